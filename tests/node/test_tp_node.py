"""`nexrt-decode --tp 2`: one process per rank (rank 0 serves HTTP and the control endpoint, rank 1
follows it over gloo), /capabilities reports the group, and hand-offs from prefill pools at TP = 1,
2 and 4 (re-sharded into the node's two shards) yield the TP = 1 engine's greedy tokens."""
import random

import pytest

from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide
from nexrt_vllm.testing.tp_sender import ShardedPrefillSide

SHAPE = dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8)
PROMPT = [random.Random(9).randrange(3, 380) for _ in range(41)]
N_TOKENS = 24


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    # fp32 end to end (checkpoint, prefill, wire, node): on a random tiny model bf16 sums of partials
    # in another order flip near-tied greedy tokens; the bf16 TP check is on the trained checkpoint
    return ckpt_factory("qwen3_next", "float32", **SHAPE)


@pytest.fixture(scope="module")
def node(ckpt):
    n = NodeProcess(ckpt, "mooncake", "--tp", "2", start_timeout=240)
    yield n
    assert n.wait_free()["busy_slots"] == 0
    n.stop()


def test_capabilities_report_the_group(node):
    status, caps = node.call("GET", "/capabilities")
    assert status == 200 and caps["graph"] == "off" and caps["handoff_parts"] is True and caps["tuning"] == {}
    tp = caps["tp"]
    assert tp["size"] == 2 and tp["backend"] == "gloo" and tp["collectives"] is None  # (no graph step)
    assert [r["shard"]["kv_heads"] for r in tp["ranks"]] == [[0, 1], [1, 2]]
    assert [r["shard"]["k_heads"] for r in tp["ranks"]] == [[0, 2], [2, 4]]
    assert [r["shard"]["v_heads"] for r in tp["ranks"]] == [[0, 4], [4, 8]]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_tp2_node_tokens_equal_tp1(ckpt, node, n):
    wire = dict(kv_dtype="float32", conv_dtype="float32")
    side = PrefillSide(ckpt, "mooncake", **wire) if n == 1 else ShardedPrefillSide(ckpt, "mooncake", n, **wire)
    try:
        ref = side.engine.generate(PROMPT, N_TOKENS, ignore_eos=True)
        prep = side.prepare(PROMPT)
        rid = f"tp2-from-{n}"
        adm = node.admit(rid)
        side.send(node, rid, adm["generation"], prep)
        tokens, final = node.generate(rid, adm["generation"], prep["first"], N_TOKENS, ignore_eos=True)
        assert [prep["first"], *tokens] == ref and final["finish_reason"] == "length"
        assert node.wait_free()["busy_slots"] == 0
    finally:
        side.close()

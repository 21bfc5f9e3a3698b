"""A hand-off from a prefill pool at TP = N arrives as N parts (one begin/pages/done per vLLM TP
rank, nexrt_vllm.testing.tp_sender): the node's admission completes only when every part is done,
re-shards the parts into its state and yields the prefill engine's own greedy tokens; a missing,
late or aborted part fails the hand-off cleanly (the stream ends with an error, 0 busy slots)."""
import json
import random

import pytest

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sender import HandoffError
from nexrt_vllm.handoff.sharding import Sharding
from nexrt_vllm.testing.node_process import NodeProcess
from nexrt_vllm.testing.tp_sender import ShardedPrefillSide, layout_for_part

# TP = 2 and 4 divide every head count; KV heads 2: at N = 4 each is shipped by one of two replicas
SHAPE = dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8)
TRANSFER_S = 3.0
PROMPT = [random.Random(4).randrange(3, 380) for _ in range(37)]  # 3 pages of 16, the last partial


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("qwen3_next", "bfloat16", **SHAPE)


@pytest.fixture(scope="module")
def node(ckpt):
    n = NodeProcess(ckpt, "mooncake", "--transfer-timeout", str(TRANSFER_S), "--quarantine", "5")
    yield n
    assert n.wait_free()["busy_slots"] == 0
    n.stop()


@pytest.fixture(scope="module")
def sides(ckpt):
    made = {n: ShardedPrefillSide(ckpt, "mooncake", n) for n in (2, 4)}
    yield made
    for s in made.values():
        s.close()


def _handoff(node, side, rid):
    """Every part, one after the other: the node is READY only after the last part's done."""
    ref = side.reference(PROMPT, 24, ignore_eos=True)
    prep = side.prepare(PROMPT)
    assert prep["first"] == ref[0]
    kv_parts = [p["layout"].sharding.kv_heads for p in prep["parts"]]
    assert sum(kv is not None for kv in kv_parts) == 2  # each KV head shipped once
    adm = node.admit(rid)
    for r in range(side.n):
        assert node.health()["state"] == ("reserved" if r == 0 else "receiving")
        side.send(node, rid, adm["generation"], prep, ranks=[r])
    assert node.health()["state"] == "ready"
    tokens, final = node.generate(rid, adm["generation"], prep["first"], 24, ignore_eos=True)
    assert [prep["first"], *tokens] == ref and final["finish_reason"] == "length"
    assert node.wait_free()["busy_slots"] == 0


@pytest.mark.parametrize("n", [2, 4])
def test_all_parts_give_the_engines_tokens(node, sides, n):
    _handoff(node, sides[n], f"tp{n}")


def test_missing_part_fails_cleanly(node, sides):
    side = sides[2]
    prep = side.prepare(PROMPT)
    adm = node.admit("tp-missing")
    side.send(node, "tp-missing", adm["generation"], prep, ranks=[0])
    assert node.health()["state"] == "receiving"
    tokens, final = node.generate("tp-missing", adm["generation"], prep["first"], 8, timeout=TRANSFER_S + 10)
    assert tokens == [] and final["finish_reason"] == "error"
    assert "part(s) [1] of 2" in final["error"] and "timeout" in final["error"]
    assert node.wait_free()["busy_slots"] == 0
    with pytest.raises(HandoffError) as ei:  # the part that comes too late is refused
        side.send(node, "tp-missing", adm["generation"], prep, ranks=[1])
    assert ei.value.reason is P.Reason.DUPLICATE


def test_late_done_fails_cleanly(node, sides):
    side = sides[2]
    prep = side.prepare(PROMPT)
    adm = node.admit("tp-late")
    side.send(node, "tp-late", adm["generation"], prep, ranks=[0])
    t = side.begin(node, "tp-late", adm["generation"], prep, 1)
    t.write_pages(prep["parts"][1]["pages"])
    _, final = node.generate("tp-late", adm["generation"], prep["first"], 8, timeout=TRANSFER_S + 10)
    assert final["finish_reason"] == "error" and node.wait_free()["busy_slots"] == 0
    with pytest.raises(HandoffError) as ei:
        t.done()
    assert ei.value.reason is P.Reason.STALE_GENERATION
    # the node serves the next hand-off (its buffer was quarantined until that late done)
    _handoff(node, sides[2], "tp-after-late")


def test_aborted_part_fails_at_once(node, sides):
    side = sides[4]
    prep = side.prepare(PROMPT)
    adm = node.admit("tp-abort")
    side.send(node, "tp-abort", adm["generation"], prep, ranks=[0, 1])
    t = side.begin(node, "tp-abort", adm["generation"], prep, 3)
    with node.open_generate("tp-abort", adm["generation"], prep["first"], 8, timeout=5) as stream:
        t.abort("rank 3 failed")  # while the generate waits for the parts
        lines = [json.loads(x) for x in stream if x.strip()]
    assert len(lines) == 1 and lines[0]["finish_reason"] == "error" and "part 3 of 4" in lines[0]["error"]
    assert node.wait_free(2)["busy_slots"] == 0
    status, _ = node.call("POST", "/v1/generate", {"rid": "tp-abort", "first_token": 1, "max_tokens": 2})
    assert status == 404


def test_inconsistent_parts_are_refused(node, sides, ckpt):
    side = sides[2]
    cfg = side.engine.config
    prep = side.prepare(PROMPT)
    # the same part twice: refused, the hand-off goes on and completes
    adm = node.admit("tp-dup")
    side.send(node, "tp-dup", adm["generation"], prep, ranks=[0])
    with pytest.raises(HandoffError) as ei:
        side.begin(node, "tp-dup", adm["generation"], prep, 0)
    assert ei.value.reason is P.Reason.DUPLICATE
    side.send(node, "tp-dup", adm["generation"], prep, ranks=[1])
    tokens, final = node.generate("tp-dup", adm["generation"], prep["first"], 4)
    assert final["finish_reason"] in ("length", "stop") and node.wait_free()["busy_slots"] == 0
    # a second part claiming KV head 0 again (and so missing head 1): refused, the admission ends
    adm = node.admit("tp-overlap")
    side.send(node, "tp-overlap", adm["generation"], prep, ranks=[0])
    s1 = prep["parts"][1]["layout"].sharding
    wrong = layout_for_part(cfg, Sharding(2, 1, (0, 1), s1.k_heads, s1.v_heads))
    with pytest.raises(HandoffError) as ei:
        side.senders[1].begin(node.control_addr, wrong, "tp-overlap", adm["generation"], prep["seq_len"])
    assert ei.value.reason is P.Reason.LAYOUT_MISMATCH and "KV head" in ei.value.message
    assert node.wait_free()["busy_slots"] == 0
    # a part whose pages do not match the heads it names: refused at hello
    bad = layout_for_part(cfg, Sharding(2, 0, (0, 2), (0, 2), (0, 4)))  # 2 KV heads claimed...
    bad = L.Layout(bad.model, bad.block_size, tuple(x if x.kind != "attention" else
                                                    L.AttentionLayout(x.index, x.dtype, (1, *x.shape[1:]), x.strides)
                                                    for x in bad.layers), sharding=bad.sharding)  # ...1 shipped
    with pytest.raises(HandoffError) as ei:
        side.senders[0].hello(node.control_addr, bad)
    assert ei.value.reason is P.Reason.LAYOUT_MISMATCH and "page shape" in ei.value.message

"""The agentic traces (nexrt_vllm/bench/agentic.py): conversations grow by the answer and a tool
result each turn, a turn's blocks extend the last turn's, the system prompt's blocks are shared by
every conversation; block contents follow their hash ids; replay order and medians."""
from nexrt_vllm.bench.agentic import block_tokens, interleaved, summarize, synthesize


def test_conversations_grow_turn_by_turn():
    t = synthesize(3, 4, first=1000, tool=200, output=30, system=256, block_size=64, seed=1)
    assert t["block_size"] == 64 and len(t["conversations"]) == 3
    firsts = []
    for c in t["conversations"]:
        reqs = c["requests"]
        assert len(reqs) == 4 and reqs[0]["input_length"] == 1000 and reqs[0]["think_time_s"] == 0.0
        assert len(reqs[0]["hash_ids"]) == -(-1000 // 64)
        for a, b in zip(reqs, reqs[1:]):
            grew = b["input_length"] - a["input_length"]
            assert 30 + 150 <= grew <= 30 + 250 and b["output_length"] == 30 and b["think_time_s"] > 0
            assert b["hash_ids"][:len(a["hash_ids"])] == a["hash_ids"] and len(b["hash_ids"]) > len(a["hash_ids"])
        firsts.append(reqs[0]["hash_ids"])
    assert all(f[:4] == [0, 1, 2, 3] for f in firsts)  # 256 shared tokens: 4 blocks in every conversation
    assert len({tuple(f[4:]) for f in firsts}) == 3
    assert synthesize(3, 4, 1000, 200, 30, system=256, seed=1) == synthesize(3, 4, 1000, 200, 30, system=256, seed=1)


def test_blocks_and_replay_order():
    a = block_tokens(7, 16, (3, 380))
    assert a == block_tokens(7, 16, (3, 380)) and len(a) == 16 and all(3 <= x < 380 for x in a)
    assert block_tokens(8, 16, (3, 380)) != a and block_tokens(7, 16, (3, 380), salt=1) != a
    t = synthesize(2, 3, 100, 50, 10, block_size=16)
    assert interleaved(t) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_summary_medians():
    rows = [{"turn": 0, "input_tokens": 100, "ttft_s": 0.1, "second_token_s": 0.2, "tpot_s": 0.01,
             "handoff_bytes": 1000, "held_tokens": 0},
            {"turn": 1, "input_tokens": 200, "ttft_s": 0.3, "second_token_s": 0.4, "tpot_s": 0.02,
             "handoff_bytes": 300, "held_tokens": 64, "queue_s": 0.001, "prefill_s": 0.25, "transfer_s": 0.01},
            {"turn": 1, "input_tokens": 220, "ttft_s": 0.5, "second_token_s": 0.6, "tpot_s": 0.04,
             "handoff_bytes": 500, "held_tokens": 128, "queue_s": 0.003, "prefill_s": 0.45, "transfer_s": None}]
    s = summarize(rows)
    assert s["by_turn"][0]["handoff_bytes"] == 1000 and s["by_turn"][1]["ttft_s"] == 0.4
    assert s["by_turn"][0]["prefill_s"] is None and s["by_turn"][1]["prefill_s"] == 0.35
    assert s["later_turns"] == {"ttft_s": 0.4, "second_token_s": 0.5, "tpot_s": 0.03, "handoff_bytes": 400,
                                "held_tokens": 96, "queue_s": 0.002, "prefill_s": 0.35, "transfer_s": 0.01}
    assert summarize([{"turn": 0, "ttft_s": 0.1}])["by_turn"][0]["handoff_bytes"] is None

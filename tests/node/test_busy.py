"""One request at a time: a second admission while the first is reserved, receiving, ready or
decoding is refused with 409 busy, and the first request's tokens are unaffected."""
import json
import random

import pytest

from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sender import HandoffError
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide


@pytest.fixture(scope="module")
def env(qwen3_next_ckpt):
    node = NodeProcess(qwen3_next_ckpt, "mooncake", max_seq_len=1024)
    side = PrefillSide(qwen3_next_ckpt, "mooncake", max_seq_len=1024)
    yield node, side
    side.close()
    assert node.wait_free()["busy_slots"] == 0
    node.stop()


def _busy(node, rid):
    status, body = node.call("POST", "/v1/admit", {"rid": rid})
    assert status == 409 and body["error"]["type"] == "busy", body


def test_second_request_refused_first_unaffected(env):
    node, side = env
    prompt = [random.Random(3).randrange(3, 300) for _ in range(30)]
    n_tok = 400
    ref = side.reference(prompt, n_tok)
    prep = side.prepare(prompt)
    adm = node.admit("first")
    _busy(node, "second-a")  # reserved
    t = side.sender.begin(node.control_addr, prep["layout"], "first", adm["generation"], prep["seq_len"])
    _busy(node, "second-b")  # receiving
    with pytest.raises(HandoffError) as ei:  # a sender for the refused rid is turned away too
        side.sender.begin(node.control_addr, prep["layout"], "second-b", adm["generation"] + 1, prep["seq_len"])
    assert ei.value.reason is P.Reason.UNKNOWN_RID
    t.write_pages(prep["pages"])
    t.done()
    _busy(node, "second-c")  # ready
    tokens = []
    with node.open_generate("first", adm["generation"], prep["first"], n_tok) as r:
        for line in r:
            msg = json.loads(line)
            if "token" in msg:
                tokens.append(msg["token"])
                if len(tokens) == 1:
                    _busy(node, "second-d")  # decoding
            else:
                final = msg
    assert [prep["first"], *tokens] == ref
    assert final["finish_reason"] in ("stop", "length")
    assert node.metric("nexrt_refusals_total", 'reason="busy"') == 4
    assert node.wait_free()["busy_slots"] == 0
    nxt = node.admit("second-e")  # free again
    assert nxt["generation"] == adm["generation"] + 1
    node.call("POST", "/v1/cancel", {"rid": "second-e"})

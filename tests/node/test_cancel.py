"""Cancel during the transfer and during the decode: the stream ends "cancelled", the slot is
freed, the late sender is told its admission is gone, and the next request decodes correctly."""
import json
import random

import pytest

from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sender import HandoffError
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide


@pytest.fixture(scope="module")
def env(qwen3_next_ckpt):
    node = NodeProcess(qwen3_next_ckpt, "mooncake", "--quarantine", "60", max_seq_len=2048)
    side = PrefillSide(qwen3_next_ckpt, "mooncake", max_seq_len=2048)
    yield node, side
    side.close()
    assert node.wait_free()["busy_slots"] == 0
    node.stop()


def test_cancel_during_transfer(env):
    node, side = env
    prompt = [random.Random(5).randrange(3, 300) for _ in range(40)]
    prep = side.prepare(prompt)
    adm = node.admit("c-xfer")
    t = side.sender.begin(node.control_addr, prep["layout"], "c-xfer", adm["generation"], prep["seq_len"])
    with node.open_generate("c-xfer", adm["generation"], prep["first"], 16) as r:  # waits for done
        status, body = node.call("POST", "/v1/cancel", {"rid": "c-xfer"})
        assert status == 200 and body == {"rid": "c-xfer", "cancelled": True, "state": "receiving"}
        lines = [json.loads(x) for x in r if x.strip()]
    assert len(lines) == 1 and lines[0]["finish_reason"] == "cancelled"
    assert node.health()["busy_slots"] == 0
    assert node.health()["free_buffers"] == 1  # the cut-off writer's buffer is quarantined
    t.write_pages(prep["pages"])  # the writer finishes into its quarantined buffer, harmlessly
    with pytest.raises(HandoffError) as ei:
        t.done()
    assert ei.value.reason is P.Reason.STALE_GENERATION
    assert node.health()["free_buffers"] == 2  # its late done released the quarantine
    # the next request is unaffected
    ref = side.reference(prompt, 33)
    adm2 = node.admit("c-after-xfer")
    side.send(node, "c-after-xfer", adm2["generation"], prep)
    tokens, final = node.generate("c-after-xfer", adm2["generation"], prep["first"], 33)
    assert [prep["first"], *tokens] == ref


def test_cancel_during_decode(env):
    node, side = env
    prompt = [random.Random(6).randrange(3, 300) for _ in range(30)]
    prep = side.prepare(prompt)
    adm = node.admit("c-dec")
    side.send(node, "c-dec", adm["generation"], prep)
    max_tokens = 1800  # far more than can be decoded before the cancel lands
    tokens, final = [], None
    with node.open_generate("c-dec", adm["generation"], prep["first"], max_tokens, ignore_eos=True) as r:
        for line in r:
            msg = json.loads(line)
            if "token" in msg:
                tokens.append(msg["token"])
                if len(tokens) == 3:
                    status, body = node.call("POST", "/v1/cancel", {"rid": "c-dec"})
                    assert status == 200 and body["cancelled"] and body["state"] == "decoding"
            else:
                final = msg
    assert final["finish_reason"] == "cancelled" and 3 <= len(tokens) < max_tokens - 1
    assert node.wait_free()["busy_slots"] == 0
    assert node.call("POST", "/v1/cancel", {"rid": "c-dec"}) == (200, {"rid": "c-dec", "cancelled": False,
                                                                       "state": "finished"})
    assert node.metric("nexrt_requests_finished_total", 'outcome="cancelled"') == 2

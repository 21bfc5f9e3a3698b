"""A second `done` for one admission is answered error{duplicate_done} and changes nothing; a done
with the wrong byte count fails the admission (never a decode from a partial state)."""
import random

import pytest

from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sender import HandoffError
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide, control_request


@pytest.fixture(scope="module")
def env(qwen3_5_moe_ckpt):
    node = NodeProcess(qwen3_5_moe_ckpt, "nixl")
    side = PrefillSide(qwen3_5_moe_ckpt, "nixl")
    yield node, side
    side.close()
    assert node.wait_free()["busy_slots"] == 0
    node.stop()


def _done(node, rid, gen, seq_len, nbytes):
    return control_request(node.control_addr, {"type": "done", "v": P.PROTOCOL_VERSION, "rid": rid,
                                               "generation": gen, "seq_len": seq_len, "nbytes": nbytes})


def test_duplicate_done(env):
    node, side = env
    prompt = [random.Random(8).randrange(3, 300) for _ in range(25)]
    ref = side.reference(prompt, 33)
    prep = side.prepare(prompt)
    adm = node.admit("dd")
    sent = side.send(node, "dd", adm["generation"], prep)
    rep = _done(node, "dd", adm["generation"], prep["seq_len"], sent.nbytes)
    assert (rep["type"], rep["reason"]) == ("error", "duplicate_done")
    assert node.health()["state"] == "ready"
    tokens, final = node.generate("dd", adm["generation"], prep["first"], 33)
    assert [prep["first"], *tokens] == ref
    rep = _done(node, "dd", adm["generation"], prep["seq_len"], sent.nbytes)  # after the request ended
    assert (rep["type"], rep["reason"]) == ("error", "duplicate_done")
    assert node.metric("nexrt_refusals_total", 'reason="duplicate_done"') == 2


def test_done_with_wrong_size_fails_the_request(env):
    node, side = env
    prep = side.prepare([random.Random(9).randrange(3, 300) for _ in range(25)])
    adm = node.admit("short")
    t = side.sender.begin(node.control_addr, prep["layout"], "short", adm["generation"], prep["seq_len"])
    first_layer = next(iter(prep["pages"]))
    t.write_pages({first_layer: prep["pages"][first_layer]})  # only one layer's pages
    with pytest.raises(HandoffError) as ei:
        t.done()
    assert ei.value.reason is P.Reason.SIZE_MISMATCH
    assert node.health()["busy_slots"] == 0
    status, body = node.call("POST", "/v1/generate", {"rid": "short", "generation": adm["generation"],
                                                      "first_token": prep["first"], "max_tokens": 4})
    assert status == 404 and body["error"]["type"] == "unknown_rid"

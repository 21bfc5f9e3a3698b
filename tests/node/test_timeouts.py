"""Every wait has a timeout: no begin after admit, no generate after done, a client that vanishes
while waiting for the transfer or mid-stream. Each frees the slot; the node stays usable."""
import json
import random
import time

import pytest

from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide

ADMIT_S, START_S = 2.0, 1.0


@pytest.fixture(scope="module")
def env(qwen3_next_ckpt):
    node = NodeProcess(qwen3_next_ckpt, "mooncake", "--admit-timeout", str(ADMIT_S), "--start-timeout",
                       str(START_S), "--transfer-timeout", "5", max_seq_len=2048)
    side = PrefillSide(qwen3_next_ckpt, "mooncake", max_seq_len=2048)
    yield node, side, side.prepare([random.Random(10).randrange(3, 300) for _ in range(20)])
    side.close()
    assert node.wait_free()["busy_slots"] == 0
    node.stop()


def _freed_within(node, lo, hi):
    t0 = time.monotonic()
    assert node.wait_free(hi + 2)["busy_slots"] == 0
    assert lo <= time.monotonic() - t0 <= hi + 2


def test_begin_never_comes(env):
    node, _, _ = env
    node.admit("t-nobegin")
    _freed_within(node, ADMIT_S - 0.3, ADMIT_S)
    assert node.metric("nexrt_requests_finished_total", 'outcome="timeout"') >= 1


def test_start_never_comes(env):
    node, side, prep = env
    adm = node.admit("t-nostart")
    side.send(node, "t-nostart", adm["generation"], prep)
    assert node.health()["state"] == "ready"
    _freed_within(node, START_S - 0.3, START_S)
    status, body = node.call("POST", "/v1/generate", {"rid": "t-nostart", "generation": adm["generation"],
                                                      "first_token": prep["first"], "max_tokens": 4})
    assert status == 404 and body["error"]["type"] == "unknown_rid"


def test_client_vanishes_while_waiting_for_transfer(env):
    node, side, prep = env
    adm = node.admit("t-gone-wait")
    t = side.sender.begin(node.control_addr, prep["layout"], "t-gone-wait", adm["generation"], prep["seq_len"])
    r = node.open_generate("t-gone-wait", adm["generation"], prep["first"], 8)
    r.close()  # the client goes away before done
    assert node.wait_free(3)["busy_slots"] == 0
    t.abort("test over")


def test_client_vanishes_mid_stream(env):
    node, side, prep = env
    adm = node.admit("t-gone-stream")
    side.send(node, "t-gone-stream", adm["generation"], prep)
    r = node.open_generate("t-gone-stream", adm["generation"], prep["first"], 1800, ignore_eos=True)
    assert "token" in json.loads(r.readline())
    r.close()
    assert node.wait_free(5)["busy_slots"] == 0
    # still serving
    adm2 = node.admit("t-after")
    side.send(node, "t-after", adm2["generation"], prep)
    tokens, final = node.generate("t-after", adm2["generation"], prep["first"], 5)
    assert len(tokens) <= 4 and final["finish_reason"] in ("stop", "length")

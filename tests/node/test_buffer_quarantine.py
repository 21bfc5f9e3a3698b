"""A receive buffer is never reused while a writer may be live: with one buffer, an admission cut
off mid-transfer blocks new admissions until the writer's late done arrives or the grace passes."""
import random
import time

import pytest

from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sender import HandoffError
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide, assert_request_matches_engine

GRACE = 1.5


def test_single_buffer_quarantine(qwen3_next_ckpt):
    node = NodeProcess(qwen3_next_ckpt, "mooncake", "--recv-buffers", "1", "--quarantine", str(GRACE))
    side = PrefillSide(qwen3_next_ckpt, "mooncake")
    try:
        prompt = [random.Random(11).randrange(3, 300) for _ in range(20)]
        prep = side.prepare(prompt)

        def cut_off(rid):
            adm = node.admit(rid)
            t = side.sender.begin(node.control_addr, prep["layout"], rid, adm["generation"], prep["seq_len"])
            assert node.call("POST", "/v1/cancel", {"rid": rid})[0] == 200
            return t

        # 1. the cut-off writer's late done releases the buffer at once
        t = cut_off("q-1")
        status, body = node.call("POST", "/v1/admit", {"rid": "q-2"})
        assert status == 409 and body["error"]["type"] == "busy" and "stale writer" in body["error"]["message"]
        t.write_pages(prep["pages"])
        with pytest.raises(HandoffError) as ei:
            t.done()
        assert ei.value.reason is P.Reason.STALE_GENERATION
        t = cut_off("q-3")  # admitted: the buffer was free again

        # 2. a writer that never reports back: the buffer returns after the grace period
        t0 = time.monotonic()
        while node.call("POST", "/v1/admit", {"rid": "q-4"})[0] == 409:
            assert time.monotonic() - t0 < GRACE + 3
            time.sleep(0.1)
        assert time.monotonic() - t0 > GRACE - 0.5
        node.call("POST", "/v1/cancel", {"rid": "q-4"})  # reserved only: no writer, no quarantine

        assert_request_matches_engine(node, side, "q-5", prompt, prep, 17)
    finally:
        side.close()
        node.stop()

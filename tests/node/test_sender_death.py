"""A sender that dies mid-transfer: the waiting generate ends with finish_reason "error" after the
transfer timeout, the slot is freed, and the next request succeeds with correct tokens."""
import json
import os
import random
import subprocess
import sys
import time

import pytest

from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide, assert_request_matches_engine

TRANSFER_TIMEOUT = 2.0

# Child: the connector side of a prefill worker that crashes after writing one layer's pages
# (no torch import, so it starts fast).
CHILD = r"""
import json, os, sys
import numpy as np
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff.sender import HandoffSender
transport, addr, rid, gen, seq_len, layout = sys.argv[1:7]
src = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
s = HandoffSender(transport)
s.register(src.ctypes.data, src.nbytes)
t = s.begin(addr, L.Layout.from_wire(json.loads(layout)), rid, int(gen), int(seq_len))
first = next(iter(t.regions.values()))
t.write([(src.ctypes.data, first.offset, first.page_bytes)])
print("wrote", flush=True)
os._exit(3)
"""

@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_sender_dies_mid_transfer(qwen3_next_ckpt, transport):
    node = NodeProcess(qwen3_next_ckpt, transport, "--transfer-timeout", str(TRANSFER_TIMEOUT))
    side = PrefillSide(qwen3_next_ckpt, transport)
    try:
        prompt = [random.Random(4).randrange(3, 300) for _ in range(20)]
        prep = side.prepare(prompt)
        adm = node.admit("doomed")
        # the router's generate is already waiting when the sender dies
        with node.open_generate("doomed", adm["generation"], prep["first"], 8) as stream:
            child = subprocess.run([sys.executable, "-c", CHILD, transport, node.control_addr, "doomed",
                                    str(adm["generation"]), str(prep["seq_len"]), json.dumps(prep["layout"].to_wire())],
                                   capture_output=True, timeout=60, env=dict(os.environ, UCX_NET_DEVICES="lo"))
            t_dead = time.monotonic()
            assert child.returncode == 3 and b"wrote" in child.stdout, child.stderr[-2000:]
            lines = [json.loads(x) for x in stream if x.strip()]
        assert len(lines) == 1 and lines[0]["finish_reason"] == "error", lines
        assert lines[0]["error"].startswith("timeout: no done")
        assert time.monotonic() - t_dead < TRANSFER_TIMEOUT + 3.0
        assert node.health()["busy_slots"] == 0
        assert node.metric("nexrt_requests_finished_total", 'outcome="timeout"') == 1

        assert_request_matches_engine(node, side, "next", prompt, prep, 33)
    finally:
        side.close()
        node.stop()

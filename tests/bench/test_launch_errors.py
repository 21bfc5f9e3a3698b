"""A child server that dies names its cause: `Procs.check` raises with the log's first error lines (a
vLLM engine core's root cause, logged far above the API server's closing traceback) and its last lines."""
import sys
import time

import pytest

from nexrt_vllm.launch import Procs, error_lines

LOG = """INFO starting
(EngineCore pid=7) ERROR core.py: EngineCore failed to start.
(EngineCore pid=7) ValueError: Free memory on device (10.1/139.8 GiB) is less than desired (35.0 GiB).
  File "/x/core.py", line 10, in run
    raise ValueError("x")
""" + "".join(f"(APIServer) traceback line {i}\n" for i in range(40)) + \
    "RuntimeError: Engine core initialization failed. See root cause above.\n"


def test_error_lines_finds_the_root_cause_above_the_tail(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(LOG)
    got = error_lines(str(log)).splitlines()
    assert got[0].endswith("EngineCore failed to start.") and "Free memory on device" in got[1]
    assert got[-1].startswith("RuntimeError: Engine core initialization failed")
    assert not any(x.startswith(("File ", "raise ")) for x in got)
    assert error_lines(str(tmp_path / "missing.log")) == ""


def test_a_dead_child_raises_with_its_cause(tmp_path):
    procs = Procs(str(tmp_path))
    try:
        p = procs.start("server", [sys.executable, "-c", f"print({LOG!r}); raise SystemExit(3)"])
        deadline = time.monotonic() + 30
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError) as e:
            procs.check()
        msg = str(e.value)
        assert "server exited with code 3" in msg and "Free memory on device" in msg
        assert msg.index("Free memory on device") < msg.index("last lines of")
    finally:
        procs.stop()

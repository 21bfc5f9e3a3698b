"""`nexrt-vllm demo` on this CPU box: one command makes a tiny checkpoint, starts vLLM with the
connector, a decode node and the router, streams a chat reply through the interactive path,
prints TTFT and tokens/s per stage, and leaves no process behind — also when interrupted."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest


def processes_of(run_dir):
    """PIDs whose environment carries the demo's NEXRT_RUN_DIR marker."""
    marker = f"NEXRT_RUN_DIR={run_dir}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def run_dir_of(text):
    m = re.search(r"logs in (\S+)", text)
    assert m, text
    return m.group(1)


def test_demo_end_to_end(ckpt_factory):
    """A checkpoint with an MTP head is served with MTP rounds (the product's mode for it)."""
    from nexrt_vllm.testing.connector_harness import TRAINED_MTP

    ckpt = ckpt_factory("qwen3_next", "bfloat16", **TRAINED_MTP["qwen3_next"])
    r = subprocess.run([sys.executable, "-m", "nexrt_vllm.demo.cli", "demo", "--model", ckpt,
                        "--max-tokens", "24"], capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "MTP, 3 drafts per round" in out, out
    assert "assistant> " in out
    m = re.search(r"prompt tokens (\d+), completion tokens (\d+)", out)
    assert m and int(m.group(2)) == 24, out
    for stage in ("client  TTFT", "vLLM    prefill", "node    KV/state hand-off", "node    decode"):
        assert stage in out, out
    assert re.search(r"node    decode .* \(\d+\.\d tok/s, 23 tokens\)", out), out
    assert processes_of(run_dir_of(out)) == []


def test_demo_ctrl_c_shuts_everything_down():
    p = subprocess.Popen([sys.executable, "-m", "nexrt_vllm.demo.cli", "demo", "--max-tokens", "8"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while not any("starting vLLM" in ln for ln in lines):
            assert time.monotonic() < deadline and p.poll() is None, "".join(lines)
            lines.append(p.stdout.readline())
        run_dir = run_dir_of("".join(lines))
        while len(processes_of(run_dir)) < 2:        # vLLM and the node are up and running
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=60)
    except BaseException:
        p.kill()
        raise
    assert p.returncode == 130, "".join(lines) + rest
    assert "interrupted" in rest and "shutting down" in rest
    assert processes_of(run_dir) == []


STUBBORN = """
import asyncio, os, signal, sys
from nexrt_vllm.demo.cli import _until_interrupted

async def stubborn():
    asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGINT)
    swallowed = 0
    while True:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:     # the first cancellation is retried, as a timed-out wait is
            swallowed += 1
            if swallowed > 1:
                raise

try:
    asyncio.run(_until_interrupted(stubborn()))
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_ctrl_c_ends_the_demo_when_a_wait_swallows_the_cancellation():
    r = subprocess.run([sys.executable, "-c", STUBBORN], capture_output=True, text=True, timeout=60)
    assert r.returncode == 130, r.stdout + r.stderr

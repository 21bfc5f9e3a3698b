"""Start, wait for and stop the processes of a NexRT stack — vLLM with the NexRT connector, decode
nodes, routers — for the demo, the benchmarks and the tests.

    procs = Procs(logdir)
    procs.start("vllm", vllm_argv(model, vport, 2048, "mooncake"))
    procs.start("node", node_argv(model, ready_file, max_seq_len=2048))
    node = await wait_file(ready_file, procs, 300, "decode node")     # {"url": ...}
    await wait_http(f"http://127.0.0.1:{vport}/health", procs, 600, "vLLM")
    procs.start("router", router_argv(rport, vllm_url, [node["url"]], model))
    ...
    procs.stop()                                                      # bounded: SIGTERM, then SIGKILL

Every wait is bounded and fails early, with the log's tail, when a child exits. Imports neither
torch nor vLLM (``resolve_device`` asks torch when called).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may take it before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Child processes, each in its own session so that the whole tree (vLLM's engine core
    included) can be stopped, whatever way the run ends."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen, str]] = []

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = os.path.join(self.logdir, f"{name}.log")
        with open(log, "wb") as f:
            # NEXRT_RUN_DIR marks the whole tree (grandchildren inherit it) for operators/tests.
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, **(env or {}), "NEXRT_RUN_DIR": self.logdir})
        self.procs.append((name, p, log))
        return p

    def end(self, p: subprocess.Popen, timeout: float = 30.0) -> None:
        """Stop one child (SIGTERM to its session, SIGKILL after `timeout`) and forget it: a process
        restarted on purpose does not count as one that died (`check`)."""
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.procs = [x for x in self.procs if x[1] is not p]

    def check(self) -> None:
        for name, p, log in self.procs:
            if p.poll() is not None:
                first = error_lines(log)
                raise RuntimeError(f"{name} exited with code {p.returncode}; "
                                   + (f"its first error lines:\n{first}" if first else "")
                                   + f"last lines of {log}:\n" + tail_log(log))

    def stop(self, timeout: float = 20.0) -> None:
        for _, p, _ in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, p, _ in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
            # Leftover grandchildren (vLLM's engine core) die with the session.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def tail_log(path: str, n: int = 30) -> str:
    """The last n lines of a log file (for error messages)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def error_lines(path: str, n: int = 8) -> str:
    """The first n distinct lines of a log that name an error or exception (or are logged at ERROR), not
    traceback frames: a server whose child process failed (vLLM's engine core) logs the cause there, far
    above the parent's closing traceback that the last lines show."""
    out: list[str] = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                s = line.strip()
                named = "Error" in s or "Exception" in s or " ERROR " in s
                if named and not s.startswith(("File ", "raise ", "^")) and s not in out:
                    out.append(s)
                    if len(out) == n:
                        break
    except OSError:
        return ""
    return "".join(x + "\n" for x in out)


def kv_transfer_config(transport: str) -> dict:
    return {"kv_connector": "NexRTConnector", "kv_connector_module_path": "nexrt_vllm.connector",
            "kv_role": "kv_producer", "kv_connector_extra_config": {"transport": transport}}


def vllm_argv(model: str, port: int, max_model_len: int, transport: str | None, device: str = "cpu",
              gpu_share: float = 0.3, extra: list[str] | None = None) -> list[str]:
    """The vLLM prefill server, with the connector unless `transport` is None.

    CPU: small fixed KV memory, 4 sequences at a time, eager. GPU: vLLM's own sequence limit (a
    benchmark's baseline at concurrency 8 must not queue half its requests), a bounded share of the
    GPU's memory (the decode node shares the GPU), CUDA graphs on, and the Triton GDN prefill kernels
    (vLLM's SM90 default, FlashInfer, is often not installed)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
            "--uvicorn-log-level", "warning"]
    if device == "cpu":
        argv += ["--max-num-seqs", "4", "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager"]
    else:
        argv += ["--gpu-memory-utilization", str(gpu_share), "--gdn-prefill-backend", "triton"]
    if transport is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(transport))]
    return argv + list(extra or [])



def node_argv(model: str, ready_file: str, *, max_seq_len: int, port: int = 0, transport: str | None = None,
              device: str | None = None, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """A decode node (``nexrt-decode``); it writes ``{"url": ...}`` to ``ready_file`` once it serves
    (port 0: the OS picks one). ``transport`` / ``device`` None: the node's defaults."""
    argv = [sys.executable, "-m", "nexrt_vllm.node.server", "--model", model]
    if device is not None:
        argv += ["--device", device]
    argv += ["--port", str(port)]
    if transport is not None:
        argv += ["--transport", transport]
    return argv + ["--max-seq-len", str(max_seq_len), "--ready-file", ready_file, *extra]


def router_argv(port: int, vllm_url: str, decode_urls: list[str], tokenizer: str, *,
                default_class: str | None = "interactive", extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """A router in front of ``vllm_url`` and the decode nodes; ``default_class`` is the class of a
    request that names none (None: the router's default)."""
    argv = [sys.executable, "-m", "nexrt_vllm.router.server", "--port", str(port), "--vllm-url", vllm_url]
    for url in decode_urls:
        argv += ["--decode-url", url]
    if default_class is not None:
        argv += ["--default-class", default_class]
    return argv + ["--tokenizer", tokenizer, *extra]

def resolve_device(device: str) -> str:
    """`auto` -> cuda when torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


async def wait_http(url: str, procs: Procs, timeout: float, what: str) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            procs.check()
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout:g}s")
            await asyncio.sleep(0.5)


async def wait_file(path: str, procs: Procs, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        procs.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:g}s")
        await asyncio.sleep(0.2)
    with open(path) as f:
        return json.load(f)

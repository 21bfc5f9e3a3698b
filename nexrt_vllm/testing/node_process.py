"""Helpers for tests that run a real `nexrt-decode` process and play the prefill side.

`NodeProcess` starts the console script on free ports and waits for its ready file; `PrefillSide`
prefills a prompt with the engine, packs the state into a vLLM-like paged cache and sends it with
`nexrt_vllm.handoff.sender.HandoffSender` (the helper the connector uses).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import torch

from nexrt_vllm.handoff.contracts import AdmitReply, AdmitRequest, GenerateRequest, Sampling


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, and SIGKILL if the process has not exited after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class NodeProcess:
    def __init__(self, model: str, transport: str = "mooncake", *extra: str, max_seq_len: int = 512,
                 start_timeout: float = 90.0):
        self.dir = tempfile.mkdtemp(prefix="nexrt-node-")
        ready = os.path.join(self.dir, "ready.json")
        self.log_path = os.path.join(self.dir, "node.log")
        exe = shutil.which("nexrt-decode")
        cmd = [exe] if exe else [sys.executable, "-m", "nexrt_vllm.node.server"]
        cmd += ["--model", model, "--port", "0", "--transport", transport, "--max-seq-len", str(max_seq_len),
                "--ready-file", ready, *extra]
        env = dict(os.environ, NEXRT_THREADS="1", UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + start_timeout
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(keep_log=True)
                raise RuntimeError(f"nexrt-decode did not start:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        with open(ready) as f:
            info = json.load(f)
        self.url, self.control_addr = info["url"], info["control_addr"]

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, keep_log: bool = False) -> None:
        stop_process(self.proc)
        self._log.close()
        if not keep_log:  # a node that did not start keeps its log for the error message
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---- HTTP ---------------------------------------------------------------------------------------
    def call(self, method: str, path: str, body=None, timeout: float = 10.0) -> tuple[int, dict | str]:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw.decode()

    def admit(self, rid: str, prompt_len: int | None = None, structured: dict | None = None) -> dict:
        """The node's admit reply as JSON (tests read its fields)."""
        status, body = self.call("POST", "/v1/admit", AdmitRequest(rid, prompt_len, structured).to_wire())
        assert status == 200, body
        return AdmitReply.from_wire(body).to_wire()

    def open_generate(self, rid: str, generation: int, first_token: int, max_tokens: int, timeout: float = 30.0,
                      logprobs: int | None = None, structured: dict | None = None, **sampling):
        """Start /v1/generate; returns the open response (iterate lines) — or raises HTTPError."""
        body = GenerateRequest(rid, first_token, max_tokens, generation, Sampling(**sampling), logprobs,
                               structured).to_wire()
        req = urllib.request.Request(self.url + "/v1/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=timeout)

    def generate(self, *args, **kw) -> tuple[list[int], dict]:
        """Tokens and the final line of a whole /v1/generate stream."""
        with self.open_generate(*args, **kw) as r:
            lines = [json.loads(line) for line in r if line.strip()]
        assert "finish_reason" in lines[-1] and all("token" in x for x in lines[:-1]), lines
        return [x["token"] for x in lines[:-1]], lines[-1]

    def health(self) -> dict:
        return self.call("GET", "/health")[1]

    def wait_free(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["busy_slots"] == 0 or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def metric(self, name: str, labels: str = "") -> float:
        text = self.call("GET", "/metrics")[1]
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0


class PrefillSide:
    """Prefill with the NexRT engine, expose the state as vLLM-like pages, send it to a node."""

    def __init__(self, model: str, transport: str, *, max_seq_len: int = 512, block_size: int = 16, **layout_kw):
        from nexrt_vllm.engine import Engine
        from nexrt_vllm.handoff.sender import HandoffSender

        torch.set_num_threads(1)
        self.engine = Engine.from_pretrained(model, max_seq_len=max_seq_len)
        self.block_size, self.layout_kw = block_size, layout_kw
        self.sender = HandoffSender(transport, control_timeout=5.0, transfer_timeout=10.0)
        self._caches = []  # keep every registered cache alive as long as the sender

    def prepare(self, prompt: list[int]) -> dict:
        """Prefill `prompt`; returns first token, seq_len, layout and the page addresses to send."""
        from nexrt_vllm.testing.senders import layout_for, pack_state

        first = int(self.engine.prefill(prompt).argmax())
        n, state = self.engine.export_state()
        layout = layout_for(self.engine.config, block_size=self.block_size, **self.layout_kw)
        cache, pages = pack_state(state, n, layout)
        self.sender.register(cache.data_ptr(), cache.numel())
        self._caches.append(cache)
        base = cache.data_ptr()
        return {"first": first, "seq_len": n, "layout": layout, "ids": list(prompt),
                "pages": {layer: [base + off for off in offs] for layer, offs in pages.items()}}

    def reference(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return self.engine.generate(prompt, max_new_tokens)

    def send(self, node: NodeProcess, rid: str, generation: int, prep: dict):
        """The hand-off, with the prompt's ids (a node with a context cache may hold some)."""
        from nexrt_vllm.handoff.prefix import pack_ids

        return self.sender.send(node.control_addr, prep["layout"], rid, generation, prep["seq_len"], prep["pages"],
                                pack_ids(prep["ids"]))

    def close(self) -> None:
        self.sender.close()


def assert_request_matches_engine(node: NodeProcess, side: PrefillSide, rid: str, prompt: list[int], prep: dict,
                                  max_tokens: int) -> None:
    """A whole request (admit, hand-off of `prep`, generate) yields the prefill engine's own greedy
    continuation of `prompt`, and the node's slot is free afterwards."""
    ref = side.reference(prompt, max_tokens)
    adm = node.admit(rid)
    side.send(node, rid, adm["generation"], prep)
    tokens, _ = node.generate(rid, adm["generation"], prep["first"], max_tokens)
    got = [prep["first"], *tokens]
    assert got == ref, f"node tokens {got} != engine tokens {ref}"
    health = node.wait_free()
    assert health["busy_slots"] == 0, health


def control_request(control_addr: str, message: dict | bytes, timeout: float = 5.0) -> dict:
    """One raw REQ/REP round trip with the node's control endpoint (for malformed/foreign messages)."""
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control_addr)
        sock.send(message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True))
        assert sock.poll(int(timeout * 1000)), "node did not answer"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(linger=0)

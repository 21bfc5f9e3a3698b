"""vLLM (offline ``LLM``) in a subprocess, driven by JSON lines: the connector tests' prefill side.

Child: ``python nexrt_vllm/testing/connector_harness.py '<config json>'`` reads one command per stdin line and
answers one ``@@`` + JSON line on stdout (vLLM's own logs go to stderr/stdout around it):

- ``{"op": "generate", "requests": [{"prompt_token_ids", "max_tokens", "kv_transfer_params"?, "sampling"?}]}``
  -> ``{"outputs": [{"token_ids", "finish_reason", "kv_transfer_params", "logprobs"}]}``, all requests
  in one ``generate`` call (so they share batches); greedy with ``ignore_eos`` unless ``sampling``
  (more ``SamplingParams`` fields; ``structured_outputs`` as a dict of ``StructuredOutputsParams``)
  says otherwise; ``logprobs``: per token ``[[id, logprob, rank], ...]`` when requested, else null;
- ``{"op": "settle", "timeout": s}``: steps the engine until no connector work is pending (held
  blocks released), -> ``{"free_blocks": n, "pending": bool}``;
- ``{"op": "free_blocks"}`` -> ``{"free_blocks": n}``;
- ``{"op": "layout"}`` -> ``{"layout": the connector's page layout, Layout.to_wire()}``;
- ``{"op": "metrics", "prefix"}`` -> vLLM's own metrics whose names start with ``prefix`` (with
  ``llm_kwargs`` ``disable_log_stats: false``);
- ``{"op": "abort_midway", "request_id", "request", "steps"}``: add, step ``steps`` times, abort;
- ``{"op": "preempt_midway", ...}``: same, but preempt instead and run the request to its end.

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the scheduler's block
pool can be read. Parent: ``VLLMProc``.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import torch

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.contracts import AdmitReply, AdmitRequest, Claim, GenerateRequest, Sampling
from nexrt_vllm.handoff.transport import make_receiver
from nexrt_vllm.testing.control_peer import ControlPeer
from nexrt_vllm.testing.recipes import TRAINED, TRAINED_MTP, period_continuation, periodic_prompt  # noqa: F401
from nexrt_vllm.testing.node_process import stop_process

MARK = "@@"


def _add_and_step(llm, cmd: dict) -> None:
    """Add one greedy request to the engine and run ``cmd["steps"]`` engine steps."""
    from vllm import SamplingParams

    r = cmd["request"]
    sp = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0,
                        extra_args={"kv_transfer_params": r["kv_transfer_params"]})
    llm.llm_engine.add_request(cmd["request_id"], {"prompt_token_ids": r["prompt_token_ids"]}, sp)
    for _ in range(cmd["steps"]):
        llm.llm_engine.step()


def _child(cfg: dict) -> None:
    import torch
    from vllm import LLM, SamplingParams

    torch.set_num_threads(1)
    kw = dict(model=cfg["model"], dtype=cfg.get("dtype", "bfloat16"), max_model_len=cfg.get("max_model_len", 4096),
              enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=cfg.get("kv_bytes", 64 << 20),
              max_num_batched_tokens=cfg.get("max_num_batched_tokens", 512), max_num_seqs=cfg.get("max_num_seqs", 8))
    kw.update(cfg.get("llm_kwargs", {}))
    if cfg.get("kv_transfer_config"):
        kw["kv_transfer_config"] = cfg["kv_transfer_config"]
    llm = LLM(**kw)
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler

    def free_blocks() -> int:
        return sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def reply(obj) -> None:
        sys.stdout.write(MARK + json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True, "free_blocks": free_blocks()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "generate":
            reqs = cmd["requests"]
            sps = []
            for r in reqs:
                extra = {"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None
                kw = {"temperature": 0.0, "ignore_eos": True, **r.get("sampling", {})}
                if kw.get("structured_outputs") is not None:
                    from vllm.sampling_params import StructuredOutputsParams
                    kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
                sps.append(SamplingParams(max_tokens=r["max_tokens"], extra_args=extra, **kw))
            outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], sps, use_tqdm=False)
            reply({"outputs": [{"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
                                "kv_transfer_params": o.kv_transfer_params,
                                "logprobs": None if o.outputs[0].logprobs is None else
                                [[[t, lp.logprob, lp.rank] for t, lp in pos.items()] for pos in o.outputs[0].logprobs]}
                               for o in outs]})
        elif op == "abort_midway":
            # Abort a request after ``steps`` engine steps (mid chunked prefill), as a client
            # disconnect would.
            _add_and_step(llm, cmd)
            llm.llm_engine.abort_request([cmd["request_id"]])
            reply({"aborted": True})
        elif op == "preempt_midway":
            # Run ``steps`` engine steps, then preempt every running request (vLLM's own
            # reset_prefix_cache(reset_running_requests=True)): they recompute into new blocks.
            _add_and_step(llm, cmd)
            assert llm.reset_prefix_cache(reset_running_requests=True)
            done = None
            while done is None:
                done = next((o for o in llm.llm_engine.step() if o.finished), None)
            reply({"token_ids": list(done.outputs[0].token_ids), "kv_transfer_params": done.kv_transfer_params})
        elif op == "settle":
            deadline = time.monotonic() + cmd.get("timeout", 30)
            # Offline LLM only steps while requests are unfinished; held blocks are released by
            # further steps (vLLM's server loop does this itself via has_pending_push_work).
            while sched.has_requests() and time.monotonic() < deadline:
                core.step()
                time.sleep(0.01)
            reply({"free_blocks": free_blocks(), "pending": sched.has_requests()})
        elif op == "free_blocks":
            reply({"free_blocks": free_blocks()})
        elif op == "layout":
            from vllm.distributed.kv_transfer import get_kv_transfer_group
            reply({"layout": get_kv_transfer_group().layout.to_wire()})
        elif op == "metrics":  # needs llm_kwargs disable_log_stats=False
            reply({m.name: getattr(m, "values", None) or getattr(m, "value", None)
                   for m in llm.get_metrics() if m.name.startswith(cmd.get("prefix", ""))})
        elif op == "exit":
            reply({"bye": True})
            return


class VLLMProc:
    """Parent side: start the child, send commands, read answers with deadlines, kill on close."""

    def __init__(self, cfg: dict, log_path: str, start_timeout: float = 300, env: dict | None = None):
        # the child runs this file as a script: its sys.path starts here, so the package it and vLLM
        # import (the connector) must be named, or an installed copy elsewhere would be taken
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1",
                   TOKENIZERS_PARALLELISM="false", UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"),
                   PYTHONPATH=path, **(env or {}))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self.ready = self._read(start_timeout)
        except BaseException:
            self.close()
            raise

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._q.put(json.loads(line[len(MARK):]))
            elif not self._log.closed:
                self._log.write(line)
                self._log.flush()
        self._q.put(None)

    def _read(self, timeout: float) -> dict:
        try:
            msg = self._q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"vLLM harness gave no answer in {timeout}s (log: {self._log.name})") from None
        if msg is None:
            raise RuntimeError(f"vLLM harness exited with {self.proc.wait(5)} (log: {self._log.name})")
        return msg

    def call(self, cmd: dict, timeout: float = 300) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def generate(self, requests: list[dict], timeout: float = 300) -> list[dict]:
        return self.call({"op": "generate", "requests": requests}, timeout)["outputs"]

    def close(self) -> None:
        if self.proc.poll() is None and hasattr(self, "ready"):  # started: ask it to exit cleanly
            try:
                self.call({"op": "exit"}, timeout=20)
                self.proc.wait(20)
            except Exception:  # noqa: BLE001 - fall through to kill
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def vllm_with_node(ckpt: str, d, transport: str, kv_transfer_config: dict):
    """Module-fixture body: one fp32 `nexrt-decode` node + one vLLM with `kv_transfer_config`;
    yields (vllm, node) and closes both, also when either fails to start."""
    node = vllm = None
    try:
        node = NodeProc(ckpt, transport, str(d / "node.log"), str(d), extra_args=("--dtype", "float32"))
        vllm = VLLMProc({"model": ckpt, "max_num_batched_tokens": 512, "kv_transfer_config": kv_transfer_config},
                        str(d / "vllm.log"))
        yield vllm, node
    finally:
        for p in (vllm, node):
            if p is not None:
                p.close()


def nexrt_kv_config(transport: str, **extra) -> dict:
    return {"kv_connector": "NexRTConnector", "kv_connector_module_path": "nexrt_vllm.connector",
            "kv_role": "kv_producer", "kv_connector_extra_config": {"transport": transport, **extra}}


def vllm_greedy(vllm: "VLLMProc", prompt: list[int], n: int) -> list[int]:
    """vLLM-only greedy: the same prompt as an ordinary (unclaimed) request, n tokens."""
    (out,) = vllm.generate([{"prompt_token_ids": prompt, "max_tokens": n}])
    assert "nexrt" not in (out["kv_transfer_params"] or {}), out  # not claimed: vLLM alone generated it
    return out["token_ids"]


def hand_off(vllm: "VLLMProc", pairs) -> list[tuple[dict, dict]]:
    """pairs: [(node, rid, prompt)], admitted, then prefilled in ONE vLLM generate call with
    max_tokens=1 -> [(claim, vLLM output)]."""
    claims = [node.admit(rid, len(p)) for node, rid, p in pairs]
    outs = vllm.generate([{"prompt_token_ids": p, "max_tokens": 1, "kv_transfer_params": c}
                          for c, (_, _, p) in zip(claims, pairs)])
    return list(zip(claims, outs))


def continue_on_node(node: "NodeProc", claim: dict, out: dict, max_tokens: int) -> list[int]:
    """vLLM's first token + the node's continuation (``max_tokens`` in all)."""
    status, toks, last = node.generate(claim, out["token_ids"][0], max_tokens)
    assert status == 200 and last.get("finish_reason") == "length", (status, last)
    return out["token_ids"] + toks


def assert_vllm_greedy(vllm: "VLLMProc", prompt: list[int], full: list[int]) -> None:
    """vLLM's first token + the node's continuation == vLLM-only greedy generation, token for token."""
    ref = vllm_greedy(vllm, prompt, len(full))
    j = next((i for i, (a, b) in enumerate(zip(full, ref)) if a != b), None)
    assert full == ref, f"first difference at token {j}: hand-off {full[j:j + 4]} vs vLLM-only {ref[j:j + 4]}"


class RecordingReceiver(ControlPeer):
    """A double of the node's control plane made of the node's own pieces (protocol, transport
    receiver, region plan): accepts every begin into its own slice of one registered buffer (host,
    or GPU memory with ``device``) and records what arrived. ``unregistered=True`` hands out a
    buffer the transport never registered, so every page write fails (a transfer error)."""

    def __init__(self, size=64 << 20, unregistered=False, transport="mooncake", device=None):
        self.unregistered = unregistered
        self.buf = torch.zeros(size, dtype=torch.uint8, device=device)  # device: a GPU receive buffer
        self.rx = make_receiver(transport)
        self.rx.register(self.buf.data_ptr(), size, "device" if self.buf.is_cuda else "host",
                         self.buf.device.index or 0)
        self.begun, self.done, self.aborted, self._next = {}, {}, {}, 0
        super().__init__({"hello": lambda m: P.HelloOk(self.rx.peer_info(), {}), "begin": self._begin,
                          "done": self._done, "abort": self._abort})

    def _begin(self, m: P.Begin) -> P.Accept:
        layout = L.Layout.from_wire(m.layout)
        regions = layout.regions(m.seq_len)
        size = P.align_up(max(r.offset + r.nbytes for r in regions))
        self.begun[m.rid] = (self._next, size, layout, regions, m.seq_len)
        base = self.buf.data_ptr() + self._next + (size + (64 << 20) if self.unregistered else 0)
        self._next += size
        return P.Accept(m.rid, m.generation, {"base": base, "size": size}, P.region_dicts(regions), 30.0)

    def _done(self, m: P.Done) -> P.Ack:
        self.done[m.rid] = m.nbytes
        return P.Ack(m.rid, m.generation)

    def _abort(self, m: P.Abort) -> P.Ack:
        self.aborted[m.rid] = m.reason
        return P.Ack(m.rid, m.generation)

    def close(self):
        super().close()
        self.rx.close()


class NodeProc:
    """A real ``nexrt-decode`` process (HTTP on a free port), killed on close."""

    def __init__(self, model: str, transport: str, log_path: str, tmp_dir: str, start_timeout: float = 120,
                 extra_args: tuple[str, ...] = ()):
        ready = os.path.join(tmp_dir, f"node-{os.getpid()}-{id(self)}.url")
        env = dict(os.environ, OMP_NUM_THREADS="1", NEXRT_THREADS="1",
                   UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "nexrt_vllm.node.server", "--model", model,
                                      "--port", "0", "--transport", transport, "--ready-file", ready,
                                      "--max-seq-len", "4096", *extra_args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + start_timeout
        while not (os.path.exists(ready) and open(ready).read().strip()):
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"nexrt-decode exited with {self.proc.returncode} (log: {log_path})")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"nexrt-decode not ready in {start_timeout}s (log: {log_path})")
            time.sleep(0.2)
        self.url = json.loads(open(ready).read())["url"]

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, bytes]:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def admit(self, rid: str, prompt_len: int) -> dict:
        """Admit ``rid``; returns the ``kv_transfer_params`` the router would send vLLM."""
        status, body = self.post("/v1/admit", AdmitRequest(rid, prompt_len).to_wire())
        assert status == 200, (status, body)
        a = AdmitReply.from_wire(json.loads(body))
        return Claim(a.rid, a.generation, a.control_addr, self.url).to_params()

    def generate(self, claim: dict, first_token: int, max_tokens: int) -> tuple[int, list[int], dict]:
        """Greedy, EOS ignored -> (HTTP status, streamed tokens, final line)."""
        c = Claim.from_params(claim)
        req = GenerateRequest(c.rid, first_token, max_tokens, c.generation, Sampling(ignore_eos=True))
        status, body = self.post("/v1/generate", req.to_wire())
        if status != 200:
            return status, [], json.loads(body)
        lines = [json.loads(x) for x in body.splitlines() if x.strip()]
        return status, [x["token"] for x in lines if "token" in x], lines[-1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))

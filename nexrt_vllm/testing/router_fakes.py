"""Test doubles of the router's external peers (vLLM prefill server, decode nodes), plus a helper
that runs aiohttp apps on an event loop in a background thread so that tests can use ordinary
blocking clients (the `openai` package, threads) against them.

The fakes speak the real contracts (docs/ARCHITECTURE.md §2): vLLM's one-token response with
`token_ids`/`prompt_token_ids`, the node's admit / NDJSON generate / cancel / health API. Their
"model" is a fixed deterministic continuation of the prompt, so expected text is computable.
The real peers are exercised by tests/router/test_fullpath.py.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import web
from tokenizers import Tokenizer

from nexrt_vllm.handoff.contracts import (AdmissionState, AdmitReply, AdmitRequest, CancelReply, CancelRequest,
                                          Claim, GenerateRequest, HandoffReport, ProbeReply, Refusal, is_probe)
from nexrt_vllm.handoff.protocol import Reason
from nexrt_vllm.testing import make_tokenizer


class Loop:
    """An asyncio loop in a daemon thread; `serve(app)` returns the URL it listens on."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: web.Application, port: int = 0) -> str:
        async def go():
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", port)
            await site.start()
            self.runners.append(runner)
            return runner, runner.addresses[0][1]
        runner, port = self.call(go())
        return f"http://127.0.0.1:{port}"

    def stop_app(self, url: str) -> None:
        """Stop one served app: its port refuses connections afterwards, open streams break."""
        port = int(url.rsplit(":", 1)[1])
        for r in list(self.runners):
            if r.addresses and r.addresses[0][1] == port:
                self.runners.remove(r)
                self.call(r.cleanup())

    def close(self) -> None:
        for r in reversed(self.runners):
            self.call(r.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Model:
    """The fakes' shared 'model': a deterministic continuation of the prompt, over word tokens."""

    def __init__(self, tokenizer_dir: str):
        self.tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
        vocab = self.tok.get_vocab()
        self.eos = vocab["<|im_end|>"]
        self.words = sorted(i for t, i in vocab.items() if t.startswith("▁") and len(t) > 2)
        self.eos_at: int | None = None    # position (0 = first token) at which EOS is produced
        # A scripted output: every request's continuation is these ids (from the first token on,
        # whatever the prompt); end it with EOS to stop there.
        self.script: list[int] | None = None

    def prompt_ids(self, body: dict) -> list[int]:
        if "messages" in body:
            text = " ".join(str(m.get("content", "")) for m in body["messages"])
        else:
            p = body["prompt"]
            p = p[0] if isinstance(p, list) and p and not isinstance(p[0], int) else p
            if isinstance(p, list):
                return list(p)
            text = p
        return self.tok.encode(text).ids

    def continuation(self, prompt_ids: list[int], n: int, ignore_eos: bool = False) -> list[int]:
        """Each token a function of the whole context before it, so continuing prompt + k
        generated tokens gives the rest of the same continuation (as a real model does)."""
        if self.script is not None:
            return list(self.script[:n])
        out, ctx = [], list(prompt_ids)
        for i in range(n):
            if self.eos_at == i and not ignore_eos:
                out.append(self.eos)
                break
            t = self.words[(sum(ctx) + 7 * len(ctx)) % len(self.words)]
            out.append(t)
            ctx.append(t)
        return out


class FakeVLLM:
    """vLLM's OpenAI server as the router uses it (prefill leg, model list, standard proxy)."""

    def __init__(self, model: Model, tokenizer_dir: str, name: str = "tiny",
                 max_model_len: int = 4096):
        self.model = model
        self.name = name
        self.root = tokenizer_dir
        self.max_model_len = max_model_len
        self.handoff: dict[str, list[int]] = {}   # rid -> prompt ids ("the KV" the node gets)
        self.requests: list[dict] = []
        self.delay = 0.0
        self.stream_delay = 0.0                    # seconds before each streamed token
        self.prefill_error: int | None = None      # answer prefill legs with this HTTP status
        self.handoff_status: HandoffReport | None = None   # the connector's report in the reply
        self.aborted = 0                           # requests whose client went away mid-prefill
        self.active = 0
        # What the connector's configuration probe answers (None: vLLM without the connector).
        self.connector: dict | None = {"transport": "mooncake", "model": {"name": name}}
        self.probes = 0
        self.standard: list[dict] = []             # streamed requests without a claim
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.complete)
        self.app.router.add_post("/v1/chat/completions", self.complete)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.name, "object": "model", "root": self.root,
             "max_model_len": self.max_model_len}]})

    async def complete(self, request):
        body = await request.json()
        if is_probe(body.get("kv_transfer_params")):
            self.probes += 1
            ktp = ProbeReply(self.connector).to_params() if self.connector else None
            return web.json_response({"choices": [{"index": 0, "text": "", "token_ids": [0],
                                                   "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                                      "kv_transfer_params": ktp})
        if body.get("stream"):
            self.standard.append(body)
        else:
            self.requests.append(body)
            if self.prefill_error:
                return web.json_response({"error": {"message": "engine dead", "code": self.prefill_error}},
                                         status=self.prefill_error)
        if body.get("model") != self.name:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` "
                                                "does not exist.", "code": 404}}, status=404)
        chat = request.path.endswith("chat/completions")
        ids = self.model.prompt_ids(body)
        self.active += 1
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.active -= 1
        n = body.get("max_tokens") or 16
        toks = self.model.continuation(ids, n, body.get("ignore_eos", False))
        if body.get("stream"):
            return await self._stream(request, body, chat, ids, toks)
        claim = Claim.from_params(body.get("kv_transfer_params"))
        if claim is not None:
            self.handoff[claim.rid] = ids
        stop = toks[-1] == self.model.eos and not body.get("ignore_eos")
        text = self.model.tok.decode(toks)
        choice = {"index": 0, "finish_reason": "stop" if stop else "length",
                  "token_ids": toks}
        # Like vLLM: prompt ids top-level for chat, inside the choice for completions.
        choice.update({"message": {"role": "assistant", "content": text}} if chat
                      else {"text": text, "prompt_token_ids": ids})
        return web.json_response({
            "id": "x", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.name, "choices": [choice],
            "prompt_token_ids": ids if chat else None,
            "kv_transfer_params": self.handoff_status.to_params() if self.handoff_status else None,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(toks),
                      "total_tokens": len(ids) + len(toks)}})


    async def _stream(self, request, body, chat, ids, toks):
        """vLLM's SSE with return_token_ids: prompt ids in the first chunk, one token per chunk."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        head = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.name}
        if chat:
            await send({**head, "prompt_token_ids": ids, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        stop = toks[-1] == self.model.eos and not body.get("ignore_eos")
        for i, t in enumerate(toks):
            await asyncio.sleep(self.stream_delay)
            last = i == len(toks) - 1
            fin = ("stop" if stop else "length") if last else None
            text = self.model.tok.decode([t])
            choice = {"index": 0, "token_ids": [t], "finish_reason": fin}
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            if not chat and i == 0:
                choice["prompt_token_ids"] = ids
            await send({**head, "choices": [choice]})
        await send({**head, "choices": [], "usage": {"prompt_tokens": len(ids),
                                                     "completion_tokens": len(toks)}})
        await resp.write(b"data: [DONE]\n\n")
        return resp


class FakeNode:
    """A NexRT decode node (one request at a time), with knobs for failure tests."""

    def __init__(self, model: Model, vllm: FakeVLLM, max_seq_len: int = 4096):
        self.model = model
        self.vllm = vllm
        self.max_seq_len = max_seq_len
        self.token_delay = 0.0
        self.die_after: int | None = None      # drop the connection after this many tokens
        self.finish_error: str | None = None   # end with finish_reason "error" and this message
        self.rid: str | None = None
        self.generation = 0
        self.admits = 0
        self.cancels: list[str] = []
        self.generated: list[str] = []         # rids decoded to the end
        self.emit_times: list[float] = []      # time.monotonic() of each streamed token
        self.caps_extra: dict = {}             # more /capabilities fields (transport, dtype, ...)
        self.admit_delay = 0.0                 # seconds between reserving and answering /v1/admit
        self.refuse: tuple | None = None       # (Reason, message): refuse /v1/generate with it
        self.instance: str | None = None       # the process id /health reports (a restart changes it)
        self.app = self.new_app()

    def new_app(self) -> web.Application:
        """A fresh app over the same state (an aiohttp app cannot be served again once stopped)."""
        app = web.Application()
        for path, h in (("/v1/admit", self.admit), ("/v1/generate", self.generate),
                        ("/v1/cancel", self.cancel)):
            app.router.add_post(path, h)
        app.router.add_get("/health", self.health)
        app.router.add_get("/capabilities", self.caps)
        return app

    async def health(self, request):
        held = [] if self.rid is None else [{"rid": self.rid, "state": "decoding", "slot": 0}]
        return web.json_response({"status": "busy" if held else "free", "busy_slots": len(held), "max_batch": 1,
                                  "requests": held, "instance": self.instance})

    async def caps(self, request):
        return web.json_response({"model": "tiny", "max_seq_len": self.max_seq_len,
                                  **self.caps_extra})

    @staticmethod
    def _refuse(reason: Reason, message: str) -> web.Response:
        r = Refusal(reason, message)
        return web.json_response(r.to_wire(), status=r.status)

    async def admit(self, request):
        adm = AdmitRequest.from_wire(await request.json())
        if self.rid is not None:
            return self._refuse(Reason.BUSY, f"node is busy with {self.rid!r}")
        self.admits += 1
        self.generation += 1
        self.rid = adm.rid
        await asyncio.sleep(self.admit_delay)  # reserved, but the answer is not out yet
        return web.json_response(AdmitReply(self.rid, self.generation, "tcp://127.0.0.1:1", 30.0).to_wire())

    async def cancel(self, request):
        rid = CancelRequest.from_wire(await request.json()).rid
        if rid != self.rid:
            return self._refuse(Reason.UNKNOWN_RID, f"rid {rid!r} is not in flight")
        self.cancels.append(rid)
        self.rid = None
        return web.json_response(CancelReply(rid, True, AdmissionState.DECODING).to_wire())

    async def generate(self, request):
        req = GenerateRequest.from_wire(await request.json())
        rid, ignore_eos, stop_ids = req.rid, req.sampling.ignore_eos, req.sampling.stop_token_ids
        if rid != self.rid or req.generation != self.generation:
            return self._refuse(Reason.UNKNOWN_RID, f"rid {rid!r} is not admitted")
        if self.refuse is not None:
            self.rid = None
            return self._refuse(*self.refuse)
        ids = self.vllm.handoff.pop(rid)
        assert self.model.continuation(ids, 1, ignore_eos)[0] == req.first_token
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        toks = self.model.continuation(ids, req.max_tokens, ignore_eos)[1:]
        sent: list[int] = []
        try:
            for i, t in enumerate(toks):
                if self.rid != rid:
                    return resp          # cancelled meanwhile
                if self.die_after is not None and i == self.die_after:
                    request.transport.close()
                    self.rid = None
                    return resp
                await asyncio.sleep(self.token_delay)
                self.emit_times.append(time.monotonic())
                await resp.write(b'{"token": %d}\n' % t)
                sent.append(t)
                if t in stop_ids:
                    break
            if self.finish_error:
                await resp.write(b'{"finish_reason": "error", "error": "%s"}\n'
                                 % self.finish_error.encode())
            else:
                stop = bool(sent) and (sent[-1] == self.model.eos
                                       or sent[-1] in stop_ids)
                await resp.write(b'{"finish_reason": "%s", "timing": {}}\n'
                                 % (b"stop" if stop else b"length"))
                self.generated.append(rid)
            self.rid = None
            return resp
        except asyncio.CancelledError:
            # The router went away without a cancel: like the real node, free after the fact.
            self.rid = None
            raise


def tokenizer_dir(tmp_path_factory) -> str:
    """A fresh temporary directory holding the tiny test tokenizer."""
    d = str(tmp_path_factory.mktemp("tok"))
    make_tokenizer(d)
    return d


def wait(cond, timeout: float = 5.0) -> None:
    """Poll `cond()` until it is true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


class Stack:
    """Fake vLLM + `n_nodes` fake decode nodes + a real in-process router, on one Loop. The router
    sends no warm-up hand-offs unless `warmup` (tests count the fakes' requests)."""

    def __init__(self, tokenizer_dir: str, n_nodes: int = 1, router_args: tuple = (), warmup: bool = False):
        from nexrt_vllm.router.server import ROUTER_KEY, build_parser, make_app

        self.loop = Loop()
        self.model = Model(tokenizer_dir)
        self.vllm = FakeVLLM(self.model, tokenizer_dir)
        self.vllm_url = self.loop.serve(self.vllm.app)
        self.nodes = [FakeNode(self.model, self.vllm) for _ in range(n_nodes)]
        self.node_urls = [self.loop.serve(n.app) for n in self.nodes]
        argv = ["--vllm-url", self.vllm_url, "--health-interval", "0.2"] + ([] if warmup else ["--no-warmup"])
        for u in self.node_urls:
            argv += ["--decode-url", u]
        self.app = make_app(build_parser().parse_args(argv + list(router_args)))
        self.router = self.app[ROUTER_KEY]
        self.url = self.loop.serve(self.app)

    def health(self) -> dict:
        import requests
        return requests.get(f"{self.url}/health", timeout=5).json()

    def idle(self, timeout: float = 5.0) -> bool:
        """True once no slot is busy (a cancelled slot is released after the node confirms)."""
        deadline = time.monotonic() + timeout
        while self.health()["slots_busy"]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self) -> None:
        self.loop.close()


def interactive_stack(tmp_path_factory):
    """Body of a module-scoped `stack` fixture (`yield from` it): one fake node, and requests
    without a class header take the interactive path."""
    s = Stack(tokenizer_dir(tmp_path_factory), n_nodes=1, router_args=("--default-class", "interactive"))
    yield s
    s.close()

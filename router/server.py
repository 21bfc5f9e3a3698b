"""`nexrt-router`: OpenAI-compatible front of the NexRT fast-decode tier.

Interactive request path (docs/ARCHITECTURE.md §2): acquire a decode node (1 in flight per node,
bounded FIFO otherwise) → node admits rid → vLLM prefill with max_tokens=1 and
kv_transfer_params.nexrt → the first token is streamed to the client at once → the node decodes the
rest from the handed-off state → incremental detokenization, stop strings, OpenAI SSE/JSON.
Standard requests are proxied unchanged to the standard pool.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
import uuid

import aiohttp
import tokenizers
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from nexrt_vllm.handoff.contracts import AdmitReply, Claim, GenerateRequest

from . import params as P
from .errors import APIError
from .pool import NodePool, NoHealthyNode, QueueFull, QueueTimeout
from .textstream import Detokenizer, StopStrings
from .upstream import NodeBusy, NodeClient, NodeError, vllm_prefill

log = logging.getLogger("nexrt.router")

CLASS_HEADER = "X-NexRT-Class"
ROUTER_KEY: web.AppKey["Router"] = web.AppKey("router")
_HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                "trailers", "transfer-encoding", "upgrade", "host", "content-length"}


class Metrics:
    def __init__(self, router: "Router"):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("nexrt_router_requests", "Requests by class and outcome",
                                ["cls", "outcome"], registry=r)
        self.rejected = Counter("nexrt_router_rejected", "Interactive requests refused before "
                                "prefill, by reason", ["reason"], registry=r)
        self.node_failures = Counter("nexrt_router_node_failures", "Decode-node failures seen by "
                                     "the router", ["node"], registry=r)
        self.tokens = Counter("nexrt_router_generated_tokens", "Completion tokens streamed on the "
                              "interactive path", registry=r)
        self.ttft = Histogram("nexrt_router_ttft_seconds", "Router receive → first token sent",
                              registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.queue_wait = Histogram("nexrt_router_queue_wait_seconds", "Time waiting for a node",
                                    registry=r, buckets=(.001, .01, .1, .5, 1, 5, 30))
        pool = router.pool
        Gauge("nexrt_router_inflight", "Interactive requests holding a decode slot",
              registry=r).set_function(lambda: pool.busy_count)
        Gauge("nexrt_router_queue_depth", "Interactive requests waiting for a node",
              registry=r).set_function(lambda: pool.queue_depth)
        Gauge("nexrt_router_nodes_healthy", "Decode nodes in rotation",
              registry=r).set_function(lambda: pool.healthy_count)
        Gauge("nexrt_router_nodes", "Configured decode nodes",
              registry=r).set_function(lambda: len(pool.nodes))


class Lease:
    """One interactive request's hold on a node; cleaned up exactly once."""

    def __init__(self, node, rid: str):
        self.node = node
        self.rid = rid
        self.admitted = False
        self.done = False          # the node sent its final line (nothing to cancel)
        self.t0 = time.monotonic()


class Router:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.vllm_url = args.vllm_url.rstrip("/")
        self.standard_url = (args.standard_url or args.vllm_url).rstrip("/")
        self.pool = NodePool(args.decode_url, args.queue_size, args.queue_timeout)
        self.metrics = Metrics(self)
        self.tokenizer: tokenizers.Tokenizer | None = (
            _load_tokenizer(args.tokenizer) if args.tokenizer else None)
        self.models: dict[str, dict] = {}
        self._models_at = 0.0
        self._tasks: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None
        self.proxy_session: aiohttp.ClientSession | None = None
        self.nodes: NodeClient | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        conn = aiohttp.TCPConnector(limit=0)
        self.session = aiohttp.ClientSession(connector=conn)
        # Standard-class traffic passes through byte for byte (no decompression).
        self.proxy_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                   auto_decompress=False)
        self.nodes = NodeClient(self.session, self.args.admit_timeout, self.args.node_timeout)
        await self._health_round()
        self._spawn(self._health_loop())

    async def stop(self, app: web.Application) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.session.close()
        await self.proxy_session.close()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # -- health ------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.health_interval)
            await self._health_round()

    async def _health_round(self) -> None:
        await asyncio.gather(*(self._check(n) for n in self.pool.nodes))

    async def _check(self, node) -> None:
        try:
            caps = await self.nodes.probe(node.url, self.args.health_timeout)
        except asyncio.TimeoutError:
            # A node busy decoding on a loaded host may answer slowly; its own stream tells us
            # if it died. Idle nodes that stop answering are ejected.
            if not node.busy:
                self.pool.mark_down(node, "health check timed out")
            return
        except (aiohttp.ClientError, NodeError, ValueError) as e:
            self.pool.mark_down(node, f"health check failed: {e}")
            return
        self.pool.mark_up(node, caps if isinstance(caps, dict) else {})

    def _node_failed(self, node, reason: str) -> None:
        self.metrics.node_failures.labels(node.url).inc()
        self.pool.mark_down(node, reason)

    # -- vLLM model list / tokenizer ---------------------------------------------------------
    async def _refresh_models(self, force: bool = False) -> None:
        if self.models and not force:
            return
        if force and time.monotonic() - self._models_at < 1.0:
            return
        try:
            async with self.session.get(f"{self.vllm_url}/v1/models",
                                        timeout=aiohttp.ClientTimeout(total=10)) as r:
                data = await r.json(content_type=None)
            models = {m["id"]: m for m in data["data"]}
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as e:
            raise APIError(503, f"vLLM at {self.vllm_url} is unreachable: "
                                f"{type(e).__name__}: {e}") from None
        self.models, self._models_at = models, time.monotonic()
        if self.tokenizer is None:
            root = next(iter(models.values())).get("root") or next(iter(models))
            try:
                self.tokenizer = _load_tokenizer(root)
            except (OSError, Exception) as e:  # noqa: BLE001 - tokenizers raises Exception
                raise APIError(500, f"cannot load a tokenizer from vLLM's model root {root!r} "
                                    f"({e}); start the router with --tokenizer PATH") from None

    async def _resolve_model(self, name) -> tuple[str, dict]:
        if name is not None and not isinstance(name, str):
            raise APIError(400, "'model' must be a string", param="model")
        await self._refresh_models()
        if name is None:
            name = next(iter(self.models))
        if name not in self.models:
            await self._refresh_models(force=True)
        if name not in self.models:
            raise APIError(404, f"The model `{name}` does not exist.", param="model")
        return name, self.models[name]

    # -- handlers ----------------------------------------------------------------------------
    def _classify(self, request: web.Request) -> str:
        h = request.headers.get(CLASS_HEADER)
        if h is None:
            return self.args.default_class
        h = h.strip().lower()
        if h not in ("interactive", "standard"):
            raise APIError(400, f"{CLASS_HEADER} must be 'interactive' or 'standard', got {h!r}")
        return h

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, "completion")

    async def _openai(self, request: web.Request, kind: str) -> web.StreamResponse:
        cls = "interactive"
        try:
            cls = self._classify(request)
            if cls == "standard":
                resp = await self._proxy(request, self.standard_url)
            else:
                resp = await self._interactive(request, kind)
        except APIError as e:
            self.metrics.requests.labels(cls, str(e.status)).inc()
            return e.response()
        except asyncio.CancelledError:
            self.metrics.requests.labels(cls, "client_closed").inc()
            raise
        except ConnectionResetError:
            # The client left while we wrote; the lease was already cleaned up on the way out.
            self.metrics.requests.labels(cls, "client_closed").inc()
            return web.Response(status=499)
        self.metrics.requests.labels(cls, str(resp.status)).inc()
        return resp

    async def models_list(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._proxy(request, self.vllm_url)
        except APIError as e:
            return e.response()

    async def health(self, request: web.Request) -> web.Response:
        p = self.pool
        body = {"status": "ok" if p.healthy_count else "unavailable",
                "slots_busy": p.busy_count, "queue_depth": p.queue_depth,
                "nodes": [{"url": n.url, "healthy": n.healthy, "busy": n.busy,
                           "reason": n.down_reason} for n in p.nodes]}
        return web.json_response(body, status=200 if p.healthy_count else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.metrics.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    # -- standard class: transparent proxy ---------------------------------------------------
    async def _proxy(self, request: web.Request, base: str) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        data = await request.read() if request.can_read_body else None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.args.admit_timeout,
                                        sock_read=self.args.prefill_timeout)
        try:
            async with self.proxy_session.request(request.method, base + request.path_qs,
                                                  data=data, headers=headers,
                                                  timeout=timeout) as up:
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise APIError(502, f"upstream {base} failed: {type(e).__name__}: {e}") from None

    # -- interactive class -------------------------------------------------------------------
    async def _interactive(self, request: web.Request, kind: str) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        model, info = await self._resolve_model(body.get("model") if isinstance(body, dict)
                                                else None)
        params = P.parse(body, kind, info.get("max_model_len"))
        t_recv = time.monotonic()
        try:
            node = await self.pool.acquire(t_recv + self.args.queue_timeout)
        except QueueFull:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, "all decode nodes are busy and the queue is full; retry later",
                           headers={"Retry-After": str(self.pool.retry_after())}) from None
        except QueueTimeout:
            self.metrics.rejected.labels("queue_timeout").inc()
            raise APIError(429, f"no decode node became free within "
                                f"{self.args.queue_timeout:g}s; retry later",
                           headers={"Retry-After": str(self.pool.retry_after())}) from None
        except NoHealthyNode:
            self.metrics.rejected.labels("no_node").inc()
            raise APIError(503, "no healthy decode node is available") from None
        self.metrics.queue_wait.observe(time.monotonic() - t_recv)
        lease = Lease(node, f"nexrt-{uuid.uuid4().hex}")
        try:
            return await self._serve(request, body, params, model, info, lease, t_recv)
        finally:
            self._end_lease(lease)

    def _end_lease(self, lease: Lease) -> None:
        if lease.node is None:
            return
        node, lease.node = lease.node, None
        if lease.admitted and not lease.done and node.healthy:
            # Runs outside the (possibly cancelled) handler; the slot is released only once the
            # node has acknowledged the cancel, so it is never handed out while still busy.
            self._spawn(self._cancel_and_release(node, lease.rid))
        else:
            # Finished, never admitted, or the node was ejected as unreachable (its own
            # admission/start timeouts free its slot; it rejoins only via a health check).
            self.pool.record_service_time(time.monotonic() - lease.t0)
            self.pool.release(node)

    async def _cancel_and_release(self, node, rid: str) -> None:
        try:
            await self.nodes.cancel(node.url, rid)
            await self.nodes.wait_free(node.url, self.args.admit_timeout)
        except NodeError as e:
            self._node_failed(node, str(e))
        finally:
            self.pool.release(node)

    async def _admit(self, lease: Lease, deadline: float) -> AdmitReply:
        """Admission with fail-over: a node that fails here is ejected and another one tried."""
        busy_until = None
        while True:
            try:
                adm = await self.nodes.admit(lease.node.url, lease.rid)
                lease.admitted = True
                return adm
            except NodeBusy as e:
                # Busy although the router holds no request there: a cancelled request may be
                # finishing on the node. Retry briefly; after that, take it out of rotation
                # until a health check sees it again.
                now = time.monotonic()
                busy_until = busy_until or now + self.args.admit_timeout
                if now < busy_until:
                    await asyncio.sleep(0.1)
                    continue
                self.pool.mark_down(lease.node, f"refused admission ({e}) for "
                                                f"{self.args.admit_timeout:g}s")
            except NodeError as e:
                self._node_failed(lease.node, str(e))
            busy_until = None
            node, lease.node = lease.node, None
            self.pool.release(node)
            try:
                lease.node = await self.pool.acquire(deadline)
            except (QueueFull, QueueTimeout, NoHealthyNode):
                raise APIError(503, "no healthy decode node could admit the request") from None

    async def _serve(self, request, body, params: P.GenParams, model, info, lease: Lease,
                     t_recv: float) -> web.StreamResponse:
        adm = await self._admit(lease, t_recv + self.args.queue_timeout)
        node = lease.node
        claim = Claim(lease.rid, adm.generation, adm.control_addr, node.url)
        path = "/v1/chat/completions" if params.kind == "chat" else "/v1/completions"
        t_prefill = time.monotonic()
        pre = await vllm_prefill(self.session, self.vllm_url + path,
                                 P.prefill_body(body, params, model, claim), self.args.prefill_timeout)
        t_first = time.monotonic()
        h = pre["handoff"]
        if h is not None and h.status.failed:
            # The connector already knows the node will get no state: fail now, not at the
            # node's transfer timeout.
            raise APIError(502, f"KV hand-off to the decode node failed: "
                                f"{h.reason.value if h.reason else None}: {h.error or h.status.value}")
        prompt_len = pre["prompt_tokens"]
        limits = [x for x in (info.get("max_model_len"), node.caps.get("max_seq_len")) if x]
        limit = min(limits) if limits else None
        max_tokens = params.max_tokens
        if limit is not None:
            if max_tokens is None:
                max_tokens = max(1, limit - prompt_len)
            elif prompt_len + max_tokens > limit:
                raise APIError(400, f"this tier's maximum context length is {limit} tokens; the "
                                    f"prompt has {prompt_len} and max_tokens is {max_tokens}",
                               param="max_tokens")
        elif max_tokens is None:
            raise APIError(400, "max_tokens is required (the context limit is unknown)",
                           param="max_tokens")

        out = (_SSE if params.stream else _JSON)(request, params, model)
        detok = Detokenizer(self.tokenizer, pre["prompt_token_ids"])
        stopper = StopStrings(params.stop)
        stop_ids = set(params.stop_token_ids)
        out_ids = [pre["first_token"]]
        finish = None
        timing = {"queue_s": t_prefill - t_recv, "prefill_s": t_first - t_prefill}
        first = pre["first_token"]
        await out.start()
        if pre["finish_reason"] == "stop":
            finish = "stop"        # vLLM stopped on the first token (EOS / stop id): not rendered
        else:
            await out.text(stopper.push(detok.step(first)) if first not in stop_ids else "")
            if stopper.stopped:
                finish = "stop"
            elif max_tokens == 1:
                finish = "length"
        self.metrics.ttft.observe(time.monotonic() - t_recv)

        if finish is None:
            req = GenerateRequest(lease.rid, first, max_tokens, adm.generation, params.sampling)
            t_dec = time.monotonic()
            try:
                async with contextlib.aclosing(self.nodes.generate(node.url, req)) as lines:
                    async for msg in lines:
                        if "token" in msg:
                            tok = int(msg["token"])
                            out_ids.append(tok)
                            if tok in stop_ids:
                                continue       # the node ends with finish "stop" next
                            await out.text(stopper.push(detok.step(tok)))
                            if stopper.stopped:
                                finish = "stop"
                                break          # lease not done: the node gets a cancel
                        else:
                            lease.done = True
                            timing["node"] = msg.get("timing")
                            fr = msg["finish_reason"]
                            if fr in ("stop", "length"):
                                finish = fr
                            else:
                                raise _DecodeFailed(f"decode node ended the request with "
                                                    f"'{fr}': {msg.get('error') or 'no detail'}")
            except NodeError as e:
                self._node_failed(node, str(e))
                return await out.fail(502, f"decode node {node.url} failed: {e}")
            except _DecodeFailed as e:
                return await out.fail(502, str(e))
            timing["decode_s"] = time.monotonic() - t_dec
        await out.text(stopper.flush())
        self.metrics.tokens.inc(len(out_ids))
        usage = {"prompt_tokens": prompt_len, "completion_tokens": len(out_ids),
                 "total_tokens": prompt_len + len(out_ids)}
        timing["total_s"] = time.monotonic() - t_recv
        return await out.finish(finish, usage, timing, out_ids)


class _DecodeFailed(Exception):
    pass


class _Output:
    """Renders one response in the OpenAI envelope (one id/created for all chunks)."""

    def __init__(self, request: web.Request, params: P.GenParams, model: str):
        self.request = request
        self.params = params
        self.model = model
        self.chat = params.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())


class _JSON(_Output):
    def __init__(self, *a):
        super().__init__(*a)
        self.parts: list[str] = []

    async def start(self) -> None:
        pass

    async def text(self, delta: str) -> None:
        if delta:
            self.parts.append(delta)

    async def fail(self, status: int, message: str) -> web.Response:
        return APIError(status, message).response()

    async def finish(self, reason: str, usage: dict, timing: dict,
                     ids: list[int]) -> web.Response:
        text = "".join(self.parts)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.params.return_token_ids:
            choice["token_ids"] = ids
        return web.json_response({
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": [choice], "usage": usage,
            "nexrt_timing": timing})


class _SSE(_Output):
    async def start(self) -> None:
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                "Cache-Control": "no-cache"})
        await self.resp.prepare(self.request)
        if self.chat:
            await self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None})

    async def _send(self, obj) -> None:
        await self.resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    async def _chunk(self, choice: dict | None, **extra) -> None:
        await self._send({"id": self.id,
                          "object": "chat.completion.chunk" if self.chat else "text_completion",
                          "created": self.created, "model": self.model,
                          "choices": [choice] if choice else [], **extra})

    def _choice(self, text: str, reason: str | None) -> dict:
        if self.chat:
            return {"index": 0, "delta": {"content": text} if text or not reason else {},
                    "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    async def text(self, delta: str) -> None:
        if delta:
            await self._chunk(self._choice(delta, None))

    async def fail(self, status: int, message: str) -> web.StreamResponse:
        # Fail closed: an explicit error event, then the terminator; never a silent truncation.
        await self._send(APIError(status, message).body())
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp

    async def finish(self, reason: str, usage: dict, timing: dict,
                     ids: list[int]) -> web.StreamResponse:
        await self._chunk(self._choice("", reason))
        if self.params.include_usage:
            await self._chunk(None, usage=usage, nexrt_timing=timing)
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp


def _load_tokenizer(path: str) -> tokenizers.Tokenizer:
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return tokenizers.Tokenizer.from_file(path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nexrt-router", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--vllm-url", required=True, help="vLLM prefill server (with NexRTConnector)")
    ap.add_argument("--decode-url", action="append", required=True,
                    help="NexRT decode node HTTP URL (repeat for several nodes)")
    ap.add_argument("--standard-url", default=None,
                    help="OpenAI server for standard-class requests (default: --vllm-url)")
    ap.add_argument("--default-class", choices=("interactive", "standard"), default="standard",
                    help=f"class of requests without an {CLASS_HEADER} header")
    ap.add_argument("--queue-size", type=int, default=16,
                    help="interactive requests that may wait for a node (beyond that: 429)")
    ap.add_argument("--queue-timeout", type=float, default=30.0,
                    help="seconds a queued request waits for a node before 429")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json or its directory (default: vLLM's model root)")
    ap.add_argument("--prefill-timeout", type=float, default=600.0,
                    help="seconds for the vLLM prefill leg (and standard-class reads)")
    ap.add_argument("--admit-timeout", type=float, default=5.0,
                    help="seconds for node admit/cancel calls and connects")
    ap.add_argument("--node-timeout", type=float, default=60.0,
                    help="max seconds between two lines of a node's decode stream")
    ap.add_argument("--health-interval", type=float, default=2.0)
    ap.add_argument("--health-timeout", type=float, default=2.0)
    ap.add_argument("--log-level", default="INFO")
    return ap


def make_app(args: argparse.Namespace) -> web.Application:
    if args.queue_size < 0 or args.queue_timeout <= 0:
        raise SystemExit("--queue-size must be >= 0 and --queue-timeout > 0")
    router = Router(args)
    app = web.Application(client_max_size=64 << 20)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/chat/completions", router.chat)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_get("/v1/models", router.models_list)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_handler)
    return app


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # handler_cancellation: a client disconnect cancels the handler, which closes the vLLM leg
    # (vLLM aborts the request) and cancels the node — at any stage, not only on the next write.
    web.run_app(make_app(args), host=args.host, port=args.port, handler_cancellation=True,
                print=lambda *_: log.info("nexrt-router listening on http://%s:%d", args.host,
                                          args.port))


if __name__ == "__main__":
    main()

"""`nexrt-router`: OpenAI-compatible front of the NexRT fast-decode tier.

Interactive request path (docs/ARCHITECTURE.md §2): acquire a decode node (1 in flight per node,
bounded FIFO otherwise) → node admits rid → vLLM prefill with max_tokens=1 and
kv_transfer_params.nexrt → the first token is streamed to the client at once → the node decodes the
rest from the handed-off state → incremental detokenization, stop strings, OpenAI SSE/JSON.
Whatever the fast tier cannot take or finish before its node's text reaches the client continues
on the standard path (`--fallback standard`, router/fallback.py). Standard requests are proxied
unchanged to the standard pool.
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

from . import config_check
from . import params as P
from . import standard
from .chat_parser import ChatOptions, ChatParser
from .reasoning import REASONING_PARSERS
from .tool_parsers import TOOL_PARSERS
from .errors import APIError
from .fallback import Fallback, Reason
from .logprobs import Logprobs, TokenTexts
from .pool import NodePool, NoHealthyNode, QueueFull, QueueTimeout
from .textstream import Detokenizer, StopStrings
from .upstream import NodeBusy, NodeClient, NodeError, NodeRefused, vllm_prefill

log = logging.getLogger("nexrt.router")

CLASS_HEADER = "X-NexRT-Class"
DEGRADED_HEADER = "x-nexrt-degraded"
ROUTER_KEY: web.AppKey["Router"] = web.AppKey("router")
_HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
REPROBE_MIN_S = 5.0     # at most one connector probe per this many seconds after a failure


class Metrics:
    def __init__(self, router: "Router"):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("nexrt_router_requests", "Requests by class and outcome",
                                ["cls", "outcome"], registry=r)
        self.rejected = Counter("nexrt_router_rejected", "Interactive requests refused with 429 "
                                "(queue full, queue timeout, busy), by reason", ["reason"], registry=r)
        self.fast_failures = Counter("nexrt_router_fast_path_failures", "Interactive requests the "
                                     "fast tier could not serve or finish, by reason (served on the "
                                     "standard path, or refused with --fallback error)", ["reason"],
                                     registry=r)
        self.degraded = Counter("nexrt_router_degraded", "Interactive requests continued on the "
                                "standard path, by reason", ["reason"], registry=r)
        for reason in Reason:
            self.fast_failures.labels(reason.value)
            self.degraded.labels(reason.value)
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
        Gauge("nexrt_router_nodes_misconfigured", "Decode nodes ejected because their "
              "/capabilities contradict vLLM's configuration",
              registry=r).set_function(lambda: sum(bool(n.mismatch) for n in pool.nodes))


class Lease:
    """One interactive request's hold on a node; cleaned up exactly once."""

    def __init__(self, node, rid: str):
        self.node = node
        self.rid = rid
        self.admitted = False
        self.done = False          # the node sent its final line (nothing to cancel)
        self.served = False        # ... and it was a normal finish (a service-time sample)
        self.t0 = time.monotonic()


class _Gen:
    """The response being produced for one interactive request, whichever leg produces it."""

    def __init__(self, out: "_Output", tokenizer, params: P.GenParams, prompt_ids: list[int],
                 prompt_len: int, max_tokens: int | None, parser: ChatParser | None = None,
                 special_ids: frozenset[int] = frozenset()):
        self.out = out
        self.parser = out.parser = parser
        self.detok = Detokenizer(tokenizer, prompt_ids, skip_special_tokens=(
            parser is None or parser.skip_special_tokens))
        self.special_ids = special_ids
        self.texts: list[str] = []          # per-token text (the parsed path's token counts)
        self._held: tuple[str, bool, bool] | None = None   # (text, special, from_node)
        self.stopper = StopStrings(params.stop)
        self.stop_ids = set(params.stop_token_ids)
        self.prompt_ids = list(prompt_ids)
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.ids: list[int] = []
        self.finish: str | None = None
        self.node_tokens = 0
        self.node_text_sent = False   # a stream already carries text the node produced
        self.lp: Logprobs | None = None   # the response's logprobs, when asked for

    async def push(self, tok: int, *, render: bool = True, from_node: bool = False) -> bool:
        """Append one token and send its text (stop ids and hidden tokens render nothing);
        True once a stop string completed."""
        self.ids.append(tok)
        self.node_tokens += from_node
        if self.parser is not None:
            return await self._push_parsed(tok, render, from_node)
        if render and tok not in self.stop_ids:
            text = self.stopper.push(self.detok.step(tok))
            if text:
                await self.out.text(text)
                self.node_text_sent |= from_node and self.out.streams
            if self.stopper.stopped:
                self.finish = "stop"
        return self.finish == "stop"

    async def _push_parsed(self, tok: int, render: bool, from_node: bool) -> bool:
        """The parser gets each token's text (after stop strings) with `finished` set on the last
        one. Whether a token is the last is known on arrival, except for a special token (EOS
        ends the node's stream with nothing after it): that one waits for the next message."""
        text = ""
        if render and tok not in self.stop_ids:
            text = self.stopper.push(self.detok.step(tok))
            if self.stopper.stopped:
                self.finish = "stop"
        self.texts.append(text)
        await self._release()
        final = (self.finish == "stop" or not render or tok in self.stop_ids
                 or (self.max_tokens is not None and len(self.ids) >= self.max_tokens))
        if final or tok in self.special_ids:
            self._held = (text, tok in self.special_ids, from_node)
        else:
            await self._emit(text, False, 1, from_node)
        return self.finish == "stop"

    async def _release(self) -> None:
        if self._held is not None:
            (text, _special, from_node), self._held = self._held, None
            await self._emit(text, False, 1, from_node)

    async def _emit(self, text: str, finished: bool, count: int, from_node: bool) -> None:
        if not self.out.streams:
            await self.out.text(text)
            return
        d = self.parser.feed(text, finished=finished, token_count=count,
                             prompt_ids=self.prompt_ids)
        if d is not None:
            await self.out.delta(d)
            self.node_text_sent |= from_node

    async def close_text(self) -> None:
        """End of generation: what stop strings held back, and the parser's final feed."""
        tail = self.stopper.flush()
        if self.parser is None:
            await self.out.text(tail)
            return
        text, count, from_node = tail, 0, False
        if self._held is not None:
            (held, special, from_node), self._held = self._held, None
            count = 1
            # A special token that ended the stream with "stop" is EOS: vLLM shows no text for it.
            text = ("" if special and self.finish == "stop" else held) + tail
        await self._emit(text, True, count, from_node)


class _Request:
    """One interactive request as received, plus what the router learned along the way."""

    def __init__(self, request: web.Request, kind: str, body: dict, params: P.GenParams,
                 model: str, info: dict):
        self.request, self.kind, self.body, self.params = request, kind, body, params
        self.model, self.info = model, info
        self.t_recv = time.monotonic()
        self.timing: dict = {}
        self.gen: _Gen | None = None


class Router:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.vllm_url = args.vllm_url.rstrip("/")
        self.standard_url = (args.standard_url or args.vllm_url).rstrip("/")
        self.pool = NodePool(args.decode_url, args.queue_size, args.queue_timeout,
                             args.retry_after_max)
        self.metrics = Metrics(self)
        self.tokenizer: tokenizers.Tokenizer | None = (
            _load_tokenizer(args.tokenizer) if args.tokenizer else None)
        self._texts: TokenTexts | None = (
            TokenTexts(self.tokenizer, _clean_up_spaces(args.tokenizer)) if args.tokenizer else None)
        self.models: dict[str, dict] = {}
        self._models_at = 0.0
        self._special: tuple[str, ...] | None = None       # the tokenizer's special tokens
        self._special_ids: frozenset[int] = frozenset()
        self._tasks: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None
        self.proxy_session: aiohttp.ClientSession | None = None
        self.nodes: NodeClient | None = None
        # vLLM's connector as its configuration probe reported it (router/config_check.py).
        self.connector: dict | None = None
        self.connector_state = "not probed"
        self._probe_wanted = True
        self._probe_after = 0.0
        self._probe_task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        conn = aiohttp.TCPConnector(limit=0)
        self.session = aiohttp.ClientSession(connector=conn)
        # Standard-class traffic passes through byte for byte (no decompression).
        self.proxy_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                   auto_decompress=False)
        self.nodes = NodeClient(self.session, self.args.admit_timeout, self.args.node_timeout)
        # Learn vLLM's side first, so a misconfigured node is never taken into rotation.
        await self._probe_connector()
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

    # -- health and configuration --------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.health_interval)
            if self._probe_wanted and time.monotonic() >= self._probe_after and (
                    self._probe_task is None or self._probe_task.done()):
                self._probe_task = self._spawn(self._probe_connector(recheck=True))
            await self._health_round()

    async def _health_round(self) -> None:
        await asyncio.gather(*(self._check(n) for n in self.pool.nodes))

    def _reprobe(self) -> None:
        """A hand-off failed or vLLM was unreachable: its configuration may have changed."""
        self._probe_wanted = True

    async def _probe_connector(self, recheck: bool = False) -> None:
        self._probe_wanted = False
        self._probe_after = time.monotonic() + REPROBE_MIN_S
        state, info = await config_check.probe(self.session, self.vllm_url, self.args.probe_timeout)
        if state == "unreachable":
            self._probe_wanted = True      # vLLM not up (yet): ask again at the next round
            self._probe_after = 0.0
            return
        if (state, info) != (self.connector_state, self.connector):
            log.info("vLLM %s: connector %s %s", self.vllm_url, state, info or "")
        self.connector_state, self.connector = state, info
        if recheck:
            await self._health_round()

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
        caps = caps if isinstance(caps, dict) else {}
        mismatch = config_check.mismatches(self.connector, caps)
        if mismatch != node.mismatch:
            if mismatch:
                log.error("decode node %s does not match vLLM %s, ejected: %s", node.url,
                          self.vllm_url, "; ".join(mismatch))
            else:
                log.info("decode node %s now matches vLLM's configuration", node.url)
            node.mismatch = mismatch
        if mismatch:
            self.pool.mark_down(node, "misconfigured: " + "; ".join(mismatch))
            return
        if not node.healthy and config_check.name_differs(self.connector, caps):
            log.warning("decode node %s serves %r, vLLM %r (same shapes; is it the same "
                        "checkpoint?)", node.url, caps.get("model"),
                        (self.connector or {}).get("model", {}).get("name"))
        self.pool.mark_up(node, caps)

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
            self._texts = TokenTexts(self.tokenizer, _clean_up_spaces(root))

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
        ok = bool(p.healthy_count)
        # With --fallback standard the router still answers everything (on the standard path).
        status = "ok" if ok else ("degraded" if self.args.fallback == "standard" else "unavailable")
        body = {"status": status, "slots_busy": p.busy_count, "queue_depth": p.queue_depth,
                "fallback": self.args.fallback, "when_busy": self.args.when_busy,
                "connector": {"state": self.connector_state, "config": self.connector},
                "nodes": [{"url": n.url, "healthy": n.healthy, "busy": n.busy,
                           "reason": n.down_reason, "mismatch": n.mismatch} for n in p.nodes]}
        return web.json_response(body, status=200 if status != "unavailable" else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.metrics.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    # -- standard class: transparent proxy ---------------------------------------------------
    async def _proxy(self, request: web.Request, base: str,
                     extra_headers: dict[str, str] | None = None) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        data = await request.read() if request.body_exists else None  # read() is cached
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.args.admit_timeout,
                                        sock_read=self.args.prefill_timeout)
        try:
            async with self.proxy_session.request(request.method, base + request.path_qs,
                                                  data=data, headers=headers,
                                                  timeout=timeout) as up:
                resp = web.StreamResponse(status=up.status, headers={
                    **{k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS},
                    **(extra_headers or {})})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the client went away") from None   # not vLLM's fault
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
        params = P.parse(body, kind, info.get("max_model_len"),
                         auto_tools=bool(self.args.enable_auto_tool_choice
                                         and self.args.tool_call_parser),
                         reasoning=self.args.reasoning_parser is not None)
        rq = _Request(request, kind, body, params, model, info)
        try:
            return await self._fast(rq)
        except Fallback as f:
            self.metrics.fast_failures.labels(f.reason.value).inc()
            if self.args.fallback == "error":
                if rq.gen is not None and rq.gen.out.started:
                    return await rq.gen.out.fail(f.error.status, f.error.message)
                raise f.error from None
            return await self._standard(rq, f)

    async def _fast(self, rq: _Request) -> web.StreamResponse:
        node = await self._acquire(rq)
        self.metrics.queue_wait.observe(time.monotonic() - rq.t_recv)
        lease = Lease(node, f"nexrt-{uuid.uuid4().hex}")
        try:
            return await self._serve(rq, lease)
        finally:
            self._end_lease(lease)

    async def _acquire(self, rq: _Request):
        """A node for this request, per --when-busy; Fallback when the tier cannot take it."""
        pool = self.pool
        if not pool.healthy_count:
            raise self._no_node()
        if self.args.when_busy != "queue":
            node = pool.try_acquire()
            if node is not None:
                return node
            if self.args.when_busy == "standard":
                raise Fallback(Reason.BUSY, f"all {pool.healthy_count} healthy decode nodes busy",
                               APIError(429, "all decode nodes are busy; retry later"))
            self.metrics.rejected.labels("busy").inc()
            raise APIError(429, "all decode nodes are busy; retry later",
                           headers={"Retry-After": str(pool.retry_after(1))})
        try:
            return await pool.acquire(rq.t_recv + self.args.queue_timeout)
        except QueueFull:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, "all decode nodes are busy and the queue is full; retry later",
                           headers={"Retry-After": str(pool.retry_after())}) from None
        except QueueTimeout:
            self.metrics.rejected.labels("queue_timeout").inc()
            raise APIError(429, f"no decode node became free within "
                                f"{self.args.queue_timeout:g}s; retry later",
                           headers={"Retry-After": str(pool.retry_after())}) from None
        except NoHealthyNode:
            raise self._no_node() from None

    def _no_node(self) -> Fallback:
        why = "; ".join(f"{n.url}: {n.down_reason}" for n in self.pool.nodes)
        return Fallback(Reason.NO_NODE, f"no decode node in rotation ({why})",
                        APIError(503, "no healthy decode node is available"))

    def _end_lease(self, lease: Lease) -> None:
        if lease.node is None:
            return
        node, lease.node = lease.node, None
        if lease.served:
            self.pool.record_service_time(node, time.monotonic() - lease.t0)
        if lease.admitted and not lease.done and node.healthy:
            # Runs outside the (possibly cancelled) handler; the slot is released only once the
            # node has acknowledged the cancel, so it is never handed out while still busy.
            self._spawn(self._cancel_and_release(node, lease.rid))
        else:
            # Finished, never admitted, or the node was ejected as unreachable (its own
            # admission/start timeouts free its slot; it rejoins only via a health check).
            self.pool.release(node)

    async def _cancel_and_release(self, node, rid: str) -> None:
        try:
            await self.nodes.cancel(node.url, rid)
            await self.nodes.wait_free(node.url, self.args.admit_timeout)
        except NodeError as e:
            self._node_failed(node, str(e))
        finally:
            self.pool.release(node)

    async def _forget(self, url: str, rid: str) -> None:
        with contextlib.suppress(NodeError):
            await self.nodes.cancel(url, rid)

    async def _admit(self, rq: _Request, lease: Lease) -> AdmitReply:
        """Admission with fail-over: a node that fails here is ejected and another one tried."""
        busy_until = None
        while True:
            why = _unsupported(rq.params, lease.node)
            if why:
                raise Fallback(Reason.UNSUPPORTED, why, APIError(400, why))
            # Admitted from the moment the request leaves: if this handler is cancelled (the
            # client left) or times out while the node has already reserved the slot, the lease's
            # cleanup must cancel that reservation (the node answers 404 if there was none).
            lease.admitted = True
            spec = rq.params.structured
            try:
                return await self.nodes.admit(lease.node.url, lease.rid,
                                              spec.to_wire() if spec is not None else None)
            except NodeRefused as e:
                lease.admitted = False
                msg = f"decode node {lease.node.url} cannot serve this request: {e.message}"
                raise Fallback(Reason.UNSUPPORTED, msg, APIError(400, msg)) from None
            except NodeBusy as e:
                lease.admitted = False
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
                lease.admitted = False
                self._node_failed(lease.node, str(e))
                # It may have reserved the slot before the error (a slow answer): free it.
                self._spawn(self._forget(lease.node.url, lease.rid))
            busy_until = None
            node, lease.node = lease.node, None
            self.pool.release(node)
            try:
                lease.node = await self._acquire(rq)
            except (Fallback, APIError) as e:
                raise Fallback(Reason.ADMISSION, f"no node admitted the request ({e})",
                               APIError(503, "no healthy decode node could admit the request")
                               ) from None

    async def _serve(self, rq: _Request, lease: Lease) -> web.StreamResponse:
        params, info = rq.params, rq.info
        adm = await self._admit(rq, lease)
        node = lease.node
        claim = Claim(lease.rid, adm.generation, adm.control_addr, node.url)
        path = "/v1/chat/completions" if params.kind == "chat" else "/v1/completions"
        t_prefill = time.monotonic()
        try:
            pre = await vllm_prefill(self.session, self.vllm_url + path,
                                     P.prefill_body(rq.body, params, rq.model, claim),
                                     self.args.prefill_timeout)
        except APIError as e:
            if e.status >= 500:
                self._reprobe()
                if self.standard_url != self.vllm_url:
                    raise Fallback(Reason.PREFILL, e.message, e) from None
            raise
        t_first = time.monotonic()
        rq.timing.update(queue_s=t_prefill - rq.t_recv, prefill_s=t_first - t_prefill)

        # Failures known before anything is sent: the first token (vLLM's own) still goes to the
        # client at once, the rest comes from the standard path.
        pending = None
        h = pre["handoff"]
        if h is not None and h.status.failed:
            self._reprobe()
            detail = f"{h.reason.value if h.reason else None}: {h.error or h.status.value}"
            pending = Fallback(Reason.HANDOFF, f"connector: {detail}",
                               APIError(502, f"KV hand-off to the decode node failed: {detail}"))
        prompt_len = pre["prompt_tokens"]
        vllm_limit, node_limit = info.get("max_model_len"), node.caps.get("max_seq_len")
        limits = [x for x in (vllm_limit, node_limit) if x]
        limit = min(limits) if limits else None
        max_tokens = params.max_tokens
        if limit is None and max_tokens is None:
            raise APIError(400, "max_tokens is required (the context limit is unknown)",
                           param="max_tokens")
        if limit is not None and prompt_len + (max_tokens or 1) > limit:
            err = APIError(400, f"this tier's maximum context length is {limit} tokens; the "
                                f"prompt has {prompt_len} and max_tokens is {max_tokens}",
                           param="max_tokens")
            if vllm_limit and prompt_len + (max_tokens or 1) > vllm_limit:
                raise err
            # Beyond the node's context, within vLLM's: vLLM alone can serve it.
            if max_tokens is None:
                if not vllm_limit:
                    raise err
                max_tokens = vllm_limit - prompt_len
            pending = pending or Fallback(
                Reason.TOO_LONG, f"prompt {prompt_len} + max_tokens {max_tokens} tokens exceed "
                                 f"the node's max_seq_len {node_limit}", err)
        elif max_tokens is None:
            max_tokens = limit - prompt_len
        first = pre["first_token"]
        if pending is not None and (pre["finish_reason"] == "stop" or max_tokens == 1):
            pending = None          # the first token ends the request: no decode needed at all
        if pending is not None and self.args.fallback == "error":
            raise pending

        gen = rq.gen = self._new_gen(rq, pre["prompt_token_ids"], prompt_len, max_tokens,
                                     pending.reason if pending else None)
        await gen.out.start()
        if gen.lp is not None:
            try:
                gen.lp.add_vllm_first(first, pre["logprobs"])
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise APIError(502, f"vLLM's prefill answer lacks the first token's logprobs: {e}") from None
        if pre["finish_reason"] == "stop":
            # vLLM stopped on the first token (EOS / stop id): counted, not rendered
            await gen.push(first, render=False)
            gen.finish = "stop"
        elif not await gen.push(first) and max_tokens == 1:
            gen.finish = "length"
        self.metrics.ttft.observe(time.monotonic() - rq.t_recv)
        if pending is not None:
            raise pending
        if gen.finish is None:
            failed = await self._decode(rq, lease, adm)
            if failed is not None:
                return failed
        return await self._finish(rq)

    async def _decode(self, rq: _Request, lease: Lease, adm: AdmitReply) -> web.StreamResponse | None:
        """The node's part. Returns the fail-closed response of a stream that already carries
        node text; raises Fallback when the node failed before that."""
        gen, node = rq.gen, lease.node
        # the grammar went with the admission (compiled while vLLM prefilled)
        req = GenerateRequest(lease.rid, gen.ids[0], gen.max_tokens, adm.generation, rq.params.sampling,
                              logprobs=rq.params.logprobs)
        t_dec = time.monotonic()
        try:
            async with contextlib.aclosing(self.nodes.generate(node.url, req)) as lines:
                async for msg in lines:
                    if "token" in msg:
                        if gen.lp is not None:
                            gen.lp.add_node(int(msg["token"]), msg)
                        if await gen.push(int(msg["token"]), from_node=True):
                            break                # stop string: the node gets a cancel
                    else:
                        lease.done = True
                        rq.timing["node"] = msg.get("timing")
                        fr = msg["finish_reason"]
                        if fr not in ("stop", "length"):
                            raise _DecodeFailed(f"decode node ended the request with '{fr}': "
                                                f"{msg.get('error') or 'no detail'}")
                        gen.finish = fr
                        lease.served = True
        except NodeError as e:
            self._node_failed(node, str(e))
            return await self._node_lost(gen, Reason.NODE_FAILED, f"decode node {node.url} failed: {e}")
        except NodeRefused as e:
            self._reprobe()
            return await self._node_lost(gen, Reason.HANDOFF,
                                         f"decode node {node.url} refused to decode: {e}")
        except _DecodeFailed as e:
            reason = Reason.HANDOFF if gen.node_tokens == 0 else Reason.NODE_FAILED
            if reason is Reason.HANDOFF:
                self._reprobe()
            return await self._node_lost(gen, reason, str(e))
        rq.timing["decode_s"] = time.monotonic() - t_dec
        return None

    async def _node_lost(self, gen: _Gen, reason: Reason, message: str) -> web.StreamResponse:
        if gen.node_text_sent:
            # The client already has text from the node: fail closed, never splice two sources.
            return await gen.out.fail(502, message)
        raise Fallback(reason, message, APIError(502, message))

    def _new_gen(self, rq: _Request, prompt_ids, prompt_len: int, max_tokens: int | None,
                 degraded: Reason | None) -> _Gen:
        headers = {DEGRADED_HEADER: degraded.value} if degraded is not None else {}
        out = (_SSE if rq.params.stream else _JSON)(rq.request, rq.params, rq.model, headers)
        gen = _Gen(out, self.tokenizer, rq.params, prompt_ids, prompt_len, max_tokens,
                   self._chat_parser(rq), self._special_ids)
        if rq.params.logprobs is not None:
            gen.lp = out.lp = Logprobs(self._texts, rq.params.kind == "chat", rq.params.logprobs)
        return gen

    def _chat_parser(self, rq: _Request) -> ChatParser | None:
        """vLLM's composed output parser for a chat request (None: the text is the content)."""
        a = self.args
        tool_parser = a.tool_call_parser if a.enable_auto_tool_choice else None
        if rq.kind != "chat" or (a.reasoning_parser is None and tool_parser is None):
            return None
        if self._special is None:
            added = self.tokenizer.get_added_tokens_decoder()
            self._special = tuple(t.content for t in added.values() if t.special)
            self._special_ids = frozenset(i for i, t in added.items() if t.special)
        return ChatParser(ChatOptions.from_request(rq.body, a.default_chat_template_kwargs),
                          reasoning_parser=a.reasoning_parser, tool_parser=tool_parser,
                          drop_tokens=self._special, token_id=self.tokenizer.token_to_id)

    async def _finish(self, rq: _Request) -> web.StreamResponse:
        gen = rq.gen
        await gen.close_text()
        self.metrics.tokens.inc(len(gen.ids))
        usage = {"prompt_tokens": gen.prompt_len, "completion_tokens": len(gen.ids),
                 "total_tokens": gen.prompt_len + len(gen.ids)}
        if gen.parser is not None and gen.parser.reasoning is not None:
            gen.out.usage_details = lambda: {"reasoning_tokens": gen.parser.count_reasoning_tokens(
                gen.ids, gen.texts)}
        rq.timing["total_s"] = time.monotonic() - rq.t_recv
        return await gen.out.finish(gen.finish, usage, rq.timing, gen.ids)

    # -- the standard path for what the fast tier could not serve ----------------------------
    async def _standard(self, rq: _Request, f: Fallback) -> web.StreamResponse:
        gen, params = rq.gen, rq.params
        t0 = time.monotonic()
        # known_s: since the request arrived; decide_s: from learning the failure to asking the
        # standard path; *_at: wall clock, for comparison with other processes' events.
        rq.timing["degraded"] = {"reason": f.reason.value, "detail": f.detail,
                                 "known_s": f.known - rq.t_recv, "decide_s": t0 - f.known,
                                 "known_at": f.known_at, "fallback_at": time.time()}
        self.metrics.degraded.labels(f.reason.value).inc()
        log.info("interactive request continues on the standard path (%s: %s)", f.reason.value,
                 f.detail)
        exact = params.logprobs is None and params.structured is None
        if gen is None and not exact:
            # Logprobs and grammars are vLLM's own there: the client's request, unchanged.
            return await self._proxy(rq.request, self.standard_url, {DEGRADED_HEADER: f.reason.value})
        if gen is None:
            # Nothing prefilled: the client's own request, rendered by the router.
            path = "/v1/chat/completions" if params.kind == "chat" else "/v1/completions"
            body = P.standard_body(rq.body, params, rq.model)
        else:
            remaining = gen.max_tokens - len(gen.ids)
            if gen.finish is not None or remaining < 1:
                gen.finish = gen.finish or "length"
                return await self._finish(rq)
            if not exact:
                # vLLM cannot resume a grammar mid-answer, nor would the logprobs be one response's
                msg = (f"the fast tier failed after the first token ({f.detail}) and a request with "
                       f"logprobs or structured output cannot continue on the standard path")
                return await gen.out.fail(502, msg)
            path = "/v1/completions"
            body = P.continuation_body(params, rq.model, gen.prompt_ids + gen.ids, remaining)
        try:
            async with contextlib.aclosing(standard.stream(
                    self.session, self.standard_url + path, body, self.args.admit_timeout,
                    self.args.prefill_timeout)) as chunks:
                async for c in chunks:
                    if gen is None:
                        pids = c.prompt_token_ids or []
                        gen = rq.gen = self._new_gen(rq, pids, len(pids), params.max_tokens,
                                                     f.reason)
                        await gen.out.start()
                        self.metrics.ttft.observe(time.monotonic() - rq.t_recv)
                    for i, tok in enumerate(c.token_ids):
                        # vLLM ends on EOS / a stop id with that token last: counted, not shown.
                        hidden = (i == len(c.token_ids) - 1 and c.finish_reason == "stop"
                                  and not isinstance(c.stop_reason, str))
                        if await gen.push(tok, render=not hidden):
                            break
                    if gen.finish is None and c.finish_reason:
                        gen.finish = "length" if c.finish_reason == "length" else "stop"
                    if gen.finish is not None:
                        break
        except standard.StandardError as e:
            if gen is None or not gen.out.started:
                raise APIError(e.status, f"the standard path failed: {e.message}") from None
            return await gen.out.fail(502, f"the standard path failed: {e.message}")
        rq.timing["standard_s"] = time.monotonic() - t0
        return await self._finish(rq)


class _DecodeFailed(Exception):
    pass


class _Output:
    """Renders one response in the OpenAI envelope (one id/created for all chunks)."""

    streams = False               # True: what text() sends reaches the client at once

    def __init__(self, request: web.Request, params: P.GenParams, model: str,
                 headers: dict[str, str] | None = None):
        self.request = request
        self.params = params
        self.model = model
        self.headers = dict(headers or {})
        self.chat = params.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.started = False
        self.parser: ChatParser | None = None
        self.usage_details = None     # () -> usage's completion_tokens_details (reasoning parser)
        self.lp: Logprobs | None = None

    def _usage(self, usage: dict) -> dict:
        if self.usage_details is not None:
            usage = {**usage, "completion_tokens_details": self.usage_details()}
        return usage


class _JSON(_Output):
    def __init__(self, *a):
        super().__init__(*a)
        self.parts: list[str] = []

    async def start(self) -> None:
        self.started = True

    async def text(self, delta: str) -> None:
        if delta:
            self.parts.append(delta)

    async def fail(self, status: int, message: str) -> web.Response:
        return APIError(status, message).response()

    async def finish(self, reason: str, usage: dict, timing: dict,
                     ids: list[int]) -> web.Response:
        text = "".join(self.parts)
        if self.chat and self.parser is not None:
            reasoning, content, calls = self.parser.parse(text)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls]
                reason = "tool_calls"
            message["reasoning"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            usage = self._usage(usage)
        elif self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.lp is not None:
            choice["logprobs"] = self.lp.whole()
        if self.params.return_token_ids:
            choice["token_ids"] = ids
        return web.json_response({
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": [choice], "usage": usage,
            "nexrt_timing": timing}, headers=self.headers)


class _SSE(_Output):
    streams = True

    async def start(self) -> None:
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                "Cache-Control": "no-cache", **self.headers})
        await self.resp.prepare(self.request)
        self.started = True
        if self.chat:
            await self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None})

    async def _send(self, obj) -> None:
        await self.resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    async def _chunk(self, choice: dict | None, **extra) -> None:
        if choice is not None and self.lp is not None:
            # the tokens since the last chunk (a token without text of its own rides on the next)
            choice["logprobs"] = self.lp.pending()
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

    async def delta(self, delta: dict) -> None:
        """A parsed chat delta (content / reasoning / tool_calls), as vLLM's DeltaMessage."""
        await self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

    async def fail(self, status: int, message: str) -> web.StreamResponse:
        # Fail closed: an explicit error event, then the terminator; never a silent truncation.
        await self._send(APIError(status, message).body())
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp

    async def finish(self, reason: str, usage: dict, timing: dict,
                     ids: list[int]) -> web.StreamResponse:
        # A degraded stream says so even without a usage chunk (its headers may predate it).
        extra = ({"nexrt_timing": timing} if "degraded" in timing and not self.params.include_usage
                 else {})
        if self.parser is not None:
            usage = self._usage(usage)
            if reason == "stop" and self.parser.tools_streamed:
                reason = "tool_calls"
        await self._chunk(self._choice("", reason), **extra)
        if self.params.include_usage:
            await self._chunk(None, usage=usage, nexrt_timing=timing)
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp


def _unsupported(params: P.GenParams, node) -> str | None:
    """Why `node` (by its /capabilities) cannot serve the request's output options, or None."""
    caps = node.caps if isinstance(node.caps, dict) else {}
    if params.logprobs is not None:
        s = caps.get("sampling") or {}
        if not s.get("logprobs"):
            return f"decode node {node.url} does not return logprobs (its /capabilities)"
        if params.logprobs > s.get("max_logprobs", 0):
            return (f"decode node {node.url} returns at most {s.get('max_logprobs', 0)} logprobs per token, "
                    f"{params.logprobs} asked")
    spec = params.structured
    if spec is not None:
        so = caps.get("structured_output") or {}
        if spec.type not in (so.get("types") or ()):
            return (f"decode node {node.url} does not support structured output {spec.type!r}: "
                    f"{so.get('reason') or 'not listed in its /capabilities'}")
    return None


def _clean_up_spaces(path: str) -> bool:
    """transformers' clean_up_tokenization_spaces of the tokenizer (vLLM decodes with it)."""
    d = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with open(os.path.join(d, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("clean_up_tokenization_spaces", False))
    except (OSError, ValueError):
        return False


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
    ap.add_argument("--fallback", choices=("standard", "error"), default="standard",
                    help="what an interactive request gets when the fast tier cannot take or finish "
                         "it before its node's text reaches the client: the standard path (vLLM "
                         "decodes it) or today's error")
    ap.add_argument("--when-busy", choices=("queue", "429", "standard"), default="queue",
                    help="all nodes busy: wait in the queue (429 when full / timed out), answer 429 "
                         "at once, or serve it on the standard path (needs --fallback standard)")
    ap.add_argument("--retry-after-max", type=float, default=60.0,
                    help="upper bound of a 429's Retry-After (expected wait from the queue)")
    ap.add_argument("--health-interval", type=float, default=2.0)
    ap.add_argument("--health-timeout", type=float, default=2.0)
    ap.add_argument("--probe-timeout", type=float, default=10.0,
                    help="seconds for the configuration probe of vLLM's connector")
    ap.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                    help="parse tool calls out of chat output as vLLM's parser of this name does")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="serve tool_choice 'auto' (needs --tool-call-parser), as vLLM's flag")
    ap.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                    help="split reasoning out of chat output into 'reasoning', as vLLM's flag")
    ap.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                    help="JSON object: vLLM's --default-chat-template-kwargs (the parsers read "
                         "enable_thinking from it); give vLLM the same value")
    ap.add_argument("--log-level", default="INFO")
    return ap


def _json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def make_app(args: argparse.Namespace) -> web.Application:
    if args.queue_size < 0 or args.queue_timeout <= 0:
        raise SystemExit("--queue-size must be >= 0 and --queue-timeout > 0")
    if args.when_busy == "standard" and args.fallback != "standard":
        raise SystemExit("--when-busy standard needs --fallback standard")
    if args.retry_after_max < 1:
        raise SystemExit("--retry-after-max must be >= 1")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice requires --tool-call-parser")
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

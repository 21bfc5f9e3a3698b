"""The interactive path (docs/ARCHITECTURE.md §2): acquire a decode node (1 in flight per node,
bounded FIFO otherwise) → the node admits the rid → vLLM prefills with max_tokens=1 and
kv_transfer_params.nexrt → the first token goes to the client at once → the node decodes the rest
from the handed-off state. Whatever the fast tier cannot take or finish before its node's text
reaches the client raises Fallback and continues on the standard path (`--fallback standard`,
router/standard.py) or gets the error (`--fallback error`)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import logging
import uuid
from collections.abc import Callable

import aiohttp
from aiohttp import web

from nexrt_vllm.handoff.contracts import AdmitReply, Claim, GenerateRequest

from . import fastjson
from . import params as P
from .affinity import Affinity, session_key
from .errors import APIError
from .fallback import Fallback, Reason
from .health import NodeHealth
from .metrics import Metrics
from .models import Models
from .pool import NodePool, NoHealthyNode, QueueFull, QueueTimeout
from .presentation import Gen, Renderer
from .standard import StandardPath
from .upstream import NodeBusy, NodeClient, NodeError, NodeRefused, vllm_prefill

log = logging.getLogger("nexrt.router")


class Lease:
    """One interactive request's hold on a node; cleaned up exactly once."""

    def __init__(self, node, rid: str):
        self.node = node
        self.rid = rid
        self.admitted = False
        self.done = False          # the node sent its final line (nothing to cancel)
        self.served = False        # ... and it was a normal finish (a service-time sample)
        self.t0 = time.monotonic()


class InteractiveRequest:
    """One interactive request as received, plus what the router learned along the way."""

    def __init__(self, request: web.Request, kind: str, body: dict, model: str, info: dict):
        self.request, self.kind, self.body = request, kind, body
        self.model, self.info = model, info
        self.params: P.GenParams | None = None   # None: not one the tier serves (P.Unsupported)
        self.t_recv = time.monotonic()
        self.timing: dict = {}
        self.gen: Gen | None = None
        self.session = session_key(request.headers, body, kind) if isinstance(body, dict) else None


class DecodeFailed(Exception):
    """The node ended the request with an error of its own."""


def node_unsupported(params: P.GenParams, node) -> str | None:
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


class InteractivePath:
    """Serves interactive-class requests; what it cannot serve goes to `standard`."""

    def __init__(self, args: argparse.Namespace, vllm_url: str, standard_url: str, pool: NodePool,
                 nodes: NodeClient, session: aiohttp.ClientSession, metrics: Metrics,
                 models: Models, health: NodeHealth, renderer: Renderer, standard: StandardPath,
                 spawn: Callable):
        self.args, self.vllm_url, self.standard_url = args, vllm_url, standard_url
        self.pool, self.nodes, self.session, self.metrics = pool, nodes, session, metrics
        self.models, self.health, self.renderer, self.standard = models, health, renderer, standard
        self.spawn = spawn
        self.affinity = Affinity()           # conversation -> the node of its last turn
        self._logged: set[str] = set()       # what _log_once has said

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = fastjson.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        model, info = await self.models.resolve(
            self.session, body.get("model") if isinstance(body, dict) else None)
        rq = InteractiveRequest(request, kind, body, model, info)
        try:
            try:
                rq.params = P.parse(body, kind, info.get("max_model_len"),
                                    auto_tools=bool(self.args.enable_auto_tool_choice
                                                    and self.args.tool_call_parser),
                                    reasoning=self.args.reasoning_parser is not None)
            except P.Unsupported as e:
                self._log_unsupported(e)
                raise Fallback(e.reason, e.message, e) from None
            if kind == "chat" and self.args.reasoning_parser is None and P.asks_for_reasoning(body):
                self._log_once("reasoning", logging.WARNING,
                               "chat requests ask for reasoning but the router runs "
                               "without --reasoning-parser: their reasoning stays in the content; "
                               "if vLLM runs one, give the router the same flag")
            return await self._fast(rq)
        except Fallback as f:
            self.metrics.fast_failures.labels(f.reason.value).inc()
            if self.args.fallback == "error":
                if rq.gen is not None and rq.gen.out.started:
                    return await rq.gen.out.fail(f.error.status, f.error.message)
                raise f.error from None
            return await self.standard.serve(rq, f)

    def _log_once(self, key: str, level: int, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, "%s", message)

    def _log_unsupported(self, e: P.Unsupported) -> None:
        """Once per reason: what kind of request the tier leaves to the standard path, and when
        the router's parser flags are why."""
        level = logging.WARNING
        if e.reason is Reason.TOOL_PARSER:
            why = ("the router runs without --enable-auto-tool-choice --tool-call-parser; if vLLM "
                   "runs them, give the router the same flags")
        elif e.reason is Reason.REASONING_GRAMMAR:
            why = ("with --reasoning-parser the node would constrain the reasoning too (vLLM "
                   "applies the grammar after it)")
        else:
            level, why = logging.INFO, f"e.g. {e.message}"
        what = ("go to the standard path" if self.args.fallback == "standard"
                else f"are refused with {e.status} (--fallback error)")
        self._log_once(e.reason.value, level, f"interactive requests the tier does not serve "
                                              f"({e.reason.value}) {what}: {why}")

    async def _fast(self, rq: InteractiveRequest) -> web.StreamResponse:
        prefer = self.affinity.node_for(rq.session)
        node = await self._acquire(rq, prefer)
        self.metrics.affinity.labels("new" if prefer is None else "same" if node.url == prefer else "other").inc()
        self.metrics.queue_wait.observe(time.monotonic() - rq.t_recv)
        lease = Lease(node, f"nexrt-{uuid.uuid4().hex}")
        try:
            return await self._serve(rq, lease)
        finally:
            if lease.served and lease.node is not None:
                self.affinity.served(rq.session, lease.node.url)
            self._end_lease(lease)

    async def _acquire(self, rq: InteractiveRequest, prefer: str | None = None):
        """A node for this request (`prefer`'s URL when it is free), per --when-busy; Fallback when
        the tier cannot take it."""
        pool = self.pool
        if not pool.healthy_count:
            raise self._no_node()
        if self.args.when_busy != "queue":
            node = pool.try_acquire(prefer)
            if node is not None:
                return node
            if self.args.when_busy == "standard":
                raise Fallback(Reason.BUSY, f"all {pool.healthy_count} healthy decode nodes busy",
                               APIError(429, "all decode nodes are busy; retry later"))
            self.metrics.rejected.labels("busy").inc()
            raise APIError(429, "all decode nodes are busy; retry later",
                           headers={"Retry-After": str(pool.retry_after(1))})
        try:
            return await pool.acquire(rq.t_recv + self.args.queue_timeout, prefer)
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
            self.spawn(self._cancel_and_release(node, lease.rid))
        else:
            # Finished, never admitted, or the node was ejected as unreachable (its own
            # admission/start timeouts free its slot; it rejoins only via a health check).
            self.pool.release(node)

    async def _cancel_and_release(self, node, rid: str) -> None:
        try:
            await self.nodes.cancel(node.url, rid)
            await self.nodes.wait_free(node.url, rid, self.args.admit_timeout)
        except NodeError as e:
            self.health.node_failed(node, str(e))
        finally:
            self.pool.release(node)

    async def _forget(self, url: str, rid: str) -> None:
        with contextlib.suppress(NodeError):
            await self.nodes.cancel(url, rid)

    async def _admit(self, rq: InteractiveRequest, lease: Lease) -> AdmitReply:
        """Admission with fail-over: a node that fails here is ejected and another one tried."""
        busy_until = None
        while True:
            why = node_unsupported(rq.params, lease.node)
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
                self.health.node_failed(lease.node, str(e))
                # It may have reserved the slot before the error (a slow answer): free it.
                self.spawn(self._forget(lease.node.url, lease.rid))
            busy_until = None
            node, lease.node = lease.node, None
            self.pool.release(node)
            try:
                lease.node = await self._acquire(rq)
            except (Fallback, APIError) as e:
                raise Fallback(Reason.ADMISSION, f"no node admitted the request ({e})",
                               APIError(503, "no healthy decode node could admit the request")
                               ) from None

    async def _serve(self, rq: InteractiveRequest, lease: Lease) -> web.StreamResponse:
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
                self.health.reprobe()
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
            self.health.reprobe()
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

        gen = rq.gen = self.renderer.new_gen(rq, pre["prompt_token_ids"], prompt_len, max_tokens,
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
        return await self.renderer.finish(rq)

    async def _decode(self, rq: InteractiveRequest, lease: Lease, adm: AdmitReply) -> web.StreamResponse | None:
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
                            raise DecodeFailed(f"decode node ended the request with '{fr}': "
                                                f"{msg.get('error') or 'no detail'}")
                        gen.finish = fr
                        lease.served = True
        except NodeError as e:
            self.health.node_failed(node, str(e))
            return await self._node_lost(gen, Reason.NODE_FAILED, f"decode node {node.url} failed: {e}")
        except NodeRefused as e:
            self.health.reprobe()
            return await self._node_lost(gen, Reason.HANDOFF,
                                         f"decode node {node.url} refused to decode: {e}")
        except DecodeFailed as e:
            reason = Reason.HANDOFF if gen.node_tokens == 0 else Reason.NODE_FAILED
            if reason is Reason.HANDOFF:
                self.health.reprobe()
            return await self._node_lost(gen, reason, str(e))
        rq.timing["decode_s"] = time.monotonic() - t_dec
        return None

    async def _node_lost(self, gen: Gen, reason: Reason, message: str) -> web.StreamResponse:
        if gen.node_text_sent:
            # The client already has text from the node: fail closed, never splice two sources.
            return await gen.out.fail(502, message)
        raise Fallback(reason, message, APIError(502, message))

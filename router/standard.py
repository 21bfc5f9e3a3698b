"""The standard path: vLLM (`--standard-url`, default `--vllm-url`) serving what the fast tier does
not. Standard-class requests (and `/v1/models`) are proxied byte for byte; an interactive request
the fast tier could not take or finish continues here as one streamed vLLM request
(`return_token_ids`, no `kv_transfer_params`), read chunk by chunk so the router renders it in the
client's own envelope (one response, whichever path served it)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from . import fastjson
from . import params as P
from .errors import APIError
from .fallback import DEGRADED_HEADER, Fallback
from .metrics import Metrics
from .presentation import Renderer

log = logging.getLogger("nexrt.router")

_HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                "trailers", "transfer-encoding", "upgrade", "host", "content-length"}


class StandardError(Exception):
    """The standard path refused (`status` 4xx: vLLM's message) or failed (5xx, broken stream)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Chunk:
    token_ids: list[int]
    prompt_token_ids: list[int] | None
    finish_reason: str | None
    stop_reason: object = None     # str: a stop string; int: a stop token id; None: EOS/length


async def stream(session: aiohttp.ClientSession, url: str, body: dict, connect_timeout: float,
                 read_timeout: float) -> AsyncIterator[Chunk]:
    """Yields the chunks of one streamed vLLM completion until (and including) the one with a
    finish_reason. Raises StandardError before the first chunk for a refusal, and if the stream
    breaks off. Closing the generator closes the request (vLLM aborts it)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
    try:
        async with session.post(url, json=body, timeout=timeout) as r:
            if r.status != 200:
                raw = await r.read()
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:300].decode(errors="replace")
                raise StandardError(r.status if 400 <= r.status < 500 else 502, f"vLLM: {msg}")
            while True:
                line = await r.content.readline()
                if not line:
                    raise StandardError(502, "the standard path's stream ended without a finish")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    raise StandardError(502, "the standard path's stream ended without a finish")
                obj = fastjson.loads(data)  # the first chunk carries the prompt's ids
                if "error" in obj:
                    err = obj["error"]
                    raise StandardError(502, f"vLLM: {err.get('message') if isinstance(err, dict) else err}")
                if not obj.get("choices"):
                    continue           # usage-only chunk
                c = obj["choices"][0]
                yield Chunk(list(c.get("token_ids") or ()),
                            obj.get("prompt_token_ids") or c.get("prompt_token_ids"),
                            c.get("finish_reason"), c.get("stop_reason"))
                if c.get("finish_reason"):
                    return
    except asyncio.TimeoutError:
        raise StandardError(504, f"the standard path gave nothing for {read_timeout:g}s") from None
    except (aiohttp.ClientError, json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
        raise StandardError(502, f"the standard path failed: {type(e).__name__}: {e}") from None


class StandardPath:
    """The proxy to vLLM, and the continuation of what the fast tier could not serve."""

    def __init__(self, args: argparse.Namespace, standard_url: str, session: aiohttp.ClientSession,
                 proxy_session: aiohttp.ClientSession, metrics: Metrics, renderer: Renderer):
        self.args, self.standard_url, self.metrics, self.renderer = args, standard_url, metrics, renderer
        self.session = session
        # Standard-class traffic passes through byte for byte (no decompression).
        self.proxy_session = proxy_session

    async def proxy(self, request: web.Request, base: str,
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

    async def serve(self, rq, f: Fallback) -> web.StreamResponse:
        """An interactive request the fast tier could not serve (`rq`, an InteractiveRequest),
        continued after whatever of it already exists."""
        gen, params = rq.gen, rq.params
        t0 = time.monotonic()
        # known_s: since the request arrived; decide_s: from learning the failure to asking the
        # standard path; *_at: wall clock, for comparison with other processes' events.
        rq.timing["degraded"] = {"reason": f.reason.value, "detail": f.detail,
                                 "known_s": f.known - rq.t_recv, "decide_s": t0 - f.known,
                                 "known_at": f.known_at, "fallback_at": time.time()}
        self.metrics.degraded.labels(f.reason.value).inc()
        # A request the tier does not serve at all (params None) is said once per reason, at
        # validation (router/interactive.py); a fast-tier failure each time.
        log.log(logging.DEBUG if params is None else logging.INFO,
                "interactive request continues on the standard path (%s: %s)", f.reason.value,
                f.detail)
        exact = params is not None and params.logprobs is None and params.structured is None
        if gen is None and not exact:
            # What the tier does not serve, logprobs and grammars are vLLM's own there: the
            # client's request, unchanged.
            return await self.proxy(rq.request, self.standard_url, {DEGRADED_HEADER: f.reason.value})
        if gen is None:
            # Nothing prefilled: the client's own request, rendered by the router.
            path = "/v1/chat/completions" if params.kind == "chat" else "/v1/completions"
            body = P.standard_body(rq.body, params, rq.model)
        else:
            remaining = gen.max_tokens - len(gen.ids)
            if gen.finish is not None or remaining < 1:
                gen.finish = gen.finish or "length"
                return await self.renderer.finish(rq)
            if not exact:
                # vLLM cannot resume a grammar mid-answer, nor would the logprobs be one response's
                msg = (f"the fast tier failed after the first token ({f.detail}) and a request with "
                       f"logprobs or structured output cannot continue on the standard path")
                return await gen.out.fail(502, msg)
            path = "/v1/completions"
            body = P.continuation_body(params, rq.model, gen.prompt_ids + gen.ids, remaining)
        try:
            async with contextlib.aclosing(stream(
                    self.session, self.standard_url + path, body, self.args.admit_timeout,
                    self.args.prefill_timeout)) as chunks:
                async for c in chunks:
                    if gen is None:
                        pids = c.prompt_token_ids or []
                        gen = rq.gen = self.renderer.new_gen(rq, pids, len(pids),
                                                             params.max_tokens, f.reason)
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
        except StandardError as e:
            if gen is None or not gen.out.started:
                raise APIError(e.status, f"the standard path failed: {e.message}") from None
            return await gen.out.fail(502, f"the standard path failed: {e.message}")
        rq.timing["standard_s"] = time.monotonic() - t0
        return await self.renderer.finish(rq)

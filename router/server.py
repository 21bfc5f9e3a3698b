"""`nexrt-router`: OpenAI-compatible front of the NexRT fast-decode tier.

Interactive requests take the fast path (router/interactive.py): vLLM prefills, a NexRT decode
node decodes the rest from the handed-off state; whatever the fast tier cannot take or finish
before its node's text reaches the client continues on the standard path (`--fallback standard`,
router/standard.py). Standard requests are proxied unchanged to the standard pool. This module
wires the parts into the aiohttp app and holds the command line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from . import fastjson
from .errors import APIError
from .health import NodeHealth
from .interactive import InteractivePath
from .metrics import Metrics
from .models import Models
from .pool import NodePool
from .presentation import Renderer
from .reasoning import REASONING_PARSERS
from .standard import StandardPath
from .tool_parsers import TOOL_PARSERS
from .upstream import NodeClient
from .warmup import Warmup

log = logging.getLogger("nexrt.router")

CLASS_HEADER = "X-NexRT-Class"
ROUTER_KEY: web.AppKey["Router"] = web.AppKey("router")


class Router:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.vllm_url = args.vllm_url.rstrip("/")
        self.standard_url = (args.standard_url or args.vllm_url).rstrip("/")
        self.pool = NodePool(args.decode_url, args.queue_size, args.queue_timeout,
                             args.retry_after_max)
        self.metrics = Metrics(self.pool)
        self.models = Models(self.vllm_url, args.tokenizer)
        self.renderer = Renderer(args, self.models, self.metrics)
        self._tasks: set[asyncio.Task] = set()
        # Made in start(), on the app's event loop.
        self.session: aiohttp.ClientSession | None = None
        self.proxy_session: aiohttp.ClientSession | None = None
        self.node_health: NodeHealth | None = None
        self.standard: StandardPath | None = None
        self.interactive: InteractivePath | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        conn = aiohttp.TCPConnector(limit=0)
        # the upstream bodies (the vLLM leg's carries the client's prompt) written by orjson where installed
        self.session = aiohttp.ClientSession(connector=conn, json_serialize=fastjson.dumps)
        # Standard-class traffic passes through byte for byte (no decompression).
        self.proxy_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                   auto_decompress=False)
        nodes = NodeClient(self.session, self.args.admit_timeout, self.args.node_timeout)
        warmup = None if self.args.no_warmup else Warmup(self.args, self.vllm_url, self.pool, nodes,
                                                         self.session, self.metrics, self.models)
        self.node_health = NodeHealth(self.args, self.vllm_url, self.pool, nodes, self.session,
                                      self.metrics, self._spawn, warmup)
        self.standard = StandardPath(self.args, self.standard_url, self.session,
                                     self.proxy_session, self.metrics, self.renderer)
        self.interactive = InteractivePath(self.args, self.vllm_url, self.standard_url, self.pool,
                                           nodes, self.session, self.metrics, self.models,
                                           self.node_health, self.renderer, self.standard,
                                           self._spawn)
        await self.node_health.start()

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
                resp = await self.standard.proxy(request, self.standard_url)
            else:
                resp = await self.interactive.handle(request, kind)
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
            return await self.standard.proxy(request, self.vllm_url)
        except APIError as e:
            return e.response()

    async def health(self, request: web.Request) -> web.Response:
        p = self.pool
        ok = bool(p.healthy_count)
        # With --fallback standard the router still answers everything (on the standard path).
        status = "ok" if ok else ("degraded" if self.args.fallback == "standard" else "unavailable")
        body = {"status": status, "slots_busy": p.busy_count, "queue_depth": p.queue_depth,
                "fallback": self.args.fallback, "when_busy": self.args.when_busy,
                "connector": {"state": self.node_health.connector_state,
                              "config": self.node_health.connector},
                "nodes": [{"url": n.url, "healthy": n.healthy, "busy": n.busy, "in_flight": n.in_flight, "capacity": n.capacity,
                           "reason": n.down_reason, "mismatch": n.mismatch, "warmup": n.warmup}
                          for n in p.nodes]}
        return web.json_response(body, status=200 if status != "unavailable" else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return self.metrics.response()


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
                    help="what an interactive request gets when the fast tier does not serve it "
                         "(tools it cannot parse or constrain, n > 1, penalties, ...) or cannot "
                         "take or finish it before its node's text reaches the client: the "
                         "standard path (vLLM serves it) or the tier's own 4xx/5xx")
    ap.add_argument("--when-busy", choices=("queue", "429", "standard"), default="queue",
                    help="all nodes busy: wait in the queue (429 when full / timed out), answer 429 "
                         "at once, or serve it on the standard path (needs --fallback standard)")
    ap.add_argument("--retry-after-max", type=float, default=60.0,
                    help="upper bound of a 429's Retry-After (expected wait from the queue)")
    ap.add_argument("--health-interval", type=float, default=2.0)
    ap.add_argument("--health-timeout", type=float, default=2.0)
    ap.add_argument("--probe-timeout", type=float, default=10.0,
                    help="seconds for the configuration probe of vLLM's connector")
    ap.add_argument("--no-warmup", action="store_true",
                    help="do not send a probe hand-off to a decode node when it is (re)admitted "
                         "(its first request then pays the transport's connection set-up)")
    ap.add_argument("--warmup-timeout", type=float, default=30.0,
                    help="seconds for one warm-up probe hand-off")
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
    if args.warmup_timeout <= 0:
        raise SystemExit("--warmup-timeout must be > 0")
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
"""Health and configuration of the decode tier: vLLM's connector as its probe reports it
(router/config_check.py), and every decode node checked against it (`/health` +
`/capabilities` every `--health-interval` s) before it is taken into rotation. A node taken into
rotation, restarted (another `instance` in its /health) or facing a restarted vLLM (another
`instance` in the connector's probe) is warmed once (router/warmup.py)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from . import config_check
from .metrics import Metrics
from .pool import NodePool
from .upstream import NodeClient, NodeError
from .warmup import Warmup

log = logging.getLogger("nexrt.router")

REPROBE_MIN_S = 5.0     # at most one connector probe per this many seconds after a failure


class NodeHealth:
    def __init__(self, args: argparse.Namespace, vllm_url: str, pool: NodePool, nodes: NodeClient,
                 session: aiohttp.ClientSession, metrics: Metrics, spawn: Callable,
                 warmup: Warmup | None):
        self.args, self.vllm_url, self.pool, self.nodes = args, vllm_url, pool, nodes
        self.session, self.metrics, self.spawn, self.warmup = session, metrics, spawn, warmup
        # vLLM's connector as its configuration probe reported it (router/config_check.py).
        self.connector: dict | None = None
        self.connector_state = "not probed"
        self._probe_wanted = True
        self._probe_after = 0.0
        self._probe_task: asyncio.Task | None = None

    async def start(self) -> None:
        # Learn vLLM's side first, so a misconfigured node is never taken into rotation.
        await self._probe_connector()
        # The router serves once the nodes found healthy are warmed (each bounded by
        # --warmup-timeout), so no user request meets a cold path at start.
        await asyncio.gather(*await self._round())
        self.spawn(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.health_interval)
            if self._probe_wanted and time.monotonic() >= self._probe_after and (
                    self._probe_task is None or self._probe_task.done()):
                self._probe_task = self.spawn(self._probe_connector(recheck=True))
            await self._round()

    async def _round(self) -> list[asyncio.Task]:
        """Check every node; returns the warm-ups this round started (they run on)."""
        warming = await asyncio.gather(*(self._check(n) for n in self.pool.nodes))
        return [t for t in warming if t is not None]

    def reprobe(self) -> None:
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
            await self._round()

    async def _check(self, node) -> asyncio.Task | None:
        try:
            health, caps = await self.nodes.probe(node.url, self.args.health_timeout)
        except asyncio.TimeoutError:
            # A node busy decoding on a loaded host may answer slowly; its own stream tells us
            # if it died. Idle nodes that stop answering are ejected.
            if not node.in_flight:
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
        node.instance = health.get("instance")
        self.pool.mark_up(node, caps)
        return self._warm(node)

    def _warm(self, node) -> asyncio.Task | None:
        """Start a warm-up of `node` unless it was warmed for this node process and this vLLM
        process (or is being warmed now). Not before vLLM answered a probe: a warm-up then cannot
        reach vLLM; the round after its first answer warms every node."""
        if self.warmup is None or self.connector_state == "not probed":
            return None
        key = (node.instance, (self.connector or {}).get("instance"))
        if node.warmed == key:
            return None
        node.warmed = key
        return self.spawn(self._warm_run(node))

    async def _warm_run(self, node) -> None:
        if await self.warmup.run(node) not in (None, "ok"):
            self.reprobe()      # vLLM may have restarted: a new instance is warmed again

    def node_failed(self, node, reason: str) -> None:
        self.metrics.node_failures.labels(node.url).inc()
        self.pool.mark_down(node, reason)

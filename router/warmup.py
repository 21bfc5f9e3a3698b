"""Warm-up: one probe hand-off through the real path to a decode node when it is (re)admitted, so
that the first user request's hand-off costs what the second one does.

The first hand-off from vLLM to a node sets the transport up (the connector's hello, NIXL's
remote-agent load and UCX endpoint, Mooncake's handshake and segment open); the sender keeps that
per node (nexrt_vllm/handoff/sender.py), so one hand-off pays it for all that follow. The probe is
a tiny interactive request made by the router itself: the node admits it, vLLM prefills a few
tokens with the connector claiming them, the state goes to the node, which decodes one token. It
holds the node's slot like a request (a user request meanwhile takes another node or waits its
turn), is bounded by --warmup-timeout, and counts only in nexrt_router_warmups_total{outcome}.
A failed warm-up is logged and changes nothing else: health checks decide rotation.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
import uuid

import aiohttp

from nexrt_vllm.handoff.contracts import Claim, GenerateRequest, Sampling
from nexrt_vllm.handoff.protocol import Reason

from .errors import APIError
from .metrics import Metrics
from .models import Models
from .pool import Node, NodePool
from .upstream import NodeBusy, NodeClient, NodeError, NodeRefused, vllm_prefill

log = logging.getLogger("nexrt.router")

PROMPT = "Warm-up of the NexRT hand-off path."
TOKENS = 2                  # vLLM's first token + one the node decodes
SAMPLING = Sampling(temperature=0.0, ignore_eos=True)


class WarmupFailed(Exception):
    def __init__(self, message: str, stale: bool = False):
        super().__init__(message)
        self.stale = stale      # the transfer failed: the sender had a stale connection to the node


class Warmup:
    def __init__(self, args: argparse.Namespace, vllm_url: str, pool: NodePool, nodes: NodeClient,
                 session: aiohttp.ClientSession, metrics: Metrics, models: Models):
        self.args, self.vllm_url, self.pool, self.nodes = args, vllm_url, pool, nodes
        self.session, self.metrics, self.models = session, metrics, models

    async def run(self, node: Node) -> str | None:
        """Warm `node` if its slot is free (a request that got there first sets the path up
        itself: None). Returns the outcome."""
        if not self.pool.take(node):
            log.info("decode node %s is busy: no warm-up (its request sets the path up)", node.url)
            return None
        t0 = time.monotonic()
        try:
            try:
                async with asyncio.timeout(self.args.warmup_timeout):
                    timing = await self._attempt(node)
            except WarmupFailed as e:
                if not e.stale:
                    raise
                # The sender dropped a connection to an earlier process at this control address
                # (a node restarted with a fixed --control-port): the next hand-off sets up anew.
                log.info("warm-up of decode node %s: %s; once more", node.url, e)
                async with asyncio.timeout(self.args.warmup_timeout):
                    timing = await self._attempt(node)
        except TimeoutError:
            self._record(node, "timeout", f"no answer within --warmup-timeout {self.args.warmup_timeout:g}s")
        except (NodeError, NodeBusy, NodeRefused, APIError, WarmupFailed) as e:
            self._record(node, "failed", str(getattr(e, "message", None) or e))
        else:
            self._record(node, "ok")
            log.info("decode node %s warmed in %.0f ms (prefill %.0f ms, hand-off %.1f ms on the node)",
                     node.url, 1e3 * (time.monotonic() - t0), 1e3 * timing["prefill_s"],
                     1e3 * float((timing["node"] or {}).get("transfer_s") or 0.0))
        finally:
            self.pool.release(node)
        return node.warmup

    async def _attempt(self, node: Node) -> dict:
        """One probe hand-off; its node reservation is gone when this returns or raises."""
        rid = f"nexrt-warmup-{uuid.uuid4().hex}"
        held = {"admitted": False, "ended": False}
        try:
            return await self._probe(node, rid, held)
        finally:
            if held["admitted"] and not held["ended"]:
                with contextlib.suppress(NodeError):
                    await self.nodes.cancel(node.url, rid)
                    await self.nodes.wait_free(node.url, rid, self.args.admit_timeout)

    def _record(self, node: Node, outcome: str, detail: str = "") -> None:
        node.warmup = outcome
        self.metrics.warmups.labels(outcome).inc()
        if outcome != "ok":
            log.warning("warm-up of decode node %s: %s: %s (it stays in rotation; its first request "
                        "sets the transport up)", node.url, outcome, detail)

    async def _probe(self, node: Node, rid: str, held: dict) -> dict:
        held["admitted"] = True         # from the moment the admit leaves (its answer may be lost)
        try:
            adm = await self.nodes.admit(node.url, rid)
        except NodeBusy:
            held["admitted"] = False    # the node holds another admission, not this one
            raise
        model, _ = await self.models.resolve(self.session, None)
        claim = Claim(rid, adm.generation, adm.control_addr, node.url)
        body = {"model": model, "prompt": PROMPT, **SAMPLING.to_wire(), "max_tokens": 1,
                "stream": False, "return_token_ids": True, "kv_transfer_params": claim.to_params()}
        t = time.monotonic()
        pre = await vllm_prefill(self.session, f"{self.vllm_url}/v1/completions", body,
                                 self.args.prefill_timeout)
        prefill_s = time.monotonic() - t
        h = pre["handoff"]
        if h is not None and h.status.failed:
            raise WarmupFailed(f"connector: {h.reason.value if h.reason else None}: {h.error or h.status.value}",
                               stale=h.reason is Reason.TRANSFER_FAILED)
        req = GenerateRequest(rid, pre["first_token"], TOKENS, adm.generation, SAMPLING)
        final: dict = {}
        async with contextlib.aclosing(self.nodes.generate(node.url, req)) as lines:
            async for msg in lines:
                if "finish_reason" in msg:
                    final = msg
        held["ended"] = True
        if final.get("finish_reason") not in ("stop", "length"):
            error = str(final.get("error") or "no detail")
            raise WarmupFailed(f"the node ended it with {final.get('finish_reason')!r}: {error}",
                               stale=error.startswith(Reason.TRANSFER_FAILED.value))
        return {"prefill_s": prefill_s, "node": final.get("timing")}

"""Decode-node pool: hard limit of a node's slots in flight per node (its `/capabilities`
`max_batch`, 1 for a node that does not say), the least-loaded node first, bounded FIFO of
waiters, ejection on failure and re-admission by active health checks. A request may prefer a node
(the one that holds its conversation's context, router/affinity.py): it gets a slot there when one
is free, else the least-loaded node's.

A slot is owned from `acquire()` until `release()`; the router releases only when the client's
stream has ended and the node has acknowledged any cancel, so there are no phantom free slots.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics
import time

log = logging.getLogger("nexrt.router.pool")


class QueueFull(Exception):
    pass


class QueueTimeout(Exception):
    pass


class NoHealthyNode(Exception):
    pass


SERVICE_WINDOW = 32        # service times per node that make up its "recent mean"
DEFAULT_SERVICE_S = 1.0    # assumed before any request has finished


class Node:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.healthy = False          # until the first health check or a successful request
        self.in_flight = 0            # slots held by router requests (and warm-ups)
        self.caps: dict = {}
        self.failures = 0
        self.down_reason = "not checked yet"
        self.service_times: collections.deque[float] = collections.deque(maxlen=SERVICE_WINDOW)
        self.mismatch: list[str] = []  # what /capabilities contradicts in vLLM's configuration
        self.instance: str | None = None  # the node process's id, from its /health
        self.warmed: tuple | None = None  # (node instance, vLLM instance) last warmed; None: since admitted
        self.warmup: str | None = None    # the last warm-up's outcome (router/warmup.py)

    @property
    def capacity(self) -> int:
        """Requests the node decodes at once, from its /capabilities (1 until it said)."""
        n = self.caps.get("max_batch", 1)
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1

    @property
    def busy(self) -> bool:
        """Every slot held."""
        return self.in_flight >= self.capacity

    def __repr__(self) -> str:
        return f"Node({self.url}, healthy={self.healthy}, in_flight={self.in_flight}/{self.capacity})"


class NodePool:
    def __init__(self, urls: list[str], queue_size: int, queue_timeout: float,
                 retry_after_max: float = 60.0):
        if not urls:
            raise ValueError("at least one decode node URL is required")
        self.nodes = [Node(u) for u in urls]
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.retry_after_max = retry_after_max
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._next = 0                # round-robin start, so idle nodes share the load

    # -- state -------------------------------------------------------------------------------
    @property
    def busy_count(self) -> int:
        """Slots held, over all nodes."""
        return sum(n.in_flight for n in self.nodes)

    @property
    def queue_depth(self) -> int:
        return sum(not f.done() for f in self._waiters)

    @property
    def healthy_count(self) -> int:
        return sum(n.healthy for n in self.nodes)

    def expected_wait(self, position: int) -> float:
        """Seconds until the request at queue `position` (1 = next to be served) gets a node:
        `position` completions at the tier's service rate, the sum over healthy nodes of
        capacity / (that node's recent mean service time). A node without finished requests counts
        with the mean of the others (DEFAULT_SERVICE_S when none has finished any)."""
        nodes = [n for n in self.nodes if n.healthy] or self.nodes
        known = [statistics.fmean(n.service_times) for n in nodes if n.service_times]
        fallback = statistics.fmean(known) if known else DEFAULT_SERVICE_S
        rate = sum(n.capacity / max(1e-3, statistics.fmean(n.service_times) if n.service_times
                                    else fallback) for n in nodes)
        return position / rate

    def retry_after(self, position: int | None = None) -> int:
        """Retry-After seconds for a refused request: the expected wait of the position it would
        have taken (the end of the queue by default), bounded to [1, retry_after_max]."""
        if position is None:
            position = self.queue_depth + 1
        wait = self.expected_wait(max(1, position))
        return int(max(1, min(self.retry_after_max, math.ceil(wait))))

    def record_service_time(self, node: Node, seconds: float) -> None:
        node.service_times.append(seconds)

    # -- acquire / release -------------------------------------------------------------------
    def _take_free(self, prefer: str | None = None) -> Node | None:
        """A slot on `prefer`'s node when it has one free, else on the healthy node with the fewest
        requests in flight (ties: round-robin)."""
        if prefer is not None:
            node = next((x for x in self.nodes if x.url == prefer), None)
            if node is not None and node.healthy and not node.busy:
                node.in_flight += 1
                return node
        n, best = len(self.nodes), None
        for i in range(n):
            node = self.nodes[(self._next + i) % n]
            if node.healthy and not node.busy and (best is None or node.in_flight < best[1].in_flight):
                best = (i, node)
        if best is None:
            return None
        self._next = (self._next + best[0] + 1) % n
        best[1].in_flight += 1
        return best[1]

    def take(self, node: Node) -> bool:
        """Hold a slot of this node now if it is idle (a warm-up); False when a request holds one."""
        if not node.healthy or node.in_flight:
            return False
        node.in_flight += 1
        return True

    def try_acquire(self, prefer: str | None = None) -> Node | None:
        """A free healthy node now (`prefer`'s URL if it is one), or None (never queues; waiters
        keep their turn)."""
        return None if self.queue_depth else self._take_free(prefer)

    async def acquire(self, deadline: float | None = None, prefer: str | None = None) -> Node:
        """A free healthy node (`prefer`'s URL if it is one), waiting FIFO until `deadline`
        (monotonic) if all are busy; a waiter takes the first node freed."""
        if not self.queue_depth:
            node = self._take_free(prefer)
            if node is not None:
                return node
        if not self.healthy_count:
            raise NoHealthyNode()
        if self.queue_depth >= self.queue_size:
            raise QueueFull()
        if deadline is None:
            deadline = time.monotonic() + self.queue_timeout
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                return await fut
        except BaseException as e:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Handed a node in the same tick we timed out or were cancelled: give it back.
                self.release(fut.result())
            fut.cancel()
            if isinstance(e, TimeoutError):
                raise QueueTimeout() from None
            raise
        finally:
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass

    def release(self, node: Node) -> None:
        assert node.in_flight > 0, f"double release of {node}"
        node.in_flight -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self._waiters:
            if self._waiters[0].done():
                self._waiters.popleft()
                continue
            node = self._take_free()
            if node is None:
                return
            self._waiters.popleft().set_result(node)

    # -- health ------------------------------------------------------------------------------
    def mark_down(self, node: Node, reason: str) -> None:
        if node.healthy:
            log.warning("ejecting decode node %s: %s", node.url, reason)
        node.healthy = False
        node.down_reason = reason
        node.warmed = None            # once back in rotation, it is warmed again
        if not self.healthy_count:
            # Nobody can serve the queue any more: fail the waiters now rather than at timeout.
            while self._waiters:
                f = self._waiters.popleft()
                if not f.done():
                    f.set_exception(NoHealthyNode())

    def mark_up(self, node: Node, caps: dict) -> None:
        if not node.healthy:
            log.info("decode node %s is healthy", node.url)
        node.healthy = True
        node.failures = 0
        node.down_reason = ""
        node.caps = caps
        self._dispatch()


def _loop_time(monotonic_deadline: float) -> float:
    # asyncio's clock is time.monotonic() on every platform we run on, but convert explicitly.
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())

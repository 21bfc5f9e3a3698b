"""The router's Prometheus metrics (`GET /metrics`, router/README.md "Metrics")."""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from .fallback import Reason
from .pool import NodePool

WARMUP_OUTCOMES = ("ok", "failed", "timeout")


class Metrics:
    def __init__(self, pool: NodePool):
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
        self.warmups = Counter("nexrt_router_warmups", "Probe hand-offs that warm the transport "
                               "path to a decode node when it is (re)admitted, by outcome (not "
                               "counted as requests)", ["outcome"], registry=r)
        for outcome in WARMUP_OUTCOMES:
            self.warmups.labels(outcome)
        self.affinity = Counter("nexrt_router_affinity", "Interactive requests by the node they got "
                                "(router/affinity.py): same = the node of the conversation's last "
                                "turn, other = that node was not free, new = no turn known",
                                ["outcome"], registry=r)
        for outcome in ("same", "other", "new"):
            self.affinity.labels(outcome)
        self.tokens = Counter("nexrt_router_generated_tokens", "Completion tokens streamed on the "
                              "interactive path", registry=r)
        self.ttft = Histogram("nexrt_router_ttft_seconds", "Router receive → first token sent",
                              registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.queue_wait = Histogram("nexrt_router_queue_wait_seconds", "Time waiting for a node",
                                    registry=r, buckets=(.001, .01, .1, .5, 1, 5, 30))
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

    def response(self) -> web.Response:
        """The exposition of every metric (the body of `GET /metrics`)."""
        resp = web.Response(body=generate_latest(self.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

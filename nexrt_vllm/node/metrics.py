"""Prometheus metrics of one decode node (own registry, served at GET /metrics)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# GPU steps take 1-3 ms (fine buckets there), CPU steps tens of ms.
_STEP_BUCKETS = (0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.00175, 0.002, 0.0025, 0.003, 0.004, 0.006, 0.008, 0.01,
                 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_XFER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class NodeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.admissions = Counter("nexrt_admissions", "Requests admitted", registry=r)
        self.refusals = Counter("nexrt_refusals", "Refused admissions/messages by reason", ["reason"], registry=r)
        self.finished = Counter("nexrt_requests_finished", "Admissions ended, by outcome", ["outcome"], registry=r)
        # a `hello` is a sender's connection set-up towards this node (it caches the answer after)
        self.control = Counter("nexrt_control_messages", "Control messages received, by type", ["type"],
                               registry=r)
        for kind in ("hello", "begin", "done", "abort"):
            self.control.labels(kind)
        self.transfer_bytes = Counter("nexrt_transfer_bytes", "Hand-off bytes received", registry=r)
        self.transfer_seconds = Histogram("nexrt_transfer_seconds", "accept -> done per hand-off",
                                          buckets=_XFER_BUCKETS, registry=r)
        self.convert_seconds = Histogram("nexrt_convert_seconds", "received pages -> native state",
                                         buckets=_XFER_BUCKETS, registry=r)
        self.tokens = Counter("nexrt_tokens_generated", "Tokens streamed", registry=r)
        self.step_seconds = Histogram("nexrt_decode_step_seconds", "Decode step latency", buckets=_STEP_BUCKETS,
                                      registry=r)
        self.busy = Gauge("nexrt_busy_slots", "Admitted requests in flight (0 .. max_batch)", registry=r)
        self.capacity = Gauge("nexrt_slots", "Requests the node admits at once (--max-batch)", registry=r)
        self.batch_size = Histogram("nexrt_batch_size", "Requests advanced per batch step",
                                    buckets=tuple(float(b) for b in range(1, 9)), registry=r)
        self.acceptance_length = None  # speculative decoding only (speculative())
        self.graph = Gauge("nexrt_decode_graph", "1 for the decode path in use (fused | eager graph, or off)",
                           ["mode", "device"], registry=r)
        # the context cache (node/context_cache.py)
        self.context_capacity = Gauge("nexrt_context_cache_capacity_bytes", "Context cache size (--context-cache-gib)",
                                      registry=r)
        self.context_bytes = Gauge("nexrt_context_cache_bytes", "Attention rows the context cache holds", registry=r)
        self.context_entries = Gauge("nexrt_context_cache_entries", "Contexts the context cache holds", registry=r)
        self.context_lookups = Counter("nexrt_context_cache_lookups", "Hand-off begins looked up, by outcome (hit: "
                                       "some tokens held; miss; unusable: no prompt ids, or a sharded hand-off)",
                                       ["outcome"], registry=r)
        self.context_held_tokens = Counter("nexrt_context_cache_held_tokens",
                                           "Prompt tokens whose attention rows came from the cache, not the wire",
                                           registry=r)
        self.context_stores = Counter("nexrt_context_cache_stores", "Finished requests offered to the cache, by "
                                      "outcome (kept | no_room)", ["outcome"], registry=r)
        self.context_dropped = Counter("nexrt_context_cache_dropped", "Entries removed (evicted: least recently "
                                       "used; superseded: a newer entry holds its blocks)", ["why"], registry=r)
        for outcome in ("hit", "miss", "unusable"):
            self.context_lookups.labels(outcome)

    def speculative(self, method: str, num_tokens: int, synthetic_length: float | None = None) -> None:
        """Speculative decoding is on: tokens emitted per verify round (1 .. num_tokens + 1); with a pinned
        (synthetic) acceptance schedule, its mean length too."""
        r = self.registry
        Gauge("nexrt_speculative", "1 for the speculative method in use", ["method", "num_speculative_tokens"],
              registry=r).labels(method=method, num_speculative_tokens=str(num_tokens)).set(1)
        Gauge("nexrt_spec_synthetic_acceptance_length", "Pinned mean tokens per round (benchmark mode); 0 = off",
              registry=r).set(synthetic_length or 0.0)
        self.acceptance_length = Histogram(
            "nexrt_spec_acceptance_length", "Tokens emitted per speculative verify round (accepted drafts + 1)",
            buckets=tuple(float(k) for k in range(1, num_tokens + 2)), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Why the fast tier could not serve a request, and what `--fallback error` answers instead.

A `Fallback` is raised wherever the fast path gives up before any node-produced text reached the
client; the router then continues the request on the standard path (default) or answers
`error` (`--fallback error`). Reasons are the label values of `nexrt_router_degraded_total`.
"""
from __future__ import annotations

import enum
import time

from .errors import APIError

# Names the reason on a response that the standard path served (when it precedes the headers).
DEGRADED_HEADER = "x-nexrt-degraded"


class Reason(str, enum.Enum):
    NO_NODE = "no_node"            # no decode node in rotation (down, ejected, misconfigured)
    BUSY = "busy"                  # every node busy (--when-busy standard)
    ADMISSION = "admission"        # no node admitted it (all unreachable or refusing)
    HANDOFF = "handoff"            # the KV hand-off failed or was refused (connector or node)
    NODE_FAILED = "node_failed"    # the node died or failed before its text reached the client
    TOO_LONG = "too_long"          # longer than the nodes' context, within vLLM's
    PREFILL = "prefill"            # the prefill server failed (only when --standard-url differs)
    UNSUPPORTED = "unsupported"    # the node cannot serve an output option (logprobs, a grammar)


class Fallback(Exception):
    def __init__(self, reason: Reason, detail: str, error: APIError):
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail, self.error = Reason(reason), detail, error
        self.known = time.monotonic()      # when the router learned it
        self.known_at = time.time()

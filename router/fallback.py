"""Why the fast tier could not serve a request, and what `--fallback error` answers instead.

A `Fallback` is raised wherever the fast path gives up before any node-produced text reached the
client (a request it cannot serve is known at validation, router/params.py `Unsupported`); the
router then continues the request on the standard path (default) or answers `error`
(`--fallback error`). Reasons are the label values of `nexrt_router_degraded_total`.
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
    # What the interactive tier does not implement but vLLM serves, known from the request alone
    # (router/params.py): the client's request goes to the standard path unchanged.
    TOOL_PARSER = "tool_parser"    # tools with tool_choice "auto"; the router has no tool parser
    TOOL_CHOICE_REQUIRED = "tool_choice_required"
    TOOL_CHOICE_NAMED = "tool_choice_named"            # tool_choice names a function
    STRICT_TOOLS = "strict_tools"                      # a tool with "strict": true
    PARALLEL_TOOL_CALLS = "parallel_tool_calls"        # parallel_tool_calls: false with tools
    COMPLETION_TOOLS = "completion_tools"              # tools / tool_choice on /v1/completions
    BATCHED_PROMPT = "batched_prompt"                  # several prompts in one completion
    REQUEST_OPTION = "request_option"  # n, best_of, penalties, ...; streamed token ids; a seed < 0
    LOGPROBS = "logprobs"          # more than 20 per token or -1 (vLLM's --max-logprobs decides)
    GRAMMAR = "grammar"            # structured output the node does not enforce as vLLM would
    REASONING_GRAMMAR = "reasoning_grammar"            # structured output with --reasoning-parser


class Fallback(Exception):
    def __init__(self, reason: Reason, detail: str, error: APIError):
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail, self.error = Reason(reason), detail, error
        self.known = time.monotonic()      # when the router learned it
        self.known_at = time.time()

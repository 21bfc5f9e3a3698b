"""Clients of a node that decodes several requests at once (`--max-batch`), for tests: a `DecodeBatch`
job's stream as the node's generate handler sees it, and one /v1/generate stream read in a thread."""
from __future__ import annotations

import json
import threading
import time

from nexrt_vllm.node.batch import Job


class JobRequest:
    """One job's stream as the node's generate handler sees it: tokens, then one end (`stop` set after
    `cancel_after` tokens)."""

    def __init__(self, rid, slot, prompt, params, cancel_after=None):
        self.rid, self.slot, self.prompt, self.params, self.cancel_after = rid, slot, prompt, params, cancel_after
        self.tokens, self.logprobs, self.end, self.released = [], [], None, threading.Event()
        self.stop = threading.Event()

    def job(self, first: int) -> Job:
        return Job(self.rid, self.slot, lambda engine: engine.prefill(self.prompt), first, self.params, None,
                   self.put, self.released.set, stop=self.stop)

    def put(self, kind, value):
        if kind == "tok":
            self.tokens.append(value.token)
            self.logprobs.append(value.logprob)
            if self.cancel_after is not None and len(self.tokens) >= self.cancel_after:
                self.stop.set()
        elif kind in ("end", "err"):
            self.end = (kind, value)


class GenerateStream(threading.Thread):
    """One /v1/generate stream of a `NodeProcess` read in its own thread; `lines` fill as tokens arrive
    (the request cancelled after `cancel_after` of them)."""

    def __init__(self, node, rid, gen, first, max_tokens, cancel_after=None, timeout=120.0, **kw):
        super().__init__(daemon=True)
        self.node, self.rid, self.gen, self.first, self.max_tokens, self.kw = node, rid, gen, first, max_tokens, kw
        self.cancel_after, self.timeout, self.lines, self.error = cancel_after, timeout, [], None

    def run(self):
        try:
            with self.node.open_generate(self.rid, self.gen, self.first, self.max_tokens, timeout=self.timeout,
                                         **self.kw) as r:
                for raw in r:
                    if raw.strip():
                        self.lines.append(json.loads(raw))
                        if self.cancel_after is not None and len(self.lines) == self.cancel_after:
                            self.node.call("POST", "/v1/cancel", {"rid": self.rid})
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def tokens(self):
        return [x["token"] for x in self.lines if "token" in x]

    def wait_tokens(self, n, timeout=60.0):
        deadline = time.monotonic() + timeout
        while len(self.tokens()) < n and self.is_alive():
            assert time.monotonic() < deadline, f"{self.rid}: {len(self.tokens())} tokens after {timeout}s"
            time.sleep(0.01)

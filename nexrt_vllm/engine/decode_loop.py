"""When a request's decode loop ends, and why: the rules every loop of the engine follows.

A request whose state holds N tokens continues from `first_token` (token N, already emitted by the
caller). Its loop yields the tokens after it until one of:
- a stop token: one of `stop_token_ids`, EOS unless `ignore_eos`, or the token with which the
  grammar (`constraint`) terminates; it is yielded, finish reason "stop";
- `max_tokens`, which counts `first_token` (so at most max_tokens - 1 are yielded): "length";
- a full context (the state holds max_seq_len tokens): "length".
A `first_token` that stops ends the request before any token ("stop").

The eager loop (`Engine`), the eager speculative rounds (`spec.speculative.Speculator`), the step
graph (`gpu.runner.GraphRunner`), the round graph (`gpu.spec_round.SpecRunner`, through `Engine`)
and the batch step (`gpu.batch_runner.BatchRunner`, one per request slot) all decide by a
`DecodeLoop`; `Engine.finish_reason` is its `finish_reason`.
"""
from __future__ import annotations

from collections.abc import Iterable

from nexrt_vllm.engine.sampling import SamplingParams


class DecodeLoop:
    """One request's stop / length bookkeeping: `start` with the first token, `room` before each
    step (or round), `emit` after each yielded token, `end` when the loop runs out of room."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int], constraint=None):
        self.stop_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_token_ids)
        self.max_tokens = params.max_tokens
        self.constraint = constraint
        self.produced = 1  # first_token
        self.finish_reason: str | None = None

    def stops(self, token: int) -> bool:
        """Whether `token` ends the request: a stop id, EOS, or (the constraint having accepted it) the
        grammar's end."""
        return token in self.stop_ids or (self.constraint is not None and self.constraint.terminated)

    def start(self, first_token: int) -> bool:
        """Whether any token may follow `first_token`; if not, the request finished with "stop"."""
        if self.stops(first_token):
            self.finish_reason = "stop"
            return False
        return True

    def room(self, state) -> int:
        """How many more tokens the loop may yield from `state` (a DecodeState): what max_tokens leaves
        and what the context still holds."""
        return min(self.max_tokens - self.produced, state.max_seq_len - state.seq_len)

    def emit(self, token: int) -> bool:
        """Count a yielded token; True when the loop ends with it (finish reason set)."""
        self.produced += 1
        if self.stops(token):
            self.finish_reason = "stop"
        elif self.produced >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def end(self) -> None:
        """The loop stopped without a stop token: finish reason "length" (max_tokens or a full context)."""
        if self.finish_reason is None:
            self.finish_reason = "length"

"""The batch runner: one captured CUDA graph steps every live request slot once (`--max-batch`).

`BatchRunner` captures a `BatchDecoder` step (gpu/batch_decoder.py) over the first k slots for each
bucket k of `buckets` (2, 4, 8, ... up to B) and replays the smallest bucket that holds every live
slot (the node admits into the lowest free slot), so a few requests on a large node pay for few
rows; which slots step is the device mask `live`, so requests join and leave between replays
without a new capture, and a slot that is not live costs its rows of the GEMVs (no weight bytes)
and nothing else. The host keeps one replay in flight ahead of the one it reads (as gpu/runner.py does for one
request), reads each live slot's token from its column of the control ring and applies that
request's stop rules (engine/decode_loop.py). A request never runs past its room (max_tokens and
the context): a replay includes a slot only while the request may still take a token, so the one
replay that runs past a stop is the only token discarded, and it never writes past the slot's
context. Host writes to the device (a joining slot's token and position, the mask) are stream-ordered
fills between replays; a slot's state is loaded (the hand-off) on the same stream, after the
replays that stepped its previous request.

Greedy requests without logprobs or grammar only (`join` refuses the others with an EngineError).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nexrt_vllm.engine.decode_loop import DecodeLoop
from nexrt_vllm.engine.errors import EngineError, InputError, StateError
from nexrt_vllm.engine.gpu.batch_decoder import BatchDecoder
from nexrt_vllm.engine.gpu.control import wait_record
from nexrt_vllm.engine.gpu.runner import capture_graph
from nexrt_vllm.engine.state import DecodeState


def row_buckets(n: int, least: int) -> list[int]:
    """The slot counts a batch graph is captured for: least, 2 x least, ... below n, and n."""
    out, k = [], least
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def bucket(buckets: list[int], slots: int) -> int:
    """The smallest bucket holding `slots` slots (0..slots-1)."""
    return next(k for k in buckets if k >= slots)


@dataclass(frozen=True)
class SlotEvent:
    """What one batch step gave a slot's request: its token, and the finish reason when the request ended
    with it ("stop" | "length"; the slot is then free)."""
    slot: int
    token: int
    finish_reason: str | None = None


@dataclass(eq=False)
class _Request:
    slot: int
    loop: DecodeLoop
    state: DecodeState
    budget: int  # replays it may still be part of (its room left)
    pending: int = 0  # replays enqueued with it whose token is not read yet


class SlotRunner:
    """What the batch graphs' host sides share (`BatchRunner`, gpu/batch_round.py `BatchRoundRunner`): the
    request slots, one captured graph per bucket of leading slots (`least`, 2 x least, ... n), the live
    mask and the replay of the smallest bucket holding the requests of a replay."""

    least = 2  # the smallest bucket
    what = "batch step"  # the graph, in errors

    def __init__(self, decoder, timeout_s: float = 60.0):
        self.d, self.n, self.timeout_s = decoder, decoder.n, timeout_s
        self.buckets = row_buckets(self.n, self.least)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> its graph
        self.bucket_replays = dict.fromkeys(self.buckets, 0)
        self.requests: list = [None] * self.n
        self._live = [False] * self.n  # the host's copy of d.live
        self.replays = 0

    @property
    def busy(self) -> list[int]:
        """The slots with a request decoding."""
        return [b for b, r in enumerate(self.requests) if r is not None]

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The graph over every slot (None before `capture`, or on the CPU)."""
        return self.graphs.get(self.n)

    def _capture(self, live, clear) -> bool:
        """Capture every bucket's graph (CUDA, once) with no slot live; `live` / `clear` as `capture_graph`'s.
        False when there was nothing to do."""
        d = self.d
        if self.graphs or d.states.device.type != "cuda":
            return False
        self._set_live([False] * self.n, force=True)
        for k in self.buckets:
            self.graphs[k] = capture_graph(lambda k=k: d.launch(k), live, clear)
        return True

    def _check_join(self, slot: int, first_token: int, params) -> DecodeState:
        """The checks of a `join` (greedy without logprobs, a free slot, a token id, a loaded state): the
        slot's state."""
        if not (params.greedy and params.logprobs is None):
            raise EngineError(f"the {self.what} decodes greedy requests without logprobs (temperature 0, no "
                              f"logprobs)")
        if not 0 <= slot < self.n or self.requests[slot] is not None:
            raise EngineError(f"slot {slot} is not a free slot of this batch ({self.n} slots, busy {self.busy})")
        vocab = self.d.cfg.vocab_size
        if isinstance(first_token, bool) or not isinstance(first_token, int) or not 0 <= first_token < vocab:
            raise InputError(f"first_token must be an int in [0, {vocab}), got {first_token!r}")
        st = self.d.states.states[slot]
        if st.seq_len == 0:
            raise StateError(f"slot {slot}: its state is empty (load a hand-off or prefill first)")
        return st

    def _start_loop(self, st: DecodeState, first_token: int, params) -> tuple[DecodeLoop, int] | str:
        """A joining request's stop rules and the tokens it may take from `st` (its room), or the finish
        reason when it ends before any token (`first_token` stops it, or it has no room)."""
        loop = DecodeLoop(params, self.d.cfg.eos_token_ids)
        if not loop.start(first_token):
            return loop.finish_reason
        room = loop.room(st)
        if room <= 0:
            loop.end()
            return loop.finish_reason
        return loop, room

    def leave(self, slot: int) -> None:
        """End the request in `slot` (finished, cancelled, failed): no later replay steps it; what a replay
        already in flight gives it is dropped. The slot is free at once."""
        self.requests[slot] = None

    def generate(self, slot: int, first_token: int, params) -> Iterator[int]:
        """One request's tokens (`join`, then `step` until it ends), the batch's other slots idle: a request
        alone, for tests and warm-up."""
        if self.busy:
            raise EngineError(f"generate runs one request alone; slots {self.busy} are decoding")
        if self.join(slot, first_token, params) is not None:
            return
        while True:
            for ev in self.step():
                yield ev.token
                if ev.finish_reason is not None:
                    return

    def _set_live(self, want: list[bool], force: bool = False) -> None:
        """Write the live words that change (stream-ordered fills between replays)."""
        for b in range(self.n):
            if force or want[b] != self._live[b]:
                self.d.live[b].fill_(int(want[b]))
                self._live[b] = want[b]

    def _replay(self, slots: list[int]) -> None:
        """One replay with exactly `slots` live: the smallest bucket's graph holding them (on the CPU its
        launches, in order)."""
        want = [False] * self.n
        for b in slots:
            want[b] = True
        self._set_live(want)
        k = bucket(self.buckets, max(slots) + 1)
        if self.graphs:
            self.graphs[k].replay()
        else:
            self.d.launch(k)
        self.replays += 1
        self.bucket_replays[k] += 1


class BatchRunner(SlotRunner):
    """The batch step graph over a `BatchDecoder` and the host side of its slots: `join`, `step`, `leave`."""

    def __init__(self, decoder: BatchDecoder, timeout_s: float = 60.0):
        super().__init__(decoder, timeout_s)
        self._inflight: deque[tuple[int, list[_Request]]] = deque()  # (step number, its live requests)
        self._step = int(decoder.step.item())  # the device step counter after the replays enqueued

    def capture(self) -> None:
        """Compile and capture the step graphs (CUDA; on the CPU each replay runs the launches in order). The
        warm-up step runs with no slot live, so it leaves every slot's state, token and position as
        they were; the step counter and the ring are put back."""
        d = self.d
        if self._capture((d.step, d.tok, d.pos), (d.ring, d.ring_host)):
            self._step = int(d.step.item())

    # ---- requests ------------------------------------------------------------------------------------
    def join(self, slot: int, first_token: int, params) -> str | None:
        """Start a request in `slot`, whose state holds N tokens (loaded) and whose token N is `first_token`:
        it steps from the next replay on. Returns None, or the finish reason when the request ends
        before any token (`first_token` stops it, or it has no room). Greedy without logprobs only."""
        st = self._check_join(slot, first_token, params)
        started = self._start_loop(st, first_token, params)
        if isinstance(started, str):
            return started
        loop, room = started
        self.d.tok[slot].fill_(first_token)
        self.d.pos[slot].fill_(st.seq_len)
        self.requests[slot] = _Request(slot, loop, st, room)
        return None

    def step(self) -> list[SlotEvent]:
        """Read the oldest replay in flight (enqueuing one first when none is) after enqueuing the next,
        and return a `SlotEvent` per request it stepped that is still in its slot; a request that ends
        has left when this returns. [] when no slot is live."""
        if not self._inflight:
            self._enqueue()
        if not self._inflight:
            return []
        self._enqueue()  # step k + 1 in flight before we read step k
        step, reqs = self._inflight.popleft()
        events = []
        for r in reqs:
            r.pending -= 1
            if self.requests[r.slot] is not r:
                continue
            tok = wait_record(self.d.ring_host[:, r.slot], step, self.timeout_s, "batch step")
            r.state.seq_len += 1
            end = r.loop.emit(tok)
            if not end and r.budget == 0 and r.pending == 0:
                r.loop.end()  # its room is used up (a full context): "length"
                end = True
            events.append(SlotEvent(r.slot, tok, r.loop.finish_reason if end else None))
            if end:
                self.leave(r.slot)
        return events

    # ---- replays -------------------------------------------------------------------------------------
    def _enqueue(self) -> None:
        """Enqueue one replay over the requests that may still take a token (none: nothing)."""
        reqs = [r for r in self.requests if r is not None and r.budget > 0]
        if not reqs:
            return
        for r in reqs:
            r.budget -= 1
            r.pending += 1
        self._replay([r.slot for r in reqs])
        self._step += 1
        self._inflight.append((self._step, reqs))

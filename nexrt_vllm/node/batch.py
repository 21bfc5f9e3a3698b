"""DecodeBatch: up to B requests decoding together on one node (``nexrt-decode --max-batch B``).

One worker thread owns every slot's engine. Each batch step advances every active request by one
step of its own decode loop (one token, or one speculative round), in slot order; requests join
(their hand-off is converted into their slot's state first) and leave (finished, cancelled,
failed) between steps, so one request's end never disturbs the others' tokens. Slot engines share
the weights and have their own DecodeState (`Engine.slots`), so each request keeps its own
position, context length, GDN state, sampler, seed, logprobs, grammar constraint and stops.

With the batch graph (`Engine.use_batch_graph`: a CUDA node with --graph fused and --max-batch > 1)
greedy requests without logprobs or grammar are stepped together by one replay of the captured
batch step per batch step (engine/gpu/batch_runner.py: it applies each request's stop rules); the
others run their slot engine's eager loop in the same batch step.

With speculative decoding (`--speculative mtp`, eager: CPU or --graph off) every slot engine has a
Speculator of its own (`Engine.slot`: drafter cache, verify scratch), so a request's rounds are the
rounds it would run alone; a batch step runs one round of each speculating request and sends all
its tokens. Grammar-constrained requests take their one-token step, as alone.

The thread talks back to the asyncio loop only through each job's ``put`` (thread-safe) and
``finished`` callbacks.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nexrt_vllm.engine.sampling import Sampled

log = logging.getLogger("nexrt.node")

IDLE_WAIT_S = 0.5  # an idle thread re-checks for close at this period


@dataclass(eq=False)
class Job:
    """One request's decode. `load(engine)` fills the slot's state (the converted hand-off);
    `put(kind, value)` receives ("converted", None), ("tok", record), ("end", finish_reason) or
    ("err", text), the last one exactly once; `ended(engine, tokens)` (optional) runs in the decode
    thread when the stream ended without an error (finished or cancelled), with the slot's engine
    and the tokens sent, before the final message; `finished()` runs after the job left the batch
    (its slot is no longer touched)."""
    rid: str
    slot: int
    load: Callable
    first_token: int
    params: object
    constraint: object
    put: Callable
    finished: Callable
    stop: threading.Event = field(default_factory=threading.Event)
    ended: Callable | None = None
    steps: object = None  # the slot engine's step iterator, once loaded (None: on the batch graph)
    on_graph: bool = False  # stepped by the batch graph (the engine's BatchRunner)
    tokens: list = field(default_factory=list)  # the token ids sent


class DecodeBatch:
    def __init__(self, engines: list, metrics=None):
        if not engines:
            raise ValueError("a batch needs at least one slot engine")
        self.engines = engines
        self.metrics = metrics
        self.runner = engines[0].batch_graph  # the batch step of every slot (gpu/batch_runner.py), or None
        self._graph_jobs: dict[int, Job] = {}  # slot -> its job on the batch graph
        self._pending: list[Job] = []
        self._active: list[Job] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="nexrt-decode", daemon=True)
        self._thread.start()

    @property
    def capacity(self) -> int:
        return len(self.engines)

    def submit(self, job: Job) -> None:
        if not 0 <= job.slot < len(self.engines):
            raise ValueError(f"slot {job.slot} outside [0, {len(self.engines)})")
        with self._cv:
            if self._closed:
                raise RuntimeError("the decode batch is closed")
            self._pending.append(job)
            self._cv.notify()

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    # ---- the worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._active and not self._closed:
                    self._cv.wait(IDLE_WAIT_S)
                if self._closed:
                    jobs, self._pending = self._active + self._pending, []
                    break
                joining, self._pending = self._pending, []
            for job in joining:
                self._join(job)
            t = time.perf_counter()
            stepped = self._graph_step() if self._graph_jobs else 0
            for job in [j for j in self._active if not j.on_graph]:
                stepped += self._step(job) > 0
            if stepped and self.metrics is not None:
                self.metrics.batch_size.observe(stepped)
                self.metrics.step_seconds.observe(time.perf_counter() - t)
        for job in jobs:  # closing: every stream still open ends as an error
            self._leave(job, "err", "the decode node is shutting down", joined=job in self._active)

    def _join(self, job: Job) -> None:
        if job.stop.is_set():
            self._leave(job, "end", "cancelled", joined=False)
            return
        engine = self.engines[job.slot]
        try:
            job.load(engine)
            job.put("converted", None)
            if self._fits_graph(job):
                ended = self.runner.join(job.slot, job.first_token, job.params)
                if ended is not None:  # the first token already ends it
                    self._leave(job, "end", ended, joined=False)
                    return
                job.on_graph = True
                self._graph_jobs[job.slot] = job
            else:
                job.steps = engine.steps(job.first_token, job.params, job.constraint)
        except Exception as e:  # noqa: BLE001 - a bad hand-off ends this request only
            log.exception("loading rid=%s into slot %d failed", job.rid, job.slot)
            self._leave(job, "err", f"{type(e).__name__}: {e}", joined=False)
            return
        self._active.append(job)

    def _fits_graph(self, job: Job) -> bool:
        """Whether the batch graph steps this job: greedy, no logprobs, no grammar."""
        p = job.params
        return self.runner is not None and job.constraint is None and p.greedy and p.logprobs is None

    def _graph_step(self) -> int:
        """One replay's tokens for the jobs on the batch graph (the next replay already enqueued); the
        number of tokens sent."""
        for job in list(self._graph_jobs.values()):
            if job.stop.is_set():
                self._leave(job, "end", "cancelled")
        if not self._graph_jobs:
            return 0
        try:
            events = self.runner.step()
        except Exception as e:  # noqa: BLE001 - the batch step failed: every request on it ends as an error
            log.exception("the batch step failed")
            for job in list(self._graph_jobs.values()):
                self._leave(job, "err", f"{type(e).__name__}: {e}")
            return 0
        sent = 0
        for ev in events:
            job = self._graph_jobs.get(ev.slot)
            if job is None:
                continue
            if job.stop.is_set():  # cancelled while this step ran: its token is not sent
                self._leave(job, "end", "cancelled")
                continue
            if self.metrics is not None:
                self.metrics.tokens.inc()
            job.tokens.append(int(ev.token))
            job.put("tok", Sampled(ev.token))
            sent += 1
            if ev.finish_reason is not None:
                self._leave(job, "end", ev.finish_reason)
        return sent

    def _step(self, job: Job) -> int:
        """One step of `job`'s loop: one token, or every token of one speculative round (the slot's
        Speculator holds the round's later tokens back, `buffered`); the number of tokens sent."""
        spec = self.engines[job.slot].speculative
        sent = 0
        while True:
            if job.stop.is_set():
                self._leave(job, "end", "cancelled")
                return sent
            try:
                rec = next(job.steps)
            except StopIteration:
                self._leave(job, "end", self.engines[job.slot].finish_reason or "length")
                return sent
            except Exception as e:  # noqa: BLE001 - any engine failure ends this stream as an error
                log.exception("decode of rid=%s failed", job.rid)
                self._leave(job, "err", f"{type(e).__name__}: {e}")
                return sent
            if job.stop.is_set():  # cancelled while this step ran: its token is not sent
                self._leave(job, "end", "cancelled")
                return sent
            if self.metrics is not None:
                self.metrics.tokens.inc()
            job.tokens.append(int(rec.token))
            job.put("tok", rec)
            sent += 1
            if spec is None or spec.buffered == 0:
                return sent

    def _leave(self, job: Job, kind: str, value, joined: bool = True) -> None:
        if job.on_graph:
            self.runner.leave(job.slot)
            del self._graph_jobs[job.slot]
            job.on_graph = False
        if joined:
            self._active.remove(job)
            if job.steps is not None:
                try:
                    job.steps.close()
                except Exception:  # noqa: BLE001 - a generator that fails while closing is already ended
                    log.exception("closing the stream of rid=%s failed", job.rid)
            if kind == "end" and job.ended is not None:
                try:
                    job.ended(self.engines[job.slot], job.tokens)
                except Exception:  # noqa: BLE001 - the request already streamed: its end stands
                    log.exception("after the stream of rid=%s", job.rid)
        job.put(kind, value)
        job.finished()

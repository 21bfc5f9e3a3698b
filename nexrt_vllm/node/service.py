"""The decode node's admission state machine, control-message handlers and decode loop.

Everything here runs on one asyncio loop (HTTP handlers, the ZMQ control endpoint and the reaper
share it), so the state needs no locks; only the engines run in a worker thread (node/batch.py:
every decoding request of the node, one step each per batch step) and talk back through
``loop.call_soon_threadsafe``.

Up to ``max_batch`` slots (``--max-batch``, default 1). An admission takes the lowest free slot at
``/v1/admit`` and moves RESERVED -> RECEIVING (``begin`` accepted, buffer assigned) -> READY
(``done`` validated) -> DECODING (``/v1/generate``) -> released. Each state has a deadline (admit,
transfer, start timeouts), enforced by the reaper, so a missing peer never pins a slot.
``/v1/generate`` may arrive before ``done``: it waits on the admission. The slot's state is
written only by its own hand-off and decode, so requests in one batch never see each other.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import heapq
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.contracts import AdmissionState, AdmitRequest, CancelReply, GenerateRequest, Refusal
from nexrt_vllm.handoff.structured import LOGPROB_FLOOR, StructuredError, StructuredSpec
from nexrt_vllm.node.batch import DecodeBatch, Job
from nexrt_vllm.node.buffers import RecvBuffer, stage
from nexrt_vllm.node.context_cache import NodeContext
from nexrt_vllm.node.parts import PartSet, check_part, load_parts
from nexrt_vllm.node.faults import Faults
from nexrt_vllm.node.metrics import NodeMetrics

log = logging.getLogger("nexrt.node")

TOMBSTONES = 4096  # finished rids remembered to refuse duplicates (vLLM may reschedule a request)


@dataclass
class Options:
    max_seq_len: int
    admit_timeout: float = 30.0  # admit -> begin
    transfer_timeout: float = 30.0  # begin -> done
    start_timeout: float = 30.0  # done -> generate
    quarantine_s: float = 30.0  # grace for a writer that may outlive its admission
    tick: float = 0.05
    max_batch: int = 1  # requests admitted at once (slots)
    faults: Faults = field(default_factory=Faults)  # test-only (nexrt_vllm/node/faults.py)


@dataclass
class Admission:
    rid: str
    generation: int
    state: AdmissionState
    deadline: float
    slot: int = 0  # its engine and state (DecodeNode.engines)
    buffer: RecvBuffer | None = None
    parts: PartSet | None = None  # the hand-off's parts (one unless the prefill runs TP > 1)
    seq_len: int = 0
    t_accept: float = 0.0
    transfer_s: float = 0.0
    started: bool = False  # /v1/generate claimed it
    stop: threading.Event = field(default_factory=threading.Event)  # tells the decode batch to drop it
    decoding: bool = False  # in the decode batch (its slot's state is in use until it leaves)
    cancelled: bool = False  # POST /v1/cancel
    # resolves to None when READY, to (reason, message) when the admission fails first
    ready: asyncio.Future | None = None
    structured: StructuredSpec | None = None  # given at admit: compiled while the prefill runs
    grammar: asyncio.Future | None = None  # -> the compiled grammar (or the StructuredError)


class DecodeNode:
    def __init__(self, engine, cfg, transport, buffers: list[RecvBuffer], opts: Options, *, device: str,
                 control_addr: str, model_name: str, metrics: NodeMetrics | None = None, grammars=None,
                 grammars_missing: str = "structured output is not enabled on this node",
                 context: NodeContext | None = None):
        self.engine, self.cfg, self.transport, self.buffers, self.opts = engine, cfg, transport, buffers, opts
        self.device, self.control_addr, self.model_name = device, control_addr, model_name
        # engine.structured.Grammars (xgrammar over the checkpoint's tokenizer), or None and why not
        self.grammars, self.grammars_missing = grammars, grammars_missing
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nexrt-grammar")
        self.metrics = metrics or NodeMetrics()
        # slot k decodes on engines[k]: slot 0 is `engine`, the others share its weights
        self.engines = engine.slots(opts.max_batch)
        self.admissions: dict[str, Admission] = {}  # every admission in flight, by rid
        self._free_slots = list(range(opts.max_batch))
        self.context = context or NodeContext()  # the context cache (node/context_cache.py); off by default
        self._generation = 0
        # rid -> (generation, done received): finished rids, to refuse duplicates and late messages
        self._tombstones: collections.OrderedDict[str, tuple[int, bool]] = collections.OrderedDict()
        self.batch = DecodeBatch(self.engines, self.metrics)
        self.metrics.capacity.set(opts.max_batch)
        self._dtypes = engine.state.native_dtypes()
        # Who this process is: a peer that sees another instance at the same URL knows the node
        # restarted (its connections and warm-up are gone).
        self.instance, self.started_at = uuid.uuid4().hex, time.time()

    # ---- admission (HTTP) -------------------------------------------------------------------
    def admit(self, req: AdmitRequest) -> Admission:
        rid, prompt_len = req.rid, req.prompt_len
        spec = self.structured_spec(req.structured)
        if rid in self.admissions or rid in self._tombstones:
            raise self._refuse(P.Reason.DUPLICATE, f"rid {rid!r} was already admitted")
        if prompt_len is not None and prompt_len + 1 > self.opts.max_seq_len:
            raise self._refuse(P.Reason.TOO_LONG,
                               f"prompt_len {prompt_len} + 1 exceeds max_seq_len {self.opts.max_seq_len}")
        if not self._free_slots:
            if any(a.stop.is_set() for a in self.admissions.values()):
                raise self._refuse(P.Reason.CANCELLING, "a cancelled request is still stopping")
            busy = ", ".join(repr(r) for r in self.admissions)
            raise self._refuse(P.Reason.BUSY, f"all {self.opts.max_batch} slots are busy ({busy})")
        now = time.monotonic()
        waiting = sum(a.state is AdmissionState.RESERVED for a in self.admissions.values())
        if sum(b.available(now) for b in self.buffers) <= waiting:
            raise self._refuse(P.Reason.BUSY, "no receive buffer is free (in use, or waiting for a stale writer)")
        self._generation += 1
        adm = Admission(rid, self._generation, AdmissionState.RESERVED, now + self.opts.admit_timeout,
                        slot=heapq.heappop(self._free_slots), ready=asyncio.get_running_loop().create_future(),
                        structured=spec)
        if spec is not None:
            adm.grammar = self._compile(spec)
        self.admissions[rid] = adm
        self.metrics.admissions.inc()
        self._update_busy()
        return adm

    def cancel(self, rid: str) -> CancelReply:
        adm = self.admissions.get(rid)
        if adm is None:
            if rid in self._tombstones:
                return CancelReply(rid, False, AdmissionState.FINISHED)
            raise self._refuse(P.Reason.UNKNOWN_RID, f"rid {rid!r} is not in flight")
        prior = adm.state
        adm.cancelled = True
        adm.stop.set()
        if adm.state is not AdmissionState.DECODING:
            self._end(adm, "cancelled", P.Reason.CANCELLED, "cancelled by client")
        return CancelReply(rid, True, prior)

    # ---- control endpoint (ZMQ) ---------------------------------------------------------------
    def handle(self, data: bytes) -> bytes:
        try:
            msg, version = P.decode_versioned(data)  # answered in the version it was spoken in
        except P.ProtocolError as e:
            self.metrics.refusals.labels(e.reason.value).inc()
            return P.encode(P.Refuse(e.reason.value, e.message), P.reply_version(data))
        self.metrics.control.labels(msg.type).inc()
        handler = {"hello": self._on_hello, "begin": self._on_begin, "done": self._on_done,
                   "abort": self._on_abort}.get(msg.type)
        if handler is None:
            return P.encode(P.Refuse(P.Reason.BAD_MESSAGE.value, f"node does not take {msg.type!r}"))
        reply = handler(msg)
        if isinstance(reply, (P.Refuse, P.Reject, P.Error)):
            self.metrics.refusals.labels(reply.reason.value).inc()
        return P.encode(reply, version)

    def _layout(self, wire: dict) -> L.Layout:
        layout = L.Layout.from_wire(wire)
        check_part(layout, self.cfg)
        return layout

    def _on_hello(self, msg: P.Hello):
        try:
            self._layout(msg.layout)
        except P.ProtocolError as e:
            return P.Refuse(e.reason.value, e.message)
        return P.HelloOk(self.transport.peer_info(), {"model": self.model_name, "max_seq_len": self.opts.max_seq_len})

    def _on_begin(self, msg: P.Begin):
        def reject(reason, text):
            return P.Reject(msg.rid, P.Reason(reason).value, text)

        adm = self.admissions.get(msg.rid)
        if adm is None:
            if msg.rid in self._tombstones:
                return reject(P.Reason.DUPLICATE, f"rid {msg.rid!r} already finished")
            return reject(P.Reason.UNKNOWN_RID, f"rid {msg.rid!r} was not admitted")
        if msg.generation != adm.generation:
            return reject(P.Reason.STALE_GENERATION, f"generation {msg.generation}, admission is {adm.generation}")
        more = adm.state is AdmissionState.RECEIVING and adm.parts.n > 1  # a further part of a TP prefill
        if adm.state is not AdmissionState.RESERVED and not more:
            return reject(P.Reason.DUPLICATE, f"rid {msg.rid!r} already began ({adm.state.value})")
        if self.opts.faults.refuse():
            text = "refusing hand-offs (test fault NEXRT_TEST_FAULTS=refuse_begin)"
            self._end(adm, "rejected", P.Reason.BUSY, text)
            return reject(P.Reason.BUSY, text)
        try:
            layout = self._layout(msg.layout)
        except P.ProtocolError as e:
            self._end(adm, "rejected", e.reason, e.message)
            return reject(e.reason, e.message)
        if more:
            return self._begin_part(adm, msg, layout)
        if msg.seq_len < 1 or msg.seq_len + 1 > self.opts.max_seq_len:
            text = f"seq_len {msg.seq_len} (+1 for the first token) exceeds max_seq_len {self.opts.max_seq_len}"
            self._end(adm, "rejected", P.Reason.TOO_LONG, text)
            return reject(P.Reason.TOO_LONG, text)
        now = time.monotonic()
        buf = next((b for b in self.buffers if b.available(now)), None)
        if buf is None:
            self._end(adm, "rejected", P.Reason.BUSY, "no receive buffer free")
            return reject(P.Reason.BUSY, "no receive buffer free")
        parts = PartSet(1 if layout.sharding is None else layout.sharding.tp_size, msg.seq_len,
                        self.context.begin(msg, layout, self.engine))  # the rows the node holds already
        try:
            part = parts.plan(layout, msg.seq_len, buf.size)
        except P.ProtocolError as e:
            self.context.release(parts)
            self._end(adm, "rejected", e.reason, e.message)
            return reject(e.reason, e.message)
        buf.owner = adm.generation
        adm.buffer, adm.parts, adm.seq_len = buf, parts, msg.seq_len
        adm.state, adm.t_accept, adm.deadline = AdmissionState.RECEIVING, now, now + self.opts.transfer_timeout
        return self._accept(adm, part)

    def _begin_part(self, adm: Admission, msg: P.Begin, layout: L.Layout):
        """A further part of a TP = N prefill: its own regions in the same buffer, same deadline."""
        try:
            part = adm.parts.plan(layout, msg.seq_len, adm.buffer.size)
            adm.parts.check_cover(self.cfg)
        except P.ProtocolError as e:
            if e.reason is not P.Reason.DUPLICATE:  # a repeated begin leaves the others' transfer alone
                self._end(adm, "rejected", e.reason, e.message)
            return P.Reject(msg.rid, e.reason.value, e.message)
        return self._accept(adm, part)

    def _accept(self, adm: Admission, part) -> P.Accept:
        return P.Accept(adm.rid, adm.generation, {"base": adm.buffer.addr, "size": adm.buffer.size},
                        P.region_dicts(part.regions), max(0.0, adm.deadline - time.monotonic()),
                        held_tokens=adm.parts.held)

    def _on_done(self, msg: P.Done):
        adm = self.admissions.get(msg.rid)
        if adm is None or adm.generation != msg.generation:
            return self._late(msg, "done")
        if adm.state is not AdmissionState.RECEIVING:
            if adm.state is AdmissionState.RESERVED:
                return P.Error(msg.rid, P.Reason.BAD_MESSAGE.value, "done before begin")
            return P.Error(msg.rid, P.Reason.DUPLICATE_DONE.value, "done already received")
        part = adm.parts.parts.get(msg.part)
        if part is None:
            return P.Error(msg.rid, P.Reason.BAD_MESSAGE.value, f"done for part {msg.part} before its begin")
        if part.done:
            return P.Error(msg.rid, P.Reason.DUPLICATE_DONE.value, f"done of part {msg.part} already received")
        if msg.seq_len != adm.seq_len or msg.nbytes != part.expected_bytes:
            text = (f"done of part {msg.part} says seq_len={msg.seq_len} nbytes={msg.nbytes}, begin implies "
                    f"seq_len={adm.seq_len} nbytes={part.expected_bytes}")
            self._end(adm, "failed", P.Reason.SIZE_MISMATCH, text)
            return P.Error(msg.rid, P.Reason.SIZE_MISMATCH.value, text)
        part.done = True
        self.metrics.transfer_bytes.inc(msg.nbytes)
        if not adm.parts.complete:
            return P.Ack(adm.rid, adm.generation)  # READY when every part is done
        adm.transfer_s = time.monotonic() - adm.t_accept
        self.metrics.transfer_seconds.observe(adm.transfer_s)
        adm.state, adm.deadline = AdmissionState.READY, time.monotonic() + self.opts.start_timeout
        if adm.started:
            adm.deadline = math.inf  # the waiting generate takes over
        if not adm.ready.done():
            adm.ready.set_result(None)
        return P.Ack(adm.rid, adm.generation)

    def _on_abort(self, msg: P.Abort):
        adm = self.admissions.get(msg.rid)
        if adm is None or adm.generation != msg.generation:
            return self._late(msg, "abort")
        if adm.state not in (AdmissionState.RESERVED, AdmissionState.RECEIVING):
            return P.Error(msg.rid, P.Reason.BAD_MESSAGE.value, f"cannot abort in state {adm.state.value}")
        if adm.parts is not None and msg.part in adm.parts.parts:
            adm.parts.parts[msg.part].aborted = True
        where = f" (part {msg.part} of {adm.parts.n})" if adm.parts is not None and adm.parts.n > 1 else ""
        self._end(adm, "aborted", P.Reason.TRANSFER_FAILED, f"sender aborted{where}: {msg.reason}")
        return P.Ack(msg.rid, msg.generation)

    def _late(self, msg, what: str):
        """done/abort for an admission that is gone: frees a quarantined buffer, says why."""
        for b in self.buffers:
            b.writer_finished(msg.generation, msg.part)
        gen, done = self._tombstones.get(msg.rid, (None, False))
        if gen == msg.generation:
            if what == "done" and done:
                return P.Error(msg.rid, P.Reason.DUPLICATE_DONE.value, "done already received")
            return P.Error(msg.rid, P.Reason.STALE_GENERATION.value, f"admission {msg.generation} already ended")
        if msg.rid in self._tombstones or msg.rid in self.admissions:
            return P.Error(msg.rid, P.Reason.STALE_GENERATION.value, f"generation {msg.generation} is not current")
        return P.Error(msg.rid, P.Reason.UNKNOWN_RID.value, f"rid {msg.rid!r} was not admitted")

    # ---- ending an admission --------------------------------------------------------------------
    def _end(self, adm: Admission, outcome: str, reason: P.Reason | str, message: str,
             writer_live: bool | None = None) -> None:
        """Release the slot (once; never while the decode batch holds it). ``writer_live`` defaults to:
        a part accepted without done/abort yet."""
        if self.admissions.get(adm.rid) is not adm or adm.decoding:
            return
        live = adm.parts.live() if adm.parts is not None and adm.state is AdmissionState.RECEIVING else set()
        if writer_live is None:
            writer_live = bool(live)
        if adm.buffer is not None and adm.buffer.owner == adm.generation:
            adm.buffer.release(writer_live, self.opts.quarantine_s, live)
        self.context.release(adm.parts)
        del self.admissions[adm.rid]
        heapq.heappush(self._free_slots, adm.slot)  # lowest first: few requests replay a small batch graph
        self._tombstones[adm.rid] = (adm.generation, adm.state in (AdmissionState.READY, AdmissionState.DECODING))
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
        self.metrics.finished.labels(outcome).inc()
        self._update_busy()
        if adm.ready is not None and not adm.ready.done():
            adm.ready.set_result((P.Reason(reason).value, message))
        log.info("rid=%s gen=%d ended: %s (%s)", adm.rid, adm.generation, outcome, message)

    async def reaper(self) -> None:
        """Ages out admissions whose peer went silent (admit, transfer and start timeouts)."""
        while True:
            await asyncio.sleep(self.opts.tick)
            now = time.monotonic()
            for adm in list(self.admissions.values()):
                if adm.state is AdmissionState.DECODING or now <= adm.deadline:
                    continue
                what = {AdmissionState.RESERVED: "begin", AdmissionState.RECEIVING: "done",
                        AdmissionState.READY: "generate"}[adm.state]
                if adm.state is AdmissionState.RECEIVING and adm.parts.n > 1:
                    what = f"done of part(s) {adm.parts.missing()} of {adm.parts.n}"
                self._end(adm, "timeout", P.Reason.TIMEOUT, f"no {what} before the {adm.state.value} deadline")

    # ---- structured output ---------------------------------------------------------------------------
    def structured_spec(self, wire: Any) -> StructuredSpec | None:
        """The request's grammar spec, checked for what this node can enforce (400 otherwise)."""
        if wire is None:
            return None
        try:
            spec = StructuredSpec.from_wire(wire)
        except StructuredError as e:
            raise self._refuse(P.Reason.BAD_MESSAGE, str(e)) from None
        if self.grammars is None:
            raise self._refuse(P.Reason.UNSUPPORTED, self.grammars_missing)
        why = spec.unsupported()
        if why:
            raise self._refuse(P.Reason.UNSUPPORTED, why)
        return spec

    def _compile(self, spec: StructuredSpec) -> asyncio.Future:
        fut = asyncio.get_running_loop().run_in_executor(self._compile_pool, self.grammars.compile, spec)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # consumed even if never awaited
        return fut

    async def constraint(self, rid: Any, wire: Any, first_token: Any, stop_token_ids) -> Any:
        """The engine constraint of a generate request (None without a grammar), before any byte of
        the stream: its grammar compiled (at admit, or now), and vLLM's first token allowed by it."""
        adm = self.admissions.get(rid) if isinstance(rid, str) else None
        spec = self.structured_spec(wire)
        admitted = adm.structured if adm is not None else None
        if spec is not None and admitted is not None and spec.key != admitted.key:
            raise self._refuse(P.Reason.BAD_MESSAGE, "structured differs from the one given at admit")
        spec = spec or admitted
        if spec is None:
            return None
        fut = adm.grammar if admitted is not None else self._compile(spec)
        try:
            compiled = await asyncio.wait_for(asyncio.shield(fut), self.opts.start_timeout)
        except StructuredError as e:
            raise self._refuse(P.Reason.UNSUPPORTED, str(e)) from None
        except asyncio.TimeoutError:
            raise self._refuse(P.Reason.UNSUPPORTED,
                               f"{spec.type} did not compile within {self.opts.start_timeout}s") from None
        stops = set(stop_token_ids) | set(self.cfg.eos_token_ids)  # vLLM's all_stop_token_ids
        if isinstance(first_token, int) and not isinstance(first_token, bool) and 0 <= first_token < self.cfg.vocab_size:
            probe = self.grammars.constraint(compiled, stops)
            try:
                probe.accept(first_token)
            except Exception:  # noqa: BLE001 - EngineError: the grammar refuses it
                raise self._refuse(P.Reason.BAD_MESSAGE,
                                   f"first_token {first_token} is not allowed by the {spec.type} grammar") from None
        return self.grammars.constraint(compiled, stops)

    # ---- decode (HTTP) ----------------------------------------------------------------------------
    def claim(self, req: GenerateRequest) -> Admission:
        """Validate a generate request before any response byte is sent (errors become 4xx)."""
        rid = req.rid
        adm = self.admissions.get(rid)
        if adm is None:
            raise self._refuse(P.Reason.UNKNOWN_RID, f"rid {rid!r} is not admitted")
        if req.generation is not None and req.generation != adm.generation:
            raise self._refuse(P.Reason.STALE_GENERATION,
                               f"generation {req.generation!r}, admission is {adm.generation}")
        if adm.started:
            raise self._refuse(P.Reason.DUPLICATE, f"rid {rid!r} already started")
        if not req.first_token < self.cfg.vocab_size:
            raise self._refuse(P.Reason.BAD_MESSAGE, f"first_token outside [0, {self.cfg.vocab_size})")
        adm.started = True
        if adm.state is AdmissionState.READY:
            adm.deadline = math.inf
        return adm

    async def generate(self, adm: Admission, sp, first_token: int, constraint=None) -> AsyncIterator[dict]:
        """Yields ``{"token": id}`` dicts (with ``sp.logprobs``: ``"logprob"`` and ``"top_logprobs"``
        [[id, logprob], ...] too), then one final ``{"finish_reason", ...}`` dict.

        However it ends (normally, by cancel, by the client closing the generator while it waits
        for the transfer or mid-stream), the slot is released exactly once on the way out.
        """
        t0 = time.monotonic()
        left, tokens, final = None, 0, None
        try:
            failure = await adm.ready  # bounded: the reaper ends the admission at its deadline
            if failure is not None:
                final = {"finish_reason": "cancelled" if failure[0] == P.Reason.CANCELLED.value else "error",
                         "error": f"{failure[0]}: {failure[1]}"}
            elif self.admissions.get(adm.rid) is not adm:
                final = {"finish_reason": "cancelled"}
            else:
                adm.state, adm.decoding = AdmissionState.DECODING, True
                loop = asyncio.get_running_loop()
                q: asyncio.Queue = asyncio.Queue()
                done = loop.create_future()
                put = lambda kind, val: loop.call_soon_threadsafe(q.put_nowait, (kind, val))  # noqa: E731
                try:
                    self.batch.submit(Job(adm.rid, adm.slot, lambda engine: self._load(adm, engine), first_token, sp,
                                          constraint, put, lambda: loop.call_soon_threadsafe(self._left, adm, done),
                                          stop=adm.stop, ended=lambda engine, tokens: self.context.store(
                                              engine, adm.parts, first_token, tokens)))
                except RuntimeError as e:  # the node is shutting down
                    adm.decoding = False
                    q.put_nowait(("err", str(e)))
                else:
                    left = done
                while final is None:
                    kind, val = await q.get()
                    if kind == "tok":
                        tokens += 1
                        yield _token_line(val, sp.logprobs is not None)
                    elif kind == "converted":
                        adm.buffer.release(False, 0.0)  # pages are in the engine: the buffer is free
                    elif kind == "end":
                        final = {"finish_reason": val}
                    else:
                        final = {"finish_reason": "error", "error": val}
                final["timing"] = {"transfer_s": adm.transfer_s, "decode_s": time.monotonic() - t0,
                                   "tokens": tokens}
        finally:
            if left is not None:
                adm.stop.set()  # drops it from the batch if the client went away mid-stream
                await left  # within one batch step
            outcome = final["finish_reason"] if final else "cancelled"
            self._end(adm, outcome, P.Reason.CANCELLED, f"ended: {outcome}")
        yield final

    def _left(self, adm: Admission, left: asyncio.Future) -> None:
        """The request left the decode batch: its slot is free to reuse. A cancelled request frees
        it now, even if its HTTP writer is still stuck on a client that stopped reading."""
        adm.decoding = False
        if not left.done():
            left.set_result(None)
        if adm.cancelled:
            self._end(adm, "cancelled", P.Reason.CANCELLED, "cancelled during decode")

    def _load(self, adm: Admission, engine) -> None:
        """Decode thread: the received pages converted into the slot engine's state."""
        t = time.perf_counter()
        raw = stage(adm.buffer, adm.parts.end, self.device)
        load_parts(engine, raw, adm.parts, self._dtypes)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()  # the pinned buffer is reusable only after its copy landed
        del raw
        self.metrics.convert_seconds.observe(time.perf_counter() - t)

    # ---- status -----------------------------------------------------------------------------------
    def health(self) -> dict:
        """``status`` "busy" when every slot is taken; ``rid`` / ``state``: the oldest admission's."""
        now = time.monotonic()
        first = next(iter(self.admissions.values()), None)
        return {"status": "free" if self._free_slots else "busy", "busy_slots": len(self.admissions),
                "max_batch": self.opts.max_batch,
                "rid": first.rid if first else None, "state": first.state.value if first else None,
                "requests": [{"rid": a.rid, "state": a.state.value, "slot": a.slot} for a in self.admissions.values()],
                "free_buffers": sum(b.available(now) for b in self.buffers),
                "instance": self.instance, "started_at": self.started_at}

    def _update_busy(self) -> None:
        self.metrics.busy.set(len(self.admissions))

    def _refuse(self, reason: P.Reason, message: str) -> Refusal:
        err = Refusal(reason, message)
        self.metrics.refusals.labels(err.reason.value).inc()
        return err

    def close(self) -> None:
        self.batch.close()
        self._compile_pool.shutdown(wait=False, cancel_futures=True)


def _lp(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (a masked token) is not JSON


def _token_line(rec, logprobs: bool) -> dict:
    if not logprobs:
        return {"token": int(rec.token)}
    return {"token": int(rec.token), "logprob": _lp(rec.logprob), "top_logprobs": [[i, _lp(v)] for i, v in rec.top]}

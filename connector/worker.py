"""Worker-side half of NexRTConnector (runs in each vLLM worker process).

Pages are written straight from vLLM's KV-cache memory (registered once with the transfer engine,
as device memory on a GPU) into the node's receive buffer; only a transport that cannot read GPU
memory sends through a pinned host pool (``staging``), in ranges no two requests share. The page
layouts are read from what vLLM allocated (``layouts``). Each claimed request gets a ``_Job`` with
its own thread that runs, in order: hello+begin (admission check on the node), the page writes
queued by the forward pass, and done/abort. ``begin`` gives the node the prompt's token ids; when
the node's context cache holds the conversation's leading tokens (``accept.held_tokens``), the
pages it holds are queued as usual and not written (``Transfer.slot``).

Overlap with prefill: an attention layer's *complete* pages (and, in the step that completes the
prefill, its tail page) are queued the moment vLLM calls ``save_kv_layer`` for it (the layer has
written its cache), so they travel while later layers and later chunks compute; the GDN state
pages (GDN layers never call ``save_kv_layer``) are queued in ``wait_for_save`` of the step that
completes the prefill.
On a GPU those hooks run when the kernels were queued, not run: each batch of pages carries a CUDA
event recorded there, and nothing reads the pages before it completed.
Safety: a job is drained before vLLM can overwrite blocks it still reads (preemption frees the
blocks; a decode step after the prefill would advance the GDN state).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import torch
from vllm.logger import init_logger

from nexrt_vllm.connector.config import ConnectorConfig, ConnectorConfigError
from nexrt_vllm.connector.layouts import PagedLayer, detect
from nexrt_vllm.connector.metadata import NexRTMetadata, NexRTWorkerMetadata, Outcome, ReqStep
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.contracts import HandoffStatus
from nexrt_vllm.handoff.sender import HandoffError, HandoffSender, Transfer

logger = init_logger("vllm.nexrt_connector")  # under "vllm": inherits vLLM's log handler and level


class _Job:
    """One claimed request's hand-off. Tasks run in order on the job's own thread."""

    def __init__(self, step: ReqStep, sender: HandoffSender, layout: L.Layout, on_end: Callable[["_Job"], None],
                 stager=None):
        self.req_id, self.claim, self.seq_len = step.req_id, step.claim, step.prompt_len
        self.prompt = step.prompt_ids if layout.sharding is None else None  # a TP part's node holds no context
        self._sender, self._layout, self._on_end, self._stager = sender, layout, on_end, stager
        self._tasks: deque = deque()
        self._cv = threading.Condition()
        self._busy = False
        self.transfer: Transfer | None = None
        self.outcome: Outcome | None = None
        self.queued_pages: dict[int, int] = {}  # attention layer index -> pages queued so far
        self.final_queued = False  # tail + GDN pages + done queued
        self._prefill_end = 0.0
        self._bytes_at_prefill_end = 0
        self._thread = threading.Thread(target=self._run, name=f"nexrt-send-{step.req_id}", daemon=True)
        self._thread.start()

    # -- called from vLLM's thread -------------------------------------------------------------
    def write(self, pages: list[tuple[int, int, int]], ready=None) -> None:
        """Queue ``(layer index, page index, local address)`` writes of pages final once the CUDA
        event ``ready`` completed (None: final now)."""
        if pages:
            self._submit(lambda: self._write(pages, ready))

    def finish(self) -> None:
        """Queue done after the last pages (called when the step completing the prefill ends)."""
        self.final_queued = True
        self._prefill_end = time.perf_counter()
        self._bytes_at_prefill_end = self.transfer.nbytes if self.transfer is not None else 0
        self._submit(self._done)

    def abort(self, reason: str) -> None:
        with self._cv:
            self._tasks.clear()
        self._submit(lambda: self._abort(reason))

    def drain(self, timeout: float) -> bool:
        """Wait until every queued task ran; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._tasks and not self._busy, timeout)

    def restart(self) -> None:
        """After a drain: vLLM will recompute the request into new blocks; rewrite every page."""
        self.queued_pages.clear()
        self.final_queued = False
        if self.transfer is not None:
            self.transfer.nbytes = 0

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    # -- job thread ----------------------------------------------------------------------------
    def _submit(self, fn) -> None:
        with self._cv:
            if self.outcome is None:
                self._tasks.append(fn)
                self._cv.notify_all()

    def _run(self) -> None:
        try:
            self.transfer = self._sender.begin(self.claim.control_addr, self._layout, self.claim.rid,
                                               self.claim.generation, self.seq_len, self.prompt)
        except HandoffError as e:
            self._end(Outcome(HandoffStatus.FAILED, e.reason, e.message))
        except Exception as e:  # noqa: BLE001 - any sender bug must still end the job and free blocks
            self._end(Outcome(HandoffStatus.FAILED, P.Reason.TRANSFER_FAILED, repr(e)))
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._tasks or self.outcome is not None)
                if self.outcome is not None:
                    self._tasks.clear()
                    self._busy = False
                    self._cv.notify_all()
                    return
                fn = self._tasks.popleft()
                self._busy = True
            try:
                fn()
            except HandoffError as e:
                self._end(Outcome(HandoffStatus.FAILED, e.reason, e.message))
            except Exception as e:  # noqa: BLE001
                logger.exception("hand-off of %s failed", self.req_id)
                if self.transfer is not None:
                    self.transfer.abort(f"sender error: {e!r}")
                self._end(Outcome(HandoffStatus.FAILED, P.Reason.TRANSFER_FAILED, repr(e)))
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _write(self, pages: list[tuple[int, int, int]], ready) -> None:
        writes = []
        for layer, page, addr in pages:
            reg = self.transfer.regions.get(layer)
            slot = self.transfer.slot(layer, page) if reg is not None else None
            if slot is None and reg is not None:
                continue  # the node holds this page (its context cache)
            if reg is None or slot >= reg.num_pages:
                self.transfer.abort("sender layout mismatch")
                raise HandoffError(P.Reason.LAYOUT_MISMATCH, f"node has no slot {slot} for layer {layer}")
            writes.append((addr, reg.offset + slot * reg.page_bytes, reg.page_bytes))
        if not writes:
            return
        if self._stager is not None:
            self._stager.write(self.transfer, writes, ready)
            return
        if ready is not None:
            ready.synchronize()  # the transport reads GPU memory: the cache writes must have run
        self.transfer.write(writes)

    def _done(self) -> None:
        t = self.transfer
        t.done()
        # How much of the hand-off overlapped the prefill (docs/CONNECTOR.md, "Overlap").
        logger.info("hand-off %s: %d tokens, %.2f MiB, %.1f%% written before the prefill ended, "
                    "done acked %.1f ms after it", self.claim.rid, self.seq_len, t.nbytes / 2**20,
                    100.0 * self._bytes_at_prefill_end / max(t.nbytes, 1),
                    1e3 * (time.perf_counter() - self._prefill_end))
        self._end(Outcome(HandoffStatus.SENT))

    def _abort(self, reason: str) -> None:
        if self.transfer is not None:
            self.transfer.abort(reason)
        self._end(Outcome(HandoffStatus.ABORTED, P.Reason.CANCELLED, reason))

    def _end(self, outcome: Outcome) -> None:
        with self._cv:
            if self.outcome is not None:
                return
            self.outcome = outcome
            self._cv.notify_all()
        self._on_end(self)


class NexRTWorker:
    def __init__(self, cfg: ConnectorConfig, vllm_config, kv_cache_config):
        self._cfg = cfg
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._sender: HandoffSender | None = None
        self._layout: L.Layout | None = None
        self._attn: list[PagedLayer] = []
        self._gdn: list[PagedLayer] = []
        self._attn_by_name: dict[str, PagedLayer] = {}
        self._stager = None
        self._cuda = False  # the KV cache is GPU memory: page batches carry CUDA events
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._ended: dict[str, Outcome] = {}  # terminal outcomes not yet reported to the scheduler
        self._vllm_finished: set[str] = set()  # vLLM finished these; report once their job ended
        self._steps: dict[str, ReqStep] = {}
        self._meta: NexRTMetadata | None = None

    # -- registration --------------------------------------------------------------------------
    @property
    def layout(self) -> L.Layout | None:
        return self._layout

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        found = detect(kv_caches, self._kv_cache_config, self._vllm_config,
                       attn_kv_format=self._cfg.attn_kv_format, gdn_rec_layout=self._cfg.gdn_rec_layout)
        self._attn, self._gdn, self._layout = found.attention, found.gdn, found.layout
        self._attn_by_name = {layer.name: layer for layer in self._attn}
        self._sender = HandoffSender(self._cfg.transport, host=self._cfg.host,
                                     control_timeout=self._cfg.control_timeout_s,
                                     transfer_timeout=self._cfg.transfer_timeout_s)
        devices = {st.device.type for st in found.storages.values()}
        self._cuda = "cuda" in devices
        kinds = self._sender.transport.memory_kinds
        staged = self._cuda and (self._cfg.staging == "always"
                                 or (self._cfg.staging == "auto" and "device" not in kinds))
        if self._cuda and not staged and "device" not in kinds:
            raise ConnectorConfigError(f"transport {self._cfg.transport} cannot read GPU memory (this build registers "
                              f"{kinds}) and staging is 'never'")
        if staged:
            from nexrt_vllm.connector.staging import PinnedStager

            self._stager = PinnedStager(list(found.storages.values()), self._sender, self._cfg.staging_mib << 20,
                                        self._cfg.transfer_timeout_s)
        else:  # vLLM's layers are views of one allocation: each distinct storage is registered once
            for addr, st in found.storages.items():
                self._sender.register(addr, st.nbytes(), "device" if st.device.type == "cuda" else "host",
                                      st.device.index or 0)
        source = ("pinned staging pool" if staged else "device memory") if self._cuda else "host memory"
        logger.info("NexRTConnector worker: %s; transport %s from %s", found.summary, self._cfg.transport, source)

    # -- per step ------------------------------------------------------------------------------
    def on_metadata(self, meta: NexRTMetadata) -> None:
        """Before the forward: start new jobs, stop aborted ones, and drain jobs whose blocks
        vLLM is about to overwrite. Reached from ``handle_preemptions`` (forward steps, before
        any block is touched) and from ``bind_connector_metadata`` (every step); runs once."""
        if meta is self._meta:
            return
        self._meta = meta
        if not meta.steps and not self._jobs:
            return  # nothing claimed in flight: nothing to start, stop or drain (self._steps is empty)
        self._steps = {s.req_id: s for s in meta.steps}
        for req_id in meta.aborted:
            job = self._jobs.get(req_id)
            if job is not None and not job.ended:
                job.abort("request aborted during prefill")
        for req_id in meta.preempted:
            job = self._jobs.get(req_id)
            if job is None or job.ended:
                continue
            # Its blocks were freed and may be rewritten by this very forward.
            if not job.drain(self._cfg.drain_timeout_s):
                job.abort("preempted and in-flight writes did not drain")
            elif not job.final_queued:  # the state was incomplete: rewrite every page from the recompute
                logger.info("request %s (rid %s) preempted: its hand-off restarts with the recompute",
                            req_id, job.claim.rid)
                job.restart()
        for s in meta.steps:
            job = self._jobs.get(s.req_id)
            if job is None:
                self._jobs[s.req_id] = _Job(s, self._sender, self._layout, self._job_ended, self._stager)
            elif job.final_queued and not job.ended and not s.completes_prefill:
                # Decode step after the hand-off was queued: the GDN state is about to advance.
                job.drain(self._cfg.drain_timeout_s)

    def save_kv_layer(self, layer_name: str) -> None:
        if not self._steps:
            return
        layer = self._attn_by_name.get(layer_name)
        if layer is None:
            return
        ready = None
        for s in self._steps.values():
            job = self._jobs.get(s.req_id)
            if job is None or job.ended or job.final_queued:
                continue
            # This layer has just written its cache for the step: full pages are final, and in the
            # step that completes the prefill so is the tail page.
            bs = self._layout.block_size
            upto = -(-s.prompt_len // bs) if s.completes_prefill else s.end // bs
            if ready is None:
                ready = self._ready()
            self._queue_attention(job, s, layer, upto, ready)

    def wait_for_save(self) -> None:
        if not self._steps:
            return
        ready = None
        for s in self._steps.values():
            job = self._jobs.get(s.req_id)
            if job is None or job.ended or job.final_queued or not s.completes_prefill:
                continue
            if ready is None:
                ready = self._ready()  # after every kernel of this forward, GDN state updates included
            n_pages = -(-s.prompt_len // self._layout.block_size)
            for layer in self._attn:  # any layer that did not call save_kv_layer
                self._queue_attention(job, s, layer, n_pages, ready)
            job.write([(g.index, 0, g.page_addr([_state_block(s.block_ids[g.group], g.spare)], 0))
                       for g in self._gdn], ready)
            job.finish()
        self._steps = {}

    def _ready(self):
        """A CUDA event after the work vLLM has queued so far (None for a host KV cache)."""
        if not self._cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _queue_attention(self, job: _Job, s: ReqStep, layer: PagedLayer, upto: int, ready) -> None:
        first = job.queued_pages.get(layer.index, 0)
        if upto <= first:
            return
        blocks = s.block_ids[layer.group]
        job.write([(layer.index, i, layer.page_addr(blocks, i)) for i in range(first, upto)], ready)
        job.queued_pages[layer.index] = upto

    def _job_ended(self, job: _Job) -> None:
        with self._lock:
            self._ended[job.req_id] = job.outcome

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._jobs:
            return None, None
        self._vllm_finished.update(r for r in finished_req_ids if r in self._jobs)
        done = {r for r in self._vllm_finished if self._jobs[r].ended}
        for r in done:
            self._vllm_finished.discard(r)
            del self._jobs[r]
        return (done or None), None

    def build_worker_meta(self) -> NexRTWorkerMetadata | None:
        if not self._ended:
            return None  # unlocked read: an outcome being added now is reported next step
        with self._lock:
            if not self._ended:
                return None
            out, self._ended = self._ended, {}
        return NexRTWorkerMetadata(out)

    def shutdown(self) -> None:
        for job in list(self._jobs.values()):
            if not job.ended:
                job.abort("vLLM shutting down")
        if self._sender is not None:
            self._sender.close()


def _state_block(blocks: list[int], spare: int) -> int:
    # Without prefix caching a GDN group holds one block per request; in "align" mode the list is
    # position-indexed with null (0) placeholders and the running state is the last entry. With
    # speculative decoding `spare` scratch blocks follow the running one (vLLM's prefill and
    # accepted-token state go to the first of the 1 + spare).
    return blocks[-1 - spare]

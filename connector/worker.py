"""Worker-side half of NexRTConnector (runs in each vLLM worker process).

Pages are written straight from vLLM's KV-cache memory (registered once with the transfer engine)
into the node's receive buffer: there is no staging buffer, so requests cannot overwrite each
other. Each claimed request gets a ``_Job`` with its own thread that runs, in order: hello+begin
(admission check on the node), the page writes queued by the forward pass, and done/abort.

Overlap with prefill: an attention layer's *complete* pages (and, in the step that completes the
prefill, its tail page) are queued the moment vLLM calls ``save_kv_layer`` for it (the layer has
written its cache), so they travel while later layers and later chunks compute; the GDN state
pages (GDN layers never call ``save_kv_layer``) are queued in ``wait_for_save`` of the step that
completes the prefill.
Safety: a job is drained before vLLM can overwrite blocks it still reads (preemption frees the
blocks; a decode step after the prefill would advance the GDN state).
"""
from __future__ import annotations

import re
import threading
import time
from collections import deque
from typing import Callable

import torch
from vllm.logger import init_logger

from nexrt_vllm.connector.config import ConnectorConfig, ConnectorConfigError
from nexrt_vllm.connector.metadata import NexRTMetadata, NexRTWorkerMetadata, Outcome, ReqStep
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.contracts import HandoffStatus
from nexrt_vllm.handoff.sender import HandoffError, HandoffSender, Transfer
from nexrt_vllm.node.convert import DTYPE_NAMES

logger = init_logger("vllm.nexrt_connector")  # under "vllm": inherits vLLM's log handler and level

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# KV-cache dtypes the hand-off ships as they are (fp8 caches carry per-layer scales that the layout
# does not describe, so they are refused rather than converted wrongly).
_SENT_DTYPES = ("bfloat16", "float16", "float32", "int8", "uint8")


class _Layer:
    """One registered layer: where block ``b``'s page starts and how the node must read it."""

    def __init__(self, name: str, group: int, base: int, page_stride: int, layout):
        self.name, self.group, self.base, self.page_stride, self.layout = name, group, base, page_stride, layout

    @property
    def index(self) -> int:
        return self.layout.index

    def page_addr(self, block_id: int) -> int:
        return self.base + block_id * self.page_stride


class _Job:
    """One claimed request's hand-off. Tasks run in order on the job's own thread."""

    def __init__(self, step: ReqStep, sender: HandoffSender, layout: L.Layout, on_end: Callable[["_Job"], None]):
        self.req_id, self.claim, self.seq_len = step.req_id, step.claim, step.prompt_len
        self._sender, self._layout, self._on_end = sender, layout, on_end
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
    def write(self, pages: list[tuple[int, int, int]]) -> None:
        """Queue ``(layer index, page slot, local address)`` writes."""
        if pages:
            self._submit(lambda: self._write(pages))

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
                                               self.claim.generation, self.seq_len)
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

    def _write(self, pages: list[tuple[int, int, int]]) -> None:
        writes = []
        for layer, slot, addr in pages:
            reg = self.transfer.regions.get(layer)
            if reg is None or slot >= reg.num_pages:
                self.transfer.abort("sender layout mismatch")
                raise HandoffError(P.Reason.LAYOUT_MISMATCH, f"node has no slot {slot} for layer {layer}")
            writes.append((addr, reg.offset + slot * reg.page_bytes, reg.page_bytes))
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
        self._attn: list[_Layer] = []
        self._gdn: list[_Layer] = []
        self._attn_by_name: dict[str, _Layer] = {}
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._ended: dict[str, Outcome] = {}  # terminal outcomes not yet reported to the scheduler
        self._vllm_finished: set[str] = set()  # vLLM finished these; report once their job ended
        self._steps: dict[str, ReqStep] = {}
        self._meta: NexRTMetadata | None = None

    # -- registration --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

        group_of = {}
        for g, grp in enumerate(self._kv_cache_config.kv_cache_groups):
            for name in grp.layer_names:
                group_of[name] = (g, grp.kv_cache_spec)
        storages: dict[int, int] = {}
        attn_block_size = None
        for name, t in kv_caches.items():
            if name not in group_of:
                raise ConnectorConfigError(f"KV cache {name!r} belongs to no KV-cache group")
            g, spec = group_of[name]
            m = _LAYER_RE.search(name)
            if m is None:
                raise ConnectorConfigError(f"cannot read a layer index from KV cache name {name!r}")
            idx = int(m.group(1))
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
            if isinstance(spec, MambaSpec):
                self._gdn.append(_Layer(name, g, t.data_ptr(), t.stride(0) * t.element_size(),
                                        self._gdn_layout(idx, t, spec)))
            elif isinstance(spec, AttentionSpec):
                if t.dim() != 4 or t.shape[2] != spec.block_size:
                    raise ConnectorConfigError(f"{name}: attention cache {tuple(t.shape)} is not "
                                      f"(num_blocks, kv_heads, block_size={spec.block_size}, 2*head_dim)")
                attn_block_size = spec.block_size
                layout = L.AttentionLayout(index=idx, dtype=_dtype(t.dtype), shape=tuple(t.shape[1:]),
                                           strides=tuple(t.stride()[1:]), kv_format=self._kv_format(name))
                layer = _Layer(name, g, t.data_ptr(), t.stride(0) * t.element_size(), layout)
                self._attn.append(layer)
                self._attn_by_name[name] = layer
            else:
                raise ConnectorConfigError(f"{name}: KV-cache spec {type(spec).__name__} is not supported")
        if attn_block_size is None:
            raise ConnectorConfigError("model has no full-attention layer; nothing defines the page size")
        self._attn.sort(key=lambda layer: layer.index)
        self._gdn.sort(key=lambda layer: layer.index)
        hf = self._vllm_config.model_config.hf_text_config
        model = {"num_hidden_layers": hf.num_hidden_layers, "hidden_size": hf.hidden_size,
                 "vocab_size": hf.vocab_size}
        self._layout = L.Layout(model=model, block_size=attn_block_size,
                                layers=tuple(sorted((x.layout for x in self._attn + self._gdn),
                                                    key=lambda lay: lay.index)))
        self._sender = HandoffSender(self._cfg.transport, host=self._cfg.host,
                                     control_timeout=self._cfg.control_timeout_s,
                                     transfer_timeout=self._cfg.transfer_timeout_s)
        # All layers alias one storage on vLLM 0.32; register each distinct storage once.
        for addr, size in storages.items():
            self._sender.register(addr, size)
        logger.info("NexRTConnector worker: %d attention + %d GDN layers, block_size %d, transport %s",
                    len(self._attn), len(self._gdn), attn_block_size, self._cfg.transport)

    def _kv_format(self, name: str) -> str:
        if self._cfg.attn_kv_format is not None:
            return self._cfg.attn_kv_format
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise ConnectorConfigError("attention page interior not characterised on this platform; set "
                              "kv_connector_extra_config.attn_kv_format (docs/CONNECTOR.md)")
        layer = self._vllm_config.compilation_config.static_forward_context[name]
        isa = getattr(layer, "isa", None)
        if isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            cache = self._vllm_config.cache_config
            isa = _get_attn_isa(self._vllm_config.model_config.dtype, cache.block_size, layer.head_size,
                                cache.cache_dtype)
        if isa in ("vec", "vec16"):
            return "cpu_vec"
        if isa == "amx":
            return "cpu_amx"
        raise ConnectorConfigError(f"vLLM-CPU attention ISA {isa!r} stores pages in a layout NexRT does not convert "
                          "(supported: vec, vec16, amx)")

    def _gdn_layout(self, idx: int, t: torch.Tensor, spec) -> L.GDNLayout:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
        from vllm.platforms import current_platform

        (conv_shape, rec_shape), (conv_dt, rec_dt) = spec.shapes, spec.dtypes
        rec_layout = self._cfg.gdn_rec_layout
        if rec_layout is None:
            if not current_platform.is_cpu():
                raise ConnectorConfigError("GDN recurrent orientation not characterised on this platform; set "
                                  "kv_connector_extra_config.gdn_rec_layout (docs/CONNECTOR.md)")
            rec_layout = "HKV"  # measured against transformers (docs/CONNECTOR.md)
        layout = L.GDNLayout(index=idx, conv_layout=get_conv_state_layout(), conv_dtype=_dtype(conv_dt),
                             conv_shape=tuple(conv_shape), conv_strides=L.contiguous_strides(conv_shape),
                             rec_layout=rec_layout, rec_dtype=_dtype(rec_dt), rec_shape=tuple(rec_shape),
                             rec_strides=L.contiguous_strides(rec_shape))
        if layout.page_bytes > t.shape[-1]:
            raise ConnectorConfigError(f"layer {idx}: GDN state ({layout.page_bytes} B) larger than its page "
                                       f"({t.shape[-1]} B)")
        return layout

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
                self._jobs[s.req_id] = _Job(s, self._sender, self._layout, self._job_ended)
            elif job.final_queued and not job.ended and not s.completes_prefill:
                # Decode step after the hand-off was queued: the GDN state is about to advance.
                job.drain(self._cfg.drain_timeout_s)

    def save_kv_layer(self, layer_name: str) -> None:
        if not self._steps:
            return
        layer = self._attn_by_name.get(layer_name)
        if layer is None:
            return
        for s in self._steps.values():
            job = self._jobs.get(s.req_id)
            if job is None or job.ended or job.final_queued:
                continue
            # This layer has just written its cache for the step: full pages are final, and in the
            # step that completes the prefill so is the tail page.
            bs = self._layout.block_size
            upto = -(-s.prompt_len // bs) if s.completes_prefill else s.end // bs
            self._queue_attention(job, s, layer, upto)

    def wait_for_save(self) -> None:
        if not self._steps:
            return
        for s in self._steps.values():
            job = self._jobs.get(s.req_id)
            if job is None or job.ended or job.final_queued or not s.completes_prefill:
                continue
            n_pages = -(-s.prompt_len // self._layout.block_size)
            for layer in self._attn:  # any layer that did not call save_kv_layer
                self._queue_attention(job, s, layer, n_pages)
            job.write([(g.index, 0, g.page_addr(_state_block(s.block_ids[g.group]))) for g in self._gdn])
            job.finish()
        self._steps = {}

    def _queue_attention(self, job: _Job, s: ReqStep, layer: _Layer, upto: int) -> None:
        first = job.queued_pages.get(layer.index, 0)
        if upto <= first:
            return
        blocks = s.block_ids[layer.group]
        job.write([(layer.index, i, layer.page_addr(blocks[i])) for i in range(first, upto)])
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


def _state_block(blocks: list[int]) -> int:
    # Without prefix caching a GDN group holds one block per request; in "align" mode the list is
    # position-indexed with null (0) placeholders and the running state is the last entry.
    return blocks[-1]


def _dtype(dt: torch.dtype) -> str:
    name = DTYPE_NAMES.get(dt)
    if name not in _SENT_DTYPES:
        raise ConnectorConfigError(f"KV-cache dtype {dt} not supported by the hand-off")
    return name

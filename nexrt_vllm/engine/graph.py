"""GPU decode path: fused Triton kernels, one CUDA graph per decode step, pipelined replays.

`FusedDecoder` re-packs the engine's weights once (projections that read the same input are
concatenated, so each layer is a handful of weight streams) and enqueues one decode step as
~5 launches per layer with no host values in them: the token, the position (`DecodeState.position`),
the step counter and the sampling parameters are device buffers. `GraphRunner` captures that step
(embedding, every layer, final norm, lm_head, token selection, control publication) into one CUDA
graph, so a generated token costs exactly one graph replay.

Control: the last kernel writes (step << 32 | token) into a ring of host-mapped pinned memory (one
8-byte store, so the host never sees a torn pair; if mapping is unavailable, a device ring plus a
copy node into pinned memory). The host enqueues replay k+1 before it waits for token k (spinning
on the ring, no device sync), does stop detection itself, and discards the one replay that ran past
a stop. The ring (not a single slot) means replay k+1 can land before the host has read k.

Layout assumptions are those of `DecodeState` (docs/ARCHITECTURE.md §1) and `weights.py` canonical
names; the CPU/eager engine stays the oracle these kernels are checked against.
"""
from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import EngineError
from .fp8 import FP8Weight, cat_rows, split_views, take_rows
from .state import AttentionState, DecodeState, GDNState

RING = 64  # control slots; must exceed the replays in flight (2)
MOE = "moe"  # a plan entry's stream: the MoE experts launch (`FusedDecoder._l2_plan`)


@dataclass(frozen=True)
class Tuning:
    """Launch shapes of the fused step (chosen by on-device sweeps, docs/GPU.md) and PDL on/off.

    `gemv`: (max output rows, block_n, block_k, num_warps), first match wins. Few output rows need
    few rows per program and long K blocks, so that enough programs stream enough bytes each."""
    gemv: tuple = ((4096, 2, 1024, 4), (10000, 8, 256, 4), (1 << 62, 16, 256, 4))
    # The speculative verify's M-row GEMVs (engine/spec_graph.py): the same rules plus the kernel, as
    # pipeline stages of the tensor-core kernel (kernels/gemv.py `gemv_rows_dot_kernel`; 0 = the fold
    # kernel `gemv_rows_kernel`); its GDN out_proj and lm_head as (rows, K block, warps, stages). The
    # best per launch group of two H200 sweeps (2B, 8K; docs/GPU.md).
    gemv_rows: tuple = ((4096, 16, 256, 1, 5), (10000, 32, 256, 2, 3), (1 << 62, 32, 256, 2, 3))
    gemv_gated_rows: tuple = (8, 1024, 8, 0)
    lm_rows: tuple = (64, 256, 4, 3)
    gemv_gated: tuple = (8, 1024, 8)  # GDN out_proj (gated-norm prologue), by the same sweep
    gemv_router: tuple = (4, 1024, 4)  # MoE router (E+1 rows)
    block_n_lm: int = 16
    attn_splits: int = 128
    attn_block: int = 64
    attn_min_per: int = 64
    attn_warps: int = 4
    gdn_block_v: int = 16
    # One-warp programs for the GDN step and the MoE experts: their reductions (the L2 norms, the
    # top-k picks of the routing, the per-expert dot products) stay in warp shuffles, no CTA barrier
    # between a program's loads and its arithmetic.
    gdn_warps: int = 1
    moe_block_n: int = 2
    moe_block_k: int = 256
    moe_down_block_n: int = 1
    moe_down_block_k: int = 512
    moe_warps: int = 1
    moe_down_warps: int = 1
    # Programmatic dependent launch for every kernel of the step (kernels/common.py) where the GPU has
    # it (`pdl_enabled`); None: the process default (NEXRT_PDL). With the small programs above, a
    # kernel's CTAs can be resident while its predecessor drains.
    pdl: bool | None = True
    # With PDL: K blocks of its bf16 weight rows each GEMV program loads before it waits on the
    # previous kernel, and (when > 0) the GDN step's state slice too; what neither depends on the
    # previous kernel streams while it drains. 0: every load after the wait.
    prefetch: int = 2
    prefetch_conv: int = 0  # the same for the GDN in_proj + conv launches (their own measured best)
    # Columns each GEMV / MoE thread sums in registers before accumulating (kernels/gemv.py `_fold`):
    # 0 the elements of one 16-byte load (8 bf16, 16 e4m3), 1 elementwise accumulators. `vec` for
    # bf16 weights (the fold measured mixed there: +40 / -7 us per step), `vec_fp8` for fp8 ones
    # (-198 / -94 us: their fp32 accumulators were what limited the bytes in flight).
    vec: int = 1
    # Logprobs / grammar masks: logits per program of the tail launch, and how many reads of the
    # host's mask flag a step makes before it gives up on the mask (each read crosses PCIe, ~1 us).
    tail_chunk: int = 2048
    mask_spin: int = 1 << 21
    # FP8 weights (fp8.FP8Weight, e4m3 + block scales; docs/GPU.md "FP8"): the same rules for the
    # fp8 kernels, chosen by their own sweeps (16 e4m3 per thread and load).
    gemv_fp8: tuple = ((4096, 4, 2048, 4), (10000, 16, 512, 4), (1 << 62, 16, 512, 4))
    gemv_gated_fp8: tuple = (8, 2048, 8)
    gemv_router_fp8: tuple = (4, 2048, 8)
    block_n_lm_fp8: int = 32
    block_k_lm_fp8: int = 512
    moe_fp8: tuple = (8, 512, 2)  # gate_up: rows, K block, warps
    moe_down_fp8: tuple = (2, 256, 1)  # down: rows, K block, warps
    vec_fp8: int = 0
    prefetch_fp8: int = 0  # `prefetch` for fp8 weights: measured to cost them (-42 / +45 us per step without)
    # Round every e4m3 * scale to bf16 in the kernels, as the eager oracle's dequantized weights are:
    # the fp8 step then differs from the eager one only in the order of sums (parity diagnostics).
    fp8_round_weights: bool = False
    # Bytes of the next GEMV's weight each M = 1 GEMV launch asks L2 for as its programs finish
    # (kernels/common.py `l2_prefetch`, `FusedDecoder._l2_plan`); 0: none. Measured on the H200 against
    # none in one process (docs/GPU.md): 1 MiB takes 12-27 us off the bf16 2B step at 1K-128K; on the
    # MoE 35B-A3B shape it was mixed (-23 us at 8K, +19 us at 32K), so MoE models (`l2_prefetch_moe`)
    # and GEMVs over fp8 weights (`l2_prefetch_fp8`, +5 to +20 us) ask nothing; 16 MiB cost 92 us.
    l2_prefetch: int = 1 << 20
    l2_prefetch_moe: int = 0
    l2_prefetch_fp8: int = 0

    def shape(self, n: int, fp8: bool = False, rows: bool = False) -> dict:
        rules = self.gemv_fp8 if fp8 else self.gemv_rows if rows and self.gemv_rows else self.gemv
        for max_rows, bn, bk, nw, *dot in rules:  # `dot`: the rows rules' 5th field (absent: the fold kernel)
            if n <= max_rows:
                return {"block_n": bn, "block_k": bk, "num_warps": nw, **({"dot": (dot or [0])[0]} if rows else {})}
        raise AssertionError("unreachable: the last gemv rule has no row limit")


def pdl_enabled(requested: bool | None, process_default: bool, capability: tuple[int, int] | None) -> bool:
    """Whether the step's kernels launch with PDL: as requested (None: the process default), and only
    on a device that has it (compute capability 9.0+, Hopper; None: not a CUDA device). The kernels
    then carry `griddepcontrol`, which an older GPU cannot run."""
    want = process_default if requested is None else requested
    return bool(want) and capability is not None and capability >= (9, 0)


def _require_gpu_dtype(cfg: ModelConfig, dtype: torch.dtype) -> None:
    if dtype != torch.bfloat16:
        raise EngineError(f"the GPU graph path runs bfloat16 models only (got {dtype}); use the eager path")
    if cfg.conv_kernel < 2:
        raise EngineError(f"conv kernel {cfg.conv_kernel} < 2 is not supported by the GPU path")


def _concat_shared(parts: list, tail_ok: bool = True) -> tuple:
    """Concatenate row blocks into one matrix and return views of it standing in for the parts.

    The caller re-points the eager model's weights at the views, so the fused and the eager path
    read the same memory (no second copy of a 70 GB model). FP8 parts (fp8.FP8Weight) stay fp8,
    each with its own scale grid; bf16 parts after them become the fused weight's bf16 tail
    (`tail_ok`: not for [gate; up], whose halves the SwiGLU reads in one format). Other mixes of
    fp8 and bf16 parts are dequantized here into one bf16 matrix."""
    if any(isinstance(p, FP8Weight) for p in parts):
        kinds = [isinstance(p, FP8Weight) for p in parts]
        n8 = kinds.index(False) if False in kinds else len(kinds)
        if all(kinds[:n8]) and not any(kinds[n8:]) and (tail_ok or n8 == len(parts)):
            fused = cat_rows(parts)
            return fused, split_views(fused, parts)
        dt = next(p.dtype for p in parts if not isinstance(p, FP8Weight))
        parts = [p.dequant(dt) if isinstance(p, FP8Weight) else p for p in parts]
    fused = torch.cat(parts)
    views, r = [], 0
    for p in parts:
        views.append(fused[r:r + p.shape[0]].view_as(p))
        r += p.shape[0]
    return fused, views


def _next_in_proj(cfg: ModelConfig, w):
    """Qwen3-Next groups in_proj_qkvz / in_proj_ba per key head; regroup the rows to [q|k|v|z|b|a].
    (A copy: the eager path keeps its grouped matrices; an fp8 weight's rows move with their scale rows.)"""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    if isinstance(w.in_proj_qkvz, FP8Weight) or isinstance(w.in_proj_ba, FP8Weight):
        dev = w.in_proj_qkvz.device
        iq = torch.arange(w.in_proj_qkvz.shape[0], device=dev).view(nk, 2 * dk + 2 * r * dv)
        ib = torch.arange(w.in_proj_ba.shape[0], device=dev).view(nk, 2 * r)
        qkvz = torch.cat([t.reshape(-1) for t in torch.split(iq, [dk, dk, r * dv, r * dv], dim=1)])
        ba = torch.cat([t.reshape(-1) for t in torch.split(ib, [r, r], dim=1)])
        return _concat_shared([take_rows(w.in_proj_qkvz, qkvz), take_rows(w.in_proj_ba, ba)])[0]
    q, k, v, z = torch.split(w.in_proj_qkvz.view(nk, 2 * dk + 2 * r * dv, -1), [dk, dk, r * dv, r * dv], dim=1)
    b, a = torch.split(w.in_proj_ba.view(nk, 2 * r, -1), [r, r], dim=1)
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a)]).contiguous()


_PAGE = 4096
_ALIGN = 128


def _control_specs(vocab_size: int) -> dict:
    """What the host and the step share, name -> (shape, dtype, initial value): the control ring; the
    logprob ring parallel to it (slot s: the chosen token's logprob then the top KMAX, and their
    ids); the grammar flag (masks of every step <= flag are written) and two mask slots (step % 2);
    the speculative round records (round << 32 | tokens emitted, engine/spec_graph.py)."""
    from .kernels.sampling import KMAX
    return {"ring": ((RING,), torch.int64, -1), "rounds": ((RING,), torch.int64, -1),
            "lpv": ((RING, KMAX + 1), torch.float32, 0),
            "lpi": ((RING, KMAX), torch.int32, 0), "flag": ((1,), torch.int64, 0),
            "masks": ((2, (vocab_size + 31) // 32), torch.int32, -1)}


class _Mapped:
    """Page-locked, device-mapped host memory holding the tensors of `specs`, unregistered when dropped.

    The tensors sit alone on whole pages of an over-allocated buffer (registration is per page, so no
    other allocation may share them). UVA: the mapped device address equals the host address."""

    def __init__(self, dev: torch.device, specs: dict):
        offs, n = {}, 0
        for name, (shape, dtype, _) in specs.items():
            offs[name] = n
            n += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        size = -(-n // _PAGE) * _PAGE
        self._backing = torch.zeros(size + _PAGE, dtype=torch.uint8)
        base = -self._backing.data_ptr() % _PAGE
        self._ptr = self._backing.data_ptr() + base
        rc = torch.cuda.cudart().cudaHostRegister(self._ptr, size, 2)  # cudaHostRegisterMapped
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister failed ({rc})")
        self.host, self.device = {}, {}
        for name, (shape, dtype, fill) in specs.items():
            nbytes = math.prod(shape) * dtype.itemsize
            h = self._backing[base + offs[name]:base + offs[name] + nbytes].view(dtype).view(shape)
            h.fill_(fill)
            self.host[name] = h

            class _Iface:
                __cuda_array_interface__ = {"shape": tuple(shape), "typestr": _TYPESTR[dtype],
                                            "data": (h.data_ptr(), False), "version": 3, "strides": None}
            self.device[name] = torch.as_tensor(_Iface(), device=dev)

    def __del__(self):
        torch.cuda.synchronize()  # no replay may still write the pages
        torch.cuda.cudart().cudaHostUnregister(self._ptr)


_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.float32: "<f4"}


class ControlMemory:
    """The host <-> step tensors (`_control_specs`), as host views and the device views kernels use.

    mode "host-mapped" (preferred): kernels write the rings over PCIe and read the grammar masks
    from host memory, so no copy node and no sync. "pinned-copy" (mapping failed): device rings
    copied into pinned memory by the graph's last nodes; grammar masks are then not available to
    the graph (`masks` False). "cpu": one set of tensors (the interpreter tests)."""

    def __init__(self, dev: torch.device, vocab_size: int):
        specs = _control_specs(vocab_size)
        self._owner = None
        if dev.type != "cuda":
            self.mode, self.host = "cpu", {k: torch.full(sh, f, dtype=dt) for k, (sh, dt, f) in specs.items()}
            self.device = self.host
            return
        from .kernels import sampling
        try:
            mem = _Mapped(dev, specs)
            # Round trip through the very kernel that publishes tokens: it writes, the host must see it.
            pm = torch.full((1,), 1.0, device=dev)
            pi = torch.full((1,), 9, dtype=torch.int32, device=dev)
            z = torch.zeros(1, dtype=torch.int64, device=dev)
            sampling.finish(pm, pi, 1, z.clone(), z.clone(), z.clone(), mem.device["ring"], RING)
            torch.cuda.synchronize()
            if int(mem.host["ring"][0]) == (1 << 32) | 9:
                mem.host["ring"].fill_(-1)
                self.mode, self.host, self.device, self._owner = "host-mapped", mem.host, mem.device, mem
                return
        except Exception:  # noqa: BLE001 - any failure means: use the copy path
            pass
        self.mode = "pinned-copy"
        self.host = {k: torch.full(sh, f, dtype=dt).pin_memory() for k, (sh, dt, f) in specs.items()}
        self.device = {k: torch.full(sh, f, dtype=dt, device=dev) for k, (sh, dt, f) in specs.items()}

    @property
    def masks(self) -> bool:
        """Whether the step can wait for and read host-written grammar masks."""
        return self.mode in ("host-mapped", "cpu")


@dataclass(frozen=True, eq=False)
class GDNMixer:
    """A GDN layer as the fused step reads it: in_proj rows regrouped to [q|k|v|z|b|a] (one GEMV with
    the causal conv as epilogue), the conv filter, gates, the gated-norm weight, out_proj, its state."""
    w_in: torch.Tensor
    conv_w: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    w_out: torch.Tensor
    state: GDNState


@dataclass(frozen=True, eq=False)
class AttentionMixer:
    """A full-attention layer: [q|k|v] rows in one matrix, the q/k norms, o_proj, its K/V cache."""
    w_qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    w_o: torch.Tensor
    state: AttentionState


@dataclass(frozen=True, eq=False)
class MoEFFN:
    """A sparse MoE block: router rows then the shared-expert gate row in one matrix, the routed
    experts' gate_up [E, 2I, H] / down [E, H, I], the shared expert's [gate; up] and down."""
    w_router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    s_gate_up: torch.Tensor
    s_down: torch.Tensor


@dataclass(frozen=True, eq=False)
class DenseFFN:
    w_gate_up: torch.Tensor  # [gate; up]
    w_down: torch.Tensor


@dataclass(frozen=True, eq=False)
class FusedLayer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: GDNMixer | AttentionMixer
    ffn: MoEFFN | DenseFFN


@dataclass(frozen=True, eq=False)
class Launch:
    """One kernel launch of the fused step: its group (the benchmark times and counts bytes per group),
    the model layer it serves (None: embedding, lm_head) and the call that enqueues it."""
    group: str
    layer: int | None
    run: Callable[[], None]


class FusedDecoder:
    """Static buffers + fused weights over an eager `Model`; `launch()` enqueues one decode step.

    mode "fused": the Triton kernels (~5 launches per layer). mode "eager": the eager model's own
    `decode` (same ops as the oracle, so greedy tokens are bit-identical), used to check the graph
    machinery separately from the kernels' numerics.
    """

    def __init__(self, model, state: DecodeState, mode: str = "fused", tuning: Tuning | None = None):
        if mode not in ("fused", "eager"):
            raise EngineError(f"mode must be 'fused' or 'eager', got {mode!r}")
        cfg = model.config
        _require_gpu_dtype(cfg, state.dtype)
        from .kernels import attention, common, gdn, gemv, moe, sampling  # triton: GPU path only
        self.k_common = common
        self.k_attn, self.k_gdn, self.k_gemv, self.k_moe, self.k_samp = attention, gdn, gemv, moe, sampling
        self.model, self.cfg, self.state, self.mode, self.t = model, cfg, state, mode, tuning or Tuning()
        self.pdl = pdl_enabled(self.t.pdl, common.DEFAULT_PDL,
                               torch.cuda.get_device_capability(state.device) if state.device.type == "cuda" else None)
        dev, dt, c = state.device, state.dtype, cfg
        self.layers: list[FusedLayer] = [
            FusedLayer(lw.input_norm, lw.post_norm, self._fuse_mixer(i, lw), self._fuse_ffn(lw.ffn))
            for i, lw in enumerate(model.layers if mode == "fused" else ())]
        max_buf = max([1] + [(L.mixer.w_in if isinstance(L.mixer, GDNMixer) else L.mixer.w_qkv).shape[0]
                             for L in self.layers])
        self.embed, self.final_norm, self.lm_head = model.embed, model.final_norm, model.lm_head
        # Static activations (addresses fixed for capture).
        H = c.hidden_size
        self.res = torch.zeros(H, dtype=dt, device=dev)
        self.buf = torch.zeros(max_buf, dtype=dt, device=dev)
        self.o = torch.zeros(max(c.value_dim, c.num_heads * c.head_dim), dtype=dt, device=dev)
        self.q = torch.zeros(c.num_heads * c.head_dim, dtype=dt, device=dev)
        ns = self.t.attn_splits
        self.m_buf = torch.zeros(c.num_heads * ns, dtype=torch.float32, device=dev)
        self.l_buf = torch.zeros(c.num_heads * ns, dtype=torch.float32, device=dev)
        self.acc_buf = torch.zeros(c.num_heads * ns * c.head_dim, dtype=torch.float32, device=dev)
        self.s_buf = torch.zeros(c.num_heads * state.max_seq_len, dtype=torch.float32, device=dev)  # scores
        if c.num_experts:
            imax = max(c.moe_intermediate_size, c.shared_expert_intermediate_size)
            self.act = torch.zeros((c.num_experts_per_tok + 1) * imax, dtype=dt, device=dev)
            self.router_logits = torch.zeros(c.num_experts + 1, dtype=dt, device=dev)
            self.ids = torch.zeros(c.num_experts_per_tok, dtype=torch.int32, device=dev)
            self.wts = torch.zeros(c.num_experts_per_tok, dtype=torch.float32, device=dev)
            self.xn = torch.zeros(c.hidden_size, dtype=dt, device=dev)
        if c.intermediate_size:
            self.act_dense = torch.zeros(c.intermediate_size, dtype=dt, device=dev)
        self.logits = torch.zeros(c.vocab_size, dtype=torch.float32, device=dev)
        lm8 = isinstance(self.lm_head, FP8Weight)
        self.lm_shape = self._fit(self.lm_head, {"block_n": self.t.block_n_lm_fp8 if lm8 else self.t.block_n_lm,
                                                 "block_k": self.t.block_k_lm_fp8 if lm8 else 256})
        self.n_part = -(-c.vocab_size // self.lm_shape["block_n"])
        self.pmax = torch.zeros(max(self.n_part, -(-c.vocab_size // 2048)), dtype=torch.float32, device=dev)
        self.pidx = torch.zeros_like(self.pmax, dtype=torch.int32)
        # Control state on the device.
        self.tok = torch.zeros(1, dtype=torch.int64, device=dev)
        self.step = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos_scratch = torch.zeros(1, dtype=torch.int64, device=dev)
        self.mem = ControlMemory(dev, c.vocab_size)
        self.control = self.mem.mode
        self.ring_host, self.ring = self.mem.host["ring"], self.mem.device["ring"]
        self.params = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float32, device=dev)  # temperature, top_p, top_k
        self.seed = torch.zeros(1, dtype=torch.int64, device=dev)
        # Logprobs / grammar masks: the tail launch's partials, the requested k, the mask status.
        from .kernels.sampling import KMAX
        if self.t.tail_chunk < 64 or self.t.tail_chunk & (self.t.tail_chunk - 1):
            raise EngineError(f"Tuning.tail_chunk must be a power of two >= 64, got {self.t.tail_chunk}")
        self.n_tail = -(-c.vocab_size // self.t.tail_chunk)
        self.tmax = torch.zeros(self.n_tail, dtype=torch.float32, device=dev)
        self.tidx = torch.zeros(self.n_tail, dtype=torch.int32, device=dev)
        self.tsum = torch.zeros(self.n_tail, dtype=torch.float32, device=dev)
        self.topv = torch.zeros(self.n_tail * KMAX, dtype=torch.float32, device=dev)
        self.topi = torch.zeros(self.n_tail * KMAX, dtype=torch.int32, device=dev)
        self.lp_k = torch.zeros(1, dtype=torch.int32, device=dev)
        self.mask_status = torch.full((1,), -1, dtype=torch.int64, device=dev)

    def _fuse_mixer(self, i: int, lw) -> GDNMixer | AttentionMixer:
        m = lw.mixer
        if lw.kind == "linear_attention":
            if self.cfg.family == "qwen3_next":
                w_in = _next_in_proj(self.cfg, m)
            else:
                w_in, (m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a) = _concat_shared(
                    [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a])
            return GDNMixer(w_in, m.conv1d.contiguous(), m.A_log, m.dt_bias, m.norm, m.out_proj, self.state.gdn(i))
        w_qkv, (m.q_proj, m.k_proj, m.v_proj) = _concat_shared([m.q_proj, m.k_proj, m.v_proj])
        return AttentionMixer(w_qkv, m.q_norm, m.k_norm, m.o_proj, self.state.attention(i))

    @staticmethod
    def _fuse_ffn(f) -> MoEFFN | DenseFFN:
        if hasattr(f, "router"):
            w_router, (f.router, f.shared_gate) = _concat_shared([f.router, f.shared_gate])
            s_gate_up, (f.shared.gate_proj, f.shared.up_proj) = _concat_shared(
                [f.shared.gate_proj, f.shared.up_proj], tail_ok=False)
            return MoEFFN(w_router, f.gate_up_proj, f.down_proj, s_gate_up, f.shared.down_proj)
        w_gate_up, (f.gate_proj, f.up_proj) = _concat_shared([f.gate_proj, f.up_proj], tail_ok=False)
        return DenseFFN(w_gate_up, f.down_proj)

    def _shape(self, w, n: int, prefetch: int | None = None, rows: bool = False) -> dict:
        """Launch shape of a GEMV over `w` with n output rows (Tuning.gemv / gemv_fp8; `rows`: the verify's
        M-row GEMV, Tuning.gemv_rows); fp8 rows before a bf16 tail must fill whole programs. `prefetch`: K
        blocks of a bf16 `w` ahead of the wait (None: Tuning's; fp8 weights take Tuning.prefetch_fp8)."""
        return self._fit(w, self.t.shape(n, fp8=isinstance(w, FP8Weight), rows=rows), prefetch)

    def _fit(self, w, shape: dict, prefetch: int | None = None) -> dict:
        if isinstance(w, FP8Weight):
            shape = {**shape, "prefetch": self.t.prefetch_fp8, "vec": self.t.vec_fp8,
                     "round_w": self.t.fp8_round_weights}
            if w.tail is not None:
                shape["block_n"] = min(shape["block_n"], w.n8 & -w.n8)
            return shape
        return {**shape, "prefetch": self.t.prefetch if prefetch is None else prefetch, "vec": self.t.vec}

    def _rule(self, w, bf16: tuple, fp8: tuple) -> dict:
        return self._fit(w, dict(zip(("block_n", "block_k", "num_warps"), fp8 if isinstance(w, FP8Weight) else bf16)))

    # ---- one decode step -------------------------------------------------------------------------
    def plan(self) -> list[Launch]:
        """The fused step as its launches, in order: the step runs them; benchmarks/decode_bench.py
        times each group and counts the bytes it moves. With `Tuning.l2_prefetch` each GEMV launch
        asks L2, as its programs finish, for the first bytes of the next GEMV's weight (`_l2_plan`)."""
        c, g = self.cfg, self.k_gemv
        entries = [("embed", None, lambda: self.k_samp.embed(self.tok, self.embed, self.res), None)]
        for i, L in enumerate(self.layers):
            mixer = self._gdn if isinstance(L.mixer, GDNMixer) else self._attention
            ffn = self._moe if isinstance(L.ffn, MoEFFN) else self._dense
            entries += [(group, i, fn, stream) for group, fn, stream in mixer(L) + ffn(L)]
        entries.append(("lm_head+argmax", None, lambda **l2: g.gemv(
            self.res, self.lm_head, self.logits, pro=g.PRO_RMSNORM, epi=g.EPI_ARGMAX, norm_w=self.final_norm,
            aux0=self.pmax, aux1=self.pidx, eps=c.rms_norm_eps, **l2, **self.lm_shape), (self.lm_head, False)))
        targets = self._l2_plan([e[3] for e in entries])
        return [Launch(group, i, fn if t is None else functools.partial(fn, l2=t))
                for (group, i, fn, _), t in zip(entries, targets)]

    def _l2_plan(self, streams: list) -> list:
        """Per launch, the `gemv` l2 target it asks for: the next GEMV's first `Tuning.l2_prefetch` bytes
        (`l2_prefetch_moe` in an MoE model, `l2_prefetch_fp8` from a GEMV over fp8 weights), for GEMV
        launches (stream = (weight, SwiGLU halves)) followed by another before any MoE experts launch
        (stream MOE: its tens of MB of expert weights would evict what was asked for)."""
        out, nxt = [None] * len(streams), None
        for j in range(len(streams) - 1, -1, -1):
            s = streams[j]
            if s is MOE:
                nxt = None
            elif s is not None:
                nbytes = self.t.l2_prefetch_fp8 if isinstance(s[0], FP8Weight) else \
                    self.t.l2_prefetch_moe if self.cfg.num_experts else self.t.l2_prefetch
                if nxt is not None and nbytes > 0:
                    out[j] = self.k_gemv.l2_target(nxt[0], nbytes, halves=nxt[1])
                nxt = s
        return out

    def _gdn(self, L: FusedLayer) -> list[tuple]:
        c, g, t, m, eps = self.cfg, self.k_gemv, self.t, L.mixer, self.cfg.rms_norm_eps
        return [
            ("gdn_in_proj+conv", lambda **l2: g.gemv(
                self.res, m.w_in, self.buf, pro=g.PRO_RMSNORM, epi=g.EPI_CONV, norm_w=L.input_norm,
                aux0=m.state.conv, aux1=m.conv_w, eps=eps, conv_n=c.conv_dim, kc=c.conv_kernel, **l2,
                **self._shape(m.w_in, m.w_in.shape[0], prefetch=t.prefetch_conv)), (m.w_in, False)),
            ("gdn_step", lambda: self.k_gdn.gdn_step(
                self.buf, m.state.rec, self.o, m.a_log, m.dt_bias, num_k_heads=c.linear_num_key_heads,
                num_v_heads=c.linear_num_value_heads, head_k_dim=c.linear_key_head_dim,
                head_v_dim=c.linear_value_head_dim, block_v=t.gdn_block_v, num_warps=t.gdn_warps,
                prefetch=t.prefetch > 0), None),
            ("gdn_out_proj", lambda **l2: g.gemv(
                self.o, m.w_out, self.res, pro=g.PRO_GATED, epi=g.EPI_RESIDUAL, norm_w=m.norm,
                z=self.buf[c.conv_dim:c.conv_dim + c.value_dim], eps=eps, group=c.linear_value_head_dim, **l2,
                **self._rule(m.w_out, t.gemv_gated, t.gemv_gated_fp8)), (m.w_out, False))]

    def _attention(self, L: FusedLayer) -> list[tuple]:
        c, g, t, m, eps, pos = self.cfg, self.k_gemv, self.t, L.mixer, self.cfg.rms_norm_eps, self.state.position
        return [
            ("attn_qkv_proj", lambda **l2: g.gemv(
                self.res, m.w_qkv, self.buf, pro=g.PRO_RMSNORM, norm_w=L.input_norm, eps=eps, **l2,
                **self._shape(m.w_qkv, m.w_qkv.shape[0])), (m.w_qkv, False)),
            ("attn_qknorm_rope_kvwrite", lambda: self.k_attn.qk_rope_cache(
                self.buf, self.q, m.state.k, m.state.v, m.q_norm, m.k_norm, self.model.rope_cos, self.model.rope_sin,
                pos, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                rotary_dim=c.rotary_dim, eps=eps), None),
            ("attn_splitk+combine", lambda: self.k_attn.attention_decode(
                self.q, m.state.k, m.state.v, pos, self.buf, self.o, self.m_buf, self.l_buf, self.acc_buf,
                self.s_buf, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                nsplit=t.attn_splits, block=t.attn_block, min_per=t.attn_min_per, num_warps=t.attn_warps), None),
            ("attn_o_proj", lambda **l2: g.gemv(
                self.o, m.w_o, self.res, epi=g.EPI_RESIDUAL, **l2, **self._shape(m.w_o, c.hidden_size)),
             (m.w_o, False))]

    def _moe(self, L: FusedLayer) -> list[tuple]:
        c, g, t, f, eps = self.cfg, self.k_gemv, self.t, L.ffn, self.cfg.rms_norm_eps
        up8 = isinstance(f.gate_up, FP8Weight) or isinstance(f.s_gate_up, FP8Weight)
        dn8 = isinstance(f.down, FP8Weight) or isinstance(f.s_down, FP8Weight)
        bn, bk, nw = t.moe_fp8 if up8 else (t.moe_block_n, t.moe_block_k, t.moe_warps)
        dbn, dbk, dnw = t.moe_down_fp8 if dn8 else (t.moe_down_block_n, t.moe_down_block_k, t.moe_down_warps)
        return [
            ("moe_router", lambda **l2: g.gemv(
                self.res, f.w_router, self.router_logits, pro=g.PRO_RMSNORM, norm_w=L.post_norm, eps=eps,
                xn_out=self.xn, **l2, **self._rule(f.w_router, t.gemv_router, t.gemv_router_fp8)),
             (f.w_router, False)),
            ("moe_experts", lambda: self.k_moe.moe_experts(
                self.xn, self.res, self.router_logits, f.gate_up, f.s_gate_up, f.down, f.s_down,
                self.act, self.ids, self.wts, top_k=c.num_experts_per_tok, block_n=bn, block_k=bk,
                down_block_n=dbn, down_block_k=dbk, num_warps=nw, down_num_warps=dnw, norm_topk=c.norm_topk_prob,
                round_w=t.fp8_round_weights, vec=t.vec_fp8 if up8 or dn8 else t.vec), MOE)]

    def _dense(self, L: FusedLayer) -> list[tuple]:
        c, g, f = self.cfg, self.k_gemv, L.ffn
        return [
            ("mlp_gate_up+swiglu", lambda **l2: g.gemv(
                self.res, f.w_gate_up, self.act_dense, pro=g.PRO_RMSNORM, epi=g.EPI_SWIGLU, norm_w=L.post_norm,
                eps=c.rms_norm_eps, **l2, **self._shape(f.w_gate_up, f.w_gate_up.shape[0] // 2)),
             (f.w_gate_up, True)),
            ("mlp_down", lambda **l2: g.gemv(
                self.act_dense, f.w_down, self.res, epi=g.EPI_RESIDUAL, **l2, **self._shape(f.w_down, c.hidden_size)),
             (f.w_down, False))]

    def launch(self, sample: bool = False, logprobs: bool = False, mask: bool = False) -> None:
        """Enqueue one decode step: input token `tok` at `position`; leaves the next token in `tok`.
        `logprobs`: also the chosen token's logprob and the top `lp_k` into the logprob ring;
        `mask`: wait for this step's grammar mask from the host and apply it before the choice."""
        with self.launch_options():
            self._launch(sample, logprobs, mask)

    def launch_options(self):
        """Context in which this decoder's kernels are launched (PDL per `pdl_enabled`)."""
        return self.k_common.launch_options(self.pdl)

    def _launch(self, sample: bool, logprobs: bool = False, mask: bool = False) -> None:
        pos = self.state.position
        if self.mode == "fused":
            for step in self.plan():
                step.run()
            n_part = self.n_part
        else:
            self.logits.copy_(self.model.decode(self.tok, self.state))  # advances position itself
            pos = self.pos_scratch
            torch.amax(self.logits, 0, keepdim=True, out=self.pmax[:1])
            self.pidx[:1].copy_(torch.argmax(self.logits, 0, keepdim=True))
            n_part = 1
        pmax, pidx, dm = self.pmax, self.pidx, self.mem.device
        if logprobs or mask:
            # One launch over the logits: the mask (stored back for the sampler's sort), the masked
            # (max, argmax) and sum of exp per program, and the per-program top k.
            n_tail = self.k_samp.tail(self.logits, self.step, dm["flag"], dm["masks"], self.lp_k, self.mask_status,
                                      self.tmax, self.tidx, self.tsum, self.topv, self.topi, mask=mask,
                                      topk=logprobs, write=mask and sample, chunk=self.t.tail_chunk,
                                      spin=self.t.mask_spin)
            if not sample:
                pmax, pidx, n_part = self.tmax, self.tidx, n_tail
        if sample:
            # engine.sampling_probs's rule: top-k first, then top-p over the top-k set renormalised;
            # all on the device (the parameters are device scalars).
            vals, idx = torch.sort(self.logits, descending=True)
            probs = torch.softmax(vals / self.params[0], dim=0)
            cum = torch.cumsum(probs, 0)
            v = cum.numel()
            k = torch.where(self.params[2] > 0, self.params[2], float(v)).clamp(1, v).long() - 1
            cum_excl = (cum - probs) / cum.index_select(0, k.view(1))
            n_part = self.k_samp.gumbel_partial(vals, idx, cum_excl, self.params, self.seed, self.state.position,
                                                self.pmax, self.pidx)
        lp = ((self.logits, self.tmax, self.tsum, self.n_tail, self.topv, self.topi, self.lp_k, dm["lpv"], dm["lpi"])
              if logprobs else None)
        self.k_samp.finish(pmax, pidx, n_part, self.tok, pos, self.step, self.ring, RING, lp=lp,
                           status=self.mask_status if mask else None)
        if self.control == "pinned-copy":
            if logprobs:  # before the token ring: the host reads a token's logprobs after the token
                self.mem.host["lpv"].copy_(dm["lpv"], non_blocking=True)
                self.mem.host["lpi"].copy_(dm["lpi"], non_blocking=True)
            self.ring_host.copy_(self.ring, non_blocking=True)


class GraphRunner:
    """One captured CUDA graph per decode step over a `FusedDecoder`, one graph per variant
    (sample, logprobs, mask): the plain greedy and sampling steps stay as they were; logprobs and
    grammar masks add the tail launch and a longer finish."""

    VARIANTS = tuple((s, lp, m) for s in (False, True) for lp in (False, True) for m in (False, True))

    def __init__(self, decoder: FusedDecoder):
        self.d = decoder
        self.graphs: dict[tuple[bool, bool, bool], torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.finish_reason: str | None = None

    @property
    def masks(self) -> bool:
        """Whether grammar-constrained requests can run on the graph (host-mapped control memory)."""
        return self.d.mem.masks

    def _graph(self, sample: bool, logprobs: bool = False, mask: bool = False) -> torch.cuda.CUDAGraph:
        key = (sample, logprobs, mask)
        if key not in self.graphs:
            if mask and not self.masks:
                raise EngineError(f"grammar masks need host-mapped control memory (have {self.d.control})")
            d = self.d
            saved = self._snapshot()
            flag = d.mem.host["flag"]
            if mask:
                flag.fill_(1 << 62)  # the warm-up step must not wait for a mask
                torch.cuda.synchronize()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                d.launch(*key)  # warm-up: compiles the kernels, allocator settles
                torch.cuda.synchronize()
                self._restore(saved)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    d.launch(*key)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            self._restore(saved)
            # The warm-up published step `step+1`; the restored counter will publish it again.
            d.ring.fill_(-1)
            d.ring_host.fill_(-1)
            flag.fill_(int(d.step.item()))  # no later step has a mask yet
            d.mask_status.fill_(-1)
            torch.cuda.synchronize()
            self.graphs[key] = g
        return self.graphs[key]

    def _snapshot(self) -> dict:
        # Warm-up runs a real step; put back every tensor it mutates so capture leaves no trace.
        d = self.d
        live = [d.state.position, d.tok, d.step, d.res] + d.state.buffers()
        return {id(t): (t, t.clone()) for t in live}

    @staticmethod
    def _restore(saved: dict) -> None:
        for t, c in saved.values():
            t.copy_(c)

    def capture(self, sample: bool = False, logprobs: bool = False, mask: bool = False) -> None:
        """Compile and capture one variant's step graph now rather than on first use."""
        self._graph(sample, logprobs, mask)

    def stream(self, first_token: int, params, constraint=None) -> Iterator[int]:
        """The token ids of `stream_steps`."""
        return (rec.token for rec in self.stream_steps(first_token, params, constraint))

    def stream_steps(self, first_token: int, params, constraint=None) -> Iterator:
        """`Engine.steps`'s contract (docs/ARCHITECTURE.md §1) on the graph path: the state holds N
        tokens and token N is `first_token` (already accepted by `constraint`); yields `Sampled`
        records of the following tokens until EOS (unless ignore_eos) / a stop id (both yielded) /
        max_tokens, which counts first_token / a full context / the grammar's end. Sets
        `finish_reason` ("stop" | "length")."""
        st = self.d.state
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.d.cfg.eos_token_ids))
        self.finish_reason = None
        if first_token in stops or (constraint is not None and constraint.terminated):
            self.finish_reason = "stop"
            return
        n = min(params.max_tokens - 1, st.max_seq_len - st.seq_len)
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        for rec in self.steps(first_token, n, temperature=params.temperature, top_p=params.top_p,
                              top_k=max(params.top_k, 0), seed=seed, stop_token_ids=stops,
                              logprobs=params.logprobs, constraint=constraint):
            yield rec
            if rec.token in stops or (constraint is not None and constraint.terminated):
                self.finish_reason = "stop"
                return
        self.finish_reason = "length"

    def generate(self, first_token: int, max_new_tokens: int, **kw) -> Iterator[int]:
        """The token ids of `steps` (same arguments)."""
        return (rec.token for rec in self.steps(first_token, max_new_tokens, **kw))

    def steps(self, first_token: int, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
              top_k: int = 0, seed: int = 0, stop_token_ids=(), logprobs: int | None = None, constraint=None,
              timeout_s: float = 60.0):
        """Yield a `Sampled` per token after `first_token` (the token at position state.seq_len) until a
        stop id, the grammar's end or the limit.

        The state advances on the device; afterwards `state.seq_len` counts every replay that ran,
        including the one overrun replay after a stop (its token is discarded, its state write stays).
        With `constraint` (which has accepted `first_token`), the mask of step k+1 is written as soon
        as token k is read, while the device already runs step k+1's layers; the step waits for it
        only at its tail.
        """
        from .kernels.sampling import INVALID_TOKEN
        from .sampling import Sampled

        d, st = self.d, self.d.state
        if max_new_tokens <= 0:
            return
        if st.seq_len + max_new_tokens > st.max_seq_len:
            raise EngineError(f"seq_len {st.seq_len} + {max_new_tokens} new tokens exceeds max_seq_len "
                              f"{st.max_seq_len}")
        sample = temperature > 0
        if sample and not (0.0 < top_p <= 1.0):
            raise EngineError(f"top_p must be in (0, 1], got {top_p}")
        lp, mask = logprobs is not None, constraint is not None
        g = self._graph(sample, lp, mask)
        d.params.copy_(torch.tensor([temperature if sample else 1.0, top_p, float(top_k)]))
        d.seed.fill_(seed)
        d.tok.fill_(first_token)
        d.state.position.fill_(st.seq_len)
        if lp:
            d.lp_k.fill_(logprobs)
        base = int(d.step.item())
        if mask:
            self._publish_mask(constraint, base + 1)
        stops = set(stop_token_ids)
        ring, vocab = d.ring_host, d.cfg.vocab_size
        done = 0
        launched = 0
        try:
            g.replay()
            launched = 1
            while done < max_new_tokens:
                if launched < max_new_tokens:
                    g.replay()  # k+1 in flight before we read k
                    launched += 1
                want = base + done + 1
                slot = (want - 1) % RING
                deadline = time.monotonic() + timeout_s
                while (v := int(ring[slot])) >> 32 != want:
                    if time.monotonic() > deadline:
                        raise EngineError(f"decode step {want} did not publish within {timeout_s}s")
                tok = v & 0xFFFFFFFF
                if tok == INVALID_TOKEN:
                    raise EngineError(f"decode step {want}: its grammar mask did not arrive within "
                                      f"{d.t.mask_spin} flag reads")
                done += 1
                rec = Sampled(tok, *self._logprobs(slot, logprobs, vocab)) if lp else Sampled(tok)
                end = tok in stops
                if mask:
                    constraint.accept(tok)
                    end = end or constraint.terminated
                    if not end and done < max_new_tokens:
                        self._publish_mask(constraint, want + 1)
                yield rec
                if end:
                    break
        finally:
            if mask:
                d.mem.host["flag"].fill_(base + launched)  # releases a replay waiting for a mask that will not come
            self._sync()
            self.replays += launched
            st.seq_len += launched

    def _sync(self) -> None:
        torch.cuda.current_stream().synchronize()

    def _publish_mask(self, constraint, step: int) -> None:
        # The mask first, then the flag: x86 keeps the two stores in order for the device's reads.
        host = self.d.mem.host
        constraint.fill(host["masks"][step % 2:step % 2 + 1])
        host["flag"][0] = step

    def _logprobs(self, slot: int, k: int, vocab: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        host = self.d.mem.host
        vals = host["lpv"][slot, :k + 1].tolist()
        ids = host["lpi"][slot, :k].tolist()
        return vals[0], tuple((i, x) for i, x in zip(ids, vals[1:]) if i < vocab)

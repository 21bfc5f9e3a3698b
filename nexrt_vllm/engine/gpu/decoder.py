"""The fused decode step as a plan of launches over static buffers (`FusedDecoder`).

`FusedDecoder` re-packs the engine's weights once (gpu/fusion.py: each layer a handful of weight
streams) and enqueues one decode step as ~5 launches per layer with no host values in them: the
token, the position (`DecodeState.position`), the step counter and the sampling parameters are
device buffers, so gpu/runner.py can capture the step whole in a CUDA graph.

Layout assumptions are those of `DecodeState` (docs/ARCHITECTURE.md §1) and `weights.py` canonical
names; the CPU/eager engine stays the oracle these kernels are checked against.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.errors import EngineError
from nexrt_vllm.engine.fp8 import FP8Weight
from nexrt_vllm.engine.gpu.control import RING, ControlMemory
from nexrt_vllm.engine.gpu.fusion import FusedLayer, GDNMixer, MoEFFN, fuse_ffn, fuse_mixer
from nexrt_vllm.engine.gpu.tuning import GemvShape, Tuning, gemv_kwargs, moe_kwargs, pdl_enabled
from nexrt_vllm.engine.state import DecodeState


def _require_gpu_dtype(cfg: ModelConfig, dtype: torch.dtype) -> None:
    if dtype != torch.bfloat16:
        raise EngineError(f"the GPU graph path runs bfloat16 models only (got {dtype}); use the eager path")
    if cfg.conv_kernel < 2:
        raise EngineError(f"conv kernel {cfg.conv_kernel} < 2 is not supported by the GPU path")


def gdn_kw(cfg: ModelConfig, t: Tuning) -> dict:
    """The keywords every GDN recurrence launch takes (kernels/gdn.py, kernels/batch*.py): the layer's head
    counts and sizes, and the value block and warps of `Tuning` (the verify and the recommit must share them)."""
    return dict(num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim, block_v=t.gdn_block_v,
                num_warps=t.gdn_warps)


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
        from nexrt_vllm.engine.kernels import attention, common, gdn, gemv, moe, sampling  # triton: GPU path only
        self.k_common = common
        self.k_attn, self.k_gdn, self.k_gemv, self.k_moe, self.k_samp = attention, gdn, gemv, moe, sampling
        self.model, self.cfg, self.state, self.mode, self.t = model, cfg, state, mode, tuning or Tuning()
        self.pdl = pdl_enabled(self.t.pdl, common.DEFAULT_PDL,
                               torch.cuda.get_device_capability(state.device) if state.device.type == "cuda" else None)
        dev, dt, c = state.device, state.dtype, cfg
        self.layers: list[FusedLayer] = [
            FusedLayer(lw.input_norm, lw.post_norm, fuse_mixer(cfg, i, lw, state), fuse_ffn(lw.ffn))
            for i, lw in enumerate(model.layers if mode == "fused" else ())]
        max_buf = max([1] + [(L.mixer.w_in if isinstance(L.mixer, GDNMixer) else L.mixer.w_qkv).shape[0]
                             for L in self.layers])
        self.embed, self.final_norm, self.lm_head = model.embed, model.final_norm, model.lm_head
        # Static activations (addresses fixed for capture).
        H = c.hidden_size
        self.res = torch.zeros(H, dtype=dt, device=dev)
        # Where each mixer's and FFN's last launch leaves its output (added to the residual by the
        # epilogue); a tensor-parallel rank leaves its partial sum elsewhere and reduces it (gpu/tp.py).
        self.block_out, self.block_epi = self.res, gemv.EPI_RESIDUAL
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
        self.lm_out = self.logits  # the lm_head's rows of the logits (a tensor-parallel rank: its slice)
        self.lm_shape = self.fixed_shape(self.lm_head, self.t.lm, self.t.lm_fp8)
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
        from nexrt_vllm.engine.kernels.sampling import KMAX
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

    def gemv_shape(self, w, n: int, prefetch: int | None = None, rows: bool = False) -> dict:
        """The `gemv` launch keywords over `w` with n output rows, by the Tuning rules (`rows`: the
        verify's M-row GEMV, `Tuning.gemv_rows`; `prefetch`: see `gpu.tuning.gemv_kwargs`)."""
        return gemv_kwargs(self.t, w, self.t.shape(n, fp8=isinstance(w, FP8Weight), rows=rows), prefetch)

    def fixed_shape(self, w, bf16: GemvShape, fp8: GemvShape) -> dict:
        """The `gemv` launch keywords over `w` with a fixed shape per weight format."""
        return gemv_kwargs(self.t, w, fp8 if isinstance(w, FP8Weight) else bf16)

    # ---- one decode step -------------------------------------------------------------------------
    def plan(self) -> list[Launch]:
        """The fused step as its launches, in order: the step runs them; benchmarks/decode_bench.py
        times each group and counts the bytes it moves. With `Tuning.l2_prefetch` each GEMV launch
        asks L2, as its programs finish, for the first bytes of the next GEMV's weight (`_l2_plan`)."""
        c, g = self.cfg, self.k_gemv
        entries = [("embed", None, lambda: self.k_samp.gather_rows(self.tok, self.embed, self.res), None)]
        for i, L in enumerate(self.layers):
            mixer = self._gdn if isinstance(L.mixer, GDNMixer) else self._attention
            ffn = self._moe if isinstance(L.ffn, MoEFFN) else self._dense
            entries += [(group, i, fn, stream) for group, fn, stream in self._block(mixer(L)) + self._block(ffn(L))]
        entries.append(("lm_head+argmax", None, lambda **l2: g.gemv(
            self.res, self.lm_head, self.lm_out, pro=g.PRO_RMSNORM, epi=g.EPI_ARGMAX, norm_w=self.final_norm,
            aux0=self.pmax, aux1=self.pidx, eps=c.rms_norm_eps, **l2, **self.lm_shape), (self.lm_head, False)))
        targets = self._l2_plan([e[3] for e in entries], self.t.l2_prefetch)
        return [Launch(group, i, fn if t is None else functools.partial(fn, l2=t))
                for (group, i, fn, _), t in zip(entries, targets)]

    def _block(self, launches: list[tuple]) -> list[tuple]:
        """A mixer's or an FFN's launches as the step runs them (a tensor-parallel rank appends the
        reduction of their partial output, gpu/tp.py)."""
        return launches

    def _l2_plan(self, streams: list, nbytes: int) -> list:
        """Per launch, the `gemv` l2 target it asks for: each GEMV launch over bf16 weights (stream =
        (weight, SwiGLU halves)) asks for the first `nbytes` of the next GEMV's weight
        (`Tuning.l2_prefetch`, the round's `rows_l2_prefetch`); in an MoE model no launch asks."""
        out, nxt = [None] * len(streams), None
        if self.cfg.num_experts or nbytes <= 0:
            return out
        for j in range(len(streams) - 1, -1, -1):
            s = streams[j]
            if s is not None:
                if nxt is not None and not isinstance(s[0], FP8Weight):
                    out[j] = self.k_gemv.l2_target(nxt[0], nbytes, halves=nxt[1])
                nxt = s
        return out

    def _gdn(self, L: FusedLayer) -> list[tuple]:
        c, g, t, m, eps = self.cfg, self.k_gemv, self.t, L.mixer, self.cfg.rms_norm_eps
        return [
            ("gdn_in_proj+conv", lambda **l2: g.gemv(
                self.res, m.w_in, self.buf, pro=g.PRO_RMSNORM, epi=g.EPI_CONV, norm_w=L.input_norm,
                aux0=m.state.conv, aux1=m.conv_w, eps=eps, conv_n=c.conv_dim, kc=c.conv_kernel, **l2,
                **self.gemv_shape(m.w_in, m.w_in.shape[0], prefetch=t.prefetch_conv)), (m.w_in, False)),
            ("gdn_step", lambda: self.k_gdn.gdn_step(
                self.buf, m.state.rec, self.o, m.a_log, m.dt_bias, **gdn_kw(c, t), prefetch=t.prefetch > 0), None),
            ("gdn_out_proj", lambda **l2: g.gemv(
                self.o, m.w_out, self.block_out, pro=g.PRO_GATED, epi=self.block_epi, norm_w=m.norm,
                z=self.buf[c.conv_dim:c.conv_dim + c.value_dim], eps=eps, group=c.linear_value_head_dim, **l2,
                **self.fixed_shape(m.w_out, t.gemv_gated, t.gemv_gated_fp8)), (m.w_out, False))]

    def _attention(self, L: FusedLayer) -> list[tuple]:
        c, g, t, m, eps, pos = self.cfg, self.k_gemv, self.t, L.mixer, self.cfg.rms_norm_eps, self.state.position
        return [
            ("attn_qkv_proj", lambda **l2: g.gemv(
                self.res, m.w_qkv, self.buf, pro=g.PRO_RMSNORM, norm_w=L.input_norm, eps=eps, **l2,
                **self.gemv_shape(m.w_qkv, m.w_qkv.shape[0])), (m.w_qkv, False)),
            ("attn_qknorm_rope_kvwrite", lambda: self.k_attn.qk_rope_cache(
                self.buf, self.q, m.state.k, m.state.v, m.q_norm, m.k_norm, self.model.rope_cos, self.model.rope_sin,
                pos, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                rotary_dim=c.rotary_dim, eps=eps), None),
            ("attn_splitk+combine", lambda: self.k_attn.attention_decode(
                self.q, m.state.k, m.state.v, pos, self.buf, self.o, self.m_buf, self.l_buf, self.acc_buf,
                self.s_buf, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                nsplit=t.attn_splits, block=t.attn_block, min_per=t.attn_min_per, num_warps=t.attn_warps), None),
            ("attn_o_proj", lambda **l2: g.gemv(
                self.o, m.w_o, self.block_out, epi=self.block_epi, **l2, **self.gemv_shape(m.w_o, c.hidden_size)),
             (m.w_o, False))]

    def _moe(self, L: FusedLayer) -> list[tuple]:
        c, g, t, f, eps = self.cfg, self.k_gemv, self.t, L.ffn, self.cfg.rms_norm_eps
        return [
            ("moe_router", lambda **l2: g.gemv(
                self.res, f.w_router, self.router_logits, pro=g.PRO_RMSNORM, norm_w=L.post_norm, eps=eps,
                xn_out=self.xn, **l2, **self.fixed_shape(f.w_router, t.gemv_router, t.gemv_router_fp8)),
             (f.w_router, False)),
            ("moe_experts", lambda: self.k_moe.moe_experts(
                self.xn, self.block_out, self.router_logits, f.gate_up, f.s_gate_up, f.down, f.s_down,
                self.act, self.ids, self.wts, **moe_kwargs(t, c, f)), None)]

    def _dense(self, L: FusedLayer) -> list[tuple]:
        c, g, f = self.cfg, self.k_gemv, L.ffn
        return [
            ("mlp_gate_up+swiglu", lambda **l2: g.gemv(
                self.res, f.w_gate_up, self.act_dense, pro=g.PRO_RMSNORM, epi=g.EPI_SWIGLU, norm_w=L.post_norm,
                eps=c.rms_norm_eps, **l2, **self.gemv_shape(f.w_gate_up, f.w_gate_up.shape[0] // 2)),
             (f.w_gate_up, True)),
            ("mlp_down", lambda **l2: g.gemv(
                self.act_dense, f.w_down, self.block_out, epi=self.block_epi, **l2,
                **self.gemv_shape(f.w_down, c.hidden_size)),
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
        self._select(pos, n_part, sample, logprobs, mask)

    def _select(self, pos: torch.Tensor, n_part: int, sample: bool, logprobs: bool, mask: bool) -> None:
        """The step's tail after the logits and the lm_head's `n_part` (max, argmax) partials: the token
        (greedy, or sampled), its logprobs, the grammar mask; `pos` is advanced and the token published."""
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


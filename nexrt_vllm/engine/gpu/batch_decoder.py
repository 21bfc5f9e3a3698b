"""The batch step: B request slots decoded by one plan of launches (`BatchDecoder`), greedy.

Row b of every activation buffer is slot b; its state is slot b of a `StackedStates` (engine/state.py),
its next input token tok[b], its position pos[b]. One step reads each weight once for all B rows:
the projections are M-row GEMVs (kernels/gemv_verify.py, M = B), the per-slot work (attention over
the slot's K/V cache, the GDN step and conv over its state, the MoE experts its row routes to) runs
kernels/batch.py's per-slot variants of the step's kernels, and the finish writes each live slot's
greedy token, position and control-ring record. Slots whose `live` word is 0 are left as they are
(state, position, token) and cost little: their rows ride along in the GEMVs (no extra weight
bytes), their per-slot programs return at once.

The plan has no host value in it, so gpu/batch_runner.py captures it whole in one CUDA graph; which
slots step is the device mask `live`, written by the host between replays. Greedy only (no
sampling, logprobs or grammar masks: those requests decode on their slot engine's eager loop).
Weights are fused as gpu/fusion.py fuses them for `FusedDecoder`, bf16 or an FP8 checkpoint's kept e4m3 +
block scales (the M-row GEMVs and the MoE experts read either).
"""
from __future__ import annotations

import dataclasses

import torch

from nexrt_vllm.engine.errors import EngineError
from nexrt_vllm.engine.fp8 import FP8Weight
from nexrt_vllm.engine.gpu.control import ControlMemory
from nexrt_vllm.engine.gpu.decoder import Launch, _require_gpu_dtype, gdn_kw
from nexrt_vllm.engine.gpu.fusion import FusedLayer, GDNMixer, MoEFFN, fuse_ffn, fuse_mixer
from nexrt_vllm.engine.gpu.tuning import Tuning, gemv_kwargs, moe_kwargs, pdl_enabled
from nexrt_vllm.engine.state import StackedStates


def gated_out_proj(g, k_gdn, o, z, mixer: GDNMixer, res, rows: int, group: int, eps: float, split: bool,
                   shape: dict) -> list[tuple]:
    """The (group, launch) pairs of an M-row GDN out_proj over o[:rows] (z: the gate rows): the gated-norm
    prologue in the GEMV ("gdn_out_proj"), or with `split` (`Tuning.gated_norm_rows`) the norm in place over
    o first ("gdn_out_norm") and then the plain GEMV. Callers decide `split` from their most rows, not a
    replay's, so a request's arithmetic does not depend on the slots live with it."""
    if not split:  # the GEMV launches take `gemv`'s l2 keyword (spec_round.py's L2 requests)
        return [("gdn_out_proj", lambda **l2: g.gemv(o, mixer.w_out, res, pro=g.PRO_GATED, epi=g.EPI_RESIDUAL,
                                                     norm_w=mixer.norm, z=z, eps=eps, group=group, m=rows, **l2,
                                                     **shape))]
    return [("gdn_out_norm", lambda: k_gdn.gated_norm_rows(o, z, mixer.norm, o, m=rows, group=group, eps=eps)),
            ("gdn_out_proj", lambda **l2: g.gemv(o, mixer.w_out, res, epi=g.EPI_RESIDUAL, m=rows, **l2, **shape))]


class BatchDecoder:
    """Static buffers for `states.n` rows over the fused weights; `launch()` enqueues one batch step.

    `layers`: a `FusedDecoder`'s fused layers to share (their weights; each layer's state becomes the
    stacked one), e.g. a benchmark comparing both steps over one copy of the weights; None: fuse
    the model's weights here (gpu/fusion.py re-points the eager model at the fused matrices)."""

    def __init__(self, model, states: StackedStates, tuning: Tuning | None = None, layers=None):
        from nexrt_vllm.engine.kernels import batch, common, gdn, gemv, moe, sampling  # triton: GPU path only
        cfg = model.config
        _require_gpu_dtype(cfg, states.dtype)
        if not 2 <= states.n <= batch.MAX_ROWS:
            raise EngineError(f"the batch step runs 2..{batch.MAX_ROWS} slots, got {states.n} (one slot: the "
                              f"single-request step, FusedDecoder)")
        self.k_batch, self.k_common, self.k_gemv, self.k_gdn, self.k_moe = batch, common, gemv, gdn, moe
        self.k_samp = sampling
        self.model, self.cfg, self.states, self.t = model, cfg, states, tuning or Tuning()
        self.n = n = states.n
        self.pdl = pdl_enabled(self.t.pdl, common.DEFAULT_PDL, torch.cuda.get_device_capability(states.device)
                               if states.device.type == "cuda" else None)
        if layers is None:
            self.layers = [FusedLayer(lw.input_norm, lw.post_norm, fuse_mixer(cfg, i, lw, states), fuse_ffn(lw.ffn))
                           for i, lw in enumerate(model.layers)]
        else:
            self.layers = [FusedLayer(L.input_norm, L.post_norm, dataclasses.replace(
                L.mixer, state=states.gdn(i) if isinstance(L.mixer, GDNMixer) else states.attention(i)), L.ffn)
                for i, L in enumerate(layers)]
        self.embed, self.final_norm, self.lm_head = model.embed, model.final_norm, model.lm_head
        dev, dt, c = states.device, states.dtype, cfg
        z = lambda *s, d=dt: torch.zeros(*s, dtype=d, device=dev)  # noqa: E731
        H = c.hidden_size
        width = max([1] + [(L.mixer.w_in if isinstance(L.mixer, GDNMixer) else L.mixer.w_qkv).shape[0]
                           for L in self.layers])
        # activations, one row per slot (addresses fixed for capture)
        self.res, self.buf = z(n, H), z(n, width)
        self.o, self.q = z(n, max(c.value_dim, c.num_heads * c.head_dim)), z(n, c.num_heads * c.head_dim)
        ns = self.t.slot_attn_splits
        self.m_buf, self.l_buf = z(n, c.num_heads * ns, d=torch.float32), z(n, c.num_heads * ns, d=torch.float32)
        self.acc_buf = z(n, c.num_heads * ns * c.head_dim, d=torch.float32)
        self.s_buf = z(n, c.num_heads * states.max_seq_len, d=torch.float32)
        if c.num_experts:
            imax = max(c.moe_intermediate_size, c.shared_expert_intermediate_size)
            self.act, self.router_logits = z(n, (c.num_experts_per_tok + 1) * imax), z(n, c.num_experts + 1)
            self.ids = z(n, c.num_experts_per_tok, d=torch.int32)
            self.wts = z(n, c.num_experts_per_tok, d=torch.float32)
            self.xn = z(n, H)
        if c.intermediate_size:
            self.act_dense = z(n, c.intermediate_size)
        self.logits = z(n, c.vocab_size, d=torch.float32)
        self.lm_kw = gemv_kwargs(self.t, self.lm_head, self.t.lm_rows)
        self.n_part = -(-c.vocab_size // self.lm_kw["block_n"])
        self.pmax, self.pidx = z(n, self.n_part, d=torch.float32), z(n, self.n_part, d=torch.int32)
        # control: each slot's next input token, which slots step, the step counter, the slot ring
        self.tok = z(n, d=torch.int64)
        self.live = z(n, d=torch.int32)
        self.step = z(1, d=torch.int64)
        self.pos = states.position
        self.mem = ControlMemory(dev, c.vocab_size, slots=n)
        self.control = self.mem.mode
        self.ring_host, self.ring = self.mem.host["slot_ring"], self.mem.device["slot_ring"]

    def rows_shape(self, w, n: int, prefetch: int | None = None) -> dict:
        """The M-row `gemv` keywords over `w` (bf16 or fp8) with n output rows (`Tuning.gemv_rows` /
        `gemv_rows_fp8` rules)."""
        return gemv_kwargs(self.t, w, self.t.shape(n, fp8=isinstance(w, FP8Weight), rows=True), prefetch)

    # ---- one batch step ------------------------------------------------------------------------------
    def plan(self, k: int | None = None) -> list[Launch]:
        """The batch step's launches in order (the single-request step's group names, then "finish") over
        slots 0..k-1 (default: every slot): rows k.. and their slots are left out of every launch."""
        c, g, k = self.cfg, self.k_gemv, k or self.n
        if not 2 <= k <= self.n:
            raise EngineError(f"a batch step runs 2..{self.n} slots, got {k}")
        steps = [Launch("embed", None, lambda: self.k_samp.gather_rows(self.tok[:k], self.embed, self.res[:k],
                                                                        live=self.live[:k]))]
        for i, L in enumerate(self.layers):
            mixer = self._gdn if isinstance(L.mixer, GDNMixer) else self._attention
            ffn = self._moe if isinstance(L.ffn, MoEFFN) else self._dense
            steps += [Launch(group, i, fn) for group, fn in mixer(L, k) + ffn(L, k)]
        steps.append(Launch("lm_head+argmax", None, lambda: g.gemv(
            self.res[:k], self.lm_head, self.logits[:k], pro=g.PRO_RMSNORM, epi=g.EPI_ARGMAX, norm_w=self.final_norm,
            aux0=self.pmax[:k], aux1=self.pidx[:k], eps=c.rms_norm_eps, m=k, **self.lm_kw)))
        steps.append(Launch("finish", None, lambda: self.k_batch.finish_rows(
            self.pmax[:k], self.pidx[:k], self.n_part, self.live[:k], self.tok[:k], self.pos[:k], self.step,
            self.ring)))
        return steps

    def _gdn(self, L: FusedLayer, k: int) -> list[tuple]:
        c, g, t, m, eps, kb = self.cfg, self.k_gemv, self.t, L.mixer, self.cfg.rms_norm_eps, self.k_batch
        sh = self.rows_shape(m.w_in, m.w_in.shape[0], t.prefetch_conv)
        # the out_proj: fewer slots than Tuning.gated_norm_rows take the gated shape (`gemv_gated_rows`); the
        # replay's slots, or with Tuning.batch_invariant the node's (batch_round.py `_choice_rows`)
        split = (self.n if t.batch_invariant else k) >= t.gated_norm_rows
        return [
            ("gdn_in_proj+conv", lambda: kb.gemv_rows_conv(
                self.res[:k], m.w_in, self.buf[:k], L.input_norm, m.state.conv, m.conv_w, self.live[:k], eps=eps,
                conv_n=c.conv_dim, kc=c.conv_kernel, block_n=sh["block_n"], block_k=sh["block_k"],
                num_warps=sh["num_warps"], dot=sh["dot"], prefetch=sh.get("prefetch", 0),
                round_w=sh.get("round_w", False))),
            ("gdn_step", lambda: kb.gdn_step_rows(
                self.buf[:k], m.state.rec, self.o[:k], m.a_log, m.dt_bias, self.live[:k], **gdn_kw(c, t),
                prefetch=t.prefetch > 0)),
            *gated_out_proj(g, self.k_gdn, self.o[:k], self.buf[:k, c.conv_dim:c.conv_dim + c.value_dim], m,
                            self.res[:k], k, c.linear_value_head_dim, eps, split,
                            self.rows_shape(m.w_out, c.hidden_size) if split else
                            gemv_kwargs(t, m.w_out, t.gemv_gated_rows))]

    def _attention(self, L: FusedLayer, k: int) -> list[tuple]:
        c, g, t, a, eps, kb = self.cfg, self.k_gemv, self.t, L.mixer, self.cfg.rms_norm_eps, self.k_batch
        return [
            ("attn_qkv_proj", lambda: g.gemv(
                self.res[:k], a.w_qkv, self.buf[:k], pro=g.PRO_RMSNORM, norm_w=L.input_norm, eps=eps, m=k,
                **self.rows_shape(a.w_qkv, a.w_qkv.shape[0]))),
            ("attn_qknorm_rope_kvwrite", lambda: kb.qk_rope_rows(
                self.buf[:k], self.q[:k], a.state.k, a.state.v, a.q_norm, a.k_norm, self.model.rope_cos,
                self.model.rope_sin, self.pos[:k], self.live[:k], num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim, rotary_dim=c.rotary_dim, eps=eps)),
            ("attn_splitk+combine", lambda: kb.attention_rows(
                self.q[:k], a.state.k, a.state.v, self.pos[:k], self.live[:k], self.buf[:k], self.o[:k],
                self.m_buf[:k], self.l_buf[:k], self.acc_buf[:k], self.s_buf[:k], num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, nsplit=t.slot_attn_splits, block=t.attn_block,
                min_per=t.attn_min_per, num_warps=t.attn_warps)),
            ("attn_o_proj", lambda: g.gemv(
                self.o[:k], a.w_o, self.res[:k], epi=g.EPI_RESIDUAL, m=k, **self.rows_shape(a.w_o, c.hidden_size)))]

    def _moe(self, L: FusedLayer, k: int) -> list[tuple]:
        c, g, t, f = self.cfg, self.k_gemv, self.t, L.ffn
        return [
            ("moe_router", lambda: g.gemv(
                self.res[:k], f.w_router, self.router_logits[:k], pro=g.PRO_RMSNORM, norm_w=L.post_norm,
                eps=c.rms_norm_eps, xn_out=self.xn[:k], m=k, **self.rows_shape(f.w_router, f.w_router.shape[0]))),
            ("moe_experts", lambda: self.k_moe.moe_experts(
                self.xn[:k], self.res[:k], self.router_logits[:k], f.gate_up, f.s_gate_up, f.down, f.s_down,
                self.act[:k], self.ids[:k], self.wts[:k], live=self.live[:k], **moe_kwargs(t, c, f)))]

    def _dense(self, L: FusedLayer, k: int) -> list[tuple]:
        c, g, f = self.cfg, self.k_gemv, L.ffn
        return [
            ("mlp_gate_up+swiglu", lambda: g.gemv(
                self.res[:k], f.w_gate_up, self.act_dense[:k], pro=g.PRO_RMSNORM, epi=g.EPI_SWIGLU, norm_w=L.post_norm,
                eps=c.rms_norm_eps, m=k, **self.rows_shape(f.w_gate_up, f.w_gate_up.shape[0] // 2))),
            ("mlp_down", lambda: g.gemv(
                self.act_dense[:k], f.w_down, self.res[:k], epi=g.EPI_RESIDUAL, m=k,
                **self.rows_shape(f.w_down, c.hidden_size)))]

    def launch(self, k: int | None = None) -> None:
        """Enqueue one batch step over slots 0..k-1 (default: all): every live slot b runs tok[b] at pos[b];
        leaves its next token in tok[b], pos[b] + 1 and (step << 32 | token) in its ring column."""
        with self.k_common.launch_options(self.pdl):
            for s in self.plan(k):
                s.run()
        if self.control == "pinned-copy":  # the ring reaches the host by a copy node (gpu/control.py)
            self.ring_host.copy_(self.ring, non_blocking=True)


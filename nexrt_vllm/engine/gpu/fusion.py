"""Weight fusion for the GPU path: projections that read the same input become one matrix.

The fused matrices are concatenations whose row blocks stand in for the eager model's weights
(`concat_shared` re-points them), so the fused and the eager path read the same memory. Each layer
becomes a `FusedLayer`: a GDN or attention mixer and a MoE or dense FFN, a handful of weight streams.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.fp8 import FP8Weight, cat_rows, split_views, take_rows
from nexrt_vllm.engine.state import AttentionState, DecodeState, GDNState


def concat_shared(parts: list, tail_ok: bool = True) -> tuple:
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
        return concat_shared([take_rows(w.in_proj_qkvz, qkvz), take_rows(w.in_proj_ba, ba)])[0]
    q, k, v, z = torch.split(w.in_proj_qkvz.view(nk, 2 * dk + 2 * r * dv, -1), [dk, dk, r * dv, r * dv], dim=1)
    b, a = torch.split(w.in_proj_ba.view(nk, 2 * r, -1), [r, r], dim=1)
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a)]).contiguous()


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


def fuse_mixer(cfg: ModelConfig, i: int, lw, state: DecodeState) -> GDNMixer | AttentionMixer:
    """Layer i's mixer (`lw`: its eager weights) with its projections fused, over layer i of `state`."""
    m = lw.mixer
    if lw.kind == "linear_attention":
        if cfg.family == "qwen3_next":
            w_in = _next_in_proj(cfg, m)
        else:
            w_in, (m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a) = concat_shared(
                [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a])
        return GDNMixer(w_in, m.conv1d.contiguous(), m.A_log, m.dt_bias, m.norm, m.out_proj, state.gdn(i))
    w_qkv, (m.q_proj, m.k_proj, m.v_proj) = concat_shared([m.q_proj, m.k_proj, m.v_proj])
    return AttentionMixer(w_qkv, m.q_norm, m.k_norm, m.o_proj, state.attention(i))


def fuse_ffn(f) -> MoEFFN | DenseFFN:
    """An eager FFN (MoE or dense) with its projections fused."""
    if hasattr(f, "router"):
        w_router, (f.router, f.shared_gate) = concat_shared([f.router, f.shared_gate])
        s_gate_up, (f.shared.gate_proj, f.shared.up_proj) = concat_shared(
            [f.shared.gate_proj, f.shared.up_proj], tail_ok=False)
        return MoEFFN(w_router, f.gate_up_proj, f.down_proj, s_gate_up, f.shared.down_proj)
    w_gate_up, (f.gate_proj, f.up_proj) = concat_shared([f.gate_proj, f.up_proj], tail_ok=False)
    return DenseFFN(w_gate_up, f.down_proj)

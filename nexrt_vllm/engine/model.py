"""The Qwen3.5 / Qwen3-Next decoder in plain torch: the CPU reference (oracle) of the engine.

Every function mirrors the op order and precision of transformers 5 (modeling_qwen3_next.py,
modeling_qwen3_5.py, modeling_qwen3_5_moe.py, eager attention and eager experts), so that bf16
logits match bit for bit where the same kernels run: fp32 for norms, softmax, the router, the gated
delta rule; the model dtype elsewhere.

Two paths per layer:
- `*_prefill(x[T, H], ...)`: a whole prompt from an empty state (chunked gated delta rule, as HF's
  prefill); may sync with the host.
- `*_decode(x[1, H], ...)`: one token; static shapes, in-place state updates, the position read from a
  device tensor, no host syncs - so the GPU path can capture a whole step in one CUDA graph and swap
  any of these functions for a fused kernel.

Weights are plain tensors in small per-layer objects (`AttentionWeights`, `GDNWeights`, `MLPWeights`,
`MoEWeights`); `Model.layers[i]` holds layer i's. A projection may also be an `fp8.FP8Weight` (an
FP8 checkpoint on the GPU path, which reads e4m3 natively): the ops here dequantize it for each
use into the values the dequantize-at-load oracle holds, so these functions compute the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nexrt_vllm.engine.config import ModelConfig
from .fp8 import linear  # F.linear, or an FP8Weight dequantized for the op (GPU engines keep fp8)
from nexrt_vllm.engine.state import DecodeState

# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


@dataclass
class AttentionWeights:
    q_proj: torch.Tensor  # [2*num_heads*head_dim, H]: per head, query rows then gate rows
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor  # zero-centred RMSNorm weights over head_dim
    k_norm: torch.Tensor


@dataclass
class GDNWeights:
    # Qwen3.5: in_proj_qkv [conv_dim, H], in_proj_z [value_dim, H], in_proj_b / in_proj_a [nv, H].
    # Qwen3-Next: in_proj_qkvz [2*key_dim + 2*value_dim, H] and in_proj_ba [2*nv, H], both grouped
    # per key head (see `gdn_in_proj`). The other family's fields are None.
    conv1d: torch.Tensor  # [conv_dim, kernel]
    dt_bias: torch.Tensor  # [nv]
    A_log: torch.Tensor  # [nv]
    norm: torch.Tensor  # gated RMSNorm weight [head_v_dim] (plain, not zero-centred)
    out_proj: torch.Tensor  # [H, value_dim]
    in_proj_qkv: torch.Tensor | None = None
    in_proj_z: torch.Tensor | None = None
    in_proj_b: torch.Tensor | None = None
    in_proj_a: torch.Tensor | None = None
    in_proj_qkvz: torch.Tensor | None = None
    in_proj_ba: torch.Tensor | None = None


@dataclass
class MLPWeights:
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, H]
    gate_up_proj: torch.Tensor  # [E, 2I, H]: gate rows then up rows
    down_proj: torch.Tensor  # [E, H, I]
    shared: MLPWeights
    shared_gate: torch.Tensor  # [1, H]


@dataclass
class LayerWeights:
    kind: str  # "full_attention" | "linear_attention"
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: AttentionWeights | GDNWeights
    ffn: MLPWeights | MoEWeights


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of the family: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: rms(x) * w * SiLU(gate); w is plain (not zero-centred), applied in model dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(gate.float())
    return h.to(dtype)


def rope_tables(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, rotary_dim] for positions 0..max_len-1 (NeoX layout: halves concatenated)."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.arange(max_len, dtype=torch.long).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX RoPE on the first rotary_dim channels of x [..., T, head_dim]; cos/sin [T, rotary_dim]."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    rotated = torch.cat((-x_rot[..., rd // 2:], x_rot[..., : rd // 2]), dim=-1)
    return torch.cat(((x_rot * cos) + (rotated * sin), x_pass), dim=-1)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[kv_heads, S, d] -> [kv_heads * n_rep, S, d], each kv head repeated n_rep times in place."""
    if n_rep == 1:
        return x
    kv, s, d = x.shape
    return x[:, None].expand(kv, n_rep, s, d).reshape(kv * n_rep, s, d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scaling: float) -> torch.Tensor:
    """Eager attention. q [nH, Tq, d]; k, v [nKV, S, d]; visible [Tq, S] bool. Returns [Tq, nH*d]."""
    n_rep = q.shape[0] // k.shape[0]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(1, 2)) * scaling
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v)  # [nH, Tq, d]
    return out.transpose(0, 1).reshape(q.shape[1], -1)


# ---------------------------------------------------------------------------------------------
# gated full attention
# ---------------------------------------------------------------------------------------------


def attn_qkv(w: AttentionWeights, cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [nH, T, d], k/v [nKV, T, d] (normed, rotated) and the output gate [T, nH*d]."""
    T, d, eps = x.shape[0], cfg.head_dim, cfg.rms_norm_eps
    q, gate = torch.chunk(linear(x, w.q_proj).view(T, -1, 2 * d), 2, dim=-1)
    gate = gate.reshape(T, -1)
    q = rms_norm(q, w.q_norm, eps).transpose(0, 1)
    k = rms_norm(linear(x, w.k_proj).view(T, -1, d), w.k_norm, eps).transpose(0, 1)
    v = linear(x, w.v_proj).view(T, -1, d).transpose(0, 1)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate


def attention_prefill(w: AttentionWeights, cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Causal attention over a prompt x [T, H] at positions 0..T-1; writes K/V rows 0..T-1."""
    T = x.shape[0]
    q, k, v, gate = attn_qkv(w, cfg, x, cos[:T], sin[:T])
    k_cache[:, :T].copy_(k)
    v_cache[:, :T].copy_(v)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    out = _attend(q, k, v, causal, cfg.head_dim ** -0.5)
    return linear(out * torch.sigmoid(gate), w.o_proj)


def attention_decode(w: AttentionWeights, cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
    """One token x [1, H] at `position` (int64 [1], device); cos/sin [1, rotary_dim] for it; visible
    [1, max_seq_len] marks rows <= position. Writes the token's K/V row, attends over the whole buffer."""
    q, k, v, gate = attn_qkv(w, cfg, x, cos, sin)
    k_cache.index_copy_(1, position, k)
    v_cache.index_copy_(1, position, v)
    out = _attend(q, k_cache, v_cache, visible, cfg.head_dim ** -0.5)
    return linear(out * torch.sigmoid(gate), w.o_proj)


# ---------------------------------------------------------------------------------------------
# gated delta net (linear attention)
# ---------------------------------------------------------------------------------------------


def gdn_in_proj(w: GDNWeights, cfg: ModelConfig, x: torch.Tensor):
    """x [T, H] -> mixed_qkv [T, conv_dim] (q|k|v), z [T, nv, dv], b [T, nv], a [T, nv]."""
    T, nk, nv, dk, dv = x.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads, \
        cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if w.in_proj_qkvz is None:  # Qwen3.5: separate projections
        z = linear(x, w.in_proj_z).reshape(T, nv, dv)
        return linear(x, w.in_proj_qkv), z, linear(x, w.in_proj_b), linear(x, w.in_proj_a)
    # Qwen3-Next: per key head g the fused rows are [q_g | k_g | v_g (nv/nk heads) | z_g (nv/nk heads)]
    # and [b_g (nv/nk) | a_g (nv/nk)] (fix_query_key_value_ordering in modeling_qwen3_next.py).
    r = nv // nk
    qkvz = linear(x, w.in_proj_qkvz).view(T, nk, 2 * dk + 2 * r * dv)
    ba = linear(x, w.in_proj_ba).view(T, nk, 2 * r)
    q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=2)
    b, a = torch.split(ba, [r, r], dim=2)
    mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
    return mixed, z.reshape(T, nv, dv), b.reshape(T, nv), a.reshape(T, nv)


def _gdn_gates(w: GDNWeights, b: torch.Tensor, a: torch.Tensor):
    """beta = sigmoid(b) (model dtype); g = -exp(A_log) * softplus(a + dt_bias) (fp32, log decay)."""
    return b.sigmoid(), -w.A_log.float().exp() * F.softplus(a.float() + w.dt_bias)


def _split_heads(mixed: torch.Tensor, cfg: ModelConfig):
    """conv output [T, conv_dim] -> q, k [T, nv, dk] (key heads repeated to value heads), v [T, nv, dv]."""
    T = mixed.shape[0]
    q, k, v = torch.split(mixed, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
    q = q.reshape(T, -1, cfg.linear_key_head_dim)
    k = k.reshape(T, -1, cfg.linear_key_head_dim)
    v = v.reshape(T, -1, cfg.linear_value_head_dim)
    r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    if r > 1:
        q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    return q, k, v


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk_size: int = 64):
    """The gated delta rule over a prompt from a zero state, chunk by chunk (HF's
    torch_chunk_gated_delta_rule). q, k [T, h, dk], v [T, h, dv], g, beta [T, h].
    Returns (out [T, h, dv] in q's dtype, final state [h, dk, dv] fp32)."""
    dtype = q.dtype
    T = q.shape[0]
    q, k, v, beta, g = [x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g)]
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    h, dk, dv = q.shape[0], q.shape[-1], v.shape[-1]
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = [x.reshape(h, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    g = g.reshape(h, -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    # decay between positions j <= i of a chunk: exp(cum_i - cum_j)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    # UT transform: condenses the chunk's delta-rule updates into matmuls
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    state = torch.zeros(h, dk, dv, dtype=torch.float32, device=q.device)
    out = torch.zeros_like(new_v)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[1]):
        v_new = new_v[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(h, -1, dv)[:, :T]
    return out.transpose(0, 1).to(dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule, updating `state` [h, dk, dv] (fp32) in place.
    q, k [h, dk]; v [h, dv]; g, beta [h]. Returns out [h, dv] in q's dtype:
    S = exp(g) S;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q."""
    dtype = q.dtype
    q, k, v, beta, g = (x.to(torch.float32) for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    state.mul_(g.exp()[:, None, None])
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (state * q.unsqueeze(-1)).sum(dim=-2).to(dtype)


def _gdn_out(w: GDNWeights, cfg: ModelConfig, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """core, z [T, nv, dv] -> gated norm per head -> out_proj -> [T, H]."""
    T, dv = core.shape[0], cfg.linear_value_head_dim
    o = gated_rms_norm(core.reshape(-1, dv), z.reshape(-1, dv), w.norm, cfg.rms_norm_eps)
    return linear(o.reshape(T, -1), w.out_proj)


def gdn_prefill(w: GDNWeights, cfg: ModelConfig, x: torch.Tensor, conv_state: torch.Tensor,
                rec_state: torch.Tensor) -> torch.Tensor:
    """A prompt x [T, H] from an empty state; leaves the conv window and recurrent state behind."""
    T, km1 = x.shape[0], cfg.conv_kernel - 1
    mixed, z, b, a = gdn_in_proj(w, cfg, x)
    cols = mixed.transpose(0, 1)  # [conv_dim, T]
    # conv state: the last kernel-1 inputs, left-padded with zeros for short prompts
    n = min(T, km1)
    conv_state.zero_()
    conv_state[:, km1 - n:].copy_(cols[:, T - n:])
    conv = F.conv1d(cols.unsqueeze(0).to(w.conv1d.dtype), w.conv1d.unsqueeze(1), padding=km1,
                    groups=cfg.conv_dim)[..., :T]
    mixed = F.silu(conv).to(x.dtype)[0].transpose(0, 1)
    q, k, v = _split_heads(mixed, cfg)
    beta, g = _gdn_gates(w, b, a)
    core, final = chunk_gated_delta_rule(q, k, v, g, beta)
    rec_state.copy_(final)
    return _gdn_out(w, cfg, core, z)


def gdn_decode(w: GDNWeights, cfg: ModelConfig, x: torch.Tensor, conv_state: torch.Tensor,
               rec_state: torch.Tensor) -> torch.Tensor:
    """One token x [1, H]; updates conv_state [conv_dim, kernel-1] and rec_state in place."""
    mixed, z, b, a = gdn_in_proj(w, cfg, x)
    window = torch.cat((conv_state, mixed.transpose(0, 1)), dim=-1).to(w.conv1d.dtype)  # [conv_dim, kernel]
    conv_state.copy_(window[:, 1:])
    conv = F.conv1d(window.unsqueeze(0), w.conv1d.unsqueeze(1), groups=cfg.conv_dim)  # [1, conv_dim, 1]
    mixed = F.silu(conv).to(x.dtype)[0].transpose(0, 1)
    q, k, v = _split_heads(mixed, cfg)
    beta, g = _gdn_gates(w, b, a)
    core = recurrent_gated_delta_step(q[0], k[0], v[0], g[0], beta[0], rec_state)
    return _gdn_out(w, cfg, core.unsqueeze(0), z)


def gdn_verify(w: GDNWeights, cfg: ModelConfig, x: torch.Tensor, conv_state: torch.Tensor,
               rec_state: torch.Tensor, window: torch.Tensor, rec_after: torch.Tensor) -> torch.Tensor:
    """T tokens x [T, H] in order from the live state, which stays untouched: the state after each
    position is kept instead, so a speculative round commits any prefix without recompute
    (`gdn_commit`). window [conv_dim, kernel-1+T] receives the conv inputs (the conv state after
    position j is window[:, j+1 : j+kernel]); rec_after [T, nv, dk, dv] fp32 the recurrent state
    after each position. Per position the same ops as `gdn_decode`."""
    T = x.shape[0]
    mixed, z, b, a = gdn_in_proj(w, cfg, x)
    window.copy_(torch.cat((conv_state, mixed.transpose(0, 1)), dim=-1))
    conv = F.conv1d(window.unsqueeze(0).to(w.conv1d.dtype), w.conv1d.unsqueeze(1), groups=cfg.conv_dim)
    mixed = F.silu(conv).to(x.dtype)[0].transpose(0, 1)  # [T, conv_dim]
    q, k, v = _split_heads(mixed, cfg)
    beta, g = _gdn_gates(w, b, a)
    prev, core = rec_state, []
    for j in range(T):
        rec_after[j].copy_(prev)
        core.append(recurrent_gated_delta_step(q[j], k[j], v[j], g[j], beta[j], rec_after[j]))
        prev = rec_after[j]
    return _gdn_out(w, cfg, torch.stack(core), z)


def gdn_commit(cfg: ModelConfig, conv_state: torch.Tensor, rec_state: torch.Tensor, window: torch.Tensor,
               rec_after: torch.Tensor, last: torch.Tensor) -> None:
    """Make the state after verified position `last` (int64 [1], device) the live GDN state."""
    cols = last + 1 + torch.arange(cfg.conv_kernel - 1, device=last.device)
    conv_state.copy_(window.index_select(1, cols))
    rec_state.copy_(rec_after.index_select(0, last)[0])


# ---------------------------------------------------------------------------------------------
# feed-forward
# ---------------------------------------------------------------------------------------------


def mlp(w: MLPWeights, x: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(x, w.gate_proj)) * linear(x, w.up_proj), w.down_proj)


def _route(w: MoEWeights, cfg: ModelConfig, x: torch.Tensor):
    """Softmax over all experts (fp32), top-k, renormalised; weights back in the model dtype."""
    logits = linear(x, w.router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_i


def _expert(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU: gate_up [2I, H], down [H, I]."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


def _shared_expert(w: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(linear(x, w.shared_gate)) * mlp(w.shared, x)


def moe_prefill(w: MoEWeights, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """x [T, H]: each hit expert runs once on its tokens; outputs summed in expert order (HF's eager
    experts), which fixes the bf16 rounding of the sum."""
    shared = _shared_expert(w, x)
    top_w, top_i = _route(w, cfg, x)
    out = torch.zeros_like(x)
    for e in torch.unique(top_i).tolist():
        slot, tok = torch.where(top_i.t() == e)  # slot-major, as HF orders the rows
        y = _expert(w.gate_up_proj[e], w.down_proj[e], x[tok]) * top_w[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out + shared


def moe_decode(w: MoEWeights, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """x [1, H]: the top-k experts chosen on the device (no host sync), summed in ascending expert
    order like `moe_prefill`."""
    shared = _shared_expert(w, x)
    top_w, top_i = _route(w, cfg, x)
    top_i, order = torch.sort(top_i[0])
    top_w = top_w[0, order]
    out = torch.zeros_like(x)
    for j in range(cfg.num_experts_per_tok):
        e = top_i[j: j + 1]  # a 1-element index tensor: indexing with a 0-d tensor would sync
        y = _expert(w.gate_up_proj.index_select(0, e)[0], w.down_proj.index_select(0, e)[0], x)
        out = out + y * top_w[j]
    return out + shared


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


def _mlp(t: dict[str, torch.Tensor], prefix: str) -> MLPWeights:
    return MLPWeights(*(t[prefix + n + ".weight"] for n in ("gate_proj", "up_proj", "down_proj")))


def layer_weights(cfg: ModelConfig, t: dict[str, torch.Tensor], p: str, kind: str, moe: bool) -> LayerWeights:
    """One decoder layer's weights from canonical tensors named `p` + HF's names (a model layer, or
    the MTP head's layer with its `layers.0.` names)."""
    if kind == "full_attention":
        a = p + "self_attn."
        mixer = AttentionWeights(*(t[a + n + ".weight"] for n in
                                   ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")))
    else:
        g = p + "linear_attn."
        proj = ("in_proj_qkvz", "in_proj_ba") if cfg.family == "qwen3_next" else \
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        mixer = GDNWeights(conv1d=t[g + "conv1d.weight"].squeeze(1), dt_bias=t[g + "dt_bias"],
                           A_log=t[g + "A_log"], norm=t[g + "norm.weight"],
                           out_proj=t[g + "out_proj.weight"], **{n: t[g + n + ".weight"] for n in proj})
    m = p + "mlp."
    if moe:
        ffn = MoEWeights(router=t[m + "gate.weight"], gate_up_proj=t[m + "experts.gate_up_proj"],
                         down_proj=t[m + "experts.down_proj"], shared=_mlp(t, m + "shared_expert."),
                         shared_gate=t[m + "shared_expert_gate.weight"])
    else:
        ffn = _mlp(t, m)
    return LayerWeights(kind, t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"], mixer, ffn)


class Model:
    """Weights + the prefill / decode passes over a DecodeState."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], max_seq_len: int,
                 mtp: dict[str, torch.Tensor] | None = None):
        self.config = cfg
        t = tensors
        self.embed = t["embed_tokens.weight"]
        self.final_norm = t["norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else t["lm_head.weight"]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.mtp = mtp or {}  # the multi-token-prediction head's raw tensors (engine/spec/mtp.py builds it)
        self.layers = [layer_weights(cfg, t, f"layers.{i}.", kind, cfg.is_moe_layer(i))
                       for i, kind in enumerate(cfg.layer_types)]
        self.rope_cos, self.rope_sin = rope_tables(cfg, max_seq_len, self.dtype, self.device)
        self.kv_index = torch.arange(max_seq_len, device=self.device)

    def ffn(self, i: int, x: torch.Tensor, decode: bool) -> torch.Tensor:
        w = self.layers[i].ffn
        if isinstance(w, MoEWeights):
            return (moe_decode if decode else moe_prefill)(w, self.config, x)
        return mlp(w, x)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial outputs of a mixer / FFN; one device: x itself (engine/tp.py)."""
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the last row of h [T, H] -> fp32 [vocab]."""
        h = rms_norm(h[-1:], self.final_norm, self.config.rms_norm_eps)
        return linear(h, self.lm_head)[0].float()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, state: DecodeState, hidden: bool = False):
        """ids int64 [T] on the device, state freshly reset. Fills the state; returns the last logits,
        with `hidden` also every position's final-normed hidden state [T, H] (the MTP head's input)."""
        cfg, eps = self.config, self.config.rms_norm_eps
        h = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, eps)
            if layer.kind == "full_attention":
                kv = state.attention(i)
                x = attention_prefill(layer.mixer, cfg, x, self.rope_cos, self.rope_sin, kv.k, kv.v)
            else:
                s = state.gdn(i)
                x = gdn_prefill(layer.mixer, cfg, x, s.conv, s.rec)
            h = h + self.reduce(x)
            h = h + self.reduce(self.ffn(i, rms_norm(h, layer.post_norm, eps), decode=False))
        if hidden:
            return self.logits(h), rms_norm(h, self.final_norm, eps)
        return self.logits(h)

    def _step_layers(self, h: torch.Tensor, state: DecodeState, cos, sin, positions, visible, gdn) -> torch.Tensor:
        """Every layer over the T = h.shape[0] new positions after the cached ones (decode: T = 1;
        verify: the speculated tokens): attention writes their K/V rows and attends under `visible`;
        `gdn(i, mixer, x, gdn_state)` runs a GDN layer; MoE picks experts per position."""
        cfg, eps = self.config, self.config.rms_norm_eps
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, eps)
            if layer.kind == "full_attention":
                kv = state.attention(i)
                x = attention_decode(layer.mixer, cfg, x, cos, sin, kv.k, kv.v, positions, visible)
            else:
                x = gdn(i, layer.mixer, x, state.gdn(i))
            h = h + self.reduce(x)
            y = rms_norm(h, layer.post_norm, eps)
            if isinstance(layer.ffn, MoEWeights) and y.shape[0] > 1:  # as decode picks them (static shapes)
                y = torch.cat([self.ffn(i, y[j:j + 1], decode=True) for j in range(y.shape[0])])
            else:
                y = self.ffn(i, y, decode=True)
            h = h + self.reduce(y)
        return h

    @torch.no_grad()
    def decode(self, token: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """token int64 [1] on the device, placed at state.position; advances state.position by one
        on the device. Returns fp32 logits [vocab]. No host syncs: capturable in a CUDA graph."""
        cfg, pos = self.config, state.position
        cos, sin = self.rope_cos.index_select(0, pos), self.rope_sin.index_select(0, pos)
        visible = (self.kv_index <= pos).unsqueeze(0)
        h = self._step_layers(F.embedding(token, self.embed), state, cos, sin, pos, visible,
                              lambda i, m, x, s: gdn_decode(m, cfg, x, s.conv, s.rec))
        pos.add_(1)
        return self.logits(h)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, state: DecodeState, scratch: "VerifyScratch"):
        """T tokens int64 [T] at positions state.position .. +T-1 in one pass: attention writes their
        K/V rows and attends causally among them; GDN layers keep the state after each position in
        `scratch` (the live GDN state is untouched); MoE picks experts per position. state.position
        does not move: `commit` advances it. Returns (fp32 logits [T, vocab], final-normed hidden
        [T, H]). No host syncs: capturable."""
        cfg, T = self.config, tokens.shape[0]
        positions = state.position + torch.arange(T, device=self.device)
        cos, sin = self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)
        visible = self.kv_index.unsqueeze(0) <= positions.unsqueeze(1)  # [T, max_seq_len], causal
        h = self._step_layers(
            F.embedding(tokens, self.embed), state, cos, sin, positions, visible,
            lambda i, m, x, s: gdn_verify(m, cfg, x, s.conv, s.rec, scratch.window(i, T), scratch.rec_after[i][:T]))
        hn = rms_norm(h, self.final_norm, self.config.rms_norm_eps)
        return linear(hn, self.lm_head).float(), hn

    @torch.no_grad()
    def commit(self, state: DecodeState, scratch: "VerifyScratch", accepted: torch.Tensor, T: int) -> None:
        """Keep verified positions 0..accepted (int64 [1], device) of the last `verify` of T tokens:
        the GDN state after position `accepted` becomes live, state.position += accepted + 1. K/V rows
        after it stay written but masked (at or after seq_len)."""
        for i in self.config.gdn_layers:
            s = state.gdn(i)
            gdn_commit(self.config, s.conv, s.rec, scratch.window(i, T), scratch.rec_after[i][:T], accepted)
        state.position.add_(accepted + 1)


class VerifyScratch:
    """Static buffers of a verify pass of up to `width` positions: per GDN layer the conv inputs and
    the recurrent state after each position (what `Model.commit` selects from). The states are
    allocated on first use: a slot engine's Speculator that never verifies holds none."""

    def __init__(self, cfg: ModelConfig, width: int, dtype: torch.dtype, device):
        self.width, self.cfg, self.device = width, cfg, device
        km1 = cfg.conv_kernel - 1
        self._window = {i: torch.zeros(cfg.conv_dim, km1 + width, dtype=dtype, device=device) for i in cfg.gdn_layers}
        self._rec_after: dict[int, torch.Tensor] | None = None
        self.km1 = km1

    def window(self, i: int, T: int) -> torch.Tensor:
        return self._window[i][:, :self.km1 + T]

    @property
    def rec_after(self) -> dict[int, torch.Tensor]:
        """Per GDN layer the fp32 state after each position, [width, nv, dk, dv]."""
        if self._rec_after is None:
            c = self.cfg
            self._rec_after = {i: torch.zeros(self.width, c.linear_num_value_heads, c.linear_key_head_dim,
                                              c.linear_value_head_dim, dtype=torch.float32, device=self.device)
                               for i in c.gdn_layers}
        return self._rec_after

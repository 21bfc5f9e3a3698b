"""A trained tiny Qwen3.5 checkpoint grafted into a real model shape, for greedy parity at that shape.

Random weights at the real shapes give near-tied logits: any two correct implementations (the eager
engine with its state perturbed by half a bf16 step, say) part ways within a few tokens. No trained
real-shape checkpoint exists here. So the tiny checkpoint, trained to continue periodic text
(`testing.make_checkpoint(train="periodic")`, its tokens decided by the context with margins of
nats), is carried into every tensor of the real shape so that the big model computes the same
function:

- hidden size: the residual stream is rotated into the real width, x_real = c U x_tiny with U a
  random [H_real, H_tiny] matrix of orthonormal columns and c = sqrt(H_real / H_tiny), so every hidden
  channel of every GEMV carries signal and RMSNorm sees the tiny mean square (its eps acts the
  same). A projection writing the residual gets c U W; one reading a normed input (c U x^_tiny)
  gets W diag(1 + w_norm) U^T / c, the real norm weight being 0.
- heads: tiny heads go to real heads that share the same key / value head; head dims are
  zero-padded (q / k / v rows of the padding are 0, so the per-head norms, the GDN L2 norms and
  the delta rule see the tiny values; the norm weights carry the sqrt(d_tiny / d_real) change and the
  attention's 1/sqrt(head_dim) change). RoPE needs the tiny rotary dim equal to the real one
  (train the tiny model with partial_rotary_factor=1.0 and head_dim = real rotary dim).
- FFN / experts: intermediate rows beyond the tiny ones have up rows 0 (SiLU(g) * 0 = 0), so they
  add nothing; the expert count and top-k must equal the real ones.
- vocabulary: ids beyond the tiny vocabulary get small random embedding / lm_head rows (their
  logits ~N(0, 0.3^2) against trained top-1 logits of many nats).
- the real model's further layers (beyond the tiny depth) and every weight the tiny model has no
  counterpart for (extra heads and their output columns) are random, their output-side weights
  scaled by `extra_scale`, so they perturb the function a little and exercise every kernel.

Tied embeddings (Qwen3.5-2B) need the tiny model's final norm weight fixed at 0
(`make_checkpoint(final_norm_fixed=True)`): the embedding then serves both ends of the rotation.
"""
from __future__ import annotations

import math
import os

import torch


def tiny_overrides(real: dict) -> dict:
    """`make_checkpoint` overrides for a tiny checkpoint that `graft` can carry into the real config
    dict `real`: rotary over the whole tiny head (= the real rotary dim), the real expert count and
    top-k with a small expert width, the final norm fixed where the real model ties its embeddings
    (training ties them and saves lm_head as a copy of the embedding)."""
    kw: dict = {"rope_parameters": {"partial_rotary_factor": 1.0}}
    if real.get("num_experts"):
        kw.update(num_experts=real["num_experts"], num_experts_per_tok=real["num_experts_per_tok"],
                  moe_intermediate_size=16)
    if real.get("tie_word_embeddings"):
        kw.update(final_norm_fixed=True)
    return kw


def ensure_checkpoint(path: str, arch: str, real: dict) -> str:
    """`path` if it holds a checkpoint, else a tiny `arch` checkpoint for `real` trained there
    (`make_checkpoint(train="periodic")`: 5-8 min on one CPU core)."""
    from nexrt_vllm.testing import make_checkpoint
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_checkpoint(path, arch=arch, dtype="bfloat16", train="periodic", **tiny_overrides(real))
    return path


class GraftError(ValueError):
    """The tiny checkpoint cannot be carried into that shape (says which dimension)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise GraftError(msg)


def graft(tiny: dict[str, torch.Tensor], tcfg, rcfg, dtype=torch.bfloat16, device="cpu", seed: int = 0,
          extra_scale: float = 0.1, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Tensors (canonical names, `weights.expected_shapes(rcfg)`) of the real config `rcfg` computing
    the tiny model `tiny` (canonical tensors of `tcfg`) up to bf16 rounding and the small random
    contributions described in the module docstring."""
    from nexrt_vllm.engine.weights import random_weights

    Ht, Hr = tcfg.hidden_size, rcfg.hidden_size
    _check(tcfg.family == rcfg.family and tcfg.family.startswith("qwen3_5"), f"families {tcfg.family} -> {rcfg.family}: Qwen3.5 only")
    _check(Hr >= Ht and tcfg.vocab_size <= rcfg.vocab_size and tcfg.num_layers <= rcfg.num_layers,
           "the real shape must be at least the tiny one (hidden, vocab, layers)")
    _check(list(rcfg.layer_types[:tcfg.num_layers]) == list(tcfg.layer_types), "layer kinds differ")
    _check(tcfg.rotary_dim == rcfg.rotary_dim == tcfg.head_dim <= rcfg.head_dim and tcfg.rope_theta == rcfg.rope_theta,
           f"RoPE: tiny rotary {tcfg.rotary_dim} of head {tcfg.head_dim}, real {rcfg.rotary_dim} of {rcfg.head_dim}")
    _check(tcfg.num_kv_heads <= rcfg.num_kv_heads and tcfg.num_heads // tcfg.num_kv_heads
           <= rcfg.num_heads // rcfg.num_kv_heads, "attention heads")
    _check(not rcfg.tie_word_embeddings or torch.equal(tiny.get("lm_head.weight", tiny["embed_tokens.weight"]),
                                                        tiny["embed_tokens.weight"]),
           "tied real embeddings need a tied tiny model (lm_head == embedding)")
    f32 = dict(dtype=torch.float32, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    U = torch.linalg.qr(torch.randn(Hr, Ht, generator=gen, **f32))[0]  # orthonormal columns
    c = math.sqrt(Hr / Ht)
    t = {k: v.to(**f32) for k, v in tiny.items()}
    # made in the target dtype and edited in place (fp32 values cast on assignment): the 35B-A3B
    # shape is 67 GB in bf16 and would not fit the GPU twice or in fp32
    out = random_weights(rcfg, dtype, device, seed=seed + 1, std=std)

    def noise(shape, scale=1.0):
        return torch.randn(shape, generator=gen, **f32) * std * scale

    def inp(w, norm):  # tiny projection reading a normed input -> real columns
        return (w * (1 + norm)) @ U.T / c

    def outp(w):  # tiny projection writing the residual -> real rows
        return c * U @ w

    for name, x in out.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj", "down_proj.weight")):
            x.mul_(extra_scale)  # random residual writes: small, so the grafted function dominates
        elif name.endswith("layernorm.weight"):
            x.zero_()

    # embeddings, final norm, lm_head
    Vt = tcfg.vocab_size
    emb = out["embed_tokens.weight"]
    tied = rcfg.tie_word_embeddings
    # extra vocabulary logits ~ N(0, 0.3^2): a tied row meets U x^ / c (|x^|^2 = H_tiny), an untied one c U x^
    for r in range(0, emb.shape[0], 1 << 15):
        emb[r:r + (1 << 15)] = noise((min(1 << 15, emb.shape[0] - r), Hr), 0.3 * c / math.sqrt(Ht) / std)
    emb[:Vt] = outp(t["embed_tokens.weight"].T).T
    if tied:
        _check(bool((t["norm.weight"] == 0).all()), "tied embeddings: the tiny final norm weight must be 0 "
               "(make_checkpoint(final_norm_fixed=True))")
        out["norm.weight"].fill_(1 / c ** 2 - 1)  # logits = (c U e) . (c U x^ / c^2) = e . x^
    else:
        out["norm.weight"].zero_()
        head = out["lm_head.weight"]
        for r in range(0, head.shape[0], 1 << 15):
            head[r:r + (1 << 15)] = noise((min(1 << 15, head.shape[0] - r), Hr), 0.3 / math.sqrt(Ht) / c / std)
        head[:Vt] = inp(t.get("lm_head.weight", t["embed_tokens.weight"]), t["norm.weight"])

    for i, kind in enumerate(tcfg.layer_types):
        p = f"layers.{i}."
        n_in, n_post = t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"]
        if kind == "full_attention":
            _attention(out, t, p + "self_attn.", tcfg, rcfg, lambda w: inp(w, n_in), outp)
        else:
            _gdn(out, t, p + "linear_attn.", tcfg, rcfg, lambda w: inp(w, n_in), outp)
        _ffn(out, t, p + "mlp.", tcfg, rcfg, i, lambda w: inp(w, n_post), outp)
    return out


def _attention(out, t, a, tc, rc, inp, outp):
    dt, dr = tc.head_dim, rc.head_dim
    gt, gr = tc.num_heads // tc.num_kv_heads, rc.num_heads // rc.num_kv_heads
    q = out[a + "q_proj.weight"].view(rc.num_heads, 2, dr, -1)
    k = out[a + "k_proj.weight"].view(rc.num_kv_heads, dr, -1)
    v = out[a + "v_proj.weight"].view(rc.num_kv_heads, dr, -1)
    o = out[a + "o_proj.weight"].view(-1, rc.num_heads, dr)
    tq = inp(t[a + "q_proj.weight"]).view(tc.num_heads, 2, dt, -1)
    tk = inp(t[a + "k_proj.weight"]).view(tc.num_kv_heads, dt, -1)
    tv = inp(t[a + "v_proj.weight"]).view(tc.num_kv_heads, dt, -1)
    to = outp(t[a + "o_proj.weight"]).view(-1, tc.num_heads, dt)
    for h in range(tc.num_heads):
        r = (h // gt) * gr + h % gt  # same kv head as in the tiny model
        q[r, :, :dt] = tq[h]
        q[r, 0, dt:] = 0  # padded query dims: 0, so q_norm sees the tiny query
        o[:, r] = 0
        o[:, r, :dt] = to[:, h]
    for j in range(tc.num_kv_heads):
        k[j, :dt], k[j, dt:] = tk[j], 0
        v[j, :dt], v[j, dt:] = tv[j], 0
    # q: rms over dr of a zero-padded head is sqrt(dt/dr) of the tiny one, and the softmax scale is
    # dr^-1/2 instead of dt^-1/2: the two cancel. k: only the rms change, carried by k_norm.
    qn, kn = out[a + "q_norm.weight"], out[a + "k_norm.weight"]
    qn[:dt] = t[a + "q_norm.weight"]
    kn[:dt] = (1 + t[a + "k_norm.weight"]) * math.sqrt(dt / dr) - 1


def _qkv_heads(x, nk: int, dk: int, nv: int, dv: int):
    """Per-head views [nk, dk, -1], [nk, dk, -1], [nv, dv, -1] of the q | k | v rows (GDN conv channels)."""
    return x[:nk * dk].view(nk, dk, -1), x[nk * dk:2 * nk * dk].view(nk, dk, -1), x[2 * nk * dk:].view(nv, dv, -1)


def _gdn(out, t, g, tc, rc, inp, outp):
    nkt, nvt, dkt, dvt = tc.linear_num_key_heads, tc.linear_num_value_heads, tc.linear_key_head_dim, \
        tc.linear_value_head_dim
    nkr, nvr, dkr, dvr = rc.linear_num_key_heads, rc.linear_num_value_heads, rc.linear_key_head_dim, \
        rc.linear_value_head_dim
    _check(nvt <= nvr and dkt <= dkr and dvt <= dvr, "GDN heads / dims")
    rt, rr = nvt // nkt, nvr // nkr
    src: dict[int, int] = {}  # real key head -> tiny key head
    for j in range(nvt):  # tiny value head j -> real value head j
        _check(src.setdefault(j // rr, j // rt) == j // rt, "GDN key heads of the tiny value heads collide")
    rq, rk, rv = _qkv_heads(out[g + "in_proj_qkv.weight"], nkr, dkr, nvr, dvr)
    tq, tk, tv = _qkv_heads(inp(t[g + "in_proj_qkv.weight"]), nkt, dkt, nvt, dvt)
    cq, ck, cv = _qkv_heads(out[g + "conv1d.weight"], nkr, dkr, nvr, dvr)
    tcq, tck, tcv = _qkv_heads(t[g + "conv1d.weight"], nkt, dkt, nvt, dvt)
    for a, s in src.items():  # padded q / k dims 0: the L2 norms see the tiny vectors
        rq[a, :dkt], rq[a, dkt:], cq[a, :dkt] = tq[s], 0, tcq[s]
        rk[a, :dkt], rk[a, dkt:], ck[a, :dkt] = tk[s], 0, tck[s]
    z = out[g + "in_proj_z.weight"].view(nvr, dvr, -1)
    tz = inp(t[g + "in_proj_z.weight"]).view(nvt, dvt, -1)
    o = out[g + "out_proj.weight"].view(-1, nvr, dvr)
    to = outp(t[g + "out_proj.weight"]).view(-1, nvt, dvt)
    for j in range(nvt):  # padded v dims 0: the state's extra columns and outputs stay 0
        rv[j, :dvt], rv[j, dvt:], cv[j, :dvt] = tv[j], 0, tcv[j]
        z[j, :dvt] = tz[j]
        o[:, j] = 0
        o[:, j, :dvt] = to[:, j]
    for n in ("in_proj_b.weight", "in_proj_a.weight"):
        out[g + n][:nvt] = inp(t[g + n])
    for n in ("dt_bias", "A_log"):
        out[g + n][:nvt] = t[g + n]
    # the gated norm (plain weight) over dvr channels of which dvt are non-zero
    out[g + "norm.weight"][:dvt] = t[g + "norm.weight"] * math.sqrt(dvt / dvr)


def _ffn(out, t, m, tc, rc, i, inp, outp):
    def swiglu(gate_r, up_r, down_r, gate_t, up_t, down_t):  # real [I, H] x2, [H, I]; tiny likewise
        it = gate_t.shape[0]
        gate_r[:it], up_r[:it], up_r[it:] = inp(gate_t), inp(up_t), 0  # padding: SiLU(g) * 0 adds nothing
        down_r[:, :it] = outp(down_t)

    def dense(p):  # the gate_proj / up_proj / down_proj modules under prefix p
        names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
        swiglu(*(out[p + n] for n in names), *(t[p + n] for n in names))

    if not tc.is_moe_layer(i):
        _check(not rc.is_moe_layer(i) and tc.intermediate_size <= rc.intermediate_size, "dense FFN")
        dense(m)
        return
    _check(rc.is_moe_layer(i) and tc.num_experts == rc.num_experts and tc.num_experts_per_tok ==
           rc.num_experts_per_tok and tc.moe_intermediate_size <= rc.moe_intermediate_size and
           tc.shared_expert_intermediate_size <= rc.shared_expert_intermediate_size,
           f"MoE: tiny {tc.num_experts} experts top-{tc.num_experts_per_tok}, real {rc.num_experts} "
           f"top-{rc.num_experts_per_tok} (must be equal)")
    out[m + "gate.weight"][:] = inp(t[m + "gate.weight"])
    out[m + "shared_expert_gate.weight"][:] = inp(t[m + "shared_expert_gate.weight"])
    gu, dn, tgu, tdn = out[m + "experts.gate_up_proj"], out[m + "experts.down_proj"], \
        t[m + "experts.gate_up_proj"], t[m + "experts.down_proj"]
    ir, it = rc.moe_intermediate_size, tc.moe_intermediate_size
    for e in range(rc.num_experts):
        swiglu(gu[e, :ir], gu[e, ir:], dn[e], tgu[e, :it], tgu[e, it:], tdn[e])
    dense(m + "shared_expert.")

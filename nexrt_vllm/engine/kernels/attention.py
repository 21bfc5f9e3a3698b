"""Batch-1 gated attention over the static KV cache, with the sequence length read on the device.

Four launches per attention layer: (1) q/k RMSNorm + partial NeoX RoPE at the device position,
K/V written into the cache row; (2) scores: grid (kv head, split), each program covers a contiguous
slice of [0, pos] for all query heads of its group (GQA: K read once), keeping the bf16-rounded
scores and the split's max / sum of exp; (3) P·V over the same splits with the probabilities
normalised by the global max and sum and rounded to bf16 first, as the eager softmax(fp32).to(bf16)
does (a one-pass flash softmax cannot round there: it only normalises at the end); (4) sum the
splits and apply the sigmoid output gate. K and V are each read once, as in one-pass flash
decoding; the scores round-trip through a small fp32 scratch. The grid never depends on the length,
so one captured graph serves every position up to max_seq_len.
"""
import os

import triton
import triton.language as tl

from .common import LAUNCH, pdl_begin
from .common import bf16_round as _bf16


@triton.jit
def qk_rope_cache_kernel(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr,
                         pos_ptr, eps, stride_ch, stride_cs,
                         H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
                         RESTP: tl.constexpr, HDP: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    # qkv layout: [H x (query | gate)] [KVH x k] [KVH x v]; grid H + KVH. Each head vector is read as
    # three pieces [0, ROT/2) [ROT/2, ROT) [ROT, HD) so the NeoX pairs (i, i + ROT/2) line up.
    pid = tl.program_id(0)
    pos = tl.load(pos_ptr)
    is_q = pid < H
    src = tl.where(is_q, pid * 2 * HD, H * 2 * HD + (pid - H) * HD)
    half: tl.constexpr = ROT // 2
    i = tl.arange(0, half)
    r = ROT + tl.arange(0, RESTP)
    rm = r < HD
    x1 = tl.load(qkv_ptr + src + i).to(tl.float32)
    x2 = tl.load(qkv_ptr + src + half + i).to(tl.float32)
    x3 = tl.load(qkv_ptr + src + r, mask=rm, other=0.0).to(tl.float32)
    nw = tl.where(is_q, qn_ptr, kn_ptr)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0) + tl.sum(x3 * x3, 0)) / HD + eps)
    x1 = _bf16((x1 * rstd) * (1.0 + tl.load(nw + i).to(tl.float32)))
    x2 = _bf16((x2 * rstd) * (1.0 + tl.load(nw + half + i).to(tl.float32)))
    x3 = _bf16((x3 * rstd) * (1.0 + tl.load(nw + r, mask=rm, other=0.0).to(tl.float32)))
    # The eager model's bf16 cos/sin tables [max_seq_len, ROT] (halves equal): same values, no
    # device transcendental at large angles.
    c = tl.load(cos_ptr + pos * ROT + i).to(tl.float32)
    s = tl.load(sin_ptr + pos * ROT + i).to(tl.float32)
    y1 = _bf16(_bf16(x1 * c) - _bf16(x2 * s))
    y2 = _bf16(_bf16(x2 * c) + _bf16(x1 * s))
    if is_q:
        dst = q_out_ptr + pid * HD
    else:
        dst = k_cache_ptr + (pid - H) * stride_ch + pos * stride_cs
    tl.store(dst + i, y1.to(dst.dtype.element_ty))
    tl.store(dst + half + i, y2.to(dst.dtype.element_ty))
    tl.store(dst + r, x3.to(dst.dtype.element_ty), mask=rm)
    if not is_q:
        d = tl.arange(0, HDP)
        dm = d < HD
        v = tl.load(qkv_ptr + H * 2 * HD + KVH * HD + (pid - H) * HD + d, mask=dm)
        tl.store(v_cache_ptr + (pid - H) * stride_ch + pos * stride_cs + d, v.to(v_cache_ptr.dtype.element_ty),
                 mask=dm)


@triton.jit
def _split_range(pos_ptr, sp, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr, BLOCK: tl.constexpr):
    # At least MIN_PER keys per split: short contexts use fewer splits (less partial traffic),
    # long ones all NSPLIT. Splits past the end write nothing; later passes read only live ones.
    length = tl.load(pos_ptr) + 1
    per = tl.maximum(tl.cdiv(tl.cdiv(length, NSPLIT), BLOCK) * BLOCK, MIN_PER)
    return sp * per, tl.minimum(sp * per + per, length), per, length


@triton.jit
def attn_scores_kernel(q_ptr, k_cache_ptr, pos_ptr, s_ptr, m_ptr, l_ptr, scale, stride_ch, stride_cs, max_len,
                       NSPLIT: tl.constexpr, MIN_PER: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                       HD: tl.constexpr, BLOCK: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    # Pass 1, grid (kv head, split): the scores of the split's keys for all query heads of the group
    # (K read once), stored fp32 in [H, max_len] scratch, plus the split's max and sum of exp.
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    start, end, per, length = _split_range(pos_ptr, sp, NSPLIT, MIN_PER, BLOCK)
    g = tl.arange(0, GP)
    d = tl.arange(0, HD)
    gm = g < G
    h = kvh * G + g
    q = tl.load(q_ptr + h[:, None] * HD + d[None, :], mask=gm[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    kb = k_cache_ptr + kvh * stride_ch
    for n0 in range(start, end, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        nm = n < end
        kt = tl.load(kb + n[:, None] * stride_cs + d[None, :], mask=nm[:, None], other=0.0)
        if DOT_F32:
            kt = kt.to(tl.float32)
        # Scores rounded to bf16 before and after the scale, as the eager matmul + multiply leave them.
        s = _bf16(_bf16(tl.dot(q, tl.trans(kt))) * scale)
        s = tl.where(nm[None, :], s, float("-inf"))
        tl.store(s_ptr + h[:, None] * max_len + n[None, :], s, mask=gm[:, None] & nm[None, :])
        m_new = tl.maximum(m, tl.max(s, 1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    live = gm & ((tl.zeros_like(g) + start) < length)  # vector compare: the interpreter rejects bool&scalar
    tl.store(m_ptr + h * NSPLIT + sp, m, mask=live)
    tl.store(l_ptr + h * NSPLIT + sp, l, mask=live)


@triton.jit
def attn_pv_kernel(v_cache_ptr, pos_ptr, s_ptr, m_ptr, l_ptr, acc_ptr, stride_ch, stride_cs, max_len,
                   NSPLIT: tl.constexpr, MIN_PER: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                   HD: tl.constexpr, BLOCK: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    # Pass 2, grid (kv head, split): global max and sum from every live split, then the split's
    # probabilities normalised and rounded to bf16 exactly as the eager softmax(fp32).to(bf16)
    # leaves them, times V (read once) with fp32 accumulation; partial sums per split.
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    start, end, per, length = _split_range(pos_ptr, sp, NSPLIT, MIN_PER, BLOCK)
    g = tl.arange(0, GP)
    d = tl.arange(0, HD)
    gm = g < G
    h = kvh * G + g
    j = tl.arange(0, NSPLIT)
    jm = gm[:, None] & (j * per < length)[None, :]
    mj = tl.load(m_ptr + h[:, None] * NSPLIT + j[None, :], mask=jm, other=float("-inf"))
    lj = tl.load(l_ptr + h[:, None] * NSPLIT + j[None, :], mask=jm, other=0.0)
    mx = tl.max(mj, 1)
    mx = tl.where(gm, mx, 0.0)  # padded heads (masked out below): keep them finite
    inv = 1.0 / tl.where(gm, tl.sum(tl.where(jm, lj * tl.exp(mj - mx[:, None]), 0.0), 1), 1.0)
    acc = tl.zeros([GP, HD], tl.float32)
    vb = v_cache_ptr + kvh * stride_ch
    for n0 in range(start, end, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        nm = n < end
        s = tl.load(s_ptr + h[:, None] * max_len + n[None, :], mask=gm[:, None] & nm[None, :], other=float("-inf"))
        p = _bf16(tl.exp(s - mx[:, None]) * inv[:, None])
        vt = tl.load(vb + n[:, None] * stride_cs + d[None, :], mask=nm[:, None], other=0.0)
        if DOT_F32:
            vt = vt.to(tl.float32)
        acc += tl.dot(p.to(vt.dtype), vt)  # p is bf16-exact: the cast loses nothing
    live = gm & ((tl.zeros_like(g) + start) < length)
    tl.store(acc_ptr + (h * NSPLIT + sp)[:, None] * HD + d[None, :], acc, mask=live[:, None])


@triton.jit
def attn_combine_kernel(acc_ptr, qkv_ptr, out_ptr, pos_ptr,
                        NSPLIT: tl.constexpr, MIN_PER: tl.constexpr, BLOCK: tl.constexpr, HD: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    # grid (head, head_dim block): sum the live splits' partial P·V, round as the eager bf16 matmul
    # output, apply the sigmoid output gate.
    h = tl.program_id(0)
    s = tl.arange(0, NSPLIT)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    _, _, per, length = _split_range(pos_ptr, 0, NSPLIT, MIN_PER, BLOCK)
    live = s * per < length
    acc = tl.load(acc_ptr + (h * NSPLIT + s)[:, None] * HD + d[None, :], mask=live[:, None], other=0.0)
    o = tl.sum(acc, 0)
    gate = tl.load(qkv_ptr + h * 2 * HD + HD + d).to(tl.float32)
    sig = _bf16(1.0 / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + h * HD + d, _bf16(_bf16(o) * sig).to(out_ptr.dtype.element_ty))


# The interpreter (CPU tests) multiplies bf16 dot operands as raw integers; give it fp32 there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def qk_rope_cache(qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos, sin, pos, *, num_heads,
                  num_kv_heads, head_dim, rotary_dim, eps):
    """k_cache/v_cache: [KVH, max_seq_len, head_dim]; writes row `pos` (device scalar); cos/sin
    [max_seq_len, rotary_dim] in the model dtype."""
    qk_rope_cache_kernel[(num_heads + num_kv_heads,)](
        qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos, sin, pos, eps,
        k_cache.stride(0), k_cache.stride(1), H=num_heads, KVH=num_kv_heads, HD=head_dim, ROT=rotary_dim,
        RESTP=triton.next_power_of_2(head_dim - rotary_dim), HDP=triton.next_power_of_2(head_dim),
        **LAUNCH, num_warps=2)


def attention_decode(q, k_cache, v_cache, pos, qkv, out, m_buf, l_buf, acc_buf, s_buf, *, num_heads, num_kv_heads,
                     head_dim, nsplit, block=32, min_per=128, num_warps=4):
    """softmax(q K[:pos+1]^T / sqrt(d)) V per head, times sigmoid(gate). Scratch: m_buf, l_buf
    [H * nsplit], acc_buf [H * nsplit * d] fp32, s_buf [H * max_seq_len] fp32 (the scores)."""
    g = num_heads // num_kv_heads
    max_len = k_cache.shape[1]
    kw = dict(NSPLIT=nsplit, MIN_PER=min_per, G=g, GP=max(16, triton.next_power_of_2(g)), HD=head_dim, BLOCK=block,
              DOT_F32=_INTERPRETED, **LAUNCH)
    attn_scores_kernel[(num_kv_heads, nsplit)](
        q, k_cache, pos, s_buf, m_buf, l_buf, head_dim ** -0.5, k_cache.stride(0), k_cache.stride(1), max_len,
        **kw, num_warps=num_warps)
    attn_pv_kernel[(num_kv_heads, nsplit)](
        v_cache, pos, s_buf, m_buf, l_buf, acc_buf, v_cache.stride(0), v_cache.stride(1), max_len,
        **kw, num_warps=num_warps)
    block_d = min(64, head_dim)
    attn_combine_kernel[(num_heads, head_dim // block_d)](acc_buf, qkv, out, pos, NSPLIT=nsplit, MIN_PER=min_per,
                                                          BLOCK=block, HD=head_dim, BLOCK_D=block_d, **LAUNCH,
                                                          num_warps=4)

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

The verify pass of speculative decoding (`qk_rope_cache(m=M)`, `attention_verify`) runs M tokens at
positions pos..pos+M-1 through the same four steps: each (kv head, split) program covers the M*G
query rows of its group, so K and V are still read once, and row j is masked past pos + j.
"""
import os

import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.common import LAUNCH, pdl_begin
from nexrt_vllm.engine.kernels.common import bf16_round as _bf16


@triton.jit
def _qk_rope_head(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pid, pos, eps,
                  stride_ch, stride_cs, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
                  RESTP: tl.constexpr, HDP: tl.constexpr):
    # One head (pid < H: query head pid, else kv head pid - H) of one token at position pos.
    # qkv layout: [H x (query | gate)] [KVH x k] [KVH x v]; grid H + KVH. Each head vector is read as
    # three pieces [0, ROT/2) [ROT/2, ROT) [ROT, HD) so the NeoX pairs (i, i + ROT/2) line up.
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
def qk_rope_cache_kernel(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr,
                         pos_ptr, eps, stride_ch, stride_cs,
                         H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
                         RESTP: tl.constexpr, HDP: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    pos = tl.load(pos_ptr)
    _qk_rope_head(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pid, pos, eps,
                  stride_ch, stride_cs, H, KVH, HD, ROT, RESTP, HDP)


@triton.jit
def qk_rope_cache_m_kernel(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr,
                           pos_ptr, eps, stride_ch, stride_cs, stride_qkv, stride_q,
                           H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
                           RESTP: tl.constexpr, HDP: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    # The verify pass: grid (H + KVH, m), token j (qkv row j) at position pos + j, q_out row j.
    j = tl.program_id(1)
    _qk_rope_head(qkv_ptr + j * stride_qkv, q_out_ptr + j * stride_q, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr,
                  cos_ptr, sin_ptr, tl.program_id(0), tl.load(pos_ptr) + j, eps, stride_ch, stride_cs, H, KVH, HD,
                  ROT, RESTP, HDP)


@triton.jit
def _split_range(pos_ptr, sp, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr, BLOCK: tl.constexpr):
    # At least MIN_PER keys per split: short contexts use fewer splits (less partial traffic),
    # long ones all NSPLIT. Splits past the end exit after their wait and write nothing; later
    # passes read only live ones.
    length = tl.load(pos_ptr) + 1
    per = tl.maximum(tl.cdiv(tl.cdiv(length, NSPLIT), BLOCK) * BLOCK, MIN_PER)
    return sp * per, tl.minimum(sp * per + per, length), per, length


@triton.jit
def _scores_block(q, kb, n, nm, qm, lim, srow, s_ptr, max_len, scale, m, l, stride_cs, d, DOT_F32: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """Keys n (nm: in the range) of one block against the query rows q (qm: live rows): the scores,
    rounded to bf16 before and after the scale as the eager matmul + multiply leave them, stored at
    s_ptr rows `srow`; returns the rows' running max and sum of exp. CAUSAL (the verify's rows): a
    row sees keys up to its own position lim, and a row that has seen none yet keeps its sum 0."""
    kt = tl.load(kb + n[:, None] * stride_cs + d[None, :], mask=nm[:, None], other=0.0)
    if DOT_F32:
        kt = kt.to(tl.float32)
    s = _bf16(_bf16(tl.dot(q, tl.trans(kt))) * scale)
    if CAUSAL:
        vis = qm[:, None] & nm[None, :] & (n[None, :] <= lim[:, None])
        smask = vis
    else:
        vis = nm[None, :]
        smask = qm[:, None] & nm[None, :]
    s = tl.where(vis, s, float("-inf"))
    tl.store(s_ptr + srow[:, None] * max_len + n[None, :], s, mask=smask)
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = m_new
    if CAUSAL:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    l = l * tl.exp(m - m_use) + tl.sum(tl.exp(s - m_use[:, None]), 1)
    return m_new, l


@triton.jit
def _scores_split(q, kb, lo, hi, qm, lim, srow, s_ptr, max_len, scale, stride_cs, d, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr, DOT_F32: tl.constexpr, CAUSAL: tl.constexpr):
    """`_scores_block` over the keys [lo, hi) of one split: the ROWS query rows' max and sum of exp."""
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    for n0 in range(lo, hi, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        m, l = _scores_block(q, kb, n, n < hi, qm, lim, srow, s_ptr, max_len, scale, m, l, stride_cs, d, DOT_F32,
                             CAUSAL)
    return m, l


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
    if start < length:  # a split past the end (short contexts) exits at once
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        gm = g < G
        h = kvh * G + g
        q = tl.load(q_ptr + h[:, None] * HD + d[None, :], mask=gm[:, None], other=0.0)
        m, l = _scores_split(q, k_cache_ptr + kvh * stride_ch, start, end, gm, 0, h, s_ptr, max_len, scale,
                             stride_cs, d, GP, BLOCK, DOT_F32, False)
        tl.store(m_ptr + h * NSPLIT + sp, m, mask=gm)
        tl.store(l_ptr + h * NSPLIT + sp, l, mask=gm)


@triton.jit
def _global_stats(m_ptr, l_ptr, row, rm, per, length, NSPLIT: tl.constexpr):
    """The P·V passes' softmax statistics: for scratch rows `row` (rm: live), the max over every live
    split's max (split j is live when j * per < length) and 1 / the sum of exp relative to it.
    Padded rows get max 0 and sum 1 (finite; their results are masked out)."""
    j = tl.arange(0, NSPLIT)
    jm = rm[:, None] & (j * per < length)[None, :]
    mj = tl.load(m_ptr + row[:, None] * NSPLIT + j[None, :], mask=jm, other=float("-inf"))
    lj = tl.load(l_ptr + row[:, None] * NSPLIT + j[None, :], mask=jm, other=0.0)
    mx = tl.where(rm, tl.max(mj, 1), 0.0)
    inv = 1.0 / tl.where(rm, tl.sum(tl.where(jm, lj * tl.exp(mj - mx[:, None]), 0.0), 1), 1.0)
    return mx, inv


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
    if start < length:  # as in the scores pass
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        gm = g < G
        h = kvh * G + g
        mx, inv = _global_stats(m_ptr, l_ptr, h, gm, per, length, NSPLIT)
        acc = tl.zeros([GP, HD], tl.float32)
        vb = v_cache_ptr + kvh * stride_ch
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            nm = n < end
            s = tl.load(s_ptr + h[:, None] * max_len + n[None, :], mask=gm[:, None] & nm[None, :],
                        other=float("-inf"))
            p = _bf16(tl.exp(s - mx[:, None]) * inv[:, None])
            vt = tl.load(vb + n[:, None] * stride_cs + d[None, :], mask=nm[:, None], other=0.0)
            if DOT_F32:
                vt = vt.to(tl.float32)
            acc += tl.dot(p.to(vt.dtype), vt)  # p is bf16-exact: the cast loses nothing
        tl.store(acc_ptr + (h * NSPLIT + sp)[:, None] * HD + d[None, :], acc, mask=gm[:, None])


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


# The verify pass (M new tokens at pos..pos+M-1, speculative decoding): the same three passes, each
# (kv head, split) program covering all M*G query rows of its group, so every K and V row is read once
# for all of them. Row r of a program is token j = r // G, query head kvh*G + r % G; it sees keys
# [start, pos + j]. The splits cover the union [start, pos + M); a row may see no key of a split
# (its max stays -inf, its sum 0, its P.V 0). Scratch rows are indexed j*H + h.


@triton.jit
def _verify_range(pos_ptr, start_ptr, sp, M: tl.constexpr, HAS_START: tl.constexpr, NSPLIT: tl.constexpr,
                  MIN_PER: tl.constexpr, BLOCK: tl.constexpr):
    pos = tl.load(pos_ptr)
    if HAS_START:
        base = tl.load(start_ptr)
    else:
        base = tl.zeros_like(pos)
    length = pos + M - base
    per = tl.maximum(tl.cdiv(tl.cdiv(length, NSPLIT), BLOCK) * BLOCK, MIN_PER)
    lo = base + sp * per
    return lo, tl.minimum(lo + per, pos + M), per, length, pos


@triton.jit
def attn_verify_scores_kernel(q_ptr, k_cache_ptr, pos_ptr, start_ptr, s_ptr, m_ptr, l_ptr, scale, stride_q, stride_ch,
                              stride_cs, max_len, M: tl.constexpr, HAS_START: tl.constexpr, NSPLIT: tl.constexpr,
                              MIN_PER: tl.constexpr, H: tl.constexpr, G: tl.constexpr, RP: tl.constexpr,
                              HD: tl.constexpr, BLOCK: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    # attn_scores_kernel for M*G rows; scores past a row's own position are -inf (not stored).
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    lo, hi, per, length, pos = _verify_range(pos_ptr, start_ptr, sp, M, HAS_START, NSPLIT, MIN_PER, BLOCK)
    r = tl.arange(0, RP)
    d = tl.arange(0, HD)
    rm = r < M * G
    j = r // G
    h = kvh * G + r % G
    row = j * H + h
    lim = pos + j  # the row's last visible key
    q = tl.load(q_ptr + j[:, None] * stride_q + h[:, None] * HD + d[None, :], mask=rm[:, None], other=0.0)
    m, l = _scores_split(q, k_cache_ptr + kvh * stride_ch, lo, hi, rm, lim, row, s_ptr, max_len, scale, stride_cs, d,
                         RP, BLOCK, DOT_F32, True)
    live = rm & ((tl.zeros_like(r) + lo) < hi)
    tl.store(m_ptr + row * NSPLIT + sp, m, mask=live)
    tl.store(l_ptr + row * NSPLIT + sp, l, mask=live)


@triton.jit
def attn_verify_pv_kernel(v_cache_ptr, pos_ptr, start_ptr, s_ptr, m_ptr, l_ptr, acc_ptr, stride_ch, stride_cs, max_len,
                          M: tl.constexpr, HAS_START: tl.constexpr, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr,
                          H: tl.constexpr, G: tl.constexpr, RP: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr,
                          DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    # attn_pv_kernel for M*G rows: V read once for all of them.
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    lo, hi, per, length, pos = _verify_range(pos_ptr, start_ptr, sp, M, HAS_START, NSPLIT, MIN_PER, BLOCK)
    r = tl.arange(0, RP)
    d = tl.arange(0, HD)
    rm = r < M * G
    j = r // G
    row = j * H + kvh * G + r % G
    lim = pos + j
    mx, inv = _global_stats(m_ptr, l_ptr, row, rm, per, length, NSPLIT)
    acc = tl.zeros([RP, HD], tl.float32)
    vb = v_cache_ptr + kvh * stride_ch
    for n0 in range(lo, hi, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        nm = n < hi
        vis = rm[:, None] & nm[None, :] & (n[None, :] <= lim[:, None])
        s = tl.load(s_ptr + row[:, None] * max_len + n[None, :], mask=vis, other=float("-inf"))
        p = _bf16(tl.exp(s - mx[:, None]) * inv[:, None])
        vt = tl.load(vb + n[:, None] * stride_cs + d[None, :], mask=nm[:, None], other=0.0)
        if DOT_F32:
            vt = vt.to(tl.float32)
        acc += tl.dot(p.to(vt.dtype), vt)
    live = rm & ((tl.zeros_like(r) + lo) < hi)
    tl.store(acc_ptr + (row * NSPLIT + sp)[:, None] * HD + d[None, :], acc, mask=live[:, None])


@triton.jit
def attn_verify_combine_kernel(acc_ptr, qkv_ptr, out_ptr, pos_ptr, start_ptr, stride_qkv, stride_out,
                               M: tl.constexpr, HAS_START: tl.constexpr, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr,
                               BLOCK: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                               PDL: tl.constexpr):
    pdl_begin(PDL)
    # attn_combine_kernel, grid (M*H, head_dim block): row j*H + h, gate from qkv row j, out row j.
    rh = tl.program_id(0)
    j = rh // H
    h = rh % H
    s = tl.arange(0, NSPLIT)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    _, _, per, length, _ = _verify_range(pos_ptr, start_ptr, 0, M, HAS_START, NSPLIT, MIN_PER, BLOCK)
    live = s * per < length
    acc = tl.load(acc_ptr + (rh * NSPLIT + s)[:, None] * HD + d[None, :], mask=live[:, None], other=0.0)
    o = tl.sum(acc, 0)
    gate = tl.load(qkv_ptr + j * stride_qkv + h * 2 * HD + HD + d).to(tl.float32)
    sig = _bf16(1.0 / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + j * stride_out + h * HD + d, _bf16(_bf16(o) * sig).to(out_ptr.dtype.element_ty))


# The interpreter (CPU tests) multiplies bf16 dot operands as raw integers; give it fp32 there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def qk_rope_cache(qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos, sin, pos, *, num_heads,
                  num_kv_heads, head_dim, rotary_dim, eps, m=1):
    """k_cache/v_cache: [KVH, max_seq_len, head_dim]; writes row `pos` (device scalar); cos/sin
    [max_seq_len, rotary_dim] in the model dtype. m > 1 (verify): qkv [m, qkv rows] and q_out
    [m, H*HD] (row strides), token j at position pos + j, its K/V at cache row pos + j."""
    if m == 1:
        qk_rope_cache_kernel[(num_heads + num_kv_heads,)](
            qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos, sin, pos, eps,
            k_cache.stride(0), k_cache.stride(1), H=num_heads, KVH=num_kv_heads, HD=head_dim, ROT=rotary_dim,
            RESTP=triton.next_power_of_2(head_dim - rotary_dim), HDP=triton.next_power_of_2(head_dim),
            **LAUNCH, num_warps=2)
        return
    qk_rope_cache_m_kernel[(num_heads + num_kv_heads, m)](
        qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos, sin, pos, eps, k_cache.stride(0), k_cache.stride(1),
        qkv.stride(0), q_out.stride(0), H=num_heads, KVH=num_kv_heads, HD=head_dim, ROT=rotary_dim,
        RESTP=triton.next_power_of_2(head_dim - rotary_dim), HDP=triton.next_power_of_2(head_dim), **LAUNCH,
        num_warps=2)


def attention_decode(q, k_cache, v_cache, pos, qkv, out, m_buf, l_buf, acc_buf, s_buf, *, num_heads, num_kv_heads,
                     head_dim, nsplit, block=32, min_per=128, num_warps=4):
    """softmax(q K[:pos+1]^T / sqrt(d)) V per head, times sigmoid(gate). Scratch: m_buf, l_buf
    [H * nsplit], acc_buf [H * nsplit * d] fp32, s_buf [H * max_seq_len] fp32 (the scores)."""
    g = num_heads // num_kv_heads
    max_len = k_cache.shape[1]
    split = dict(NSPLIT=nsplit, MIN_PER=min_per)
    kw = dict(split, G=g, GP=max(16, triton.next_power_of_2(g)), HD=head_dim, BLOCK=block, DOT_F32=_INTERPRETED,
              **LAUNCH)
    attn_scores_kernel[(num_kv_heads, nsplit)](
        q, k_cache, pos, s_buf, m_buf, l_buf, head_dim ** -0.5, k_cache.stride(0), k_cache.stride(1), max_len,
        **kw, num_warps=num_warps)
    attn_pv_kernel[(num_kv_heads, nsplit)](
        v_cache, pos, s_buf, m_buf, l_buf, acc_buf, v_cache.stride(0), v_cache.stride(1), max_len,
        **kw, num_warps=num_warps)
    block_d = min(64, head_dim)
    attn_combine_kernel[(num_heads, head_dim // block_d)](acc_buf, qkv, out, pos, **split, BLOCK=block, HD=head_dim,
                                                          BLOCK_D=block_d, **LAUNCH, num_warps=4)


def verify_scratch_sizes(m, num_heads, nsplit, max_seq_len, head_dim):
    """fp32 element counts of `attention_verify`'s scratch for up to m rows over caches of up to
    max_seq_len rows: {name: count}, the names its keyword arguments take (allocate once)."""
    rows = m * num_heads
    return {"m_buf": rows * nsplit, "l_buf": rows * nsplit, "acc_buf": rows * nsplit * head_dim,
            "s_buf": rows * max_seq_len}


def attention_verify(q, k_cache, v_cache, pos, qkv, out, m_buf, l_buf, acc_buf, s_buf, *, m, num_heads, num_kv_heads,
                     head_dim, start=None, nsplit, block=32, min_per=128, num_warps=4):
    """attention_decode for m tokens at positions pos..pos+m-1 (their K/V rows written by
    qk_rope_cache): query row j (q [m, H*HD], row stride) attends cache rows [start, pos + j]
    (start: device int64 [1], default 0); out [m, H*HD] (row stride) = that times sigmoid(gate of qkv
    row j). Each K/V row is read once for all m*G query rows of its kv head; the grid does not depend
    on pos. Scratch: `verify_scratch_sizes`."""
    g = num_heads // num_kv_heads
    max_len = k_cache.shape[1]
    assert s_buf.numel() >= m * num_heads * max_len and m_buf.numel() >= m * num_heads * nsplit
    assert acc_buf.numel() >= m * num_heads * nsplit * head_dim
    sq = q.stride(0) if q.dim() > 1 else 0
    sqkv = qkv.stride(0) if qkv.dim() > 1 else 0
    so = out.stride(0) if out.dim() > 1 else 0
    has_start = start is not None
    start = start if has_start else pos
    kw = dict(M=m, HAS_START=has_start, NSPLIT=nsplit, MIN_PER=min_per, H=num_heads, G=g,
              RP=max(16, triton.next_power_of_2(m * g)), HD=head_dim, BLOCK=block, DOT_F32=_INTERPRETED, **LAUNCH)
    attn_verify_scores_kernel[(num_kv_heads, nsplit)](
        q, k_cache, pos, start, s_buf, m_buf, l_buf, head_dim ** -0.5, sq, k_cache.stride(0), k_cache.stride(1),
        max_len, **kw, num_warps=num_warps)
    attn_verify_pv_kernel[(num_kv_heads, nsplit)](
        v_cache, pos, start, s_buf, m_buf, l_buf, acc_buf, v_cache.stride(0), v_cache.stride(1), max_len,
        **kw, num_warps=num_warps)
    block_d = min(64, head_dim)
    attn_verify_combine_kernel[(m * num_heads, head_dim // block_d)](
        acc_buf, qkv, out, pos, start, sqkv, so, M=m, HAS_START=has_start, NSPLIT=nsplit, MIN_PER=min_per,
        BLOCK=block, H=num_heads, HD=head_dim, BLOCK_D=block_d, **LAUNCH, num_warps=4)

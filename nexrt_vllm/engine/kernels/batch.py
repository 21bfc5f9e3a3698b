"""The batch step's kernels: B request slots in one step, each row of the step one slot (`--max-batch`).

Slot b's state is row b of stacked tensors ([B, ...], engine/state.py `StackedStates`), reached by a
slot stride; its position is pos[b] (int64 [B]); `live` (int32 [B]) says which slots step. The
projections are the M-row GEMVs of kernels/gemv_verify.py over the B rows (each weight tile read
once for all of them). The per-slot work runs the single-request step's kernels unchanged, one
grid axis more over the slots: a program of a slot that is not live does nothing, so such a slot's
state, position and token stay as they are and cost one load of its `live` word. Per slot the
arithmetic is the step's (the same kernels); the GEMVs differ from the one-row ones only in the
order of their fp32 sums.

- `gemv_rows_conv_kernel`: the GDN in_proj over the rows with the step's causal-conv epilogue per
  row over its slot's conv state (gemv_step `_epilogue` EPI 3), on the fold or the tensor-core path;
- `qk_rope_rows_kernel`, `attn_{scores,pv,combine}_rows_kernel`: kernels/attention.py's decode
  kernels per slot (its K/V cache, position, scratch rows);
- `gdn_step_rows_kernel`: kernels/gdn.py's step per slot (its recurrent state);
- the MoE experts: kernels/moe.py's M-row launches with `live` (the programs of slots that are not live
  idle; their experts are not read);
- `finish_rows_kernel`: per live slot the greedy token from the lm_head's per-row partials, its
  next input token and position, and (step << 32 | token) in its column of the control ring.
"""
import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.attention import (_qk_rope_head, attn_combine_kernel, attn_pv_kernel,
                                                 attn_scores_kernel)
from nexrt_vllm.engine.kernels.common import ASM, LAUNCH, pdl_begin
from nexrt_vllm.engine.kernels.common import bf16_round as _bf16
from nexrt_vllm.engine.kernels.common import silu as _silu
from nexrt_vllm.engine.kernels.gdn import gdn_step_kernel
from nexrt_vllm.engine.kernels.gemv import EPI_CONV, fp8_operands, head_blocks
from nexrt_vllm.engine.kernels.gemv_verify import _gemv_rows_w
from nexrt_vllm.engine.kernels.sampling import argmax_partials

MAX_ROWS = 8  # slots of one batch step (the M-row GEMVs keep the rows in registers)


@triton.jit
def _live(live_ptr, b):
    return tl.load(live_ptr + b) != 0


@triton.jit
def _slot(live_ptr, AXIS: tl.constexpr, PDL: tl.constexpr):
    """After the PDL wait: this program's slot (grid axis AXIS), as int64, and whether it steps."""
    pdl_begin(PDL)
    b = tl.program_id(AXIS)
    return b, b.to(tl.int64), _live(live_ptr, b)


@triton.jit
def _conv_rows(y, y_ptr, stride_y, conv_ptr, stride_cs, cw_ptr, live_ptr, jrow, jm, rows, rmask, CONV_N,
               KC: tl.constexpr, KCP: tl.constexpr):
    """gemv_step `_epilogue` EPI 3 for each row j (y [MP, BLOCK_N]) over slot j's conv state
    (conv_ptr + j * stride_cs, [CONV_N, KC-1] oldest first); the state of a slot that is not live is
    neither read nor written."""
    on = jm & (tl.load(live_ptr + jrow, mask=jm, other=0) != 0)
    yb = _bf16(y)
    cm = rmask & (rows < CONV_N)
    taps = tl.arange(0, KCP)
    tm = cm[:, None] & (taps[None, :] < KC - 1)
    sp = conv_ptr + jrow.to(tl.int64)[:, None, None] * stride_cs + rows[None, :, None] * (KC - 1) + taps[None, None, :]
    m3 = on[:, None, None] & tm[None, :, :]
    st = tl.load(sp, mask=m3, other=0.0).to(tl.float32)
    cw = tl.load(cw_ptr + rows[:, None] * KC + taps[None, :], mask=tm, other=0.0).to(tl.float32)
    cw_last = tl.load(cw_ptr + rows * KC + (KC - 1), mask=cm, other=0.0).to(tl.float32)
    conv = tl.sum(cw[None, :, :] * st, 2) + cw_last[None, :] * yb
    nxt = tl.load(sp + 1, mask=m3 & (taps[None, None, :] < KC - 2), other=0.0).to(tl.float32)
    nxt = tl.where(taps[None, None, :] == KC - 2, yb[:, :, None], nxt)
    # Threads share rows: every read of the old state must land before any write of the new one.
    tl.debug_barrier()
    tl.store(sp, nxt.to(conv_ptr.dtype.element_ty), mask=m3)
    out = tl.where(rows[None, :] < CONV_N, _bf16(_silu(_bf16(conv))), yb)
    tl.store(y_ptr + jrow[:, None] * stride_y + rows[None, :], out.to(y_ptr.dtype.element_ty),
             mask=jm[:, None] & rmask[None, :])


@triton.jit
def gemv_rows_conv_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, conv_ptr, cw_ptr, live_ptr, s_ptr, srow_ptr, t_ptr, N, K, N8,
                          stride_w, stride_s, stride_t, stride_x, stride_y, stride_cs, eps, CONV_N, M: tl.constexpr,
                          MP: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, KP: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr,
                          PRE: tl.constexpr, VEC: tl.constexpr, FP8: tl.constexpr, BKS: tl.constexpr,
                          UNIFORM: tl.constexpr, ROUND_W: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr):
    """The GDN in_proj of the M rows of x (RMSNorm prologue) with the causal conv per row (`_conv_rows`):
    DOT 0 `gemv_rows_kernel`'s fold (PRE K blocks of W loaded before the PDL wait), DOT 1 / 2
    `gemv_rows_dot_kernel`'s tensor-core loop (2: fp32 products, the interpreter); bf16 W or FP8 (e4m3 rows
    < N8 with block scales, TAIL: bf16 rows at t_ptr; gemv_verify `_gemv_rows_w`)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    jrow = tl.arange(0, MP)
    jm = jrow < M
    y, _ = _gemv_rows_w(x_ptr, w_ptr, s_ptr, srow_ptr, t_ptr, nw_ptr, nw_ptr, stride_x, 0, jrow, jm, rows, rmask, pid,
                        N, K, N8, stride_w, stride_s, stride_t, eps, 1, 0, 1, False, KP, BLOCK_N, BLOCK_K, EVEN_K, DOT,
                        PRE, VEC, PDL, 1, FP8, BKS, UNIFORM, ROUND_W, TAIL)
    _conv_rows(y, y_ptr, stride_y, conv_ptr, stride_cs, cw_ptr, live_ptr, jrow, jm, rows, rmask, CONV_N, KC, KCP)


@triton.jit
def qk_rope_rows_kernel(qkv_ptr, q_out_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, live_ptr, eps,
                        stride_ch, stride_cs, stride_kv, stride_qkv, stride_q, H: tl.constexpr, KVH: tl.constexpr,
                        HD: tl.constexpr, ROT: tl.constexpr, RESTP: tl.constexpr, HDP: tl.constexpr,
                        PDL: tl.constexpr):
    """`qk_rope_cache_kernel` per slot: grid (H + KVH, B), slot b's qkv row, q row, K/V cache (slot stride
    stride_kv) and position."""
    b, b64, live = _slot(live_ptr, 1, PDL)
    if live:
        _qk_rope_head(qkv_ptr + b * stride_qkv, q_out_ptr + b * stride_q, k_ptr + b64 * stride_kv,
                      v_ptr + b64 * stride_kv, qn_ptr, kn_ptr, cos_ptr, sin_ptr, tl.program_id(0),
                      tl.load(pos_ptr + b), eps, stride_ch, stride_cs, H, KVH, HD, ROT, RESTP, HDP)


@triton.jit
def attn_scores_rows_kernel(q_ptr, k_ptr, pos_ptr, live_ptr, s_ptr, m_ptr, l_ptr, scale, stride_ch, stride_cs, max_len,
                            stride_q, stride_kv, stride_s, stride_ml, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr,
                            G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr,
                            DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """`attn_scores_kernel` per slot: grid (KVH, NSPLIT, B), slot b's q row, K cache, position and scratch rows."""
    b, b64, live = _slot(live_ptr, 2, PDL)
    if live:
        attn_scores_kernel(q_ptr + b * stride_q, k_ptr + b64 * stride_kv, pos_ptr + b, s_ptr + b64 * stride_s,
                           m_ptr + b * stride_ml, l_ptr + b * stride_ml, scale, stride_ch, stride_cs, max_len, NSPLIT,
                           MIN_PER, G, GP, HD, BLOCK, DOT_F32, False)


@triton.jit
def attn_pv_rows_kernel(v_ptr, pos_ptr, live_ptr, s_ptr, m_ptr, l_ptr, acc_ptr, stride_ch, stride_cs, max_len,
                        stride_kv, stride_s, stride_ml, stride_acc, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr,
                        G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr,
                        DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """`attn_pv_kernel` per slot: grid (KVH, NSPLIT, B)."""
    b, b64, live = _slot(live_ptr, 2, PDL)
    if live:
        attn_pv_kernel(v_ptr + b64 * stride_kv, pos_ptr + b, s_ptr + b64 * stride_s, m_ptr + b * stride_ml,
                       l_ptr + b * stride_ml, acc_ptr + b64 * stride_acc, stride_ch, stride_cs, max_len, NSPLIT,
                       MIN_PER, G, GP, HD, BLOCK, DOT_F32, False)


@triton.jit
def attn_combine_rows_kernel(acc_ptr, qkv_ptr, out_ptr, pos_ptr, live_ptr, stride_acc, stride_qkv, stride_out,
                             NSPLIT: tl.constexpr, MIN_PER: tl.constexpr, BLOCK: tl.constexpr, HD: tl.constexpr,
                             BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """`attn_combine_kernel` per slot: grid (H, HD / BLOCK_D, B), slot b's gate (qkv row) and output row."""
    b, b64, live = _slot(live_ptr, 2, PDL)
    if live:
        attn_combine_kernel(acc_ptr + b64 * stride_acc, qkv_ptr + b * stride_qkv, out_ptr + b * stride_out,
                            pos_ptr + b, NSPLIT, MIN_PER, BLOCK, HD, BLOCK_D, False)


@triton.jit
def gdn_step_rows_kernel(buf_ptr, state_ptr, out_ptr, a_log_ptr, dt_bias_ptr, live_ptr, KEY_DIM, VALUE_DIM, OFF_B,
                         OFF_A, q_scale, stride_buf, stride_rec, stride_out, HV: tl.constexpr, HK: tl.constexpr,
                         DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, PRE: tl.constexpr,
                         PDL: tl.constexpr):
    """`gdn_step_kernel` per slot: grid (HV, DV / BLOCK_V, B), slot b's [q|k|v|z|b|a] row, recurrent state
    (slot stride stride_rec) and output row. PRE: the live word and the state slice are read before
    the PDL wait (both written only before this replay or by this kernel's previous step)."""
    b = tl.program_id(2)
    if PRE:
        if _live(live_ptr, b):
            gdn_step_kernel(buf_ptr + b * stride_buf, state_ptr + b.to(tl.int64) * stride_rec, out_ptr + b * stride_out,
                            a_log_ptr, dt_bias_ptr, KEY_DIM, VALUE_DIM, OFF_B, OFF_A, q_scale, HV, HK, DK, DV, BLOCK_V,
                            True, PDL)
    else:
        pdl_begin(PDL)
        if _live(live_ptr, b):
            gdn_step_kernel(buf_ptr + b * stride_buf, state_ptr + b.to(tl.int64) * stride_rec, out_ptr + b * stride_out,
                            a_log_ptr, dt_bias_ptr, KEY_DIM, VALUE_DIM, OFF_B, OFF_A, q_scale, HV, HK, DK, DV, BLOCK_V,
                            False, False)


@triton.jit
def finish_rows_kernel(pmax_ptr, pidx_ptr, NP, stride_p, live_ptr, tok_ptr, pos_ptr, step_ptr, ring_ptr, RING,
                       RING_B, B: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program: per live slot b < B the greedy token of row b (its NP (max, argmax) partials at row
    stride stride_p; ties -> lowest id), stored as b's next input token, pos[b] + 1, and (step << 32 |
    token) in ring [RING, RING_B] at ((step - 1) % RING, b), one 8-byte store; then the step counter + 1."""
    pdl_begin(PDL)
    step = tl.load(step_ptr) + 1
    for b in tl.static_range(B):
        if _live(live_ptr, b):
            tok = argmax_partials(pmax_ptr + b * stride_p, pidx_ptr + b * stride_p, NP, BLOCK)
            tl.store(tok_ptr + b, tok.to(tok_ptr.dtype.element_ty))
            tl.store(pos_ptr + b, tl.load(pos_ptr + b) + 1)
            tl.store(ring_ptr + ((step - 1) % RING) * RING_B + b, (step.to(tl.int64) << 32) | tok.to(tl.int64))
    tl.store(step_ptr, step)


# ---- launchers ------------------------------------------------------------------------------------

def _rows(t) -> int:
    return t.stride(0)


def gemv_rows_conv(x, w, y, norm_w, conv, conv_w, live, *, eps, conv_n, kc, block_n, block_k, num_warps, dot=0,
                   prefetch=0, round_w=False):
    """y [B, N] = the GDN in_proj of RMSNorm(x [B, K]) (w [N, K] bf16 or an fp8.FP8Weight), then per row b the
    causal conv + SiLU on its first conv_n outputs over slot b's conv state conv[b] ([B, conv_n, kc-1], updated
    in place where live[b]). `dot` > 0: the tensor-core loop with `dot` pipeline stages; else the fold
    with `prefetch` K blocks before the PDL wait (bf16 W; `round_w`: an FP8 W's, as gemv.gemv's)."""
    m, k, n = x.shape[0], w.shape[1], w.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv_rows_conv: 1..{MAX_ROWS} rows, got {m}")
    if conv.dim() != 3 or conv.shape[0] < m or conv[0].stride() != (kc - 1, 1):
        raise ValueError(f"gemv_rows_conv: conv state must be [>= {m}, {conv_n}, {kc - 1}] per slot contiguous")
    block_k = min(block_k, triton.next_power_of_2(k))
    if dot and (block_n < 16 or block_k < 16):
        raise ValueError(f"gemv_rows_conv: the tensor-core loop needs block_n and block_k >= 16 (got {block_n}, "
                         f"{block_k})")
    grid = (triton.cdiv(n, block_n),)
    common = dict(M=m, MP=triton.next_power_of_2(m), KC=kc, KCP=triton.next_power_of_2(max(kc - 1, 1)),
                  KP=triton.next_power_of_2(k), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, **LAUNCH,
                  num_warps=num_warps)
    if hasattr(w, "scale") and prefetch:
        raise ValueError("gemv_rows_conv: prefetch is for bf16 weights (got an FP8Weight)")
    args = dict(x_ptr=x, y_ptr=y, nw_ptr=norm_w, conv_ptr=conv, cw_ptr=conv_w, live_ptr=live, N=n, K=k,
                stride_x=_rows(x), stride_y=_rows(y), stride_cs=conv.stride(0), eps=eps, CONV_N=conv_n,
                ROUND_W=round_w, **fp8_operands(w, EPI_CONV, n, block_n, y))
    if dot:
        gemv_rows_conv_kernel[grid](**args, DOT=1 if ASM else 2, PRE=0, VEC=1, num_stages=dot, **common)
    else:
        gemv_rows_conv_kernel[grid](**args, DOT=0, PRE=head_blocks(min(prefetch, 4), k, block_k), VEC=min(8, block_k),
                                    **common)


def qk_rope_rows(qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos, sin, pos, live, *, num_heads, num_kv_heads,
                 head_dim, rotary_dim, eps):
    """`attention.qk_rope_cache` per live slot: qkv [B, .] and q_out [B, H*HD] rows, k_cache / v_cache
    [B, KVH, max_seq_len, HD], slot b's row pos[b]."""
    qk_rope_rows_kernel[(num_heads + num_kv_heads, pos.numel())](
        qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos, sin, pos, live, eps, k_cache.stride(1),
        k_cache.stride(2), k_cache.stride(0), _rows(qkv), _rows(q_out), H=num_heads, KVH=num_kv_heads, HD=head_dim,
        ROT=rotary_dim, RESTP=triton.next_power_of_2(head_dim - rotary_dim), HDP=triton.next_power_of_2(head_dim),
        **LAUNCH, num_warps=2)


def attention_rows(q, k_cache, v_cache, pos, live, qkv, out, m_buf, l_buf, acc_buf, s_buf, *, num_heads, num_kv_heads,
                   head_dim, nsplit, block=32, min_per=128, num_warps=4):
    """`attention.attention_decode` per live slot: q [B, H*HD], qkv, out rows; k_cache / v_cache
    [B, KVH, max_seq_len, HD]; scratch rows m_buf / l_buf [B, H*nsplit], acc_buf [B, H*nsplit*HD],
    s_buf [B, H*max_seq_len] (fp32)."""
    g = num_heads // num_kv_heads
    n, max_len = pos.numel(), k_cache.shape[2]
    assert s_buf.shape[1] >= num_heads * max_len and m_buf.shape[1] >= num_heads * nsplit
    assert acc_buf.shape[1] >= num_heads * nsplit * head_dim and m_buf.stride(0) == l_buf.stride(0)
    split = dict(NSPLIT=nsplit, MIN_PER=min_per)
    kw = dict(split, G=g, GP=max(16, triton.next_power_of_2(g)), HD=head_dim, BLOCK=block, DOT_F32=not ASM, **LAUNCH)
    attn_scores_rows_kernel[(num_kv_heads, nsplit, n)](
        q, k_cache, pos, live, s_buf, m_buf, l_buf, head_dim ** -0.5, k_cache.stride(1), k_cache.stride(2), max_len,
        _rows(q), k_cache.stride(0), _rows(s_buf), _rows(m_buf), **kw, num_warps=num_warps)
    attn_pv_rows_kernel[(num_kv_heads, nsplit, n)](
        v_cache, pos, live, s_buf, m_buf, l_buf, acc_buf, v_cache.stride(1), v_cache.stride(2), max_len,
        v_cache.stride(0), _rows(s_buf), _rows(m_buf), _rows(acc_buf), **kw, num_warps=num_warps)
    block_d = min(64, head_dim)
    attn_combine_rows_kernel[(num_heads, head_dim // block_d, n)](
        acc_buf, qkv, out, pos, live, _rows(acc_buf), _rows(qkv), _rows(out), **split, BLOCK=block, HD=head_dim,
        BLOCK_D=block_d, **LAUNCH, num_warps=4)


def gdn_step_rows(buf, state, out, a_log, dt_bias, live, *, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                  block_v=32, num_warps=4, prefetch=False):
    """`gdn.gdn_step` per live slot: buf [B, width] and out [B, value_dim] rows, state [B, HV, dk, dv] fp32."""
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    off_b = 2 * key_dim + 2 * value_dim
    block_v = min(block_v, head_v_dim)
    assert state[0].is_contiguous()
    gdn_step_rows_kernel[(num_v_heads, head_v_dim // block_v, live.numel())](
        buf, state, out, a_log, dt_bias, live, key_dim, value_dim, off_b, off_b + num_v_heads, float(head_k_dim) ** 0.5,
        _rows(buf), state.stride(0), _rows(out), HV=num_v_heads, HK=num_k_heads, DK=head_k_dim, DV=head_v_dim,
        BLOCK_V=block_v, PRE=bool(prefetch), **LAUNCH, num_warps=num_warps)


def finish_rows(pmax, pidx, n_partials, live, tok, pos, step, ring):
    """`finish_rows_kernel`: pmax / pidx [B, >= n_partials] (one row stride), ring [RING, >= B] int64 (a
    column per slot of the node; these B slots are its first)."""
    b = tok.numel()
    if ring.dim() != 2 or ring.shape[1] < b or not ring.is_contiguous():
        raise ValueError(f"finish_rows: the ring must be [RING, >= {b}] contiguous, got {tuple(ring.shape)}")
    block = min(max(triton.next_power_of_2(n_partials), 128), 16384)
    finish_rows_kernel[(1,)](pmax, pidx, n_partials, _rows(pmax), live, tok, pos, step, ring, ring.shape[0],
                             ring.shape[1], B=b, BLOCK=block, **LAUNCH, num_warps=8 if block >= 4096 else 4)

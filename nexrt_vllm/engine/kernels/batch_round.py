"""The batched speculative round's per-slot kernels: the verify pass of B request slots, M positions each.

Rows of the round are slot-major: row b * M + j is slot b's position pos[b] + j. The projections
are the M-row GEMVs over all B * M rows (each weight tile read once for all of them); the work of
one slot runs the one-request round's kernel bodies unchanged (kernels/attention.py verify,
kernels/gdn.py verify, kernels/gemv_verify.py's conv epilogue) with one grid axis more over the
slots, each program reaching its slot's rows, state and scratch by strides. A slot whose `live`
word is 0 costs one load of it: its state, cache and scratch are not touched.

A slot within M positions of its context's end still runs the round: its K/V rows past the end
are not written (`qk_rope_rows`), its queries past the end attend to junk they never emit (the
accept clamps what the round emits to the context, kernels/spec.py), so such rows read up to M
rows past the slot's cache: the cache allocation carries that many rows of slack at its end
(engine/state.py `StackedStates(pad_rows=...)`), and the scores scratch rows are as long as the
cache plus M (`verify_rows_scratch`).

- `gemv_conv_slots_kernel`: the GDN in_proj of all rows (RMSNorm prologue), then per live slot the
  verify's causal conv over its M rows from its conv state into its window (gemv_verify
  `_epilogue_rows` EPI 3, the rows read back after the projection stored them);
- `gdn_verify_rows_kernel`: kernels/gdn.py `gdn_verify_kernel` per slot;
- `qk_rope_rows_kernel`, `attn_verify_{scores,pv,combine}_rows_kernel`: kernels/attention.py's
  verify kernels per slot (its cache, position, first valid row, scratch rows).
"""
import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.attention import (_INTERPRETED, _qk_rope_head, attn_verify_combine_kernel,
                                                 attn_verify_pv_kernel, attn_verify_scores_kernel)
from nexrt_vllm.engine.kernels.batch import _slot
from nexrt_vllm.engine.kernels.common import ASM, LAUNCH
from nexrt_vllm.engine.kernels.common import bf16_round as _bf16
from nexrt_vllm.engine.kernels.common import silu as _silu
from nexrt_vllm.engine.kernels.gdn import gdn_verify_kernel
from nexrt_vllm.engine.kernels.gemv import EPI_CONV, fp8_operands
from nexrt_vllm.engine.kernels.gemv_verify import _epilogue_rows, _gemv_rows_w

MAX_ROWS = 32  # rows of one launch (B * M): the tensor-core M-row GEMV's column tile


@triton.jit
def gemv_conv_slots_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, conv_ptr, cw_ptr, win_ptr, live_ptr, s_ptr, srow_ptr, t_ptr,
                           N, K, N8, stride_w, stride_s, stride_t, stride_x, stride_y, stride_cs, stride_ws, stride_win,
                           eps, CONV_N, B, R: tl.constexpr, RP: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                           KC: tl.constexpr, KCP: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr, ALL_SLOTS: tl.constexpr,
                           PRO: tl.constexpr, FP8: tl.constexpr, BKS: tl.constexpr, UNIFORM: tl.constexpr,
                           ROUND_W: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr):
    """y [R, N] = W RMSNorm(x_r) (PRO 1; PRO 0: x already normed, gemv.rmsnorm_rows) for the R = B * M rows
    (tensor-core loop, DOT 1; 2: fp32 products, the interpreter; W bf16 or FP8 as gemv_verify `_gemv_rows_w`
    reads it); then for each live slot b the conv epilogue
    of its rows b*M .. b*M+M-1 over its conv state (conv_ptr + b * stride_cs, read only) and window
    (win_ptr + b * stride_ws, [CONV_N, KC-1+M]):
    one slot after the other (`_epilogue_rows`), or with ALL_SLOTS every row at once (`_conv_all_slots`)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    jr = tl.arange(0, RP)
    y, _ = _gemv_rows_w(x_ptr, w_ptr, s_ptr, srow_ptr, t_ptr, nw_ptr, nw_ptr, stride_x, 0, jr, jr < R, rows, rmask, pid,
                        N, K, N8, stride_w, stride_s, stride_t, eps, PRO, 0, 1, False, KP, BLOCK_N, BLOCK_K, EVEN_K,
                        DOT, 0, 1, PDL, 1, FP8, BKS, UNIFORM, ROUND_W, TAIL)
    tl.store(y_ptr + jr[:, None] * stride_y + rows[None, :], _bf16(y).to(y_ptr.dtype.element_ty),
             mask=(jr < R)[:, None] & rmask[None, :])
    if pid * BLOCK_N < CONV_N:  # programs past the conv channels are done
        tl.debug_barrier()  # the rows this program stored, read back below by other threads of it
        if ALL_SLOTS:
            _conv_all_slots(y_ptr, conv_ptr, cw_ptr, win_ptr, live_ptr, stride_y, stride_cs, stride_ws, stride_win,
                            jr, R, rows, rmask, CONV_N, M, MP, KC, KCP)
        else:
            _conv_each_slot(y_ptr, conv_ptr, cw_ptr, win_ptr, live_ptr, stride_y, stride_cs, stride_ws, stride_win,
                            rows, rmask, pid, CONV_N, B, M, MP, KC, KCP)


@triton.jit
def _conv_each_slot(y_ptr, conv_ptr, cw_ptr, win_ptr, live_ptr, stride_y, stride_cs, stride_ws, stride_win, rows,
                    rmask, pid, CONV_N, B, M: tl.constexpr, MP: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr):
    """The conv epilogue slot by slot: the one-request round's (`_epilogue_rows` EPI 3) over slot b's rows."""
    j = tl.arange(0, MP)
    jm = j < M
    for b in range(B):
        if tl.load(live_ptr + b) != 0:
            ys = tl.load(y_ptr + (b * M + j)[:, None] * stride_y + rows[None, :], mask=jm[:, None] & rmask[None, :],
                         other=0.0).to(tl.float32)
            tl.debug_barrier()  # the epilogue stores over these rows: every thread's load first
            _epilogue_rows(ys, ys, y_ptr + b * M * stride_y, stride_y, conv_ptr + b * stride_cs, cw_ptr, 0,
                           win_ptr + b * stride_ws, stride_win, j, jm, rows, rmask, pid, CONV_N, 3, KC, KCP)


@triton.jit
def _conv_all_slots(y_ptr, conv_ptr, cw_ptr, win_ptr, live_ptr, stride_y, stride_cs, stride_ws, stride_win, jr, R,
                    rows, rmask, CONV_N, M: tl.constexpr, MP: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr):
    """`_conv_each_slot` over all rows at once, row r = b*M + j (slot b, position j): the same products and
    sums (state taps over the last axis, the slot's new inputs over the middle one), without B dependent
    rounds of loads, barriers and stores per program (the 32-row round spent most of its in_proj there)."""
    b = jr // M
    j = jr - b * M
    lv = (jr < R) & (tl.load(live_ptr + b, mask=jr < R, other=0) != 0)
    cm = rmask & (rows < CONV_N)
    m2 = lv[:, None] & cm[None, :]  # [RP, BLOCK_N]: live rows' conv channels
    yb = tl.load(y_ptr + jr[:, None] * stride_y + rows[None, :], mask=m2, other=0.0).to(tl.float32)
    # the state taps: token j reads state column j + t for j + t < KC-1
    b3 = b[:, None, None]
    j3 = j[:, None, None]
    r3 = rows[None, :, None]
    t3 = tl.arange(0, KCP)[None, None, :]
    tm = m2[:, :, None] & (t3 < KC - 1)
    st = tl.load(conv_ptr + b3 * stride_cs + r3 * (KC - 1) + t3, mask=tm, other=0.0)
    sm = m2[:, :, None] & (j3 + t3 < KC - 1)
    sj = tl.load(conv_ptr + b3 * stride_cs + r3 * (KC - 1) + j3 + t3, mask=sm, other=0.0).to(tl.float32)
    cw = tl.load(cw_ptr + r3 * KC + t3, mask=sm, other=0.0).to(tl.float32)
    conv = tl.sum(tl.where(sm, cw * sj, 0.0), 2)  # [RP, BLOCK_N]
    # the slot's new inputs: weight tap KC-1-(j-i) on its row i, 0 <= j-i <= KC-1
    i3 = tl.arange(0, MP)[None, :, None]
    d = j3 - i3  # [RP, MP, 1]
    rr = rows[None, None, :]
    ym = (d >= 0) & (d <= KC - 1) & (i3 < M) & m2[:, None, :]
    yi = tl.load(y_ptr + (b3 * M + i3) * stride_y + rr, mask=ym, other=0.0).to(tl.float32)
    cy = tl.load(cw_ptr + rr * KC + (KC - 1) - d, mask=ym, other=0.0).to(tl.float32)
    conv += tl.sum(tl.where(ym, cy * yi, 0.0), 1)
    # the windows: each slot's live state (from its row 0), then its rows' inputs
    tl.store(win_ptr + b3 * stride_ws + r3 * stride_win + t3, st, mask=tm & (j3 == 0))
    tl.store(win_ptr + b[:, None] * stride_ws + rows[None, :] * stride_win + (KC - 1) + j[:, None],
             _bf16(yb).to(win_ptr.dtype.element_ty), mask=m2)
    tl.debug_barrier()  # the stores below overwrite rows other threads loaded above
    tl.store(y_ptr + jr[:, None] * stride_y + rows[None, :],
             _bf16(_silu(_bf16(conv))).to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def gdn_verify_rows_kernel(buf_ptr, state_ptr, rec_ptr, out_ptr, a_log_ptr, dt_bias_ptr, live_ptr, KEY_DIM, VALUE_DIM,
                           OFF_B, OFF_A, q_scale, stride_buf, stride_rec, stride_out, slot_state, slot_rec,
                           M: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           BLOCK_V: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr):
    """`gdn_verify_kernel` per slot: grid (HV, DV / BLOCK_V, B), slot b's M rows of [q|k|v|z|b|a] and of the
    output, its live recurrent state (read only) and (STORE) its states after each position."""
    b, b64, live = _slot(live_ptr, 2, PDL)
    if live:
        gdn_verify_kernel(buf_ptr + b * M * stride_buf, state_ptr + b64 * slot_state, rec_ptr + b64 * slot_rec,
                          out_ptr + b * M * stride_out, a_log_ptr, dt_bias_ptr, KEY_DIM, VALUE_DIM, OFF_B, OFF_A,
                          q_scale, stride_buf, stride_rec, stride_out, M, HV, HK, DK, DV, BLOCK_V, False, STORE,
                          False)


@triton.jit
def qk_rope_rows_kernel(qkv_ptr, q_out_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, live_ptr, eps,
                        stride_ch, stride_cs, stride_kv, stride_qkv, stride_q, rows, M: tl.constexpr,
                        H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr, RESTP: tl.constexpr,
                        HDP: tl.constexpr, PDL: tl.constexpr):
    """`qk_rope_cache_m_kernel` per slot: grid (H + KVH, M, B), slot b's row j at position pos[b] + j into
    its cache (slot stride stride_kv), unless that position is past the cache's `rows`."""
    b, b64, live = _slot(live_ptr, 2, PDL)
    j = tl.program_id(1)
    p = tl.load(pos_ptr + b) + j
    if live & (p < rows):
        r = b * M + j
        _qk_rope_head(qkv_ptr + r * stride_qkv, q_out_ptr + r * stride_q, k_ptr + b64 * stride_kv,
                      v_ptr + b64 * stride_kv, qn_ptr, kn_ptr, cos_ptr, sin_ptr, tl.program_id(0), p, eps, stride_ch,
                      stride_cs, H, KVH, HD, ROT, RESTP, HDP)


@triton.jit
def attn_verify_scores_rows_kernel(q_ptr, k_ptr, pos_ptr, start_ptr, live_ptr, s_ptr, m_ptr, l_ptr, scale, stride_q,
                                   stride_ch, stride_cs, stride_kv, max_len, slot_s, slot_ml, M: tl.constexpr,
                                   HAS_START: tl.constexpr, NSPLIT: tl.constexpr, MIN_PER: tl.constexpr,
                                   H: tl.constexpr, G: tl.constexpr, RP: tl.constexpr, HD: tl.constexpr,
                                   BLOCK: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    """`attn_verify_scores_kernel` per slot: grid (KVH, NSPLIT, B)."""
    b, b64, live = _slot(live_ptr, 2, PDL)
    if live:
        attn_verify_scores_kernel(q_ptr + b * M * stride_q, k_ptr + b64 * stride_kv, pos_ptr + b, start_ptr + b,
                                  s_ptr + b64 * slot_s, m_ptr + b64 * slot_ml, l_ptr + b64 * slot_ml, scale, stride_q,
                                  stride_ch, stride_cs, max_len, M, HAS_START, NSPLIT, MIN_PER, H, G, RP, HD, BLOCK,
                                  DOT_F32, False)


@triton.jit
def attn_verify_pv_rows_kernel(v_ptr, pos_ptr, start_ptr, live_ptr, s_ptr, m_ptr, l_ptr, acc_ptr, stride_ch, stride_cs,
                               stride_kv, max_len, slot_s, slot_ml, slot_acc, M: tl.constexpr, HAS_START: tl.constexpr,
                               NSPLIT: tl.constexpr, MIN_PER: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                               RP: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr, DOT_F32: tl.constexpr,
                               PDL: tl.constexpr):
    """`attn_verify_pv_kernel` per slot: grid (KVH, NSPLIT, B)."""
    b, b64, live = _slot(live_ptr, 2, PDL)
    if live:
        attn_verify_pv_kernel(v_ptr + b64 * stride_kv, pos_ptr + b, start_ptr + b, s_ptr + b64 * slot_s,
                              m_ptr + b64 * slot_ml, l_ptr + b64 * slot_ml, acc_ptr + b64 * slot_acc, stride_ch,
                              stride_cs, max_len, M, HAS_START, NSPLIT, MIN_PER, H, G, RP, HD, BLOCK, DOT_F32, False)


@triton.jit
def attn_verify_combine_rows_kernel(acc_ptr, qkv_ptr, out_ptr, pos_ptr, start_ptr, live_ptr, stride_qkv, stride_out,
                                    slot_acc, M: tl.constexpr, HAS_START: tl.constexpr, NSPLIT: tl.constexpr,
                                    MIN_PER: tl.constexpr, BLOCK: tl.constexpr, H: tl.constexpr, HD: tl.constexpr,
                                    BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """`attn_verify_combine_kernel` per slot: grid (M * H, HD / BLOCK_D, B)."""
    b, b64, live = _slot(live_ptr, 2, PDL)
    if live:
        attn_verify_combine_kernel(acc_ptr + b64 * slot_acc, qkv_ptr + b * M * stride_qkv, out_ptr + b * M * stride_out,
                                   pos_ptr + b, start_ptr + b, stride_qkv, stride_out, M, HAS_START, NSPLIT, MIN_PER,
                                   BLOCK, H, HD, BLOCK_D, False)


# ---- launchers ------------------------------------------------------------------------------------

def gemv_conv_slots(x, w, y, norm_w, conv, conv_w, window, live, *, m, eps, conv_n, kc, block_n, block_k, num_warps,
                    stages=2, all_slots=False, normed=False, round_w=False):
    """y [B*m, N] = the GDN in_proj of RMSNorm(x [B*m, K]) (w [N, K] bf16 or an fp8.FP8Weight), then per live
    slot b the verify's causal conv + SiLU on its m rows' first conv_n outputs from its conv state conv[b]
    ([B, conv_n, kc-1], read only) into its window window[b] ([B, conv_n, kc-1+m]: the state, then the m new
    inputs);
    `all_slots`: every slot's rows in one pass (Tuning.conv_all_slots); `normed`: x is RMSNorm(x) already
    (gemv.rmsnorm_rows; norm_w unused); `round_w`: an FP8 W's, as gemv.gemv's."""
    r, k, n, nb = x.shape[0], w.shape[1], w.shape[0], live.numel()
    if r != nb * m or not 1 <= r <= MAX_ROWS:
        raise ValueError(f"gemv_conv_slots: {nb} slots x {m} rows = {r} rows, at most {MAX_ROWS}")
    if conv.dim() != 3 or conv[0].stride() != (kc - 1, 1) or window.dim() != 3 or window.shape[2] < kc - 1 + m \
            or window.stride(2) != 1:
        raise ValueError(f"gemv_conv_slots: conv [B, {conv_n}, {kc - 1}] and window [B, {conv_n}, >= {kc - 1 + m}] "
                         "per slot, unit column stride")
    block_k = min(block_k, triton.next_power_of_2(k))
    if block_n < 16 or block_k < 16:
        raise ValueError(f"gemv_conv_slots: the tensor-core loop needs block_n and block_k >= 16 (got {block_n}, "
                         f"{block_k})")
    gemv_conv_slots_kernel[(triton.cdiv(n, block_n),)](
        x_ptr=x, y_ptr=y, nw_ptr=norm_w, conv_ptr=conv, cw_ptr=conv_w, win_ptr=window, live_ptr=live, N=n, K=k,
        stride_x=x.stride(0), stride_y=y.stride(0), stride_cs=conv.stride(0), stride_ws=window.stride(0),
        stride_win=window.stride(1), eps=eps, CONV_N=conv_n, B=nb, ROUND_W=round_w,
        **fp8_operands(w, EPI_CONV, n, block_n, y),
        R=r, RP=max(16, triton.next_power_of_2(r)), M=m,
        MP=triton.next_power_of_2(m), KC=kc, KCP=triton.next_power_of_2(max(kc - 1, 1)), KP=triton.next_power_of_2(k),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, DOT=1 if ASM else 2, ALL_SLOTS=all_slots,
        PRO=0 if normed else 1, **LAUNCH,
        num_warps=num_warps, num_stages=stages)


def gdn_verify_rows(buf, state, rec_after, out, a_log, dt_bias, live, *, m, num_k_heads, num_v_heads, head_k_dim,
                    head_v_dim, block_v=32, num_warps=4):
    """`gdn.gdn_verify_step` per live slot: buf [B*m, width] and out [B*m, value_dim] rows (slot-major), state
    [B, HV, dk, dv] fp32 (read only), rec_after [B, >= m, HV, dk, dv] fp32 (the state after each position;
    None: not kept, `gdn.Recommit` then recomputes the accepted one)."""
    key_dim = num_k_heads * head_k_dim
    off_b = 2 * key_dim + 2 * num_v_heads * head_v_dim
    block_v = min(block_v, head_v_dim)
    store = rec_after is not None
    assert state[0].is_contiguous() and (not store or (rec_after[0, 0].is_contiguous() and rec_after.shape[1] >= m))
    gdn_verify_rows_kernel[(num_v_heads, head_v_dim // block_v, live.numel())](
        buf, state, rec_after if store else state, out, a_log, dt_bias, live, key_dim, num_v_heads * head_v_dim,
        off_b, off_b + num_v_heads, float(head_k_dim) ** 0.5, buf.stride(0), rec_after.stride(1) if store else 0,
        out.stride(0), state.stride(0), rec_after.stride(0) if store else 0, M=m, HV=num_v_heads, HK=num_k_heads,
        DK=head_k_dim, DV=head_v_dim, BLOCK_V=block_v, STORE=store, **LAUNCH, num_warps=num_warps)


def qk_rope_rows(qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos, sin, pos, live, *, m, num_heads, num_kv_heads,
                 head_dim, rotary_dim, eps):
    """`attention.qk_rope_cache(m=m)` per live slot: qkv [B*m, .] and q_out [B*m, H*HD] rows (slot-major),
    k_cache / v_cache [B, KVH, rows, HD]: slot b's row j at position pos[b] + j, its K/V written where
    that position is < rows; cos / sin cover every position up to rows + m - 1."""
    qk_rope_rows_kernel[(num_heads + num_kv_heads, m, live.numel())](
        qkv, q_out, k_cache, v_cache, q_norm_w, k_norm_w, cos, sin, pos, live, eps, k_cache.stride(1),
        k_cache.stride(2), k_cache.stride(0), qkv.stride(0), q_out.stride(0), k_cache.shape[2], M=m, H=num_heads,
        KVH=num_kv_heads, HD=head_dim, ROT=rotary_dim, RESTP=triton.next_power_of_2(head_dim - rotary_dim),
        HDP=triton.next_power_of_2(head_dim), **LAUNCH, num_warps=2)


def verify_rows_scratch(slots, m, num_heads, nsplit, rows, head_dim):
    """fp32 shapes of `attention_verify_rows`' scratch for `slots` slots of up to m rows over caches of up
    to `rows` rows: {name: [slots, count]} (allocate once). A score row is rows + m long (junk rows
    past a cache's end)."""
    r = m * num_heads
    return {"m_buf": (slots, r * nsplit), "l_buf": (slots, r * nsplit), "acc_buf": (slots, r * nsplit * head_dim),
            "s_buf": (slots, r * (rows + m))}


def attention_verify_rows(q, k_cache, v_cache, pos, live, qkv, out, m_buf, l_buf, acc_buf, s_buf, *, m, num_heads,
                          num_kv_heads, head_dim, start=None, nsplit, block=32, min_per=128, num_warps=4):
    """`attention.attention_verify` per live slot: slot b's m query rows (q, qkv, out [B*m, .], slot-major)
    at positions pos[b] .. pos[b]+m-1 attend to its cache rows [start[b], pos[b] + j] (start: int64 [B],
    default 0); k_cache / v_cache [B, KVH, rows, HD]; scratch `verify_rows_scratch` ([B, .] each)."""
    g, rows = num_heads // num_kv_heads, k_cache.shape[2]
    max_len = s_buf.shape[1] // (m * num_heads)  # a score row's length (the scratch's, >= rows + m)
    assert max_len >= rows + m and m_buf.shape[1] >= m * num_heads * nsplit and m_buf.stride(0) == l_buf.stride(0)
    assert acc_buf.shape[1] >= m * num_heads * nsplit * head_dim
    has_start = start is not None
    start = start if has_start else pos
    n = live.numel()
    kw = dict(M=m, HAS_START=has_start, NSPLIT=nsplit, MIN_PER=min_per, H=num_heads, G=g,
              RP=max(16, triton.next_power_of_2(m * g)), HD=head_dim, BLOCK=block, DOT_F32=_INTERPRETED, **LAUNCH)
    attn_verify_scores_rows_kernel[(num_kv_heads, nsplit, n)](
        q, k_cache, pos, start, live, s_buf, m_buf, l_buf, head_dim ** -0.5, q.stride(0), k_cache.stride(1),
        k_cache.stride(2), k_cache.stride(0), max_len, s_buf.stride(0), m_buf.stride(0), **kw, num_warps=num_warps)
    attn_verify_pv_rows_kernel[(num_kv_heads, nsplit, n)](
        v_cache, pos, start, live, s_buf, m_buf, l_buf, acc_buf, v_cache.stride(1), v_cache.stride(2),
        v_cache.stride(0), max_len, s_buf.stride(0), m_buf.stride(0), acc_buf.stride(0), **kw, num_warps=num_warps)
    block_d = min(64, head_dim)
    attn_verify_combine_rows_kernel[(m * num_heads, head_dim // block_d, n)](
        acc_buf, qkv, out, pos, start, live, qkv.stride(0), out.stride(0), acc_buf.stride(0), M=m, HAS_START=has_start,
        NSPLIT=nsplit, MIN_PER=min_per, BLOCK=block, H=num_heads, HD=head_dim, BLOCK_D=block_d, **LAUNCH, num_warps=4)

"""Batch-1 matrix-vector product y = W x with fused prologues and epilogues.

At batch 1 a projection is a weight stream: every weight byte is read once and the vector x (a few
KiB) is re-read from L2 by each program. Fusing the norm that produces x into the prologue and the
residual add / activation / causal conv that consumes y into the epilogue removes the separate norm,
add and activation launches (each of which costs more launch gap than it moves bytes).

Prologues (PRO): 0 plain x; 1 zero-centred RMSNorm `x·rsqrt(mean x²+eps)·(1+w)` over all of K;
2 gated RMSNorm per head of GROUP elements `w·rms(x)·SiLU(z)` (GDN output norm; BLOCK_K a multiple
of GROUP).
Epilogues (EPI): 0 store y; 1 residual add `y_ptr += y`; 2 SwiGLU over W = [gate; up] (N rows each);
3 causal depthwise conv + SiLU on rows < CONV_N (GDN in_proj: updates the conv state in place),
4 store fp32 logits plus a per-program (max, argmax) pair for the sampler. With `xn_out`, program 0
also stores the normed input (PRO 1) for a later launch (the MoE experts).

FP8 (`gemv_fp8_kernel`, chosen by `gemv` for an fp8.FP8Weight): the weight stays e4m3 and is read in
the bf16 kernel's [BLOCK_N, BLOCK_K] tiles; each column's block scale (one per 128 x 128 block,
gathered from L1) multiplies the (bf16-valued) input, so the weight stream is one byte per element;
accumulation in fp32 as in bf16. Rows after the fp8 ones may be bf16 (a fused projection whose last
parts the checkpoint keeps in bf16); those programs run the bf16 loop.

M rows (`gemv_rows_kernel`, `gemv(..., m=M)`, M <= 4: the MTP verify pass, tokens pos..pos+M-1): each
bf16 weight tile is loaded once and multiplied by every row of x, so a verify streams W's bytes once
for all M rows. Same prologues and epilogues per row; the conv epilogue runs the M tokens in order
from the live conv state without writing it, into a window the commit picks the new state from.
`gemv_rows_dot_kernel` does the same on the tensor cores, the weight tile as the left operand of the
product (the compiler then streams it through shared memory in pipeline stages).
"""
import torch
import triton
import triton.language as tl

from .common import ASM, LAUNCH, l2_prefetch, pdl_begin
from .common import bf16_round as _bf16
from .common import silu as _silu

PRO_NONE, PRO_RMSNORM, PRO_GATED = 0, 1, 2
EPI_STORE, EPI_RESIDUAL, EPI_SWIGLU, EPI_CONV, EPI_ARGMAX = 0, 1, 2, 3, 4


@triton.jit
def _load_x(x_ptr, cols, cmask, nw_ptr, z_ptr, rstd, eps, PRO: tl.constexpr, GROUP: tl.constexpr,
            BLOCK_K: tl.constexpr):
    x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if PRO == 1:
        w = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        x = _bf16((x * rstd) * (1.0 + w))
    elif PRO == 2:
        # BLOCK_K spans whole heads of GROUP elements: rms per head, bf16 norm, bf16 weight
        # product, SiLU(z) gate.
        NH: tl.constexpr = BLOCK_K // GROUP
        x2 = tl.reshape(x, (NH, GROUP))
        r = tl.rsqrt(tl.sum(x2 * x2, 1) / GROUP + eps)
        xn = tl.reshape(_bf16(x2 * r[:, None]), (BLOCK_K,))
        w = tl.load(nw_ptr + (cols % GROUP), mask=cmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        x = _bf16(_bf16(w * xn) * _silu(z))
    return x


@triton.jit
def _rstd(x_ptr, K, eps, PRO: tl.constexpr, KP: tl.constexpr, BLOCK_K: tl.constexpr):
    rstd = 0.0
    if PRO == 1:
        # The whole of x in one load where it fits (KP = next power of two of K): a loop over K
        # blocks is one dependent L2 round trip per block before the first weight load.
        if KP <= 8192:
            kk = tl.arange(0, KP)
            xa = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xa * xa, 0) / K + eps)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            ss = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xv = tl.load(x_ptr + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0).to(tl.float32)
                ss += xv * xv
            rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)
    return rstd


@triton.jit
def _w_head(w_ptr, rows, rmask, N, K, stride_w, EPI: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr):
    """The first PRE K blocks of the program's rows of a bf16 W (and of the SwiGLU up rows): loaded
    before the program waits on its predecessor kernel (weights never depend on it), so they stream
    while that kernel drains. PRE * BLOCK_K <= K (`head_blocks`): no column mask."""
    wh = 0.0
    wuh = 0.0
    if PRE > 0:
        HK: tl.constexpr = PRE * BLOCK_K
        hcols = tl.arange(0, HK)
        wp = w_ptr + rows[:, None] * stride_w + hcols[None, :]
        wmask = rmask[:, None]
        wh = tl.load(wp, mask=wmask, other=0.0, eviction_policy="evict_first")
        if EPI == 2:
            wuh = tl.load(wp + N * stride_w, mask=wmask, other=0.0, eviction_policy="evict_first")
    return wh, wuh


@triton.jit
def _fold(p, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """[BLOCK_N, BLOCK_K] products summed over runs of VEC adjacent columns. A run is one thread's
    16-byte load, so the sum stays in its registers: the accumulator is VEC times smaller, and the
    registers it frees hold more weight bytes in flight (VEC 1: elementwise)."""
    return tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // VEC, VEC)), 2)


@triton.jit
def _store_out(y_ptr, offs, y, y_up, m, EPI: tl.constexpr):
    """Epilogues 0-2 of y at y_ptr + offs (mask m): store; add to the residual there; SiLU(y)·y_up.
    bf16 after each op, as the eager path."""
    if EPI == 0:
        tl.store(y_ptr + offs, _bf16(y).to(y_ptr.dtype.element_ty), mask=m)
    elif EPI == 1:
        r = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, _bf16(r + _bf16(y)).to(y_ptr.dtype.element_ty), mask=m)
    else:
        u = _bf16(y_up)
        tl.store(y_ptr + offs, _bf16(_bf16(_silu(_bf16(y))) * u).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _conv_state(aux0_ptr, rows, rmask, CONV_N, KC: tl.constexpr, KCP: tl.constexpr):
    """The conv epilogue's rows (cm: rows < CONV_N), taps [KCP], their mask (taps < KC-1) and the live
    conv state of those rows [BLOCK_N, KCP] (aux0: [CONV_N, KC-1], oldest first)."""
    cm = rmask & (rows < CONV_N)
    taps = tl.arange(0, KCP)
    tm = cm[:, None] & (taps[None, :] < KC - 1)
    st = tl.load(aux0_ptr + rows[:, None] * (KC - 1) + taps[None, :], mask=tm, other=0.0)
    return cm, taps, tm, st


@triton.jit
def _epilogue(y, y_up, y_ptr, aux0_ptr, aux1_ptr, rows, rmask, pid, CONV_N,
              EPI: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr):
    if EPI < 3:
        _store_out(y_ptr, rows, y, y_up, rmask, EPI)
    elif EPI == 3:
        # aux0: conv state [CONV_N, KC-1] (oldest first), aux1: conv weight [CONV_N, KC].
        yb = _bf16(y)
        cm, taps, tm, st = _conv_state(aux0_ptr, rows, rmask, CONV_N, KC, KCP)
        cw = tl.load(aux1_ptr + rows[:, None] * KC + taps[None, :], mask=tm, other=0.0).to(tl.float32)
        cw_last = tl.load(aux1_ptr + rows * KC + (KC - 1), mask=cm, other=0.0).to(tl.float32)
        conv = tl.sum(cw * st.to(tl.float32), 1) + cw_last * yb
        nxt = tl.load(aux0_ptr + rows[:, None] * (KC - 1) + taps[None, :] + 1,
                      mask=tm & (taps[None, :] < KC - 2), other=0.0).to(tl.float32)
        nxt = tl.where(taps[None, :] == KC - 2, yb[:, None], nxt)
        # Threads share rows: every read of the old state must land before any write of the new one.
        tl.debug_barrier()
        tl.store(aux0_ptr + rows[:, None] * (KC - 1) + taps[None, :], nxt.to(aux0_ptr.dtype.element_ty), mask=tm)
        out = tl.where(rows < CONV_N, _bf16(_silu(_bf16(conv))), yb)
        tl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=rmask)
    else:
        yb = _bf16(y)
        tl.store(y_ptr + rows, yb, mask=rmask)
        v = tl.where(rmask, yb, float("-inf"))
        m = tl.max(v, 0)
        idx = tl.min(tl.where(v == m, rows, 2147483647), 0)  # ties -> lowest index, like argmax
        tl.store(aux0_ptr + pid, m)
        tl.store(aux1_ptr + pid, idx)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, z_ptr, aux0_ptr, aux1_ptr, pf_ptr,
                N, K, stride_w, eps, CONV_N, pf_off1, pf_each, pf_chunk,
                PRO: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr,
                STORE_XN: tl.constexpr, KP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRE: tl.constexpr,
                VEC: tl.constexpr, PF: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    wh, wuh = _w_head(w_ptr, rows, rmask, N, K, stride_w, EPI, BLOCK_K, PRE)
    pdl_begin(PDL)
    rstd = _rstd(x_ptr, K, eps, PRO, KP, BLOCK_K)
    y, y_up = _acc(x_ptr, w_ptr, w_ptr, w_ptr, nw_ptr, z_ptr, rows, rmask, pid, N, K, stride_w, 0, eps, rstd, wh, wuh,
                   PRO, EPI, GROUP, STORE_XN, BLOCK_N, BLOCK_K, EVEN_K, PRE, VEC, False, 1, True, False)
    _epilogue(y, y_up, y_ptr, aux0_ptr, aux1_ptr, rows, rmask, pid, CONV_N, EPI, KC, KCP)
    l2_prefetch(pf_ptr, pf_off1, pf_each, pf_chunk, pid, PF)


@triton.jit
def _col_scales(sbase, sr, stride_s, cols, cmask, rmask, BKS: tl.constexpr, UNIFORM: tl.constexpr):
    """The block scale of every column of a [BLOCK_N, BLOCK_K] tile: [BLOCK_K] when the program's rows
    share scale row sr (UNIFORM), else [BLOCK_N, BLOCK_K] (sr per row). BKS columns share an address,
    so the gather is L1 traffic, not HBM."""
    if UNIFORM:
        s = tl.load(sbase + sr * stride_s + cols // BKS, mask=cmask, other=0.0)
    else:
        s = tl.load(sbase + sr[:, None] * stride_s + (cols // BKS)[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0)
    return s


@triton.jit
def _scaled_dot(w, xv, s, UNIFORM: tl.constexpr, ROUND_W: tl.constexpr):
    """w [BN, BK] (e4m3) times x [BK] with the block scales s (`_col_scales`), elementwise in fp32: the
    scale multiplies x (one product per column), or with ROUND_W the weight, rounded to bf16."""
    if UNIFORM:
        if ROUND_W:
            out = _bf16(w.to(tl.float32) * s[None, :]) * xv[None, :]
        else:
            out = w.to(tl.float32) * (xv * s)[None, :]
    else:
        if ROUND_W:
            out = _bf16(w.to(tl.float32) * s) * xv[None, :]
        else:
            out = w.to(tl.float32) * (xv[None, :] * s)
    return out


@triton.jit
def _scale_row(srow_ptr, row0, rows, rmask, FP8: tl.constexpr, UNIFORM: tl.constexpr):
    """The scale row of the program's rows of an e4m3 W: srow of the first row (UNIFORM) or per row; 0 for
    bf16 weights."""
    sr = 0
    if FP8:
        if UNIFORM:
            sr = tl.load(srow_ptr + row0)
        else:
            sr = tl.load(srow_ptr + rows, mask=rmask, other=0)
    return sr


@triton.jit
def _w_dot(w, xv, s_ptr, srow, stride_s, cols, cmask, rmask, BKS: tl.constexpr, FP8: tl.constexpr,
           UNIFORM: tl.constexpr, ROUND_W: tl.constexpr):
    """Elementwise products of a [BN, BK] weight tile with x [BK], fp32: bf16 W, or e4m3 W times the
    block scale of each column (`_col_scales`, `_scaled_dot`)."""
    if FP8:
        p = _scaled_dot(w, xv, _col_scales(s_ptr, srow, stride_s, cols, cmask, rmask, BKS, UNIFORM), UNIFORM, ROUND_W)
    else:
        p = w.to(tl.float32) * xv[None, :]
    return p


@triton.jit
def _acc(x_ptr, w_ptr, s_ptr, srow_ptr, nw_ptr, z_ptr, rows, rmask, pid, N, K, stride_w, stride_s, eps, rstd, wh, wuh,
         PRO: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr, STORE_XN: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRE: tl.constexpr, VEC: tl.constexpr,
         FP8: tl.constexpr, BKS: tl.constexpr, UNIFORM: tl.constexpr, ROUND_W: tl.constexpr):
    """(y, y_up) of `rows` of W, fp32 (y_up: the SwiGLU up rows N + rows; 0 otherwise). W is bf16, or
    with FP8 e4m3 with block scales (s_ptr, row map srow_ptr) read in the same [BLOCK_N, BLOCK_K]
    tiles (whose 2-D layout keeps the loads 16 bytes wide and the accumulator small), the scale of
    each column gathered beside the tile. UNIFORM: all the program's rows share one scale row (srow
    of the first row); else per row. ROUND_W: each weight is e4m3 * scale rounded to bf16 instead
    (the eager oracle's dequantized weights, so the two differ only in the order of sums; a
    diagnostic mode, more ALU per byte). (wh, wuh): the first PRE K blocks, already loaded
    (`_w_head`); the loop reads the rest."""
    offs_k = tl.arange(0, BLOCK_K)
    srow = _scale_row(srow_ptr, pid * BLOCK_N, rows, rmask, FP8, UNIFORM)
    srow_u = srow
    if EPI == 2:  # the up rows N + rows: their own scale rows
        srow_u = _scale_row(srow_ptr + N, pid * BLOCK_N, rows, rmask, FP8, UNIFORM)
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    if EPI == 2:
        acc_u = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    y_up = 0.0
    if PRE > 0:
        HK: tl.constexpr = PRE * BLOCK_K
        hcols = tl.arange(0, HK)
        hmask = hcols < HK
        xh = _load_x(x_ptr, hcols, hmask, nw_ptr, z_ptr, rstd, eps, PRO, GROUP, HK)
        if STORE_XN:
            tl.store(z_ptr + hcols, xh.to(z_ptr.dtype.element_ty), mask=hmask & ((tl.zeros_like(hcols) + pid) == 0))
        y = tl.sum(_w_dot(wh, xh, s_ptr, srow, stride_s, hcols, hmask, rmask, BKS, FP8, UNIFORM, ROUND_W), 1)
        if EPI == 2:
            y_up = tl.sum(_w_dot(wuh, xh, s_ptr, srow_u, stride_s, hcols, hmask, rmask, BKS, FP8, UNIFORM, ROUND_W), 1)
    for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
        cols = k0 + offs_k
        cmask = cols < K
        xv = _load_x(x_ptr, cols, cmask, nw_ptr, z_ptr, rstd, eps, PRO, GROUP, BLOCK_K)
        if STORE_XN:  # program 0 leaves the normed input (z_ptr) for a later launch (MoE experts)
            tl.store(z_ptr + cols, xv.to(z_ptr.dtype.element_ty), mask=cmask & ((tl.zeros_like(cols) + pid) == 0))
        wp = w_ptr + rows[:, None] * stride_w + cols[None, :]
        if EVEN_K:
            wmask = rmask[:, None]
        else:
            wmask = rmask[:, None] & cmask[None, :]
        w = tl.load(wp, mask=wmask, other=0.0, eviction_policy="evict_first")
        acc += _fold(_w_dot(w, xv, s_ptr, srow, stride_s, cols, cmask, rmask, BKS, FP8, UNIFORM, ROUND_W),
                     BLOCK_N, BLOCK_K, VEC)
        if EPI == 2:
            wu = tl.load(wp + N * stride_w, mask=wmask, other=0.0, eviction_policy="evict_first")
            acc_u += _fold(_w_dot(wu, xv, s_ptr, srow_u, stride_s, cols, cmask, rmask, BKS, FP8, UNIFORM, ROUND_W),
                           BLOCK_N, BLOCK_K, VEC)
    y += tl.sum(acc, 1)
    if EPI == 2:
        y_up += tl.sum(acc_u, 1)
    return y, y_up


@triton.jit
def gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, srow_ptr, t_ptr, y_ptr, nw_ptr, z_ptr, aux0_ptr, aux1_ptr, pf_ptr,
                    N, K, N8, stride_w, stride_s, stride_t, eps, CONV_N, pf_off1, pf_each, pf_chunk,
                    PRO: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr, KC: tl.constexpr,
                    KCP: tl.constexpr, STORE_XN: tl.constexpr, KP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BKS: tl.constexpr,
                    UNIFORM: tl.constexpr, ROUND_W: tl.constexpr, TAIL: tl.constexpr, EVEN_K: tl.constexpr,
                    PRE: tl.constexpr, VEC: tl.constexpr, VEC_T: tl.constexpr, PF: tl.constexpr, PDL: tl.constexpr):
    """`gemv_kernel` over an FP8 weight: rows < N8 e4m3 (w_ptr) with fp32 block scales (s_ptr, row
    map srow_ptr), rows >= N8 (TAIL) bf16 (t_ptr); N8 is a multiple of BLOCK_N, so each program
    reads one of the two. Same prologues and epilogues; the e4m3 programs load their first PRE K
    blocks before the PDL wait, as the bf16 kernel does."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    if TAIL and pid * BLOCK_N >= N8:
        pdl_begin(PDL)
        rstd = _rstd(x_ptr, K, eps, PRO, KP, BLOCK_K)
        trows = rows - N8
        y, y_up = _acc(x_ptr, t_ptr, t_ptr, t_ptr, nw_ptr, z_ptr, trows, rmask, pid, N - N8, K, stride_t, 0, eps, rstd,
                       0.0, 0.0, PRO, EPI, GROUP, STORE_XN, BLOCK_N, BLOCK_K, EVEN_K, 0, VEC_T, False, 1, True, False)
    else:
        r8 = rmask & (rows < N8)
        wh, wuh = _w_head(w_ptr, rows, r8, N8, K, stride_w, EPI, BLOCK_K, PRE)
        pdl_begin(PDL)
        rstd = _rstd(x_ptr, K, eps, PRO, KP, BLOCK_K)
        y, y_up = _acc(x_ptr, w_ptr, s_ptr, srow_ptr, nw_ptr, z_ptr, rows, r8, pid, N8, K, stride_w, stride_s, eps,
                       rstd, wh, wuh, PRO, EPI, GROUP, STORE_XN, BLOCK_N, BLOCK_K, EVEN_K, PRE, VEC, True, BKS, UNIFORM,
                       ROUND_W)
    _epilogue(y, y_up, y_ptr, aux0_ptr, aux1_ptr, rows, rmask, pid, CONV_N, EPI, KC, KCP)
    l2_prefetch(pf_ptr, pf_off1, pf_each, pf_chunk, pid, PF)


# ---- M rows (the speculative verify pass) ------------------------------------------------------
# `gemv_rows_kernel`: y_j = W x_j for the M <= 4 rows of x (positions pos..pos+M-1 of a verify), each
# weight tile loaded once and multiplied by every row, so M rows stream W's bytes once. The rows are a
# leading [MP] dimension (M padded to a power of two, masked). Per row the M = 1 kernel's ops and
# rounding points; only the order of the fp32 sums differs (one FMA chain per 16-byte run).


@triton.jit
def _rstd_rows(x_ptr, stride_x, jrow, jm, K, eps, PRO: tl.constexpr, KP: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_rstd` of each row of x [MP]: one load of all rows where MP * KP <= 8192, else a loop over K."""
    MP: tl.constexpr = jrow.shape[0]
    rstd = tl.zeros([MP], dtype=tl.float32)
    if PRO == 1:
        if MP * KP <= 8192:
            kk = tl.arange(0, KP)
            xa = tl.load(x_ptr + jrow[:, None] * stride_x + kk[None, :], mask=jm[:, None] & (kk[None, :] < K),
                         other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xa * xa, 1) / K + eps)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            ss = tl.zeros([MP, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ck = k0 + offs_k
                xv = tl.load(x_ptr + jrow[:, None] * stride_x + ck[None, :], mask=jm[:, None] & (ck[None, :] < K),
                             other=0.0).to(tl.float32)
                ss += xv * xv
            rstd = tl.rsqrt(tl.sum(ss, 1) / K + eps)
    return rstd


@triton.jit
def _load_x_rows(x_ptr, stride_x, jrow, jm, cols, cmask, nw_ptr, z_ptr, stride_z, rstd, eps, PRO: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_load_x` of each row: x [MP, BLOCK_K] after the prologue (rstd [MP]; PRO 2: z rows at stride_z)."""
    MP: tl.constexpr = jrow.shape[0]
    m2 = jm[:, None] & cmask[None, :]
    x = tl.load(x_ptr + jrow[:, None] * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    if PRO == 1:
        w = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        x = _bf16((x * rstd[:, None]) * (1.0 + w[None, :]))
    elif PRO == 2:
        NH: tl.constexpr = BLOCK_K // GROUP
        x3 = tl.reshape(x, (MP, NH, GROUP))
        r = tl.rsqrt(tl.sum(x3 * x3, 2) / GROUP + eps)
        xn = tl.reshape(_bf16(x3 * r[:, :, None]), (MP, BLOCK_K))
        w = tl.load(nw_ptr + (cols % GROUP), mask=cmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + jrow[:, None] * stride_z + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        x = _bf16(_bf16(w[None, :] * xn) * _silu(z))
    return x


@triton.jit
def _fma_pairs(acc, w, x):
    """acc + w[..., 0] x[..., 0] + w[..., 1] x[..., 1] (last dim 2, in one thread): two chained FMAs."""
    w0, w1 = tl.split(w)
    x0, x1 = tl.split(x)
    return acc + w0 * x0 + w1 * x1


@triton.jit
def _halves(t):
    """A [A, B, C, V] tensor (V in one thread's registers) as its [A, B, C, V / 2] halves."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    C: tl.constexpr = t.shape[2]
    V: tl.constexpr = t.shape[3]
    return tl.split(tl.reshape(t, (A, B, C, V // 2, 2)))


@triton.jit
def _fma_run(acc, w, x, VEC: tl.constexpr):
    """acc + the products w x [.., VEC] summed over their last dim (VEC <= 8 adjacent columns of one
    thread) as one chain of FMAs: a tree sum costs a multiply and an add more per two products."""
    if VEC == 1:
        out = acc + tl.sum(w * x, 3)
    elif VEC == 2:
        out = _fma_pairs(acc, w, x)
    else:
        wa, wb = _halves(w)
        xa, xb = _halves(x)
        if VEC == 4:
            out = _fma_pairs(_fma_pairs(acc, wa, xa), wb, xb)
        else:
            wa0, wa1 = _halves(wa)
            xa0, xa1 = _halves(xa)
            wb0, wb1 = _halves(wb)
            xb0, xb1 = _halves(xb)
            out = _fma_pairs(_fma_pairs(_fma_pairs(_fma_pairs(acc, wa0, xa0), wa1, xa1), wb0, xb0), wb1, xb1)
    return out


@triton.jit
def _fold_rows(acc, w, xv, VEC: tl.constexpr):
    """acc [MP, BN, BK // VEC] + the products of a [1, BN, BK] weight tile with each row of x [MP, 1, BK],
    fp32, each run of VEC adjacent columns (one thread's 16-byte load, `_fold`) summed in registers."""
    MP: tl.constexpr = xv.shape[0]
    BN: tl.constexpr = w.shape[1]
    BK: tl.constexpr = w.shape[2]
    # both operands at the full [MP, BN, BK] (a broadcast reuses registers): their splits then share
    # one layout
    w4 = tl.reshape(tl.broadcast_to(w.to(tl.float32), (MP, BN, BK)), (MP, BN, BK // VEC, VEC))
    x4 = tl.reshape(tl.broadcast_to(xv, (MP, BN, BK)), (MP, BN, BK // VEC, VEC))
    return _fma_run(acc, w4, x4, VEC)


@triton.jit
def _w_tile(w_ptr, rows, rmask, cols, K, stride_w, EVEN_K: tl.constexpr):
    """The [1, BLOCK_N, BLOCK_K] weight tile at `cols`, loaded with evict_first: a 3-D load whose layout
    the rows of x broadcast into (each thread's products for all rows from its own registers)."""
    wp = w_ptr + rows[None, :, None] * stride_w + cols[None, None, :]
    if EVEN_K:
        wmask = rmask[None, :, None]
    else:
        wmask = rmask[None, :, None] & (cols < K)[None, None, :]
    return tl.load(wp, mask=wmask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _w_head_rows(w_ptr, rows, rmask, N, K, stride_w, EPI: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr):
    """`_w_head` for `gemv_rows_kernel`: the first PRE (0, 1, 2 or 4) K blocks as separate tiles
    (`_w_tile`; 0.0 past PRE), and those of the SwiGLU up rows."""
    offs_k = tl.arange(0, BLOCK_K)
    w0 = 0.0
    w1 = 0.0
    w2 = 0.0
    w3 = 0.0
    u0 = 0.0
    u1 = 0.0
    u2 = 0.0
    u3 = 0.0
    if PRE > 0:
        w0 = _w_tile(w_ptr, rows, rmask, offs_k, K, stride_w, True)
        if EPI == 2:
            u0 = _w_tile(w_ptr + N * stride_w, rows, rmask, offs_k, K, stride_w, True)
    if PRE > 1:
        w1 = _w_tile(w_ptr, rows, rmask, BLOCK_K + offs_k, K, stride_w, True)
        if EPI == 2:
            u1 = _w_tile(w_ptr + N * stride_w, rows, rmask, BLOCK_K + offs_k, K, stride_w, True)
    if PRE > 2:
        w2 = _w_tile(w_ptr, rows, rmask, 2 * BLOCK_K + offs_k, K, stride_w, True)
        w3 = _w_tile(w_ptr, rows, rmask, 3 * BLOCK_K + offs_k, K, stride_w, True)
        if EPI == 2:
            u2 = _w_tile(w_ptr + N * stride_w, rows, rmask, 2 * BLOCK_K + offs_k, K, stride_w, True)
            u3 = _w_tile(w_ptr + N * stride_w, rows, rmask, 3 * BLOCK_K + offs_k, K, stride_w, True)
    return w0, w1, w2, w3, u0, u1, u2, u3


@triton.jit
def _x_block(x_ptr, stride_x, jrow, jm, cols, cmask, nw_ptr, z_ptr, stride_z, rstd, eps, pid, PRO: tl.constexpr,
             GROUP: tl.constexpr, STORE_XN: tl.constexpr, BLOCK_K: tl.constexpr):
    """The x rows of one K block after the prologue (`_load_x_rows`); with STORE_XN program 0 also leaves
    them at z_ptr for a later launch (the MoE experts' normed input)."""
    xv = _load_x_rows(x_ptr, stride_x, jrow, jm, cols, cmask, nw_ptr, z_ptr, stride_z, rstd, eps, PRO, GROUP, BLOCK_K)
    if STORE_XN:
        tl.store(z_ptr + jrow[:, None] * stride_z + cols[None, :], xv.to(z_ptr.dtype.element_ty),
                 mask=jm[:, None] & cmask[None, :] & ((tl.zeros_like(cols) + pid) == 0)[None, :])
    return xv


@triton.jit
def _block_rows(acc, acc_u, w, wu, k0, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z, rstd, eps, pid, K,
                PRO: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr, STORE_XN: tl.constexpr,
                BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """One K block (columns k0..) of the rows: the prologue's x rows, xn stored by program 0, and the
    loaded weight tile(s) [1, BLOCK_N, BLOCK_K] folded into acc (acc_u: SwiGLU up rows)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    xv = _x_block(x_ptr, stride_x, jrow, jm, cols, cols < K, nw_ptr, z_ptr, stride_z, rstd, eps, pid, PRO, GROUP,
                  STORE_XN, BLOCK_K)
    acc = _fold_rows(acc, w, xv[:, None, :], VEC)
    if EPI == 2:
        acc_u = _fold_rows(acc_u, wu, xv[:, None, :], VEC)
    return acc, acc_u


@triton.jit
def _acc_rows(x_ptr, w_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows, rmask, pid, N, K, stride_w, eps, rstd,
              w0, w1, w2, w3, u0, u1, u2, u3, PRO: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr,
              STORE_XN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              PRE: tl.constexpr, VEC: tl.constexpr):
    """`_acc` (bf16 W) for every row of x: (y, y_up) [MP, BLOCK_N] fp32. The head tiles (w0.., u0..:
    the first PRE K blocks, `_w_head_rows`) are folded as the loop folds the rest."""
    MP: tl.constexpr = jrow.shape[0]
    acc = tl.zeros([MP, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc_u = acc
    if PRE > 0:
        acc, acc_u = _block_rows(acc, acc_u, w0, u0, 0, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z, rstd, eps,
                                 pid, K, PRO, EPI, GROUP, STORE_XN, BLOCK_K, VEC)
    if PRE > 1:
        acc, acc_u = _block_rows(acc, acc_u, w1, u1, BLOCK_K, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z, rstd,
                                 eps, pid, K, PRO, EPI, GROUP, STORE_XN, BLOCK_K, VEC)
    if PRE > 2:
        acc, acc_u = _block_rows(acc, acc_u, w2, u2, 2 * BLOCK_K, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z,
                                 rstd, eps, pid, K, PRO, EPI, GROUP, STORE_XN, BLOCK_K, VEC)
        acc, acc_u = _block_rows(acc, acc_u, w3, u3, 3 * BLOCK_K, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z,
                                 rstd, eps, pid, K, PRO, EPI, GROUP, STORE_XN, BLOCK_K, VEC)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
        w = _w_tile(w_ptr, rows, rmask, k0 + offs_k, K, stride_w, EVEN_K)
        wu = w
        if EPI == 2:
            wu = _w_tile(w_ptr + N * stride_w, rows, rmask, k0 + offs_k, K, stride_w, EVEN_K)
        acc, acc_u = _block_rows(acc, acc_u, w, wu, k0, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z, rstd,
                                 eps, pid, K, PRO, EPI, GROUP, STORE_XN, BLOCK_K, VEC)
    return tl.sum(acc, 2), tl.sum(acc_u, 2)


@triton.jit
def _epilogue_rows(y, y_up, y_ptr, stride_y, aux0_ptr, aux1_ptr, stride_a, win_ptr, stride_win, jrow, jm, rows,
                   rmask, pid, CONV_N, EPI: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr):
    """`_epilogue` of each row j (y [MP, BLOCK_N]) into y row j (stride_y). EPI 4: (max, argmax) of
    row j at aux0/aux1 [j * stride_a + pid]. EPI 3 (M consecutive tokens): the live conv state aux0 is
    only read; the window [CONV_N, KC-1+M] (win_ptr, row stride stride_win) receives the state and
    bf16(y_j) at column KC-1+j, and token j's conv runs over window columns j..j+KC-1, in registers."""
    m2 = jm[:, None] & rmask[None, :]
    yp = y_ptr + jrow[:, None] * stride_y + rows[None, :]
    if EPI < 3:
        _store_out(yp, 0, y, y_up, m2, EPI)
    elif EPI == 3:
        yb = _bf16(y)
        cm, taps, tm, st = _conv_state(aux0_ptr, rows, rmask, CONV_N, KC, KCP)
        # the window: the live state, then the M new inputs
        tl.store(win_ptr + rows[:, None] * stride_win + taps[None, :], st, mask=tm)
        tl.store(win_ptr + rows[None, :] * stride_win + (KC - 1) + jrow[:, None], yb.to(win_ptr.dtype.element_ty),
                 mask=jm[:, None] & cm[None, :])
        # token j: taps t with j + t < KC-1 read the state (column j + t), the others y_i with i = j + t - (KC-1)
        j3 = jrow[:, None, None]
        r3 = rows[None, :, None]
        t3 = taps[None, None, :]
        sm = (j3 + t3 < KC - 1) & cm[None, :, None]
        sj = tl.load(aux0_ptr + r3 * (KC - 1) + j3 + t3, mask=sm, other=0.0).to(tl.float32)
        cw = tl.load(aux1_ptr + r3 * KC + t3, mask=sm, other=0.0).to(tl.float32)
        conv = tl.sum(tl.where(sm, cw * sj, 0.0), 2)  # [MP, BLOCK_N]
        # the new inputs: weight tap KC-1-(j-i) on y_i for 0 <= j-i <= KC-1
        i3 = jrow[None, :, None]
        d = jrow[:, None, None] - i3  # [MP, MP, 1]: j - i
        r3 = rows[None, None, :]
        ym = (d >= 0) & (d <= KC - 1) & cm[None, None, :]
        cy = tl.load(aux1_ptr + r3 * KC + (KC - 1) - d, mask=ym, other=0.0).to(tl.float32)
        conv += tl.sum(tl.where(ym, cy * yb[None, :, :], 0.0), 1)
        out = tl.where(rows[None, :] < CONV_N, _bf16(_silu(_bf16(conv))), yb)
        tl.store(yp, out.to(y_ptr.dtype.element_ty), mask=m2)
    else:
        yb = _bf16(y)
        tl.store(yp, yb, mask=m2)
        v = tl.where(m2, yb, float("-inf"))
        mx = tl.max(v, 1)
        idx = tl.min(tl.where(v == mx[:, None], rows[None, :], 2147483647), 1)  # ties -> lowest index
        tl.store(aux0_ptr + jrow * stride_a + pid, mx, mask=jm)
        tl.store(aux1_ptr + jrow * stride_a + pid, idx, mask=jm)


@triton.jit
def gemv_rows_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, z_ptr, aux0_ptr, aux1_ptr, win_ptr,
                     N, K, stride_w, stride_x, stride_y, stride_z, stride_a, stride_win, eps, CONV_N,
                     M: tl.constexpr, MP: tl.constexpr, PRO: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr,
                     KC: tl.constexpr, KCP: tl.constexpr, STORE_XN: tl.constexpr, KP: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRE: tl.constexpr,
                     VEC: tl.constexpr, PDL: tl.constexpr):
    """`gemv_kernel` over the M rows of x [M, K] (row stride stride_x) into y [M, N] (stride_y): one
    load of each weight tile (the same tiles, prefetch head and eviction as M = 1) feeds M dot
    products. Same prologues and epilogues per row (`_epilogue_rows`)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    jrow = tl.arange(0, MP)
    jm = jrow < M
    w0, w1, w2, w3, u0, u1, u2, u3 = _w_head_rows(w_ptr, rows, rmask, N, K, stride_w, EPI, BLOCK_K, PRE)
    pdl_begin(PDL)
    rstd = _rstd_rows(x_ptr, stride_x, jrow, jm, K, eps, PRO, KP, BLOCK_K)
    y, y_up = _acc_rows(x_ptr, w_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows, rmask, pid, N, K, stride_w,
                        eps, rstd, w0, w1, w2, w3, u0, u1, u2, u3, PRO, EPI, GROUP, STORE_XN, BLOCK_N, BLOCK_K, EVEN_K,
                        PRE, VEC)
    _epilogue_rows(y, y_up, y_ptr, stride_y, aux0_ptr, aux1_ptr, stride_a, win_ptr, stride_win, jrow, jm, rows, rmask,
                   pid, CONV_N, EPI, KC, KCP)


@triton.jit
def _dot_t(w, xt, acc, DOT: tl.constexpr):
    """acc [BLOCK_N, MP] + w [BLOCK_N, BLOCK_K] (bf16) @ xt [BLOCK_K, MP] (bf16 values in fp32): DOT 1 on the
    tensor cores (bf16 operands, fp32 sums; exact products); DOT 2 as fp32 "ieee" (the interpreter,
    whose bf16 dot reads raw bits): the same products either way."""
    if DOT == 1:
        out = tl.dot(w, xt.to(tl.bfloat16), acc)
    else:
        out = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
    return out


@triton.jit
def gemv_rows_dot_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, z_ptr, aux0_ptr, aux1_ptr, win_ptr,
                         N, K, stride_w, stride_x, stride_y, stride_z, stride_a, stride_win, eps, CONV_N,
                         M: tl.constexpr, MP: tl.constexpr, PRO: tl.constexpr, EPI: tl.constexpr,
                         GROUP: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, STORE_XN: tl.constexpr,
                         KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         DOT: tl.constexpr, PDL: tl.constexpr):
    """`gemv_rows_kernel` through the tensor cores with the weight as the left operand: acc [BLOCK_N, MP] =
    W[rows] @ x^T (the compiler pads the MP columns to the instruction's). Each weight tile goes from the load
    straight into the product, so the compiler streams it through shared memory in pipeline stages
    (num_stages); the x rows take the prologue per K block. Same epilogues (`_epilogue_rows`)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    jrow = tl.arange(0, MP)
    jm = jrow < M
    pdl_begin(PDL)
    rstd = _rstd_rows(x_ptr, stride_x, jrow, jm, K, eps, PRO, KP, BLOCK_K)
    acc = tl.zeros([BLOCK_N, MP], dtype=tl.float32)
    acc_u = acc
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        cmask = cols < K
        if EVEN_K:
            wmask = rmask[:, None]
        else:
            wmask = rmask[:, None] & cmask[None, :]
        wp = w_ptr + rows[:, None] * stride_w + cols[None, :]
        w = tl.load(wp, mask=wmask, other=0.0, eviction_policy="evict_first")
        xt = tl.trans(_x_block(x_ptr, stride_x, jrow, jm, cols, cmask, nw_ptr, z_ptr, stride_z, rstd, eps, pid, PRO,
                               GROUP, STORE_XN, BLOCK_K))
        acc = _dot_t(w, xt, acc, DOT)
        if EPI == 2:
            wu = tl.load(wp + N * stride_w, mask=wmask, other=0.0, eviction_policy="evict_first")
            acc_u = _dot_t(wu, xt, acc_u, DOT)
    _epilogue_rows(tl.trans(acc), tl.trans(acc_u), y_ptr, stride_y, aux0_ptr, aux1_ptr, stride_a, win_ptr,
                   stride_win, jrow, jm, rows, rmask, pid, CONV_N, EPI, KC, KCP)


def head_blocks(prefetch: int, k: int, block_k: int) -> int:
    """K blocks a program loads ahead of its wait: at most `prefetch` and the whole blocks of K, a power of two."""
    n = min(prefetch, k // block_k)
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def fold_vec(vec: int, elem_bytes: int, block_k: int) -> int:
    """`_fold`'s run length: `vec`, or with 0 the elements of one 16-byte load; within block_k."""
    return min(vec or 16 // elem_bytes, block_k)


def gemv(x, w, y, *, pro=PRO_NONE, epi=EPI_STORE, norm_w=None, z=None, aux0=None, aux1=None, eps=1e-6,
         conv_n=0, group=1, kc=4, xn_out=None, block_n=None, block_k=None, num_warps=4, n=None, round_w=False,
         prefetch=0, vec=0, m=1, window=None, dot=0, l2=None):
    """Launch `gemv_kernel`, or `gemv_fp8_kernel` when `w` is an fp8.FP8Weight (e4m3 + block scales,
    optionally a bf16 tail; `round_w`: see _acc's ROUND_W). `w` is [N, K] ([2N, K] for SwiGLU,
    N = rows of y); `prefetch`: K blocks of W (bf16 or e4m3) each program loads before it waits on the
    previous kernel (PDL), cut to a power of two within K; `vec`: columns each thread sums in
    registers before accumulating (`_fold`; 0: a 16-byte load's, 1: elementwise); returns the grid size.

    `m` > 1 (<= 4, bf16 W only): `gemv_rows_kernel` over the rows of x [m, K] into y [m, N], W read
    once for all rows; every row strided (stride(0); unit column stride). Per row: z (PRO_GATED) and
    xn_out [m, K]; EPI_ARGMAX's aux0 fp32 / aux1 int32 [m, P] (P = the grid size returned; any row
    stride, the same for both); EPI_CONV runs the m rows as consecutive tokens from the live conv
    state aux0 (read only) and fills `window` [conv_n, kc-1+m] (bf16, any row stride) with the state
    and the m new inputs (`model.gdn_verify`'s window: token j's conv input is window[:, j:j+kc]).
    With m > 1 each thread always folds its 16-byte runs (`vec` is not used: elementwise
    accumulators for m rows would not fit in registers) and `prefetch` is cut to 4 blocks. `dot` > 0:
    `gemv_rows_dot_kernel` (tensor cores, >= 16 weight rows per program) with `dot` pipeline stages.
    `l2` (m = 1): an `l2_target` of the next GEMV, whose first bytes the programs ask L2 for when done."""
    fp8 = hasattr(w, "scale")
    if m != 1:
        if l2 is not None:
            raise ValueError("gemv: l2 prefetch is for m = 1 launches")
        return _gemv_rows(x, w, y, fp8, pro=pro, epi=epi, norm_w=norm_w, z=z, aux0=aux0, aux1=aux1, eps=eps,
                          conv_n=conv_n, group=group, kc=kc, xn_out=xn_out, block_n=block_n, block_k=block_k,
                          num_warps=num_warps, n=n, prefetch=prefetch, vec=vec, m=m, window=window, dot=dot)
    k = w.shape[-1]
    n = n if n is not None else (w.shape[0] // 2 if epi == EPI_SWIGLU else w.shape[0])
    block_k = min(block_k or 512, triton.next_power_of_2(k))
    if pro == PRO_GATED:  # whole heads per K block (group and block_k are powers of two)
        block_k = max(block_k, group)
    block_n = block_n or 16
    grid = triton.cdiv(n, block_n)
    dummy = y
    if xn_out is not None:
        z = xn_out
    args = (norm_w if norm_w is not None else dummy, z if z is not None else dummy,
            aux0 if aux0 is not None else dummy, aux1 if aux1 is not None else dummy)
    if l2 is not None:
        pf_t, pf_off1, pf_each, segs = l2
        per = -(-pf_each // grid)
        pf_ptr, pf = pf_t, (pf_off1, pf_each, -(-per // 16) * 16)
    else:
        pf_ptr, pf, segs = dummy, (0, 0, 0), 0
    common = dict(PRO=pro, EPI=epi, GROUP=group, KC=kc, KCP=triton.next_power_of_2(max(kc - 1, 1)),
                  STORE_XN=xn_out is not None, KP=triton.next_power_of_2(k), BLOCK_N=block_n, BLOCK_K=block_k,
                  EVEN_K=(k % block_k == 0), PF=segs, **LAUNCH, num_warps=num_warps)
    args = (*args, pf_ptr)
    if not fp8:
        gemv_kernel[(grid,)](x, w, y, *args, n, k, w.stride(0), eps, conv_n, *pf,
                             PRE=head_blocks(prefetch, k, block_k), VEC=fold_vec(vec, 2, block_k), **common)
        return grid
    n8 = w.n8
    tail = w.tail
    if tail is not None:
        if epi == EPI_SWIGLU:
            raise ValueError("gemv: a SwiGLU weight cannot have bf16 tail rows")
        if n8 % block_n:
            raise ValueError(f"gemv: {n8} fp8 rows before the bf16 tail are not a multiple of block_n {block_n}")
    elif n8 != w.shape[0]:
        raise AssertionError("FP8Weight rows")
    uniform = w.row_uniform(block_n) and (epi != EPI_SWIGLU or w.row_uniform(block_n, n))
    gemv_fp8_kernel[(grid,)](
        x, w.q, w.scale, w.srow, tail if tail is not None else dummy, y, *args, n, k, n8 if tail is not None else n,
        w.q.stride(0), w.scale.stride(0), tail.stride(0) if tail is not None else 0, eps, conv_n, *pf,
        BKS=w.block[1], UNIFORM=uniform, ROUND_W=round_w, TAIL=tail is not None,
        PRE=head_blocks(prefetch, k, block_k), VEC=fold_vec(vec, 1, block_k), VEC_T=fold_vec(vec, 2, block_k),
        **common)
    return grid


def l2_target(w, nbytes: int, halves: bool = False):
    """The `l2` argument of the launch before a GEMV over `w` (bf16 or fp8.FP8Weight: its e4m3 values):
    the first `nbytes` of the weight (split between the gate and the up half of a SwiGLU weight,
    `halves`, whose programs read both from their start), as (its bytes, offset of the second segment,
    bytes per segment, segments); None when nothing is asked (nbytes 0, a strided view)."""
    t = w.q if hasattr(w, "scale") else w
    if nbytes <= 0 or not t.is_contiguous():
        return None
    flat = t.view(-1).view(torch.uint8)
    segs = 2 if halves else 1
    each = min(nbytes, flat.numel()) // segs // 16 * 16
    return (flat, flat.numel() // 2 if halves else 0, each, segs) if each else None


def _gemv_rows(x, w, y, fp8, *, pro, epi, norm_w, z, aux0, aux1, eps, conv_n, group, kc, xn_out, block_n,
               block_k, num_warps, n, prefetch, vec, m, window, dot):
    """`gemv` with m > 1: `gemv_rows_kernel`, or `gemv_rows_dot_kernel` with `dot` pipeline stages."""
    if fp8:
        raise ValueError("gemv: m > 1 needs bf16 weights (got an FP8Weight)")
    if not 1 <= m <= 4:
        raise ValueError(f"gemv: m must be 1..4 (got {m})")
    k = w.shape[-1]
    n = n if n is not None else (w.shape[0] // 2 if epi == EPI_SWIGLU else w.shape[0])
    for name, t, cols in (("x", x, k), ("y", y, n), ("z", z if pro == PRO_GATED else None, k),
                          ("xn_out", xn_out, k)):
        if t is not None and (t.dim() != 2 or t.shape[0] < m or t.shape[1] < cols or t.stride(1) != 1):
            raise ValueError(f"gemv: {name} must be [m, {cols}] with unit column stride (got {tuple(t.shape)})")
    block_k = min(block_k or 512, triton.next_power_of_2(k))
    if pro == PRO_GATED:
        block_k = max(block_k, group)
    block_n = block_n or 16
    if dot and (block_n < 16 or block_k < 16):
        raise ValueError(f"gemv: the tensor-core M-row kernel needs block_n and block_k >= 16 (got {block_n}, "
                         f"{block_k})")
    grid = triton.cdiv(n, block_n)
    dummy = y
    if xn_out is not None:
        z = xn_out
    stride_a, stride_win = 0, 0
    if epi == EPI_ARGMAX:
        if aux0.stride(0) != aux1.stride(0) or aux0.shape[-1] < grid or aux1.shape[-1] < grid:
            raise ValueError(f"gemv: argmax partials must be [m, >= {grid}] with one row stride")
        stride_a = aux0.stride(0)
    if epi == EPI_CONV:
        if window is None or window.shape[0] < conv_n or window.shape[1] < kc - 1 + m or window.stride(1) != 1:
            raise ValueError(f"gemv: EPI_CONV with m > 1 needs window [{conv_n}, {kc - 1 + m}]")
        stride_win = window.stride(0)
    args = (x, w, y, norm_w if norm_w is not None else dummy, z if z is not None else dummy,
            aux0 if aux0 is not None else dummy, aux1 if aux1 is not None else dummy,
            window if window is not None else dummy, n, k, w.stride(0), x.stride(0), y.stride(0),
            z.stride(0) if z is not None else 0, stride_a, stride_win, eps, conv_n)
    common = dict(M=m, MP=triton.next_power_of_2(m), PRO=pro, EPI=epi, GROUP=group, KC=kc,
                  KCP=triton.next_power_of_2(max(kc - 1, 1)), STORE_XN=xn_out is not None,
                  KP=triton.next_power_of_2(k), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=(k % block_k == 0),
                  **LAUNCH, num_warps=num_warps)
    if dot:
        gemv_rows_dot_kernel[(grid,)](*args, DOT=1 if ASM else 2, num_stages=dot, **common)
        return grid
    gemv_rows_kernel[(grid,)](*args, PRE=head_blocks(min(prefetch, 4), k, block_k), VEC=min(8, block_k), **common)
    return grid


__all__ = ["gemv", "l2_target", "gemv_kernel", "gemv_fp8_kernel", "gemv_rows_kernel", "gemv_rows_dot_kernel",
           "head_blocks", "fold_vec", "PRO_NONE", "PRO_RMSNORM", "PRO_GATED", "EPI_STORE", "EPI_RESIDUAL",
           "EPI_SWIGLU", "EPI_CONV", "EPI_ARGMAX"]

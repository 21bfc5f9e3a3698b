"""The decode step's GEMV kernels: one row of x, y = W x, bf16 (`gemv_kernel`) or FP8 (`gemv_fp8_kernel`) W.

Launched through `kernels.gemv.gemv`, which documents the prologues (PRO) and epilogues (EPI) as
numbers; the kernels here take them as constexprs.

FP8 (`gemv_fp8_kernel`, for an fp8.FP8Weight): the weight stays e4m3 and is read in the bf16
kernel's [BLOCK_N, BLOCK_K] tiles; each column's block scale (one per 128 x 128 block, gathered
from L1) multiplies the (bf16-valued) input, so the weight stream is one byte per element;
accumulation in fp32 as in bf16. Rows after the fp8 ones may be bf16 (a fused projection whose last
parts the checkpoint keeps in bf16); those programs run the bf16 loop.
"""
import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.common import bf16_round as _bf16
from nexrt_vllm.engine.kernels.common import gated_rmsnorm, l2_prefetch, pdl_begin
from nexrt_vllm.engine.kernels.common import silu as _silu


@triton.jit
def _load_x(x_ptr, cols, cmask, nw_ptr, z_ptr, rstd, eps, PRO: tl.constexpr, GROUP: tl.constexpr,
            BLOCK_K: tl.constexpr):
    x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if PRO == 1:
        w = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        x = _bf16((x * rstd) * (1.0 + w))
    elif PRO == 2:
        # BLOCK_K spans whole heads of GROUP elements
        w = tl.load(nw_ptr + (cols % GROUP), mask=cmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        x = gated_rmsnorm(x, z, w, eps, GROUP)
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
    elif EPI == 5:  # a tensor-parallel rank's partial sum, unrounded (fp32 y_ptr): reduced, then added
        tl.store(y_ptr + rows, y, mask=rmask)
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
def gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, srow_ptr, t_ptr, y_ptr, nw_ptr, z_ptr, aux0_ptr, aux1_ptr,
                    N, K, N8, stride_w, stride_s, stride_t, eps, CONV_N,
                    PRO: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr, KC: tl.constexpr,
                    KCP: tl.constexpr, STORE_XN: tl.constexpr, KP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BKS: tl.constexpr,
                    UNIFORM: tl.constexpr, ROUND_W: tl.constexpr, TAIL: tl.constexpr, EVEN_K: tl.constexpr,
                    VEC: tl.constexpr, VEC_T: tl.constexpr, PDL: tl.constexpr):
    """`gemv_kernel` over an FP8 weight: rows < N8 e4m3 (w_ptr) with fp32 block scales (s_ptr, row
    map srow_ptr), rows >= N8 (TAIL) bf16 (t_ptr); N8 is a multiple of BLOCK_N, so each program
    reads one of the two. Same prologues and epilogues. Unlike the bf16 kernel it loads nothing
    before the PDL wait and asks L2 for nothing after: neither made the fp8 step faster."""
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
        pdl_begin(PDL)
        rstd = _rstd(x_ptr, K, eps, PRO, KP, BLOCK_K)
        y, y_up = _acc(x_ptr, w_ptr, s_ptr, srow_ptr, nw_ptr, z_ptr, rows, r8, pid, N8, K, stride_w, stride_s, eps,
                       rstd, 0.0, 0.0, PRO, EPI, GROUP, STORE_XN, BLOCK_N, BLOCK_K, EVEN_K, 0, VEC, True, BKS, UNIFORM,
                       ROUND_W)
    _epilogue(y, y_up, y_ptr, aux0_ptr, aux1_ptr, rows, rmask, pid, CONV_N, EPI, KC, KCP)

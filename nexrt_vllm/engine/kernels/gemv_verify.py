"""The M-row GEMV kernels: M <= 8 rows of x (the speculative verify's positions pos..pos+M-1, the batch
step's request slots), bf16 W or an fp8.FP8Weight (e4m3 + block scales, optionally bf16 tail rows).

`gemv_rows_kernel`: y_j = W x_j for the M rows of x, each weight tile loaded once and multiplied by
every row, so M rows stream W's bytes once. The rows are a leading [MP] dimension (M padded to a
power of two, masked). Per row the M = 1 kernel's (kernels/gemv_step.py) ops and rounding points;
only the order of the fp32 sums differs (one FMA chain per 16-byte run). The conv epilogue runs the
M tokens in order from the live conv state without writing it, into a window the commit picks the
new state from. `gemv_rows_dot_kernel` does the same on the tensor cores, the weight tile as the
left operand of the product (the compiler then streams it through shared memory in pipeline stages).
Launched through `kernels.gemv.gemv(..., m=M)`.

FP8 (FP8): the weight tiles are e4m3, each column's block scale gathered beside the tile as the one-row
fp8 kernel does (gemv_step `_col_scales`). The fold kernel multiplies the scale into x (the one-row kernel's
products), or with ROUND_W rounds each e4m3 * scale to bf16. The tensor-core kernel multiplies a K block that lies
inside one scale block as it is (e4m3 is exact in bf16) and scales the block's sums per row; otherwise (or with
ROUND_W) it rounds each e4m3 * scale to bf16 first, the eager engine's dequantized weight. Rows past N8 (TAIL)
are bf16 at t_ptr: those programs run the bf16 loop.
"""
import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.common import bf16_round as _bf16
from nexrt_vllm.engine.kernels.common import l2_prefetch, pdl_begin
from nexrt_vllm.engine.kernels.common import silu as _silu
from nexrt_vllm.engine.kernels.gemv_step import _col_scales, _conv_state, _load_x, _rstd, _scale_row, _store_out


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
def _fold_fp8(acc, w, xv, s_ptr, srow, stride_s, cols, cmask, rmask, BKS: tl.constexpr, UNIFORM: tl.constexpr,
              ROUND_W: tl.constexpr, VEC: tl.constexpr):
    """`_fold_rows` of an e4m3 tile w [1, BN, BK] with the x rows xv [MP, BK]: each product w * (x * scale), as the
    one-row fp8 kernel's (gemv_step `_scaled_dot`), or with ROUND_W bf16(w * scale) * x."""
    s = _col_scales(s_ptr, srow, stride_s, cols, cmask, rmask, BKS, UNIFORM)
    if UNIFORM:
        s3 = s[None, None, :]
    else:
        s3 = s[None, :, :]
    if ROUND_W:
        out = _fold_rows(acc, _bf16(w.to(tl.float32) * s3), xv[:, None, :], VEC)
    else:
        out = _fold_rows(acc, w, xv[:, None, :] * s3, VEC)
    return out


@triton.jit
def _block_rows(acc, acc_u, w, wu, k0, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z, rstd, eps, pid, K,
                s_ptr, srow, srow_u, stride_s, rmask, PRO: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr,
                STORE_XN: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, FP8: tl.constexpr,
                BKS: tl.constexpr, UNIFORM: tl.constexpr, ROUND_W: tl.constexpr):
    """One K block (columns k0..) of the rows: the prologue's x rows, xn stored by program 0, and the
    loaded weight tile(s) [1, BLOCK_N, BLOCK_K] folded into acc (acc_u: SwiGLU up rows); FP8: e4m3 tiles
    with the block scales of scale rows srow (srow_u: the up rows') (`_fold_fp8`)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    cmask = cols < K
    xv = _x_block(x_ptr, stride_x, jrow, jm, cols, cmask, nw_ptr, z_ptr, stride_z, rstd, eps, pid, PRO, GROUP,
                  STORE_XN, BLOCK_K)
    if FP8:
        acc = _fold_fp8(acc, w, xv, s_ptr, srow, stride_s, cols, cmask, rmask, BKS, UNIFORM, ROUND_W, VEC)
        if EPI == 2:
            acc_u = _fold_fp8(acc_u, wu, xv, s_ptr, srow_u, stride_s, cols, cmask, rmask, BKS, UNIFORM, ROUND_W, VEC)
    else:
        acc = _fold_rows(acc, w, xv[:, None, :], VEC)
        if EPI == 2:
            acc_u = _fold_rows(acc_u, wu, xv[:, None, :], VEC)
    return acc, acc_u


@triton.jit
def _acc_rows(x_ptr, w_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows, rmask, pid, N, K, stride_w, eps, rstd,
              w0, w1, w2, w3, u0, u1, u2, u3, s_ptr, srow, srow_u, stride_s, PRO: tl.constexpr, EPI: tl.constexpr,
              GROUP: tl.constexpr, STORE_XN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, PRE: tl.constexpr, VEC: tl.constexpr, FP8: tl.constexpr, BKS: tl.constexpr,
              UNIFORM: tl.constexpr, ROUND_W: tl.constexpr):
    """`_acc` for every row of x: (y, y_up) [MP, BLOCK_N] fp32. The head tiles (w0.., u0..: the first PRE K
    blocks, `_w_head_rows`; bf16 W only) are folded as the loop folds the rest."""
    MP: tl.constexpr = jrow.shape[0]
    acc = tl.zeros([MP, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc_u = acc
    if PRE > 0:
        acc, acc_u = _block_rows(acc, acc_u, w0, u0, 0, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z, rstd, eps,
                                 pid, K, s_ptr, srow, srow_u, stride_s, rmask, PRO, EPI, GROUP, STORE_XN, BLOCK_K,
                                 VEC, False, BKS, UNIFORM, ROUND_W)
    if PRE > 1:
        acc, acc_u = _block_rows(acc, acc_u, w1, u1, BLOCK_K, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z, rstd,
                                 eps, pid, K, s_ptr, srow, srow_u, stride_s, rmask, PRO, EPI, GROUP, STORE_XN,
                                 BLOCK_K, VEC, False, BKS, UNIFORM, ROUND_W)
    if PRE > 2:
        acc, acc_u = _block_rows(acc, acc_u, w2, u2, 2 * BLOCK_K, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z,
                                 rstd, eps, pid, K, s_ptr, srow, srow_u, stride_s, rmask, PRO, EPI, GROUP, STORE_XN,
                                 BLOCK_K, VEC, False, BKS, UNIFORM, ROUND_W)
        acc, acc_u = _block_rows(acc, acc_u, w3, u3, 3 * BLOCK_K, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z,
                                 rstd, eps, pid, K, s_ptr, srow, srow_u, stride_s, rmask, PRO, EPI, GROUP, STORE_XN,
                                 BLOCK_K, VEC, False, BKS, UNIFORM, ROUND_W)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
        w = _w_tile(w_ptr, rows, rmask, k0 + offs_k, K, stride_w, EVEN_K)
        wu = w
        if EPI == 2:
            wu = _w_tile(w_ptr + N * stride_w, rows, rmask, k0 + offs_k, K, stride_w, EVEN_K)
        acc, acc_u = _block_rows(acc, acc_u, w, wu, k0, x_ptr, stride_x, jrow, jm, nw_ptr, z_ptr, stride_z, rstd,
                                 eps, pid, K, s_ptr, srow, srow_u, stride_s, rmask, PRO, EPI, GROUP, STORE_XN,
                                 BLOCK_K, VEC, FP8, BKS, UNIFORM, ROUND_W)
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
def gemv_rows_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, z_ptr, aux0_ptr, aux1_ptr, win_ptr, s_ptr, srow_ptr, t_ptr,
                     N, K, N8, stride_w, stride_s, stride_t, stride_x, stride_y, stride_z, stride_a, stride_win, eps,
                     CONV_N, M: tl.constexpr, MP: tl.constexpr, PRO: tl.constexpr, EPI: tl.constexpr,
                     GROUP: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, STORE_XN: tl.constexpr,
                     KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     PRE: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr, BKS: tl.constexpr,
                     UNIFORM: tl.constexpr, ROUND_W: tl.constexpr, TAIL: tl.constexpr, pf_ptr, pf_off1, pf_each,
                     pf_chunk, PF: tl.constexpr):
    """`gemv_kernel` over the M rows of x [M, K] (row stride stride_x) into y [M, N] (stride_y): one
    load of each weight tile (the same tiles, prefetch head and eviction as M = 1) feeds M dot
    products. Same prologues and epilogues per row (`_epilogue_rows`). FP8: `gemv_fp8_kernel`'s
    operands (s_ptr, srow_ptr; rows >= N8 bf16 at t_ptr with TAIL). PF: `gemv_kernel`'s L2 request for the
    next GEMV's first weight bytes when the program is done (common.l2_prefetch)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    jrow = tl.arange(0, MP)
    jm = jrow < M
    y, y_up = _gemv_rows_w(x_ptr, w_ptr, s_ptr, srow_ptr, t_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows,
                           rmask, pid, N, K, N8, stride_w, stride_s, stride_t, eps, PRO, EPI, GROUP, STORE_XN, KP,
                           BLOCK_N, BLOCK_K, EVEN_K, 0, PRE, VEC, PDL, 1, FP8, BKS, UNIFORM, ROUND_W, TAIL)
    _epilogue_rows(y, y_up, y_ptr, stride_y, aux0_ptr, aux1_ptr, stride_a, win_ptr, stride_win, jrow, jm, rows, rmask,
                   pid, CONV_N, EPI, KC, KCP)
    l2_prefetch(pf_ptr, pf_off1, pf_each, pf_chunk, pid, PF)


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
def _dot_w(w, xt, acc, s_ptr, srow, stride_s, sc, rmask, UNIFORM: tl.constexpr, SCALED: tl.constexpr,
           DOT: tl.constexpr):
    """acc + w @ xt (`_dot_t`) for a tile from `_w_dot_tile`; SCALED (an e4m3 tile as bf16 within one column block
    of the scale grid): the tile's sums times each weight row's block scale at scale column sc, srow the program's
    scale row (UNIFORM) or each row's."""
    if SCALED:
        p = _dot_t(w, xt, tl.zeros_like(acc), DOT)
        if UNIFORM:
            out = acc + p * tl.load(s_ptr + srow * stride_s + sc)
        else:
            out = acc + p * tl.load(s_ptr + srow * stride_s + sc, mask=rmask, other=0.0)[:, None]
    else:
        out = _dot_t(w, xt, acc, DOT)
    return out


@triton.jit
def _w_dot_tile(wp, wmask, s_ptr, srow, stride_s, cols, cmask, rmask, FP8: tl.constexpr, BKS: tl.constexpr,
                UNIFORM: tl.constexpr, SCALED: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile for `_dot_w`: bf16 W as loaded; FP8 with SCALED: the e4m3 values as bf16
    (exact; scaled after the product); FP8 otherwise: each e4m3 * its column's block scale rounded to bf16 (the
    eager engine's dequantized weight, exactly)."""
    w = tl.load(wp, mask=wmask, other=0.0, eviction_policy="evict_first")
    if SCALED:
        w = w.to(tl.bfloat16)
    elif FP8:
        s = _col_scales(s_ptr, srow, stride_s, cols, cmask, rmask, BKS, UNIFORM)
        if UNIFORM:
            w = _bf16(w.to(tl.float32) * s[None, :]).to(tl.bfloat16)
        else:
            w = _bf16(w.to(tl.float32) * s).to(tl.bfloat16)
    return w


@triton.jit
def _scale_rows(srow_ptr, pid, rows, rmask, N, EPI: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
                UNIFORM: tl.constexpr):
    """(srow, srow_u): the scale rows of the program's rows of an e4m3 W and of its SwiGLU up rows N + rows
    (`_scale_row`); 0 for bf16 W."""
    srow = 0
    srow_u = 0
    if FP8:
        srow = _scale_row(srow_ptr, pid * BLOCK_N, rows, rmask, FP8, UNIFORM)
        srow_u = srow
        if EPI == 2:
            srow_u = _scale_row(srow_ptr + N, pid * BLOCK_N, rows, rmask, FP8, UNIFORM)
    return srow, srow_u


@triton.jit
def _gemv_rows(x_ptr, w_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows, rmask, pid, N, K, stride_w, eps,
               PRO: tl.constexpr, EPI: tl.constexpr, GROUP: tl.constexpr, STORE_XN: tl.constexpr, KP: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr,
               PRE: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr, SPLITS: tl.constexpr = 1,
               s_ptr=None, srow_ptr=None, stride_s=0, FP8: tl.constexpr = False, BKS: tl.constexpr = 1,
               UNIFORM: tl.constexpr = True, ROUND_W: tl.constexpr = False):
    """y, y_up [MP, BLOCK_N]: this program's BLOCK_N outputs for the M rows of x after the prologue (y_up: EPI 2's
    up half), PDL's wait included. DOT 0: `gemv_rows_kernel`'s fold (PRE K blocks of W loaded before the
    wait, VEC-column FMA runs); DOT 1 / 2: `gemv_rows_dot_kernel`'s tensor-core loop (`_dot_t`), over the
    K blocks of split program_id(1) of SPLITS (the split's partial sums). FP8: W is e4m3 with block scales
    (s_ptr, row map srow_ptr; no PRE)."""
    MP: tl.constexpr = jrow.shape[0]
    tl.static_assert(not FP8 or PRE == 0, "FP8 weights load nothing before the wait")
    if DOT == 0:
        w0, w1, w2, w3, u0, u1, u2, u3 = _w_head_rows(w_ptr, rows, rmask, N, K, stride_w, EPI, BLOCK_K, PRE)
        pdl_begin(PDL)
        srow, srow_u = _scale_rows(srow_ptr, pid, rows, rmask, N, EPI, BLOCK_N, FP8, UNIFORM)
        rstd = _rstd_rows(x_ptr, stride_x, jrow, jm, K, eps, PRO, KP, BLOCK_K)
        y, y_up = _acc_rows(x_ptr, w_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows, rmask, pid, N, K,
                            stride_w, eps, rstd, w0, w1, w2, w3, u0, u1, u2, u3, s_ptr, srow, srow_u, stride_s, PRO,
                            EPI, GROUP, STORE_XN, BLOCK_N, BLOCK_K, EVEN_K, PRE, VEC, FP8, BKS, UNIFORM, ROUND_W)
    else:
        acc = tl.zeros([BLOCK_N, MP], dtype=tl.float32)
        acc_u = acc
        offs_k = tl.arange(0, BLOCK_K)
        k_lo = 0
        k_hi = K
        if SPLITS > 1:  # whole K blocks per split, the last split's range cut at K
            per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLITS) * BLOCK_K
            k_lo = tl.program_id(1) * per
            k_hi = tl.minimum(K, k_lo + per)
        pdl_begin(PDL)
        srow, srow_u = _scale_rows(srow_ptr, pid, rows, rmask, N, EPI, BLOCK_N, FP8, UNIFORM)
        rstd = _rstd_rows(x_ptr, stride_x, jrow, jm, K, eps, PRO, KP, BLOCK_K)
        # FP8 with K blocks inside scale blocks: each tile's products on the tensor cores as loaded (e4m3 is exact
        # in bf16), times the block's scale per row after (`_dot_w`); else each weight dequantized first (`_w_dot_tile`)
        SCALED: tl.constexpr = FP8 and not ROUND_W and BKS % BLOCK_K == 0
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + offs_k
            cmask = cols < K
            if EVEN_K:
                wmask = rmask[:, None]
            else:
                wmask = rmask[:, None] & cmask[None, :]
            wp = w_ptr + rows[:, None] * stride_w + cols[None, :]
            w = _w_dot_tile(wp, wmask, s_ptr, srow, stride_s, cols, cmask, rmask, FP8, BKS, UNIFORM, SCALED)
            xt = tl.trans(_x_block(x_ptr, stride_x, jrow, jm, cols, cmask, nw_ptr, z_ptr, stride_z, rstd, eps, pid,
                                   PRO, GROUP, STORE_XN, BLOCK_K))
            acc = _dot_w(w, xt, acc, s_ptr, srow, stride_s, k0 // BKS, rmask, UNIFORM, SCALED, DOT)
            if EPI == 2:
                wu = _w_dot_tile(wp + N * stride_w, wmask, s_ptr, srow_u, stride_s, cols, cmask, rmask, FP8, BKS,
                                 UNIFORM, SCALED)
                acc_u = _dot_w(wu, xt, acc_u, s_ptr, srow_u, stride_s, k0 // BKS, rmask, UNIFORM, SCALED, DOT)
        y, y_up = tl.trans(acc), tl.trans(acc_u)
    return y, y_up


@triton.jit
def _gemv_rows_w(x_ptr, w_ptr, s_ptr, srow_ptr, t_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows, rmask, pid,
                 N, K, N8, stride_w, stride_s, stride_t, eps, PRO: tl.constexpr, EPI: tl.constexpr,
                 GROUP: tl.constexpr, STORE_XN: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr, PRE: tl.constexpr,
                 VEC: tl.constexpr, PDL: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr, BKS: tl.constexpr,
                 UNIFORM: tl.constexpr, ROUND_W: tl.constexpr, TAIL: tl.constexpr):
    """`_gemv_rows` over the launch's weight: bf16 W, or FP8 e4m3 rows < N8 and (TAIL) bf16 rows >= N8 at t_ptr
    (N8 a multiple of BLOCK_N, so each program reads one of the two, as `gemv_fp8_kernel`'s do)."""
    if FP8:
        if TAIL and pid * BLOCK_N >= N8:
            y, y_up = _gemv_rows(x_ptr, t_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows - N8, rmask, pid,
                                 N - N8, K, stride_t, eps, PRO, EPI, GROUP, STORE_XN, KP, BLOCK_N, BLOCK_K, EVEN_K,
                                 DOT, 0, VEC, PDL, SPLITS)
        else:
            y, y_up = _gemv_rows(x_ptr, w_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows, rmask & (rows < N8),
                                 pid, N8, K, stride_w, eps, PRO, EPI, GROUP, STORE_XN, KP, BLOCK_N, BLOCK_K, EVEN_K,
                                 DOT, 0, VEC, PDL, SPLITS, s_ptr, srow_ptr, stride_s, True, BKS, UNIFORM, ROUND_W)
    else:
        y, y_up = _gemv_rows(x_ptr, w_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows, rmask, pid, N, K,
                             stride_w, eps, PRO, EPI, GROUP, STORE_XN, KP, BLOCK_N, BLOCK_K, EVEN_K, DOT, PRE, VEC,
                             PDL, SPLITS)
    return y, y_up


@triton.jit
def _split_sum(y, y_up, part_ptr, cnt_ptr, pid, n_tiles, EPI: tl.constexpr, SPLITS: tl.constexpr):
    """Split-K fixup of tile pid: store this split's partials y (and EPI 2's y_up) [MP, BLOCK_N] at part_ptr
    [2, SPLITS, n_tiles, MP * BLOCK_N] fp32, count the arrival on cnt_ptr[pid] (acq_rel: the partials of
    every earlier arrival are visible to the last); the last arrival resets the counter to 0 for the next
    launch and returns the sums of all splits in split order. Returns (y, y_up, last: 1 or 0, an int32)."""
    MP: tl.constexpr = y.shape[0]
    BN: tl.constexpr = y.shape[1]
    idx = tl.arange(0, MP)[:, None] * BN + tl.arange(0, BN)[None, :]
    tile = MP * BN
    half = SPLITS * n_tiles * tile
    mine = (tl.program_id(1) * n_tiles + pid) * tile
    tl.store(part_ptr + mine + idx, y)
    if EPI == 2:
        tl.store(part_ptr + half + mine + idx, y_up)
    tl.debug_barrier()  # every thread's partials stored before the one-thread release below
    arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
    # as an int: the interpreter's masks built from an atomic's compare come out int32 and are refused
    last = (arrived == SPLITS - 1).to(tl.int32)
    lim = last * tile  # this tile's partials when last, else none
    y = tl.zeros([MP, BN], dtype=tl.float32)
    y_up = y
    for s in tl.static_range(SPLITS):
        at = part_ptr + (s * n_tiles + pid) * tile + idx
        y += tl.load(at, mask=idx < lim, other=0.0, cache_modifier=".cg")
        if EPI == 2:
            y_up += tl.load(at + half, mask=idx < lim, other=0.0, cache_modifier=".cg")
    tl.store(cnt_ptr + pid, 0, mask=lim > 0)
    return y, y_up, last


@triton.jit
def gemv_rows_dot_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, z_ptr, aux0_ptr, aux1_ptr, win_ptr, s_ptr, srow_ptr, t_ptr,
                         N, K, N8, stride_w, stride_s, stride_t, stride_x, stride_y, stride_z, stride_a, stride_win,
                         eps, CONV_N, M: tl.constexpr, MP: tl.constexpr, PRO: tl.constexpr, EPI: tl.constexpr,
                         GROUP: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, STORE_XN: tl.constexpr,
                         KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         DOT: tl.constexpr, PDL: tl.constexpr, SPLITS: tl.constexpr, part_ptr, cnt_ptr,
                         FP8: tl.constexpr, BKS: tl.constexpr, UNIFORM: tl.constexpr, ROUND_W: tl.constexpr,
                         TAIL: tl.constexpr, pf_ptr, pf_off1, pf_each, pf_chunk, PF: tl.constexpr):
    """`gemv_rows_kernel` through the tensor cores with the weight as the left operand: acc [BLOCK_N, MP] =
    W[rows] @ x^T (the compiler pads the MP columns to the instruction's). Each weight tile goes from the load
    straight into the product, so the compiler streams it through shared memory in pipeline stages
    (num_stages); the x rows take the prologue per K block. Same epilogues (`_epilogue_rows`).

    SPLITS > 1 (grid [tiles, SPLITS]): each program sums its share of K (`_split_sum`); the last of a tile's
    programs to finish adds the tile's partials in split order and runs the epilogue, so a launch over few
    output rows streams its weight from SPLITS times the programs and the sums do not depend on which
    program finishes last.
    FP8: as `gemv_rows_kernel`'s: a K block inside one scale block goes to the tensor cores as e4m3 (exact in bf16)
    and its products are scaled per row after (`_dot_w`); otherwise, or with ROUND_W, each weight is rounded
    to bf16 after its scale first (`_w_dot_tile`: the eager engine's dequantized weight).
    PF: as `gemv_rows_kernel`'s, each of the grid's programs (splits included) asking for its share."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    jrow = tl.arange(0, MP)
    jm = jrow < M
    y, y_up = _gemv_rows_w(x_ptr, w_ptr, s_ptr, srow_ptr, t_ptr, nw_ptr, z_ptr, stride_x, stride_z, jrow, jm, rows,
                           rmask, pid, N, K, N8, stride_w, stride_s, stride_t, eps, PRO, EPI, GROUP, STORE_XN, KP,
                           BLOCK_N, BLOCK_K, EVEN_K, DOT, 0, 1, PDL, SPLITS, FP8, BKS, UNIFORM, ROUND_W, TAIL)
    if SPLITS > 1:
        y, y_up, last = _split_sum(y, y_up, part_ptr, cnt_ptr, pid, tl.num_programs(0), EPI, SPLITS)
        rmask = rows < N * last  # the epilogue's stores: the last program's only
        jm = jrow < M * last
    _epilogue_rows(y, y_up, y_ptr, stride_y, aux0_ptr, aux1_ptr, stride_a, win_ptr, stride_win, jrow, jm, rows, rmask,
                   pid, CONV_N, EPI, KC, KCP)
    l2_prefetch(pf_ptr, pf_off1, pf_each, pf_chunk, tl.program_id(1) * tl.num_programs(0) + pid, PF)


@triton.jit
def rmsnorm_rows_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, K, eps, KP: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
    """Row r of out = the PRO 1 prologue of row r of x (the one-row GEMV's `_rstd` and `_load_x`, the same
    ops and order), once per row: the plain M-row GEMV over out then stands in for the PRO 1 launch,
    whose every program re-reads and re-normalizes all the rows (Tuning.norm_rows)."""
    r = tl.program_id(0)
    pdl_begin(PDL)
    xr = x_ptr + r * stride_x
    rstd = _rstd(xr, K, eps, 1, KP, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cm = cols < K
        xn = _load_x(xr, cols, cm, w_ptr, w_ptr, rstd, eps, 1, 1, BLOCK_K)
        tl.store(out_ptr + r * stride_out + cols, xn.to(out_ptr.dtype.element_ty), mask=cm)

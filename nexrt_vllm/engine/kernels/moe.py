"""Sparse MoE for one token: only the selected experts' weights are read, each exactly once.

Launch 1 is the router GEMV (`gemv`, RMSNorm prologue, `xn_out`) over [router; shared_expert_gate]
rows; its program 0 also stores the normed input for the experts. Launch 2 (`moe_gate_up_kernel`,
grid (intermediate blocks, 1 + top_k)) routes and writes SiLU(gate)·up for its slot's expert: each
routed program repeats the top-k selection (softmax over E in fp32, top-k, renormalise, ids
ascending) from the router logits before its first weight load, which costs less than a launch of
its own; grid column 0 is the shared expert (its act row is the last). Launch 3 (`moe_down_kernel`)
sums the down projections in ascending expert id (the eager order, with its bf16 rounding), adds
the sigmoid-gated shared expert and the residual. With fp8 weights (fp8.FP8Weight) launches 2 and 3
are `moe_gate_up_fp8_kernel` / `moe_down_fp8_kernel`: the same design reading e4m3 + block scales.
"""
import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.common import LAUNCH, pdl_begin
from nexrt_vllm.engine.kernels.common import bf16_round as _bf16
from nexrt_vllm.engine.kernels.common import silu as _silu
from nexrt_vllm.engine.kernels.gemv import fold_vec
from nexrt_vllm.engine.kernels.gemv_step import _col_scales, _fold, _scale_row, _scaled_dot, _w_dot


@triton.jit
def topk_select(logits_ptr, E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, NORM: tl.constexpr):
    """(expert index e [EP], selected mask, slot of each selected expert (ascending id), weights in
    bf16 precision) of one token's top-k routing from its router logits."""
    e = tl.arange(0, EP)
    em = e < E
    lg = tl.load(logits_ptr + e, mask=em, other=float("-inf")).to(tl.float32)
    p = tl.exp(lg - tl.max(lg, 0))
    p = p / tl.sum(p, 0)
    # One max-reduction per pick: key = (bits of p >= 0, order-preserving) << 32 | (EP-1-e), so the
    # max key is the largest probability and, among equals, the lowest expert id.
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (EP - 1 - e).to(tl.int64)
    key = tl.where(em, key, -1)
    sel = e < 0
    for _ in tl.static_range(TOPK):
        idx = EP - 1 - (tl.max(key, 0) & 0xFFFFFFFF).to(tl.int32)
        sel = sel | (e == idx)
        key = tl.where(e == idx, -1, key)
    wsum = tl.sum(tl.where(sel, p, 0.0), 0) if NORM else 1.0
    rank = tl.cumsum(sel.to(tl.int32), 0) - 1
    return e, sel, rank, _bf16(p / wsum)


@triton.jit
def _row_mask(rows, n, EVEN: tl.constexpr):
    """rows < n, or (EVEN: all of them lie below n) a constant true mask, which the compiler drops. The
    fp8 kernels use it (their expert launches are faster without the mask); the bf16 ones keep their
    masks (unmasked, theirs were slower)."""
    if EVEN:
        m = tl.full(rows.shape, 1, tl.int1)
    else:
        m = rows < n
    return m


@triton.jit
def _swiglu_rows(x_ptr, wbase, sbase, srow_ptr, stride_s, n_rows, rows, row0, K: tl.constexpr,
                 BLOCK_K: tl.constexpr, BKS: tl.constexpr, FP8: tl.constexpr, UNIFORM: tl.constexpr,
                 ROUND_W: tl.constexpr, VEC: tl.constexpr, EVEN: tl.constexpr):
    """SiLU(W_gate x)·(W_up x) for `rows` of a [2 n_rows, K] expert: bf16, or with FP8 e4m3 with block
    scales (sbase, row map srow_ptr). K is a compile-time constant and the loop is unrolled: no K
    block's loads wait for the previous block's arithmetic, so a program's whole slice can be in
    flight at once (a rolled loop costs one dependent HBM round trip per block). EVEN: every row of
    the grid is a row of the expert (no row mask; `_row_mask`)."""
    rmask = _row_mask(rows, n_rows, EVEN)
    offs_k = tl.arange(0, BLOCK_K)
    sr_g = 0
    sr_u = 0
    if FP8:
        ok = row0 < n_rows  # a program past this expert's rows (a wider shared expert) reads no scale row
        if UNIFORM:
            sr_g = tl.load(srow_ptr + row0, mask=ok, other=0)
            sr_u = tl.load(srow_ptr + n_rows + row0, mask=ok, other=0)
        else:
            sr_g = tl.load(srow_ptr + rows, mask=rmask, other=0)
            sr_u = tl.load(srow_ptr + n_rows + rows, mask=rmask, other=0)
    BN: tl.constexpr = rows.shape[0]
    acc_g = tl.zeros([BN, BLOCK_K // VEC], dtype=tl.float32)
    acc_u = tl.zeros([BN, BLOCK_K // VEC], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        cols = k0 + offs_k
        cmask = _row_mask(cols, K, FP8 and K % BLOCK_K == 0)
        wp = wbase + rows[:, None] * K + cols[None, :]
        m2 = rmask[:, None] & cmask[None, :]
        wg = tl.load(wp, mask=m2, other=0.0, eviction_policy="evict_first")
        wu = tl.load(wp + n_rows * K, mask=m2, other=0.0, eviction_policy="evict_first")
        xv = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        smask = cmask & _row_mask(offs_k * 0 + row0, n_rows, EVEN)  # (a scalar & a vector trips the interpreter)
        acc_g += _fold(_w_dot(wg, xv, sbase, sr_g, stride_s, cols, smask, rmask, BKS, FP8, UNIFORM, ROUND_W),
                       BN, BLOCK_K, VEC)
        acc_u += _fold(_w_dot(wu, xv, sbase, sr_u, stride_s, cols, smask, rmask, BKS, FP8, UNIFORM, ROUND_W),
                       BN, BLOCK_K, VEC)
    g = _bf16(tl.sum(acc_g, 1))
    u = _bf16(tl.sum(acc_u, 1))
    return _bf16(_bf16(_silu(g)) * u)


@triton.jit
def _route_slot(logits_ptr, ids_ptr, wts_ptr, pid, slot, E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr,
                NORM: tl.constexpr):
    """The expert of routed slot `slot` (ascending ids); the programs with pid 0 publish its id and
    weight for the down launch."""
    e, sel, rank, w = topk_select(logits_ptr, E, EP, TOPK, NORM)
    mine = sel & (rank == slot)
    eid = tl.sum(tl.where(mine, e, 0), 0)
    if pid == 0:
        tl.store(ids_ptr + slot, eid)
        tl.store(wts_ptr + slot, tl.sum(tl.where(mine, w, 0.0), 0))
    return eid


@triton.jit
def _token_row(c, M: tl.constexpr, TOPK: tl.constexpr):
    """(token row, routed slot or -1 for the shared expert) of gate_up grid column c: columns 0..M-1
    are the rows' shared experts (adjacent, so M rows' reads of the same tiles meet in L2), then each
    row's TOPK routed slots."""
    if M == 1:
        return 0, c - 1
    else:
        shared = c < M
        r = tl.where(shared, c, (c - M) // TOPK)
        return r, tl.where(shared, -1, (c - M) % TOPK)


@triton.jit
def _gate_up(x_ptr, gu_ptr, gus_ptr, gur_ptr, sgu_ptr, sgus_ptr, sgur_ptr, act_ptr, ids_ptr, logits_ptr, wts_ptr,
             stride_ge, stride_gse, stride_gs, stride_sgs, stride_x, stride_a, stride_r, stride_l,
             K: tl.constexpr, I: tl.constexpr, IS: tl.constexpr,
             TOPK: tl.constexpr, IMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E: tl.constexpr,
             EP: tl.constexpr, NORM: tl.constexpr, BKS: tl.constexpr, FP8_E: tl.constexpr, FP8_S: tl.constexpr,
             UNI_E: tl.constexpr, UNI_S: tl.constexpr, ROUND_W: tl.constexpr, VEC_E: tl.constexpr,
             VEC_S: tl.constexpr, M: tl.constexpr, PDL: tl.constexpr):
    """Launch 2 (bf16 and fp8 alike). Grid column 0 is the shared expert (scheduled first: it needs no
    routing, so its loads start while the routed programs select their experts); columns 1..TOPK
    are routed slots 0..TOPK-1: each routed program selects its own slot's expert (`_route_slot`).
    With M token rows (`_token_row`) each row's programs are those of one row, over its own x, logits,
    act, ids and wts (row strides stride_x, stride_l, stride_a, stride_r)."""
    pdl_begin(PDL)
    EVEN: tl.constexpr = (FP8_E or FP8_S) and (I == IS) and (I % BLOCK_N == 0)
    pid = tl.program_id(0)
    r, slot = _token_row(tl.program_id(1), M, TOPK)
    if M > 1:
        x_ptr += r * stride_x
        logits_ptr += r * stride_l
        act_ptr += r * stride_a
        ids_ptr += r * stride_r
        wts_ptr += r * stride_r
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if FP8_E or FP8_S:  # one expert loop per format (the routed and the shared one may differ)
        if slot >= 0:
            eid = _route_slot(logits_ptr, ids_ptr, wts_ptr, pid, slot, E, EP, TOPK, NORM)
            a = _swiglu_rows(x_ptr, gu_ptr + eid.to(tl.int64) * stride_ge, gus_ptr + eid.to(tl.int64) * stride_gse,
                             gur_ptr, stride_gs, I, rows, pid * BLOCK_N, K, BLOCK_K, BKS, FP8_E, UNI_E, ROUND_W, VEC_E,
                             EVEN)
            tl.store(act_ptr + slot * IMAX + rows, a.to(act_ptr.dtype.element_ty), mask=rows < I)
        else:
            a = _swiglu_rows(x_ptr, sgu_ptr, sgus_ptr, sgur_ptr, stride_sgs, IS, rows, pid * BLOCK_N, K, BLOCK_K, BKS,
                             FP8_S, UNI_S, ROUND_W, VEC_S, EVEN)
            tl.store(act_ptr + TOPK * IMAX + rows, a.to(act_ptr.dtype.element_ty), mask=rows < IS)
    else:  # bf16: one loop over the selected weight (half the code)
        if slot >= 0:
            eid = _route_slot(logits_ptr, ids_ptr, wts_ptr, pid, slot, E, EP, TOPK, NORM)
            wbase = gu_ptr + eid.to(tl.int64) * stride_ge
            n_rows = I
        else:
            wbase = sgu_ptr
            n_rows = IS
            slot = TOPK  # the shared expert's act row is the last
        a = _swiglu_rows(x_ptr, wbase, wbase, gur_ptr, 0, n_rows, rows, pid * BLOCK_N, K, BLOCK_K, BKS, False, True,
                         False, VEC_E, EVEN)
        tl.store(act_ptr + slot * IMAX + rows, a.to(act_ptr.dtype.element_ty), mask=rows < n_rows)


@triton.jit
def moe_gate_up_kernel(x_ptr, gu_ptr, sgu_ptr, act_ptr, ids_ptr, logits_ptr, wts_ptr, stride_ge,
                       stride_x, stride_a, stride_r, stride_l, live_ptr,
                       K: tl.constexpr, I: tl.constexpr, IS: tl.constexpr,
                       TOPK: tl.constexpr, IMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       E: tl.constexpr, EP: tl.constexpr, NORM: tl.constexpr, VEC: tl.constexpr,
                       M: tl.constexpr, HAS_LIVE: tl.constexpr, PDL: tl.constexpr):
    """Launch 2 over bf16 weights (`_gate_up`); HAS_LIVE: the programs of a row whose live word is 0 idle
    (`_row_live`)."""
    if _row_live(live_ptr, _token_row(tl.program_id(1), M, TOPK)[0], HAS_LIVE, PDL):
        _gate_up(x_ptr, gu_ptr, gu_ptr, ids_ptr, sgu_ptr, sgu_ptr, ids_ptr, act_ptr, ids_ptr, logits_ptr, wts_ptr,
                 stride_ge, 0, 0, 0, stride_x, stride_a, stride_r, stride_l, K, I, IS, TOPK, IMAX, BLOCK_N, BLOCK_K,
                 E, EP, NORM, 1, False, False, True, True, False, VEC, VEC, M, PDL and not HAS_LIVE)


@triton.jit
def _row_live(live_ptr, r, HAS_LIVE: tl.constexpr, PDL: tl.constexpr):
    """Whether token row r computes: with HAS_LIVE (the batch step's rows, one per request slot) its live word,
    read after the PDL wait (which the launch's body then skips); else always."""
    on = True
    if HAS_LIVE:
        pdl_begin(PDL)
        on = tl.load(live_ptr + r) != 0
    return on


@triton.jit
def _fold3(p, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """`gemv_step._fold` of [S, BLOCK_N, BLOCK_K] products (one slice per selected expert)."""
    return tl.sum(tl.reshape(p, (S, BLOCK_N, BLOCK_K // VEC, VEC)), 3)


@triton.jit
def _shared_tile(sdn_ptr, sdns_ptr, sr, stride_sds, rows, rmask, k0, IS: tl.constexpr, BLOCK_K: tl.constexpr,
                 BKS: tl.constexpr, FP8: tl.constexpr, UNIFORM: tl.constexpr):
    """K block k0 of the shared expert's down rows `rows` [BLOCK_N, BLOCK_K] and, when FP8, each
    column's block scale (`gemv_step._col_scales`)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    cm = _row_mask(cols, IS, FP8 and IS % BLOCK_K == 0)
    wv = tl.load(sdn_ptr + rows[:, None] * IS + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0,
                 eviction_policy="evict_first")
    sv = 0.0
    if FP8:
        sv = _col_scales(sdns_ptr, sr, stride_sds, cols, cm, rmask, BKS, UNIFORM)
    return wv, sv


@triton.jit
def _shared_dot(wv, sv, a, FP8: tl.constexpr, UNIFORM: tl.constexpr, ROUND_W: tl.constexpr):
    if FP8:
        p = _scaled_dot(wv, a, sv, UNIFORM, ROUND_W)
    else:
        p = wv.to(tl.float32) * a[None, :]
    return p


@triton.jit
def _routed_tile(base, sbase, sr, stride_ds, sm, rmask, k0, I: tl.constexpr, BLOCK_K: tl.constexpr,
                 BKS: tl.constexpr, FP8: tl.constexpr, UNIFORM: tl.constexpr):
    """K block k0 of every selected expert's down rows in one gather load [TOPKP, BLOCK_N, BLOCK_K]
    (all of a program's weight bytes can be in flight together) and, when FP8, their column scales
    ([TOPKP, BLOCK_K] for UNIFORM rows, else [TOPKP, BLOCK_N, BLOCK_K])."""
    cols = k0 + tl.arange(0, BLOCK_K)
    cm = _row_mask(cols, I, FP8 and I % BLOCK_K == 0)
    wv = tl.load(base + cols[None, None, :], mask=sm[:, None, None] & rmask[None, :, None] & cm[None, None, :],
                 other=0.0, eviction_policy="evict_first")
    sv = 0.0
    if FP8:
        if UNIFORM:
            sv = tl.load(sbase[:, None] + sr * stride_ds + (cols // BKS)[None, :], mask=sm[:, None] & cm[None, :],
                         other=0.0)
        else:
            sv = tl.load(sbase[:, None, None] + sr[None, :, None] * stride_ds + (cols // BKS)[None, None, :],
                         mask=sm[:, None, None] & rmask[None, :, None] & cm[None, None, :], other=0.0)
    return wv, sv


@triton.jit
def _routed_dot(wv, sv, a, FP8: tl.constexpr, UNIFORM: tl.constexpr, ROUND_W: tl.constexpr):
    """Products of a `_routed_tile` with the selected experts' act rows a [TOPKP, BLOCK_K] (fp32)."""
    if FP8:
        if UNIFORM:
            if ROUND_W:
                p = _bf16(wv.to(tl.float32) * sv[:, None, :]) * a[:, None, :]
            else:
                p = wv.to(tl.float32) * (a * sv)[:, None, :]
        else:
            if ROUND_W:
                p = _bf16(wv.to(tl.float32) * sv) * a[:, None, :]
            else:
                p = wv.to(tl.float32) * (a[:, None, :] * sv)
    else:
        p = wv.to(tl.float32) * a[:, None, :]
    return p


@triton.jit
def _down(act_ptr, dn_ptr, dns_ptr, dnr_ptr, sdn_ptr, sdns_ptr, sdnr_ptr, ids_ptr, wts_ptr, logits_ptr, res_ptr, N,
          stride_de, stride_dse, stride_ds, stride_sds, stride_a, stride_r, stride_l, stride_res,
          I: tl.constexpr, IS: tl.constexpr, E: tl.constexpr,
          TOPK: tl.constexpr, TOPKP: tl.constexpr, IMAX: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BKS: tl.constexpr, FP8_E: tl.constexpr,
          FP8_S: tl.constexpr, UNI_E: tl.constexpr, UNI_S: tl.constexpr, ROUND_W: tl.constexpr,
          VEC_E: tl.constexpr, VEC_S: tl.constexpr, M: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    """The down launch (bf16 and fp8 alike): shared expert rows, then every selected expert's rows in
    one gather load per K block (`_routed_tile`: all of the program's weight bytes can be in flight
    together; expert after expert, each bf16 sum would wait for its own round trip), summed in
    ascending expert id (the eager order, with its bf16 rounding); the sigmoid-gated shared expert
    and the residual. With M token rows, grid axis 1 is the row (its act, ids, wts, logits, residual).
    EVEN: N is a multiple of BLOCK_N (no row mask; `_row_mask`)."""
    pdl_begin(PDL)
    pid = tl.program_id(0)
    if M > 1:
        r = tl.program_id(1)
        act_ptr += r * stride_a
        ids_ptr += r * stride_r
        wts_ptr += r * stride_r
        logits_ptr += r * stride_l
        res_ptr += r * stride_res
    row0 = pid * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    rmask = _row_mask(rows, N, EVEN)
    offs_k = tl.arange(0, BLOCK_K)
    ssr = _scale_row(sdnr_ptr, row0, rows, rmask, FP8_S, UNI_S)
    act_s = act_ptr + TOPK * IMAX
    acc_s = tl.zeros([BLOCK_N, BLOCK_K // VEC_S], dtype=tl.float32)
    for k0 in tl.static_range(0, IS, BLOCK_K):
        cols = k0 + offs_k
        a = tl.load(act_s + cols, mask=cols < IS, other=0.0).to(tl.float32)
        wv, sv = _shared_tile(sdn_ptr, sdns_ptr, ssr, stride_sds, rows, rmask, k0, IS, BLOCK_K, BKS, FP8_S, UNI_S)
        acc_s += _fold(_shared_dot(wv, sv, a, FP8_S, UNI_S, ROUND_W), BLOCK_N, BLOCK_K, VEC_S)
    s = tl.arange(0, TOPKP)
    sm = _row_mask(s, TOPK, FP8_E and TOPK == TOPKP)
    eid = tl.load(ids_ptr + s, mask=sm, other=0)
    base = dn_ptr + eid.to(tl.int64)[:, None, None] * stride_de + rows[None, :, None] * I
    sbase = dns_ptr + eid.to(tl.int64) * stride_dse
    sr = _scale_row(dnr_ptr, row0, rows, rmask, FP8_E, UNI_E)
    acc = tl.zeros([TOPKP, BLOCK_N, BLOCK_K // VEC_E], dtype=tl.float32)
    for k0 in tl.static_range(0, I, BLOCK_K):
        cols = k0 + offs_k
        a = tl.load(act_ptr + s[:, None] * IMAX + cols[None, :], mask=sm[:, None] & (cols < I)[None, :],
                    other=0.0).to(tl.float32)
        wv, sv = _routed_tile(base, sbase, sr, stride_ds, sm, rmask, k0, I, BLOCK_K, BKS, FP8_E, UNI_E)
        acc += _fold3(_routed_dot(wv, sv, a, FP8_E, UNI_E, ROUND_W), TOPKP, BLOCK_N, BLOCK_K, VEC_E)
    w = tl.load(wts_ptr + s, mask=sm, other=0.0)
    part = _bf16(_bf16(tl.sum(acc, 2)) * w[:, None])  # [TOPKP, BLOCK_N]: each expert's bf16 output
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in tl.static_range(TOPK):  # the eager order: ascending expert id, bf16 after every add
        out = _bf16(out + tl.sum(tl.where(s[:, None] == i, part, 0.0), 0))
    sg = tl.load(logits_ptr + E).to(tl.float32)
    gate = _bf16(1.0 / (1.0 + tl.exp(-sg)))
    moe = _bf16(out + _bf16(gate * _bf16(tl.sum(acc_s, 1))))
    r = tl.load(res_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(res_ptr + rows, _bf16(r + moe).to(res_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def moe_down_kernel(act_ptr, dn_ptr, sdn_ptr, ids_ptr, wts_ptr, logits_ptr, res_ptr, N, stride_de,
                    stride_a, stride_r, stride_l, stride_res, live_ptr,
                    I: tl.constexpr, IS: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr, TOPKP: tl.constexpr,
                    IMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                    M: tl.constexpr, HAS_LIVE: tl.constexpr, PDL: tl.constexpr):
    """Launch 3 over bf16 weights (`_down`; masked, `_row_mask`; HAS_LIVE: `_row_live`, grid axis 1 the row)."""
    if _row_live(live_ptr, tl.program_id(1), HAS_LIVE, PDL):
        _down(act_ptr, dn_ptr, dn_ptr, ids_ptr, sdn_ptr, sdn_ptr, ids_ptr, ids_ptr, wts_ptr, logits_ptr, res_ptr, N,
              stride_de, 0, 0, 0, stride_a, stride_r, stride_l, stride_res, I, IS, E, TOPK, TOPKP, IMAX, BLOCK_N,
              BLOCK_K, 1, False, False, True, True, False, VEC, VEC, M, False, PDL and not HAS_LIVE)


def moe_experts(xn, res, logits, gate_up, shared_gate_up, down, shared_down, act, ids, wts, *, top_k,
                block_n=8, block_k=None, down_block_n=4, down_block_k=None, num_warps=4, down_num_warps=4,
                norm_topk=True, round_w=False, vec=0, live=None):
    """Routed + shared experts for one token, or for M tokens (xn [M, H]: the verify rows, each routed
    on its own), after the router launch (`gemv`, xn_out) has left the normed input xn [H] and
    logits [E+1] (router logits, then the shared-expert gate logit). The gate_up launch routes and
    writes ids / wts [top_k] (ascending ids) for the down launch. `res` (the residual, [H]) is
    updated in place. gate_up [E, 2I, H], down [E, H, I], shared_gate_up [2Is, H], shared_down
    [H, Is], act [top_k+1, max(I, Is)] scratch (flat, or [M, >= (top_k+1) max(I, Is)]); with M rows
    every per-token tensor gains a leading M dimension. All M rows run in the same two launches
    (one program per row, slot and block: an expert several rows chose is read from HBM about once,
    the rows' concurrent reads of its tiles meeting in L2). Any of the four weights may be an
    fp8.FP8Weight (e4m3 + block scales): the launches then run the fp8 kernels, which read each
    weight in its own format (`round_w`: gemv_step._acc's ROUND_W; `vec`: gemv.gemv's). `live` (int32 [M],
    the batch step's slots): the programs of a row whose word is 0 idle (its experts are not read, its
    tensors are left as they are)."""
    n_exp, two_i, hidden = gate_up.shape
    inter, inter_s = two_i // 2, shared_gate_up.shape[0] // 2
    imax = max(inter, inter_s)
    m = xn.shape[0] if xn.dim() == 2 else 1
    st = lambda t: t.stride(0) if m > 1 else 0  # noqa: E731 - a row stride; none for one token
    rows = dict(stride_a=st(act), stride_r=st(ids), stride_l=st(logits), M=m,
                live_ptr=live if live is not None else ids, HAS_LIVE=live is not None)
    if m > 1 and not (ids.stride(0) == wts.stride(0) and act.shape[-1] >= (top_k + 1) * imax):
        raise ValueError(f"moe_experts: {m} rows need ids / wts with one row stride and act rows of "
                         f">= {(top_k + 1) * imax} elements")
    bk = min(block_k or 512, triton.next_power_of_2(hidden))
    bkd = min(down_block_k or 512, triton.next_power_of_2(imax))
    up_fp8, down_fp8 = _fp8(gate_up, shared_gate_up), _fp8(down, shared_down)
    grid_up = (triton.cdiv(imax, block_n), m * (1 + top_k))
    if up_fp8 is None:
        moe_gate_up_kernel[grid_up](
            xn, gate_up, shared_gate_up, act, ids, logits, wts, gate_up.stride(0), stride_x=st(xn), **rows,
            K=hidden, I=inter, IS=inter_s, TOPK=top_k, IMAX=imax, BLOCK_N=block_n, BLOCK_K=bk, E=n_exp,
            EP=triton.next_power_of_2(n_exp), NORM=norm_topk, VEC=fold_vec(vec, 2, bk), **LAUNCH,
            num_warps=num_warps)
    else:
        (ge, gs, gr, sge, uni_e), (sg, ss, sr, sgs, uni_s), bks = up_fp8(block_n, inter, inter_s, swiglu=True)
        moe_gate_up_fp8_kernel[grid_up](
            xn, ge, gs, gr, sg, ss, sr, act, ids, logits, wts, ge.stride(0), gs.stride(0) if gs.dim() == 3 else 0,
            sge, sgs, stride_x=st(xn), **rows, K=hidden, I=inter, IS=inter_s, TOPK=top_k, IMAX=imax,
            BLOCK_N=block_n, BLOCK_K=bk, E=n_exp, EP=triton.next_power_of_2(n_exp), NORM=norm_topk, BKS=bks,
            FP8_E=_is_fp8(gate_up), FP8_S=_is_fp8(shared_gate_up), UNI_E=uni_e, UNI_S=uni_s, ROUND_W=round_w,
            VEC_E=_vec(vec, gate_up, bk), VEC_S=_vec(vec, shared_gate_up, bk), **LAUNCH, num_warps=num_warps)
    grid_dn = (triton.cdiv(hidden, down_block_n), m)
    if down_fp8 is None:
        moe_down_kernel[grid_dn](
            act, down, shared_down, ids, wts, logits, res, hidden, down.stride(0), stride_res=st(res), **rows,
            I=inter, IS=inter_s, E=n_exp, TOPK=top_k, TOPKP=triton.next_power_of_2(top_k), IMAX=imax,
            BLOCK_N=down_block_n, BLOCK_K=bkd, VEC=fold_vec(vec, 2, bkd), **LAUNCH, num_warps=down_num_warps)
    else:
        (de, ds, dr, sde, uni_e), (sd, sds, sdr, ssd, uni_s), bks = down_fp8(down_block_n, hidden, hidden)
        moe_down_fp8_kernel[grid_dn](
            act, de, ds, dr, sd, sds, sdr, ids, wts, logits, res, hidden, de.stride(0),
            ds.stride(0) if ds.dim() == 3 else 0, sde, ssd, stride_res=st(res), **rows,
            EVEN=hidden % down_block_n == 0, I=inter, IS=inter_s, E=n_exp, TOPK=top_k,
            TOPKP=triton.next_power_of_2(top_k), IMAX=imax, BLOCK_N=down_block_n, BLOCK_K=bkd, BKS=bks,
            FP8_E=_is_fp8(down), FP8_S=_is_fp8(shared_down), UNI_E=uni_e, UNI_S=uni_s, ROUND_W=round_w,
            VEC_E=_vec(vec, down, bkd), VEC_S=_vec(vec, shared_down, bkd), **LAUNCH, num_warps=down_num_warps)


def _is_fp8(w) -> bool:
    return hasattr(w, "scale")


def _vec(vec: int, w, block_k: int) -> int:
    return fold_vec(vec, 1 if _is_fp8(w) else 2, block_k)


def _fp8(routed, shared):
    """None when both weights are bf16; else a function (block_n, rows_e, rows_s, swiglu) -> the fp8
    kernel's pointer groups (weight, scales, row map, scale row stride, uniform rows) for the routed
    and the shared weight (a bf16 weight: itself and dummies), and the scale block's columns."""
    fp8 = [w for w in (routed, shared) if _is_fp8(w)]
    if not fp8:
        return None
    if len({w.block for w in fp8}) != 1:
        raise ValueError(f"moe_experts: fp8 weights with different block sizes {[w.block for w in fp8]}")
    if any(w.tail is not None for w in fp8):
        raise ValueError("moe_experts: expert weights cannot have bf16 tail rows")
    bks = fp8[0].block[1]

    def groups(block_n, rows_e, rows_s, swiglu=False):
        out = []
        for w, n in ((routed, rows_e), (shared, rows_s)):
            if _is_fp8(w):
                uni = w.row_uniform(block_n) and (not swiglu or w.row_uniform(block_n, n))
                out.append((w.q, w.scale, w.srow, w.scale.stride(-2), uni))
            else:
                out.append((w, w, w, 0, True))
        return out[0], out[1], bks
    return groups


# ---- FP8 experts (fp8.FP8Weight: e4m3 [.., N, K] + fp32 block scales + row map) -------------------
# The same three-launch design and rounding points; the routed experts and the shared expert may each
# be fp8 or bf16 (FP8_E / FP8_S). Tiles are the bf16 kernels' 2-D ones; each column's block scale is
# gathered beside it and multiplies the bf16-valued input, not the weights.


@triton.jit
def moe_gate_up_fp8_kernel(x_ptr, gu_ptr, gus_ptr, gur_ptr, sgu_ptr, sgus_ptr, sgur_ptr, act_ptr, ids_ptr,
                           logits_ptr, wts_ptr, stride_ge, stride_gse, stride_gs, stride_sgs,
                           stride_x, stride_a, stride_r, stride_l, live_ptr, K: tl.constexpr, I: tl.constexpr,
                           IS: tl.constexpr, TOPK: tl.constexpr, IMAX: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, NORM: tl.constexpr,
                           BKS: tl.constexpr, FP8_E: tl.constexpr, FP8_S: tl.constexpr, UNI_E: tl.constexpr,
                           UNI_S: tl.constexpr, ROUND_W: tl.constexpr, VEC_E: tl.constexpr, VEC_S: tl.constexpr,
                           M: tl.constexpr, HAS_LIVE: tl.constexpr, PDL: tl.constexpr):
    """`moe_gate_up_kernel` with fp8 routed experts (FP8_E: gu e4m3 [E, 2I, K], scales gus
    [E, S, ceil(K/bk)], row map gur [2I]) and / or an fp8 shared expert (FP8_S: sgu, sgus, sgur)."""
    if _row_live(live_ptr, _token_row(tl.program_id(1), M, TOPK)[0], HAS_LIVE, PDL):
        _gate_up(x_ptr, gu_ptr, gus_ptr, gur_ptr, sgu_ptr, sgus_ptr, sgur_ptr, act_ptr, ids_ptr, logits_ptr, wts_ptr,
                 stride_ge, stride_gse, stride_gs, stride_sgs, stride_x, stride_a, stride_r, stride_l, K, I, IS,
                 TOPK, IMAX, BLOCK_N, BLOCK_K, E, EP, NORM, BKS, FP8_E, FP8_S, UNI_E, UNI_S, ROUND_W, VEC_E, VEC_S,
                 M, PDL and not HAS_LIVE)


@triton.jit
def moe_down_fp8_kernel(act_ptr, dn_ptr, dns_ptr, dnr_ptr, sdn_ptr, sdns_ptr, sdnr_ptr, ids_ptr, wts_ptr, logits_ptr,
                        res_ptr, N, stride_de, stride_dse, stride_ds, stride_sds,
                        stride_a, stride_r, stride_l, stride_res, live_ptr, I: tl.constexpr, IS: tl.constexpr,
                        E: tl.constexpr, TOPK: tl.constexpr, TOPKP: tl.constexpr,
                        IMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BKS: tl.constexpr, FP8_E: tl.constexpr, FP8_S: tl.constexpr, UNI_E: tl.constexpr,
                        UNI_S: tl.constexpr, ROUND_W: tl.constexpr, VEC_E: tl.constexpr, VEC_S: tl.constexpr,
                        M: tl.constexpr, EVEN: tl.constexpr, HAS_LIVE: tl.constexpr, PDL: tl.constexpr):
    """`moe_down_kernel` with fp8 routed down projections (FP8_E: dn e4m3 [E, H, I], scales dns, row
    map dnr [H]) and / or an fp8 shared down (FP8_S)."""
    if _row_live(live_ptr, tl.program_id(1), HAS_LIVE, PDL):
        _down(act_ptr, dn_ptr, dns_ptr, dnr_ptr, sdn_ptr, sdns_ptr, sdnr_ptr, ids_ptr, wts_ptr, logits_ptr, res_ptr,
              N, stride_de, stride_dse, stride_ds, stride_sds, stride_a, stride_r, stride_l, stride_res, I, IS, E,
              TOPK, TOPKP, IMAX, BLOCK_N, BLOCK_K, BKS, FP8_E, FP8_S, UNI_E, UNI_S, ROUND_W, VEC_E, VEC_S, M, EVEN,
              PDL and not HAS_LIVE)

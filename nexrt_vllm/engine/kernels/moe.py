"""Sparse MoE for one token: only the selected experts' weights are read, each exactly once.

Launch 1 is the router GEMV (`gemv`, RMSNorm prologue, `xn_out`) over [router; shared_expert_gate]
rows; its program 0 also stores the normed input for the experts. Launch 2 (`moe_gate_up_kernel`,
grid (intermediate blocks, 1 + top_k)) routes and writes SiLU(gate)·up for its slot's expert: each
routed program repeats the top-k selection (softmax over E in fp32, top-k, renormalise, ids
ascending) from the router logits before its first weight load, which costs less than a launch of
its own; grid column 0 is the shared expert (its act row is the last). Launch 3 (`moe_down_kernel`)
sums the down projections in ascending expert id (the eager order, with its bf16 rounding), adds
the sigmoid-gated shared expert and the residual.
"""
import triton
import triton.language as tl

from .common import LAUNCH, pdl_begin
from .common import bf16_round as _bf16
from .common import silu as _silu


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
def _swiglu_rows(x_ptr, wbase, n_rows, rows, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """SiLU(W_gate x)·(W_up x) for `rows` of a [2 n_rows, K] matrix. K is a compile-time constant and
    the loop is unrolled: no K block's loads wait for the previous block's arithmetic, so a
    program's whole slice can be in flight at once (a rolled loop costs one dependent HBM round
    trip per block)."""
    rmask = rows < n_rows
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([rows.shape[0], BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([rows.shape[0], BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        cols = k0 + offs_k
        cmask = cols < K
        wp = wbase + rows[:, None] * K + cols[None, :]
        m2 = rmask[:, None] & cmask[None, :]
        wg = tl.load(wp, mask=m2, other=0.0, eviction_policy="evict_first")
        wu = tl.load(wp + n_rows * K, mask=m2, other=0.0, eviction_policy="evict_first")
        xv = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        acc_g += wg.to(tl.float32) * xv[None, :]
        acc_u += wu.to(tl.float32) * xv[None, :]
    g = _bf16(tl.sum(acc_g, 1))
    u = _bf16(tl.sum(acc_u, 1))
    return _bf16(_bf16(_silu(g)) * u)


@triton.jit
def moe_gate_up_kernel(x_ptr, gu_ptr, sgu_ptr, act_ptr, ids_ptr, logits_ptr, wts_ptr, stride_ge,
                       K: tl.constexpr, I: tl.constexpr, IS: tl.constexpr,
                       TOPK: tl.constexpr, IMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       E: tl.constexpr, EP: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    # Grid column 0 is the shared expert (scheduled first: it needs no routing, so its loads start
    # while the routed programs select their experts); columns 1..TOPK are routed slots 0..TOPK-1.
    slot = tl.program_id(1) - 1
    if slot >= 0:
        # Each routed program selects its own slot's expert; the programs with pid 0 publish ids /
        # weights for the down launch.
        e, sel, rank, w = topk_select(logits_ptr, E, EP, TOPK, NORM)
        mine = sel & (rank == slot)
        eid = tl.sum(tl.where(mine, e, 0), 0)
        if pid == 0:
            tl.store(ids_ptr + slot, eid)
            tl.store(wts_ptr + slot, tl.sum(tl.where(mine, w, 0.0), 0))
        wbase = gu_ptr + eid.to(tl.int64) * stride_ge
        n_rows = I
    else:
        wbase = sgu_ptr
        n_rows = IS
        slot = TOPK  # the shared expert's act row is the last
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    a = _swiglu_rows(x_ptr, wbase, n_rows, rows, K, BLOCK_K)
    tl.store(act_ptr + slot * IMAX + rows, a.to(act_ptr.dtype.element_ty), mask=rows < n_rows)


@triton.jit
def moe_down_kernel(act_ptr, dn_ptr, sdn_ptr, ids_ptr, wts_ptr, logits_ptr, res_ptr, N, stride_de,
                    I: tl.constexpr, IS: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr, TOPKP: tl.constexpr,
                    IMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    offs_k = tl.arange(0, BLOCK_K)
    # The shared expert's rows first (no routing needed), then every routed expert's rows in one
    # gather load [TOPKP, BLOCK_N, BLOCK_K] per K block: all of the program's weight bytes can be in
    # flight together. (Expert after expert, each bf16 sum waits for its own round trip.)
    acc_s = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, IS, BLOCK_K):
        cols = k0 + offs_k
        cm = cols < IS
        a = tl.load(act_ptr + TOPK * IMAX + cols, mask=cm, other=0.0).to(tl.float32)
        wv = tl.load(sdn_ptr + rows[:, None] * IS + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0,
                     eviction_policy="evict_first")
        acc_s += wv.to(tl.float32) * a[None, :]
    s = tl.arange(0, TOPKP)
    sm = s < TOPK
    eid = tl.load(ids_ptr + s, mask=sm, other=0)
    base = dn_ptr + eid.to(tl.int64)[:, None, None] * stride_de + rows[None, :, None] * I
    acc = tl.zeros([TOPKP, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, I, BLOCK_K):
        cols = k0 + offs_k
        cm = cols < I
        a = tl.load(act_ptr + s[:, None] * IMAX + cols[None, :], mask=sm[:, None] & cm[None, :], other=0.0)
        wv = tl.load(base + cols[None, None, :], mask=sm[:, None, None] & rmask[None, :, None] & cm[None, None, :],
                     other=0.0, eviction_policy="evict_first")
        acc += wv.to(tl.float32) * a.to(tl.float32)[:, None, :]
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


def moe_experts(xn, res, logits, gate_up, shared_gate_up, down, shared_down, act, ids, wts, *, top_k,
                block_n=8, block_k=None, down_block_n=4, down_block_k=None, num_warps=4, down_num_warps=4,
                norm_topk=True):
    """Routed + shared experts for one token, after the router launch (`gemv`, xn_out) has left the
    normed input xn [H] and logits [E+1] (router logits, then the shared-expert gate logit). The
    gate_up launch routes and writes ids / wts [top_k] (ascending ids) for the down launch.
    `res` (the residual, [H]) is updated in place. gate_up [E, 2I, H], down [E, H, I],
    shared_gate_up [2Is, H], shared_down [H, Is], act [top_k+1, max(I, Is)] scratch."""
    n_exp, two_i, hidden = gate_up.shape
    inter, inter_s = two_i // 2, shared_gate_up.shape[0] // 2
    imax = max(inter, inter_s)
    bk = min(block_k or 512, triton.next_power_of_2(hidden))
    moe_gate_up_kernel[(triton.cdiv(imax, block_n), 1 + top_k)](
        xn, gate_up, shared_gate_up, act, ids, logits, wts, gate_up.stride(0), K=hidden, I=inter, IS=inter_s,
        TOPK=top_k, IMAX=imax, BLOCK_N=block_n, BLOCK_K=bk, E=n_exp, EP=triton.next_power_of_2(n_exp),
        NORM=norm_topk, **LAUNCH, num_warps=num_warps)
    bkd = min(down_block_k or 512, triton.next_power_of_2(imax))
    moe_down_kernel[(triton.cdiv(hidden, down_block_n),)](
        act, down, shared_down, ids, wts, logits, res, hidden, down.stride(0), I=inter, IS=inter_s,
        E=n_exp, TOPK=top_k, TOPKP=triton.next_power_of_2(top_k), IMAX=imax, BLOCK_N=down_block_n, BLOCK_K=bkd,
        **LAUNCH, num_warps=down_num_warps)

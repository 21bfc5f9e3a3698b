"""MoE top-k routing of one token: one program of one warp (the reductions stay in warp shuffles)."""
import triton
import triton.language as tl

from .common import LAUNCH, pdl_begin
from .common import bf16_round as _bf16


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
def route_kernel(logits_ptr, ids_ptr, wts_ptr, E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr,
                 NORM: tl.constexpr, PDL: tl.constexpr):
    """Top-k routing of one token from its router logits; ids ascending, weights in bf16 precision."""
    pdl_begin(PDL)
    e, sel, rank, w = topk_select(logits_ptr, E, EP, TOPK, NORM)
    tl.store(ids_ptr + rank, e, mask=sel)
    tl.store(wts_ptr + rank, w, mask=sel)


def route(logits, ids, wts, *, num_experts, top_k, norm_topk=True):
    """ids [top_k] (ascending) / wts [top_k] of the top-k experts from router logits [>= num_experts]."""
    route_kernel[(1,)](logits, ids, wts, E=num_experts, EP=triton.next_power_of_2(num_experts), TOPK=top_k,
                       NORM=norm_topk, **LAUNCH, num_warps=1)

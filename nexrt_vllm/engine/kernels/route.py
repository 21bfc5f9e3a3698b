"""MoE top-k routing of one token, run by the router GEMV's last program (gemv EPI_ROUTE)."""
import triton
import triton.language as tl

from .common import bf16_round as _bf16


@triton.jit
def route(logits_ptr, ids_ptr, wts_ptr, E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr,
          NORM: tl.constexpr):
    """Top-k routing of one token from its router logits; ids ascending, weights in bf16 precision."""
    e = tl.arange(0, EP)
    em = e < E
    # .cg: read from L2, where the other programs of the router launch left their logits.
    lg = tl.load(logits_ptr + e, mask=em, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    p = tl.exp(lg - tl.max(lg, 0))
    p = p / tl.sum(p, 0)
    work = tl.where(em, p, -1.0)
    sel = e < 0
    for _ in tl.static_range(TOPK):
        m = tl.max(work, 0)
        idx = tl.min(tl.where(work == m, e, EP), 0)  # ties -> lowest expert id
        sel = sel | (e == idx)
        work = tl.where(e == idx, -1.0, work)
    wsum = tl.sum(tl.where(sel, p, 0.0), 0) if NORM else 1.0
    rank = tl.cumsum(sel.to(tl.int32), 0) - 1  # slot of each selected expert, ascending id
    wt = _bf16(p / wsum)
    for s in tl.static_range(TOPK):
        tl.store(ids_ptr + s, tl.sum(tl.where(sel & (rank == s), e, 0), 0))
        tl.store(wts_ptr + s, tl.sum(tl.where(sel & (rank == s), wt, 0.0), 0))

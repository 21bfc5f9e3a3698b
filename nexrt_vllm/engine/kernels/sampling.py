"""On-device token selection and control publication for the captured decode step.

Greedy: the lm_head GEMV (EPI_ARGMAX) leaves one (max, index) pair per program; `finish_kernel`
reduces them (ties -> lowest id, as torch.argmax), stores the token for the next step, advances the
device position and step counter and publishes (step << 32 | token) in a slot of the control ring
(host-mapped memory, see graph.py).

Sampling (temperature / top-k / top-p): the allowed set is a prefix of the logits sorted in
descending order, so after a (captured) sort + softmax + cumsum, `gumbel_partial_kernel` takes
argmax(l/T + Gumbel) over that prefix. The noise is keyed on (seed, position, token id):
a seed reproduces a request, and the draw does not depend on the sort order. Parameters live in a device buffer
[temperature, top_p, top_k] and the seed in an int64 buffer, so one graph serves every request.
"""
import triton
import triton.language as tl

from .common import LAUNCH, pdl_begin


@triton.jit
def gumbel_partial_kernel(vals_ptr, idx_ptr, cum_ptr, params_ptr, seed_ptr, pos_ptr, pmax_ptr, pidx_ptr, V,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    r = pid * BLOCK + tl.arange(0, BLOCK)
    m = r < V
    temp = tl.load(params_ptr)
    top_p = tl.load(params_ptr + 1)
    top_k = tl.load(params_ptr + 2).to(tl.int32)
    lv = tl.load(vals_ptr + r, mask=m, other=float("-inf"))
    tok = tl.load(idx_ptr + r, mask=m, other=0).to(tl.int32)
    # cum_ptr holds the exclusive prefix sum of the sorted probabilities (mass strictly before r).
    prob_before = tl.load(cum_ptr + r, mask=m, other=2.0)
    allowed = m & ((top_k <= 0) | (r < top_k)) & ((r == 0) | (prob_before < top_p))
    seed = tl.load(seed_ptr)
    pos = tl.load(pos_ptr)
    u = tl.rand(seed.to(tl.int32) ^ (pos.to(tl.int32) * 1000003), tok)
    u = tl.minimum(tl.maximum(u, 1e-12), 1.0 - 1e-7)
    score = tl.where(allowed, lv / temp - tl.log(-tl.log(u)), float("-inf"))
    best = tl.max(score, 0)
    tl.store(pmax_ptr + pid, best)
    tl.store(pidx_ptr + pid, tl.min(tl.where(score == best, tok, 2147483647), 0))


@triton.jit
def embed_kernel(tok_ptr, emb_ptr, out_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = emb[tok]: the step's first launch reads the token from the device."""
    pdl_begin(PDL)
    tok = tl.load(tok_ptr).to(tl.int64)
    for h0 in range(0, H, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        tl.store(out_ptr + h, tl.load(emb_ptr + tok * H + h, mask=h < H), mask=h < H)


def embed(tok, table, out):
    embed_kernel[(1,)](tok, table, out, table.shape[1], BLOCK=1024, **LAUNCH, num_warps=4)


@triton.jit
def finish_kernel(pmax_ptr, pidx_ptr, NP, tok_ptr, pos_ptr, step_ptr, ring_ptr, RING, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_begin(PDL)
    best = float("-inf")
    best_i = 2147483647
    for p0 in range(0, NP, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        v = tl.load(pmax_ptr + p, mask=p < NP, other=float("-inf"))
        ix = tl.load(pidx_ptr + p, mask=p < NP, other=2147483647)
        m = tl.max(v, 0)
        i = tl.min(tl.where(v == m, ix, 2147483647), 0)
        take = (m > best) | ((m == best) & (i < best_i))
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    step = tl.load(step_ptr) + 1
    tl.store(tok_ptr, best_i.to(tok_ptr.dtype.element_ty))
    tl.store(pos_ptr, tl.load(pos_ptr) + 1)
    tl.store(step_ptr, step)
    # One 8-byte store of (step << 32 | token): the host polls this slot and must never see a torn pair.
    tl.store(ring_ptr + (step - 1) % RING, (step.to(tl.int64) << 32) | best_i.to(tl.int64))


def finish(pmax, pidx, n_partials, tok, pos, step, ring, ring_slots):
    """Reduce the partial argmaxes; advance tok/pos/step; publish step<<32|token in ring slot step-1."""
    # One block covers every partial when it can (the lm_head leaves ~8K): each loop iteration is a
    # dependent L2 round trip plus two block reductions.
    block = min(max(triton.next_power_of_2(n_partials), 128), 16384)
    finish_kernel[(1,)](pmax, pidx, n_partials, tok, pos, step, ring, ring_slots, BLOCK=block, **LAUNCH,
                        num_warps=8 if block >= 4096 else 4)


def gumbel_partial(vals, idx, cum_excl, params, seed, pos, pmax, pidx, block=2048):
    """Per-program Gumbel-max over the allowed prefix of the sorted logits; noise keyed on (seed, position)."""
    v = vals.numel()
    gumbel_partial_kernel[(triton.cdiv(v, block),)](vals, idx, cum_excl, params, seed, pos, pmax, pidx, v,
                                                  BLOCK=block, **LAUNCH, num_warps=8)
    return triton.cdiv(v, block)

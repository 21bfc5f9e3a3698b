"""On-device token selection and control publication for the captured decode step.

Greedy: the lm_head GEMV (EPI_ARGMAX) leaves one (max, index) pair per program; `finish_kernel`
reduces them (ties -> lowest id, as torch.argmax), stores the token for the next step, advances the
device position and step counter and publishes (step << 32 | token) in a slot of the control ring
(host-mapped memory, see engine/gpu/control.py).

Sampling (temperature / top-k / top-p): the allowed set is a prefix of the logits sorted in
descending order, so after a (captured) sort + softmax + cumsum, `gumbel_partial_kernel` takes
argmax(l/T + Gumbel) over that prefix. The noise is keyed on (seed, position, token id):
a seed reproduces a request, and the draw does not depend on the sort order. Parameters live in a device buffer
[temperature, top_p, top_k] and the seed in an int64 buffer, so one graph serves every request.

Logprobs and grammar masks (`tail_kernel`, before the finish): chunks of the fp32 logits, each
program over CHUNK tokens. With MASK it first waits for the host's bitmask of this step: the host
writes the mask into host-mapped memory, then raises a flag word to the step's number; the
programs spin on that flag (bounded by SPIN reads; a mask that never comes is reported in
`status` and the finish publishes an invalid token instead of an unconstrained one), clear the
disallowed logits and, for the sampling graph, store them back so the sort sees the masked
distribution. Each program leaves its (max, argmax), its sum of exp(l - max) and, with TOPK, its
k best (logit, id) pairs. The finish then reduces those: the greedy token (the masked argmax),
logsumexp, the chosen token's logprob and the global top k, written into the host-mapped logprob
ring before the token itself is published (a system-scope fence between), so a host that sees
token k reads complete logprobs for it.
"""
import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.common import ASM, LAUNCH, fence_sys, pdl_begin

INVALID_TOKEN = 0x7FFFFFFF  # published instead of a token when the step's grammar mask did not arrive
KMAX = 32  # top-k slots per program and per ring slot (a power of two >= handoff.structured.LOGPROBS_MAX)
_BIG = tl.constexpr(2147483647)


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
def gather_rows_kernel(idx_ptr, live_ptr, src_ptr, out_ptr, H, stride_src, stride_out, STEP: tl.constexpr,
                       HAS_LIVE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (R,): out row r = src row (r * STEP + max(idx[r], 0)); with HAS_LIVE zeros where live[r] == 0."""
    pdl_begin(PDL)
    r = tl.program_id(0)
    on = 1
    if HAS_LIVE:
        on = tl.load(live_ptr + r)
    row = (r * STEP + tl.maximum(tl.where(on != 0, tl.load(idx_ptr + r), 0), 0)).to(tl.int64)
    for h0 in range(0, H, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        # (h * 0 + on): a vector mask (a scalar one trips the interpreter)
        v = tl.load(src_ptr + row * stride_src + h, mask=(h < H) & ((h * 0 + on) != 0), other=0.0)
        tl.store(out_ptr + r * stride_out + h, v, mask=h < H)


def gather_rows(idx, src, out, step: int = 0, live=None):
    """out[r] = src[r * step + max(idx[r], 0)] for each of the R = idx.numel() indices (int64, device), in one
    launch that reads the indices on the device: the step's embedding (R = 1) and the batch step's and the
    verify's (step 0: src the embedding table, idx the tokens), each slot's row of its accepted position in a round
    (step M: a slot whose round emitted nothing, idx < 0, takes its first row). `live` (int32 [R]): zeros in the rows
    where it is 0 (a batch slot that is not live then carries finite values through the step). Rows of src and out
    with unit column stride; out [R, H] (or [H] for R = 1)."""
    r, h = idx.numel(), src.shape[1]
    out2 = out.view(1, -1) if out.dim() == 1 else out
    if src.stride(1) != 1 or out2.stride(-1) != 1 or out2.shape[0] < r or out2.shape[-1] < h:
        raise ValueError(f"gather_rows: src [*, {h}] and out [>= {r}, {h}] with unit column stride")
    gather_rows_kernel[(r,)](idx, live if live is not None else idx, src, out2, h, src.stride(0), out2.stride(0),
                             STEP=step, HAS_LIVE=live is not None, BLOCK=1024, **LAUNCH, num_warps=4)


@triton.jit
def tail_kernel(logits_ptr, V, step_ptr, flag_ptr, mask_ptr, MASK_WORDS, k_ptr, status_ptr,
                tmax_ptr, tidx_ptr, tsum_ptr, topv_ptr, topi_ptr,
                CHUNK: tl.constexpr, KMAX: tl.constexpr, MASK: tl.constexpr, TOPK: tl.constexpr,
                WRITE: tl.constexpr, SPIN: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    WPC: tl.constexpr = CHUNK // 32  # mask words per program; [word, bit] tiles of the chunk
    w = pid * WPC + tl.arange(0, WPC)
    b = tl.arange(0, 32)
    r = w[:, None] * 32 + b[None, :]
    m = r < V
    lg = tl.load(logits_ptr + r, mask=m, other=float("-inf"))
    if MASK:
        want = tl.load(step_ptr) + 1  # this replay's step (the finish increments the counter)
        f = tl.load(flag_ptr, volatile=True)
        n = 0
        while (f < want) & (n < SPIN):
            f = tl.load(flag_ptr, volatile=True)
            n += 1
        fence_sys(ASM)  # the mask is read after the flag that announced it
        words = tl.load(mask_ptr + (want % 2) * MASK_WORDS + w, mask=w < MASK_WORDS, other=0, cache_modifier=".cv")
        allowed = ((words[:, None] >> b[None, :]) & 1) != 0
        lg = tl.where(allowed & m, lg, float("-inf"))
        if WRITE:
            tl.store(logits_ptr + r, lg, mask=m)
        tl.store(status_ptr, want, mask=f < want)
    mx = tl.max(tl.max(lg, 1), 0)
    ix = tl.min(tl.min(tl.where(lg == mx, r, _BIG), 1), 0)
    se = tl.sum(tl.sum(tl.exp(lg - tl.where(mx > float("-inf"), mx, 0.0)), 1), 0)  # a fully masked chunk: 0
    tl.store(tmax_ptr + pid, mx)
    tl.store(tidx_ptr + pid, ix)
    tl.store(tsum_ptr + pid, se)
    if TOPK:
        kk = tl.arange(0, KMAX)
        tv = tl.full([KMAX], float("-inf"), tl.float32)
        ti = tl.full([KMAX], _BIG, tl.int32)
        cur = lg
        for j in range(0, tl.load(k_ptr)):
            mv = tl.max(tl.max(cur, 1), 0)
            mi = tl.min(tl.min(tl.where(cur == mv, r, _BIG), 1), 0)
            mi = tl.where(mv == float("-inf"), _BIG, mi)  # nothing left: no candidate
            tv = tl.where(kk == j, mv, tv)
            ti = tl.where(kk == j, mi, ti)
            cur = tl.where(r == mi, float("-inf"), cur)
        tl.store(topv_ptr + pid * KMAX + kk, tv)
        tl.store(topi_ptr + pid * KMAX + kk, ti)


def tail(logits, step, flag, masks, k, status, tmax, tidx, tsum, topv, topi, *, mask: bool, topk: bool,
         write: bool, chunk: int, spin: int):
    """Launch `tail_kernel` over the logits; returns its program count (the partials it left)."""
    v = logits.numel()
    nt = triton.cdiv(v, chunk)
    tail_kernel[(nt,)](logits, v, step, flag, masks, masks.shape[-1], k, status, tmax, tidx, tsum, topv, topi,
                       CHUNK=chunk, KMAX=topv.numel() // tmax.numel(), MASK=mask, TOPK=topk, WRITE=write,
                       SPIN=spin, ASM=ASM, **LAUNCH, num_warps=4)
    return nt


@triton.jit
def argmax_partials(pmax_ptr, pidx_ptr, NP, BLOCK: tl.constexpr):
    """The index of the max over NP per-program (max, argmax) partials, the lowest on ties (torch.argmax)."""
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
    return best_i


@triton.jit
def finish_kernel(pmax_ptr, pidx_ptr, NP, tok_ptr, pos_ptr, step_ptr, ring_ptr, RING,
                  logits_ptr, tmax_ptr, tsum_ptr, NT, topv_ptr, topi_ptr, k_ptr, status_ptr, lpv_ptr, lpi_ptr,
                  BLOCK: tl.constexpr, LP: tl.constexpr, CHECK: tl.constexpr, KMAX: tl.constexpr,
                  TB: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    best_i = argmax_partials(pmax_ptr, pidx_ptr, NP, BLOCK)
    step = tl.load(step_ptr) + 1
    if LP:
        # logsumexp over the (masked) logits from the tail's per-program max and sum of exp
        t = tl.arange(0, TB)
        tm = tl.load(tmax_ptr + t, mask=t < NT, other=float("-inf"))
        ts = tl.load(tsum_ptr + t, mask=t < NT, other=0.0)
        mm = tl.max(tm, 0)
        lse = mm + tl.log(tl.sum(ts * tl.exp(tm - tl.where(mm > float("-inf"), mm, 0.0)), 0))
        slot = (step - 1) % RING
        chosen = tl.load(logits_ptr + best_i) - lse
        kk = tl.arange(0, KMAX)
        c = tl.arange(0, CB)
        cv = tl.load(topv_ptr + c, mask=c < NT * KMAX, other=float("-inf"))
        ci = tl.load(topi_ptr + c, mask=c < NT * KMAX, other=2147483647)
        tv = tl.full([KMAX], float("-inf"), tl.float32)
        ti = tl.full([KMAX], 2147483647, tl.int32)
        for j in range(0, tl.load(k_ptr)):
            mv = tl.max(cv, 0)
            mi = tl.min(tl.where(cv == mv, ci, 2147483647), 0)
            mi = tl.where(mv == float("-inf"), 2147483647, mi)
            tv = tl.where(kk == j, mv, tv)
            ti = tl.where(kk == j, mi, ti)
            cv = tl.where(ci == mi, float("-inf"), cv)
        tl.store(lpv_ptr + slot * (KMAX + 1), chosen)
        tl.store(lpv_ptr + slot * (KMAX + 1) + 1 + kk, tv - lse)
        tl.store(lpi_ptr + slot * KMAX + kk, ti)
        tl.debug_barrier()  # every thread's logprob stores precede the token store ...
        fence_sys(ASM)  # ... for the host too
    pub = best_i
    if CHECK:  # this step's grammar mask never arrived: publish that, not an unconstrained token
        late = tl.load(status_ptr) == step
        pub = tl.where(late, 2147483647, best_i)
        best_i = tl.where(late, 0, best_i)  # the next replay (discarded) still embeds a valid id
    tl.store(tok_ptr, best_i.to(tok_ptr.dtype.element_ty))
    tl.store(pos_ptr, tl.load(pos_ptr) + 1)
    tl.store(step_ptr, step)
    # One 8-byte store of (step << 32 | token): the host polls this slot and must never see a torn pair.
    tl.store(ring_ptr + (step - 1) % RING, (step.to(tl.int64) << 32) | pub.to(tl.int64))


def finish(pmax, pidx, n_partials, tok, pos, step, ring, ring_slots, lp=None, status=None):
    """Reduce the partial argmaxes; advance tok/pos/step; publish step<<32|token in ring slot step-1.

    `lp` = (logits, tmax, tsum, n_tail, topv, topi, k, lpv, lpi): also write the chosen token's
    logprob and the top k into ring slot step-1 of `lpv` / `lpi` first. `status`: the tail's mask
    status word (publish INVALID_TOKEN if this step's mask never came)."""
    # One block covers every partial when it can (the lm_head leaves ~8K): each loop iteration is a
    # dependent L2 round trip plus two block reductions.
    block = min(max(triton.next_power_of_2(n_partials), 128), 16384)
    if lp is None:
        logits, tmax, tsum, nt, topv, topi, k, lpv, lpi, kmax = (pmax, pmax, pmax, 1, pmax, pidx, pidx, pmax, pidx,
                                                                 1)
    else:
        logits, tmax, tsum, nt, topv, topi, k, lpv, lpi = lp
        kmax = topv.numel() // tmax.numel()
    finish_kernel[(1,)](pmax, pidx, n_partials, tok, pos, step, ring, ring_slots,
                        logits, tmax, tsum, nt, topv, topi, k, status if status is not None else step, lpv, lpi,
                        BLOCK=block, LP=lp is not None, CHECK=status is not None, KMAX=kmax,
                        TB=max(triton.next_power_of_2(nt), 16), CB=max(triton.next_power_of_2(nt * kmax), 16),
                        ASM=ASM, **LAUNCH, num_warps=8 if block >= 4096 or lp is not None else 4)


def gumbel_partial(vals, idx, cum_excl, params, seed, pos, pmax, pidx, block=2048):
    """Per-program Gumbel-max over the allowed prefix of the sorted logits; noise keyed on (seed, position)."""
    v = vals.numel()
    gumbel_partial_kernel[(triton.cdiv(v, block),)](vals, idx, cum_excl, params, seed, pos, pmax, pidx, v,
                                                  BLOCK=block, **LAUNCH, num_warps=8)
    return triton.cdiv(v, block)

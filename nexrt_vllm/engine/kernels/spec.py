"""On-device accept / commit bookkeeping and MTP-head glue of the captured speculative round.

A round (engine/gpu/spec_round.py) verifies M tokens [t, d_1 .. d_{M-1}] at positions pos..pos+M-1; the
lm_head leaves per-program (max, argmax) partials per row. `accept_kernel` reduces them to the
target's tokens y_0..y_{M-1}, counts the drafts that equal them (a: d_{j+1} == y_j for every j < a),
publishes the round's a + 1 tokens y_0..y_a into the control ring (one (step << 32 | token) store
each, as the plain finish does), then the round record (round << 32 | a + 1) into the round ring
behind a system-scope fence, so a host that sees the record reads complete tokens; and it advances
the device position by a + 1 (keeping the round's first position in `base` for the drafter) and
leaves y_a as the next round's first token.

`mtp_input_kernel` builds the MTP head's fc input [RMSNorm_e(embed(token)) ; RMSNorm_h(hidden)]
per row (zero-centred RMSNorm, bf16 rounding as the eager `Drafter._input`); `draft_pick_kernel`
reduces the head's lm_head partials to a draft token (through the draft token map when the head
read a map's rows: engine/spec/draft_vocab.py), stores it as the next verify input and as the
next chained step's token, and sets that step's head position; `draft_pick_input_kernel` is the two in
one launch (a pick followed by the chained step's input: one launch fewer per chained step).
"""
import triton
import triton.language as tl

from .common import ASM, LAUNCH, fence_sys, pdl_begin
from .common import bf16_round as _bf16
from .sampling import argmax_partials as _argmax_partials


@triton.jit
def accept_kernel(pmax_ptr, pidx_ptr, NP, tok_ptr, y_ptr, pos_ptr, base_ptr, nacc_ptr, step_ptr, round_ptr,
                  ring_ptr, rounds_ptr, RING, forced_ptr, NF, live_ptr, max_len, M: tl.constexpr, MP: tl.constexpr,
                  BLOCK: tl.constexpr, SYNTH: tl.constexpr, HAS_LIVE: tl.constexpr, RING_B: tl.constexpr,
                  ASM: tl.constexpr, PDL: tl.constexpr):
    # Grid (slots,): program b is request slot b (its M rows of partials, its tokens, words, ring column);
    # one slot: grid (1,), RING_B 1.
    pdl_begin(PDL)
    b = tl.program_id(0)
    on = True
    if HAS_LIVE:
        on = tl.load(live_ptr + b) != 0
    if on:
        j = tl.arange(0, MP)
        y = tl.zeros([MP], dtype=tl.int32)
        for r in tl.static_range(M):
            row = b * M + r
            y = tl.where(j == r, _argmax_partials(pmax_ptr + row * NP, pidx_ptr + row * NP, NP, BLOCK), y)
        tok = tok_ptr + b * M
        # a = leading drafts equal to the target's token at the position before them
        drafts = tl.load(tok + 1 + j, mask=j < M - 1, other=-1).to(tl.int32)
        miss = (j < M - 1) & (drafts != y)
        a = tl.min(tl.where(miss | (j >= M - 1), j, MP), 0)
        rnd = tl.load(round_ptr + b) + 1
        if SYNTH:  # pinned acceptance: a from the schedule, the accepted drafts emitted as they are
            a = tl.minimum(tl.load(forced_ptr + b * NF + (rnd - 1) % NF).to(tl.int32), M - 1)
            y = tl.where(j < a, drafts, y)
        step = tl.load(step_ptr + b)
        pos = tl.load(pos_ptr + b)
        # no token past the context: the round emits at most max_len - pos (a = -1: none, nothing moves)
        a = tl.maximum(tl.minimum(a.to(tl.int64), max_len - pos - 1), -1).to(tl.int32)
        tl.store(y_ptr + b * M + j, y.to(y_ptr.dtype.element_ty), mask=j < M)
        # ring slots of steps step+1 .. step+a+1 hold tokens y_0 .. y_a
        s = step + 1 + j
        tl.store(ring_ptr + ((s - 1) % RING) * RING_B + b, (s.to(tl.int64) << 32) | y.to(tl.int64), mask=j <= a)
        nxt = tl.sum(tl.where(j == a, y, 0), 0)
        if a >= 0:
            tl.store(tok, nxt.to(tok_ptr.dtype.element_ty))
        tl.store(base_ptr + b, pos)
        tl.store(pos_ptr + b, pos + a + 1)
        tl.store(nacc_ptr + b, a.to(nacc_ptr.dtype.element_ty))
        tl.store(step_ptr + b, step + a + 1)
        tl.store(round_ptr + b, rnd)
        tl.debug_barrier()  # every thread's token stores precede the round record ...
        fence_sys(ASM)  # ... for the host too
        tl.store(rounds_ptr + ((rnd - 1) % RING) * RING_B + b, (rnd.to(tl.int64) << 32) | (a + 1).to(tl.int64))


def accept(pmax, pidx, n_partials, tok, y, pos, base, acc, step, rnd, ring, rounds, ring_slots, forced=None,
           live=None, max_len=None):
    """Reduce the verify's lm_head partials pmax/pidx [M, n_partials] (row stride n_partials) to the
    target's tokens y [M]; accept the leading drafts tok[1:] that match; publish; advance (module doc).
    `forced` (int64 [NF], optional): pinned acceptance - round r accepts forced[(r - 1) % NF] drafts and
    emits them as they are, then the target's token after them (engine/spec/synthetic.py).

    B request slots (`live`, int32 [B]: the batched round, engine/gpu/batch_round.py): tok / y [B, M],
    the partials [B*M, n_partials], pos / base / acc / step / rnd [B], ring and rounds [RING, >= B] (a
    column per slot of the node, these B its first), forced [B, NF]; a slot whose live word is 0 is left
    as it is. `max_len`: no slot emits a token past it (a <= max_len - pos - 1; a slot already full
    emits none, acc = -1)."""
    b = live.numel() if live is not None else 1
    m = tok.numel() // b
    block = min(max(triton.next_power_of_2(n_partials), 128), 16384)
    synth = forced is not None
    accept_kernel[(b,)](pmax, pidx, n_partials, tok, y, pos, base, acc, step, rnd, ring, rounds, ring_slots,
                        forced if synth else rnd, forced.shape[-1] if synth else 1, live if live is not None else rnd,
                        max_len if max_len is not None else 1 << 62, M=m, MP=max(triton.next_power_of_2(m), 2),
                        BLOCK=block, SYNTH=synth, HAS_LIVE=live is not None,
                        RING_B=ring.shape[1] if ring.dim() == 2 else 1, ASM=ASM, **LAUNCH,
                        num_warps=8 if block >= 4096 else 4)


@triton.jit
def _input_row(t, emb_ptr, hid_ptr, we_ptr, wh_ptr, out_ptr, r, half, H, stride_h, stride_o, eps,
               HP: tl.constexpr):
    """Half `half` of the head's fc input row r: 0, RMSNorm(embed[t]; w_e); 1, RMSNorm(hidden[r]; w_h)
    (zero-centred, bf16-rounded)."""
    c = tl.arange(0, HP)
    cm = c < H
    if half == 0:
        x = tl.load(emb_ptr + t * H + c, mask=cm, other=0.0).to(tl.float32)
        w = tl.load(we_ptr + c, mask=cm, other=0.0).to(tl.float32)
    else:
        x = tl.load(hid_ptr + r * stride_h + c, mask=cm, other=0.0).to(tl.float32)
        w = tl.load(wh_ptr + c, mask=cm, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    y = _bf16((x * rstd) * (1.0 + w))
    tl.store(out_ptr + r * stride_o + half * H + c, y.to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def mtp_input_kernel(tok_ptr, emb_ptr, hid_ptr, we_ptr, wh_ptr, out_ptr, H, stride_h, stride_o, eps,
                     HP: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    r = tl.program_id(0)
    half = tl.program_id(1)  # 0: the embedding half, 1: the hidden half
    _input_row(tl.load(tok_ptr + r), emb_ptr, hid_ptr, we_ptr, wh_ptr, out_ptr, r, half, H, stride_h, stride_o,
               eps, HP)


def mtp_input(tok, embed, hidden, w_e, w_h, out, eps):
    """out [T, 2H] = [RMSNorm(embed[tok[r]]; w_e) ; RMSNorm(hidden[r]; w_h)] for the T = out.shape[0] rows."""
    t, h = out.shape[0], embed.shape[1]
    mtp_input_kernel[(t, 2)](tok, embed, hidden, w_e, w_h, out, h, hidden.stride(0), out.stride(0), eps,
                             HP=triton.next_power_of_2(h), **LAUNCH, num_warps=4)


@triton.jit
def _pick(pmax_ptr, pidx_ptr, NP, stride_p, ids_ptr, tok_ptr, dtok_ptr, base_ptr, nacc_ptr, dpos_ptr, b, K, M,
          BLOCK: tl.constexpr, HAS_MAP: tl.constexpr):
    """Slot b's draft d_K from its partials (through the map): tok[b, K] = dtok[b] = d_K, dpos[b] = the head
    row of the chained step that drafts d_{K+1}; returns d_K."""
    d = _argmax_partials(pmax_ptr + b * stride_p, pidx_ptr + b * stride_p, NP, BLOCK)
    if HAS_MAP:  # the lm_head rows were the map's: the argmax is an index into it
        d = tl.load(ids_ptr + d)
    tl.store(tok_ptr + b * M + K, d.to(tok_ptr.dtype.element_ty))
    tl.store(dtok_ptr + b, d.to(dtok_ptr.dtype.element_ty))
    # a round that emitted nothing (acc -1, a full context) drafts junk from row base
    tl.store(dpos_ptr + b, tl.load(base_ptr + b) + tl.maximum(tl.load(nacc_ptr + b), 0) + K)
    return d


@triton.jit
def draft_pick_kernel(pmax_ptr, pidx_ptr, NP, stride_p, ids_ptr, tok_ptr, dtok_ptr, base_ptr, nacc_ptr, dpos_ptr,
                      live_ptr, K, M, BLOCK: tl.constexpr, HAS_MAP: tl.constexpr, HAS_LIVE: tl.constexpr,
                      PDL: tl.constexpr):
    # Grid (slots,): program b picks slot b's draft (partials row b, tok row b of M, its words).
    pdl_begin(PDL)
    b = tl.program_id(0)
    on = True
    if HAS_LIVE:
        on = tl.load(live_ptr + b) != 0
    if on:
        _pick(pmax_ptr, pidx_ptr, NP, stride_p, ids_ptr, tok_ptr, dtok_ptr, base_ptr, nacc_ptr, dpos_ptr, b, K, M,
              BLOCK, HAS_MAP)


@triton.jit
def draft_pick_input_kernel(pmax_ptr, pidx_ptr, NP, stride_p, ids_ptr, tok_ptr, dtok_ptr, base_ptr, nacc_ptr,
                            dpos_ptr, live_ptr, K, M, emb_ptr, hid_ptr, we_ptr, wh_ptr, out_ptr, H, stride_h,
                            stride_o, eps, BLOCK: tl.constexpr, HAS_MAP: tl.constexpr, HAS_LIVE: tl.constexpr,
                            HP: tl.constexpr, PDL: tl.constexpr):
    # Grid (slots, 2): draft_pick then mtp_input of the chained step in one launch. Program (b, 0) picks
    # slot b's d_K and normalizes its embedding (a slot not live: dtok[b] as it stands, as mtp_input
    # would); program (b, 1) normalizes the hidden row, which does not wait for the pick.
    pdl_begin(PDL)
    b = tl.program_id(0)
    half = tl.program_id(1)
    t = tl.load(dtok_ptr + b).to(tl.int64)  # a slot not live keeps its token (the hidden half does not use it)
    if half == 0:
        on = True
        if HAS_LIVE:
            on = tl.load(live_ptr + b) != 0
        if on:
            t = _pick(pmax_ptr, pidx_ptr, NP, stride_p, ids_ptr, tok_ptr, dtok_ptr, base_ptr, nacc_ptr, dpos_ptr,
                      b, K, M, BLOCK, HAS_MAP).to(tl.int64)
    _input_row(t, emb_ptr, hid_ptr, we_ptr, wh_ptr, out_ptr, b, half, H, stride_h, stride_o, eps, HP)


def _pick_launch(pmax, pidx, n_partials, tok, dtok, base, acc, dpos, k, ids, live, b: int):
    """The pick's leading kernel arguments, its constexprs and warps (draft_pick and draft_pick_input)."""
    block = min(max(triton.next_power_of_2(n_partials), 128), 16384)
    args = (pmax, pidx, n_partials, pmax.stride(0) if pmax.dim() > 1 else 0, ids if ids is not None else pidx, tok,
            dtok, base, acc, dpos, live if live is not None else acc, k, tok.numel() // b)
    kw = dict(BLOCK=block, HAS_MAP=ids is not None, HAS_LIVE=live is not None, **LAUNCH,
              num_warps=8 if block >= 4096 else 4)
    return args, kw


def draft_pick(pmax, pidx, n_partials, tok, dtok, base, acc, dpos, k, ids=None, live=None):
    """Draft d_k = argmax of the head's partials (with `ids`, int32 [N]: ids[argmax], the head's
    lm_head having read the rows of those token ids): tok[k] = dtok = d_k; dpos = base + acc + k (the
    head row of the chained step that drafts d_{k+1}). B slots (`live` int32 [B]): partials [B, >=
    n_partials] (one row stride), tok [B, M], dtok / base / acc / dpos [B]; slots not live untouched."""
    b = live.numel() if live is not None else 1
    args, kw = _pick_launch(pmax, pidx, n_partials, tok, dtok, base, acc, dpos, k, ids, live, b)
    draft_pick_kernel[(b,)](*args, **kw)


def draft_pick_input(pmax, pidx, n_partials, tok, dtok, base, acc, dpos, k, embed, hidden, w_e, w_h, out, eps,
                     ids=None, live=None):
    """`draft_pick(... k ...)` then `mtp_input(dtok, embed, hidden, w_e, w_h, out, eps)` in one launch: the
    chained step's fc input rows [B, 2H] from the draft it picks (B = out.shape[0] slots)."""
    b, h = out.shape[0], embed.shape[1]
    args, kw = _pick_launch(pmax, pidx, n_partials, tok, dtok, base, acc, dpos, k, ids, live, b)
    draft_pick_input_kernel[(b, 2)](*args, embed, hidden, w_e, w_h, out, h, hidden.stride(0), out.stride(0), eps,
                                    HP=triton.next_power_of_2(h), **kw)


__all__ = ["accept", "accept_kernel", "mtp_input", "mtp_input_kernel", "draft_pick", "draft_pick_kernel",
           "draft_pick_input", "draft_pick_input_kernel"]


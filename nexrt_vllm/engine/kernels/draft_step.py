"""The MTP head's chained draft step as one persistent launch (engine/gpu/spec_round.py `Tuning.draft_fused`).

A chained step drafts d_{k+1} from (g, d_k) at one head row: pick d_k, build the fc input, fc, RMSNorm + qkv,
q/k norm + RoPE + the K/V row, the three attention passes, o_proj + residual, RMSNorm + gate/up + SwiGLU,
down + residual, RMSNorm + lm_head + argmax partials. As separate launches that is 13 kernels, each a few
µs of weight bytes behind a launch boundary: the H100 breakdown had the two chained steps of a round at
about half the copy rate (benchmarks/results/gpu/round_breakdown_2b_h100.json). Here the phases run in
one launch of one program per SM, separated by grid barriers, and each program asks L2 for its share of
the next GEMV's weight as a phase begins, so the bytes stream while the latency-bound phases (pick, RoPE,
attention) run.

Every phase is the launch it replaces, item for item (the same jitted helpers, tile shapes and sums), so
the drafts are the separate launches' bit for bit. A phase's items (GEMV row tiles, attention (kv head,
split) pairs, heads) go to the programs round-robin.

Data a phase reads was written by an earlier phase on other SMs. L1 is not coherent across SMs and a 128-byte
line holds the rows of several programs' tiles, so no buffer is read in one phase and rewritten in a later one:
the residual stream has a buffer per residual add (u2 = u1 + o_proj, u3 = u2 + down; the launches add in place),
so no SM holds a line another rewrote since it read it.

The barrier counts arrivals (cnt) and releases by a generation word (gen): the last program to arrive
resets cnt and bumps gen, so the pair is back at rest after every launch (CUDA graph replays need no
reset). All NPROG programs must be resident at once: NPROG is at most the SM count and the kernel runs
one program per SM. The interpreter (CPU tests) runs programs one after another, so there each phase is a
launch of its own (`PHASES`), with no barrier: the same phase code, in order.
"""
import triton
import triton.language as tl

from .attention import _qk_rope_head, _verify_range, verify_combine, verify_pv, verify_scores
from .common import _ASM, LAUNCH, _bulk_prefetch, pdl_begin
from .common import bf16_round as _bf16
from .gemv_step import _acc, _epilogue, _rstd, _w_head
from .spec import _input_row, _pick

N_PHASES = 11
SELECT_PHASE = 7  # where a launch continuing the M-row pass begins (`draft_step`'s select)


@triton.jit
def _grid_sync(bar_ptr, NPROG: tl.constexpr):
    """Every program of the launch waits here until all NPROG have arrived (bar_ptr: int32 [cnt, gen])."""
    tl.debug_barrier()  # the CTA's stores precede thread 0's release below
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
    old = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if old == NPROG - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")
    else:
        cur = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
        while cur == gen:
            cur = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _ahead(w_ptr, stride_w, N, pid, NPROG: tl.constexpr, BN: tl.constexpr, K: tl.constexpr, ESZ: tl.constexpr,
           SWIGLU: tl.constexpr, CAP: tl.constexpr):
    """Ask L2 for this program's row tiles of the next GEMV (rows t*BN.., t = pid, pid + NPROG, ...; and the
    SwiGLU up rows N + those), at most CAP bytes; a hint (`common.l2_prefetch`)."""
    if _ASM and CAP > 0:
        TB: tl.constexpr = BN * K * ESZ  # a tile's bytes: BN whole rows, contiguous
        ntiles = tl.cdiv(N, BN)
        n = 0
        for t in range(pid, ntiles, NPROG):
            if n + TB <= CAP:
                rows = tl.minimum(N - t * BN, BN)
                _bulk_prefetch(w_ptr + t * BN * stride_w, rows * K * ESZ)
                if SWIGLU:
                    _bulk_prefetch(w_ptr + (N + t * BN) * stride_w, rows * K * ESZ)
            n += TB


@triton.jit
def _ahead_kv(kc_ptr, vc_ptr, pos_ptr, start_ptr, stride_ch, stride_cs, pid, NPROG: tl.constexpr, KVH: tl.constexpr,
              NSPLIT: tl.constexpr, MIN_PER: tl.constexpr, BLOCK: tl.constexpr, HD: tl.constexpr, ESZ: tl.constexpr,
              CAP: tl.constexpr):
    """Ask L2 for the K and V rows of this program's attention items (kv head, split) of one query row at pos."""
    if _ASM and CAP > 0:
        for item in range(pid, KVH * NSPLIT, NPROG):
            lo, hi, _, _, _ = _verify_range(pos_ptr, start_ptr, item % NSPLIT, 1, True, NSPLIT, MIN_PER, BLOCK)
            if lo < hi:
                off = (item // NSPLIT) * stride_ch + lo * stride_cs
                _bulk_prefetch(kc_ptr + off, ((hi - lo) * HD * ESZ).to(tl.int32))
                _bulk_prefetch(vc_ptr + off, ((hi - lo) * HD * ESZ).to(tl.int32))


@triton.jit
def _gemv_phase(x_ptr, w_ptr, s_ptr, srow_ptr, y_ptr, nw_ptr, xn_ptr, aux0_ptr, aux1_ptr, N, stride_w, stride_s, eps,
                pid, NPROG: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, PRO: tl.constexpr, EPI: tl.constexpr,
                STORE_XN: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr, VEC: tl.constexpr,
                FP8: tl.constexpr, BKS: tl.constexpr, UNIFORM: tl.constexpr, ROUND_W: tl.constexpr,
                OWN: tl.constexpr):
    """The program's row tiles of `gemv` (m = 1, no tail rows): per tile what `gemv_kernel` / `gemv_fp8_kernel`
    computes in the program of that index (its PRE head blocks first, as there). KP: K's power of two (used
    with PRO 1 only). OWN: first ask L2 for all of the program's tiles: one program per SM keeps a tile's
    loads in flight at a time, where a launch of its own has several programs per SM; the bulk requests keep
    HBM streaming the rest meanwhile (those the phase before asked for are already there)."""
    if OWN:
        _ahead(w_ptr, stride_w, N, pid, NPROG, BN, K, 1 if FP8 else 2, EPI == 2, 1 << 30)
    EVEN_K: tl.constexpr = K % BK == 0
    rstd = _rstd(x_ptr, K, eps, PRO, KP, BK)
    for t in range(pid, tl.cdiv(N, BN), NPROG):
        rows = t * BN + tl.arange(0, BN)
        rmask = rows < N
        wh, wuh = _w_head(w_ptr, rows, rmask, N, K, stride_w, EPI, BK, PRE)
        y, y_up = _acc(x_ptr, w_ptr, s_ptr, srow_ptr, nw_ptr, xn_ptr, rows, rmask, t, N, K, stride_w, stride_s, eps,
                       rstd, wh, wuh, PRO, EPI, 1, STORE_XN, BN, BK, EVEN_K, PRE, VEC, FP8, BKS, UNIFORM, ROUND_W)
        if EPI == 1:  # the residual from aux0, a buffer other than y (module doc: no line re-read after a rewrite)
            r = tl.load(aux0_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows, _bf16(r + _bf16(y)).to(y_ptr.dtype.element_ty), mask=rmask)
        else:
            _epilogue(y, y_up, y_ptr, aux0_ptr, aux1_ptr, rows, rmask, t, 0, EPI, 4, 4)


@triton.jit
def _row(nacc_ptr, SELECT: tl.constexpr):
    """The row of the M-row pass the SELECT launch continues: the accepted count's (a round that emitted
    nothing, -1: row 0, as `sampling.gather_rows`); 0 for a chained step."""
    a = tl.zeros([], dtype=tl.int64)
    if SELECT:
        a = tl.maximum(tl.load(nacc_ptr).to(tl.int64), 0)
    return a


@triton.jit
def draft_step_kernel(
        # the pick and the fc input
        pmax_ptr, pidx_ptr, NP, ids_ptr, tok_ptr, dtok_ptr, base_ptr, nacc_ptr, dpos_ptr, KI, MT,
        emb_ptr, g_ptr, we_ptr, wh_ptr, fcin_ptr, eps,
        # the residual stream, the layer's activations
        u1_ptr, u2_ptr, u3_ptr, qkv_ptr, q_ptr, o_ptr, act_ptr,
        # GEMV weights (w, scales, scale rows, row stride, scale stride): fc, qkv, o, gate/up, down, lm_head
        wf, sf, rf, swf, ssf, wq, sq, rq, swq, ssq, wo, so, ro, swo, sso,
        wg, sg, rg, swg, ssg, wd, sd, rd, swd, ssd, wl, sl, rl, swl, ssl,
        in_norm, post_norm, out_norm, N_QKV, N_LM, logits_ptr, lpmax_ptr, lpidx_ptr, xn_ptr,
        # attention over the head's cache
        kc_ptr, vc_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, stride_ch, stride_cs, start_ptr, s_ptr, m_ptr, l_ptr,
        acc_ptr, scale, max_len, bar_ptr, stride_su, stride_so,
        H: tl.constexpr, HP: tl.constexpr, FF: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr,
        ROT: tl.constexpr, RESTP: tl.constexpr, HDP: tl.constexpr, RP: tl.constexpr, BLOCK_D: tl.constexpr,
        NSPLIT: tl.constexpr, MIN_PER: tl.constexpr, ABLOCK: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_P: tl.constexpr, HAS_MAP: tl.constexpr,
        F_BN: tl.constexpr, F_BK: tl.constexpr, F_PRE: tl.constexpr, F_VEC: tl.constexpr, F_FP8: tl.constexpr,
        F_BKS: tl.constexpr, F_UNI: tl.constexpr,
        Q_BN: tl.constexpr, Q_BK: tl.constexpr, Q_PRE: tl.constexpr, Q_VEC: tl.constexpr, Q_FP8: tl.constexpr,
        Q_BKS: tl.constexpr, Q_UNI: tl.constexpr,
        O_BN: tl.constexpr, O_BK: tl.constexpr, O_PRE: tl.constexpr, O_VEC: tl.constexpr, O_FP8: tl.constexpr,
        O_BKS: tl.constexpr, O_UNI: tl.constexpr,
        G_BN: tl.constexpr, G_BK: tl.constexpr, G_PRE: tl.constexpr, G_VEC: tl.constexpr, G_FP8: tl.constexpr,
        G_BKS: tl.constexpr, G_UNI: tl.constexpr,
        D_BN: tl.constexpr, D_BK: tl.constexpr, D_PRE: tl.constexpr, D_VEC: tl.constexpr, D_FP8: tl.constexpr,
        D_BKS: tl.constexpr, D_UNI: tl.constexpr,
        L_BN: tl.constexpr, L_BK: tl.constexpr, L_PRE: tl.constexpr, L_VEC: tl.constexpr, L_FP8: tl.constexpr,
        L_BKS: tl.constexpr, L_UNI: tl.constexpr,
        ROUND_W: tl.constexpr, CAP: tl.constexpr, OWN: tl.constexpr, NPROG: tl.constexpr,
        PHASE0: tl.constexpr, PHASE1: tl.constexpr, SELECT: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    G: tl.constexpr = NH // KVH
    for ph in tl.static_range(PHASE0, PHASE1):
        if ph > PHASE0:
            _grid_sync(bar_ptr, NPROG)
        if ph == 0:  # pick d_k; the fc input [RMSNorm(embed(d_k)) ; RMSNorm(g)] (draft_pick_input_kernel)
            _ahead(wf, swf, H, pid, NPROG, F_BN, 2 * H, 1 if F_FP8 else 2, False, CAP)
            if pid < 2:
                t = tl.load(dtok_ptr).to(tl.int64)
                if pid == 0:
                    t = _pick(pmax_ptr, pidx_ptr, NP, 0, ids_ptr, tok_ptr, dtok_ptr, base_ptr, nacc_ptr, dpos_ptr,
                              0, KI, MT, BLOCK_P, HAS_MAP).to(tl.int64)
                _input_row(t, emb_ptr, g_ptr, we_ptr, wh_ptr, fcin_ptr, 0, pid, H, 0, 0, eps, HP)
        elif ph == 1:  # fc
            _ahead(wq, swq, N_QKV, pid, NPROG, Q_BN, H, 1 if Q_FP8 else 2, False, CAP)
            _gemv_phase(fcin_ptr, wf, sf, rf, u1_ptr, wf, wf, wf, wf, H, swf, ssf, eps, pid, NPROG, 2 * H, 1, 0, 0,
                        False, F_BN, F_BK, F_PRE, F_VEC, F_FP8, F_BKS, F_UNI, ROUND_W, OWN)
        elif ph == 2:  # RMSNorm + qkv; L2: the o_proj's tiles, the attention's K/V rows
            _ahead(wo, swo, H, pid, NPROG, O_BN, NH * HD, 1 if O_FP8 else 2, False, CAP)
            _ahead_kv(kc_ptr, vc_ptr, dpos_ptr, start_ptr, stride_ch, stride_cs, pid, NPROG, KVH, NSPLIT, MIN_PER,
                      ABLOCK, HD, 2, CAP)
            _gemv_phase(u1_ptr, wq, sq, rq, qkv_ptr, in_norm, wq, wq, wq, N_QKV, swq, ssq, eps, pid, NPROG, H, HP, 1, 0,
                        False, Q_BN, Q_BK, Q_PRE, Q_VEC, Q_FP8, Q_BKS, Q_UNI, ROUND_W, OWN)
        elif ph == 3:  # q/k norm + RoPE, the K/V row at the head position
            for item in range(pid, NH + KVH, NPROG):
                _qk_rope_head(qkv_ptr, q_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, item,
                              tl.load(dpos_ptr), eps, stride_ch, stride_cs, NH, KVH, HD, ROT, RESTP, HDP)
        elif ph == 4:  # attention scores per (kv head, split)
            for item in range(pid, KVH * NSPLIT, NPROG):
                verify_scores(q_ptr, kc_ptr, dpos_ptr, start_ptr, s_ptr, m_ptr, l_ptr, scale, 0, stride_ch,
                              stride_cs, max_len, item // NSPLIT, item % NSPLIT, 1, True, NSPLIT, MIN_PER, NH, G, RP,
                              HD, ABLOCK, DOT_F32)
        elif ph == 5:  # P.V per (kv head, split)
            for item in range(pid, KVH * NSPLIT, NPROG):
                verify_pv(vc_ptr, dpos_ptr, start_ptr, s_ptr, m_ptr, l_ptr, acc_ptr, stride_ch, stride_cs, max_len,
                          item // NSPLIT, item % NSPLIT, 1, True, NSPLIT, MIN_PER, NH, G, RP, HD, ABLOCK, DOT_F32)
        elif ph == 6:  # combine + output gate
            NDB: tl.constexpr = HD // BLOCK_D
            for item in range(pid, NH * NDB, NPROG):
                verify_combine(acc_ptr, qkv_ptr, o_ptr, dpos_ptr, start_ptr, 0, 0, item // NDB, item % NDB, 1, True,
                               NSPLIT, MIN_PER, ABLOCK, NH, HD, BLOCK_D)
        elif ph == 7:  # u2 = u1 + o_proj (SELECT: the M-row pass's row a of both)
            _ahead(wg, swg, FF, pid, NPROG, G_BN, H, 1 if G_FP8 else 2, True, CAP)
            a = _row(nacc_ptr, SELECT)
            _gemv_phase(o_ptr + a * stride_so, wo, so, ro, u2_ptr, wo, wo, u1_ptr + a * stride_su, wo, H, swo, sso,
                        eps, pid, NPROG, NH * HD, 1, 0, 1, False, O_BN, O_BK, O_PRE, O_VEC, O_FP8, O_BKS, O_UNI,
                        ROUND_W, OWN)
        elif ph == 8:  # RMSNorm + gate/up + SwiGLU
            _ahead(wd, swd, H, pid, NPROG, D_BN, FF, 1 if D_FP8 else 2, False, CAP)
            _gemv_phase(u2_ptr, wg, sg, rg, act_ptr, post_norm, wg, wg, wg, FF, swg, ssg, eps, pid, NPROG, H, HP, 1, 2,
                        False, G_BN, G_BK, G_PRE, G_VEC, G_FP8, G_BKS, G_UNI, ROUND_W, OWN)
        elif ph == 9:  # u3 = u2 + down
            _ahead(wl, swl, N_LM, pid, NPROG, L_BN, H, 1 if L_FP8 else 2, False, CAP)
            _gemv_phase(act_ptr, wd, sd, rd, u3_ptr, wd, wd, u2_ptr, wd, H, swd, ssd, eps, pid, NPROG, FF, 1, 0, 1,
                        False, D_BN, D_BK, D_PRE, D_VEC, D_FP8, D_BKS, D_UNI, ROUND_W, OWN)
        else:  # RMSNorm + lm_head + argmax partials; the normed row (g of the next step) by tile 0
            _gemv_phase(u3_ptr, wl, sl, rl, logits_ptr, out_norm, xn_ptr, lpmax_ptr, lpidx_ptr, N_LM, swl, ssl, eps,
                        pid, NPROG, H, HP, 1, 4, True, L_BN, L_BK, L_PRE, L_VEC, L_FP8, L_BKS, L_UNI, ROUND_W,
                        OWN)


__all__ = ["draft_step_kernel", "N_PHASES", "SELECT_PHASE"]


def gemv_operands(w, kw: dict, epi: int, n: int, dummy) -> tuple[tuple, tuple]:
    """A GEMV phase's operands from its `gemv` launch keywords `kw` (gpu/tuning.py gemv_kwargs) over `w` (bf16,
    or an fp8.FP8Weight without bf16 tail rows) with n output rows: ((w, scales, scale rows, row stride, scale
    stride), (BN, BK, PRE, VEC, FP8, BKS, UNIFORM)), as `gemv` would launch it."""
    from .gemv import blocks, fold_vec, fp8_operands, head_blocks

    k = w.shape[-1]
    bn, bk = blocks(k, kw.get("block_n"), kw.get("block_k"))
    f = fp8_operands(w, epi, n, bn, dummy)
    if f["TAIL"]:
        raise ValueError("draft_step: a weight with bf16 tail rows")
    fp8 = f["FP8"]
    pre = 0 if fp8 else head_blocks(kw.get("prefetch", 0), k, bk)
    vec = fold_vec(kw.get("vec", 0), 1 if fp8 else 2, bk)
    return ((f["w_ptr"], f["s_ptr"] if fp8 else f["w_ptr"], f["srow_ptr"] if fp8 else f["w_ptr"], f["stride_w"],
             f["stride_s"]), (bn, bk, pre, vec, fp8, f["BKS"], f["UNIFORM"]))


def draft_step(*, pick: tuple, fc_input: tuple, stream: tuple, gemvs: list, norms: tuple, attention: dict,
               bar, nprog: int, ahead: int, own: bool, round_w: bool, num_warps: int, phases: bool = False,
               select=None):
    """Launch `draft_step_kernel`: one chained step of the MTP head (module doc).

    pick: (pmax, pidx, n_partials, ids or None, tok, dtok, base, acc, dpos, k) as `spec.draft_pick_input`;
    fc_input: (embed, g, w_e, w_h, fc_in, eps); stream: (u1, u2, u3, qkv, q, o, act) buffers (u*: [H]);
    gemvs: [(w, launch keywords, n)] of fc, qkv, o_proj, gate/up (n: the SwiGLU's rows), down, lm_head;
    norms: (input, post-attention, final) RMSNorm weights; lm outputs in attention["lm"] = (logits,
    pmax, pidx, xn_out); attention: the head's cache and scratch (see the keys read below);
    bar: int32 [2] zeros (the grid barrier's words, at rest between launches); nprog: programs (at most
    the SM count: all must be resident); ahead: bytes of the next GEMV each program asks L2 for; own: each GEMV
    phase first asks L2 for all of the program's tiles;
    phases: launch each phase alone (the interpreter, whose programs run one after another), else one launch.
    select: (u rows, o rows) of the MTP head's pass over the verified rows, whose attention ran: phases 7-10 only,
    from its row of the accepted count (pick's acc), the rest as a chained step's (the drafter's first draft)."""
    pmax, pidx, n_part, ids, tok, dtok, base, acc, dpos, k = pick
    embed, g, w_e, w_h, fc_in, eps = fc_input
    u1, u2, u3, qkv, q, o, act = stream
    stride_su = stride_so = 0
    if select is not None:
        u1, o = select
        stride_su, stride_so = u1.stride(0), o.stride(0)
    a = attention
    logits, lpmax, lpidx, xn = a["lm"]
    epis = (0, 0, 1, 2, 1, 4)
    ops, shapes = [], []
    for (w, kw, n), epi in zip(gemvs, epis):
        rt, ce = gemv_operands(w, kw, epi, n, u1)
        ops += rt
        shapes += ce
    kc, hd, nh, kvh, rot = a["k"], a["head_dim"], a["num_heads"], a["num_kv_heads"], a["rotary_dim"]
    g_ = nh // kvh
    h = u1.shape[-1]
    block_p = min(max(triton.next_power_of_2(n_part), 128), 16384)
    args = (pmax, pidx, n_part, ids if ids is not None else pidx, tok, dtok, base, acc, dpos, k, tok.numel(),
            embed, g, w_e, w_h, fc_in, eps, u1, u2, u3, qkv, q, o, act, *ops, *norms, gemvs[1][2], gemvs[5][2],
            logits, lpmax, lpidx, xn, kc, a["v"], a["q_norm"], a["k_norm"], a["cos"], a["sin"],
            kc.stride(0), kc.stride(1), a["start"], a["s_buf"], a["m_buf"], a["l_buf"], a["acc_buf"], hd ** -0.5,
            kc.shape[1], bar, stride_su, stride_so)
    names = [p + s for p in "FQOGDL" for s in ("_BN", "_BK", "_PRE", "_VEC", "_FP8", "_BKS", "_UNI")]
    const = dict(H=h, HP=triton.next_power_of_2(h), FF=gemvs[3][2], NH=nh, KVH=kvh, HD=hd, ROT=rot,
                 RESTP=triton.next_power_of_2(hd - rot), HDP=triton.next_power_of_2(hd),
                 RP=max(16, triton.next_power_of_2(g_)), BLOCK_D=min(64, hd), NSPLIT=a["nsplit"],
                 MIN_PER=a["min_per"], ABLOCK=a["block"], DOT_F32=a["dot_f32"], BLOCK_P=block_p,
                 HAS_MAP=ids is not None, **dict(zip(names, shapes)), ROUND_W=round_w, CAP=ahead, OWN=own,
                 NPROG=nprog)
    const["SELECT"] = select is not None
    first = SELECT_PHASE if select is not None else 0
    if not phases:
        _check_resident(args, const, nprog, num_warps, u1.device, first)
    for p0, p1 in ([(first, N_PHASES)] if not phases else [(p, p + 1) for p in range(first, N_PHASES)]):
        draft_step_kernel[(nprog,)](*args, **const, PHASE0=p0, PHASE1=p1, **LAUNCH, num_warps=num_warps)


_RESIDENT: dict = {}  # (device, constexprs) -> programs the GPU holds at once


def _check_resident(args, const, nprog, num_warps, device, first) -> None:
    """Refuse a launch whose programs the GPU cannot hold all at once (its grid barrier would wait forever): the
    compiled kernel's registers, shared memory and warps per SM against the device's, before the first launch."""
    import torch

    if nprog <= torch.cuda.get_device_properties(device).multi_processor_count:
        return  # one program per SM at most: the GPU holds a launch it can start at all
    key = (str(device), tuple(sorted(const.items())), num_warps, first)
    if key not in _RESIDENT:
        k = draft_step_kernel.warmup(*args, **const, PHASE0=first, PHASE1=N_PHASES, **LAUNCH, num_warps=num_warps,
                                     grid=(nprog,))
        k._init_handles()
        p = torch.cuda.get_device_properties(device)
        regs = -(-k.n_regs * 32 // 256) * 256 * num_warps  # per program: whole 256-register warp allocations
        smem = k.metadata.shared + 1024  # plus the block's reserved shared memory
        # Hopper's per-SM limits where this torch does not report them
        per_sm = min(65536 // max(regs, 1), getattr(p, "shared_memory_per_multiprocessor", 233472) // smem,
                     getattr(p, "max_threads_per_multi_processor", 2048) // (32 * num_warps))
        _RESIDENT[key] = per_sm * p.multi_processor_count
    if nprog > _RESIDENT[key]:
        raise ValueError(f"draft_step: {nprog} programs, but the GPU holds {_RESIDENT[key]} of this kernel at once "
                         f"(Tuning.draft_fused_ctas too high)")


__all__ += ["draft_step", "gemv_operands"]

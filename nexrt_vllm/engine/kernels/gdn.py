"""Gated DeltaNet decode step: gates + L2 norms + delta rule in one pass over the fp32 state.

Input is the fused in_proj output after the conv epilogue (`gemv` EPI_CONV): [q | k | v | z | b | a]
with q, k, v already conv'd and SiLU'd. The update is separable over the value dimension (every
column j of S only needs k, q and v_j), so the grid is (value head, value block) and each program
reads its [dk, BLOCK_V] slice of S exactly once and writes it once. The gated output norm needs a
whole head, so it runs in the out_proj prologue (`gemv` PRO_GATED) instead of here — or, for launches
of many rows, in `gated_norm_rows` before a plain out_proj: the prologue is recomputed by every program
of the GEMV, which costs more than the weight stream once the rows are many.

Verify pass (speculative decoding): `gdn_verify_step` runs M tokens in order from the live state with
the slice in registers (read once, the live state never written) and stores the state after each
token; `gdn_commit` then makes the accepted token's state (recurrent and conv window) live. Or the
verify stores none and `Recommit` runs the accepted tokens again over the live state (one state
written per round instead of M; Tuning.gdn_recommit).
"""
import torch
import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.common import LAUNCH, gated_rmsnorm, pdl_begin
from nexrt_vllm.engine.kernels.common import bf16_round as _bf16


@triton.jit
def _delta_load(buf_ptr, a_log_ptr, dt_bias_ptr, vh, kh, offs_k, offs_v, KEY_DIM, OFF_B, OFF_A, DK: tl.constexpr,
                DV: tl.constexpr):
    """One token's inputs of the gated delta rule from its [q|k|v|z|b|a] row at buf_ptr (and the layer's A_log
    and dt_bias of value head vh), as loaded: what `_delta_apply` takes."""
    q = tl.load(buf_ptr + kh * DK + offs_k)
    k = tl.load(buf_ptr + KEY_DIM + kh * DK + offs_k)
    v = tl.load(buf_ptr + 2 * KEY_DIM + vh * DV + offs_v)
    b = tl.load(buf_ptr + OFF_B + vh)
    a = tl.load(buf_ptr + OFF_A + vh)
    return q, k, v, b, a, tl.load(dt_bias_ptr + vh), tl.load(a_log_ptr + vh)


@triton.jit
def _delta_apply(s, q, k, v, b, a, dt_bias, a_log, q_scale):
    # One token of the gated delta rule on the [DK, BLOCK_V] state slice s (fp32, in registers) from its
    # inputs as `_delta_load` leaves them. Returns the new slice and the fp32 output columns.
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
    q = q / q_scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    b = b.to(tl.float32)
    beta = _bf16(1.0 / (1.0 + tl.exp(-b)))  # sigmoid in the model dtype, as eager
    a = a.to(tl.float32) + dt_bias.to(tl.float32)
    # softplus = log1p(exp(a)) as torch computes it (threshold 20). log(1 + y) loses y's low bits when
    # y is small (up to 2 % off for a < -10); log(u) * y / (u - 1) with u = 1 + y is within 1 ulp.
    y = tl.exp(tl.minimum(a, 20.0))
    u = 1.0 + y
    softplus = tl.where(a > 20.0, a, tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0))))
    g = -tl.exp(a_log.to(tl.float32)) * softplus
    s = s * tl.exp(g)
    kv = tl.sum(s * k[:, None], 0)
    delta = (v - kv) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)
    return s, o


@triton.jit
def gdn_step_kernel(buf_ptr, state_ptr, out_ptr, a_log_ptr, dt_bias_ptr,
                    KEY_DIM, VALUE_DIM, OFF_B, OFF_A, q_scale,
                    HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BLOCK_V: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr):
    vh = tl.program_id(0)
    jb = tl.program_id(1)
    kh = vh // (HV // HK)  # key heads repeat_interleave onto value heads
    offs_k = tl.arange(0, DK)
    offs_v = jb * BLOCK_V + tl.arange(0, BLOCK_V)
    sp = state_ptr + vh * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    if PRE:
        # The state slice is written only by this kernel (the previous token's step of this layer,
        # long complete), never by the kernel this one waits on: read it before the wait.
        s = tl.load(sp)
    pdl_begin(PDL)
    if not PRE:
        s = tl.load(sp)
    q, k, v, b, a, dtb, alog = _delta_load(buf_ptr, a_log_ptr, dt_bias_ptr, vh, kh, offs_k, offs_v, KEY_DIM, OFF_B,
                                           OFF_A, DK, DV)
    s, o = _delta_apply(s, q, k, v, b, a, dtb, alog, q_scale)
    tl.store(sp, s)
    tl.store(out_ptr + vh * DV + offs_v, _bf16(o).to(out_ptr.dtype.element_ty))


def gdn_step(buf, state, out, a_log, dt_bias, *, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
             block_v=32, num_warps=4, prefetch=False):
    """One decode step for one GDN layer. `buf` = [q|k|v|z|b|a] (conv applied), `state` [HV, dk, dv] fp32;
    `prefetch`: read the state slice before waiting on the previous kernel (PDL)."""
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    off_b = 2 * key_dim + 2 * value_dim
    block_v = min(block_v, head_v_dim)
    gdn_step_kernel[(num_v_heads, head_v_dim // block_v)](
        buf, state, out, a_log, dt_bias, key_dim, value_dim, off_b, off_b + num_v_heads,
        float(head_k_dim) ** 0.5, HV=num_v_heads, HK=num_k_heads, DK=head_k_dim, DV=head_v_dim,
        BLOCK_V=block_v, PRE=bool(prefetch), **LAUNCH, num_warps=num_warps)


@triton.jit
def gdn_verify_kernel(buf_ptr, state_ptr, rec_ptr, out_ptr, a_log_ptr, dt_bias_ptr,
                      KEY_DIM, VALUE_DIM, OFF_B, OFF_A, q_scale, stride_buf, stride_rec, stride_out,
                      M: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BLOCK_V: tl.constexpr, PRE: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr):
    # The verify pass's M tokens in order, grid (value head, value block) as gdn_step: the live state
    # slice is read once and carried in registers; the slice after token j goes to rec_after[j] (what
    # gdn_commit picks from; not with STORE off: `Recommit` recomputes the accepted prefix), the live
    # state is never written.
    vh = tl.program_id(0)
    jb = tl.program_id(1)
    kh = vh // (HV // HK)
    offs_k = tl.arange(0, DK)
    offs_v = jb * BLOCK_V + tl.arange(0, BLOCK_V)
    so = vh * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    if PRE:
        # Written only by gdn_commit of the previous round, long complete: read it before the wait.
        s = tl.load(state_ptr + so)
    pdl_begin(PDL)
    if not PRE:
        s = tl.load(state_ptr + so)
    # token j + 1's inputs are loaded before token j's arithmetic (the loop unrolled): their latency hides
    # behind it instead of adding up over the M tokens; the arithmetic is the step's
    q, k, v, b, a, dtb, alog = _delta_load(buf_ptr, a_log_ptr, dt_bias_ptr, vh, kh, offs_k, offs_v, KEY_DIM, OFF_B,
                                           OFF_A, DK, DV)
    for j in tl.static_range(M):
        if j + 1 < M:
            q1, k1, v1, b1, a1, _, _ = _delta_load(buf_ptr + (j + 1) * stride_buf, a_log_ptr, dt_bias_ptr, vh, kh,
                                                   offs_k, offs_v, KEY_DIM, OFF_B, OFF_A, DK, DV)
        s, o = _delta_apply(s, q, k, v, b, a, dtb, alog, q_scale)
        if STORE:
            tl.store(rec_ptr + j * stride_rec + so, s)
        tl.store(out_ptr + j * stride_out + vh * DV + offs_v, _bf16(o).to(out_ptr.dtype.element_ty))
        if j + 1 < M:
            q, k, v, b, a = q1, k1, v1, b1, a1


@triton.jit
def gdn_commit_kernel(conv_ptr, rec_ptr, window_ptr, rec_after_ptr, a_ptr, live_ptr, N_REC, CONV_DIM, stride_conv,
                      stride_win, stride_rec, slot_conv, slot_rec, slot_win, slot_after, KM1: tl.constexpr,
                      KM1P: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, HAS_LIVE: tl.constexpr,
                      PDL: tl.constexpr):
    # The first programs copy rec_after[a] onto the live recurrent state (BLOCK floats each), the rest
    # the conv window's columns a+1 .. a+KM1 onto the conv state (BLOCK_C channels each). Grid axis 1:
    # the request slot (the batched round; slot_* its strides), a slot not live or with a < 0 (its
    # round emitted nothing) left as it is.
    pid, b, a, on = _commit_slot(a_ptr, live_ptr, HAS_LIVE, PDL)
    if on:
        nrec = tl.cdiv(N_REC, BLOCK)
        if pid < nrec:
            o = pid * BLOCK + tl.arange(0, BLOCK)
            om = o < N_REC
            tl.store(rec_ptr + b * slot_rec + o, tl.load(rec_after_ptr + b * slot_after + a * stride_rec + o, mask=om),
                     mask=om)
        else:
            _commit_conv(conv_ptr, window_ptr, b, a, pid - nrec, CONV_DIM, stride_conv, stride_win, slot_conv,
                         slot_win, KM1, KM1P, BLOCK_C)


@triton.jit
def _commit_slot(a_ptr, live_ptr, HAS_LIVE: tl.constexpr, PDL: tl.constexpr):
    """A commit program's (pid, slot b, accepted token a, whether slot b commits): not when it is not live or
    its round emitted nothing (a < 0)."""
    pdl_begin(PDL)
    b = tl.program_id(1).to(tl.int64)
    a = tl.load(a_ptr + b)
    on = a >= 0
    if HAS_LIVE:
        on = on & (tl.load(live_ptr + b) != 0)
    return tl.program_id(0), b, a, on


@triton.jit
def _commit_conv(conv_ptr, window_ptr, b, a, q, CONV_DIM, stride_conv, stride_win, slot_conv, slot_win,
                 KM1: tl.constexpr, KM1P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Conv program q of a commit: slot b's window columns a+1 .. a+KM1 onto its conv state, BLOCK_C channels."""
    c = q * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.arange(0, KM1P)
    cm = (c < CONV_DIM)[:, None] & (t < KM1)[None, :]
    x = tl.load(window_ptr + b * slot_win + c[:, None] * stride_win + (a + 1 + t)[None, :], mask=cm)
    tl.store(conv_ptr + b * slot_conv + c[:, None] * stride_conv + t[None, :], x, mask=cm)


def gdn_verify_step(buf, state, rec_after, out, a_log, dt_bias, *, m, num_k_heads, num_v_heads, head_k_dim,
                    head_v_dim, block_v=32, num_warps=4, prefetch=False):
    """The recurrent part of a verify pass over m tokens. `buf` [m, width] (row stride; rows [q|k|v|z|b|a]
    as the conv epilogue leaves them), `state` the live [HV, dk, dv] fp32 state (read only),
    `rec_after` [>= m, HV, dk, dv] fp32 receives the state after each token (None: no state is kept,
    `Recommit` recomputes the accepted one), `out` [m, value_dim] (row stride). `prefetch` as gdn_step."""
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    off_b = 2 * key_dim + 2 * value_dim
    block_v = min(block_v, head_v_dim)
    store = rec_after is not None
    assert state.is_contiguous() and (not store or (rec_after.shape[0] >= m and rec_after[0].is_contiguous()))
    sb = buf.stride(0) if buf.dim() > 1 else 0
    so = out.stride(0) if out.dim() > 1 else 0
    gdn_verify_kernel[(num_v_heads, head_v_dim // block_v)](
        buf, state, rec_after if store else state, out, a_log, dt_bias, key_dim, value_dim, off_b,
        off_b + num_v_heads, float(head_k_dim) ** 0.5, sb, rec_after.stride(0) if store else 0, so, M=m,
        HV=num_v_heads, HK=num_k_heads, DK=head_k_dim, DV=head_v_dim, BLOCK_V=block_v, PRE=bool(prefetch),
        STORE=store, **LAUNCH, num_warps=num_warps)


def gdn_commit(conv_state, rec_state, window, rec_after, a, *, block=4096, block_c=256, num_warps=4, live=None):
    """Make the state after verified token `a` (int64 [1], device, 0..m-1; < 0: nothing) live, in one
    launch: conv_state[:, t] = window[:, a+1+t] (t < kernel-1; window [conv_dim, kernel-1+m], row
    stride), rec_state = rec_after[a]. B request slots (`live` int32 [B]): every tensor gains a leading
    slot dimension (a [B]; rec_after [B, m, ...]); slots not live are left as they are."""
    slots = live is not None
    one = (lambda t: t[0]) if slots else (lambda t: t)  # noqa: E731 - one slot's tensor
    conv_dim, km1 = one(conv_state).shape
    n_rec = one(rec_state).numel()
    assert one(rec_state).is_contiguous() and one(rec_after)[0].is_contiguous() and window.stride(-1) == 1
    assert conv_state.stride(-1) == 1
    st = (lambda t: t.stride(0)) if slots else (lambda t: 0)  # noqa: E731 - the slot stride
    grid = (triton.cdiv(n_rec, block) + triton.cdiv(conv_dim, block_c), live.numel() if slots else 1)
    gdn_commit_kernel[grid](conv_state, rec_state, window, rec_after, a, live if slots else a, n_rec, conv_dim,
                            one(conv_state).stride(0), one(window).stride(0), one(rec_after).stride(0), st(conv_state),
                            st(rec_state), st(window), st(rec_after), KM1=km1, KM1P=triton.next_power_of_2(km1),
                            BLOCK=block, BLOCK_C=block_c, HAS_LIVE=slots, **LAUNCH, num_warps=num_warps)


@triton.jit
def gdn_recommit_kernel(table_ptr, a_ptr, live_ptr, KEY_DIM, OFF_B, OFF_A, q_scale, stride_buf, CONV_DIM,
                        stride_conv, stride_win, slot_buf, slot_rec, slot_conv, slot_win, DT: tl.constexpr,
                        A_DT: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BLOCK_V: tl.constexpr, KM1: tl.constexpr, KM1P: tl.constexpr, BLOCK_C: tl.constexpr,
                        HAS_LIVE: tl.constexpr, M: tl.constexpr, PDL: tl.constexpr):
    # `gdn_commit` without the states after each position, every GDN layer in one launch (grid axis 2: the
    # layer, its tensors' addresses a row of table_ptr: verify rows, conv state, recurrent state, window,
    # A_log, dt_bias). The first HV * DV / BLOCK_V programs run the verified tokens 0..a again over their
    # [DK, BLOCK_V] slice of the live state (the verify's rows of [q|k|v|z|b|a], the verify's ops: the same
    # state bits as its token a) and write it back; the rest copy the conv window's columns a+1 .. a+KM1
    # onto the conv state. Grid axis 1: the slot.
    pid, b, a, on = _commit_slot(a_ptr, live_ptr, HAS_LIVE, PDL)
    row = table_ptr + tl.program_id(2) * 6
    if on:
        NVB: tl.constexpr = DV // BLOCK_V
        if pid < HV * NVB:
            buf_ptr = tl.load(row).to(tl.pointer_type(DT))
            rec_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
            a_log_ptr = tl.load(row + 4).to(tl.pointer_type(A_DT))
            dt_bias_ptr = tl.load(row + 5).to(tl.pointer_type(A_DT))
            vh = pid // NVB
            kh = vh // (HV // HK)
            offs_k = tl.arange(0, DK)
            offs_v = (pid % NVB) * BLOCK_V + tl.arange(0, BLOCK_V)
            sp = rec_ptr + b * slot_rec + vh * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
            st = tl.load(sp)
            rows = buf_ptr + b * slot_buf
            # as the verify: each token's inputs loaded one token ahead (rows past a are the verify's too)
            q, k, v, gb, ga, dtb, alog = _delta_load(rows, a_log_ptr, dt_bias_ptr, vh, kh, offs_k, offs_v, KEY_DIM,
                                                     OFF_B, OFF_A, DK, DV)
            for j in tl.static_range(M):
                if j + 1 < M:
                    q1, k1, v1, gb1, ga1, _, _ = _delta_load(rows + (j + 1) * stride_buf, a_log_ptr, dt_bias_ptr, vh,
                                                             kh, offs_k, offs_v, KEY_DIM, OFF_B, OFF_A, DK, DV)
                if j <= a:
                    st = _delta_apply(st, q, k, v, gb, ga, dtb, alog, q_scale)[0]
                if j + 1 < M:
                    q, k, v, gb, ga = q1, k1, v1, gb1, ga1
            tl.store(sp, st)
        else:
            _commit_conv(tl.load(row + 1).to(tl.pointer_type(DT)), tl.load(row + 3).to(tl.pointer_type(DT)), b, a,
                         pid - HV * NVB, CONV_DIM, stride_conv, stride_win, slot_conv, slot_win, KM1, KM1P, BLOCK_C)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class Recommit:
    """`gdn_commit` for verifies that kept no state per position (`gdn_verify_step` / `batch_round.gdn_verify_rows`
    with rec_after None), every GDN layer in one launch: per layer (verify rows `buf` [m, width] with row stride,
    with B slots [B * m, width], slot b's rows b*m..; conv state; recurrent state; window; A_log; dt_bias) as
    `gdn_commit` / `gdn_verify_step` take them, their addresses in a device table built here (outside any graph
    capture). A call makes rec_state = the live state after tokens 0..a of the layer's rows, recomputed with
    the verify's ops (`block_v` / `num_warps` must be the verify's: the same sums in the same order), and the
    conv state from the window as `gdn_commit`: one state written per layer instead of the m the verify would
    store. `slots`: the tensors have a leading slot dimension and a call takes `live`."""

    def __init__(self, layers, *, m, num_k_heads, num_v_heads, head_k_dim, head_v_dim, block_v=32, num_warps=4,
                 block_c=256, slots=False):
        buf, conv, rec, win, a_log, _ = layers[0]
        one = (lambda t: t[0]) if slots else (lambda t: t)  # noqa: E731 - one slot's tensor
        for row in layers:  # one set of strides and dtypes for every layer
            for t, t0 in zip(row, layers[0]):
                if t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype or t.device != t0.device:
                    raise ValueError("Recommit: every layer's tensors must have layer 0's shapes, strides and dtypes")
        if not (one(rec).is_contiguous() and rec.dtype == torch.float32 and buf.stride(-1) == 1
                and win.stride(-1) == 1 and conv.stride(-1) == 1 and buf.dtype == conv.dtype == win.dtype):
            raise ValueError("Recommit: contiguous fp32 recurrent state; unit column strides; one activation dtype")
        self.table = torch.tensor([[t.data_ptr() for t in row] for row in layers], dtype=torch.int64,
                                  device=buf.device)
        self.n, self.slots, self.num_warps = len(layers), slots, num_warps
        conv_dim, km1 = one(conv).shape
        key_dim = num_k_heads * head_k_dim
        off_b = 2 * key_dim + 2 * num_v_heads * head_v_dim
        block_v = min(block_v, head_v_dim)
        self.programs = num_v_heads * (head_v_dim // block_v) + triton.cdiv(conv_dim, block_c)
        st = (lambda t: t.stride(0)) if slots else (lambda t: 0)  # noqa: E731 - the slot stride
        self.args = (key_dim, off_b, off_b + num_v_heads, float(head_k_dim) ** 0.5, buf.stride(0), conv_dim,
                     one(conv).stride(0), one(win).stride(0), m * buf.stride(0) if slots else 0, st(rec), st(conv),
                     st(win))
        self.consts = dict(DT=_TL[buf.dtype], A_DT=_TL[a_log.dtype], HV=num_v_heads, HK=num_k_heads, DK=head_k_dim,
                           DV=head_v_dim, BLOCK_V=block_v, KM1=km1, KM1P=triton.next_power_of_2(km1),
                           BLOCK_C=block_c, HAS_LIVE=slots, M=m)

    def __call__(self, a, live=None) -> None:
        """Commit every layer: a (int64 [1], or [B] with slots: the accepted token per slot, < 0: nothing);
        live (int32 [B], slots): the slots to commit, B <= the tensors' slots."""
        if self.slots != (live is not None):
            raise ValueError("Recommit: `live` goes with slots, and only with them")
        gdn_recommit_kernel[(self.programs, live.numel() if self.slots else 1, self.n)](
            self.table, a, live if self.slots else a, *self.args, **self.consts, **LAUNCH, num_warps=self.num_warps)


@triton.jit
def gated_norm_rows_kernel(x_ptr, z_ptr, w_ptr, out_ptr, eps, stride_x, stride_z, stride_out, V,
                           GROUP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # `gemv` PRO_GATED's prologue for one row's BLOCK columns (common.gated_rmsnorm, as the one-row
    # GEMV runs it), so the plain GEMV over `out` gives the fused launch's products.
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < V
    pdl_begin(PDL)
    x = tl.load(x_ptr + r * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + (cols % GROUP), mask=cmask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + r * stride_z + cols, mask=cmask, other=0.0).to(tl.float32)
    y = gated_rmsnorm(x, z, w, eps, GROUP)
    tl.store(out_ptr + r * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


def gated_norm_rows(x, z, norm_w, out, *, m, group, eps, block=512, num_warps=4):
    """The GDN output norm `w·rms(x)·SiLU(z)` per head of `group` values for rows x[:m] [m, V] (row strides;
    z likewise, e.g. the z columns of the in_proj output) into out[:m] (bf16; may be x itself: each
    program reads its values before it writes them). A plain `gemv` over `out` then equals the
    PRO_GATED launch over x."""
    v = x.shape[1]
    block = max(min(block, triton.next_power_of_2(v)), group)
    for name, t in (("x", x), ("z", z), ("out", out)):
        if t.dim() != 2 or t.shape[0] < m or t.shape[1] < v or t.stride(1) != 1:
            raise ValueError(f"gated_norm_rows: {name} must be [>= {m}, {v}] with unit column stride "
                             f"(got {tuple(t.shape)})")
    if v % group or block % group:
        raise ValueError(f"gated_norm_rows: {v} values are not whole heads of {group} (block {block})")
    gated_norm_rows_kernel[(m, triton.cdiv(v, block))](
        x, z, norm_w, out, eps, x.stride(0), z.stride(0), out.stride(0), v, GROUP=group, BLOCK=block, **LAUNCH,
        num_warps=num_warps)

"""Batch-1 matrix-vector product y = W x with fused prologues and epilogues.

At batch 1 a projection is a weight stream: every weight byte is read once and the vector x (a few
KiB) is re-read from L2 by each program. Fusing the norm that produces x into the prologue and the
residual add / activation / causal conv that consumes y into the epilogue removes the separate norm,
add and activation launches (each of which costs more launch gap than it moves bytes).

Prologues (PRO): 0 plain x; 1 zero-centred RMSNorm `x·rsqrt(mean x²+eps)·(1+w)` over all of K;
2 gated RMSNorm per head of GROUP elements `w·rms(x)·SiLU(z)` (GDN output norm; BLOCK_K a multiple
of GROUP).
Epilogues (EPI): 0 store y; 1 residual add `y_ptr += y`; 2 SwiGLU over W = [gate; up] (N rows each);
3 causal depthwise conv + SiLU on rows < CONV_N (GDN in_proj: updates the conv state in place),
4 store fp32 logits plus a per-program (max, argmax) pair for the sampler; 5 store y unrounded into an
fp32 y (a tensor-parallel rank's partial output, summed over the ranks before the residual add:
gpu/tp.py; m = 1 only). With `xn_out`, program 0
also stores the normed input (PRO 1) for a later launch (the MoE experts).

The kernels live by family: the decode step's (one row of x; bf16 `gemv_kernel`, FP8
`gemv_fp8_kernel` for an fp8.FP8Weight) in kernels/gemv_step.py, the M-row ones of the speculative
verify and the batch step (M <= 8 rows of x, each weight tile read once for all of them;
`gemv_rows_kernel`, tensor-core `gemv_rows_dot_kernel`) in kernels/gemv_verify.py. `gemv` picks one from its arguments.
"""
import torch
import triton

from nexrt_vllm.engine.kernels.common import ASM, LAUNCH
from nexrt_vllm.engine.kernels.gemv_step import gemv_fp8_kernel, gemv_kernel
from nexrt_vllm.engine.kernels.gemv_verify import gemv_rows_dot_kernel, gemv_rows_kernel, rmsnorm_rows_kernel

PRO_NONE, PRO_RMSNORM, PRO_GATED = 0, 1, 2
EPI_STORE, EPI_RESIDUAL, EPI_SWIGLU, EPI_CONV, EPI_ARGMAX, EPI_PARTIAL = 0, 1, 2, 3, 4, 5


def head_blocks(prefetch: int, k: int, block_k: int) -> int:
    """K blocks a program loads ahead of its wait: at most `prefetch` and the whole blocks of K, a power of two."""
    n = min(prefetch, k // block_k)
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def fold_vec(vec: int, elem_bytes: int, block_k: int) -> int:
    """gemv_step `_fold`'s run length: `vec`, or with 0 the elements of one 16-byte load; within block_k."""
    return min(vec or 16 // elem_bytes, block_k)


def gemv(x, w, y, *, pro=PRO_NONE, epi=EPI_STORE, norm_w=None, z=None, aux0=None, aux1=None, eps=1e-6,
         conv_n=0, group=1, kc=4, xn_out=None, block_n=None, block_k=None, num_warps=4, n=None, round_w=False,
         prefetch=0, vec=0, m=1, window=None, dot=0, l2=None, splits=1):
    """Launch `gemv_kernel`, or `gemv_fp8_kernel` when `w` is an fp8.FP8Weight (e4m3 + block scales,
    optionally a bf16 tail; `round_w`: see gemv_step `_acc`'s ROUND_W). `w` is [N, K] ([2N, K] for SwiGLU,
    N = rows of y); `prefetch`: K blocks of a bf16 W each program loads before it waits on the
    previous kernel (PDL), cut to a power of two within K; `vec`: columns each thread sums in
    registers before accumulating (`_fold`; 0: a 16-byte load's, 1: elementwise); returns the grid size.

    `m` > 1 (<= 8, or <= 32 with `dot`): `gemv_rows_kernel` over the rows of x [m, K] into y [m, N], W read
    once for all rows; every row strided (stride(0); unit column stride). Per row: z (PRO_GATED) and
    xn_out [m, K]; EPI_ARGMAX's aux0 fp32 / aux1 int32 [m, P] (P = the grid size returned; any row
    stride, the same for both); EPI_CONV runs the m rows as consecutive tokens from the live conv
    state aux0 (read only) and fills `window` [conv_n, kc-1+m] (bf16, any row stride) with the state
    and the m new inputs (`model.gdn_verify`'s window: token j's conv input is window[:, j:j+kc]).
    With m > 1 each thread always folds its 16-byte runs (`vec` is not used: elementwise
    accumulators for m rows would not fit in registers) and `prefetch` is cut to 4 blocks. `dot` > 0:
    `gemv_rows_dot_kernel` (tensor cores, >= 16 weight rows per program) with `dot` pipeline stages.
    `splits` > 1 (with `dot`): K split over that many programs per output tile (at most one per K block),
    summed in split order by the tile's last program (scratch: `splitk_workspace`); `prefetch` is not used with
    `dot`. An FP8 W with `dot`: K blocks inside the scale blocks are multiplied as e4m3 and scaled after, else
    (or with `round_w`) each e4m3 * scale is rounded to bf16 first (kernels/gemv_verify.py).
    `l2` (bf16 W): an `l2_target` of the next GEMV, whose first bytes the programs ask L2 for when done."""
    fp8 = hasattr(w, "scale")
    if fp8 and (prefetch or l2 is not None):
        raise ValueError("gemv: prefetch and l2 are for bf16 weights (got an FP8Weight)")
    if m != 1:
        return _gemv_rows(x, w, y, fp8, pro=pro, epi=epi, norm_w=norm_w, z=z, aux0=aux0, aux1=aux1, eps=eps,
                          conv_n=conv_n, group=group, kc=kc, xn_out=xn_out, block_n=block_n, block_k=block_k,
                          num_warps=num_warps, n=n, prefetch=prefetch, vec=vec, m=m, window=window, dot=dot,
                          splits=splits, round_w=round_w, l2=l2)
    if splits != 1:
        raise ValueError(f"gemv: splits is for the tensor-core M-row kernel (m > 1, dot > 0), got {splits}")
    k = w.shape[-1]
    n = n if n is not None else (w.shape[0] // 2 if epi == EPI_SWIGLU else w.shape[0])
    block_n, block_k = blocks(k, block_n, block_k, pro, group)
    grid = triton.cdiv(n, block_n)
    dummy = y
    if xn_out is not None:
        z = xn_out
    args = (norm_w if norm_w is not None else dummy, z if z is not None else dummy,
            aux0 if aux0 is not None else dummy, aux1 if aux1 is not None else dummy)
    pf_ptr, pf, segs = l2_args(l2, grid, dummy)
    common = dict(PRO=pro, EPI=epi, GROUP=group, KC=kc, KCP=triton.next_power_of_2(max(kc - 1, 1)),
                  STORE_XN=xn_out is not None, KP=triton.next_power_of_2(k), BLOCK_N=block_n, BLOCK_K=block_k,
                  EVEN_K=(k % block_k == 0), **LAUNCH, num_warps=num_warps)
    if not fp8:
        gemv_kernel[(grid,)](x, w, y, *args, pf_ptr, n, k, w.stride(0), eps, conv_n, *pf, PF=segs,
                             PRE=head_blocks(prefetch, k, block_k), VEC=fold_vec(vec, 2, block_k), **common)
        return grid
    f = fp8_operands(w, epi, n, block_n, dummy)
    gemv_fp8_kernel[(grid,)](
        x, f["w_ptr"], f["s_ptr"], f["srow_ptr"], f["t_ptr"], y, *args, n, k, f["N8"], f["stride_w"], f["stride_s"],
        f["stride_t"], eps, conv_n, BKS=f["BKS"], UNIFORM=f["UNIFORM"], ROUND_W=round_w, TAIL=f["TAIL"],
        VEC=fold_vec(vec, 1, block_k), VEC_T=fold_vec(vec, 2, block_k), **common)
    return grid


def blocks(k: int, block_n=None, block_k=None, pro: int = PRO_NONE, group: int = 1) -> tuple[int, int]:
    """A `gemv` launch's (rows, K columns) per program from its keywords: 16 and 512 by default, the K block
    within K's power of two, and for PRO_GATED whole heads per K block (group and block_k powers of two)."""
    block_k = min(block_k or 512, triton.next_power_of_2(k))
    if pro == PRO_GATED:
        block_k = max(block_k, group)
    return block_n or 16, block_k


def l2_args(l2, programs: int, dummy) -> tuple:
    """A launch's L2 request (`l2`: an `l2_target` or None) as kernel operands over `programs` programs:
    (pf_ptr, (pf_off1, pf_each, pf_chunk), PF)."""
    if l2 is None:
        return dummy, (0, 0, 0), 0
    pf_t, pf_off1, pf_each, segs = l2
    per = -(-pf_each // programs)
    return pf_t, (pf_off1, pf_each, -(-per // 16) * 16), segs


def l2_target(w, nbytes: int, halves: bool = False):
    """The `l2` argument of the launch before a GEMV over `w` (bf16 or fp8.FP8Weight: its e4m3 values):
    the first `nbytes` of the weight (split between the gate and the up half of a SwiGLU weight,
    `halves`, whose programs read both from their start), as (its bytes, offset of the second segment,
    bytes per segment, segments); None when nothing is asked (nbytes 0, a strided view)."""
    t = w.q if hasattr(w, "scale") else w
    if nbytes <= 0 or not t.is_contiguous():
        return None
    flat = t.view(-1).view(torch.uint8)
    segs = 2 if halves else 1
    each = min(nbytes, flat.numel()) // segs // 16 * 16
    return (flat, flat.numel() // 2 if halves else 0, each, segs) if each else None


def fp8_operands(w, epi: int, n: int, block_n: int, dummy) -> dict:
    """The FP8 keywords of the M-row kernels for `w` (bf16 or an fp8.FP8Weight) and launches of block_n rows."""
    if not hasattr(w, "scale"):
        return dict(w_ptr=w, s_ptr=dummy, srow_ptr=dummy, t_ptr=dummy, N8=n, stride_w=w.stride(0), stride_s=0,
                    stride_t=0, FP8=False, BKS=1, UNIFORM=True, TAIL=False)
    tail = w.tail
    if tail is not None:
        if epi == EPI_SWIGLU:
            raise ValueError("gemv: a SwiGLU weight cannot have bf16 tail rows")
        if w.n8 % block_n:
            raise ValueError(f"gemv: {w.n8} fp8 rows before the bf16 tail are not a multiple of block_n {block_n}")
    elif w.n8 != w.shape[0]:
        raise AssertionError("FP8Weight rows")
    return dict(w_ptr=w.q, s_ptr=w.scale, srow_ptr=w.srow, t_ptr=tail if tail is not None else dummy,
                N8=w.n8 if tail is not None else n, stride_w=w.q.stride(0), stride_s=w.scale.stride(0),
                stride_t=tail.stride(0) if tail is not None else 0, FP8=True, BKS=w.block[1],
                UNIFORM=w.row_uniform(block_n) and (epi != EPI_SWIGLU or w.row_uniform(block_n, n)),
                TAIL=tail is not None)


def _gemv_rows(x, w, y, fp8, *, pro, epi, norm_w, z, aux0, aux1, eps, conv_n, group, kc, xn_out, block_n,
               block_k, num_warps, n, prefetch, vec, m, window, dot, splits, round_w, l2):
    """`gemv` with m > 1: `gemv_rows_kernel`, or `gemv_rows_dot_kernel` with `dot` pipeline stages (and K
    split over `splits` programs per output tile); bf16 W or an fp8.FP8Weight."""
    if not 1 <= m <= (32 if dot else 8):  # the fold keeps the rows in registers; the tensor cores take 32
        raise ValueError(f"gemv: m must be 1..8 (1..32 on the tensor-core kernel, dot > 0), got {m}")
    if epi == EPI_PARTIAL:
        raise ValueError("gemv: EPI_PARTIAL is for m = 1 launches")
    k = w.shape[-1]
    n = n if n is not None else (w.shape[0] // 2 if epi == EPI_SWIGLU else w.shape[0])
    for name, t, cols in (("x", x, k), ("y", y, n), ("z", z if pro == PRO_GATED else None, k),
                          ("xn_out", xn_out, k)):
        if t is not None and (t.dim() != 2 or t.shape[0] < m or t.shape[1] < cols or t.stride(1) != 1):
            raise ValueError(f"gemv: {name} must be [m, {cols}] with unit column stride (got {tuple(t.shape)})")
    block_n, block_k = blocks(k, block_n, block_k, pro, group)
    if dot and (block_n < 16 or block_k < 16):
        raise ValueError(f"gemv: the tensor-core M-row kernel needs block_n and block_k >= 16 (got {block_n}, "
                         f"{block_k})")
    grid = triton.cdiv(n, block_n)
    dummy = y
    if xn_out is not None:
        z = xn_out
    stride_a, stride_win = 0, 0
    if epi == EPI_ARGMAX:
        if aux0.stride(0) != aux1.stride(0) or aux0.shape[-1] < grid or aux1.shape[-1] < grid:
            raise ValueError(f"gemv: argmax partials must be [m, >= {grid}] with one row stride")
        stride_a = aux0.stride(0)
    if epi == EPI_CONV:
        if window is None or window.shape[0] < conv_n or window.shape[1] < kc - 1 + m or window.stride(1) != 1:
            raise ValueError(f"gemv: EPI_CONV with m > 1 needs window [{conv_n}, {kc - 1 + m}]")
        stride_win = window.stride(0)
    args = dict(x_ptr=x, y_ptr=y, nw_ptr=norm_w if norm_w is not None else dummy, z_ptr=z if z is not None else dummy,
                aux0_ptr=aux0 if aux0 is not None else dummy, aux1_ptr=aux1 if aux1 is not None else dummy,
                win_ptr=window if window is not None else dummy, N=n, K=k, stride_x=x.stride(0),
                stride_y=y.stride(0), stride_z=z.stride(0) if z is not None else 0, stride_a=stride_a,
                stride_win=stride_win, eps=eps, CONV_N=conv_n, **fp8_operands(w, epi, n, block_n, dummy))
    common = dict(M=m, MP=triton.next_power_of_2(m), PRO=pro, EPI=epi, GROUP=group, KC=kc,
                  KCP=triton.next_power_of_2(max(kc - 1, 1)), STORE_XN=xn_out is not None,
                  KP=triton.next_power_of_2(k), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=(k % block_k == 0),
                  **LAUNCH, num_warps=num_warps)
    if dot:
        if splits < 1:
            raise ValueError(f"gemv: splits must be >= 1, got {splits}")
        splits = min(splits, triton.cdiv(k, block_k))  # a rule's splits over a short K: one block a split
        part, cnt = y, y
        if splits > 1:
            part, cnt = splitk_workspace(y.device, 2 * splits * grid * block_n * common["MP"], grid)
        pf_ptr, (pf_off1, pf_each, pf_chunk), segs = l2_args(l2, grid * splits, dummy)
        gemv_rows_dot_kernel[(grid, splits)](**args, DOT=1 if ASM else 2, SPLITS=splits, part_ptr=part, cnt_ptr=cnt,
                                             ROUND_W=round_w, num_stages=dot, pf_ptr=pf_ptr, pf_off1=pf_off1,
                                             pf_each=pf_each, pf_chunk=pf_chunk, PF=segs, **common)
        return grid
    if splits != 1:
        raise ValueError(f"gemv: splits needs the tensor-core M-row kernel (dot > 0), got {splits}")
    pf_ptr, (pf_off1, pf_each, pf_chunk), segs = l2_args(l2, grid, dummy)
    gemv_rows_kernel[(grid,)](**args, PRE=head_blocks(min(prefetch, 4), k, block_k), VEC=min(8, block_k),
                              ROUND_W=round_w, pf_ptr=pf_ptr, pf_off1=pf_off1, pf_each=pf_each, pf_chunk=pf_chunk,
                              PF=segs, **common)
    return grid


# (device, stream) -> (fp32 partials, int32 arrival counters, the buffers they replaced)
_SPLITK: dict = {}


def splitk_workspace(device: torch.device, numel: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch of the split-K M-row GEMVs on `device`'s current stream: at least `numel` fp32 partials and
    `tiles` arrival counters. Launches in one stream run one after another and a tile's last program leaves
    its counter at 0, so they share one pair; streams get their own (concurrent graphs of one process). A
    larger request allocates a new pair and keeps the old one alive: a captured graph holds its address."""
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    ws = _SPLITK.get(key)
    if ws is None or ws[0].numel() < numel or ws[1].numel() < tiles:
        numel = max(numel, ws[0].numel() if ws else 0)
        tiles = max(tiles, ws[1].numel() if ws else 0)
        ws = (torch.empty(numel, dtype=torch.float32, device=device),
              torch.zeros(tiles, dtype=torch.int32, device=device), ws)
        _SPLITK[key] = ws
    return ws[0], ws[1]


def rmsnorm_rows(x, norm_w, out, *, m, eps, block_k=1024, num_warps=4):
    """out[:m] = the zero-centred RMSNorm of x[:m] [m, K] (row strides, unit column stride; bf16 out, may not
    alias x), each row as `gemv(pro=PRO_RMSNORM)` normalizes it: a plain `gemv(..., m=m)` over out then
    equals that launch's products. For many rows, where the fused prologue's per-program cost grows
    with the rows (Tuning.norm_rows)."""
    k = x.shape[1]
    for name, t in (("x", x), ("out", out)):
        if t.dim() != 2 or t.shape[0] < m or t.shape[1] < k or t.stride(1) != 1:
            raise ValueError(f"rmsnorm_rows: {name} must be [>= {m}, {k}] with unit column stride "
                             f"(got {tuple(t.shape)})")
    if out.data_ptr() == x.data_ptr():
        raise ValueError("rmsnorm_rows: out must not be x (a row's norm reads the whole row twice)")
    rmsnorm_rows_kernel[(m,)](x, norm_w, out, x.stride(0), out.stride(0), k, eps, KP=triton.next_power_of_2(k),
                              BLOCK_K=min(block_k, triton.next_power_of_2(k)), **LAUNCH, num_warps=num_warps)


__all__ = ["gemv", "blocks", "fp8_operands", "l2_args", "l2_target", "splitk_workspace", "gemv_kernel", "gemv_fp8_kernel",
           "gemv_rows_kernel", "gemv_rows_dot_kernel", "rmsnorm_rows", "rmsnorm_rows_kernel",
           "head_blocks", "fold_vec", "PRO_NONE", "PRO_RMSNORM", "PRO_GATED", "EPI_STORE", "EPI_RESIDUAL",
           "EPI_SWIGLU", "EPI_CONV", "EPI_ARGMAX", "EPI_PARTIAL"]

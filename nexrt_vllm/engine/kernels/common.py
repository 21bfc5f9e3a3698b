"""Helpers shared by the decode kernels: bf16 rounding, SiLU, programmatic dependent launch."""
import contextlib
import os

import triton
import triton.language as tl

try:  # grid dependency control (Hopper); absent from older Triton
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAVE_GDC = True
except ImportError:  # pragma: no cover - depends on the Triton build
    _HAVE_GDC = False

# Programmatic dependent launch (PDL, Hopper): a kernel may be scheduled while its predecessor still
# runs; it waits (gdc_wait) before touching any memory and at once lets its own successor launch.
# The process default comes from NEXRT_PDL=1; a `FusedDecoder` applies its `Tuning.pdl` (on by
# default) with `launch_options`. Always off in the interpreter.
_PDL_OK = _HAVE_GDC and os.environ.get("TRITON_INTERPRET") != "1"
# Inline PTX (the system-scope fences around host-mapped memory): compiled kernels only; the
# interpreter runs programs one after another on the host, where the fences have nothing to order.
ASM = os.environ.get("TRITON_INTERPRET") != "1"
_ASM = tl.constexpr(ASM)  # the same, for jitted helpers (globals they read must be constexpr)
LAUNCH = {"PDL": False}  # **kwargs of every decode-kernel launch; mutated in place by launch_options


def _set(pdl: bool) -> None:
    LAUNCH.clear()
    LAUNCH.update({"PDL": True, "launch_pdl": True} if pdl and _PDL_OK else {"PDL": False})


_set(os.environ.get("NEXRT_PDL") == "1")
DEFAULT_PDL = LAUNCH["PDL"]


@contextlib.contextmanager
def launch_options(pdl: bool | None = None):
    """Launch the decode kernels inside the block with PDL on or off (None: the process default)."""
    saved = LAUNCH["PDL"]
    _set(DEFAULT_PDL if pdl is None else pdl)
    try:
        yield
    finally:
        _set(saved)


@triton.jit
def bf16_round(x):
    """Round fp32 to the nearest bf16 (ties to even), returned as fp32.

    The eager path materialises bf16 tensors after most ops; kernels round at the same points. Done
    with integer ops rather than a cast because the Triton interpreter (CPU tests) truncates on
    fp32->bf16 casts; on the GPU both give the same bits. Every bf16 store stores a value rounded
    here, so the store's own cast is exact.
    """
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def gated_rmsnorm(x, z, w, eps, GROUP: tl.constexpr):
    """The GDN output norm over x [BLOCK] (whole heads of GROUP elements; fp32 values of bf16 tensors):
    rms per head, bf16 norm, bf16 weight product (w: the norm weight per column), SiLU(z) gate."""
    BLOCK: tl.constexpr = x.shape[0]
    NH: tl.constexpr = BLOCK // GROUP
    x2 = tl.reshape(x, (NH, GROUP))
    r = tl.rsqrt(tl.sum(x2 * x2, 1) / GROUP + eps)
    xn = tl.reshape(bf16_round(x2 * r[:, None]), (BLOCK,))
    return bf16_round(bf16_round(w * xn) * silu(z))


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()



@triton.jit
def fence_sys(ASM: tl.constexpr):
    """fence.sc.sys: this thread's earlier memory operations are ordered before its later ones for
    every observer, the host included (host-mapped memory is read by the CPU, written by it)."""
    if ASM:
        tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch(pf_ptr, pf_off1, pf_each, pf_chunk, pid, PF: tl.constexpr):
    """Ask L2 for this program's share of the next GEMV's first weight bytes (PF segments of pf_each
    bytes of the uint8 tensor at pf_ptr, at byte 0 and pf_off1; pf_chunk bytes per program, multiples
    of 16): one bulk prefetch per segment, issued by thread 0 when the program is done. The last
    programs of a launch finish one by one while HBM idles; these requests keep it streaming the bytes
    the next launch reads first. A hint: no result, nothing to order."""
    if _ASM and PF > 0:
        off = pid * pf_chunk
        n = tl.minimum(pf_each - off, pf_chunk)
        if n > 0:
            _bulk_prefetch(pf_ptr + off, n)
            if PF > 1:
                _bulk_prefetch(pf_ptr + pf_off1 + off, n)


@triton.jit
def _bulk_prefetch(p, n):
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [p.to(tl.int64), n.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

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
# runs. Before `gdc_wait` it may only touch memory the predecessor does not write: there it asks L2
# for its own weights (`prefetch_l2`), so the HBM stream continues through the predecessor's tail
# and this kernel's ramp-up. After the wait it at once lets its own successor launch. Off in the
# interpreter. Default from NEXRT_PDL (1 = on, with prefetch unless NEXRT_PREFETCH=0); a
# `FusedDecoder` sets its `Tuning`'s choice with `launch_options` around its launches.
_PDL_OK = _HAVE_GDC and os.environ.get("TRITON_INTERPRET") != "1"
LAUNCH = {"PDL": False}  # **kwargs of every decode-kernel launch; mutated in place by launch_options
OPTS = {"prefetch": False}


def _set(pdl: bool, prefetch: bool) -> None:
    on = bool(pdl) and _PDL_OK
    LAUNCH.clear()
    LAUNCH.update({"PDL": True, "launch_pdl": True} if on else {"PDL": False})
    OPTS["prefetch"] = on and bool(prefetch)


_set(os.environ.get("NEXRT_PDL") == "1", os.environ.get("NEXRT_PREFETCH", "1") == "1")
DEFAULT = (LAUNCH["PDL"], OPTS["prefetch"])


@contextlib.contextmanager
def launch_options(pdl: bool | None = None, prefetch: bool | None = None):
    """Launch the decode kernels inside the block with PDL / L2 prefetch on or off (None: the default)."""
    saved = (LAUNCH["PDL"], OPTS["prefetch"])
    _set(DEFAULT[0] if pdl is None else pdl, DEFAULT[1] if prefetch is None else prefetch)
    try:
        yield
    finally:
        _set(*saved)


def prefetching() -> bool:
    return OPTS["prefetch"]


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
def pdl_begin(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs` (no registers held, no wait)."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(base, rows, rmask, row_stride, ncols, ELEMS_PER_LINE: tl.constexpr, LINES: tl.constexpr):
    """prefetch_l2 of `rows` x [0, ncols) elements of a row-major matrix (LINES >= ncols / ELEMS_PER_LINE)."""
    ln = tl.arange(0, LINES) * ELEMS_PER_LINE
    ok = rmask[:, None] & (ln[None, :] < ncols)
    prefetch_l2(base + tl.where(ok, rows[:, None].to(tl.int64) * row_stride + ln[None, :], 0))


def lines(ncols: int, elem_bytes: int = 2) -> int:
    """LINES for prefetch_rows: 128-byte lines per row of `ncols` elements, as a power of two."""
    return triton.next_power_of_2(max(1, -(-ncols * elem_bytes // 128)))

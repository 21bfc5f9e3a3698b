"""Numeric helpers shared by the decode kernels."""
import triton
import triton.language as tl


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

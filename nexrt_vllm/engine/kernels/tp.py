"""The decode step's tensor-parallel pieces (gpu/tp.py): the residual add after an all-reduce, and the
greedy token across vocabulary shards as one max-reduced 64-bit key.

A rank's mixer and FFN leave their partial output in an fp32 buffer (gemv EPI_PARTIAL, or the MoE
launch adding into it); after the all-reduce `residual_add` adds the sum to the residual with the
rounding of the one-device epilogue (bf16(res + bf16(y))) and zeroes the buffer for the next block.

Greedy at TP > 1: each rank holds a slice of the logits. `argmax_key` reduces its lm_head partials to
one key, (the logit's bits made order-preserving) << 32 | (2^31 - 1 - global id): the max over
the ranks' keys is the largest logit and, among equal ones, the lowest id (torch.argmax's rule),
so one 8-byte max all-reduce replaces a gather of every rank's partials; `key_argmax` turns the
reduced key back into the (max, argmax) pair the finish launch reads.
"""
import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.common import LAUNCH, pdl_begin
from nexrt_vllm.engine.kernels.common import bf16_round as _bf16
from nexrt_vllm.engine.kernels.sampling import argmax_partials


@triton.jit
def residual_add_kernel(res_ptr, part_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    h = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = h < H
    r = tl.load(res_ptr + h, mask=m, other=0.0).to(tl.float32)
    p = tl.load(part_ptr + h, mask=m, other=0.0)
    tl.store(res_ptr + h, _bf16(r + _bf16(p)).to(res_ptr.dtype.element_ty), mask=m)
    tl.store(part_ptr + h, tl.zeros_like(p), mask=m)


def residual_add(res, part, block=1024):
    """res += bf16(part) (bf16 res, fp32 part [H]), rounded as the EPI_RESIDUAL epilogue; part = 0."""
    n = res.numel()
    residual_add_kernel[(triton.cdiv(n, block),)](res, part, n, BLOCK=block, **LAUNCH, num_warps=4)


@triton.jit
def argmax_key_kernel(pmax_ptr, pidx_ptr, NP, logits_ptr, offset, key_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    i = argmax_partials(pmax_ptr, pidx_ptr, NP, BLOCK)
    found = i != 2147483647  # an empty slice: -inf and no id, below every logit
    v = tl.load(logits_ptr + tl.where(found, i, 0), mask=found, other=float("-inf"))
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 and +0.0 are one value: one key
    bits = v.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    low = tl.where(found, 2147483647 - (i + offset), 0)
    tl.store(key_ptr, (ordered.to(tl.int64) << 32) | low.to(tl.int64))


@triton.jit
def key_argmax_kernel(key_ptr, pmax_ptr, pidx_ptr, PDL: tl.constexpr):
    pdl_begin(PDL)
    key = tl.load(key_ptr)
    hi = (key >> 32).to(tl.int32)
    bits = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi)
    tl.store(pmax_ptr, bits.to(tl.float32, bitcast=True))
    tl.store(pidx_ptr, 2147483647 - (key & 0xFFFFFFFF).to(tl.int32))


def argmax_key(pmax, pidx, n_partials, logits, offset, key):
    """key [1] int64 <- this rank's greedy candidate over its `n_partials` lm_head partials (indices into
    its `logits` slice, whose first id is `offset`); the lowest key when the slice is empty."""
    block = min(max(triton.next_power_of_2(max(n_partials, 1)), 128), 16384)
    argmax_key_kernel[(1,)](pmax, pidx, n_partials, logits, offset, key, BLOCK=block, **LAUNCH,
                            num_warps=8 if block >= 4096 else 4)


def key_argmax(key, pmax, pidx):
    """pmax[0], pidx[0] <- the (logit, global id) of a max-reduced `argmax_key` key."""
    key_argmax_kernel[(1,)](key, pmax, pidx, **LAUNCH, num_warps=1)

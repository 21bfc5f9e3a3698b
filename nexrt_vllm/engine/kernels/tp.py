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

One-shot collectives over peer memory (`peer_collective`): every rank can load and store every other rank's
buffer (GPUs of one host with peer access, or host memory shared between processes). A launch copies its
input into its own buffer, tells each peer by a flag in the peer's signal array, waits for every peer's
flag, then reads all ranks' inputs: the sum in rank order (every rank the same bits), the max, the
concatenation, or rank 0's; the sum can also be added to the residual as `residual_add` does (and the rank's
partial zeroed), so a block's reduction is one launch. One launch and no NCCL kernel per collective; the
step's messages are a few KB, where the cost is latency. Each buffer holds two halves used alternately: a
rank writes the half of call c + 2 only after every peer has arrived at call c + 1, which they reach after
their reads of call c. Each program keeps its own call count (`epoch`) and flags, over its own chunk.
"""
import triton
import triton.language as tl

from nexrt_vllm.engine.kernels.common import ASM, LAUNCH, fence_sys, pdl_begin
from nexrt_vllm.engine.kernels.common import bf16_round as _bf16
from nexrt_vllm.engine.kernels.sampling import argmax_partials


@triton.jit
def _residual(r, y):
    """The one-device residual epilogue's rounding of res + y (fp32 values): bf16(res + bf16(y))."""
    return _bf16(r + _bf16(y))


@triton.jit
def residual_add_kernel(res_ptr, part_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    h = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = h < H
    r = tl.load(res_ptr + h, mask=m, other=0.0).to(tl.float32)
    p = tl.load(part_ptr + h, mask=m, other=0.0)
    tl.store(res_ptr + h, _residual(r, p).to(res_ptr.dtype.element_ty), mask=m)
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


OP_SUM, OP_MAX, OP_GATHER, OP_BCAST, OP_SUM_RESIDUAL = 0, 1, 2, 3, 4
PEER_BLOCK = 1024  # elements per program of a peer collective


@triton.jit
def _peer(table_ptr, p, ety: tl.constexpr):
    return tl.load(table_ptr + p).to(tl.pointer_type(ety))


@triton.jit
def peer_collective_kernel(x_ptr, out_ptr, n, bufs_ptr, sigs_ptr, epoch_ptr, status_ptr, rank, half,
                           SIZE: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr, SPIN: tl.constexpr,
                           ASM: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    ety: tl.constexpr = x_ptr.dtype.element_ty
    e = tl.load(epoch_ptr + pid) + 1  # this program's call count (int32: the flag compare wraps)
    tl.store(epoch_ptr + pid, e)
    at = (e & 1) * half + offs  # (not e % 2: negative past the wrap)
    tl.store(_peer(bufs_ptr, rank, ety) + at, tl.load(x_ptr + offs, mask=m), mask=m)
    tl.debug_barrier()  # every thread's store before thread 0's release
    for p in tl.static_range(SIZE):
        tl.atomic_xchg(_peer(sigs_ptr, p, tl.int32) + pid * SIZE + rank, e, sem="release", scope="sys")
    mine = _peer(sigs_ptr, rank, tl.int32) + pid * SIZE
    late = 0
    for p in tl.static_range(SIZE):
        f = tl.load(mine + p, volatile=True)
        k = 0
        while ((f - e) < 0) & (k < SPIN):  # bounded: a peer that never comes leaves status set
            f = tl.load(mine + p, volatile=True)
            k += 1
        late = late | ((f - e) < 0).to(tl.int32)
    fence_sys(ASM)  # the peers' inputs are read after their flags
    tl.debug_barrier()
    if OP == 0 or OP == 4:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(SIZE):
            acc += tl.load(_peer(bufs_ptr, p, ety) + at, mask=m, other=0.0, cache_modifier=".cv").to(tl.float32)
        if OP == 0:
            tl.store(out_ptr + offs, acc.to(ety), mask=m)
        else:  # `residual_add` fused: out (the bf16 residual) += bf16(sum), the rank's partial x zeroed
            r = tl.load(out_ptr + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs, _residual(r, acc).to(out_ptr.dtype.element_ty), mask=m)
            tl.store(x_ptr + offs, tl.zeros_like(acc).to(ety), mask=m)
    elif OP == 1:
        acc = tl.load(_peer(bufs_ptr, 0, ety) + at, mask=m, cache_modifier=".cv")
        for p in tl.static_range(1, SIZE):
            acc = tl.maximum(acc, tl.load(_peer(bufs_ptr, p, ety) + at, mask=m, cache_modifier=".cv"))
        tl.store(out_ptr + offs, acc, mask=m)
    elif OP == 2:
        for p in tl.static_range(SIZE):
            tl.store(out_ptr + p * n + offs, tl.load(_peer(bufs_ptr, p, ety) + at, mask=m, cache_modifier=".cv"),
                     mask=m)
    else:
        tl.store(out_ptr + offs, tl.load(_peer(bufs_ptr, 0, ety) + at, mask=m, cache_modifier=".cv"), mask=m)
    tl.store(status_ptr + pid * 0, late, mask=late != 0)


def peer_collective(x, out, op, bufs, sigs, epoch, status, rank, half, size, spin):
    """One collective of `op` over x [n] (contiguous) of this rank and its peers': out [n] (OP_GATHER:
    [size * n]; OP_SUM_RESIDUAL: the bf16 residual the sum is added to, as `residual_add`, x zeroed) on
    every rank. bufs / sigs: int64 [size] addresses of every rank's buffer (2 * half
    elements of x's dtype) and signal array (int32 [programs * size]); epoch: this rank's int32
    [programs]; status [1] int32 set to 1 where a peer's flag did not come within `spin` reads."""
    n = x.numel()
    peer_collective_kernel[(triton.cdiv(n, PEER_BLOCK),)](
        x, out, n, bufs, sigs, epoch, status, rank, half, SIZE=size, OP=op, BLOCK=PEER_BLOCK, SPIN=spin,
        ASM=ASM, **LAUNCH, num_warps=4)

"""Gated DeltaNet decode step: gates + L2 norms + delta rule in one pass over the fp32 state.

Input is the fused in_proj output after the conv epilogue (`gemv` EPI_CONV): [q | k | v | z | b | a]
with q, k, v already conv'd and SiLU'd. The update is separable over the value dimension (every
column j of S only needs k, q and v_j), so the grid is (value head, value block) and each program
reads its [dk, BLOCK_V] slice of S exactly once and writes it once. The gated output norm needs a
whole head, so it runs in the out_proj prologue (`gemv` PRO_GATED) instead of here.
"""
import triton
import triton.language as tl

from .common import LAUNCH, pdl_begin
from .common import bf16_round as _bf16


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
    q = tl.load(buf_ptr + kh * DK + offs_k).to(tl.float32)
    k = tl.load(buf_ptr + KEY_DIM + kh * DK + offs_k).to(tl.float32)
    v = tl.load(buf_ptr + 2 * KEY_DIM + vh * DV + offs_v).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
    q = q / q_scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    b = tl.load(buf_ptr + OFF_B + vh).to(tl.float32)
    beta = _bf16(1.0 / (1.0 + tl.exp(-b)))  # sigmoid in the model dtype, as eager
    a = tl.load(buf_ptr + OFF_A + vh).to(tl.float32) + tl.load(dt_bias_ptr + vh).to(tl.float32)
    # softplus = log1p(exp(a)) as torch computes it (threshold 20). log(1 + y) loses y's low bits when
    # y is small (up to 2 % off for a < -10); log(u) * y / (u - 1) with u = 1 + y is within 1 ulp.
    y = tl.exp(tl.minimum(a, 20.0))
    u = 1.0 + y
    softplus = tl.where(a > 20.0, a, tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0))))
    g = -tl.exp(tl.load(a_log_ptr + vh).to(tl.float32)) * softplus
    s = s * tl.exp(g)
    kv = tl.sum(s * k[:, None], 0)
    delta = (v - kv) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)
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

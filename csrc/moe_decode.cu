// Batch-1 sparse MoE block in one persistent launch (sm_90): post-attention RMSNorm, router GEMV,
// top-k routing, the selected experts' and the shared expert's SwiGLU, the ordered weighted sum and
// the residual add.
//
// Why one launch: at batch 1 the MoE block is a 57 MB weight stream (35B-A3B) split by the data
// dependencies router -> routing -> gate_up -> down. As separate launches every boundary drains
// the memory pipe and ramps it up again (the Triton path: router 3.6 us + experts 26 us per layer
// for bytes worth 13 us at the copy rate). Here the grid is one CTA per SM, all resident, and the
// dependencies are two grid-wide barriers. Every weight byte goes through one ring of 16 KB
// shared-memory stages per CTA (as many as fit, 13 on an H200), filled with bulk async copies
// (cp.async.bulk, completing on mbarriers) in consumption order: the CTA's router rows and shared-
// expert gate/up rows at entry (no routing needed); after the routing its routed gate/up rows and
// then its rows [c*R, c*R+R) of every selected expert's (and the shared expert's) down projection,
// which wait in the ring until the second barrier. So up to ~200 KB per SM is in flight and the
// pipe does not drain between phases.
//
// Numerics follow the eager path's rounding points (as the Triton kernels do): xn = bf16(x*rstd*
// (1+w)); logits bf16; softmax fp32, top-k (ties: lower id), renormalised, weights rounded to bf16;
// act = bf16(bf16(silu(bf16 g)) * bf16 u); out = bf16(out + bf16(bf16(dot) * w)) in ascending
// expert id; moe = bf16(out + bf16(bf16(sigmoid(sg)) * bf16(shared dot))); res = bf16(res + moe).
// Only the fp32 summation order of the dot products differs.
//
// Requirements checked by the host (nexrt_vllm/engine/cuda_kernels.py `moe_decode_plan`): H, I, Is
// multiples of 16, E a multiple of 4 and <= 512, top_k <= 16, a gate/up row pair fits a stage,
// the tile list fits MAX_TILES, >= 2 stages fit shared memory; grid == number of SMs with nothing
// else running on the GPU (the barriers need every CTA resident).
#include <cuda_bf16.h>
#include <stdint.h>

#define THREADS 256
#define WARPS (THREADS / 32)
#define STAGE_BYTES 16384
#define MAX_TILES 160
#define MAX_TOPK 16
#define MAX_EPL 16  // experts per lane in the routing warp (E <= 512)
#define SPIN_LIMIT (1ll << 30)  // a hang guard (many seconds), not a deadline

struct MoeArgs {
  __nv_bfloat16* res;             // [H] residual, updated in place
  const __nv_bfloat16* ln_w;      // [H] post-attention norm weight (zero-centred)
  const __nv_bfloat16* w_router;  // [E + 1, H]: router rows, then the shared-expert gate row
  const __nv_bfloat16* gate_up;   // [E, 2I, H] (gate rows, then up rows)
  const __nv_bfloat16* down;      // [E, H, I]
  const __nv_bfloat16* s_gate_up; // [2Is, H]
  const __nv_bfloat16* s_down;    // [H, Is]
  __nv_bfloat16* logits;          // [E + 1] out
  __nv_bfloat16* act;             // [(top_k + 1) * IMAX] scratch, slot-major; slot top_k = shared
  int* ids;                       // [top_k] out (ascending)
  float* wts;                     // [top_k] out (bf16 values)
  unsigned long long* bar;        // [2] monotonic grid-barrier counters (never reset)
  long long* prof;                // null, or [grid][PROF_POINTS] %globaltimer stamps per CTA (profiling)
  int H, E, top_k, I, Is, IMAX, R, stages, norm_topk;
  float eps;
};

#define PROF_POINTS 10
__device__ __forceinline__ void stamp(const MoeArgs& a, int i) {
  if (a.prof != nullptr && threadIdx.x == 0) {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    a.prof[blockIdx.x * PROF_POINTS + i] = t;
  }
}

struct Tile {  // one ring load: `n` router rows / gate-up row pairs / down rows of `slot` from `lo`
  int kind, slot, lo, n;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t phase) {
  uint32_t ok = 0;
  long long spins = 0;
  while (true) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(smem_u32(b)), "r"(phase)
        : "memory");
    if (ok) return;
    if (++spins > SPIN_LIMIT) __trap();  // a lost copy must fail the launch, not hang the stream
  }
}
// Bulk async copy global -> shared (16-byte aligned, size a multiple of 16), completing on `b`.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(b))
      : "memory");
}

// Grid barrier in two halves (arrive early, wait late). The counter only grows: the n-th barrier of
// a launch completes when the counter reaches the next multiple of gridDim.x, so it needs no reset
// between launches or graph replays. Called by thread 0 only; writes before arrive (after the
// block's __syncthreads) are visible to every CTA after wait.
__device__ __forceinline__ unsigned long long grid_arrive(unsigned long long* ctr) {
  __threadfence();
  unsigned long long old = atomicAdd(ctr, 1ull);
  return (old / gridDim.x + 1) * gridDim.x;
}
__device__ __forceinline__ void grid_wait(unsigned long long* ctr, unsigned long long target) {
  long long spins = 0;
  while (true) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
    if (v >= target) break;
    __nanosleep(32);
    if (++spins > SPIN_LIMIT) __trap();
  }
  __threadfence();
}

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Dot products of the `nrows` rows of `ncols` bf16 in a stage (row-major, shared memory) with x
// (shared): every thread takes one row and every tpr-th 8-element chunk of it (tpr = threads per
// row, a power of two), so a tile is one pass of independent 16-byte loads and FMAs; partial sums
// are reduced by shuffles within the row's lanes, and across warps through red: row r's value is
// the sum of red[r * np .. r * np + np) (the return value is np).
__device__ __forceinline__ int rows_dot(const __nv_bfloat16* w, int nrows, int ncols, const __nv_bfloat16* x,
                                        float* red) {
  const int chunks = ncols / 8;
  int tpr = THREADS;
  while (tpr > 1 && (tpr * nrows > THREADS || tpr > chunks)) tpr >>= 1;
  const int r = threadIdx.x / tpr, sub = threadIdx.x % tpr;
  float acc0 = 0.f, acc1 = 0.f;
  if (r < nrows) {
    const __nv_bfloat16* row = w + (size_t)r * ncols;
#pragma unroll 4
    for (int i = sub; i < chunks; i += tpr) {
      uint4 wv = *reinterpret_cast<const uint4*>(row + i * 8);
      uint4 xv = *reinterpret_cast<const uint4*>(x + i * 8);
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
      const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 a = __bfloat1622float2(w2[j]), b = __bfloat1622float2(x2[j]);
        acc0 = fmaf(a.x, b.x, acc0);
        acc1 = fmaf(a.y, b.y, acc1);
      }
    }
  }
  float acc = acc0 + acc1;
  const int width = tpr < 32 ? tpr : 32;
  for (int o = width / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  const int np = tpr > 32 ? tpr / 32 : 1;
  if (r < nrows && (threadIdx.x % width) == 0) red[r * np + sub / 32] = acc;
  return np;
}

__device__ __forceinline__ int slot_rows(const MoeArgs& a, int s) { return s == a.top_k ? a.Is : a.I; }

// This CTA's share [lo, hi) of slot s's gate/up rows; the split is rotated per slot so the CTAs that
// get one row less differ between slots (balanced totals).
__device__ __forceinline__ void slot_share(const MoeArgs& a, int s, int& lo, int& hi) {
  const int G = gridDim.x, n = slot_rows(a, s);
  const int c = (blockIdx.x + (s * G) / (a.top_k + 1)) % G;
  lo = (int)((long long)c * n / G);
  hi = (int)((long long)(c + 1) * n / G);
}

enum { T_ROUTER = 0, T_GATE_UP = 1, T_DOWN = 2 };

extern "C" __global__ void __launch_bounds__(THREADS, 1) moe_decode_kernel(const MoeArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int H = a.H, K = a.top_k, G = gridDim.x, S = a.stages;

  // Shared memory: [ring stages][xn][act][barriers][tiles][routing][reductions].
  unsigned char* ring = smem;
  __nv_bfloat16* xn = reinterpret_cast<__nv_bfloat16*>(smem + (size_t)S * STAGE_BYTES);
  __nv_bfloat16* sact = xn + H;                                    // [(K + 1) * IMAX]
  uint64_t* full = reinterpret_cast<uint64_t*>(sact + (K + 1) * a.IMAX);  // 16-byte multiples above
  Tile* tiles = reinterpret_cast<Tile*>(full + ((S + 1) & ~1));  // keeps what follows 16-byte aligned
  int* s_ids = reinterpret_cast<int*>(tiles + MAX_TILES);
  float* s_wts = reinterpret_cast<float*>(s_ids + MAX_TOPK);
  int* c_ids = reinterpret_cast<int*>(s_wts + MAX_TOPK);      // top-k candidates by rank
  float* c_p = reinterpret_cast<float*>(c_ids + MAX_TOPK);
  float* red = c_p + MAX_TOPK;                                 // [2][64] double-buffered dot partials
  float* sp = red + 128;                                       // [E] routing probabilities
  float* dres = sp + a.E;                                      // [R][K + 1] down dot products
  __shared__ int n_tiles, n_pre;
  __shared__ float s_red[2][WARPS];

  const int rpr = min(32, STAGE_BYTES / (2 * H));  // router rows per tile
  const int rr = (a.E + 1 + G - 1) / G;            // router rows of this CTA
  const int r_lo = min(blockIdx.x * rr, a.E + 1), r_n = min(rr, a.E + 1 - r_lo);
  const int d_lo = min(blockIdx.x * a.R, H), d_n = min(a.R, H - d_lo);
  const int ppt = min(STAGE_BYTES / (4 * H), WARPS * 2);  // gate/up row pairs per tile

  // Residual rows this CTA will update, fetched now (nobody else writes them).
  const float res_own = tid < d_n ? __bfloat162float(a.res[d_lo + tid]) : 0.f;

  // thread 0: barriers and the tile list, in consumption order: router rows, shared gate/up (both
  // need no routing: n_pre tiles), routed gate/up, then every down tile (consumed after barrier 2).
  int issued = 0;  // thread 0's count of ring tiles issued
  if (tid == 0) {
    for (int i = 0; i < S; ++i) mbar_init(&full[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    int n = 0;
    for (int r = 0; r < r_n; r += rpr) tiles[n++] = Tile{T_ROUTER, -1, r_lo + r, min(rpr, r_n - r)};
    for (int s = K; s >= 0; --s) {  // the shared slot (K) first: it needs no routing
      int lo, hi;
      slot_share(a, s, lo, hi);
      for (int p = lo; p < hi; p += ppt) tiles[n++] = Tile{T_GATE_UP, s, p, min(ppt, hi - p)};
      if (s == K) n_pre = n;
    }
    for (int s = K; s >= 0; --s) {
      const int rpt = min(32, STAGE_BYTES / (2 * slot_rows(a, s)));  // <= 32 rows: red holds 64 partials
      for (int j = 0; j < d_n; j += rpt) tiles[n++] = Tile{T_DOWN, s, j, min(rpt, d_n - j)};
    }
    n_tiles = n;
  }
  __syncthreads();
  stamp(a, 0);
  const int total = n_tiles, pre = n_pre;

  auto issue = [&](int limit, int consumed) {  // thread 0: fill free stages with tiles < limit
#ifdef NEXRT_MOE_NO_LOAD  // profiling variant: no weight bytes move (results are garbage)
    issued = limit;
    return;
#endif
    while (issued < limit && issued < consumed + S) {
      const Tile t = tiles[issued];
      const int st = issued % S;
      unsigned char* dst = ring + (size_t)st * STAGE_BYTES;
      if (t.kind == T_ROUTER) {
        const uint32_t bytes = (uint32_t)t.n * H * 2;
        mbar_expect_tx(&full[st], bytes);
        bulk_g2s(dst, a.w_router + (size_t)t.lo * H, bytes, &full[st]);
      } else if (t.kind == T_GATE_UP) {
        const int n = slot_rows(a, t.slot);
        const __nv_bfloat16* base =
            t.slot == K ? a.s_gate_up : a.gate_up + (size_t)s_ids[t.slot] * 2 * n * H;
        const uint32_t bytes = (uint32_t)t.n * H * 2;
        mbar_expect_tx(&full[st], 2 * bytes);
        bulk_g2s(dst, base + (size_t)t.lo * H, bytes, &full[st]);
        bulk_g2s(dst + bytes, base + (size_t)(n + t.lo) * H, bytes, &full[st]);
      } else {
        const int n = slot_rows(a, t.slot);
        const __nv_bfloat16* base = t.slot == K ? a.s_down : a.down + (size_t)s_ids[t.slot] * H * n;
        const uint32_t bytes = (uint32_t)t.n * n * 2;
        mbar_expect_tx(&full[st], bytes);
        bulk_g2s(dst, base + (size_t)(d_lo + t.lo) * n, bytes, &full[st]);
      }
      ++issued;
    }
  };

  if (tid == 0) issue(pre, 0);

  // RMSNorm of the residual (every CTA; 16-byte loads, one round trip for H <= 8 * THREADS).
  {
    float ss = 0.f;
    for (int c = tid * 8; c < H; c += THREADS * 8) {
      uint4 xv = *reinterpret_cast<const uint4*>(a.res + c);
      const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 x = __bfloat1622float2(x2[j]);
        ss = fmaf(x.x, x.x, fmaf(x.y, x.y, ss));
      }
    }
    ss = warp_sum(ss);
    if (lane == 0) s_red[0][warp] = ss;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) t += s_red[0][w];
    const float rstd = rsqrtf(t / H + a.eps);
    for (int c = tid * 8; c < H; c += THREADS * 8) {
      uint4 xv = *reinterpret_cast<const uint4*>(a.res + c), wv = *reinterpret_cast<const uint4*>(a.ln_w + c);
      const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
      uint4 ov;
      __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&ov);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 x = __bfloat1622float2(x2[j]), w = __bfloat1622float2(w2[j]);
        o2[j] = __floats2bfloat162_rn((x.x * rstd) * (1.0f + w.x), (x.y * rstd) * (1.0f + w.y));
      }
      *reinterpret_cast<uint4*>(xn + c) = ov;
    }
    __syncthreads();
  }
  stamp(a, 1);

  // Consume ring tiles up to `to`: router logits, SwiGLU activations, or down dot products.
  int consumed = 0;
  auto consume = [&](int to, int limit) {
    for (; consumed < to; ++consumed) {
      const Tile t = tiles[consumed];
      const int st = consumed % S;
#ifndef NEXRT_MOE_NO_LOAD
      mbar_wait(&full[st], (consumed / S) & 1);
#endif
      float* rb = red + (consumed & 1) * 64;
      int np = 1;
      const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(ring + (size_t)st * STAGE_BYTES);
#ifndef NEXRT_MOE_NO_COMPUTE  // profiling variant: the ring without the dot products (results are garbage)
      if (t.kind == T_DOWN) {
        const int n = slot_rows(a, t.slot);
        np = rows_dot(w, t.n, n, sact + (size_t)t.slot * a.IMAX, rb);
      } else {
        np = rows_dot(w, t.kind == T_ROUTER ? t.n : 2 * t.n, H, xn, rb);
      }
#endif
      __syncthreads();  // stage read by all warps; partials complete
      if (tid == 0) issue(limit, consumed + 1);
      if (tid < t.n) {
        float y = 0.f, yu = 0.f;
        for (int j = 0; j < np; ++j) y += rb[tid * np + j];
        if (t.kind == T_ROUTER) {
          a.logits[t.lo + tid] = __float2bfloat16_rn(y);
        } else if (t.kind == T_GATE_UP) {
          for (int j = 0; j < np; ++j) yu += rb[(t.n + tid) * np + j];
          const float g = bf16r(y), u = bf16r(yu);
          a.act[(size_t)t.slot * a.IMAX + t.lo + tid] = __float2bfloat16_rn(bf16r(silu(g)) * u);
        } else {
          dres[(t.lo + tid) * (K + 1) + t.slot] = y;
        }
      }
    }
  };

  // Router rows, then barrier 1's arrival; the shared expert's gate/up while the others catch up.
  unsigned long long target = 0;
  int n_router = 0;
  while (n_router < pre && tiles[n_router].kind == T_ROUTER) ++n_router;
  consume(n_router, pre);
  __syncthreads();
  stamp(a, 2);
  if (tid == 0) target = grid_arrive(&a.bar[0]);
  consume(pre, pre);
  stamp(a, 3);
  if (tid == 0) grid_wait(&a.bar[0], target);
  __syncthreads();
  stamp(a, 4);

  // Routing (every CTA, all threads): softmax over E in fp32; an expert's rank = experts with a
  // larger probability, or an equal one and a lower id; ranks < K are selected; ascending ids.
  {
    float lg[2], pe[2];
    float m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int e = tid + q * THREADS;
      lg[q] = e < a.E ? __bfloat162float(__ldcg(a.logits + e)) : -__int_as_float(0x7f800000);
      m = fmaxf(m, lg[q]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) s_red[0][warp] = m;
    __syncthreads();
    m = s_red[0][0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) m = fmaxf(m, s_red[0][w]);
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      pe[q] = tid + q * THREADS < a.E ? __expf(lg[q] - m) : 0.f;
      sum += pe[q];
    }
    sum = warp_sum(sum);
    if (lane == 0) s_red[1][warp] = sum;
    __syncthreads();
    sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += s_red[1][w];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int e = tid + q * THREADS;
      pe[q] = pe[q] / sum;
      if (e < a.E) sp[e] = pe[q];
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int e = tid + q * THREADS;
      if (e < a.E) {
        int rank = 0;
        const float v = pe[q];
        for (int j = 0; j < a.E; j += 4) {  // E % 4 == 0 (host check); broadcast reads
          const float4 p4 = *reinterpret_cast<const float4*>(sp + j);
          rank += (p4.x > v || (p4.x == v && j < e)) + (p4.y > v || (p4.y == v && j + 1 < e)) +
                  (p4.z > v || (p4.z == v && j + 2 < e)) + (p4.w > v || (p4.w == v && j + 3 < e));
        }
        if (rank < K) { c_ids[rank] = e; c_p[rank] = v; }
      }
    }
    __syncthreads();
    if (tid < K) {
      const int e = c_ids[tid];
      float wsum = 0.f;
      int pos = 0;
      for (int u = 0; u < K; ++u) {  // sum in rank order: the same in every CTA
        wsum += c_p[u];
        pos += c_ids[u] < e;
      }
      const float wt = bf16r(a.norm_topk ? c_p[tid] / wsum : c_p[tid]);
      s_ids[pos] = e;
      s_wts[pos] = wt;
      if (blockIdx.x == 0) { a.ids[pos] = e; a.wts[pos] = wt; }
    }
  }
  __syncthreads();
  stamp(a, 5);

  // Routed gate/up, with the down tiles queued behind them as stages free up.
  if (tid == 0) issue(total, consumed);
  int n_gu = pre;
  while (n_gu < total && tiles[n_gu].kind != T_DOWN) ++n_gu;
  consume(n_gu, total);
  __syncthreads();
  stamp(a, 6);
  if (tid == 0) grid_wait(&a.bar[1], grid_arrive(&a.bar[1]));
  __syncthreads();
  stamp(a, 7);
  if (d_n <= 0) return;

  // Down projections: every slot's activations (L2) into shared memory, then the down tiles.
  for (int i = tid * 8; i < (K + 1) * a.IMAX; i += THREADS * 8)  // IMAX % 8 == 0: 16-byte pieces
    *reinterpret_cast<uint4*>(sact + i) = __ldcg(reinterpret_cast<const uint4*>(a.act + i));
  const float sg = __bfloat162float(__ldcg(a.logits + a.E));
  __syncthreads();
  stamp(a, 8);
  consume(total, total);
  __syncthreads();
  if (tid < d_n) {
    float out = 0.f;
    for (int k = 0; k < K; ++k) out = bf16r(out + bf16r(bf16r(dres[tid * (K + 1) + k]) * s_wts[k]));
    const float gate = bf16r(1.0f / (1.0f + __expf(-sg)));
    const float moe = bf16r(out + bf16r(gate * bf16r(dres[tid * (K + 1) + K])));
    a.res[d_lo + tid] = __float2bfloat16_rn(res_own + moe);
  }
  stamp(a, 9);
}

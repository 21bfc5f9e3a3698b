// Batch-1 sparse MoE block in one persistent launch (sm_90): post-attention RMSNorm, router GEMV,
// top-k routing, the selected experts' and the shared expert's SwiGLU, the ordered weighted sum and
// the residual add.
//
// Why one launch: at batch 1 the MoE block is a 57 MB weight stream (35B-A3B) split by the data
// dependencies router -> routing -> gate_up -> down. As separate launches every boundary drains
// the memory pipe and ramps it up again (the Triton path: router 3.6 us + experts 26 us per layer
// for bytes worth 13 us at the copy rate). Here the grid is one CTA per SM, all resident, and the
// dependencies are two grid-wide barriers. Every weight byte goes through one ring of ~16 KB
// shared-memory stages per CTA (as many as fit, 12 on an H200), filled by a producer warp with bulk
// async copies (cp.async.bulk, completing on "full" mbarriers) in ring order: the CTA's router rows
// and shared-expert gate/up rows at entry (no routing needed); after the routing its routed gate/up
// rows and then its rows [c*R, c*R+R) of every selected expert's (and the shared expert's) down
// projection, which wait in the ring until the second barrier. Eight consumer warps take the
// gate/up tiles round robin, one warp per tile on the tensor cores (no CTA barrier per tile), and
// free a stage with an "empty" mbarrier arrival; so up to ~190 KB per SM is in flight and the pipe
// does not drain between phases. Measured (docs/GPU.md, round 4): the stream itself runs at the
// roof, but the serial phases around it make the block slower than the Triton path's two launches,
// so it is opt-in (Tuning.moe_impl = "cuda").
//
// Numerics follow the eager path's rounding points (as the Triton kernels do): xn = bf16(x*rstd*
// (1+w)); logits bf16; softmax fp32, top-k (ties: lower id), renormalised, weights rounded to bf16;
// act = bf16(bf16(silu(bf16 g)) * bf16 u); out = bf16(out + bf16(bf16(dot) * w)) in ascending
// expert id; moe = bf16(out + bf16(bf16(sigmoid(sg)) * bf16(shared dot))); res = bf16(res + moe).
// Only the fp32 summation order of the dot products differs.
//
// Requirements checked by the host (nexrt_vllm/engine/cuda_kernels.py `moe_decode_plan`): H a
// multiple of 64 (tensor-core tiles), I and Is multiples of 16, E a multiple of 4 and <= 512,
// top_k <= 16, a gate/up row pair fits a stage, the tile list fits MAX_TILES, every down tile fits
// the ring at once, >= 2 stages fit shared memory; grid == number of SMs with nothing else running
// on the GPU (the barriers need every CTA resident).
#include <cuda_bf16.h>
#include <stdint.h>

#define CONSUMERS 8                      // consumer warps; one more warp is the copy producer
#define CTHREADS (CONSUMERS * 32)
#define THREADS (CTHREADS + 32)
#define ROW_PAD 64                        // bytes between the hidden-wide rows of a stage (bank spread)
#define STAGE_BYTES (16384 + 4 * ROW_PAD)  // 4 padded rows of H = 2048, or 16 KB of down rows
#define MAX_TILES 160
#define MAX_TOPK 16
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
// A warp waits for a phase: lane 0 spins (32 lanes polling one mbarrier crowd the shared-memory
// pipe of the warps still computing), then every lane observes the completed phase itself.
__device__ __forceinline__ void mbar_wait_warp(uint64_t* b, uint32_t phase) {
  if ((threadIdx.x & 31) == 0) mbar_wait(b, phase);
  __syncwarp();
  mbar_wait(b, phase);
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
    if (v >= target) break;  // tight poll: one thread per CTA, and the wait is the critical path
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

__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void consumers_sync() {  // named barrier 1: the consumer warps only
  asm volatile("bar.sync 1, %0;" ::"n"(CTHREADS) : "memory");
}
__device__ __forceinline__ void all_sync_routing() {  // named barrier 2: consumers + producer
  asm volatile("bar.sync 2, %0;" ::"n"(THREADS) : "memory");
}

__device__ __forceinline__ float2 bf2f(uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
// acc += dot(8 bf16 of w, 8 bf16 of x), two accumulators for ILP
__device__ __forceinline__ void fma8(const uint4& w, const uint4& x, float& a0, float& a1) {
#ifndef NEXRT_MOE_NO_COMPUTE
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(&w);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(&x);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 u = bf2f(wp[j]), v = bf2f(xp[j]);
    a0 = fmaf(u.x, v.x, a0);
    a1 = fmaf(u.y, v.y, a1);
  }
#endif
}
// One warp: dot products of up to 4 rows of H bf16 (row r at w + r * ldb bytes) with xn, on the
// tensor cores. The 4 x H problem is recast as 16 x H/4 so every A row is useful: row m = (r, seg)
// of A takes the elements k = 8j + 2 seg + {0, 1} of weight row r, and column seg of B the same
// elements of xn, so D[(r, seg)][seg] is the seg-th quarter of row r's dot product. m16n8k16, bf16
// in, fp32 accumulate; the padded row stride keeps the fragment loads free of bank conflicts.
// H % 64 == 0. Every lane returns the 4 sums.
__device__ __noinline__ float4 warp_dot4_mma(const unsigned char* w, int ldb, int nrows, int H,
                                             const __nv_bfloat16* x) {
  const int lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3, seg = g & 3;
  const int r_lo = g >> 2, r_hi = r_lo + 2;  // A rows g (r 0/1) and g + 8 (r 2/3)
  const uint32_t* wlo = reinterpret_cast<const uint32_t*>(w + (size_t)r_lo * ldb);
  const uint32_t* whi = reinterpret_cast<const uint32_t*>(w + (size_t)r_hi * ldb);
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(x);
  const bool vlo = r_lo < nrows, vhi = r_hi < nrows, vb = g < 4;
  float c[8] = {};  // two accumulator sets (c[0..3], c[4..7]): alternate k-steps overlap
  const int steps = H / 64;
  auto step = [&](int st, float* cc) {
    const int w0 = (8 * st + q) * 4 + seg, w1 = w0 + 16, x0 = (8 * st + q) * 4 + g, x1 = x0 + 16;
    const uint32_t a0 = vlo ? wlo[w0] : 0u, a1 = vhi ? whi[w0] : 0u, a2 = vlo ? wlo[w1] : 0u,
                   a3 = vhi ? whi[w1] : 0u, b0 = vb ? xw[x0] : 0u, b1 = vb ? xw[x1] : 0u;
#ifndef NEXRT_MOE_NO_COMPUTE
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(cc[0]), "+f"(cc[1]), "+f"(cc[2]), "+f"(cc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    cc[0] += __uint_as_float(a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1) * 0.f;
#endif
  };
  int st = 0;
  for (; st + 1 < steps; st += 2) {
    step(st, c);
    step(st + 1, c + 4);
  }
  if (st < steps) step(st, c);
  // D[g][q*2 + j] in c[j], D[g + 8][q*2 + j] in c[2 + j]; the wanted column is seg(g) = g & 3.
  const bool mine = q == (seg >> 1);
  const int j = seg & 1;
  const float vl = mine ? (j ? c[1] + c[5] : c[0] + c[4]) : 0.f;
  const float vh = mine ? (j ? c[3] + c[7] : c[2] + c[6]) : 0.f;
  float o[4] = {r_lo == 0 ? vl : 0.f, r_lo == 1 ? vl : 0.f, r_lo == 0 ? vh : 0.f, r_lo == 1 ? vh : 0.f};
#pragma unroll
  for (int sh = 16; sh > 0; sh >>= 1)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[r] += __shfl_xor_sync(0xffffffffu, o[r], sh);
  return make_float4(o[0], o[1], o[2], o[3]);
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
  const bool producer = warp == CONSUMERS;

  // Shared memory: [ring stages][xn][act][full, empty barriers][tiles][routing][down sums].
  unsigned char* ring = smem;
  __nv_bfloat16* xn = reinterpret_cast<__nv_bfloat16*>(smem + (size_t)S * STAGE_BYTES);
  __nv_bfloat16* sact = xn + H;                                            // [(K + 1) * IMAX]
  uint64_t* full = reinterpret_cast<uint64_t*>(sact + (K + 1) * a.IMAX);  // 16-byte multiples above
  uint64_t* empty = full + S;
  Tile* tiles = reinterpret_cast<Tile*>(full + 2 * S);
  int* s_ids = reinterpret_cast<int*>(tiles + MAX_TILES);
  float* s_wts = reinterpret_cast<float*>(s_ids + MAX_TOPK);
  int* c_ids = reinterpret_cast<int*>(s_wts + MAX_TOPK);  // top-k candidates by rank
  float* c_l = reinterpret_cast<float*>(c_ids + MAX_TOPK);
  uint32_t* skey = reinterpret_cast<uint32_t*>(c_l + MAX_TOPK);  // [E] routing keys
  float* dres = reinterpret_cast<float*>(skey + a.E);              // [R][K + 1] down dot products
  __shared__ int n_tiles, n_pre, n_gu;
  __shared__ float s_red[2][CONSUMERS];
  __shared__ float s_part[CONSUMERS][4];

  const int rpr = max(1, min(4, STAGE_BYTES / (2 * H + ROW_PAD)));  // router rows per tile (<= 4: one mma tile)
  const int rr = (a.E + 1 + G - 1) / G;                    // router rows of this CTA
  const int r_lo = min(blockIdx.x * rr, a.E + 1), r_n = min(rr, a.E + 1 - r_lo);
  const int d_lo = min(blockIdx.x * a.R, H), d_n = min(a.R, H - d_lo);
  const int ppt = max(1, min(2, STAGE_BYTES / (2 * (2 * H + ROW_PAD))));  // gate/up row pairs per tile

  // Loads that need nothing: this CTA's residual rows (only it writes them) and the norm inputs.
  const float res_own = tid < d_n ? __bfloat162float(a.res[d_lo + tid]) : 0.f;
  uint4 rv[2], lv[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int c = (tid + q * CTHREADS) * 8;
    if (!producer && c < H) {
      rv[q] = *reinterpret_cast<const uint4*>(a.res + c);
      lv[q] = *reinterpret_cast<const uint4*>(a.ln_w + c);
    }
  }

  // The producer's lane 0: barriers and the tile list, in ring order: router rows, shared gate/up
  // (no routing needed: n_pre tiles), routed gate/up (n_gu), then every down tile.
  if (producer && lane == 0) {
    for (int i = 0; i < S; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    int n = 0;
    for (int r = 0; r < r_n; r += rpr) tiles[n++] = Tile{T_ROUTER, -1, r_lo + r, min(rpr, r_n - r)};
    for (int s = K; s >= 0; --s) {  // the shared slot (K) first
      int lo, hi;
      slot_share(a, s, lo, hi);
      for (int p = lo; p < hi; p += ppt) tiles[n++] = Tile{T_GATE_UP, s, p, min(ppt, hi - p)};
      if (s == K) n_pre = n;
    }
    n_gu = n;
    for (int s = K; s >= 0; --s) {
      const int rpt = min(16, STAGE_BYTES / (2 * slot_rows(a, s)));
      for (int j = 0; j < d_n; j += rpt) tiles[n++] = Tile{T_DOWN, s, j, min(rpt, d_n - j)};
    }
    n_tiles = n;
  }
  __syncthreads();
  stamp(a, 0);
  const int total = n_tiles, pre = n_pre, gu_end = n_gu;

  const int ldb = H * 2 + ROW_PAD;  // stage row stride of router / gate-up tiles (bytes)
  // gate rows lo.. then up rows lo.. of a [2n, H] gate/up matrix, one padded stage row each
  auto issue_gate_up = [&](unsigned char* dst, const __nv_bfloat16* base, int n, const Tile& t, uint64_t* bar) {
    mbar_expect_tx(bar, (uint32_t)t.n * 4 * H);
    for (int r = 0; r < t.n; ++r) {
      bulk_g2s(dst + r * ldb, base + (size_t)(t.lo + r) * H, H * 2, bar);
      bulk_g2s(dst + (t.n + r) * ldb, base + (size_t)(n + t.lo + r) * H, H * 2, bar);
    }
  };
  if (producer) {
    // Copy producer: tile k goes into stage k % S once the consumer of tile k - S released it.
    if (lane == 0) {
#ifndef NEXRT_MOE_NO_LOAD
      for (int k = 0; k < pre; ++k) {
        const Tile t = tiles[k];
        const int st = k % S;
        if (k >= S) mbar_wait(&empty[st], ((k / S) - 1) & 1);
        unsigned char* dst = ring + (size_t)st * STAGE_BYTES;
        if (t.kind == T_ROUTER) {
          mbar_expect_tx(&full[st], (uint32_t)t.n * H * 2);
          for (int r = 0; r < t.n; ++r)
            bulk_g2s(dst + r * ldb, a.w_router + (size_t)(t.lo + r) * H, H * 2, &full[st]);
        } else {  // pre tiles: the shared expert
          issue_gate_up(dst, a.s_gate_up, a.Is, t, &full[st]);
        }
      }
#endif
    }
    __syncwarp();
    all_sync_routing();  // the consumers have written s_ids
    if (lane == 0) {
#ifndef NEXRT_MOE_NO_LOAD
      for (int k = pre; k < total; ++k) {
        const Tile t = tiles[k];
        const int st = k % S;
        if (k >= S) mbar_wait(&empty[st], ((k / S) - 1) & 1);
        unsigned char* dst = ring + (size_t)st * STAGE_BYTES;
        const int n = slot_rows(a, t.slot);
        if (t.kind == T_GATE_UP) {
          issue_gate_up(dst, t.slot == K ? a.s_gate_up : a.gate_up + (size_t)s_ids[t.slot] * 2 * n * H, n, t,
                        &full[st]);
        } else {
          const __nv_bfloat16* base = t.slot == K ? a.s_down : a.down + (size_t)s_ids[t.slot] * H * n;
          const uint32_t bytes = (uint32_t)t.n * n * 2;
          mbar_expect_tx(&full[st], bytes);
          bulk_g2s(dst, base + (size_t)(d_lo + t.lo) * n, bytes, &full[st]);
        }
      }
#endif
    }
    return;  // the consumers keep the CTA (and its shared memory) alive until every tile is used
  }

  // ---- consumers (warps 0..CONSUMERS-1) ----
  // RMSNorm of the residual: xn = bf16(x * rstd * (1 + w)), from the registers loaded above.
  {
    float ss = 0.f;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if ((tid + q * CTHREADS) * 8 < H) {
        const uint32_t* xp = reinterpret_cast<const uint32_t*>(&rv[q]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 x = bf2f(xp[j]);
          ss = fmaf(x.x, x.x, fmaf(x.y, x.y, ss));
        }
      }
    }
    ss = warp_sum(ss);
    if (lane == 0) s_red[0][warp] = ss;
    consumers_sync();
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < CONSUMERS; ++w) t += s_red[0][w];
    const float rstd = rsqrtf(t / H + a.eps);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int c = (tid + q * CTHREADS) * 8;
      if (c < H) {
        const uint32_t* xp = reinterpret_cast<const uint32_t*>(&rv[q]);
        const uint32_t* wp = reinterpret_cast<const uint32_t*>(&lv[q]);
        uint4 ov;
        __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&ov);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 x = bf2f(xp[j]), w = bf2f(wp[j]);
          o2[j] = __floats2bfloat162_rn((x.x * rstd) * (1.0f + w.x), (x.y * rstd) * (1.0f + w.y));
        }
        *reinterpret_cast<uint4*>(xn + c) = ov;
      }
    }
    consumers_sync();
  }
  stamp(a, 1);

  // Tiles are dealt to the consumer warps round robin (tile k -> warp k % CONSUMERS), in ring order.
  auto use_tile = [&](int k) {
    const Tile t = tiles[k];
    const int st = k % S;
#ifndef NEXRT_MOE_NO_LOAD
    mbar_wait_warp(&full[st], (k / S) & 1);
#endif
    if (t.kind == T_GATE_UP) {
      const float4 o4 = warp_dot4_mma(ring + (size_t)st * STAGE_BYTES, ldb, 2 * t.n, H, xn);  // gate.., up..
      const float o[4] = {o4.x, o4.y, o4.z, o4.w};
      const float u0 = t.n == 1 ? o[1] : o[2], u1 = o[3];
      if (lane < t.n) {
        const float g = bf16r(lane == 0 ? o[0] : o[1]), u = bf16r(lane == 0 ? u0 : u1);
        a.act[(size_t)t.slot * a.IMAX + t.lo + lane] = __float2bfloat16_rn(bf16r(silu(g)) * u);
      }
    }
    __syncwarp();
#ifndef NEXRT_MOE_NO_LOAD
    if (lane == 0) mbar_arrive(&empty[st]);  // stage free for tile k + S
#endif
  };

  // Router rows, each tile split over all consumer warps by columns, then grid barrier 1. (The
  // shared expert's gate/up tiles, already in the ring, are used after the routing with the routed
  // ones: one warp per 16 KB tile takes ~3 us, which would hold up the routing.)
  int n_router = 0;
  while (n_router < pre && tiles[n_router].kind == T_ROUTER) ++n_router;
  for (int k = 0; k < n_router; ++k) {
    const Tile t = tiles[k];
#ifndef NEXRT_MOE_NO_LOAD
    mbar_wait_warp(&full[k % S], (k / S) & 1);
#endif
    // warp `warp` takes columns [c0, c1) of every row (a multiple of 64 elements when H % 512 == 0)
    const int c0 = warp * (H / 64) / CONSUMERS * 64, c1 = (warp + 1) * (H / 64) / CONSUMERS * 64;
    const float4 o4 = c1 > c0 ? warp_dot4_mma(ring + (size_t)(k % S) * STAGE_BYTES + c0 * 2, ldb, t.n, c1 - c0, xn + c0)
                              : make_float4(0.f, 0.f, 0.f, 0.f);
    if (lane == 0) {
      s_part[warp][0] = o4.x; s_part[warp][1] = o4.y; s_part[warp][2] = o4.z; s_part[warp][3] = o4.w;
    }
    consumers_sync();
    if (tid < t.n) {
      float y = 0.f;
      for (int q = 0; q < CONSUMERS; ++q) y += s_part[q][tid];
      a.logits[t.lo + tid] = __float2bfloat16_rn(y);
    }
#ifndef NEXRT_MOE_NO_LOAD
    if (tid == 0) mbar_arrive(&empty[k % S]);
#endif
    consumers_sync();  // logits stored, s_part free
  }
  stamp(a, 2);
  stamp(a, 3);
  if (tid == 0) grid_wait(&a.bar[0], grid_arrive(&a.bar[0]));
  consumers_sync();
  stamp(a, 4);

  // Routing (every CTA): an expert's rank = experts with a larger logit, or an equal one and a lower
  // id (softmax is monotonic: the eager top-k by probability, ties to the lower id); ranks < K are
  // selected; weights from the selected logits (with norm_topk the softmax sum cancels).
  {
    float l[2];
    uint32_t key[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int e = tid + q * CTHREADS;
      const __nv_bfloat16 lb = e < a.E ? __ldcg(a.logits + e) : __float2bfloat16_rn(0.f);
      l[q] = __bfloat162float(lb);
      // Unique key, ordered like (logit, then lower id): the bf16 bits made order-preserving
      // (-0 as +0), then 0xFFFF - id.
      uint32_t b = __bfloat16_as_ushort(lb);
      b = b == 0x8000u ? 0u : b;
      b = (b & 0x8000u) ? (~b & 0xFFFFu) : (b | 0x8000u);
      key[q] = (b << 16) | (0xFFFFu - (uint32_t)e);
      if (e < a.E) skey[e] = key[q];
    }
    float tot = 0.f;
    if (!a.norm_topk) {  // the full softmax denominator, relative to the maximum
      float m = -__int_as_float(0x7f800000);
#pragma unroll
      for (int q = 0; q < 2; ++q)
        if (tid + q * CTHREADS < a.E) m = fmaxf(m, l[q]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (lane == 0) s_red[0][warp] = m;
      consumers_sync();
      m = s_red[0][0];
#pragma unroll
      for (int w = 1; w < CONSUMERS; ++w) m = fmaxf(m, s_red[0][w]);
#pragma unroll
      for (int q = 0; q < 2; ++q)
        if (tid + q * CTHREADS < a.E) tot += __expf(l[q] - m);
      tot = warp_sum(tot);
      if (lane == 0) s_red[1][warp] = tot;
    }
    consumers_sync();
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int e = tid + q * CTHREADS;
      if (e < a.E) {
        const uint32_t v = key[q];
        int rank = 0;
#pragma unroll 4
        for (int j = 0; j < a.E; j += 4) {  // E % 4 == 0 (host check); broadcast reads
          const uint4 k4 = *reinterpret_cast<const uint4*>(skey + j);
          rank += (k4.x > v) + (k4.y > v) + (k4.z > v) + (k4.w > v);
        }
        if (rank < K) { c_ids[rank] = e; c_l[rank] = l[q]; }
      }
    }
    consumers_sync();
    if (tid < K) {
      const int e = c_ids[tid];
      const float m = c_l[0];  // rank 0: the largest logit
      float wsum = 0.f;
      int pos = 0;
      for (int u = 0; u < K; ++u) {  // in rank order: the same in every CTA
        wsum += __expf(c_l[u] - m);
        pos += c_ids[u] < e;
      }
      float den = wsum;
      if (!a.norm_topk) {
        den = 0.f;
        for (int w = 0; w < CONSUMERS; ++w) den += s_red[1][w];
      }
      const float wt = bf16r(__expf(c_l[tid] - m) / den);
      s_ids[pos] = e;
      s_wts[pos] = wt;
      if (blockIdx.x == 0) { a.ids[pos] = e; a.wts[pos] = wt; }
    }
  }
  all_sync_routing();  // s_ids / s_wts ready; releases the producer's routed copies
  stamp(a, 5);

  // Shared + routed gate/up (the down tiles are being copied in behind them), then grid barrier 2.
  for (int k = n_router + warp; k < gu_end; k += CONSUMERS) use_tile(k);
  consumers_sync();
  stamp(a, 6);
  if (tid == 0) grid_wait(&a.bar[1], grid_arrive(&a.bar[1]));
  consumers_sync();
  stamp(a, 7);
  if (d_n <= 0) return;  // no down rows here (so no down tiles)

  // Down projections: every slot's activations (L2) into shared memory, then the down tiles.
  for (int i = tid * 8; i < (K + 1) * a.IMAX; i += CTHREADS * 8)  // IMAX % 8 == 0: 16-byte pieces
    *reinterpret_cast<uint4*>(sact + i) = __ldcg(reinterpret_cast<const uint4*>(a.act + i));
  const float sg = __bfloat162float(__ldcg(a.logits + a.E));
  consumers_sync();
  stamp(a, 8);
  // Down tiles, all consumer threads on each: 16 threads per row, each every 16th 16-byte chunk of
  // it, summed by shuffles within the 16 lanes. Three tiles per batch with every load issued before
  // the first FMA (one warp per scheduler pair: the loads' latency must overlap).
  const int j = tid / 16, sub = tid % 16;  // 16 rows per pass (tiles hold <= 16)
  for (int kb = gu_end; kb < total; kb += 3) {
    uint4 wv[3][4], xv[3][4];
    float acc[3][2] = {};
#pragma unroll
    for (int b = 0; b < 3; ++b) {
      const int k = kb + b;
      if (k >= total) break;
#ifndef NEXRT_MOE_NO_LOAD
      mbar_wait_warp(&full[k % S], (k / S) & 1);
#endif
      const Tile t = tiles[k];
      const int n = slot_rows(a, t.slot), chunks = n / 8;
      const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(ring + (size_t)(k % S) * STAGE_BYTES) + (size_t)j * n;
      const __nv_bfloat16* x = sact + (size_t)t.slot * a.IMAX;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = sub + 16 * i;
        const bool ok = j < t.n && c < chunks;
        wv[b][i] = ok ? *reinterpret_cast<const uint4*>(w + c * 8) : make_uint4(0, 0, 0, 0);
        xv[b][i] = ok ? *reinterpret_cast<const uint4*>(x + c * 8) : make_uint4(0, 0, 0, 0);
      }
      if (j < t.n)  // slots wider than 512: the rest, unbatched
        for (int c = sub + 64; c < chunks; c += 16)
          fma8(*reinterpret_cast<const uint4*>(w + c * 8), *reinterpret_cast<const uint4*>(x + c * 8), acc[b][0],
               acc[b][1]);
    }
#pragma unroll
    for (int b = 0; b < 3; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) fma8(wv[b][i], xv[b][i], acc[b][0], acc[b][1]);
    float y[3];
#pragma unroll
    for (int b = 0; b < 3; ++b) y[b] = acc[b][0] + acc[b][1];
#pragma unroll
    for (int o = 8; o > 0; o >>= 1)
#pragma unroll
      for (int b = 0; b < 3; ++b) y[b] += __shfl_xor_sync(0xffffffffu, y[b], o);
#pragma unroll
    for (int b = 0; b < 3; ++b) {
      const int k = kb + b;
      if (k < total && sub == 0) {
        const Tile t = tiles[k];
        if (j < t.n) dres[(t.lo + j) * (K + 1) + t.slot] = y[b];
      }
    }
  }
  consumers_sync();
  if (tid < d_n) {
    float out = 0.f;
    for (int k = 0; k < K; ++k) out = bf16r(out + bf16r(bf16r(dres[tid * (K + 1) + k]) * s_wts[k]));
    const float gate = bf16r(1.0f / (1.0f + __expf(-sg)));
    const float moe = bf16r(out + bf16r(gate * bf16r(dres[tid * (K + 1) + K])));
    a.res[d_lo + tid] = __float2bfloat16_rn(res_own + moe);
  }
  stamp(a, 9);
}

// A chain of dependent batch-1 GEMVs in one persistent launch (sm_90a): the design issue #19 asks for,
// reduced to the step's commonest task, to measure what a task boundary costs inside one launch
// (benchmarks/persistent_chain.py). One CTA per SM; each task splits its weight rows evenly over the
// CTAs, so a CTA's share of a row-major [N, K] weight is one contiguous byte range.
//
// One lane of the last warp is the producer: it streams the CTA's weight ranges of every task, in task
// order, into a ring of shared-memory stages with bulk async copies (cp.async.bulk, completion on the
// stage's "full" mbarrier) and never waits on a task's inputs: weights do not depend on them, so the
// next tasks' bytes are in flight while the consumers wait on a dependency. The other warps consume:
// per task, wait until every CTA has finished the task's predecessor (a per-task arrival counter in
// global memory, polled by one thread per CTA: at most gridDim pollers), build the input vector in
// shared memory (with its prologue), dot the stages against it — each stage whole by one warp, round
// robin, so as many stages as consumer warps are in work at once — release each stage ("empty"
// mbarrier), write their rows (with the epilogue) and arrive on the task's counter. A stage holds
// whole rows, or an equal part of one row when a row is longer than a stage (`chunk_elems`).
//
// Counters only grow: a launch's targets are (epoch + 1) * gridDim, where epoch (device memory) is
// read at the start and advanced by the last CTA to finish, so a captured graph replays it unchanged.
#include <cstdint>
#include <cuda_bf16.h>

namespace {

#ifndef GEMV_CHAIN_CONSUMER_WARPS
#define GEMV_CHAIN_CONSUMER_WARPS 16  // the launcher's default (benchmarks/persistent_chain.py)
#endif
constexpr int kConsumerWarps = GEMV_CHAIN_CONSUMER_WARPS;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kThreads = kConsumers + 32;
constexpr int kGroup = 256;  // elements one consumer warp dots at a time (8 per lane): K % 256 == 0

enum Prologue : int32_t { kPlain = 0, kRmsNorm = 1, kSwiGlu = 2 };
enum Epilogue : int32_t { kStore = 0, kResidual = 1 };

struct Task {  // csrc/gemv_chain.cu's task record; mirrored field for field by the Python launcher
  const __nv_bfloat16* w;  // [n, k] row-major
  const __nv_bfloat16* x;  // input: [k] (kPlain, kRmsNorm) or [2k] gate then up (kSwiGlu)
  const __nv_bfloat16* norm_w;  // [k] (kRmsNorm: x * rstd * (1 + norm_w))
  __nv_bfloat16* y;  // [n]
  int32_t n, k, prologue, epilogue;
  int32_t wait;  // index of the task whose outputs this one reads (-1: none); with kResidual, y's last
                 // writer must come before it through these links (y is read once, after the wait)
  float eps;
};

struct Args {
  const Task* tasks;
  uint32_t* counters;  // [num_tasks + 1]: one per task, then the launch's finish counter
  uint32_t* epoch;
  uint64_t* prof;  // null, or [gridDim][num_tasks][4] %globaltimer ns per CTA and task: before the wait,
                   // input built, dots done, arrived
  int32_t num_tasks, stages, stage_bytes, max_k, max_rows;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Every wait is bounded: a chain that cannot make progress (a CTA not resident, a bad task table)
// traps after about a second instead of hanging the stream.
constexpr uint32_t kSpinLimit = 1u << 24;

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  for (uint32_t spin = 0;; ++spin) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    if (done) return;
    if (spin > kSpinLimit) __trap();
  }
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ void red_release(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void consumers_sync() {  // named barrier 1: the consumer warps only
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float bf16r(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ void row_range(int n, int cta, int ctas, int* r0, int* r1) {
  *r0 = static_cast<int>((static_cast<int64_t>(n) * cta) / ctas);
  *r1 = static_cast<int>((static_cast<int64_t>(n) * (cta + 1)) / ctas);
}

// Elements per stage of a task with rows of k: whole rows when a row fits a stage of s elements,
// else the largest equal part of a row (a multiple of kGroup) that fits.
__device__ __forceinline__ int chunk_elems(int k, int s) {
  if (k <= s) return (s / k) * k;
  const int groups = k / kGroup;
  int parts = (k + s - 1) / s;
  while (groups % parts) ++parts;
  return k / parts;
}

// A bf16 pair packed in 32 bits as two floats (exact).
__device__ __forceinline__ float lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ void dot8(const uint4& w, const uint4& x, float& d0, float& d1) {
  d0 = fmaf(lo(w.x), lo(x.x), d0);
  d1 = fmaf(hi(w.x), hi(x.x), d1);
  d0 = fmaf(lo(w.y), lo(x.y), d0);
  d1 = fmaf(hi(w.y), hi(x.y), d1);
  d0 = fmaf(lo(w.z), lo(x.z), d0);
  d1 = fmaf(hi(w.z), hi(x.z), d1);
  d0 = fmaf(lo(w.w), lo(x.w), d0);
  d1 = fmaf(hi(w.w), hi(x.w), d1);
}

// R rows (row stride ld) of n weights (a multiple of kGroup) against x, by one warp: lane l takes 8
// adjacent elements of each group of 256, so one 16-byte load of x (bf16, shared memory) serves R
// rows; the sums end in every lane of out[R].
template <int R>
__device__ __forceinline__ void warp_dot(const __nv_bfloat16* w, int ld, const __nv_bfloat16* x, int n, int lane,
                                         float* out) {
  float d0[R], d1[R];
#pragma unroll
  for (int r = 0; r < R; ++r) d0[r] = d1[r] = 0.f;
#pragma unroll 4
  for (int j = lane * 8; j < n; j += kGroup) {
    const uint4 xv = *reinterpret_cast<const uint4*>(x + j);
#pragma unroll
    for (int r = 0; r < R; ++r) dot8(*reinterpret_cast<const uint4*>(w + r * ld + j), xv, d0[r], d1[r]);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float d = d0[r] + d1[r];
    for (int o = 16; o; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    out[r] = d;
  }
}

constexpr int kMaxK = 8192;  // the RMSNorm prologue holds its column of x in registers: k <= kMaxK
constexpr int kMaxPerThread = (kMaxK + kConsumers - 1) / kConsumers;

// Wait until every CTA has arrived on counter `c` for this launch (thread 0 polls, the consumers sync).
__device__ __forceinline__ void wait_counter(const uint32_t* c, uint32_t target, int tid) {
  if (tid == 0)
    for (uint32_t spin = 0; static_cast<int32_t>(ld_acquire(c) - target) < 0; ++spin) {
      if (spin > kSpinLimit) __trap();
      __nanosleep(32);
    }
  consumers_sync();
}

// The task's input vector into xs[k] (bf16: every prologue ends in a bf16 rounding, as the Triton
// path's), after waiting on the task's dependency; what does not depend on it (the RMSNorm weight)
// is loaded before the wait.
__device__ void build_input(const Task& t, __nv_bfloat16* xs, float* red, const uint32_t* counters, uint32_t target,
                            int tid) {
  float nw[kMaxPerThread];
  if (t.prologue == kRmsNorm) {
#pragma unroll
    for (int j = 0; j < kMaxPerThread; ++j) {
      const int i = tid + j * kConsumers;
      nw[j] = i < t.k ? 1.0f + __bfloat162float(t.norm_w[i]) : 0.f;
    }
  }
  if (t.wait >= 0) wait_counter(counters + t.wait, target, tid);
  if (t.prologue == kSwiGlu) {
    for (int i = tid; i < t.k; i += kConsumers) {
      const float g = __bfloat162float(__ldcg(t.x + i));
      const float u = __bfloat162float(__ldcg(t.x + t.k + i));
      xs[i] = __float2bfloat16(bf16r(g / (1.0f + __expf(-g))) * u);
    }
    return;
  }
  if (t.prologue == kPlain) {
    for (int i = tid; i < t.k; i += kConsumers) xs[i] = __ldcg(t.x + i);
    return;
  }
  float v[kMaxPerThread];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int i = tid + j * kConsumers;
    v[j] = i < t.k ? __bfloat162float(__ldcg(t.x + i)) : 0.f;
    ss += v[j] * v[j];
  }
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((tid & 31) == 0) red[tid >> 5] = ss;
  consumers_sync();
  float tot = 0.f;
#pragma unroll
  for (int i = 0; i < kConsumerWarps; ++i) tot += red[i];
  const float rstd = rsqrtf(tot / t.k + t.eps);
#pragma unroll
  for (int j = 0; j < kMaxPerThread; ++j) {
    const int i = tid + j * kConsumers;
    if (i < t.k) xs[i] = __float2bfloat16(v[j] * rstd * nw[j]);
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 1) gemv_chain_kernel(Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + a.stages;
  float* red = reinterpret_cast<float*>(empty + a.stages);  // kConsumerWarps floats, padded to 128 B
  float* acc = red + 32;                                    // [max_rows]
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(acc + a.max_rows);  // [max_k]
  unsigned char* ring = smem + ((128 + 16 * a.stages + 4 * (32 + a.max_rows) + 2 * a.max_k + 127) / 128) * 128;

  const int tid = threadIdx.x, cta = blockIdx.x, ctas = gridDim.x;
  const uint32_t epoch = ld_acquire(a.epoch);
  const uint32_t target = (epoch + 1u) * static_cast<uint32_t>(ctas);
  const int stage_elems = a.stage_bytes / 2;
  if (tid == 0) {
    for (int s = 0; s < a.stages; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (tid >= kConsumers) {  // producer warp
    if (tid != kConsumers) return;
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    uint32_t it = 0;
    for (int ti = 0; ti < a.num_tasks; ++ti) {
      const Task t = a.tasks[ti];
      int r0, r1;
      row_range(t.n, cta, ctas, &r0, &r1);
      const unsigned char* src = reinterpret_cast<const unsigned char*>(t.w) + static_cast<int64_t>(r0) * t.k * 2;
      const int bytes = (r1 - r0) * t.k * 2, chunk = chunk_elems(t.k, stage_elems) * 2;
      for (int off = 0; off < bytes; off += chunk, ++it) {
        const int s = it % a.stages;
        if (it >= static_cast<uint32_t>(a.stages)) mbar_wait(empty + s, ((it / a.stages) - 1) & 1);
        const uint32_t nb = static_cast<uint32_t>(min(chunk, bytes - off));
        mbar_expect_tx(full + s, nb);
        bulk_load(ring + static_cast<size_t>(s) * a.stage_bytes, src + off, nb, full + s, policy);
      }
    }
    return;
  }

  // consumer warps
  const int warp = tid >> 5, lane = tid & 31;
  uint32_t it = 0;
  for (int i = tid; i < a.max_rows; i += kConsumers) acc[i] = 0.f;
  for (int ti = 0; ti < a.num_tasks; ++ti) {
    const Task t = a.tasks[ti];
    uint64_t* prof = a.prof ? a.prof + (static_cast<size_t>(cta) * a.num_tasks + ti) * 4 : nullptr;
    if (prof && tid == 0) prof[0] = now_ns();
    build_input(t, xs, red, a.counters, target, tid);
    if (prof && tid == 0) prof[1] = now_ns();
    int r0, r1;
    row_range(t.n, cta, ctas, &r0, &r1);
    // the residual rows this CTA adds to, read now (after the dependency) so the epilogue's store
    // does not wait on a load
    const bool res_early = t.epilogue == kResidual && r1 - r0 <= kConsumers;
    const float res = res_early && tid < r1 - r0 ? __bfloat162float(__ldcg(t.y + r0 + tid)) : 0.f;
    consumers_sync();
    const int elems = (r1 - r0) * t.k, chunk = chunk_elems(t.k, stage_elems);
    const int chunks = (elems + chunk - 1) / chunk;
    // this task's chunks are stages it .. it + chunks - 1 of the ring's sequence; warp w takes those
    // whose sequence number is w modulo the warp count
    for (int c = (warp - static_cast<int>(it % kConsumerWarps) + kConsumerWarps) % kConsumerWarps; c < chunks;
         c += kConsumerWarps) {
      const uint32_t seq = it + c;
      const int s = seq % a.stages;
      mbar_wait(full + s, (seq / a.stages) & 1);
      const auto* stage = reinterpret_cast<const __nv_bfloat16*>(ring + static_cast<size_t>(s) * a.stage_bytes);
      const int e0 = c * chunk, live = min(chunk, elems - e0);
      float d[2];
      if (t.k <= chunk) {  // whole rows, two at a time
        const int rows = live / t.k, row0 = e0 / t.k;
        int r = 0;
        for (; r + 2 <= rows; r += 2) {
          warp_dot<2>(stage + r * t.k, t.k, xs, t.k, lane, d);
          if (lane == 0) acc[row0 + r] = d[0], acc[row0 + r + 1] = d[1];
        }
        if (r < rows) {
          warp_dot<1>(stage + r * t.k, t.k, xs, t.k, lane, d);
          if (lane == 0) acc[row0 + r] = d[0];
        }
      } else {  // a part of one row
        const int row = e0 / t.k;
        warp_dot<1>(stage, t.k, xs + (e0 - row * t.k), live, lane, d);
        if (lane == 0) atomicAdd(acc + row, d[0]);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);
    }
    it += chunks;
    consumers_sync();
    if (prof && tid == 0) prof[2] = now_ns();
    for (int r = tid; r < r1 - r0; r += kConsumers) {
      const float v = bf16r(acc[r]);
      acc[r] = 0.f;
      __nv_bfloat16* out = t.y + r0 + r;
      if (t.epilogue == kResidual) *out = __float2bfloat16((res_early ? res : __bfloat162float(__ldcg(out))) + v);
      else *out = __float2bfloat16(v);
    }
    consumers_sync();
    if (tid == 0) {
      red_release(a.counters + ti, 1u);
      if (prof) prof[3] = now_ns();
    }
  }
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(a.counters + a.num_tasks, 1u) == target - 1u) atomicAdd(a.epoch, 1u);
  }
}

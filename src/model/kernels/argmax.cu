// The greedy choice on the device: the first largest value of each row of logits (suppressed ids count as -inf) and
// whether the row is all finite, so a decode step sends back one id per sequence. Two launches: up to 64 blocks per
// row each take a chunk of at least 2048 values, then one warp per row picks among their candidates (a row of a
// 32000-id vocabulary read by one block took 5.7 us of the H100's decode step).
#include <algorithm>
#include <cmath>

#include "base/cuda_pdl.cuh"
#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxUnroll = 4;           // 16-byte loads per thread in flight
constexpr int64_t kArgmaxMinChunk = 2048;  // values per block at least
constexpr int kArgmaxMaxSplits = 64;       // blocks per row at most (argmax_final_kernel: two per lane)

// (value, index) a beats (value, index) b: larger value, or equal value and smaller index. A total order, so the
// best of a row is the same whatever order its values are visited in.
__device__ __forceinline__ bool beats(float av, int64_t ai, float bv, int64_t bi) {
  return av > bv || (av == bv && ai < bi);
}

// One row's best by one warp from its lanes' candidates (lanes whose finite flag is 0 clear the row's).
__device__ __forceinline__ void warp_best(float& bv, int64_t& bi, int& fin) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (beats(ov, oi, bv, bi)) bv = ov, bi = oi;
    fin &= __shfl_xor_sync(0xffffffffu, fin, o);
  }
}

// Phase 1: block (r, s) finds the best of values [s * chunk, (s + 1) * chunk) of row r (suppressed ids count as
// -inf; NaN never chosen) and whether they are all finite: part_v / part_i / part_f [R, splits].
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_part_kernel(const float* __restrict__ logits, int64_t V, int64_t chunk, Suppress sup, float* part_v,
                       int64_t* part_i, int* part_f) {
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ int64_t si[kArgmaxThreads / 32];
  __shared__ int sfin[kArgmaxThreads / 32];
  cuda::pdl_wait();  // PDL: the logits are written by the kernel before
  cuda::pdl_trigger();
  const int64_t r = blockIdx.y, s = blockIdx.x, splits = gridDim.x;
  const float* p = logits + r * V;
  const int64_t lo = s * chunk, hi = min(V, lo + chunk);
  float bv = -INFINITY;
  int64_t bi = V;  // none yet: any index beats it at -inf
  int fin = 1;
  auto visit = [&](float x, int64_t i) {
    if (!isfinite(x)) fin = 0;
    for (int j = 0; j < sup.n; ++j)
      if (sup.ids[j] == i) x = -INFINITY;
    if (beats(x, i, bv, bi)) bv = x, bi = i;  // NaN never beats (the row is reported instead)
  };
  int64_t i0 = lo;
  if (V % 4 == 0 && chunk % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0) {
    // Rounds of kArgmaxUnroll float4 per thread, all loads issued before the first compare.
    const float4* p4 = reinterpret_cast<const float4*>(p);
    const int64_t b4 = lo / 4, e4 = hi / 4;
    constexpr int64_t kRound = int64_t(kArgmaxThreads) * kArgmaxUnroll;
    for (int64_t b = b4; b < e4; b += kRound) {
      float4 q[kArgmaxUnroll];
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u) {
        const int64_t k = b + threadIdx.x + int64_t(u) * kArgmaxThreads;
        q[u] = k < e4 ? p4[k] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u) {
        const int64_t k = b + threadIdx.x + int64_t(u) * kArgmaxThreads;
        if (k < e4) {
          visit(q[u].x, 4 * k);
          visit(q[u].y, 4 * k + 1);
          visit(q[u].z, 4 * k + 2);
          visit(q[u].w, 4 * k + 3);
        }
      }
    }
    i0 = hi;
  }
  for (int64_t i = i0 + threadIdx.x; i < hi; i += kArgmaxThreads) visit(p[i], i);
  warp_best(bv, bi, fin);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
    sfin[warp] = fin;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / 32; ++w) {
      if (beats(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
      fin &= sfin[w];
    }
    part_v[r * splits + s] = bv;
    part_i[r * splits + s] = bi;
    part_f[r * splits + s] = fin;
  }
}

// The hand-over of a greedy pick (DeviceOps::greedy_feed): the next step's input and the host's copy, the
// sequence number written last.
__device__ __forceinline__ void feed_pick(int64_t tok, int64_t finite, int64_t* io, volatile int64_t* host,
                                          int64_t seq) {
  io[0] = tok;
  io[1] += 1;
  host[0] = tok;
  host[1] = finite;
  __threadfence_system();  // the pick reaches the host before the sequence number
  host[2] = seq;
}

// Phase 2: one warp per row picks the best of its splits' candidates: out[2r] = the id (0 when no value beats
// -inf), out[2r + 1] = 1 when the row is all finite. With FEED (one row): the pick also goes to the next step and
// the host as greedy_feed_kernel does it.
template <bool FEED>
__global__ void argmax_final_kernel(const float* part_v, const int64_t* part_i, const int* part_f, int splits,
                                    int64_t V, int64_t* __restrict__ out, int64_t* io, volatile int64_t* host,
                                    int64_t seq) {
  cuda::pdl_wait();  // PDL: the candidates are written by the kernel before
  cuda::pdl_trigger();
  const int64_t r = blockIdx.x;
  const int lane = threadIdx.x;
  float bv = -INFINITY;
  int64_t bi = V;
  int fin = 1;
  for (int s = lane; s < splits; s += 32) {
    const float v = part_v[r * splits + s];
    const int64_t i = part_i[r * splits + s];
    if (beats(v, i, bv, bi)) bv = v, bi = i;
    fin &= part_f[r * splits + s];
  }
  warp_best(bv, bi, fin);
  if (lane != 0) return;
  const int64_t tok = bi < V ? bi : 0;
  out[2 * r] = tok;
  out[2 * r + 1] = fin;
  if constexpr (FEED) feed_pick(tok, fin, io, host, seq);
}

__global__ void greedy_feed_kernel(const int64_t* pick, int64_t* io, volatile int64_t* host, int64_t seq) {
  cuda::pdl_wait();  // PDL: the pick is written by the kernel before
  cuda::pdl_trigger();
  feed_pick(pick[0], pick[1], io, host, seq);
}

// The device's address of page-locked, mapped host memory.
cudaError_t device_view(int64_t* host, int64_t*& dev_host) {
  dev_host = nullptr;
  return cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_host), host, 0);
}

int64_t argmax_chunk(int64_t V) {
  const int64_t c = std::max<int64_t>(kArgmaxMinChunk, (V + kArgmaxMaxSplits - 1) / kArgmaxMaxSplits);
  return (c + 3) / 4 * 4;
}

cudaError_t argmax_two_phase(const float* logits, int64_t R, int64_t V, const Suppress& suppress, int64_t* out,
                             void* work, bool feed, int64_t* io, int64_t* host, int64_t seq, cudaStream_t s) {
  if (R <= 0) return cudaSuccess;
  if (V <= 0 || R > 65535 || suppress.n < 0 || suppress.n > kArgmaxMaxSuppress || !work) return cudaErrorInvalidValue;
  const int64_t chunk = argmax_chunk(V), splits = (V + chunk - 1) / chunk;
  auto* part_i = static_cast<int64_t*>(work);  // 8-byte aligned first
  auto* part_v = reinterpret_cast<float*>(part_i + R * splits);
  auto* part_f = reinterpret_cast<int*>(part_v + R * splits);
  const bool pdl = cuda::pdl_enabled();
  cudaError_t err = cuda::launch_pdl(pdl, argmax_part_kernel, dim3(unsigned(splits), unsigned(R)), dim3(kArgmaxThreads),
                                     0, s, logits, V, chunk, suppress, part_v, part_i, part_f);
  if (err != cudaSuccess) return err;
  if (!feed)
    return cuda::launch_pdl(pdl, argmax_final_kernel<false>, dim3(unsigned(R)), dim3(32), 0, s,
                            static_cast<const float*>(part_v), static_cast<const int64_t*>(part_i),
                            static_cast<const int*>(part_f), int(splits), V, out, static_cast<int64_t*>(nullptr),
                            static_cast<volatile int64_t*>(nullptr), seq);
  int64_t* dev_host = nullptr;
  err = device_view(host, dev_host);
  if (err != cudaSuccess) return err;
  return cuda::launch_pdl(pdl, argmax_final_kernel<true>, dim3(1), dim3(32), 0, s, static_cast<const float*>(part_v),
                          static_cast<const int64_t*>(part_i), static_cast<const int*>(part_f), int(splits), V, out, io,
                          static_cast<volatile int64_t*>(dev_host), seq);
}

}  // namespace

cudaError_t greedy_feed(const int64_t* pick, int64_t* io, int64_t* host, int64_t seq, cudaStream_t s) {
  int64_t* dev_host = nullptr;
  const cudaError_t err = device_view(host, dev_host);
  if (err != cudaSuccess) return err;
  return cuda::launch_pdl(cuda::pdl_enabled(), greedy_feed_kernel, dim3(1), dim3(1), 0, s, pick, io, dev_host, seq);
}

size_t argmax_work_bytes(int64_t R, int64_t V) {
  if (R <= 0 || V <= 0) return 0;
  const int64_t splits = (V + argmax_chunk(V) - 1) / argmax_chunk(V);
  return size_t(R * splits) * (sizeof(float) + sizeof(int64_t) + sizeof(int)) + 64;
}

cudaError_t argmax_rows(const float* logits, int64_t R, int64_t V, const Suppress& suppress, int64_t* out, void* work,
                        cudaStream_t s) {
  return argmax_two_phase(logits, R, V, suppress, out, work, false, nullptr, nullptr, 0, s);
}

cudaError_t argmax_feed(const float* logits, int64_t V, const Suppress& suppress, int64_t* pick, void* work,
                        int64_t* io, int64_t* host, int64_t seq, cudaStream_t s) {
  if (!io || !host) return cudaErrorInvalidValue;
  return argmax_two_phase(logits, 1, V, suppress, pick, work, true, io, host, seq, s);
}

}  // namespace moekit::model::kernels

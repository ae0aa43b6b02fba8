// The greedy choice on the device: one block per row of logits finds the first largest value (suppressed ids
// count as -inf) and whether the row is all finite, so a decode step sends back one id per sequence.
#include <cmath>

#include "base/cuda_pdl.cuh"
#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

constexpr int kArgmaxThreads = 1024;
constexpr int kArgmaxUnroll = 8;  // 16-byte loads per thread in flight

// (value, index) a beats (value, index) b: larger value, or equal value and smaller index.
__device__ __forceinline__ bool beats(float av, int64_t ai, float bv, int64_t bi) {
  return av > bv || (av == bv && ai < bi);
}

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* __restrict__ logits, int64_t V, Suppress sup, int64_t* __restrict__ out) {
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ int64_t si[kArgmaxThreads / 32];
  __shared__ int sfin[kArgmaxThreads / 32];
  cuda::pdl_wait();  // PDL: the logits are written by the kernel before
  cuda::pdl_trigger();
  const float* p = logits + int64_t(blockIdx.x) * V;
  float bv = -INFINITY;
  int64_t bi = V;  // none yet: any index beats it at -inf
  int fin = 1;
  auto visit = [&](float x, int64_t i) {
    if (!isfinite(x)) fin = 0;
    for (int j = 0; j < sup.n; ++j)
      if (sup.ids[j] == i) x = -INFINITY;
    if (beats(x, i, bv, bi)) bv = x, bi = i;  // NaN never beats (the row is reported instead)
  };
  int64_t i0 = 0;
  if (V % 4 == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    // Rounds of kArgmaxUnroll float4 per thread, all loads issued before the first compare.
    const float4* p4 = reinterpret_cast<const float4*>(p);
    const int64_t n4 = V / 4;
    constexpr int64_t kRound = int64_t(kArgmaxThreads) * kArgmaxUnroll;
    for (int64_t b = 0; b < n4; b += kRound) {
      float4 q[kArgmaxUnroll];
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u) {
        const int64_t k = b + threadIdx.x + int64_t(u) * kArgmaxThreads;
        q[u] = k < n4 ? p4[k] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u) {
        const int64_t k = b + threadIdx.x + int64_t(u) * kArgmaxThreads;
        if (k < n4) {
          visit(q[u].x, 4 * k);
          visit(q[u].y, 4 * k + 1);
          visit(q[u].z, 4 * k + 2);
          visit(q[u].w, 4 * k + 3);
        }
      }
    }
    i0 = V;
  }
  for (int64_t i = i0 + threadIdx.x; i < V; i += kArgmaxThreads) visit(p[i], i);
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (beats(ov, oi, bv, bi)) bv = ov, bi = oi;
    fin &= __shfl_xor_sync(0xffffffffu, fin, o);
  }
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
    out[2 * int64_t(blockIdx.x)] = bi < V ? bi : 0;
    out[2 * int64_t(blockIdx.x) + 1] = fin;
  }
}

__global__ void greedy_feed_kernel(const int64_t* pick, int64_t* io, volatile int64_t* host, int64_t seq) {
  cuda::pdl_wait();  // PDL: the pick is written by the kernel before
  cuda::pdl_trigger();
  const int64_t tok = pick[0], finite = pick[1];
  io[0] = tok;
  io[1] += 1;
  host[0] = tok;
  host[1] = finite;
  __threadfence_system();  // the pick reaches the host before the sequence number
  host[2] = seq;
}

}  // namespace

cudaError_t greedy_feed(const int64_t* pick, int64_t* io, int64_t* host, int64_t seq, cudaStream_t s) {
  int64_t* dev_host = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_host), host, 0);
  if (err != cudaSuccess) return err;
  return cuda::launch_pdl(cuda::pdl_enabled(), greedy_feed_kernel, dim3(1), dim3(1), 0, s, pick, io, dev_host, seq);
}

cudaError_t argmax_rows(const float* logits, int64_t R, int64_t V, const Suppress& suppress, int64_t* out,
                        cudaStream_t s) {
  if (R <= 0) return cudaSuccess;
  if (V <= 0 || R > 0x7fffffff || suppress.n < 0 || suppress.n > kArgmaxMaxSuppress) return cudaErrorInvalidValue;
  return cuda::launch_pdl(cuda::pdl_enabled(), argmax_rows_kernel, dim3(unsigned(R)), dim3(kArgmaxThreads), 0, s,
                          logits, V, suppress, out);
}

}  // namespace moekit::model::kernels

// The greedy choice on the device: one block per row of logits finds the first largest value (suppressed ids
// count as -inf) and whether the row is all finite, so a decode step sends back one id per sequence.
#include <cmath>

#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

constexpr int kArgmaxThreads = 512;

// (value, index) a beats (value, index) b: larger value, or equal value and smaller index.
__device__ __forceinline__ bool beats(float av, int64_t ai, float bv, int64_t bi) {
  return av > bv || (av == bv && ai < bi);
}

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* __restrict__ logits, int64_t V, Suppress sup, int64_t* __restrict__ out) {
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ int64_t si[kArgmaxThreads / 32];
  __shared__ int sfin[kArgmaxThreads / 32];
  const float* p = logits + int64_t(blockIdx.x) * V;
  float bv = -INFINITY;
  int64_t bi = V;  // none yet: any index beats it at -inf
  int fin = 1;
  for (int64_t i = threadIdx.x; i < V; i += kArgmaxThreads) {
    float x = p[i];
    if (!isfinite(x)) fin = 0;
    for (int j = 0; j < sup.n; ++j)
      if (sup.ids[j] == i) x = -INFINITY;
    if (beats(x, i, bv, bi)) bv = x, bi = i;  // NaN never beats (the row is reported instead)
  }
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

}  // namespace

cudaError_t argmax_rows(const float* logits, int64_t R, int64_t V, const Suppress& suppress, int64_t* out,
                        cudaStream_t s) {
  if (R <= 0) return cudaSuccess;
  if (V <= 0 || R > 0x7fffffff || suppress.n < 0 || suppress.n > kArgmaxMaxSuppress) return cudaErrorInvalidValue;
  argmax_rows_kernel<<<unsigned(R), kArgmaxThreads, 0, s>>>(logits, V, suppress, out);
  return cudaGetLastError();
}

}  // namespace moekit::model::kernels

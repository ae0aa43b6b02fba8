// Internal: device helpers of the model's layer kernels: element access by run-time type code (uniform across a
// launch), positions read on the device, warp and block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "base/cuda_elem.cuh"
#include "base/cuda_warp.cuh"
#include "model/kernels/layer_kernels.h"

namespace moekit::model::kernels {

using cuda::bf16;
using cuda::f16;

__device__ __forceinline__ float ld(const void* p, int t, int64_t i) {
  if (t == kF32) return static_cast<const float*>(p)[i];
  if (t == kBF16) return __bfloat162float(static_cast<const bf16*>(p)[i]);
  return __half2float(static_cast<const f16*>(p)[i]);
}
__device__ __forceinline__ void st(void* p, int t, int64_t i, float v) {
  if (t == kF32)
    static_cast<float*>(p)[i] = v;
  else if (t == kBF16)
    static_cast<bf16*>(p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<f16*>(p)[i] = __float2half_rn(v);
}
// The value an f32 takes once stored in dtype t.
__device__ __forceinline__ float round_as(int t, float v) {
  if (t == kBF16) return __bfloat162float(__float2bfloat16_rn(v));
  if (t == kF16) return __half2float(__float2half_rn(v));
  return v;
}
__device__ __forceinline__ int64_t position(int64_t value, const int64_t* device) {
  return device ? *device : value;
}
using cuda::warp_max;
using cuda::warp_sum;
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ inline float block_sum(float v, float* red) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0;
  for (int w = 0; w < warps; ++w) s += red[w];
  return s;
}

// Grid for a grid-stride elementwise loop over n elements.
inline unsigned blocks_for(int64_t n, int threads = 256) {
  const int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

}  // namespace moekit::model::kernels

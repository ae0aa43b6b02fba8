// Internal: device element conversions between f32 and the storage types (round to nearest even), for the
// kernels of the backends, the model and the benchmark.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moekit::cuda {

using bf16 = __nv_bfloat16;
using f16 = __half;

template <class T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<bf16>(bf16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32<f16>(f16 v) { return __half2float(v); }

template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ f16 from_f32<f16>(float v) { return __float2half_rn(v); }

}  // namespace moekit::cuda

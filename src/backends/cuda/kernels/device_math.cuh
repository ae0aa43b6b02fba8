// Device helpers shared by the kernels: element conversions, activations and gates (same formulas as
// src/backends/gate.h), dtype dispatch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/kernels.h"

namespace moekit::cuda::kernels {

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

__device__ __forceinline__ float activate(int act, float x) {
  switch (act) {
    case kActSilu: return x / (1.0f + expf(-x));
    case kActGelu: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case kActGeluTanh: return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    case kActRelu: return x > 0.0f ? x : 0.0f;
    case kActRelu2: return x > 0.0f ? x * x : 0.0f;
    case kActSigmoid: return 1.0f / (1.0f + expf(-x));
    default: return x;  // kActIdentity
  }
}

// gate and up already include their biases.
__device__ __forceinline__ float gate_value(const GateParams& g, float gate, float up) {
  if (g.kind == kGateClampedSwiglu) {
    gate = gate < g.limit ? gate : g.limit;
    up = up < -g.limit ? -g.limit : (up > g.limit ? g.limit : up);
    return (up + 1.0f) * gate * (1.0f / (1.0f + expf(-g.alpha * gate)));
  }
  return activate(g.activation, gate) * up;
}

// Weight row of the gate and up halves of gated column c.
__device__ __forceinline__ int64_t gate_row(const GateParams& g, int64_t c) { return g.concatenated ? c : 2 * c; }
__device__ __forceinline__ int64_t up_row(const GateParams& g, int64_t c, int64_t inter) {
  return g.concatenated ? inter + c : 2 * c + 1;
}

// Expert of row tile `tile`: the largest e with tile_offsets[e] <= tile (that expert has tiles).
__device__ __forceinline__ int tile_expert(const int32_t* tile_offsets, int experts, int tile) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(tile_offsets + mid) <= tile) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// fn(T{}) with T the C++ type of an Elem: a flat switch onto the instantiations.
template <class Fn>
cudaError_t with_elem(Elem e, Fn&& fn) {
  switch (e) {
    case Elem::f32: return fn(float{});
    case Elem::bf16: return fn(bf16{});
    case Elem::f16: return fn(f16{});
  }
  return cudaErrorInvalidValue;
}
}  // namespace moekit::cuda::kernels

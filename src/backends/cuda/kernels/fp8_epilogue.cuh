// The first projection's epilogue of the FP8 kernels, as transformers' fine-grained FP8 path materialises it (and
// the f64 reference, src/backends/reference.cpp): the projection's output rounded to the activations' dtype T, the
// bias added in T, the gate in f32 with each step that torch runs in a 16-bit dtype rounded to it. The values the
// next quantisation sees are then those of the reference, bit for bit where the sums agree.
#pragma once
#include <type_traits>

#include "backends/cuda/kernels/device_math.cuh"

namespace moekit::cuda::kernels {

template <class T>
__device__ __forceinline__ float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return to_f32(from_f32<T>(v));
}

// Gated column: gate and up accumulators, their biases (has_bias), the gated value (before the final rounding).
template <class T>
__device__ __forceinline__ float fp8_gated(const GateParams& gp, float g, float u, bool has_bias, float bg, float bu) {
  g = round_to<T>(g);
  u = round_to<T>(u);
  if (has_bias) {
    g = round_to<T>(g + bg);
    u = round_to<T>(u + bu);
  }
  if constexpr (std::is_same_v<T, float>) {
    return gate_value(gp, g, u);
  } else {
    if (gp.kind == kGateClampedSwiglu) {
      g = g < gp.limit ? g : gp.limit;
      u = u < -gp.limit ? -gp.limit : (u > gp.limit ? gp.limit : u);
      const float sig = round_to<T>(1.0f / (1.0f + expf(-round_to<T>(g * gp.alpha))));
      return round_to<T>(u + 1.0f) * round_to<T>(g * sig);
    }
    return round_to<T>(activate(gp.activation, g)) * u;
  }
}

// Ungated column: act(x + bias).
template <class T>
__device__ __forceinline__ float fp8_act_only(const GateParams& gp, float x, bool has_bias, float b) {
  x = round_to<T>(x);
  if (has_bias) x = round_to<T>(x + b);
  return activate(gp.activation, x);
}

}  // namespace moekit::cuda::kernels

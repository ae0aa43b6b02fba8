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

// The gate of an epilogue as one constant: an activation code (kAct*, the gate kGateActMul or the ungated
// column) or kActClampedGate for gpt-oss's clamped SwiGLU; kActRuntime reads it from GateParams. Epilogues that
// unroll over many columns take it as a template argument (one switch per tile, outside the column loop): each
// column then carries only its own activation's code rather than every activation's, which kept the FP8 Hopper
// kernel's gated epilogue (34k instructions per instantiation) waiting on instruction fetch.
constexpr int kActClampedGate = 7, kActRuntime = -1;

__device__ __forceinline__ int gate_code(const GateParams& gp) {
  return gp.kind == kGateClampedSwiglu ? kActClampedGate : gp.activation;
}

// fn(std::integral_constant<int, code>) for the gate code of gp: the switch onto the constant forms.
template <class Fn>
__device__ __forceinline__ void with_gate_code(const GateParams& gp, Fn&& fn) {
  switch (gate_code(gp)) {
    case kActSilu: fn(std::integral_constant<int, kActSilu>{}); break;
    case kActGelu: fn(std::integral_constant<int, kActGelu>{}); break;
    case kActGeluTanh: fn(std::integral_constant<int, kActGeluTanh>{}); break;
    case kActRelu: fn(std::integral_constant<int, kActRelu>{}); break;
    case kActRelu2: fn(std::integral_constant<int, kActRelu2>{}); break;
    case kActSigmoid: fn(std::integral_constant<int, kActSigmoid>{}); break;
    case kActClampedGate: fn(std::integral_constant<int, kActClampedGate>{}); break;
    default: fn(std::integral_constant<int, kActIdentity>{}); break;
  }
}


// Gated column: gate and up accumulators, their biases (has_bias), the gated value (before the final rounding).
// CODE: the gate code as a constant (see kActClampedGate) or kActRuntime.
template <class T, int CODE = kActRuntime>
__device__ __forceinline__ float fp8_gated(const GateParams& gp, float g, float u, bool has_bias, float bg, float bu) {
  const bool clamped = CODE == kActRuntime ? gp.kind == kGateClampedSwiglu : CODE == kActClampedGate;
  const int a = CODE == kActRuntime ? gp.activation : CODE;
  g = round_to<T>(g);
  u = round_to<T>(u);
  if (has_bias) {
    g = round_to<T>(g + bg);
    u = round_to<T>(u + bu);
  }
  if constexpr (std::is_same_v<T, float>) {
    return clamped ? act::clamped_swiglu(g, u, gp.limit, gp.alpha) : activate(a, g) * u;
  } else {
    if (clamped) {
      g = g < gp.limit ? g : gp.limit;
      u = u < -gp.limit ? -gp.limit : (u > gp.limit ? gp.limit : u);
      const float sig = round_to<T>(1.0f / (1.0f + expf(-round_to<T>(g * gp.alpha))));
      return round_to<T>(u + 1.0f) * round_to<T>(g * sig);
    }
    if constexpr (CODE == kActSilu) return round_to<T>(silu_fast(g)) * u;
    return round_to<T>(activate(a, g)) * u;
  }
}

// Ungated column: act(x + bias). CODE: the activation as a constant or kActRuntime.
template <class T, int CODE = kActRuntime>
__device__ __forceinline__ float fp8_act_only(const GateParams& gp, float x, bool has_bias, float b) {
  x = round_to<T>(x);
  if (has_bias) x = round_to<T>(x + b);
  return activate(CODE == kActRuntime ? gp.activation : CODE, x);
}

// The tiled FP8 / FP4 projections' blocks of BN virtual columns (gated projections interleave gate and up rows:
// virtual column 2c is the gate row, 2c + 1 the up row of output column c): the weight row of virtual column v of
// column block bn, -1 past the end.
template <int BN, int EPI>
__device__ __forceinline__ int64_t tile_weight_row(const Fp8GemmArgs& args, int bn, int v) {
  if constexpr (EPI == kEpiGated) {
    const int64_t c = int64_t(bn) * (BN / 2) + v / 2;
    return c >= args.n ? -1 : ((v & 1) ? up_row(args.gate, c, args.inter) : gate_row(args.gate, c));
  } else {
    const int64_t n = int64_t(bn) * BN + v;
    return n < args.n ? n : -1;
  }
}

// fn(T{}, std::integral_constant<int, CODE>{}) with T the output type and CODE the gate code of these arguments:
// the one switch a tile's epilogue takes outside its unrolled columns (f32 outputs: float and kActRuntime).
template <int EPI, class Fn>
__device__ __forceinline__ void with_epilogue_forms(const Fp8GemmArgs& args, Fn&& fn) {
  if constexpr (EPI == kEpiF32) {
    fn(float{}, std::integral_constant<int, kActRuntime>{});
  } else {
    with_gate_code(args.gate, [&](auto code) {
      switch (args.type) {
        case Elem::f32: fn(float{}, code); break;
        case Elem::bf16: fn(bf16{}, code); break;
        case Elem::f16: fn(f16{}, code); break;
      }
    });
  }
}

// Stores the accumulators x0, x1 of virtual columns v, v + 1 (v even) of row `row` through the epilogue; CODE: the
// gate as a constant or kActRuntime.
template <class T, int BN, int EPI, int CODE = kActRuntime>
__device__ __forceinline__ void store_fp8_pair(const Fp8GemmArgs& args, int expert, int bn, int64_t row, int v,
                                               float x0, float x1) {
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(expert) * args.bias_expert_stride : nullptr;
  if constexpr (EPI == kEpiGated) {
    const int64_t c = int64_t(bn) * (BN / 2) + v / 2;
    if (c >= args.n) return;
    const float bg = bias ? to_f32(bias[gate_row(args.gate, c)]) : 0.0f;
    const float bu = bias ? to_f32(bias[up_row(args.gate, c, args.inter)]) : 0.0f;
    static_cast<T*>(args.out)[row * args.ldo + c] = from_f32<T>(fp8_gated<T, CODE>(args.gate, x0, x1, bias != nullptr, bg, bu));
  } else {
    const int64_t n = int64_t(bn) * BN + v;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if (n + q >= args.n) continue;
      const float x = q ? x1 : x0;
      if constexpr (EPI == kEpiActOnly) {
        const float y = fp8_act_only<T, CODE>(args.gate, x, bias != nullptr, bias ? to_f32(bias[n + q]) : 0.0f);
        static_cast<T*>(args.out)[row * args.ldo + n + q] = from_f32<T>(y);
      } else {
        static_cast<float*>(args.out)[row * args.ldo + n + q] = x;
      }
    }
  }
}

}  // namespace moekit::cuda::kernels

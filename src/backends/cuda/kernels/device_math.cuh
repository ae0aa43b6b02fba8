// Device helpers shared by the kernels: element conversions, activations and gates (the formulas of
// src/base/activation.h), dtype dispatch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "backends/cuda/kernels/kernels.h"
#include "base/activation.h"
#include "base/cuda_elem.cuh"

namespace moekit::cuda::kernels {

static_assert(kActSilu == act::kSilu && kActGelu == act::kGelu && kActGeluTanh == act::kGeluTanh &&
                  kActRelu == act::kRelu && kActRelu2 == act::kRelu2 && kActSigmoid == act::kSigmoid &&
                  kActIdentity == act::kIdentity,
              "the kernels' activation codes are base/activation.h's");

__device__ __forceinline__ float activate(int a, float x) { return act::apply(a, x); }

// SiLU with the hardware's exp2 and reciprocal approximations (a few ulp of f32) for 16-bit outputs, whose value is
// rounded to bf16 / f16 next: it differs from the correctly rounded x / (1 + exp(-x)) by one 16-bit ulp only where
// that value lies within a few f32 ulp of a rounding boundary. The exact form (an IEEE division and expf) was about a
// third of the FP8 Hopper kernel's gated epilogue, which both consumer warpgroups run while the tensor cores wait;
// the bf16 TMA engine's gated epilogues use it too. 0 once exp(-x) > 2^126.
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

// gate and up already include their biases.
__device__ __forceinline__ float gate_value(const GateParams& g, float gate, float up) {
  if (g.kind == kGateClampedSwiglu) return act::clamped_swiglu(gate, up, g.limit, g.alpha);
  return activate(g.activation, gate) * up;
}

// Weight row of the gate and up halves of gated column c.
__device__ __forceinline__ int64_t gate_row(const GateParams& g, int64_t c) { return g.concatenated ? c : 2 * c; }
__device__ __forceinline__ int64_t up_row(const GateParams& g, int64_t c, int64_t inter) {
  return g.concatenated ? inter + c : 2 * c + 1;
}

// Expert of row tile `tile`: the largest e with tile_offsets[e] <= tile (that expert has tiles). SHARED: the
// offsets are a copy in shared memory (plain loads) rather than in global memory (read-only cache loads).
template <bool SHARED = false>
__device__ __forceinline__ int tile_expert(const int32_t* tile_offsets, int experts, int tile) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if ((SHARED ? tile_offsets[mid] : __ldg(tile_offsets + mid)) <= tile) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Records bad id v of pair p in the sticky error word: the smallest (token << 40 | slot << 32 | uint32(id)),
// kernels.h's format.
__device__ __forceinline__ void record_bad_id(unsigned long long* error, int64_t p, int top_k, long long v) {
  const int32_t clamped = v < INT_MIN ? INT_MIN : (v > INT_MAX ? INT_MAX : static_cast<int32_t>(v));
  const unsigned long long t = static_cast<unsigned long long>(p / top_k);
  const unsigned long long key = ((t < (1ull << 24) ? t : (1ull << 24) - 1) << 40) |
                                 (static_cast<unsigned long long>(p % top_k & 0xff) << 32) |
                                 static_cast<uint32_t>(clamped);
  atomicMin(error, key);
}

// The expert of pair p (E for the sentinel and for bad ids, which also set the error word when it is given).
__device__ __forceinline__ int pair_expert_of(const void* index, Index index_type, int64_t p, int top_k, int experts,
                                              unsigned long long* error) {
  const long long v = index_type == Index::i32 ? static_cast<long long>(static_cast<const int32_t*>(index)[p])
                                               : static_cast<long long>(static_cast<const int64_t*>(index)[p]);
  if (v >= 0 && v <= experts) return static_cast<int>(v);
  if (error) record_bad_id(error, p, top_k, v);
  return experts;
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

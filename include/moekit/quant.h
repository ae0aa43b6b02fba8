// moekit: quantized weights (SPEC section 5): FP8 e4m3 with 128 x 128 block scales (f32 or UE8M0), and the
// dynamic activation quantisation of transformers' fine-grained FP8 path. The element conversions themselves
// (f8e4m3, f4e2m1, ue8m0 <-> f32, exact, round-to-nearest-even) are in moekit/dtype.h.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

#include "moekit/tensor.h"

namespace moekit {

// Weight blocks and activation groups of the FP8 block-scaled format: 128 x 128 weight blocks (the last block
// of a dimension that is not a multiple of 128 is partial), activations scaled per token and 128 inputs.
constexpr int64_t kFp8Block = 128;
constexpr float kFp8Max = 448.0f;  // largest finite e4m3 value
inline int64_t fp8_blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// The scale of one FP8 weight element: row n (of N), input k, scales [.., SN, ceil(K/128)] f32 or ue8m0.
// `segments` splits the N rows into that many equal halves (fused gate_up: 2) each with its own blocks of 128
// rows, so that SN = segments * ceil(N / segments / 128).
inline int64_t fp8_scale_row(int64_t n, int64_t rows, int64_t segments) {
  const int64_t seg = rows / segments;
  return (n / seg) * fp8_blocks(seg) + (n % seg) / kFp8Block;
}

// Dequantizes FP8 weights w [.., N, K] (f8e4m3) with scale_inv [.., SN, ceil(K/128)] (f32 or ue8m0) into `out`
// (f32, bf16 or f16): w[n, k] * scale[row(n), k / 128] multiplied in f32 then converted, as torch does
// (`(q.float() * s).to(dtype)`). Throws naming
// `name` on a shape or dtype that does not fit.
Tensor dequantize_fp8(const Tensor& w, const Tensor& scale_inv, DType out, int64_t segments = 1,
                      const std::string& name = "weight");

// Quantizes a float weight [.., N, K] into FP8 with 128 x 128 block scales, as transformers' Fp8Quantize with
// exact partial last blocks: per block amax, scale_inv = amax / 448 (1 where amax is 0), values w / scale_inv
// rounded to nearest even e4m3, saturating. With `scale_dtype` ue8m0, scale_inv is first rounded up to a power
// of two. Returns {weight f8e4m3 [.., N, K], scale_inv [.., SN, ceil(K/128)]}.
std::pair<Tensor, Tensor> quantize_fp8(const Tensor& w, DType scale_dtype = DType::f32, int64_t segments = 1);

// FP4 (e2m1) weights with one ue8m0 scale per row and 32 inputs (MXFP4, FP4 with UE8M0 scales).
constexpr int64_t kFp4Group = 32;
// Dequantizes w [.., N, K] (f4e2m1, packed) with scales [.., N, K / 32] (ue8m0) into `out` (f32, bf16 or f16):
// e2m1 value x 2^(scale - 127), exact in f32, then rounded once.
Tensor dequantize_fp4(const Tensor& w, const Tensor& scales, DType out, const std::string& name = "weight");
// Quantizes a float weight [.., N, K] (K a multiple of 32) into FP4: per row and 32 inputs the scale is
// 2^(floor(log2(amax)) - 2) (the OCP MX rule: the largest element lands in [4, 8) before saturating to 6), values
// w / scale rounded to nearest even e2m1, saturating to +-6. Returns {weight f4e2m1 [.., N, K], scales ue8m0
// [.., N, K / 32]}.
std::pair<Tensor, Tensor> quantize_fp4(const Tensor& w);

// The dynamic activation quantisation of one row x [k] (f32), per group of 128 inputs g:
//   scale[g] = amax(|x[g]|) / 448 (f32 division; rounded up to a power of two when `pow2_scales`),
//   q[i]     = e4m3(x[i] / scale[g]) rounded to nearest even and saturated to +-448 (0 where scale is 0),
// writing q as the e4m3 values (f32, exact) and the ceil(k / 128) scales.
void quantize_activations_fp8(const float* x, int64_t k, bool pow2_scales, float* q, float* scale);

}  // namespace moekit

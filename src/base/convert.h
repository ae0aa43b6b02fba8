// Internal: exact f16 <-> f32 conversions, rounding to a storage dtype and f32 row conversions, shared by the
// CPU backends and the model runtime's CPU ops (portable code only).
#pragma once
#include <cstdint>
#include <cstring>

#include "moekit/dtype.h"

namespace moekit::cpu {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, em = h & 0x7fffu;
  uint32_t bits;
  if (em >= 0x7c00u) {
    bits = sign | 0x7f800000u | ((em & 0x3ffu) << 13);  // inf, NaN
  } else if (em >= 0x0400u) {
    bits = sign | ((em + ((127u - 15u) << 10)) << 13);  // normal
  } else {
    const float f = float(em) * 5.9604644775390625e-8f;  // subnormal: em * 2^-24, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even; overflow gives inf, NaN stays NaN.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint16_t o;
  if (x >= 0x47800000u) {  // >= 65536 (or inf, NaN)
    o = x > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (x < 0x38800000u) {              // below 2^-14: subnormal half or zero; let the FPU round
    const uint32_t magic_bits = 126u << 23;  // 0.5: adding it aligns the half subnormal ulp (2^-24) to bit 0
    float fx, magic;
    std::memcpy(&fx, &x, 4);
    std::memcpy(&magic, &magic_bits, 4);
    fx += magic;
    uint32_t r;
    std::memcpy(&r, &fx, 4);
    o = uint16_t(r - magic_bits);
  } else {
    const uint32_t odd = (x >> 13) & 1u;
    x += (uint32_t(15 - 127) << 23) + 0xfffu + odd;
    o = uint16_t(x >> 13);
  }
  return uint16_t(o | (sign >> 16));
}

// Rounds a value to `t` (bf16, f16) and back; f32 stays as is.
inline float round_to(float v, DType t) {
  switch (t) {
    case DType::bf16:
      return bf16_to_f32(f32_to_bf16(v));
    case DType::f16:
      return half_to_float(float_to_half(v));
    default:
      return v;
  }
}

// dst[0, n) = f32(src[off, off + n)) for f32 | bf16 | f16 | f64 sources.
void load_f32(const void* src, DType t, int64_t off, int64_t n, float* dst);
// dst[off, off + n) = src[0, n) rounded to t (f32 | bf16 | f16).
void store_f32(const float* src, void* dst, DType t, int64_t off, int64_t n);
// Rounds x[0, n) in place to t (no-op for f32).
void round_row(float* x, int64_t n, DType t);

}  // namespace moekit::cpu

// FP8 quantisation on the device, bit for bit the host's (src/core/dtype.cpp, moekit/quant.h): e4m3 and ue8m0
// conversions and the 16-lane quantisation of one (row, group of 128 inputs), shared by the quantisation kernels
// (grouped_gemm_fp8.cu) and the decode GEMV's fused requantisation (gemv_quant.cu).
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backends/cuda/kernels/device_math.cuh"

namespace moekit::cuda::kernels {

// ---- element conversions, bit for bit those of src/core/dtype.cpp ----

// Round-to-nearest-even e4m3 of f, saturated to +-448 (NaN: 0x7f).
__device__ __forceinline__ uint8_t to_e4m3(float f) {
  if (isnan(f)) return 0x7f;
  const uint8_t sign = signbit(f) ? 0x80 : 0;
  const float a = fabsf(f);
  if (a >= 448.0f) return sign | 0x7e;
  uint32_t code;
  if (a < 0x1p-6f) {
    code = uint32_t(__float2int_rn(a * 512.0f));  // subnormal steps of 2^-9 (8: the smallest normal)
  } else {
    int ex;
    const float fr = frexpf(a, &ex);  // a = fr * 2^ex, fr in [0.5, 1)
    int e = ex - 1;
    uint32_t m = uint32_t(__float2int_rn((fr * 2.0f - 1.0f) * 8.0f));
    if (m == 8) m = 0, ++e;
    code = (uint32_t(e + 7) << 3) | m;
  }
  if (code > 0x7e) code = 0x7e;
  return uint8_t(sign | code);
}

// The power of two at or above f > 0, as ue8m0 then back to f32 (src/core/dtype.cpp f32_to_ue8m0).
__device__ __forceinline__ float pow2_ceil(float f) {
  int ex;
  const float m = frexpf(f, &ex);
  const int e = (m == 0.5f) ? ex - 1 : ex;
  int code = e + 127;
  code = code < 0 ? 0 : (code > 254 ? 254 : code);
  return ldexpf(1.0f, code - 127);
}

// Two e4m3 codes (lo in the low byte) by the hardware's conversion (sm_89+: round to nearest even, saturated to
// +-448, subnormals kept: to_e4m3 above), NaN mapped to 0x7f as there.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
  uint32_t r = d;
  if (isnan(lo)) r = (r & 0xff00u) | 0x7fu;
  if (isnan(hi)) r = (r & 0x00ffu) | 0x7f00u;
  return r;
#else
  return uint32_t(to_e4m3(lo)) | (uint32_t(to_e4m3(hi)) << 8);
#endif
}

// v / s as far as its e4m3 code goes, where inv is s's correctly rounded reciprocal (fast: finite). The product
// v * inv lies within 3 f32 ulp of the correctly rounded quotient, so it has the quotient's e4m3 code unless it lies
// within a few ulp of a midpoint between two e4m3 values (the 20 bits below e4m3's three mantissa bits at 0x80000)
// or below e4m3's normal range (2^-6, where the midpoints sit elsewhere): only there the IEEE division, which the
// host's quantisation runs everywhere. The codes are then the host's bit for bit at a fraction of the divisions.
__device__ __forceinline__ float e4m3_quotient(float v, float s, float inv, bool fast) {
  const float p = __fmul_rn(v, inv);
  const uint32_t low = __float_as_uint(p) & 0xfffffu;
  const bool near_midpoint = low - (0x80000u - 8u) < 16u;
  if (fast && !near_midpoint && fabsf(p) >= 0.03125f) return p;
  return __fdiv_rn(v, s);
}

// The second half of the 16-lane quantisation, for a lane's eight values v of inputs k0.. of a row of k: the group's
// amax over its 16 lanes (every lane reaches the shuffles, active or not), its scale (a power of two with pow2), the
// lane's codes (zero past k) stored into row `row` of q (k0 + 8 <= ldq: rows padded to whole groups) and, by lane 0,
// the scale into scale[row, g].
__device__ __forceinline__ void store_group16(const float (&v)[8], bool active, int64_t k0, int64_t k, int pow2, int l,
                                              uint8_t* __restrict__ q, int64_t ldq, float* __restrict__ scale,
                                              int64_t lds, int64_t row, int64_t g) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int o = 8; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!active) return;
  float s = __fdiv_rn(amax, 448.0f);
  if (pow2 && s > 0.0f) s = pow2_ceil(s);
  uint32_t w[2] = {0, 0};
  if (s > 0.0f) {
    const float inv = __frcp_rn(s);
    const bool fast = inv <= 3.0e38f;  // else the reciprocal overflowed: the division throughout
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const uint32_t c = e4m3x2(e4m3_quotient(v[i], s, inv, fast), e4m3_quotient(v[i + 1], s, inv, fast));
      const uint32_t m = (k0 + i < k ? 0x00ffu : 0u) | (k0 + i + 1 < k ? 0xff00u : 0u);  // padding: zero codes
      w[i / 4] |= (c & m) << (8 * (i % 4));
    }
  }
  uint32_t* out = reinterpret_cast<uint32_t*>(q + row * ldq + k0);
  out[0] = w[0];
  out[1] = w[1];
  if (l == 0) scale[row * lds + g] = s;
}

// Eight values of T from p (16-byte aligned where vec) into v, those at or past `left` zero.
template <class T>
__device__ __forceinline__ void load8(const T* __restrict__ p, bool vec, int64_t left, float (&v)[8]) {
  if (vec && left >= 8) {
    if constexpr (sizeof(T) == 4) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
      const T* h = reinterpret_cast<const T*>(&a);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = to_f32(h[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = i < left ? to_f32(p[i]) : 0.0f;
  }
}

}  // namespace moekit::cuda::kernels

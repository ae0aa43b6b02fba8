// GEMM micro-kernels in portable C++ (compiled with the default flags; the compiler vectorises the lane loops).
#include <cstdint>

#include "base/convert.h"
#include "base/gemm.h"

namespace moekit::cpu {
namespace scalar_kernels {

struct Lanes {
  float v[8];
};

struct V {
  static constexpr int W = 8;
  using R = Lanes;
  static R zero() {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = 0.0f;
    return r;
  }
  static R load(const float* p) {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, R a) {
    for (int i = 0; i < W; ++i) p[i] = a.v[i];
  }
  static R bcast(float x) {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = x;
    return r;
  }
  static float fma1(float a, float b, float c) {
    const volatile float p = a * b;  // never contracted: lanes and tails round the same way
    return p + c;
  }
  static R fma(R a, R b, R c) {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
    return r;
  }
  static float hsum(R a) { return ((a.v[0] + a.v[4]) + (a.v[2] + a.v[6])) + ((a.v[1] + a.v[5]) + (a.v[3] + a.v[7])); }
  static float f16_to_f32(uint16_t h) { return half_to_float(h); }
  static R load_bf16(const uint16_t* p) {
    R r;
    for (int i = 0; i < W; ++i) {
      const uint32_t b = uint32_t(p[i]) << 16;
      __builtin_memcpy(&r.v[i], &b, 4);
    }
    return r;
  }
  static R load_f16(const uint16_t* p) {
    R r;
    for (int i = 0; i < W; ++i) r.v[i] = f16_to_f32(p[i]);
    return r;
  }
};

// SSE2 has 16 xmm registers, two per Lanes: 4 accumulators (packed tiles: 4 rows x 1 vector).
constexpr int kKnMR = 4, kKnNV = 1, kDirectMaxM = 4, kDirectAcc = 4;
constexpr int64_t kKC = 256, kMC = 240, kTileN = 128;

#include "base/gemm_kernels.h"

// e4m3 decoding: the integer formula of the shared header, one value at a time.
typedef double F8D __attribute__((vector_size(16)));
inline double f8_scalar_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const int mag = e == 0 ? m : (8 + m) << (e - 1);
  return double((b & 0x80) ? -mag : mag) * 0x1p-17;
}
inline void f8_decode16(const uint8_t* src, F8D* out) {
  for (int v = 0; v < 8; ++v) out[v] = F8D{f8_scalar_value(src[2 * v]), f8_scalar_value(src[2 * v + 1])};
}
inline int64_t f8_decode_run(const uint8_t*, int64_t, double*) { return 0; }

// FP8 tile: 2 f64 lanes, 2 x 4 register tiles.
constexpr int kF8L = 2, kF8MR = 2, kF8NR = 4;
#include "base/gemm_fp8_kernels.h"

}  // namespace scalar_kernels

const GemmKernels kGemmScalar = {Isa::scalar, scalar_kernels::kTileN, scalar_kernels::kWorkFloats,
                                 scalar_kernels::kDirectMaxM, &scalar_kernels::gemm_tile, nullptr, &scalar_kernels::gemm_fp8_tile,
                                 &scalar_kernels::gemm_fp4_tile, nullptr};

}  // namespace moekit::cpu

// GEMM micro-kernels for AVX2 + FMA + F16C (this file is compiled with -mavx2 -mfma -mf16c).
#include <immintrin.h>

#include <cstdint>

#include "base/gemm.h"

namespace moekit::cpu {
namespace avx2_kernels {

struct V {
  static constexpr int W = 8;
  using R = __m256;
  static R zero() { return _mm256_setzero_ps(); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R bcast(float x) { return _mm256_set1_ps(x); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static float fma1(float a, float b, float c) {
    return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
  }
  static float hsum(R v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static R load_bf16(const uint16_t* p) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  }
  static R load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
};

// 16 ymm registers: 12 accumulators (packed tiles: 6 rows x 2 vectors).
constexpr int kKnMR = 6, kKnNV = 2, kDirectMaxM = 4, kDirectAcc = 12;
constexpr int64_t kKC = 256, kMC = 240, kTileN = 128;

#include "base/gemm_kernels.h"

// e4m3 -> f16 bits (sign to bit 15, exponent and mantissa shifted by 7: the value times 2^-8, subnormals included)
// -> f32 (F16C) -> f64, 8 at a time.
inline int64_t f8_decode_run(const uint8_t* src, int64_t n, double* dst) {
  int64_t i = 0;
  const __m128i mag = _mm_set1_epi16(0x3f80), sign = _mm_set1_epi16(int16_t(0x8000));
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 7), mag), _mm_and_si128(_mm_slli_epi16(b, 8), sign));
    const __m256 f = _mm256_cvtph_ps(h);
    _mm256_storeu_pd(dst + i, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    _mm256_storeu_pd(dst + i + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
  }
  return i;
}

typedef double F8D __attribute__((vector_size(32)));
inline void f8_decode16(const uint8_t* src, F8D* out) {
  const __m256i mag = _mm256_set1_epi16(0x3f80), sign = _mm256_set1_epi16(int16_t(0x8000));
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i h =
      _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 7), mag), _mm256_and_si256(_mm256_slli_epi16(b, 8), sign));
  const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  out[0] = F8D(_mm256_cvtps_pd(_mm256_castps256_ps128(lo)));
  out[1] = F8D(_mm256_cvtps_pd(_mm256_extractf128_ps(lo, 1)));
  out[2] = F8D(_mm256_cvtps_pd(_mm256_castps256_ps128(hi)));
  out[3] = F8D(_mm256_cvtps_pd(_mm256_extractf128_ps(hi, 1)));
}

// FP8 tile: 4 f64 lanes, 2 x 4 register tiles.
constexpr int kF8L = 4, kF8MR = 2, kF8NR = 4;
#include "base/gemm_fp8_kernels.h"

}  // namespace avx2_kernels

const GemmKernels kGemmAvx2 = {Isa::avx2, avx2_kernels::kTileN, avx2_kernels::kWorkFloats, avx2_kernels::kDirectMaxM,
                               &avx2_kernels::gemm_tile, nullptr, &avx2_kernels::gemm_fp8_tile,
                                 &avx2_kernels::gemm_fp4_tile, nullptr};

}  // namespace moekit::cpu

// GEMM micro-kernels for AVX-512 F/BW/VL/DQ + F16C (this file is compiled with -mavx512f ... -mf16c).
// GCC 12 flags its own _mm512_undefined_* helpers as uninitialised uses.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "base/gemm.h"

namespace moekit::cpu {
namespace avx512_kernels {

struct V {
  static constexpr int W = 16;
  using R = __m512;
  static R zero() { return _mm512_setzero_ps(); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R bcast(float x) { return _mm512_set1_ps(x); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static float fma1(float a, float b, float c) {
    return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
  }
  static float hsum(R v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static R load_bf16(const uint16_t* p) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  }
  static R load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
};

// 32 zmm registers: 24 accumulators (packed tiles: 12 rows x 2 vectors).
constexpr int kKnMR = 12, kKnNV = 2, kDirectMaxM = 4, kDirectAcc = 24;
constexpr int64_t kKC = 256, kMC = 240, kTileN = 128;

#include "base/gemm_kernels.h"

// e4m3 -> f16 bits (sign to bit 15, exponent and mantissa shifted by 7: the value times 2^-8, subnormals included)
// -> f32 -> f64, 16 at a time.
inline int64_t f8_decode_run(const uint8_t* src, int64_t n, double* dst) {
  int64_t i = 0;
  const __m256i mag = _mm256_set1_epi16(0x3f80), sign = _mm256_set1_epi16(int16_t(0x8000));
  for (; i + 16 <= n; i += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m256i h =
        _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 7), mag), _mm256_and_si256(_mm256_slli_epi16(b, 8), sign));
    const __m512 f = _mm512_cvtph_ps(h);
    _mm512_storeu_pd(dst + i, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    _mm512_storeu_pd(dst + i + 8, _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)));
  }
  return i;
}

typedef double F8D __attribute__((vector_size(64)));
inline void f8_decode16(const uint8_t* src, F8D* out) {
  const __m256i mag = _mm256_set1_epi16(0x3f80), sign = _mm256_set1_epi16(int16_t(0x8000));
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i h =
      _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 7), mag), _mm256_and_si256(_mm256_slli_epi16(b, 8), sign));
  const __m512 f = _mm512_cvtph_ps(h);
  out[0] = F8D(_mm512_cvtps_pd(_mm512_castps512_ps256(f)));
  out[1] = F8D(_mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)));
}

// FP8 tile: 8 f64 lanes, 4 x 4 register tiles.
constexpr int kF8L = 8, kF8MR = 4, kF8NR = 4;
#include "base/gemm_fp8_kernels.h"

}  // namespace avx512_kernels

const GemmKernels kGemmAvx512 = {Isa::avx512, avx512_kernels::kTileN, avx512_kernels::kWorkFloats,
                                 avx512_kernels::kDirectMaxM, &avx512_kernels::gemm_tile, nullptr, &avx512_kernels::gemm_fp8_tile,
                                 &avx512_kernels::gemm_fp4_tile, nullptr};

}  // namespace moekit::cpu

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

// FP8 tile: 4 f64 lanes, 2 x 4 register tiles.
constexpr int kF8L = 4, kF8MR = 2, kF8NR = 4;
#include "base/gemm_fp8_kernels.h"

}  // namespace avx2_kernels

const GemmKernels kGemmAvx2 = {Isa::avx2, avx2_kernels::kTileN, avx2_kernels::kWorkFloats, avx2_kernels::kDirectMaxM,
                               &avx2_kernels::gemm_tile, nullptr, &avx2_kernels::gemm_fp8_tile,
                                 &avx2_kernels::gemm_fp4_tile};

}  // namespace moekit::cpu

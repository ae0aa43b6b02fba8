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

// FP8 tile: 8 f64 lanes, 4 x 4 register tiles.
constexpr int kF8L = 8, kF8MR = 4, kF8NR = 4;
#include "base/gemm_fp8_kernels.h"

}  // namespace avx512_kernels

const GemmKernels kGemmAvx512 = {Isa::avx512, avx512_kernels::kTileN, avx512_kernels::kWorkFloats,
                                 avx512_kernels::kDirectMaxM, &avx512_kernels::gemm_tile, nullptr, &avx512_kernels::gemm_fp8_tile,
                                 &avx512_kernels::gemm_fp4_tile};

}  // namespace moekit::cpu

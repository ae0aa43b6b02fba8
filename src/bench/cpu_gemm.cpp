// Goto-style blocking: B packed in KC x 16 strips shared by all threads, A packed per thread in
// 6 x KC strips, a 6 x 16 register tile. Only for measuring the CPU's matrix rate.
#include "bench/cpu_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace moekit::bench {
namespace {

constexpr int64_t kMR = 6, kNR = 16;
constexpr int64_t kMC = 96, kKC = 256, kNC = 1024;

// b[kc, nc] (leading dimension ldb) into strips of kNR columns, zero-padded: [ceil(nc/16), kc, 16].
void pack_b(const float* b, int64_t ldb, int64_t kc, int64_t nc, float* packed) {
#pragma omp parallel for schedule(static)
  for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
    float* dst = packed + (j0 / kNR) * kc * kNR;
    const int64_t w = std::min(kNR, nc - j0);
    for (int64_t p = 0; p < kc; ++p) {
      const float* src = b + p * ldb + j0;
      for (int64_t j = 0; j < kNR; ++j) dst[p * kNR + j] = j < w ? src[j] : 0.0f;
    }
  }
}

// a[mc, kc] (leading dimension lda) into strips of kMR rows, zero-padded: [ceil(mc/6), kc, 6].
void pack_a(const float* a, int64_t lda, int64_t mc, int64_t kc, float* packed) {
  for (int64_t i0 = 0; i0 < mc; i0 += kMR) {
    float* dst = packed + (i0 / kMR) * kc * kMR;
    const int64_t h = std::min(kMR, mc - i0);
    for (int64_t p = 0; p < kc; ++p)
      for (int64_t i = 0; i < kMR; ++i) dst[p * kMR + i] = i < h ? a[(i0 + i) * lda + p] : 0.0f;
  }
}

// tile[6, 16] = sum over p of a_strip[p, 0:6] outer b_strip[p, 0:16].
__attribute__((target("avx2,fma"))) void tile_avx2(int64_t kc, const float* ap, const float* bp, float* tile) {
  __m256 c[kMR][2];
  for (int64_t r = 0; r < kMR; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_loadu_ps(bp + p * kNR), b1 = _mm256_loadu_ps(bp + p * kNR + 8);
    for (int64_t r = 0; r < kMR; ++r) {
      const __m256 av = _mm256_broadcast_ss(ap + p * kMR + r);
      c[r][0] = _mm256_fmadd_ps(av, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(av, b1, c[r][1]);
    }
  }
  for (int64_t r = 0; r < kMR; ++r) {
    _mm256_storeu_ps(tile + r * kNR, c[r][0]);
    _mm256_storeu_ps(tile + r * kNR + 8, c[r][1]);
  }
}

void tile_generic(int64_t kc, const float* ap, const float* bp, float* tile) {
  float c[kMR * kNR] = {};
  for (int64_t p = 0; p < kc; ++p)
    for (int64_t r = 0; r < kMR; ++r)
      for (int64_t j = 0; j < kNR; ++j) c[r * kNR + j] += ap[p * kMR + r] * bp[p * kNR + j];
  std::memcpy(tile, c, sizeof(c));
}

}  // namespace

void gemm_f32(int64_t M, int64_t N, int64_t K, const float* a, const float* b, float* c) {
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  auto tile_fn = has_avx2 ? &tile_avx2 : &tile_generic;
  std::vector<float> bpack(size_t(kKC * (kNC + kNR)));
  for (int64_t jc = 0; jc < N; jc += kNC) {
    const int64_t nc = std::min(kNC, N - jc);
    for (int64_t pc = 0; pc < K; pc += kKC) {
      const int64_t kc = std::min(kKC, K - pc);
      pack_b(b + pc * N + jc, N, kc, nc, bpack.data());
#pragma omp parallel
      {
        std::vector<float> apack(size_t(kc * (kMC + kMR)));
        alignas(32) float tile[kMR * kNR];
#pragma omp for schedule(dynamic)
        for (int64_t ic = 0; ic < M; ic += kMC) {
          const int64_t mc = std::min(kMC, M - ic);
          pack_a(a + ic * K + pc, K, mc, kc, apack.data());
          for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
            for (int64_t i0 = 0; i0 < mc; i0 += kMR) {
              tile_fn(kc, apack.data() + (i0 / kMR) * kc * kMR, bpack.data() + (j0 / kNR) * kc * kNR, tile);
              const int64_t h = std::min(kMR, mc - i0), w = std::min(kNR, nc - j0);
              for (int64_t r = 0; r < h; ++r) {
                float* crow = c + (ic + i0 + r) * N + jc + j0;
                const float* trow = tile + r * kNR;
                if (pc == 0)
                  for (int64_t j = 0; j < w; ++j) crow[j] = trow[j];
                else
                  for (int64_t j = 0; j < w; ++j) crow[j] += trow[j];
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace moekit::bench

// CPU matrix products for the layer ops: a dot-product kernel for a few rows (decode: each weight is read
// once) and a register-blocked kernel over packed weight tiles for many rows (prefill). Both are compiled
// twice, for AVX2+FMA and baseline x86-64, and picked at load time.
#include "model/linear_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace moekit::model {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOEKIT_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MOEKIT_MULTIVERSION
#endif

constexpr int64_t kTileN = 16;            // output columns per task (one packed weight tile)
constexpr int64_t kTileM = 64;            // rows per task
constexpr int64_t kPackedMinRows = 4;     // fewer rows: dot products straight over the weights
constexpr int64_t kParallelWork = int64_t(1) << 18;

// y[m, j] = x[m] . w[j] for m < mc, j < nc; w rows of length K.
MOEKIT_MULTIVERSION
void dot_tile(const float* x, int64_t lx, int64_t mc, const float* w, int64_t K, int64_t nc, float* y, int64_t ldy) {
  for (int64_t m = 0; m < mc; ++m) {
    const float* xr = x + m * lx;
    float* yr = y + m * ldy;
    int64_t j = 0;
    for (; j + 4 <= nc; j += 4) {
      const float *w0 = w + j * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
      float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t k = 0; k < K; ++k) {
        const float xv = xr[k];
        a0 += xv * w0[k];
        a1 += xv * w1[k];
        a2 += xv * w2[k];
        a3 += xv * w3[k];
      }
      yr[j] = a0;
      yr[j + 1] = a1;
      yr[j + 2] = a2;
      yr[j + 3] = a3;
    }
    for (; j < nc; ++j) {
      const float* wj = w + j * K;
      float a = 0;
#pragma omp simd reduction(+ : a)
      for (int64_t k = 0; k < K; ++k) a += xr[k] * wj[k];
      yr[j] = a;
    }
  }
}

// y[m, j] = sum_k x[m, k] * wt[k, j] with wt a packed [K, 16] tile (zero columns past nc).
MOEKIT_MULTIVERSION
void packed_tile(const float* x, int64_t lx, int64_t mc, const float* wt, int64_t K, int64_t nc, float* y,
                 int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= mc; m += 4) {
    float acc[4][kTileN] = {};
    const float *x0 = x + m * lx, *x1 = x0 + lx, *x2 = x1 + lx, *x3 = x2 + lx;
    for (int64_t k = 0; k < K; ++k) {
      const float* wk = wt + k * kTileN;
      const float a0 = x0[k], a1 = x1[k], a2 = x2[k], a3 = x3[k];
#pragma omp simd
      for (int64_t j = 0; j < kTileN; ++j) {
        acc[0][j] += a0 * wk[j];
        acc[1][j] += a1 * wk[j];
        acc[2][j] += a2 * wk[j];
        acc[3][j] += a3 * wk[j];
      }
    }
    for (int64_t r = 0; r < 4; ++r) std::memcpy(y + (m + r) * ldy, acc[r], size_t(nc) * sizeof(float));
  }
  for (; m < mc; ++m) {
    float acc[kTileN] = {};
    const float* xr = x + m * lx;
    for (int64_t k = 0; k < K; ++k) {
      const float* wk = wt + k * kTileN;
      const float a = xr[k];
#pragma omp simd
      for (int64_t j = 0; j < kTileN; ++j) acc[j] += a * wk[j];
    }
    std::memcpy(y + m * ldy, acc, size_t(nc) * sizeof(float));
  }
}

void load_rows_f32(const void* w, DType t, int64_t first, int64_t count, int64_t K, float* out) {
  const size_t es = dtype_nbytes(t, 1);
  const char* src = static_cast<const char*>(w) + size_t(first * K) * es;
  if (t == DType::f32) {
    std::memcpy(out, src, size_t(count * K) * sizeof(float));
  } else if (t == DType::bf16) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < count * K; ++i) out[i] = bf16_to_f32(s[i]);
  } else {
    convert(src, t, out, DType::f32, count * K);
  }
}

// wt [K, 16] = rows [first, first + count) of w, transposed, zero-padded to 16 columns.
void pack_tile(const void* w, DType t, int64_t first, int64_t count, int64_t K, std::vector<float>& rows,
               float* wt) {
  rows.resize(size_t(count * K));
  load_rows_f32(w, t, first, count, K, rows.data());
  for (int64_t k = 0; k < K; ++k) {
    float* dst = wt + k * kTileN;
    for (int64_t j = 0; j < count; ++j) dst[j] = rows[size_t(j * K + k)];
    for (int64_t j = count; j < kTileN; ++j) dst[j] = 0.0f;
  }
}

}  // namespace

void linear_cpu(const float* x, int64_t lx, int64_t M, int64_t K, const void* w, DType w_dtype, int64_t N,
                const float* bias, float* y) {
  if (M == 0 || N == 0) return;
  const bool packed = M >= kPackedMinRows;
  const int64_t tiles_n = (N + kTileN - 1) / kTileN, tiles_m = (M + kTileM - 1) / kTileM;
#pragma omp parallel if (M * N * K > kParallelWork)
  {
    std::vector<float> rows, tile;
    if (packed) tile.resize(size_t(K * kTileN));
#pragma omp for collapse(2) schedule(static)
    for (int64_t tn = 0; tn < tiles_n; ++tn) {
      for (int64_t tm = 0; tm < tiles_m; ++tm) {
        const int64_t n0 = tn * kTileN, nc = std::min(N - n0, kTileN);
        const int64_t m0 = tm * kTileM, mc = std::min(M - m0, kTileM);
        float* yt = y + m0 * N + n0;
        if (packed) {
          pack_tile(w, w_dtype, n0, nc, K, rows, tile.data());
          packed_tile(x + m0 * lx, lx, mc, tile.data(), K, nc, yt, N);
        } else if (w_dtype == DType::f32) {
          dot_tile(x + m0 * lx, lx, mc, static_cast<const float*>(w) + n0 * K, K, nc, yt, N);
        } else {
          rows.resize(size_t(nc * K));
          load_rows_f32(w, w_dtype, n0, nc, K, rows.data());
          dot_tile(x + m0 * lx, lx, mc, rows.data(), K, nc, yt, N);
        }
        if (bias)
          for (int64_t m = 0; m < mc; ++m)
            for (int64_t j = 0; j < nc; ++j) yt[m * N + j] += bias[n0 + j];
      }
    }
  }
}

}  // namespace moekit::model

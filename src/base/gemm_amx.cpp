// The bf16 tile on AMX: C tiles of 16 rows x 16 f32 columns accumulate _tile_dpbf16ps(A [16 rows x 32 k],
// B [16 k-pairs x 16 columns x 2]) where B is 1 KiB of a packed panel read in place. A block of up to 32 rows x
// 2 panels keeps four C tiles (tmm0-3), two A tiles (tmm4-5) and two B tiles (tmm6-7). k runs in passes of
// kChunkK so that the two panels' B of one pass stay in L1 over all rows; C goes through memory between passes
// (an exact f32 round trip, so the result does not depend on the pass length). Rows below kAmxMinRows go to the
// AVX512-BF16 tile. Compiled with the avx512 flags plus -mamx-tile -mamx-bf16 -mavx512bf16.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "base/gemm.h"

namespace moekit::cpu {
namespace {

constexpr int64_t kChunkK = 512;  // 2 panels x 512 k x 32 B = 32 KiB of B per pass
constexpr int64_t kAhead = 4;     // B prefetch distance in 32-k steps

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the configuration for row blocks of r0 and r1 (0: none) rows.
void configure(int r0, int r1) {
  TileConfig cfg;
  auto set = [&](int t, int rows) {
    cfg.rows[t] = uint8_t(rows);
    cfg.colsb[t] = rows ? 64 : 0;
  };
  set(0, r0), set(1, r0), set(4, r0);  // C block 0 (2 panels), A block 0
  set(2, r1), set(3, r1), set(5, r1);  // C block 1, A block 1
  set(6, 16), set(7, 16);              // B: 16 k-pairs x 64 B
  _tile_loadconfig(&cfg);
}

// Copies a C panel of `rows` rows and `cols` (< 16) columns into / out of a dense 16 x 16 buffer.
void to_buffer(const float* c, int64_t ldc, int rows, int64_t cols, float* buf) {
  const __mmask16 m = __mmask16((1u << cols) - 1u);
  for (int i = 0; i < rows; ++i) _mm512_store_ps(buf + i * 16, _mm512_maskz_loadu_ps(m, c + i * ldc));
}
void from_buffer(const float* buf, int rows, int64_t cols, float* c, int64_t ldc) {
  const __mmask16 m = __mmask16((1u << cols) - 1u);
  for (int i = 0; i < rows; ++i) _mm512_mask_storeu_ps(c + i * ldc, m, _mm512_load_ps(buf + i * 16));
}

// One block: MB row blocks (16 rows, the last r rows as configured) x NP panels, k in [k0, k1).
// cols0 / cols1: valid columns of the panels (16 = full, read and written in place).
template <int MB, int NP>
void block(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t k0, int64_t k1, float* c,
           int64_t ldc, bool acc, int rows0, int rows1, int64_t cols0, int64_t cols1, bool fetch) {
  alignas(64) float buf[4][256];
  const int64_t sc = ldc * 4, sa = lda * 2;
  float* c0 = c;
  float* c1 = c + 16 * ldc;
  if (acc) {
    // C tile t from c (full panel) or from its buffer.
#define MOEKIT_LOAD_C(t, ptr, rows, cols)         \
  if ((cols) == 16) {                             \
    _tile_loadd(t, ptr, sc);                      \
  } else {                                        \
    to_buffer(ptr, ldc, rows, cols, buf[t]);      \
    _tile_loadd(t, buf[t], 64);                   \
  }
    MOEKIT_LOAD_C(0, c0, rows0, cols0);
    if (NP == 2) { MOEKIT_LOAD_C(1, c0 + 16, rows0, cols1); }
    if (MB == 2) {
      MOEKIT_LOAD_C(2, c1, rows1, cols0);
      if (NP == 2) { MOEKIT_LOAD_C(3, c1 + 16, rows1, cols1); }
    }
#undef MOEKIT_LOAD_C
  } else {
    _tile_zero(0);
    if (NP == 2) _tile_zero(1);
    if (MB == 2) {
      _tile_zero(2);
      if (NP == 2) _tile_zero(3);
    }
  }
  for (int64_t k = k0; k < k1; k += 32) {
    // The first row block of a pass reads B from memory: fetch its tiles kAhead steps ahead.
    if (fetch && k + kAhead * 32 < k1) {
      const char* p0 = reinterpret_cast<const char*>(b0 + (k + kAhead * 32) * 16);
      for (int l = 0; l < 1024; l += 64) _mm_prefetch(p0 + l, _MM_HINT_T0);
      if (NP == 2) {
        const char* p1 = reinterpret_cast<const char*>(b1 + (k + kAhead * 32) * 16);
        for (int l = 0; l < 1024; l += 64) _mm_prefetch(p1 + l, _MM_HINT_T0);
      }
    }
    _tile_loadd(6, b0 + k * 16, 64);
    if (NP == 2) _tile_loadd(7, b1 + k * 16, 64);
    _tile_loadd(4, a + k, sa);
    if (MB == 2) _tile_loadd(5, a + 16 * lda + k, sa);
    _tile_dpbf16ps(0, 4, 6);
    if (NP == 2) _tile_dpbf16ps(1, 4, 7);
    if (MB == 2) {
      _tile_dpbf16ps(2, 5, 6);
      if (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
#define MOEKIT_STORE_C(t, ptr, rows, cols)      \
  if ((cols) == 16) {                           \
    _tile_stored(t, ptr, sc);                   \
  } else {                                      \
    _tile_stored(t, buf[t], 64);                \
    from_buffer(buf[t], rows, cols, ptr, ldc);  \
  }
  MOEKIT_STORE_C(0, c0, rows0, cols0);
  if (NP == 2) { MOEKIT_STORE_C(1, c0 + 16, rows0, cols1); }
  if (MB == 2) {
    MOEKIT_STORE_C(2, c1, rows1, cols0);
    if (NP == 2) { MOEKIT_STORE_C(3, c1 + 16, rows1, cols1); }
  }
#undef MOEKIT_STORE_C
}

}  // namespace

void gemm_bf16_tile_amx(const uint16_t* a, int64_t lda, int64_t m, const PackedBf16& w, int64_t n0, int64_t n1,
                        float* c, int64_t ldc) {
  if (m < kAmxMinRows || w.kp == 0) {
    gemm_bf16_tile_avx512bf16(a, lda, m, w, n0, n1, c, ldc);
    return;
  }
  if (n1 <= n0) return;
  const int64_t panel_stride = w.kp * 16, panels = (n1 - n0 + 15) / 16;
  const uint16_t* b = w.data + (n0 / 16) * panel_stride;
  float* cb = c + n0;
  int cfg0 = -1, cfg1 = -1;
  // One row block reads each B tile once: no reuse to keep in L1, so all of k in one pass.
  const int64_t chunk = m <= 32 ? w.kp : kChunkK;
  for (int64_t k0 = 0; k0 < w.kp; k0 += chunk) {
    const int64_t k1 = k0 + chunk < w.kp ? k0 + chunk : w.kp;
    const bool acc = k0 > 0;
    for (int64_t p = 0; p < panels; p += 2) {
      const bool two = p + 1 < panels;
      const int64_t cols0 = p + 1 == panels ? n1 - n0 - p * 16 : 16;
      const int64_t cols1 = two ? (p + 2 == panels ? n1 - n0 - (p + 1) * 16 : 16) : 0;
      const uint16_t* b0 = b + p * panel_stride;
      const uint16_t* b1 = b0 + panel_stride;
      for (int64_t i = 0; i < m; i += 32) {
        const int64_t left = m - i;
        const int r0 = left >= 16 ? 16 : int(left), r1 = left >= 32 ? 16 : (left > 16 ? int(left - 16) : 0);
        if (r0 != cfg0 || r1 != cfg1) configure(r0, r1), cfg0 = r0, cfg1 = r1;
        const uint16_t* ai = a + i * lda;
        float* ci = cb + i * ldc + p * 16;
        if (r1 > 0) {
          if (two) block<2, 2>(ai, lda, b0, b1, k0, k1, ci, ldc, acc, r0, r1, cols0, cols1, i == 0);
          else block<2, 1>(ai, lda, b0, b1, k0, k1, ci, ldc, acc, r0, r1, cols0, cols1, i == 0);
        } else {
          if (two) block<1, 2>(ai, lda, b0, b1, k0, k1, ci, ldc, acc, r0, r1, cols0, cols1, i == 0);
          else block<1, 1>(ai, lda, b0, b1, k0, k1, ci, ldc, acc, r0, r1, cols0, cols1, i == 0);
        }
      }
    }
  }
  _tile_release();
}

}  // namespace moekit::cpu

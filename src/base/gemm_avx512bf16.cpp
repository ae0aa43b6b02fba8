// The bf16 tile on AVX512-BF16: vdpbf16ps multiplies a broadcast pair of A (two consecutive k of one row) by one
// k-pair of a packed panel (16 columns x 2) and adds both products into 16 f32 lanes. Compiled with the avx512
// flags plus -mavx512bf16.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>

#include "base/env.h"
#include "base/gemm.h"

namespace moekit::cpu {
namespace {

constexpr int kMR = 6, kNP = 4;  // register block: 6 rows x 4 panels = 24 accumulators of 32 zmm
constexpr int64_t kChunkPairs = 128;  // k pairs per pass: 4 panels x 128 pairs x 64 B = 32 KiB of B in L1
// B prefetch distance (k pairs = cache lines of a panel) when few rows share the weights: 32 (2 KiB per panel, 4
// panels read in lockstep), the best variant of the bench's read test on the 16-core host (4 streams, 2 KiB ahead:
// 142.7 GB/s, where the experts' decode reads reached 115-121 GB/s with 16 pairs, 1 KiB, ahead). MOEKIT_BF16_AHEAD=N
// (1 to 256) sets it for A/B runs.
const int64_t kAhead = env_int_in("MOEKIT_BF16_AHEAD", 1, 256, 32);
// Panels read in lockstep at decode sizes (up to 2 kMR8 rows): 8 (the read test's best pattern on the 16-core
// host: 8 streams per thread, 145 GB/s) or 4 (the former order, kNP panels for every row count: 111-119 GB/s in the
// experts' decode cells there). MOEKIT_BF16_STREAMS=4|8 sets it for A/B runs.
constexpr int kMR8 = 3;            // 3 rows x 8 panels = 24 accumulators
constexpr int64_t kChunk8 = 32;    // k pairs per chunk for 4-6 rows: 8 panels x 32 pairs x 64 B = 16 KiB in L1
const int kStreams = env_int("MOEKIT_BF16_STREAMS", 8) == 4 ? 4 : 8;

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

inline __mmask16 cols_mask(int64_t cols) { return cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1u); }

// C[MR, NP panels] (acc ? += : =) A[MR, pairs q0..q1) x B; `last` masks the columns of the last panel. B is
// prefetched kAhead pairs ahead while that stays below pair pf_end (q1, or the panels' end when the pass over this
// chunk streams them for the row blocks after it).
template <int MR, int NP>
inline void micro(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel_stride, int64_t q0, int64_t q1,
                  int64_t pf_end, float* c, int64_t ldc, bool acc, __mmask16 last) {
  __m512 s[MR][NP];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NP; ++v)
      s[i][v] = acc ? _mm512_maskz_loadu_ps(v == NP - 1 ? last : __mmask16(0xFFFF), c + i * ldc + v * 16)
                    : _mm512_setzero_ps();
  for (int64_t q = q0; q < q1; ++q) {
    // Fetch each panel kAhead pairs (cache lines) ahead: at decode sizes (every row count up to kMR, one pass over
    // all of k) the weights stream from memory; in later row blocks the lines are in L1 already and the prefetch is
    // cheap beside the MR x NP dot products.
    if (q + kAhead < pf_end) {
#pragma GCC unroll 8
      for (int v = 0; v < NP; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(b + v * panel_stride + (q + kAhead) * 32), _MM_HINT_T0);
    }
    __m512bh bv[NP];
#pragma GCC unroll 8
    for (int v = 0; v < NP; ++v) bv[v] = as_bh(_mm512_loadu_si512(b + v * panel_stride + q * 32));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      __builtin_memcpy(&pair, a + i * lda + 2 * q, 4);
      const __m512bh av = as_bh(_mm512_set1_epi32(pair));
#pragma GCC unroll 8
      for (int v = 0; v < NP; ++v) s[i][v] = _mm512_dpbf16_ps(s[i][v], av, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NP; ++v)
      _mm512_mask_storeu_ps(c + i * ldc + v * 16, v == NP - 1 ? last : __mmask16(0xFFFF), s[i][v]);
}

template <int MR>
void micro_np(int64_t np, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel_stride, int64_t q0,
              int64_t q1, int64_t pf_end, float* c, int64_t ldc, bool acc, __mmask16 last) {
  if constexpr (MR <= kMR8) {  // more than kNP panels only here (row blocks of at most kMR8 rows)
    switch (np) {
      case 8: micro<MR, 8>(a, lda, b, panel_stride, q0, q1, pf_end, c, ldc, acc, last); return;
      case 7: micro<MR, 7>(a, lda, b, panel_stride, q0, q1, pf_end, c, ldc, acc, last); return;
      case 6: micro<MR, 6>(a, lda, b, panel_stride, q0, q1, pf_end, c, ldc, acc, last); return;
      case 5: micro<MR, 5>(a, lda, b, panel_stride, q0, q1, pf_end, c, ldc, acc, last); return;
      default: break;
    }
  }
  switch (np) {
    case 4: micro<MR, 4>(a, lda, b, panel_stride, q0, q1, pf_end, c, ldc, acc, last); break;
    case 3: micro<MR, 3>(a, lda, b, panel_stride, q0, q1, pf_end, c, ldc, acc, last); break;
    case 2: micro<MR, 2>(a, lda, b, panel_stride, q0, q1, pf_end, c, ldc, acc, last); break;
    default: micro<MR, 1>(a, lda, b, panel_stride, q0, q1, pf_end, c, ldc, acc, last); break;
  }
}

}  // namespace

void gemm_bf16_tile_avx512bf16(const uint16_t* a, int64_t lda, int64_t m, const PackedBf16& w, int64_t n0, int64_t n1,
                               float* c, int64_t ldc) {
  if (m <= 0 || n1 <= n0) return;
  const int64_t panel_stride = w.kp * 16, panels = (n1 - n0 + 15) / 16, last_cols = n1 - n0 - (panels - 1) * 16;
  const uint16_t* b = w.data + (n0 / 16) * panel_stride;
  float* cb = c + n0;
  const int64_t pairs = w.kp / 2;
  if (pairs == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n1 - n0; ++j) cb[i * ldc + j] = 0.0f;
    return;
  }
  if (kStreams == 8 && m <= 2 * kMR8) {
    // Decode sizes, kStreams panels at once: up to kMR8 rows in one pass over all of k (each panel read once, a
    // sequential stream); up to 2 kMR8 rows in two row blocks per chunk of kChunk8 pairs, the first streaming the
    // panels (prefetched across its chunks' ends) and the second reading them from L1.
    const int64_t chunk = m <= kMR8 ? pairs : kChunk8;
    for (int64_t p = 0; p < panels; p += kStreams) {
      const int64_t np = panels - p < kStreams ? panels - p : kStreams;
      const __mmask16 last = cols_mask(p + np == panels ? last_cols : 16);
      const uint16_t* bp = b + p * panel_stride;
      for (int64_t q0 = 0; q0 < pairs; q0 += chunk) {
        const int64_t q1 = q0 + chunk < pairs ? q0 + chunk : pairs;
        for (int64_t i = 0; i < m; i += kMR8) {
          const uint16_t* ai = a + i * lda;
          float* ci = cb + i * ldc + p * 16;
          const int64_t pf_end = i == 0 ? pairs : q1;
          switch (m - i < kMR8 ? m - i : kMR8) {
            case 3: micro_np<3>(np, ai, lda, bp, panel_stride, q0, q1, pf_end, ci, ldc, q0 > 0, last); break;
            case 2: micro_np<2>(np, ai, lda, bp, panel_stride, q0, q1, pf_end, ci, ldc, q0 > 0, last); break;
            default: micro_np<1>(np, ai, lda, bp, panel_stride, q0, q1, pf_end, ci, ldc, q0 > 0, last); break;
          }
        }
      }
    }
    return;
  }
  // One row block reads each panel once: all of k in one pass, each panel a sequential stream.
  const int64_t chunk = m <= kMR ? pairs : kChunkPairs;
  for (int64_t q0 = 0; q0 < pairs; q0 += chunk) {
    const int64_t q1 = q0 + chunk < pairs ? q0 + chunk : pairs;
    const bool acc = q0 > 0;
    for (int64_t p = 0; p < panels; p += kNP) {  // a block of panels stays in L1 over all rows
      const int64_t np = panels - p < kNP ? panels - p : kNP;
      const __mmask16 last = cols_mask(p + np == panels ? last_cols : 16);
      const uint16_t* bp = b + p * panel_stride;
      for (int64_t i = 0; i < m; i += kMR) {
        const uint16_t* ai = a + i * lda;
        float* ci = cb + i * ldc + p * 16;
        switch (m - i < kMR ? m - i : kMR) {
          case 6: micro_np<6>(np, ai, lda, bp, panel_stride, q0, q1, q1, ci, ldc, acc, last); break;
          case 5: micro_np<5>(np, ai, lda, bp, panel_stride, q0, q1, q1, ci, ldc, acc, last); break;
          case 4: micro_np<4>(np, ai, lda, bp, panel_stride, q0, q1, q1, ci, ldc, acc, last); break;
          case 3: micro_np<3>(np, ai, lda, bp, panel_stride, q0, q1, q1, ci, ldc, acc, last); break;
          case 2: micro_np<2>(np, ai, lda, bp, panel_stride, q0, q1, q1, ci, ldc, acc, last); break;
          default: micro_np<1>(np, ai, lda, bp, panel_stride, q0, q1, q1, ci, ldc, acc, last); break;
        }
      }
    }
  }
}

}  // namespace moekit::cpu

namespace moekit::cpu {
namespace {

// f32 bits -> bf16 bits (round to nearest even, NaN made quiet), as f32_to_bf16, in the low 16 bits of each lane.
inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                           _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)))),
      16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
}
inline __m512 from_bf16_bits(__m512i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)); }

// exp(x) in f32 within about 2 ulp of expf: x = n ln 2 + r (|r| <= ln 2 / 2, ln 2 in two parts), a degree-7 polynomial
// for exp(r), times 2^n by vscalefps (inf above 88.72, subnormals and 0 below -87.3); x clamped to [-104, 89] first
// (the result is 0 or inf past either end); NaN stays NaN.
inline __m512 exp_ps(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 e = _mm512_scalef_ps(y, n);
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

}  // namespace

void silu_mul_bf16_row_avx512(const float* h, int64_t I, uint16_t* out) {
  for (int64_t j = 0; j < I; j += 16) {
    const __mmask16 m = I - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (I - j)) - 1u);
    const __m512 g = from_bf16_bits(bf16_bits(_mm512_maskz_loadu_ps(m, h + j)));
    const __m512 u = from_bf16_bits(bf16_bits(_mm512_maskz_loadu_ps(m, h + I + j)));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    const __m512 prod = _mm512_mul_ps(from_bf16_bits(bf16_bits(s)), u);
    _mm256_mask_storeu_epi16(out + j, m, _mm512_cvtepi32_epi16(bf16_bits(prod)));
  }
}


void round_bf16_in_place_avx512(float* x, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    _mm512_mask_storeu_ps(x + j, m, from_bf16_bits(bf16_bits(_mm512_maskz_loadu_ps(m, x + j))));
  }
}

void add_bf16_products_avx512(float* acc, const float* y, float w, int64_t n) {
  const __m512 wv = _mm512_set1_ps(w);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    const __m512 prod = from_bf16_bits(bf16_bits(_mm512_mul_ps(wv, _mm512_maskz_loadu_ps(m, y + j))));
    _mm512_mask_storeu_ps(acc + j, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + j), prod));
  }
}

}  // namespace moekit::cpu

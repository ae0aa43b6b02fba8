// The bf16 tile on AMX: C tiles of 16 rows x 16 f32 columns accumulate _tile_dpbf16ps(A [16 rows x 32 k],
// B [16 k-pairs x 16 columns x 2]) where B is 1 KiB of a packed panel read in place. A block of up to 32 rows x
// 2 panels keeps four C tiles (tmm0-3), two A tiles (tmm4-5) and two B tiles (tmm6-7) over all of k: C stays in
// the tile registers (no round trips through memory), A and the two panels' B come from L2 (the first row block of
// a panel pair reads B from memory, fetched further ahead). Rows below kAmxMinRows go to the AVX512-BF16 tile.
// Compiled with the avx512 flags plus -mamx-tile -mamx-bf16 -mavx512bf16 -mavx512vbmi.
//
// Also the FP8 tile of the amx ISA: gemm_fp8_kernels.h with e4m3 decoded by two 128-entry byte tables (vpermi2b,
// AVX512-VBMI, which every AMX CPU has) straight into the top bytes of f64 lanes: the same values as the f16 route
// of gemm_avx512.cpp, so the same bits, in about a third of the instructions.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "base/env.h"
#include "base/gemm.h"

namespace moekit::cpu {
namespace {

constexpr int64_t kAhead = 2;     // B prefetch distance in 32-k steps (B in L2)
// The same for the first row block of a panel pair, whose B comes from memory: 8 steps (16 KiB of the pair);
// MOEKIT_AMX_AHEAD_MEM=N (1 to 64) sets it for A/B runs.
const int64_t kAheadMem = env_int_in("MOEKIT_AMX_AHEAD_MEM", 1, 64, 8);
constexpr int64_t kAmxOverlapRows = 24;  // from this many rows on, the overlapped order (gemm_bf16_tile_amx)
// MOEKIT_AMX_C_PREFETCH=0: no prefetch of the next block's C for writing (measurement switch).
const bool g_amx_c_prefetch = env_int_in("MOEKIT_AMX_C_PREFETCH", 0, 1, 1) != 0;

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
  asm volatile("" : : "r"(&cfg) : "memory");  // the stores above before ldtilecfg (its operand's type hides them)
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
// Prefetch into L2 while the block runs: `lines` cache lines per 32-k step from `pf` on, up to `pf_end` (the weights
// of the next panel pair, streamed from memory under the arithmetic of this one).
struct L2Prefetch {
  const char* pf = nullptr;  // the current range, then `next` (up to next_end)
  const char* pf_end = nullptr;
  const char* next = nullptr;
  const char* next_end = nullptr;
  int64_t lines = 0;
};

// cnext: the C rows of the next block (32 rows x 2 panels, `cnext_rows` of them), fetched for writing while this
// block runs, so that its tile stores do not wait on reads for ownership (nullptr: none).
template <int MB, int NP>
void block(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t k0, int64_t k1, float* c,
           int64_t ldc, bool acc, int rows0, int rows1, int64_t cols0, int64_t cols1, int64_t ahead, L2Prefetch l2,
           const float* cnext = nullptr, int cnext_rows = 0) {
  const int64_t steps = std::max<int64_t>(1, (k1 - k0) / 32);
  const int64_t c_rows_per_step = (cnext_rows + steps - 1) / steps;
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
    // The B tiles `ahead` steps on, into L1.
    if (k + ahead * 32 < k1) {
      const char* p0 = reinterpret_cast<const char*>(b0 + (k + ahead * 32) * 16);
      for (int l = 0; l < 1024; l += 64) _mm_prefetch(p0 + l, _MM_HINT_T0);
      if (NP == 2) {
        const char* p1 = reinterpret_cast<const char*>(b1 + (k + ahead * 32) * 16);
        for (int l = 0; l < 1024; l += 64) _mm_prefetch(p1 + l, _MM_HINT_T0);
      }
    }
    for (int64_t l = 0; l < l2.lines; ++l, l2.pf += 64) {
      if (l2.pf >= l2.pf_end) {
        if (l2.next >= l2.next_end) break;
        l2.pf = l2.next, l2.pf_end = l2.next_end, l2.next = l2.next_end;
      }
      _mm_prefetch(l2.pf, _MM_HINT_T1);
    }
    if (cnext) {
      const int64_t s0 = (k - k0) / 32 * c_rows_per_step, s1 = std::min<int64_t>(cnext_rows, s0 + c_rows_per_step);
      for (int64_t r = s0; r < s1; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(cnext + r * ldc), _MM_HINT_ET0);
        _mm_prefetch(reinterpret_cast<const char*>(cnext + r * ldc + 16), _MM_HINT_ET0);
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

namespace amx_fp8 {

// The f64 bits of e4m3 magnitude c times 2^-8 have only their top 16 bits set (4 significant bits): byte 7 and byte
// 6 of the f64, as two 128-entry tables of bytes (c = 0: +0).
struct Fp8Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
};
constexpr Fp8Tables make_tables() {
  Fp8Tables t{};
  for (int c = 0; c < 128; ++c) {
    const int e = c >> 3, m = c & 7;
    uint64_t bits = 0;
    if (c != 0) {
      // value = (8 + m) * 2^(e - 1) * 2^-17 (normal) or m * 2^-17 (subnormal): normalise the integer part.
      int64_t mant = e == 0 ? m : 8 + m;
      int exp2 = (e == 0 ? 0 : e - 1) - 17;
      int top = 0;
      while ((mant >> (top + 1)) != 0) ++top;        // mant in [2^top, 2^(top + 1))
      const uint64_t frac = uint64_t(mant - (int64_t(1) << top)) << (52 - top);
      bits = (uint64_t(exp2 + top + 1023) << 52) | frac;
    }
    t.hi[c] = uint8_t(bits >> 56);
    t.lo[c] = uint8_t(bits >> 48);
  }
  return t;
}
constexpr Fp8Tables kTables = make_tables();

// Output byte 8i + 6 <- lo byte i (index i), 8i + 7 <- hi byte i (index 64 + i): spread[0] for bytes 0-7,
// spread[1] for bytes 8-15.
struct Spread {
  alignas(64) uint8_t idx[2][64];
};
constexpr Spread make_spread() {
  Spread s{};
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 8; ++i) s.idx[h][8 * i + 6] = uint8_t(8 * h + i), s.idx[h][8 * i + 7] = uint8_t(64 + 8 * h + i);
  return s;
}
constexpr Spread kSpread = make_spread();
constexpr __mmask64 kTopBytes = 0xC0C0C0C0C0C0C0C0ull;

// 16 e4m3 bytes at src -> two vectors of 8 f64 (value times 2^-8). The table loads are loop invariants.
inline void decode16(const uint8_t* src, __m512d* out) {
  const __m512i b = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i hi = _mm512_ternarylogic_epi32(
      _mm512_permutex2var_epi8(_mm512_load_si512(kTables.hi), b, _mm512_load_si512(kTables.hi + 64)), b,
      _mm512_set1_epi8(int8_t(0x80)), 0xF8);  // hi | (b & 0x80): the sign
  const __m512i lo =
      _mm512_permutex2var_epi8(_mm512_load_si512(kTables.lo), b, _mm512_load_si512(kTables.lo + 64));
  out[0] = _mm512_castsi512_pd(_mm512_maskz_permutex2var_epi8(kTopBytes, lo, _mm512_load_si512(kSpread.idx[0]), hi));
  out[1] = _mm512_castsi512_pd(_mm512_maskz_permutex2var_epi8(kTopBytes, lo, _mm512_load_si512(kSpread.idx[1]), hi));
}

inline int64_t f8_decode_run(const uint8_t* src, int64_t n, double* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512d v[2];
    decode16(src + i, v);
    _mm512_storeu_pd(dst + i, v[0]);
    _mm512_storeu_pd(dst + i + 8, v[1]);
  }
  return i;
}

typedef double F8D __attribute__((vector_size(64)));
inline void f8_decode16(const uint8_t* src, F8D* out) {
  __m512d v[2];
  decode16(src, v);
  out[0] = F8D(v[0]);
  out[1] = F8D(v[1]);
}

constexpr int kF8L = 8, kF8MR = 4, kF8NR = 4;
#include "base/gemm_fp8_kernels.h"

}  // namespace amx_fp8

namespace amx_fp8 {

// The block scales of weight rows j0 .. j0 + kF8NR (rows past n1 repeat j0's), times `unit`, as [kF8NR, kblocks].
inline void block_scales(const Fp8Matrix& w, int64_t j0, int64_t n1, int64_t kblocks, double unit, double* wsc) {
  const int64_t seg_blocks = (w.seg + kFp8K - 1) / kFp8K;
  for (int j = 0; j < kF8NR; ++j) {
    const int64_t row = j0 + j < n1 ? j0 + j : j0;
    const int64_t srow = (row / w.seg) * seg_blocks + (row % w.seg) / kFp8K;
    for (int64_t kb = 0; kb < kblocks; ++kb) wsc[j * kblocks + kb] = double(w.scales[srow * kblocks + kb]) * unit;
  }
}

// The 64 weight bytes at kk of a row of K bytes: in place (prefetching the same bytes 4 rows on), or the row's last
// bytes zero-padded into `tail` (never read past the row).
inline const uint8_t* chunk64(const uint8_t* row, int64_t kk, int64_t K, uint8_t* tail) {
  if (kk + 64 <= K) {
    _mm_prefetch(reinterpret_cast<const char*>(row + kk + 4 * K), _MM_HINT_T0);
    return row + kk;
  }
  for (int d = 0; d < 64; ++d) tail[d] = kk + d < K ? row[kk + d] : 0;
  return tail;
}

// Decode-sized row counts (m <= kF8MR): the weights stream from memory once, so the decode is the cost. A normal
// e4m3 byte b (exponent field 1-15) times 2^-8 has f64 bits sign(b) << 63 | 0x3F << 56 | (b & 0x7f) << 49: the
// byte sign-extended to 64 bits (vpmovsxbq), shifted by 49, masked and or'ed with the exponent's top bits, three
// instructions for 8 weights. 64 bytes of a row at a time; a chunk holding a zero or a subnormal (exponent field
// 0; rare in real weights) goes through the byte tables instead. Values, sums and the order of the scaled block
// sums are those of f8_rows_direct: the same bits.
inline void decode64(const uint8_t* src, __m512d* out) {
  const __m512i bytes = _mm512_loadu_si512(src);
  if (_mm512_testn_epi8_mask(bytes, _mm512_set1_epi8(0x78)) != 0) {
    for (int q = 0; q < 4; ++q) decode16(src + 16 * q, out + 2 * q);
    return;
  }
  const __m512i keep = _mm512_set1_epi64(int64_t(0x80FE000000000000ull)),
                expo = _mm512_set1_epi64(int64_t(0x3F00000000000000ull));
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    const __m512i x = _mm512_slli_epi64(
        _mm512_cvtepi8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * q))), 49);
    out[q] = _mm512_castsi512_pd(_mm512_ternarylogic_epi64(x, keep, expo, 0xEA));  // (x & keep) | expo
  }
}

template <int R>
void rows_fast(const double* a, int64_t lda, const float* sa, int64_t ldsa, const Fp8Matrix& w, int64_t j0,
               int64_t cols, const double* wsc, int64_t kblocks, float* c, int64_t ldc) {
  constexpr int NR = kF8NR, NA = R == 1 ? 2 : 1;  // one row: two accumulators per weight row (FMA latency)
  const int64_t K = w.k;
  double tot[R][NR];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) tot[i][j] = 0.0;
  const uint8_t* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = w.data + (j0 + (j < cols ? j : 0)) * K;  // rows past cols: discarded
  alignas(64) uint8_t tail[64];
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    __m512d acc[R][NR][NA];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
        for (int h = 0; h < NA; ++h) acc[i][j][h] = _mm512_setzero_pd();
    const int64_t k0 = kb * kFp8K, k1 = k0 + kFp8K < K ? k0 + kFp8K : K;
    for (int64_t kk = k0; kk < k1; kk += 64) {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        __m512d wv[8];
        decode64(chunk64(rows[j], kk, K, tail), wv);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
          for (int v = 0; v < 8; ++v)
            acc[i][j][v % NA] = _mm512_fmadd_pd(_mm512_loadu_pd(a + i * lda + kk + 8 * v), wv[v], acc[i][j][v % NA]);
      }
    }
    for (int i = 0; i < R; ++i) {
      const double s = double(sa[i * ldsa + kb]);
      for (int j = 0; j < NR; ++j) {
        __m512d sum = acc[i][j][0];
        if (NA == 2) sum = _mm512_add_pd(sum, acc[i][j][NA - 1]);  // exact: integers times 2^-17 below 2^53
        tot[i][j] += f8_hsum(F8D(sum)) * (s * wsc[j * kblocks + kb]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t j = 0; j < cols; ++j) c[i * ldc + j] = float(tot[i][j]);
}

}  // namespace amx_fp8

void gemm_fp8_tile_amx(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m, const Fp8Matrix& w,
                       int64_t n0, int64_t n1, float* c, int64_t ldc, double* work) {
  using namespace amx_fp8;
  if (m > kF8MR || m <= 0 || n1 <= n0) {
    gemm_fp8_tile(a, lda, sa, ldsa, m, w, n0, n1, c, ldc, work);
    return;
  }
  const int64_t kp = fp8_row_k(w.k), kblocks = kp / kFp8K;
  double* wsc = work + kFp8MaxNR * kp;  // [kF8NR, kblocks]: weight block scales times 2^-1, as gemm_fp8_tile
  for (int64_t j0 = n0; j0 < n1; j0 += kF8NR) {
    const int64_t cols = n1 - j0 < kF8NR ? n1 - j0 : kF8NR;
    block_scales(w, j0, n1, kblocks, 0.5, wsc);
    float* cj = c + j0;
    switch (m) {
      case 1: rows_fast<1>(a, lda, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
      case 2: rows_fast<2>(a, lda, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
      case 3: rows_fast<3>(a, lda, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
      default: rows_fast<4>(a, lda, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
    }
  }
}

namespace amx_fp8 {

// bf16 bits of e4m3 magnitude c (the value itself: every e4m3 value is a normal bf16), as byte tables.
constexpr Fp8Tables make_bf16_tables() {
  Fp8Tables t{};
  for (int c = 1; c < 128; ++c) {
    const int e = c >> 3, m = c & 7;
    int mant = e == 0 ? m : 8 + m;                // value = mant * 2^(exp2)
    int exp2 = (e == 0 ? 1 : e) - 1 - 9;
    int top = 0;
    while ((mant >> (top + 1)) != 0) ++top;
    const uint32_t frac = uint32_t(mant - (1 << top)) << (7 - top);  // 7 bf16 fraction bits
    const uint32_t bits = (uint32_t(exp2 + top + 127) << 7) | frac;
    t.hi[c] = uint8_t(bits >> 8);
    t.lo[c] = uint8_t(bits);
  }
  return t;
}
constexpr Fp8Tables kBf16Tables = make_bf16_tables();
struct Interleave {
  alignas(64) uint8_t idx[2][64];
};
constexpr Interleave make_interleave() {  // word i of half h: lo byte 32h + i (index), hi byte (64 + index)
  Interleave s{};
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 32; ++i) s.idx[h][2 * i] = uint8_t(32 * h + i), s.idx[h][2 * i + 1] = uint8_t(64 + 32 * h + i);
  return s;
}
constexpr Interleave kInterleave = make_interleave();

// 64 e4m3 bytes -> two vectors of 32 bf16 (the values, in order).
inline void decode64_bf16(const uint8_t* src, __m512i* out) {
  const __m512i b = _mm512_loadu_si512(src);
  const __m512i hi = _mm512_ternarylogic_epi32(
      _mm512_permutex2var_epi8(_mm512_load_si512(kBf16Tables.hi), b, _mm512_load_si512(kBf16Tables.hi + 64)), b,
      _mm512_set1_epi8(int8_t(0x80)), 0xF8);  // hi | (b & 0x80): the sign
  const __m512i lo =
      _mm512_permutex2var_epi8(_mm512_load_si512(kBf16Tables.lo), b, _mm512_load_si512(kBf16Tables.lo + 64));
  out[0] = _mm512_permutex2var_epi8(lo, _mm512_load_si512(kInterleave.idx[0]), hi);
  out[1] = _mm512_permutex2var_epi8(lo, _mm512_load_si512(kInterleave.idx[1]), hi);
}

template <int R>
void rows_f32(const uint16_t* a, int64_t kp, const float* sa, int64_t ldsa, const Fp8Matrix& w, int64_t j0,
              int64_t cols, const double* wsc, int64_t kblocks, float* c, int64_t ldc) {
  constexpr int NR = kF8NR;
  const int64_t K = w.k;
  double tot[R][NR];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) tot[i][j] = 0.0;
  const uint8_t* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = w.data + (j0 + (j < cols ? j : 0)) * K;  // rows past cols: discarded
  alignas(64) uint8_t tail[64];
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    __m512 acc[R][NR];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    const int64_t k0 = kb * kFp8K, k1 = k0 + kFp8K < K ? k0 + kFp8K : K;
    for (int64_t kk = k0; kk < k1; kk += 64) {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        __m512i wv[2];
        decode64_bf16(chunk64(rows[j], kk, K, tail), wv);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
          for (int v = 0; v < 2; ++v)
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_loadu_si512(a + i * kp + kk + 32 * v),
                                         (__m512bh)wv[v]);
      }
    }
    for (int i = 0; i < R; ++i) {
      const double s = double(sa[i * ldsa + kb]);
      for (int j = 0; j < NR; ++j) tot[i][j] += double(_mm512_reduce_add_ps(acc[i][j])) * (s * wsc[j * kblocks + kb]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t j = 0; j < cols; ++j) c[i * ldc + j] = float(tot[i][j]);
}

}  // namespace amx_fp8

void gemm_fp8_f32_tile_amx(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m, const Fp8Matrix& w,
                           int64_t n0, int64_t n1, float* c, int64_t ldc, double* work) {
  using namespace amx_fp8;
  if (m > kFp8F32MaxRows || m <= 0 || n1 <= n0) {
    gemm_fp8_tile(a, lda, sa, ldsa, m, w, n0, n1, c, ldc, work);
    return;
  }
  const int64_t kp = fp8_row_k(w.k), kblocks = kp / kFp8K;
  // work: the activation rows as bf16 (exact: e4m3 times 2^9) [m, kp], then the scales as gemm_fp8_tile keeps them.
  auto* ab = reinterpret_cast<uint16_t*>(work);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t k = 0; k < kp; k += 8) {
      const __m256i f = _mm256_castps_si256(_mm512_cvtpd_ps(_mm512_loadu_pd(a + i * lda + k)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ab + i * kp + k), _mm256_cvtepi32_epi16(_mm256_srli_epi32(f, 16)));
    }
  double* wsc = work + kFp8MaxNR * kp;  // [kF8NR, kblocks]: weight block scales times 2^-9 (the activations' unit)
  for (int64_t j0 = n0; j0 < n1; j0 += kF8NR) {
    const int64_t cols = n1 - j0 < kF8NR ? n1 - j0 : kF8NR;
    block_scales(w, j0, n1, kblocks, 0x1p-9, wsc);
    float* cj = c + j0;
    switch (m) {
      case 1: rows_f32<1>(ab, kp, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
      case 2: rows_f32<2>(ab, kp, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
      case 3: rows_f32<3>(ab, kp, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
      default: rows_f32<4>(ab, kp, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
    }
  }
}

namespace {
std::atomic<int> g_amx_overlap{-1};
}  // namespace

void set_amx_overlap(int order) { g_amx_overlap.store(order >= 0 && order <= 2 ? order : -1, std::memory_order_relaxed); }

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
  const int64_t kp = w.kp;
  // Two orders. The single pass (overlap 0): per panel pair, row blocks of 32 over all of k; the first reads the
  // pair's B from memory (prefetched kAheadMem steps ahead into L1), the others from L2. The overlapped order: k in
  // chunks whose rows of A and two panel pairs fit in half of a core's L2 (C accumulates in place over the chunks),
  // and the next panel pair (or the next chunk's first) streamed into L2 while the current one runs, spread evenly
  // over the k steps of every row block (overlap 2) or of the row blocks after the first (overlap 1), so that the
  // memory reads run under the arithmetic and each pair finds its B in L2. On the 16-core host (16 threads, bf16):
  // overlap 2 took qwen3-30b-a3b at 32 rows per expert from 14.8 to 12.9 ms, at 128 rows from 41.7 to 31.6 ms
  // (overlap 1: 13.9, 36.3), but deepseek-v3 at 16-21 rows (k = 7168, bound by the memory stream, each B tile used
  // once) from 158 to 184 ms. So by default: overlap 2 from kAmxOverlapRows rows on, the single pass below.
  // MOEKIT_AMX_OVERLAP=0, 1 or 2 forces one for every call (A/B runs).
  // set_amx_overlap (the bench's peak, which takes the best order) before MOEKIT_AMX_OVERLAP.
  static const int forced = int(env_int_in("MOEKIT_AMX_OVERLAP", 0, 2, -1));
  const int set = g_amx_overlap.load(std::memory_order_relaxed);
  const int overlap = set >= 0 ? set : forced >= 0 ? forced : (m >= kAmxOverlapRows ? 2 : 0);
  const int64_t row_blocks = (m + 31) / 32;
  // MOEKIT_AMX_KC=N (k per chunk, 32 to 65536) sets the overlapped order's chunk for A/B runs: short chunks keep a
  // panel pair's chunk in L1 over the row blocks (C accumulated in place across chunks).
  static const int64_t kc_forced = env_int_in("MOEKIT_AMX_KC", 32, 65536, 0) / 32 * 32;
  // MOEKIT_AMX_PF_PAIRS=D (1 to 4): the overlapped order streams the panel pair D pairs on into L2 (D > 1 only in a
  // single chunk, where the panels are one contiguous range; the first pair also fetches the pairs before that).
  static const int64_t pf_pairs = env_int_in("MOEKIT_AMX_PF_PAIRS", 1, 4, 1);
  const int64_t kc_max =
      overlap ? (kc_forced ? kc_forced : std::max<int64_t>(256, (1 << 20) / (2 * m + 128) / 32 * 32)) : kp;
  const int64_t chunks = (kp + kc_max - 1) / kc_max, kc = ((kp + chunks - 1) / chunks + 31) / 32 * 32;
  struct Unit {  // the B of one panel pair over one k chunk: two byte ranges (none past the last)
    const char *a0 = nullptr, *a1 = nullptr, *b0 = nullptr, *b1 = nullptr;
    int64_t lines() const { return ((a1 - a0) + (b1 - b0)) / 64; }
  };
  auto unit = [&](int64_t p, int64_t k0) {
    Unit u;
    if (p >= panels) {
      p = 0, k0 += kc;
      if (k0 >= kp) return u;
    }
    const int64_t k1 = std::min(kp, k0 + kc);
    const auto* base = reinterpret_cast<const char*>(b + p * panel_stride);
    u.a0 = base + k0 * 32, u.a1 = base + k1 * 32;
    if (p + 1 < panels) u.b0 = u.a0 + panel_stride * 2, u.b1 = u.a1 + panel_stride * 2;
    return u;
  };
  for (int64_t k0 = 0; k0 < kp; k0 += kc) {
    const int64_t k1 = std::min(kp, k0 + kc), steps = (k1 - k0) / 32;
    for (int64_t p = 0; p < panels; p += 2) {
      const bool two = p + 1 < panels;
      const int64_t cols0 = p + 1 == panels ? n1 - n0 - p * 16 : 16;
      const int64_t cols1 = two ? (p + 2 == panels ? n1 - n0 - (p + 1) * 16 : 16) : 0;
      const uint16_t* b0 = b + p * panel_stride;
      const uint16_t* b1 = b0 + panel_stride;
      const int64_t pf_blocks = overlap == 2 ? row_blocks : row_blocks - 1;  // the row blocks that prefetch
      Unit next = pf_blocks > 0 ? unit(p + 2, k0) : Unit{};
      if (pf_pairs > 1 && chunks == 1 && pf_blocks > 0) {  // panels [p + 2 D, p + 2 D + 2), from p + 2 at p = 0
        const int64_t from = std::min(panels, p == 0 ? 2 : p + 2 * pf_pairs);
        const int64_t to = std::min(panels, p + 2 * pf_pairs + 2);
        const auto* base = reinterpret_cast<const char*>(b);
        next = Unit{};
        if (from < to) next.a0 = base + from * panel_stride * 2, next.a1 = base + to * panel_stride * 2;
      }
      const int64_t next_lines = overlap ? next.lines() : 0;
      const int64_t per_block = pf_blocks > 0 ? (next_lines + pf_blocks - 1) / pf_blocks : 0;
      for (int64_t i = 0; i < m; i += 32) {
        const int64_t left = m - i;
        const int r0 = left >= 16 ? 16 : int(left), r1 = left >= 32 ? 16 : (left > 16 ? int(left - 16) : 0);
        if (r0 != cfg0 || r1 != cfg1) configure(r0, r1), cfg0 = r0, cfg1 = r1;
        const uint16_t* ai = a + i * lda;
        float* ci = cb + i * ldc + p * 16;
        const int64_t ahead = i == 0 ? kAheadMem : kAhead;
        L2Prefetch l2;
        if ((overlap == 2 || i > 0) && next_lines > 0) {  // lines [first, first + per_block) of the next unit
          const int64_t slot = overlap == 2 ? i / 32 : i / 32 - 1;
          const int64_t first = slot * per_block, last = std::min(next_lines, first + per_block);
          const int64_t na = (next.a1 - next.a0) / 64;
          auto at = [&](int64_t l) { return l < na ? next.a0 + l * 64 : next.b0 + (l - na) * 64; };
          if (first < last) {
            l2.pf = at(first);
            l2.pf_end = first < na ? at(std::min(last, na) - 1) + 64 : at(last - 1) + 64;
            if (first < na && last > na) l2.next = next.b0, l2.next_end = at(last - 1) + 64;
            l2.lines = (per_block + steps - 1) / steps;
          }
        }
        const bool acc = k0 > 0;
        // The next block's C (the next row block of this pair, else the next pair's first), for writing.
        const float* cn = nullptr;
        int cn_rows = 0;
        if (g_amx_c_prefetch) {
          if (i + 32 < m) cn = cb + (i + 32) * ldc + p * 16, cn_rows = int(std::min<int64_t>(32, m - i - 32));
          else if (p + 2 < panels) cn = cb + (p + 2) * 16, cn_rows = int(std::min<int64_t>(32, m));
        }
        if (r1 > 0) {
          if (two) block<2, 2>(ai, lda, b0, b1, k0, k1, ci, ldc, acc, r0, r1, cols0, cols1, ahead, l2, cn, cn_rows);
          else block<2, 1>(ai, lda, b0, b1, k0, k1, ci, ldc, acc, r0, r1, cols0, cols1, ahead, l2, cn, cn_rows);
        } else {
          if (two) block<1, 2>(ai, lda, b0, b1, k0, k1, ci, ldc, acc, r0, r1, cols0, cols1, ahead, l2, cn, cn_rows);
          else block<1, 1>(ai, lda, b0, b1, k0, k1, ci, ldc, acc, r0, r1, cols0, cols1, ahead, l2, cn, cn_rows);
        }
      }
    }
  }
  _tile_release();
}

}  // namespace moekit::cpu

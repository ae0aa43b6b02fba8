// Internal: the GEMM micro-kernels and blocking, written once over a vector type and compiled once per ISA.
//
// Included by gemm_scalar.cpp, gemm_avx2.cpp and gemm_avx512.cpp INSIDE their own namespace, after they define
//   struct V {
//     static constexpr int W;               // f32 lanes
//     using R;                              // register type
//     R zero(); R load(const float*); void store(float*, R); R bcast(float); R fma(R a, R b, R c);  // a*b + c
//     float hsum(R);                        // fixed reduction order
//     float fma1(float a, float b, float c); // a*b + c rounded like one lane of fma
//     R load_bf16(const uint16_t*); R load_f16(const uint16_t*); float f16_to_f32(uint16_t);
//   };
// and the constants kKnMR, kKnNV (broadcast tiles of the packed path: rows x vectors), kKC (k block), kMC (m block),
// kTileN (widest column range), kDirectMaxM and kDirectAcc (rows and accumulators of the in-place tiles). Nothing
// here may include a header or use a library template: all code stays in the including file's namespace,
// compiled with its flags.
//
// Two layouts of W:
//   [N, K] (default): C[i, j] = dot(A[i, :], W[j, :]): "nk" tiles, vectorised along k, reduced at the end.
//   [K, N] (transposed): C[i, :] += A[i, k] * W[k, :]: "kn" tiles, vectorised along n (broadcast A).
// Up to kDirectMaxM rows, W is read in place (converted in registers) by those tiles. Above, blocks of W are
// converted once into f32 [k, n] panels (transposed on the way for [N, K]) sized for L2, and every block of kMC
// rows runs the broadcast ("kn") tiles over them.

using Reg = typename V::R;

template <class T>
inline T min_of(T a, T b) {
  return a < b ? a : b;
}

// Element i of a weight buffer, as f32 (WT: 0 f32, 1 bf16, 2 f16).
template <int WT>
inline float load1(const void* p, int64_t i) {
  if constexpr (WT == 0) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (WT == 1) {
    const uint32_t b = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
  } else {
    return V::f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

// V::W consecutive elements starting at i, as f32.
template <int WT>
inline Reg loadv(const void* p, int64_t i) {
  if constexpr (WT == 0)
    return V::load(static_cast<const float*>(p) + i);
  else if constexpr (WT == 1)
    return V::load_bf16(static_cast<const uint16_t*>(p) + i);
  else
    return V::load_f16(static_cast<const uint16_t*>(p) + i);
}

// dst[0, n) = f32(src[off, off + n))
template <int WT>
inline void convert_run(const void* src, int64_t off, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) V::store(dst + i, loadv<WT>(src, off + i));
  for (; i < n; ++i) dst[i] = load1<WT>(src, off + i);
}

// Prefetches the cache lines of src[off, off + n): the rows of W that packing reads next start on new pages,
// where the hardware prefetchers would first have to miss.
constexpr int64_t kPackAhead = 4;
// `level` 3: into L1; 2: into L2 (for data needed a whole tile later).
template <int WT>
inline void prefetch_run(const void* src, int64_t off, int64_t n, int level = 3) {
  constexpr int64_t elem = WT == 0 ? 4 : 2;
  const char* p = static_cast<const char*>(src) + off * elem;
  if (level == 3) {
    for (int64_t b = 0; b < n * elem; b += 64) __builtin_prefetch(p + b, 0, 3);
  } else {
    for (int64_t b = 0; b < n * elem; b += 64) __builtin_prefetch(p + b, 0, 2);
  }
}

// Calls f.template operator()<R>() with R == m, for 1 <= m <= Max.
template <int Max, class F>
inline void with_rows(int64_t m, F& f) {
  if constexpr (Max >= 1) {
    if (m == Max) {
      f.template operator()<Max>();
      return;
    }
    with_rows<Max - 1>(m, f);
  }
}

// C[MR, NR] = (acc ? C : 0) + A[MR, kc] . B[NR, kc]^T. A row i at a + i*lda; B row j at element boff + j*ldb of b.
template <int MR, int NR, int WT>
inline void nk_tile(const float* a, int64_t lda, const void* b, int64_t boff, int64_t ldb, int64_t kc, float* c,
                    int64_t ldc, bool acc) {
  Reg s[MR][NR];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 32
    for (int j = 0; j < NR; ++j) s[i][j] = V::zero();
  int64_t k = 0;
  for (; k + V::W <= kc; k += V::W) {
    Reg bv[NR];
#pragma GCC unroll 32
    for (int j = 0; j < NR; ++j) bv[j] = loadv<WT>(b, boff + j * ldb + k);
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const Reg av = V::load(a + i * lda + k);
#pragma GCC unroll 32
      for (int j = 0; j < NR; ++j) s[i][j] = V::fma(av, bv[j], s[i][j]);
    }
  }
  float r[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) r[i][j] = V::hsum(s[i][j]);
  for (; k < kc; ++k)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) r[i][j] = V::fma1(a[i * lda + k], load1<WT>(b, boff + j * ldb + k), r[i][j]);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) c[i * ldc + j] = (acc ? c[i * ldc + j] : 0.0f) + r[i][j];
}

// C[MR, :ncols] = (acc ? C : 0) + A[MR, kc] x B[kc, NV*W]; B row k at element boff + k*ldb of b. B is read for all
// NV*W columns (zero-padded panels when ncols < NV*W); only ncols columns of C are touched.
template <int MR, int NV, int WT>
inline void kn_tile(const float* a, int64_t lda, const void* b, int64_t boff, int64_t ldb, int64_t kc, float* c,
                    int64_t ldc, bool acc, int64_t ncols) {
  constexpr int NW = NV * V::W;
  const bool full = ncols == NW;
  Reg s[MR][NV];
  float tmp[NW];
  for (int i = 0; i < MR; ++i) {
    if (acc && full) {
#pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) s[i][v] = V::load(c + i * ldc + v * V::W);
    } else if (acc) {
      for (int j = 0; j < NW; ++j) tmp[j] = j < ncols ? c[i * ldc + j] : 0.0f;
      for (int v = 0; v < NV; ++v) s[i][v] = V::load(tmp + v * V::W);
    } else {
#pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) s[i][v] = V::zero();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    Reg bv[NV];
#pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) bv[v] = loadv<WT>(b, boff + k * ldb + v * V::W);
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const Reg av = V::bcast(a[i * lda + k]);
#pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) s[i][v] = V::fma(av, bv[v], s[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (full) {
#pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) V::store(c + i * ldc + v * V::W, s[i][v]);
    } else {
      for (int v = 0; v < NV; ++v) V::store(tmp + v * V::W, s[i][v]);
      for (int64_t j = 0; j < ncols; ++j) c[i * ldc + j] = tmp[j];
    }
  }
}

// ---- W [N, K] ----

template <int WT>
void nk_direct(const float* a, int64_t lda, int64_t m, const WeightMatrix& w, int64_t n0, int64_t n1, float* c,
               int64_t ldc) {
  const int64_t K = w.k;
  auto body = [&]<int R>() {
    constexpr int NR = kDirectAcc / R < 1 ? 1 : (kDirectAcc / R > 8 ? 8 : kDirectAcc / R);
    int64_t j = n0;
    for (; j + NR <= n1; j += NR) {
      for (int64_t r = j + NR; r < j + 2 * NR && r < n1; ++r) prefetch_run<WT>(w.data, r * K, K, 2);
      nk_tile<R, NR, WT>(a, lda, w.data, j * K, K, K, c + j, ldc, false);
    }
    for (; j < n1; ++j) nk_tile<R, 1, WT>(a, lda, w.data, j * K, K, K, c + j, ldc, false);
  };
  with_rows<kDirectMaxM>(m, body);
}

// ---- W [K, N] ----

template <int WT>
void kn_direct(const float* a, int64_t lda, int64_t m, const WeightMatrix& w, int64_t n0, int64_t n1, float* c,
               int64_t ldc) {
  const int64_t K = w.k, N = w.n;
  auto body = [&]<int R>() {
    constexpr int NV = kDirectAcc / R < 1 ? 1 : (kDirectAcc / R > 8 ? 8 : kDirectAcc / R);
    int64_t j = n0;
    for (; j + NV * V::W <= n1; j += NV * V::W)
      kn_tile<R, NV, WT>(a, lda, w.data, j, N, K, c + j, ldc, false, NV * V::W);
    for (; j + V::W <= n1; j += V::W) kn_tile<R, 1, WT>(a, lda, w.data, j, N, K, c + j, ldc, false, V::W);
    for (; j < n1; ++j) {
      for (int i = 0; i < R; ++i) {
        float s = 0.0f;
        for (int64_t k = 0; k < K; ++k) s = V::fma1(a[i * lda + k], load1<WT>(w.data, k * N + j), s);
        c[i * ldc + j] = s;
      }
    }
  };
  with_rows<kDirectMaxM>(m, body);
}

// ---- packed blocks (more than kDirectMaxM rows), both layouts ----

// Converts W^T[kb : kb + kc, n0 : n0 + nc] into panels of NR = kKnNV * W columns: panel p is [kc, NR] f32 at
// panels + p * kc * NR, zero-padded past nc. W [N, K] is transposed on the way through `rows` ([NR, kc] f32).
template <int WT>
void pack_panels(const WeightMatrix& w, int64_t n0, int64_t nc, int64_t kb, int64_t kc, float* panels, float* rows) {
  constexpr int64_t NR = kKnNV * V::W;
  const int64_t K = w.k, N = w.n, count = (nc + NR - 1) / NR;
  for (int64_t p = 0; p < count; ++p) {
    const int64_t cols = min_of<int64_t>(NR, nc - p * NR), c0 = n0 + p * NR;
    float* dst = panels + p * kc * NR;
    if (w.transposed) {
      for (int64_t kk = 0; kk < kc; ++kk) {
        convert_run<WT>(w.data, (kb + kk) * N + c0, cols, dst + kk * NR);
        for (int64_t j = cols; j < NR; ++j) dst[kk * NR + j] = 0.0f;
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        if (j + kPackAhead < cols) prefetch_run<WT>(w.data, (c0 + j + kPackAhead) * K + kb, kc);
        convert_run<WT>(w.data, (c0 + j) * K + kb, kc, rows + j * kc);
      }
      for (int64_t k0 = 0; k0 < kc; k0 += 8) {
        const int64_t k1 = min_of<int64_t>(kc, k0 + 8);
        for (int64_t j = 0; j < NR; ++j)
          for (int64_t kk = k0; kk < k1; ++kk) dst[kk * NR + j] = j < cols ? rows[j * kc + kk] : 0.0f;
      }
    }
  }
}

template <int WT>
void gemm_blocked(const float* a, int64_t lda, int64_t m, const WeightMatrix& w, int64_t n0, int64_t n1, float* c,
                  int64_t ldc, float* work) {
  constexpr int64_t NR = kKnNV * V::W;
  const int64_t K = w.k, nc = n1 - n0, panels = (nc + NR - 1) / NR;
  float* rows = work + kTileN * kKC;  // [NR, kKC] transpose staging
  for (int64_t m0 = 0; m0 < m; m0 += kMC) {
    const int64_t mc = min_of<int64_t>(kMC, m - m0);
    for (int64_t kb = 0; kb < K; kb += kKC) {
      const int64_t kc = min_of<int64_t>(kKC, K - kb);
      pack_panels<WT>(w, n0, nc, kb, kc, work, rows);
      for (int64_t mb = m0; mb < m0 + mc; mb += kKnMR) {
        const float* ab = a + mb * lda + kb;
        float* cb = c + mb * ldc + n0;
        auto body = [&]<int R>() {
          for (int64_t p = 0; p < panels; ++p)
            kn_tile<R, kKnNV, 0>(ab, lda, work, p * kc * NR, NR, kc, cb + p * NR, ldc, kb > 0,
                                 min_of<int64_t>(NR, nc - p * NR));
        };
        with_rows<kKnMR>(min_of<int64_t>(kKnMR, m0 + mc - mb), body);
      }
    }
  }
}

template <int WT>
void gemm_tile_typed(const float* a, int64_t lda, int64_t m, const WeightMatrix& w, int64_t n0, int64_t n1, float* c,
                     int64_t ldc, float* work) {
  if (m <= 0 || n1 <= n0) return;
  if (w.k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = n0; j < n1; ++j) c[i * ldc + j] = 0.0f;
    return;
  }
  if (m <= kDirectMaxM) {
    if (w.transposed)
      kn_direct<WT>(a, lda, m, w, n0, n1, c, ldc);
    else
      nk_direct<WT>(a, lda, m, w, n0, n1, c, ldc);
  } else {
    gemm_blocked<WT>(a, lda, m, w, n0, n1, c, ldc, work);
  }
}

void gemm_tile(const float* a, int64_t lda, int64_t m, const WeightMatrix& w, int64_t n0, int64_t n1, float* c,
               int64_t ldc, float* work) {
  switch (w.type) {
    case WType::f32:
      gemm_tile_typed<0>(a, lda, m, w, n0, n1, c, ldc, work);
      return;
    case WType::bf16:
      gemm_tile_typed<1>(a, lda, m, w, n0, n1, c, ldc, work);
      return;
    case WType::f16:
      gemm_tile_typed<2>(a, lda, m, w, n0, n1, c, ldc, work);
      return;
  }
}

// Scratch: the packed panels (kTileN x kKC; kTileN is a multiple of kKnNV * W) and the transpose staging.
constexpr int64_t kWorkFloats = (kTileN + kKnNV * V::W) * kKC;

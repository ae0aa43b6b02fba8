// Internal: the FP8 block-scaled GEMM tile (gemm.h GemmKernels::gemm_fp8_tile), written once over GCC vector
// types and compiled once per ISA. Included by gemm_scalar.cpp, gemm_avx2.cpp and gemm_avx512.cpp INSIDE their own
// namespace, after they define kF8L (f64 lanes: a power of two), kF8MR (activation rows per register tile), kF8NR
// (weight rows per register tile, at most kFp8MaxNR),
//   typedef double F8D __attribute__((vector_size(kF8L * 8)));   // kF8L doubles
//   void f8_decode16(const uint8_t* src, F8D* out);  // out[0 .. 16 / kF8L): the 16 e4m3 src[i] times 2^-8 (exact)
//   int64_t f8_decode_run(const uint8_t* src, int64_t n, double* dst);
// the last writing dst[i] = e4m3 value of src[i] times 2^-8 for a prefix of [0, n) and returning its length (the
// rest is decoded here). Like gemm_kernels.h, nothing here may include a header or use a library template.
//
// Exactness: an e4m3 value times 2^9 is an integer of at most 18 bits ((8 + m) << (e - 1), or m for subnormals);
// the activations are held so (integers), the weights as e4m3 times 2^-8 (what an f16 reinterpretation of the bits
// gives: multiples of 2^-17 below 2). A product is a multiple of 2^-17 below 2^19, exact in f64, and a sum of 128
// of them (below 2^26, 43 bits) is too, in any order. Each
// 128-input block's dot product is therefore exact whatever the vector width, and the block's scales (f32 x f32 x
// 2^-18, exact in f64) are applied once per block in a fixed order: the result does not depend on the ISA.
//
// Weights: for each tile of kF8NR rows, the rows are decoded once into a panel of f64 integers (work), zero past k,
// then every kF8MR activation rows run over it block by block.


// One e4m3 byte (no NaN) -> its value times 2^-8: ((8 + m) << (e - 1), or m) * 2^-17.
inline double f8_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const int mag = e == 0 ? m : (8 + m) << (e - 1);
  return double((b & 0x80) ? -mag : mag) * 0x1p-17;
}

inline F8D f8_load(const double* p) {
  F8D v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline double f8_hsum(F8D v) {
  double s = 0.0;
  for (int l = 0; l < kF8L; ++l) s += v[l];
  return s;
}

// panel[j, 0:kp) = decoded row j of w (rows j0 + j), zero past k and for rows past n1.
inline void f8_decode_panel(const Fp8Matrix& w, int64_t j0, int64_t n1, int64_t kp, double* panel) {
  const int64_t K = w.k;
  for (int j = 0; j < kF8NR; ++j) {
    double* dst = panel + j * kp;
    int64_t k = 0;
    if (j0 + j < n1) {
      const uint8_t* row = w.data + (j0 + j) * K;
      k = f8_decode_run(row, K, dst);
      for (; k < K; ++k) dst[k] = f8_value(row[k]);
    }
    for (; k < kp; ++k) dst[k] = 0.0;
  }
}

// c[R, 0:cols) = the R rows of a times the panel's kF8NR rows, block scales applied.
template <int R>
inline void f8_rows(const double* a, int64_t lda, const float* sa, int64_t ldsa, const double* panel, int64_t kp,
                    const double* wsc, int64_t kblocks, float* c, int64_t ldc, int64_t cols) {
  double tot[R][kF8NR];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kF8NR; ++j) tot[i][j] = 0.0;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    F8D acc[R][kF8NR];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < kF8NR; ++j) acc[i][j] = F8D{};
    const int64_t k0 = kb * kFp8K;
    for (int64_t kk = k0; kk < k0 + kFp8K; kk += kF8L) {
      F8D wv[kF8NR];
#pragma GCC unroll 16
      for (int j = 0; j < kF8NR; ++j) wv[j] = f8_load(panel + j * kp + kk);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const F8D av = f8_load(a + i * lda + kk);
#pragma GCC unroll 16
        for (int j = 0; j < kF8NR; ++j) acc[i][j] += av * wv[j];
      }
    }
    for (int i = 0; i < R; ++i) {
      const double s = double(sa[i * ldsa + kb]);
      for (int j = 0; j < kF8NR; ++j) tot[i][j] += f8_hsum(acc[i][j]) * (s * wsc[j * kblocks + kb]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t j = 0; j < cols; ++j) c[i * ldc + j] = float(tot[i][j]);
}

// Few rows (decode): c[R, 0:cols) for weight rows j0 .. j0 + cols decoded 16 inputs at a time into registers,
// without a panel.
template <int R>
inline void f8_rows_direct(const double* a, int64_t lda, const float* sa, int64_t ldsa, const Fp8Matrix& w, int64_t j0,
                           int64_t cols, const double* wsc, int64_t kblocks, float* c, int64_t ldc) {
  constexpr int D = 16, V = D / kF8L;
  const int64_t K = w.k;
  double tot[R][kF8NR];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kF8NR; ++j) tot[i][j] = 0.0;
  const uint8_t* rows[kF8NR];
  for (int j = 0; j < kF8NR; ++j) rows[j] = w.data + (j0 + (j < cols ? j : 0)) * K;  // rows past cols: discarded
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    F8D acc[R][kF8NR];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < kF8NR; ++j) acc[i][j] = F8D{};
    const int64_t k0 = kb * kFp8K, k1 = k0 + kFp8K < K ? k0 + kFp8K : K;
    for (int64_t kk = k0; kk < k1; kk += D) {
      F8D av[R][V];
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) av[i][v] = f8_load(a + i * lda + kk + v * kF8L);
#pragma GCC unroll 16
      for (int j = 0; j < kF8NR; ++j) {
        F8D wv[V];
        if (kk + D <= K) {
          if ((kk & 63) == 0) __builtin_prefetch(rows[j] + kk + 512, 0, 3);
          f8_decode16(rows[j] + kk, wv);
        } else {  // the row's last bytes, zero-padded (never read past the row)
          uint8_t tail[D] = {};
          for (int64_t d = 0; d < K - kk; ++d) tail[d] = rows[j][kk + d];
          f8_decode16(tail, wv);
        }
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
          for (int v = 0; v < V; ++v) acc[i][j] += av[i][v] * wv[v];
      }
    }
    for (int i = 0; i < R; ++i) {
      const double s = double(sa[i * ldsa + kb]);
      for (int j = 0; j < kF8NR; ++j) tot[i][j] += f8_hsum(acc[i][j]) * (s * wsc[j * kblocks + kb]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t j = 0; j < cols; ++j) c[i * ldc + j] = float(tot[i][j]);
}

void gemm_fp8_tile(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m, const Fp8Matrix& w,
                   int64_t n0, int64_t n1, float* c, int64_t ldc, double* work) {
  if (m <= 0 || n1 <= n0) return;
  const int64_t kp = fp8_row_k(w.k), kblocks = kp / kFp8K;
  const int64_t seg_blocks = (w.seg + kFp8K - 1) / kFp8K;
  double* panel = work;                    // [kF8NR, kp]
  double* wsc = work + kFp8MaxNR * kp;     // [kF8NR, kblocks]: weight block scales times 2^-1
  for (int64_t j0 = n0; j0 < n1; j0 += kF8NR) {
    const int64_t cols = n1 - j0 < kF8NR ? n1 - j0 : kF8NR;
    for (int j = 0; j < kF8NR; ++j) {
      const int64_t row = j0 + j < n1 ? j0 + j : j0;
      const int64_t srow = (row / w.seg) * seg_blocks + (row % w.seg) / kFp8K;
      for (int64_t kb = 0; kb < kblocks; ++kb)
        wsc[j * kblocks + kb] = double(w.scales[srow * kblocks + kb]) * 0.5;  // 2^-9 (activations) x 2^8 (panel)
    }
    if (m <= kF8MR) {  // decode: no panel
      float* cj = c + j0;
      switch (m) {
        case 1: f8_rows_direct<1>(a, lda, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
        case 2: f8_rows_direct<2 <= kF8MR ? 2 : 1>(a, lda, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
        case 3: f8_rows_direct<3 <= kF8MR ? 3 : 1>(a, lda, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
        default: f8_rows_direct<kF8MR>(a, lda, sa, ldsa, w, j0, cols, wsc, kblocks, cj, ldc); break;
      }
      continue;
    }
    f8_decode_panel(w, j0, n1, kp, panel);
    int64_t i = 0;
    for (; i + kF8MR <= m; i += kF8MR)
      f8_rows<kF8MR>(a + i * lda, lda, sa + i * ldsa, ldsa, panel, kp, wsc, kblocks, c + i * ldc + j0, ldc, cols);
    for (; i < m; ++i)
      f8_rows<1>(a + i * lda, lda, sa + i * ldsa, ldsa, panel, kp, wsc, kblocks, c + i * ldc + j0, ldc, cols);
  }
}

// ---- FP4 (e2m1 with a ue8m0 scale per row and 32 inputs) ----

// e2m1 code (4 bits) -> its value times 2 (an integer: 0, 1, 2, 3, 4, 6, 8, 12, signed).
inline int f4_twice(int c) {
  const int e = (c >> 1) & 3, m = c & 1;
  const int mag = e == 0 ? m : (2 + m) << (e - 1);
  return (c & 8) ? -mag : mag;
}

// panel[j, 0:kp) = row j0 + j of w dequantized (e2m1 x 2^(s - 127), exact in f64), zero past k and past n1.
inline void f4_decode_panel(const Fp4Matrix& w, int64_t j0, int64_t n1, int64_t kp, double* panel) {
  double twice[16];
  for (int c = 0; c < 16; ++c) twice[c] = double(f4_twice(c));
  const int64_t K = w.k;
  for (int j = 0; j < kF8NR; ++j) {
    double* dst = panel + j * kp;
    int64_t k = 0;
    if (j0 + j < n1) {
      const uint8_t* row = w.data + (j0 + j) * (K / 2);
      const uint8_t* sc = w.scales + (j0 + j) * (K / 32);
      for (int64_t g = 0; g < K / 32; ++g, k += 32) {
        uint64_t bits = (uint64_t(sc[g]) + 1023 - 127 - 1) << 52;  // 2^(s - 127) / 2: a normal f64
        double scale;
        __builtin_memcpy(&scale, &bits, 8);
        for (int64_t b = 0; b < 16; ++b) {
          const uint8_t v = row[g * 16 + b];
          dst[k + 2 * b] = twice[v & 15] * scale;
          dst[k + 2 * b + 1] = twice[v >> 4] * scale;
        }
      }
    }
    for (; k < kp; ++k) dst[k] = 0.0;
  }
}

void gemm_fp4_tile(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m, const Fp4Matrix& w,
                   int64_t n0, int64_t n1, float* c, int64_t ldc, double* work) {
  if (m <= 0 || n1 <= n0) return;
  const int64_t kp = fp8_row_k(w.k), kblocks = kp / kFp8K;
  double* panel = work;
  double* wsc = work + kFp8MaxNR * kp;
  for (int64_t i = 0; i < kF8NR * kblocks; ++i) wsc[i] = w.act_unit;
  for (int64_t j0 = n0; j0 < n1; j0 += kF8NR) {
    const int64_t cols = n1 - j0 < kF8NR ? n1 - j0 : kF8NR;
    f4_decode_panel(w, j0, n1, kp, panel);
    int64_t i = 0;
    for (; i + kF8MR <= m; i += kF8MR)
      f8_rows<kF8MR>(a + i * lda, lda, sa + i * ldsa, ldsa, panel, kp, wsc, kblocks, c + i * ldc + j0, ldc, cols);
    for (; i < m; ++i)
      f8_rows<1>(a + i * lda, lda, sa + i * ldsa, ldsa, panel, kp, wsc, kblocks, c + i * ldc + j0, ldc, cols);
  }
}

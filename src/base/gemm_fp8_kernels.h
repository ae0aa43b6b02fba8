// Internal: the FP8 block-scaled GEMM tile (gemm.h GemmKernels::gemm_fp8_tile), written once over GCC vector
// types and compiled once per ISA. Included by gemm_scalar.cpp, gemm_avx2.cpp and gemm_avx512.cpp INSIDE their own
// namespace, after they define kF8L (f64 lanes: a power of two), kF8MR (activation rows per register tile) and
// kF8NR (weight rows per register tile, at most kFp8MaxNR). Like gemm_kernels.h, nothing here may include a header
// or use a library template.
//
// Exactness: an e4m3 value times 2^9 is an integer of at most 18 bits ((8 + m) << (e - 1), or m for subnormals),
// so a product of two is exact in f64 and a sum of 128 such products (below 2^43) is too, in any order. Each
// 128-input block's dot product is therefore exact whatever the vector width, and the block's scales (f32 x f32 x
// 2^-18, exact in f64) are applied once per block in a fixed order: the result does not depend on the ISA.
//
// Weights: for each tile of kF8NR rows, the rows are decoded once into a panel of f64 integers (work), zero past k,
// then every kF8MR activation rows run over it block by block.

typedef double F8D __attribute__((vector_size(kF8L * 8)));
typedef int32_t F8I __attribute__((vector_size(kF8L * 4)));
typedef uint8_t F8B __attribute__((vector_size(kF8L)));

// kF8L e4m3 bytes -> their values times 2^9, as f64 integers (no NaN bytes).
inline F8D f8_decode(F8B b) {
  const F8I v = __builtin_convertvector(b, F8I);
  const F8I e = (v >> 3) & 15, m = v & 7;
  const F8I nz = e != 0;  // -1 where normal
  const F8I mag = (m | (nz & 8)) << (e + nz);
  const F8I sm = -(v >> 7);
  return __builtin_convertvector((mag ^ sm) - sm, F8D);
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
    if (j0 + j >= n1) {
      for (int64_t k = 0; k < kp; ++k) dst[k] = 0.0;
      continue;
    }
    const uint8_t* row = w.data + (j0 + j) * K;
    int64_t k = 0;
    for (; k + kF8L <= K; k += kF8L) {
      F8B b;
      __builtin_memcpy(&b, row + k, sizeof b);
      const F8D d = f8_decode(b);
      __builtin_memcpy(dst + k, &d, sizeof d);
    }
    for (; k < kp; k += kF8L) {  // the tail of the row (read byte by byte), then zeros
      F8B b;
      for (int l = 0; l < kF8L; ++l) b[l] = k + l < K ? row[k + l] : 0;
      const F8D d = f8_decode(b);
      __builtin_memcpy(dst + k, &d, sizeof d);
    }
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

void gemm_fp8_tile(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m, const Fp8Matrix& w,
                   int64_t n0, int64_t n1, float* c, int64_t ldc, double* work) {
  if (m <= 0 || n1 <= n0) return;
  const int64_t kp = fp8_row_k(w.k), kblocks = kp / kFp8K;
  const int64_t seg_blocks = (w.seg + kFp8K - 1) / kFp8K;
  double* panel = work;                    // [kF8NR, kp]
  double* wsc = work + kFp8MaxNR * kp;     // [kF8NR, kblocks]: weight block scales times 2^-18
  for (int64_t j0 = n0; j0 < n1; j0 += kF8NR) {
    const int64_t cols = n1 - j0 < kF8NR ? n1 - j0 : kF8NR;
    f8_decode_panel(w, j0, n1, kp, panel);
    for (int j = 0; j < kF8NR; ++j) {
      const int64_t row = j0 + j < n1 ? j0 + j : j0;
      const int64_t srow = (row / w.seg) * seg_blocks + (row % w.seg) / kFp8K;
      for (int64_t kb = 0; kb < kblocks; ++kb)
        wsc[j * kblocks + kb] = double(w.scales[srow * kblocks + kb]) * 0x1p-18;
    }
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

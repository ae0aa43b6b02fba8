// Internal: the one CPU GEMM, used by the experts backends, the model's linear layers and the benchmark's CPU
// ceiling. C[M, N] (f32) = A[M, K] (f32) x W^T, with W (one expert's weight, or a layer's) stored [N, K]
// (out, in) or [K, N] (transposed), in f32, bf16 or f16, converted on the fly.
//
// Micro-kernels exist per instruction set (gemm_scalar.cpp, gemm_avx2.cpp, gemm_avx512.cpp) and are picked at
// run time. Where the CPU has bf16 dot-pair instructions (AVX512-BF16 `vdpbf16ps`: gemm_avx512bf16.cpp; AMX tiles:
// gemm_amx.cpp) a second entry multiplies bf16 rows by bf16 weights packed once into VNNI-pair panels
// (PackedBf16), accumulating in f32. The ISA files include only this header: it must stay free of inline functions and templates, so
// that no code compiled with AVX flags can be shared with (and picked by the linker for) portable code.
#pragma once
#include <cstdint>

namespace moekit {
enum class DType : uint8_t;  // moekit/dtype.h (not included: it has inline functions)
}

namespace moekit::cpu {

enum class Isa : uint8_t { scalar, avx2, avx512, avx512bf16, amx };
enum class WType : uint8_t { f32, bf16, f16 };

// One expert's projection: logical W [n out, k in]; stored [n, k] row-major, or [k, n] when transposed.
struct WeightMatrix {
  const void* data;
  WType type;
  int64_t n, k;
  bool transposed;
};

// The weight type of a dtype; throws not_supported for any but f32, bf16 and f16.
WType weight_type(DType t);

// bf16 weights packed for the dot-pair kernels: logical W [n, k] in panels of 16 columns (n), the k axis in pairs,
// k padded with zeros to kp (a multiple of kPackK) and n to a multiple of 16. Element (j, k) sits at
//   data[(j / 16) * kp * 16 + (k / 2) * 32 + (j % 16) * 2 + k % 2]
// so that 16 consecutive k-pairs of a panel are one AMX B tile (16 rows of 64 bytes) and one k-pair of a panel is
// one 512-bit vector for vdpbf16ps.
constexpr int64_t kPackK = 32;
struct PackedBf16 {
  const uint16_t* data;
  int64_t n, k, kp;
};
int64_t packed_bf16_k(int64_t k);                 // kp: k rounded up to kPackK
int64_t packed_bf16_elems(int64_t n, int64_t k);  // uint16 elements of a packed copy of W [n, k]
// Packs w (bf16, either layout) into dst (packed_bf16_elems(w.n, w.k) elements). Single-threaded.
void pack_bf16(const WeightMatrix& w, uint16_t* dst);
// dst[i, 0:kp) = bf16(src[i, 0:k)) rounded to nearest even, zero past k, for i < m (row strides lds, kp).
void rows_to_bf16(const float* src, int64_t lds, int64_t m, int64_t k, uint16_t* dst, int64_t kp);

// FP8 block-scaled weights (SPEC section 5): logical W [n, k] in e4m3 stored [n, k], with f32 block scales
// scales[row(j) * kblocks + k / 128], row(j) = (j / seg) * ceil(seg / 128) + (j % seg) / 128 (seg: rows per segment,
// n for one matrix, I for the halves of a fused gate_up). No e4m3 NaN byte (0x7f, 0xff) may occur.
constexpr int64_t kFp8K = 128;  // k block of the scales, and of the activation groups
constexpr int64_t kFp8MaxNR = 4;  // weight rows per register tile, at most (every ISA)
struct Fp8Matrix {
  const uint8_t* data;
  const float* scales;
  int64_t n, k, seg;
};
// FP4 weights (MXFP4, FP4 with UE8M0 scales): logical W [n, k] in e2m1 packed two per byte (element k of row j in
// byte (j * k + k) / 2, low nibble first), k a multiple of 32, with one ue8m0 scale per row and 32 inputs
// scales[j * k / 32 + k / 32]. act_unit: what one unit of the activation rows is worth (2^-9 for FP8-quantized rows,
// whose values are e4m3 times 2^9; 1 for rows of plain values).
struct Fp4Matrix {
  const uint8_t* data;
  const uint8_t* scales;
  int64_t n, k;
  double act_unit;
};
// Activation rows for the FP8 tile: each row quantized per 128 inputs (moekit/quant.h quantize_activations_fp8),
// stored as the e4m3 values times 2^9 (integers, exact in f64) zero-padded to fp8_row_k(k), with the f32 group
// scales beside them.
int64_t fp8_row_k(int64_t k);  // k rounded up to kFp8K
// Scratch (doubles) of one gemm_fp8_tile call on weights with k inputs.
int64_t fp8_work_doubles(int64_t k);
constexpr int64_t kFp8TileN = 128;  // the column tile the backends split FP8 products on
// dst[i, 0:fp8_row_k(k)) and sa[i, 0:ceil(k/128)) for i < m (row strides ldd, ldsa): the rows of src quantized.
void fp8_quantize_rows(const float* src, int64_t lds, int64_t m, int64_t k, bool pow2_scales, double* dst,
                       int64_t ldd, float* sa, int64_t ldsa);
// The same rows unquantized (for FP4 weights with float activations): dst = f64(src) zero-padded, sa = 1.
void plain_rows(const float* src, int64_t lds, int64_t m, int64_t k, double* dst, int64_t ldd, float* sa,
                int64_t ldsa);

struct GemmKernels {
  Isa isa;
  int64_t max_tile_n;    // widest column range [n0, n1) one gemm_tile call accepts
  int64_t work_floats;   // scratch (floats, 64-byte aligned) one gemm_tile call needs
  int64_t direct_max_m;  // up to this many rows W is read in place; above, it is packed into f32 panels
  // C[m, n0:n1) (row stride ldc) = A[m, K] (row stride lda) x W^T[:, n0:n1). Overwrites C. Single-threaded;
  // the result of an element depends only on m, K and the ISA (not on n0/n1 or on threads).
  void (*gemm_tile)(const float* a, int64_t lda, int64_t m, const WeightMatrix& w, int64_t n0, int64_t n1, float* c,
                    int64_t ldc, float* work);
  // Null where the ISA has no bf16 dot-pair instructions. C[m, n0:n1) (row stride ldc) = A[m, kp] x W^T[:, n0:n1)
  // with A bf16 (row stride lda >= w.kp, zero in [w.k, w.kp)) and W packed; n0 a multiple of 16. Overwrites C;
  // accumulates in f32. Single-threaded; an element's result depends only on m, K and the ISA.
  void (*gemm_bf16_tile)(const uint16_t* a, int64_t lda, int64_t m, const PackedBf16& w, int64_t n0, int64_t n1,
                         float* c, int64_t ldc);
  // C[m, n0:n1) (row stride ldc) = f32(sum over k blocks b of sa[i, b] * scale(j, b) * dot_b(A[i], W[j])) with A
  // quantized rows (fp8_quantize_rows: row stride lda, scales sa with row stride ldsa) and W FP8. Each block's dot
  // product is exact (products of e4m3 values summed in f64), so an element's result does not depend on the ISA,
  // the tile or the threads. `work`: fp8_work_doubles(w.k) doubles. Single-threaded.
  void (*gemm_fp8_tile)(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m, const Fp8Matrix& w,
                        int64_t n0, int64_t n1, float* c, int64_t ldc, double* work);
  // The same with FP4 weights: each row's e2m1 values times their scales decoded once into f64 (exact), then
  // C[i, j] = f32(sum over 128-input groups g of sa[i, g] * act_unit * dot_g(A[i], W[j])) (f64 sums).
  void (*gemm_fp4_tile)(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m, const Fp4Matrix& w,
                        int64_t n0, int64_t n1, float* c, int64_t ldc, double* work);
  // Null but for the amx ISA. gemm_fp8_tile for m <= kFp8F32MaxRows with each block's dot product summed in f32
  // (products exact, sums rounded: within about 1e-7 of it, not bit-identical): for products whose output is not
  // quantized again (the down projection), where the exact f64 sums are not needed.
  void (*gemm_fp8_f32_tile)(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m,
                            const Fp8Matrix& w, int64_t n0, int64_t n1, float* c, int64_t ldc, double* work);
};
constexpr int64_t kFp8F32MaxRows = 4;

extern const GemmKernels kGemmScalar;  // gemm_scalar.cpp: portable, auto-vectorised
extern const GemmKernels kGemmAvx2;    // gemm_avx2.cpp: AVX2 + FMA + F16C
extern const GemmKernels kGemmAvx512;  // gemm_avx512.cpp: AVX-512 F/BW/VL/DQ + F16C
// The bf16 tiles of gemm_avx512bf16.cpp (AVX512-BF16) and gemm_amx.cpp (AMX-BF16 tiles; rows below
// kAmxMinRows go to the AVX512-BF16 tile). The avx512bf16 and amx ISAs are avx512 plus one of them.
void gemm_bf16_tile_avx512bf16(const uint16_t* a, int64_t lda, int64_t m, const PackedBf16& w, int64_t n0, int64_t n1,
                               float* c, int64_t ldc);
void gemm_bf16_tile_amx(const uint16_t* a, int64_t lda, int64_t m, const PackedBf16& w, int64_t n0, int64_t n1,
                        float* c, int64_t ldc);
// The amx bf16 tile's order for every later call: 0 the single pass, 1 or 2 the overlapped order (k chunks, the next
// panel pair streamed into L2), -1 (or anything else) back to the default (MOEKIT_AMX_OVERLAP if set, else 2 from 24
// rows on, 0 below). For the bench's peak, which takes the best of the orders.
void set_amx_overlap(int order);
// The SiLU gate of a row of bf16 products h = [g | u] (2I f32 values, each rounded to bf16 first): out[j] =
// bf16(bf16(silu(g[j])) * u[j]), the rounding of first_epilogue_row (backends/cpu) with exp within about 2 ulp of
// expf. AVX-512 (gemm_avx512bf16.cpp); only where the ISA has the bf16 tile.
void silu_mul_bf16_row_avx512(const float* h, int64_t I, uint16_t* out);
// acc[j] += bf16(w * y[j]) for j < n (f32 product rounded to bf16, the sum in f32), as the CPU backends' combine
// with bf16 activations and routing weights. AVX-512 (gemm_avx512bf16.cpp); only where the ISA has the bf16 tile.
void add_bf16_products_avx512(float* acc, const float* y, float w, int64_t n);
// x[j] = bf16(x[j]) in place for j < n (round to nearest even, NaN quieted), the values of the scalar rounding.
// AVX-512 (gemm_avx512bf16.cpp); only where the ISA has the bf16 tile.
void round_bf16_in_place_avx512(float* x, int64_t n);
constexpr int64_t kAmxMinRows = 8;
// The FP8 tile of the amx ISA (gemm_amx.cpp: e4m3 decoded by AVX512-VBMI byte tables; the same bits as the others).
void gemm_fp8_tile_amx(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m, const Fp8Matrix& w,
                       int64_t n0, int64_t n1, float* c, int64_t ldc, double* work);
void gemm_fp8_f32_tile_amx(const double* a, int64_t lda, const float* sa, int64_t ldsa, int64_t m, const Fp8Matrix& w,
                           int64_t n0, int64_t n1, float* c, int64_t ldc, double* work);

// Whether this CPU can run `isa` (and this build has it).
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);  // "scalar", "avx2", "avx512", "avx512bf16", "amx"

// The kernels in use: the override when set, else MOEKIT_CPU_ISA (scalar | avx2 | avx512 | avx512bf16 | amx) when
// set, else the
// best the CPU supports. Throws naming the value when MOEKIT_CPU_ISA is unknown or not supported here.
const GemmKernels& gemm_kernels();
// Forces an ISA (tests, benchmarks); throws when the CPU lacks it. clear_isa_override() restores the default.
void set_isa_override(Isa isa);
void clear_isa_override();

// C[m, N] = A[m, K] x W^T over all columns, split into column tiles run by OpenMP threads.
void gemm(const GemmKernels& kernels, const float* a, int64_t lda, int64_t m, const WeightMatrix& w, float* c,
          int64_t ldc);
// C[m, N] = A[m, kp] (bf16, as gemm_bf16_tile) x W^T over all columns, split into (row block, column block) tasks
// run by OpenMP threads. kernels.gemm_bf16_tile must not be null.
void gemm_bf16(const GemmKernels& kernels, const uint16_t* a, int64_t lda, int64_t m, const PackedBf16& w, float* c,
               int64_t ldc);
// The column and row block of one bf16 task (multiples of 16 and 32) for m rows: the blocks the backends split on.
constexpr int64_t kBf16TileN = 128;
int64_t bf16_tile_m(int64_t m);
// Columns of one bf16 task over n columns when there are row_tasks row blocks to share among the OpenMP threads: as
// many kBf16TileN blocks as leave about 8 tasks per thread (wide tasks keep their rows of A in the core's L2 over
// more columns), at least one block.
int64_t bf16_task_cols(int64_t n, int64_t row_tasks);

}  // namespace moekit::cpu

// Internal: the one CPU GEMM, used by the experts backends, the model's linear layers and the benchmark's CPU
// ceiling. C[M, N] (f32) = A[M, K] (f32) x W^T, with W (one expert's weight, or a layer's) stored [N, K]
// (out, in) or [K, N] (transposed), in f32, bf16 or f16, converted on the fly.
//
// Micro-kernels exist per instruction set (gemm_scalar.cpp, gemm_avx2.cpp, gemm_avx512.cpp) and are picked at
// run time. The ISA files include only this header: it must stay free of inline functions and templates, so
// that no code compiled with AVX flags can be shared with (and picked by the linker for) portable code.
#pragma once
#include <cstdint>

namespace moekit {
enum class DType : uint8_t;  // moekit/dtype.h (not included: it has inline functions)
}

namespace moekit::cpu {

enum class Isa : uint8_t { scalar, avx2, avx512 };
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

struct GemmKernels {
  Isa isa;
  int64_t max_tile_n;    // widest column range [n0, n1) one gemm_tile call accepts
  int64_t work_floats;   // scratch (floats, 64-byte aligned) one gemm_tile call needs
  int64_t direct_max_m;  // up to this many rows W is read in place; above, it is packed into f32 panels
  // C[m, n0:n1) (row stride ldc) = A[m, K] (row stride lda) x W^T[:, n0:n1). Overwrites C. Single-threaded;
  // the result of an element depends only on m, K and the ISA (not on n0/n1 or on threads).
  void (*gemm_tile)(const float* a, int64_t lda, int64_t m, const WeightMatrix& w, int64_t n0, int64_t n1, float* c,
                    int64_t ldc, float* work);
};

extern const GemmKernels kGemmScalar;  // gemm_scalar.cpp: portable, auto-vectorised
extern const GemmKernels kGemmAvx2;    // gemm_avx2.cpp: AVX2 + FMA + F16C
extern const GemmKernels kGemmAvx512;  // gemm_avx512.cpp: AVX-512 F/BW/VL/DQ + F16C

// Whether this CPU can run `isa` (and this build has it).
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);  // "scalar", "avx2", "avx512"

// The kernels in use: the override when set, else MOEKIT_CPU_ISA (scalar | avx2 | avx512) when set, else the
// best the CPU supports. Throws naming the value when MOEKIT_CPU_ISA is unknown or not supported here.
const GemmKernels& gemm_kernels();
// Forces an ISA (tests, benchmarks); throws when the CPU lacks it. clear_isa_override() restores the default.
void set_isa_override(Isa isa);
void clear_isa_override();

// C[m, N] = A[m, K] x W^T over all columns, split into column tiles run by OpenMP threads.
void gemm(const GemmKernels& kernels, const float* a, int64_t lda, int64_t m, const WeightMatrix& w, float* c,
          int64_t ldc);

}  // namespace moekit::cpu

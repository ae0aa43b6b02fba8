// Run-time choice of the GEMM kernels, and the column-tiled parallel GEMM.
#include "base/gemm.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/parallel.h"
#include "moekit/dtype.h"
#include "moekit/error.h"

namespace moekit::cpu {
namespace {

constexpr int kNoOverride = -1;
std::atomic<int> g_override{kNoOverride};

// clang before 15 cannot ask for f16c (the fuzz build uses clang 14); every CPU with AVX2 has it.
#if defined(__clang__) && __clang_major__ < 15
#define MOEKIT_CPU_F16C() true
#else
#define MOEKIT_CPU_F16C() __builtin_cpu_supports("f16c")
#endif

bool cpu_has(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && MOEKIT_CPU_F16C();
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             MOEKIT_CPU_F16C() && __builtin_cpu_supports("fma");
  }
  return false;
#else
  return isa == Isa::scalar;
#endif
}

const GemmKernels& kernels_of(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return kGemmScalar;
    case Isa::avx2:
      return kGemmAvx2;
    case Isa::avx512:
      return kGemmAvx512;
  }
  return kGemmScalar;
}

Isa best_isa() {
  if (cpu_has(Isa::avx512)) return Isa::avx512;
  if (cpu_has(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

// MOEKIT_CPU_ISA, read once; an unknown or unsupported value is reported at every use.
struct EnvChoice {
  bool set = false;
  Isa isa = Isa::scalar;
  std::string error;
};

const EnvChoice& env_choice() {
  static const EnvChoice choice = [] {
    EnvChoice c;
    const char* v = std::getenv("MOEKIT_CPU_ISA");
    if (!v || !*v) return c;
    const std::string s(v);
    c.set = true;
    if (s == "scalar")
      c.isa = Isa::scalar;
    else if (s == "avx2")
      c.isa = Isa::avx2;
    else if (s == "avx512")
      c.isa = Isa::avx512;
    else
      c.error = "MOEKIT_CPU_ISA='" + s + "' is not an instruction set; expected scalar, avx2 or avx512";
    if (c.error.empty() && !cpu_has(c.isa))
      c.error = "MOEKIT_CPU_ISA=" + s + " but this CPU lacks " +
                (c.isa == Isa::avx2 ? "AVX2/FMA/F16C" : "AVX-512 (F, BW, VL, DQ)") + "; use " + isa_name(best_isa()) +
                " or unset it";
    return c;
  }();
  return choice;
}

}  // namespace

bool isa_supported(Isa isa) { return cpu_has(isa); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  return "?";
}

const GemmKernels& gemm_kernels() {
  const int forced = g_override.load(std::memory_order_relaxed);
  if (forced != kNoOverride) return kernels_of(Isa(forced));
  const EnvChoice& env = env_choice();
  MOEKIT_CHECK_CODE(env.error.empty(), not_supported, env.error);
  if (env.set) return kernels_of(env.isa);
  static const Isa best = best_isa();
  return kernels_of(best);
}

void set_isa_override(Isa isa) {
  MOEKIT_CHECK_CODE(cpu_has(isa), not_supported, "set_isa_override: this CPU cannot run ", isa_name(isa),
                    " kernels; best available is ", isa_name(best_isa()));
  g_override.store(int(isa), std::memory_order_relaxed);
}

WType weight_type(DType t) {
  switch (t) {
    case DType::f32:
      return WType::f32;
    case DType::bf16:
      return WType::bf16;
    case DType::f16:
      return WType::f16;
    default:
      MOEKIT_FAIL(not_supported, "the CPU GEMM takes f32, bf16 or f16 weights, got ", dtype_name(t));
  }
}

void clear_isa_override() { g_override.store(kNoOverride, std::memory_order_relaxed); }

void gemm(const GemmKernels& kern, const float* a, int64_t lda, int64_t m, const WeightMatrix& w, float* c,
          int64_t ldc) {
  if (m <= 0 || w.n <= 0) return;
  const int64_t tiles = (w.n + kern.max_tile_n - 1) / kern.max_tile_n;
  parallel_tasks(tiles, kern.work_floats, m * w.n * w.k, [&](int64_t t, float* work) {
    const int64_t n0 = t * kern.max_tile_n, n1 = std::min(w.n, n0 + kern.max_tile_n);
    kern.gemm_tile(a, lda, m, w, n0, n1, c, ldc, work);
  });
}

}  // namespace moekit::cpu

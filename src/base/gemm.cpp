// Run-time choice of the GEMM kernels, and the column-tiled parallel GEMM.
#include "base/gemm.h"

#include <omp.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/convert.h"
#include "base/env.h"
#include "base/parallel.h"
#include "moekit/dtype.h"
#include "moekit/error.h"
#include "moekit/quant.h"

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

#if defined(__x86_64__)
// CPUID.(EAX=7, ECX=sub):reg bit `bit`.
bool cpuid7(unsigned sub, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(7, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}

// AVX512-BF16 (vdpbf16ps) on top of the avx512 set.
bool has_avx512bf16() { return cpuid7(1, 0, 5); }

// AMX-TILE and AMX-BF16, and the kernel's permission to use the tile data state (asked once per process).
bool has_amx() {
  static const bool ok = [] {
    // AMX-TILE, AMX-BF16 and AVX512-VBMI (the amx ISA's FP8 decode; every AMX CPU has it).
    if (!cpuid7(0, 3, 24) || !cpuid7(0, 3, 22) || !cpuid7(0, 2, 1)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#endif

bool cpu_has(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      MOEKIT_CPU_F16C() && __builtin_cpu_supports("fma");
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && MOEKIT_CPU_F16C();
    case Isa::avx512:
      return avx512;
#if defined(__x86_64__)
    case Isa::avx512bf16:
      return avx512 && has_avx512bf16();
    case Isa::amx:
      return avx512 && has_avx512bf16() && has_amx();
#else
    case Isa::avx512bf16:
    case Isa::amx:
      return false;
#endif
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
    case Isa::avx512bf16: {
      static const GemmKernels k = [] {
        GemmKernels r = kGemmAvx512;
        r.isa = Isa::avx512bf16;
        r.gemm_bf16_tile = &gemm_bf16_tile_avx512bf16;
        return r;
      }();
      return k;
    }
    case Isa::amx: {
      static const GemmKernels k = [] {
        GemmKernels r = kGemmAvx512;
        r.isa = Isa::amx;
        r.gemm_bf16_tile = &gemm_bf16_tile_amx;
        r.gemm_fp8_tile = &gemm_fp8_tile_amx;
        r.gemm_fp8_f32_tile = &gemm_fp8_f32_tile_amx;
        return r;
      }();
      return k;
    }
  }
  return kGemmScalar;
}

Isa best_isa() {
  if (cpu_has(Isa::amx)) return Isa::amx;
  if (cpu_has(Isa::avx512bf16)) return Isa::avx512bf16;
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
    else if (s == "avx512bf16")
      c.isa = Isa::avx512bf16;
    else if (s == "amx")
      c.isa = Isa::amx;
    else
      c.error = "MOEKIT_CPU_ISA='" + s +
                "' is not an instruction set; expected scalar, avx2, avx512, avx512bf16 or amx";
    if (c.error.empty() && !cpu_has(c.isa)) {
      const char* lacks = c.isa == Isa::avx2     ? "AVX2/FMA/F16C"
                          : c.isa == Isa::avx512 ? "AVX-512 (F, BW, VL, DQ)"
                          : c.isa == Isa::avx512bf16
                              ? "AVX-512 (F, BW, VL, DQ) with AVX512-BF16"
                              : "AMX-TILE/AMX-BF16 with AVX512-BF16 (or the OS refused the tile state)";
      c.error = "MOEKIT_CPU_ISA=" + s + " but this CPU lacks " + lacks + "; use " + isa_name(best_isa()) +
                " or unset it";
    }
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
    case Isa::avx512bf16:
      return "avx512bf16";
    case Isa::amx:
      return "amx";
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

int64_t fp8_row_k(int64_t k) { return (k + kFp8K - 1) / kFp8K * kFp8K; }

int64_t fp8_work_doubles(int64_t k) { return kFp8MaxNR * (fp8_row_k(k) + fp8_row_k(k) / kFp8K); }

void fp8_quantize_rows(const float* src, int64_t lds, int64_t m, int64_t k, bool pow2_scales, double* dst,
                       int64_t ldd, float* sa, int64_t ldsa) {
  const int64_t kp = fp8_row_k(k);
  std::vector<float> q(size_t(std::max<int64_t>(k, 1)));
  for (int64_t i = 0; i < m; ++i) {
    quantize_activations_fp8(src + i * lds, k, pow2_scales, q.data(), sa + i * ldsa);
    double* d = dst + i * ldd;
    for (int64_t j = 0; j < k; ++j) d[j] = double(q[size_t(j)]) * 512.0;  // e4m3 value times 2^9: an integer
    for (int64_t j = k; j < kp; ++j) d[j] = 0.0;
  }
}

void plain_rows(const float* src, int64_t lds, int64_t m, int64_t k, double* dst, int64_t ldd, float* sa,
                int64_t ldsa) {
  const int64_t kp = fp8_row_k(k);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k; ++j) dst[i * ldd + j] = double(src[i * lds + j]);
    for (int64_t j = k; j < kp; ++j) dst[i * ldd + j] = 0.0;
    for (int64_t g = 0; g < kp / kFp8K; ++g) sa[i * ldsa + g] = 1.0f;
  }
}

int64_t packed_bf16_k(int64_t k) { return (k + kPackK - 1) / kPackK * kPackK; }

int64_t packed_bf16_elems(int64_t n, int64_t k) { return (n + 15) / 16 * 16 * packed_bf16_k(k); }

void pack_bf16(const WeightMatrix& w, uint16_t* dst) {
  MOEKIT_CHECK(w.type == WType::bf16, "pack_bf16 takes bf16 weights");
  const auto* src = static_cast<const uint16_t*>(w.data);
  const int64_t kp = packed_bf16_k(w.k), panels = (w.n + 15) / 16;
  for (int64_t p = 0; p < panels; ++p) {
    uint16_t* panel = dst + p * kp * 16;
    for (int64_t k = 0; k < kp; ++k) {
      for (int64_t jj = 0; jj < 16; ++jj) {
        const int64_t j = p * 16 + jj;
        uint16_t v = 0;
        if (j < w.n && k < w.k) v = w.transposed ? src[k * w.n + j] : src[j * w.k + k];
        panel[(k / 2) * 32 + jj * 2 + (k & 1)] = v;
      }
    }
  }
}

void rows_to_bf16(const float* src, int64_t lds, int64_t m, int64_t k, uint16_t* dst, int64_t kp) {
  for (int64_t i = 0; i < m; ++i) {
    const float* s = src + i * lds;
    uint16_t* d = dst + i * kp;
    for (int64_t j = 0; j < k; ++j) {  // f32_to_bf16 without branches, so that the loop vectorises
      uint32_t b;
      __builtin_memcpy(&b, s + j, 4);
      const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16, quiet = (b >> 16) | 0x40u;
      d[j] = uint16_t((b & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
    }
    for (int64_t j = k; j < kp; ++j) d[j] = 0;
  }
}

int64_t bf16_tile_m(int64_t m) {
  // Rows per task: whole up to 256, else blocks of 128 (multiples of the AMX 32-row block).
  return m <= 256 ? m : 128;
}

int64_t bf16_task_cols(int64_t n, int64_t row_tasks) {
  // About 8 tasks per thread (dynamic schedule: the imbalance of real routing evens out); MOEKIT_BF16_TASKS=N (1 to
  // 64) sets it for A/B runs (fewer, wider tasks keep more panels of one expert on one core).
  static const int64_t kTasksPerThread = env_int_in("MOEKIT_BF16_TASKS", 1, 64, 8);
  const int64_t blocks = (n + kBf16TileN - 1) / kBf16TileN, want = kTasksPerThread * omp_get_max_threads();
  return std::clamp<int64_t>(blocks * row_tasks / std::max<int64_t>(want, 1), 1, std::max<int64_t>(blocks, 1)) *
         kBf16TileN;
}

void gemm_bf16(const GemmKernels& kern, const uint16_t* a, int64_t lda, int64_t m, const PackedBf16& w, float* c,
               int64_t ldc) {
  MOEKIT_CHECK(kern.gemm_bf16_tile, "gemm_bf16: the ", isa_name(kern.isa), " kernels have no bf16 tile");
  if (m <= 0 || w.n <= 0) return;
  const int64_t tm = bf16_tile_m(m), row_tiles = (m + tm - 1) / tm, tn = bf16_task_cols(w.n, row_tiles);
  const int64_t col_tiles = (w.n + tn - 1) / tn;
  parallel_tasks(row_tiles * col_tiles, 0, m * w.n * w.k, [&](int64_t t, float*) {
    const int64_t r0 = (t / col_tiles) * tm, n0 = (t % col_tiles) * tn;
    kern.gemm_bf16_tile(a + r0 * lda, lda, std::min(tm, m - r0), w, n0, std::min(w.n, n0 + tn),
                        c + r0 * ldc, ldc);
  });
}

}  // namespace moekit::cpu

// Internal: a blocked, multi-threaded f32 GEMM used only to measure the CPU's matrix rate.
#pragma once
#include <cstdint>

namespace moekit::bench {

// c[M, N] = a[M, K] @ b[K, N], row-major f32. AVX2/FMA micro-kernel where the CPU has it.
void gemm_f32(int64_t M, int64_t N, int64_t K, const float* a, const float* b, float* c);

}  // namespace moekit::bench

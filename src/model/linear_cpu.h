// Internal: the CPU matrix product behind DeviceOps::linear (ops_cpu.cpp).
#pragma once
#include <cstdint>

#include "moekit/dtype.h"

namespace moekit::model {

// y [M, N] (f32, row stride N) = x [M, K] (f32, row stride lx) @ w [N, K]^T + bias [N] (null: none).
// w is contiguous in any of f32 | bf16 | f16. Accumulates in f32 in k order; OpenMP over output tiles.
void linear_cpu(const float* x, int64_t lx, int64_t M, int64_t K, const void* w, DType w_dtype, int64_t N,
                const float* bias, float* y);

}  // namespace moekit::model

// Internal: the per-device implementations behind the built-in backends of registry.cpp.
#pragma once
#include <string_view>

#include "moekit/interface.h"

namespace moekit {

// CPU implementations (src/backends/cpu/).
namespace cpu {
Support supports(const Experts& experts, DType act_dtype);  // f32 | bf16 | f16 weights and activations
void eager(const Experts& experts, const ExpertsCall& call);
void batched_mm(const Experts& experts, const ExpertsCall& call);
void grouped_mm(const Experts& experts, const ExpertsCall& call);
}  // namespace cpu

// CUDA implementations (src/backends/cuda/, or cuda_stub.cpp in builds without CUDA).
// `backend` is one of eager, batched_mm, grouped_mm, deepgemm, sonicmoe.
namespace cuda {
Support available(std::string_view backend, Device device);                 // build, device, arch
Support supports(std::string_view backend, const Experts& experts, DType act_dtype);
void run(std::string_view backend, const Experts& experts, const ExpertsCall& call);
}  // namespace cuda

}  // namespace moekit

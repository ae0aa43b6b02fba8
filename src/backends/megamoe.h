// Internal: deepgemm_megamoe's requirements (SPEC section 2), checked in the order the SPEC gives them: an SM100+
// GPU, FP4 experts with UE8M0 scales, an expert-parallel group with ep_size > 1.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "moekit/dtype.h"
#include "moekit/experts.h"

namespace moekit {

// What the checks look at, gathered from a module (megamoe_facts) or given by a test.
struct MegaMoeFacts {
  std::string device;                 // "cpu", "cuda:0 (NVIDIA H200, compute capability 9.0)"
  std::optional<int> arch;            // major * 10 + minor of a usable CUDA device; none on the CPU / no CUDA
  DType weight_dtype = DType::bf16;   // the experts' weights
  std::optional<DType> scale_dtype;   // their block scales (quantized experts): ue8m0 or f32
  int ep_size = 1;                    // the module's expert-parallel group (1: none)
};

// Each unmet requirement, in SPEC order, in words; empty when all are met.
std::vector<std::string> megamoe_missing(const MegaMoeFacts& f);
// The facts of one module: its device, weights, and the group it runs in (set by ParallelExperts).
MegaMoeFacts megamoe_facts(const Experts& experts);

// The expert-parallel group a module runs in, recorded on the module by ParallelExperts before each call.
struct ExpertParallelState : BackendState {
  int ep_size = 1;
};
ExpertParallelState& expert_parallel_state(const Experts& experts);

}  // namespace moekit

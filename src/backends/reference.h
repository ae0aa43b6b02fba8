// Internal: the f64 reference every test compares with (simplest loop, CPU, any flags).
#pragma once
#include <vector>

#include "moekit/experts.h"

namespace moekit {

// Returns out [T, H] in f64. Inputs on the CPU (weights may be on any device: copied).
std::vector<double> reference_forward(const Experts& experts, const TensorView& hidden_states,
                                      const TensorView& top_k_index, const TensorView& top_k_weights);

// Relative L2 error ||a - ref|| / max(||ref||, tiny); +inf when `a` has a NaN or Inf.
double relative_l2(const TensorView& a, const std::vector<double>& ref);
double relative_l2(const std::vector<double>& a, const std::vector<double>& ref);

}  // namespace moekit

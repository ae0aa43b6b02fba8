// Experts case files (weights, inputs, expected outputs, `meta` JSON), as in tests/fixtures/experts.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "moekit/experts.h"

namespace moekit {

struct ExpertsCase {
  Experts experts;  // CPU, weights as stored
  Tensor hidden_states, top_k_index, top_k_weights;
  std::map<std::string, Tensor> outputs;  // "eager", "batched_mm", "grouped_mm" -> [T, H]
  std::string expected_name;              // the output compared against (eager when present)
  Tensor expected;
  std::vector<double> expected_values;
  std::string meta_json;
};

ExpertsCase load_experts_case(const std::string& path);
// The f64 reference output [T, H] of the case's inputs (weights as stored).
std::vector<double> reference_output(const ExpertsCase& c);
// ||a - ref|| / ||ref|| as the tests measure it; +inf when `a` has a NaN or Inf.
double relative_error(const TensorView& a, const std::vector<double>& ref);
// Fills a floating tensor (CPU or CUDA) with NaN so unwritten outputs show.
void poison_tensor(Tensor& t);

}  // namespace moekit

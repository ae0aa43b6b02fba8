// Internal: the data of a benchmark case (random experts, routed inputs) and its reference check.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "moekit/experts.h"

namespace moekit::bench {

// Weights and biases normal(0, 0.02) in `dtype`, made on `device` (on the GPU by a kernel); with `quant` (fp8, fp4,
// mxfp4) the weights are then quantized into that format ([E, out, in]).
Experts make_random_experts(const ShapePreset& shape, DType dtype, Device device, uint64_t seed,
                            const std::string& quant = "");

// One input set of a case. The host copies are kept only where the reference check needs them.
struct InputSet {
  Tensor hidden_states;  // [T, H] dtype, on the device
  Tensor top_k_index;    // [T, K] index dtype, on the device
  Tensor top_k_weights;  // [T, K] dtype, on the device
  Tensor out;            // [T, H] dtype, on the device
  Tensor host_hidden_states, host_top_k_index, host_top_k_weights;  // CPU copies (set 0 only)
  int64_t experts_touched = 0;  // distinct experts hit by this set's routing
  ExpertsCall call(Stream stream) const {
    return {hidden_states.view(), top_k_index.view(), top_k_weights.view(), out.view(), stream};
  }
};
// hidden_states normal(0, 1); routing: K distinct experts per token (uniform or skewed), weights the
// softmax of normal logits. `popularity` is the skewed routing's expert order (a permutation of E).
InputSet make_input_set(const ShapePreset& shape, int64_t tokens, DType dtype, DType index_dtype, Routing routing,
                        const std::vector<int64_t>& popularity, Device device, uint64_t seed, bool keep_host);

// NaN in every byte pattern of f32, bf16 and f16 (all bits set), so unwritten outputs are caught.
void poison_output(Tensor& out, Stream stream);

// The f64 reference on a subsample of rows of an input set: only the experts those rows hit are
// copied to the host, and the rows are computed in parallel.
struct ReferenceRows {
  std::vector<int64_t> rows;  // indices into [0, T)
  std::vector<double> values;  // [rows, H]
};
// Rows evenly spread over [0, T), first and last included; as many as fit in `max_macs` of work (at least one; none
// when max_macs <= 0).
ReferenceRows reference_rows(const Experts& experts, const ShapePreset& shape, const InputSet& set, int64_t max_macs);

// Relative L2 error of `out`'s checked rows against the reference; +inf, with `problem` set, when
// any element of `out` is NaN or Inf (an unwritten row keeps its poison).
double check_output(const ReferenceRows& ref, const Tensor& out, std::string& problem);

}  // namespace moekit::bench

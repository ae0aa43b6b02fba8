// FP8 experts problems for the CPU and CUDA quantized-experts tests: random float experts of a ProblemConfig,
// their weights quantized to e4m3 in 128 x 128 blocks (f32 or UE8M0 scales), inputs and the f64 reference.
#pragma once

#include <random>

#include "moekit/quant.h"
#include "test_experts_problem.h"

namespace moekit::test {

// biases_in_act_dtype: the CUDA FP8 path takes biases in the activations' dtype (the CPU path in any float dtype).
inline ExpertsProblem make_fp8_problem(ProblemConfig c, uint64_t seed, DType scale_dtype,
                                       bool biases_in_act_dtype = false) {
  std::mt19937_64 rng(seed);
  c.wdt = DType::f32;
  const Experts f = make_experts(c, rng);
  ExpertsWeights w = f.weights();
  auto [q1, s1] = quantize_fp8(w.first(), scale_dtype, c.has_gate ? 2 : 1);
  auto [q2, s2] = quantize_fp8(w.down_proj, scale_dtype);
  (c.has_gate ? w.gate_up_proj : w.up_proj) = q1;
  (c.has_gate ? w.gate_up_proj_scale_inv : w.up_proj_scale_inv) = s1;
  w.down_proj = q2;
  w.down_proj_scale_inv = s2;
  if (biases_in_act_dtype && c.has_bias && c.act != DType::f32) {
    for (Tensor* b : {&w.gate_up_proj_bias, &w.up_proj_bias, &w.down_proj_bias})
      if (b->defined()) *b = b->to(c.act);
  }
  ExpertsProblem p;
  p.config = c;
  p.experts = Experts(f.spec(), w, "grouped_mm");
  make_inputs(c, rng, p);
  p.reference = reference_forward(p.experts, p.hidden_states, p.top_k_index, p.top_k_weights);
  return p;
}

}  // namespace moekit::test

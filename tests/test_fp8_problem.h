// FP8 and FP4 experts problems for the CPU and CUDA quantized-experts tests: random float experts of a
// ProblemConfig, their weights quantized to e4m3 in 128 x 128 blocks (f32 or UE8M0 scales) or to e2m1 with a ue8m0
// scale per row and 32 inputs, inputs and the f64 reference.
#pragma once

#include <random>
#include <utility>
#include <vector>

#include "moekit/quant.h"
#include "test_experts_problem.h"

namespace moekit::test {

// Random float experts of `c` with their projections replaced by quantize(weight, segments) (segments: 2 for
// a fused gate_up, else 1), inputs and the f64 reference. biases_in_act_dtype: the CUDA quantized paths take
// biases in the activations' dtype (the CPU path in any float dtype).
template <class Quantize>
ExpertsProblem make_quantized_problem(ProblemConfig c, uint64_t seed, Quantize quantize, bool fp4_float_acts,
                                      bool biases_in_act_dtype) {
  std::mt19937_64 rng(seed);
  c.wdt = DType::f32;
  const Experts f = make_experts(c, rng);
  ExpertsWeights w = f.weights();
  auto [q1, s1] = quantize(w.first(), c.has_gate ? 2 : 1);
  auto [q2, s2] = quantize(w.down_proj, 1);
  (c.has_gate ? w.gate_up_proj : w.up_proj) = q1;
  (c.has_gate ? w.gate_up_proj_scale_inv : w.up_proj_scale_inv) = s1;
  w.down_proj = q2;
  w.down_proj_scale_inv = s2;
  w.fp4_float_activations = fp4_float_acts;
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

// FP8 experts: e4m3 in 128 x 128 blocks with `scale_dtype` scales (f32 or ue8m0).
inline ExpertsProblem make_fp8_problem(ProblemConfig c, uint64_t seed, DType scale_dtype,
                                       bool biases_in_act_dtype = false) {
  auto quantize = [&](const Tensor& t, int64_t segments) { return quantize_fp8(t, scale_dtype, segments); };
  return make_quantized_problem(c, seed, quantize, false, biases_in_act_dtype);
}

// The FP8 cases both devices' sweeps start from (each scale dtype given beside its problem).
inline std::vector<std::pair<ProblemConfig, DType>> fp8_common_cases() {
  std::vector<std::pair<ProblemConfig, DType>> v;
  auto add = [&](ProblemConfig c, DType s = DType::f32) { v.push_back({c, s}); };
  add({.T = 5, .E = 3, .K = 2, .H = 32, .I = 24});                                    // K < 128, I % 16 != 0
  add({.T = 9, .E = 5, .K = 3, .H = 200, .I = 136, .sentinels = true});               // partial blocks, odd E
  add({.T = 1, .E = 4, .K = 2, .H = 256, .I = 128});                                  // exact blocks, decode
  add({.T = 33, .E = 7, .K = 2, .H = 130, .I = 72, .empty_experts = true});           // many rows per expert
  add({.T = 6, .E = 3, .K = 2, .H = 96, .I = 40, .has_bias = true});                  // biases
  add({.T = 7, .E = 5, .K = 2, .H = 160, .I = 200, .has_gate = false, .activation = Activation::relu2});
  add({.T = 8, .E = 4, .K = 2, .H = 144, .I = 64, .sentinel_every = 3}, DType::ue8m0);  // UE8M0 scales
  add({.act = DType::bf16, .rwt = DType::bf16, .idt = DType::i32, .T = 11, .E = 5, .K = 2, .H = 200, .I = 96});
  add({.act = DType::f16, .T = 4, .E = 3, .K = 2, .H = 64, .I = 48});
  return v;
}

// FP4 experts (e2m1, one ue8m0 scale per row and 32 inputs; H and I multiples of 32): float_acts runs them as
// MXFP4 (activations as they are), else with activations quantized to FP8 (FP4 with UE8M0 scales).
inline ExpertsProblem make_fp4_case(ProblemConfig c, uint64_t seed, bool float_acts, bool biases_in_act_dtype = false) {
  auto quantize = [](const Tensor& t, int64_t) { return quantize_fp4(t); };
  return make_quantized_problem(c, seed, quantize, float_acts, biases_in_act_dtype);
}

}  // namespace moekit::test

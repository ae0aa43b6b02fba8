// Helpers of the backend tests: a random Experts problem (weights, routing with sentinels and empty experts,
// inputs) and its f64 reference.
#pragma once
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backends/reference.h"
#include "test_util.h"

namespace moekit::test {

struct ProblemConfig {
  DType act = DType::f32;  // hidden_states (and output)
  DType wdt = DType::f32;  // expert weights and biases
  DType rwt = DType::f32;  // top_k_weights
  DType idt = DType::i64;  // top_k_index
  int64_t T = 5, E = 4, K = 2, H = 32, I = 24;
  bool has_gate = true, has_bias = false, transposed = false, concatenated = true;
  GateKind gate = GateKind::act_mul;
  Activation activation = Activation::silu;
  bool sentinels = false;      // about a quarter of the slots get id E, with a NaN routing weight
  bool empty_experts = false;  // tokens only go to the even experts
  std::string to_string() const {
    std::string s = std::string("act=") + dtype_name(act) + " w=" + dtype_name(wdt) + " rw=" + dtype_name(rwt) +
                    " idx=" + dtype_name(idt) + " T=" + std::to_string(T) + " E=" + std::to_string(E) +
                    " K=" + std::to_string(K) + " H=" + std::to_string(H) + " I=" + std::to_string(I);
    s += has_gate ? (gate == GateKind::clamped_swiglu ? " clamped_swiglu"
                     : gate == GateKind::custom       ? " custom_gate"
                                                      : " gated")
                  : " no_gate";
    s += std::string(" ") + activation_name(activation);
    if (has_bias) s += " bias";
    if (transposed) s += " transposed";
    if (has_gate && !concatenated) s += " interleaved";
    if (sentinels) s += " sentinels";
    if (empty_experts) s += " empty_experts";
    return s;
  }
};

struct ExpertsProblem {
  Experts experts;  // CPU
  Tensor hidden_states, top_k_index, top_k_weights;
  std::vector<double> reference;  // [T, H]
};

// Relative L2 tolerance against the f64 reference, by activation dtype.
inline double tolerance_for(DType act) { return act == DType::f32 ? 1e-5 : act == DType::f16 ? 5e-3 : 1e-2; }

// A gate only a model could define: tanh(gate) * up + gate / 4.
inline void custom_gate_fn(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::tanh(g[i]) * u[i] + 0.25f * g[i];
}

inline ExpertsProblem make_problem(const ProblemConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ExpertsSpec s;
  s.num_experts = c.E;
  s.hidden = c.H;
  s.intermediate = c.I;
  s.activation = c.activation;
  s.has_gate = c.has_gate;
  s.has_bias = c.has_bias;
  s.is_transposed = c.transposed;
  s.is_concatenated = c.concatenated;
  s.gate = c.gate;
  if (c.gate == GateKind::clamped_swiglu) s.limit = 0.8f;  // small, so the clamps act on N(0, 1) values
  if (c.gate == GateKind::custom) s.custom_gate = custom_gate_fn;
  const int64_t E = c.E, H = c.H, I = c.I, N1 = c.has_gate ? 2 * I : I;
  ExpertsWeights w;
  Tensor first = randn(c.transposed ? Shape{E, H, N1} : Shape{E, N1, H}, c.wdt, rng, 1.0 / std::sqrt(double(H)));
  (c.has_gate ? w.gate_up_proj : w.up_proj) = first;
  w.down_proj = randn(c.transposed ? Shape{E, I, H} : Shape{E, H, I}, c.wdt, rng, 1.0 / std::sqrt(double(I)));
  if (c.has_bias) {
    (c.has_gate ? w.gate_up_proj_bias : w.up_proj_bias) = randn({E, N1}, c.wdt, rng, 0.5);
    w.down_proj_bias = randn({E, H}, c.wdt, rng, 0.5);
  }
  ExpertsProblem p;
  p.experts = Experts(s, w, "eager");
  p.hidden_states = randn({c.T, H}, c.act, rng);

  std::vector<int64_t> allowed;
  for (int64_t e = 0; e < E; ++e)
    if (!c.empty_experts || e % 2 == 0) allowed.push_back(e);
  if (int64_t(allowed.size()) < c.K)
    for (int64_t e = 0; e < E; ++e) allowed.push_back(e);  // duplicates are harmless; distinct below
  Tensor idx = Tensor::empty({c.T, c.K}, DType::i64), rw = Tensor::empty({c.T, c.K}, DType::f32);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<int64_t> pool = allowed;
    std::shuffle(pool.begin(), pool.end(), rng);
    std::vector<int64_t> chosen;
    for (int64_t e : pool)
      if (int64_t(chosen.size()) < c.K && std::find(chosen.begin(), chosen.end(), e) == chosen.end())
        chosen.push_back(e);
    float sum = 0;
    for (int64_t k = 0; k < c.K; ++k) {
      int64_t e = chosen[size_t(k)];
      float wt = u(rng);
      if (c.sentinels && rng() % 4 == 0) {
        e = E;
        wt = NAN;  // skipped entirely, so even a NaN weight must not reach the output
      } else {
        sum += wt;
      }
      idx.ptr<int64_t>()[t * c.K + k] = e;
      rw.ptr<float>()[t * c.K + k] = wt;
    }
    for (int64_t k = 0; k < c.K; ++k)
      if (sum > 0 && idx.ptr<int64_t>()[t * c.K + k] != E) rw.ptr<float>()[t * c.K + k] /= sum;
  }
  if (c.idt == DType::i32) {
    Tensor i32 = Tensor::empty({c.T, c.K}, DType::i32);
    for (int64_t i = 0; i < c.T * c.K; ++i) i32.ptr<int32_t>()[i] = int32_t(idx.ptr<int64_t>()[i]);
    p.top_k_index = i32;
  } else {
    p.top_k_index = idx;
  }
  p.top_k_weights = rw.to(c.rwt);
  p.reference = reference_forward(p.experts, p.hidden_states, p.top_k_index, p.top_k_weights);
  return p;
}

}  // namespace moekit::test

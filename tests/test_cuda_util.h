// Helpers of the CUDA tests: random experts and routing (sentinels, empty experts), tolerances.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/reference.h"
#include "moekit/cuda_graph.h"
#include "test_util.h"

namespace moekit::test {

// Built with CUDA, a device present and usable by the portable backends.
inline bool have_cuda() {
  if (!cuda_available()) return false;
  return ExpertsInterface::global().get("grouped_mm")->available(Device::cuda(0)).ok;
}

#define MOEKIT_SKIP_WITHOUT_CUDA() \
  if (!::moekit::test::have_cuda()) GTEST_SKIP() << "no usable CUDA device (or moekit built without CUDA)"

// Relative L2 tolerance against the f64 reference.
inline double cuda_tolerance(DType t) { return t == DType::f32 ? 1e-5 : t == DType::f16 ? 5e-3 : 1e-2; }

struct ExpertsConfig {
  int64_t experts = 8, hidden = 64, inter = 32;
  DType dtype = DType::bf16;
  bool has_gate = true, has_bias = false, transposed = false, concatenated = true;
  GateKind gate = GateKind::act_mul;
  Activation act = Activation::silu;
  std::string to_string() const {
    return "E=" + std::to_string(experts) + " H=" + std::to_string(hidden) + " I=" + std::to_string(inter) + " " +
           dtype_name(dtype) + " gate=" + std::to_string(has_gate) + " bias=" + std::to_string(has_bias) +
           " transposed=" + std::to_string(transposed) + " concat=" + std::to_string(concatenated) +
           (gate == GateKind::clamped_swiglu ? " clamped_swiglu" : "") + " act=" + activation_name(act);
  }
};

// CPU experts with weights scaled so every stage has values of order one.
inline Experts make_random_experts(const ExpertsConfig& c, std::mt19937_64& rng) {
  ExpertsSpec s;
  s.num_experts = c.experts;
  s.hidden = c.hidden;
  s.intermediate = c.inter;
  s.activation = c.act;
  s.has_gate = c.has_gate;
  s.has_bias = c.has_bias;
  s.is_transposed = c.transposed;
  s.is_concatenated = c.concatenated;
  s.gate = c.gate;
  const int64_t E = c.experts, H = c.hidden, I = c.inter, N1 = c.has_gate ? 2 * I : I;
  const double s1 = 1.0 / std::sqrt(double(H)), s2 = 1.0 / std::sqrt(double(I));
  ExpertsWeights w;
  Tensor first = randn(c.transposed ? Shape{E, H, N1} : Shape{E, N1, H}, c.dtype, rng, s1);
  (c.has_gate ? w.gate_up_proj : w.up_proj) = first;
  w.down_proj = randn(c.transposed ? Shape{E, I, H} : Shape{E, H, I}, c.dtype, rng, s2);
  if (c.has_bias) {
    (c.has_gate ? w.gate_up_proj_bias : w.up_proj_bias) = randn({E, N1}, c.dtype, rng, 0.2);
    w.down_proj_bias = randn({E, H}, c.dtype, rng, 0.2);
  }
  return Experts(s, w, "eager");
}

struct RoutedInputs {
  Tensor x, index, weights;  // CPU: [T, H], [T, K], [T, K]
};

// Random routing over `used` of the E experts (a random subset: the others stay empty). Every
// `sentinel_every`-th pair (0: none) gets the sentinel id E with a non-zero weight, and with sentinels
// token 0 has only sentinels (its output must be exactly zero).
inline RoutedInputs make_routed_inputs(int64_t T, int64_t K, int64_t E, int64_t H, int64_t used, int64_t sentinel_every,
                                       DType act, DType index_dtype, DType weight_dtype, std::mt19937_64& rng) {
  RoutedInputs in;
  in.x = randn({T, H}, act, rng, 1.0);
  Tensor idx, w;
  random_routing(T, K, std::max<int64_t>(1, std::min(used, E)), DType::i64, DType::f32, rng, idx, w);
  std::vector<int64_t> perm(static_cast<size_t>(E));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t p = 0; p < T * K; ++p) {
    int64_t& id = idx.ptr<int64_t>()[p];
    id = perm[size_t(id)];
    if (sentinel_every > 0 && (p % sentinel_every == sentinel_every - 1 || p < K)) id = E;
  }
  Tensor idx_out = Tensor::empty({T, K}, index_dtype);
  for (int64_t p = 0; p < T * K; ++p) {
    if (index_dtype == DType::i32) idx_out.ptr<int32_t>()[p] = int32_t(idx.ptr<int64_t>()[p]);
    else idx_out.ptr<int64_t>()[p] = idx.ptr<int64_t>()[p];
  }
  in.index = idx_out;
  in.weights = w.to(weight_dtype);
  return in;
}

// Runs `backend` on CUDA copies of the inputs, output poisoned first; returns the output on the CPU.
inline Tensor run_on_cuda(const Experts& cuda_experts, const std::string& backend, const RoutedInputs& in) {
  const Device dev = cuda_experts.device();
  Tensor x = in.x.to(dev), idx = in.index.to(dev), w = in.weights.to(dev);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), dev);
  if (out.numel() > 0) poison(out);
  cuda_experts.forward_with(backend, ExpertsCall{x.view(), idx.view(), w.view(), out.view(), nullptr});
  return out.to(Device::cpu());
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

}  // namespace moekit::test

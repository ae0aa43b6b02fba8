// The one harness of the backend tests: a random Experts problem (weights, routing with sentinels and empty
// experts, inputs) and its f64 reference; the devices present; and the differential loop that runs every
// registered backend that runs on a device and compares it with the reference under experts_tolerance().
// A backend registered in the ExpertsInterface is picked up with no edit here.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/reference.h"
#include "moekit/cuda_graph.h"
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
  float limit = 0.8f;     // clamped_swiglu: small, so the clamps act on values of order one
  double bias_std = 0.5;  // biases ~ N(0, bias_std)
  // Routing: each token picks K distinct experts among the allowed ones (cycling when fewer than K).
  bool empty_experts = false;  // only the even experts get tokens
  int64_t used = 0;            // > 0: only a random subset of `used` experts gets tokens
  bool sentinels = false;      // about a quarter of the slots get id E, with a NaN routing weight
  int64_t sentinel_every = 0;  // > 0: every n-th pair gets id E (its weight kept), and token 0 only E
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
    if (empty_experts) s += " empty_experts";
    if (used > 0) s += " used=" + std::to_string(used);
    if (sentinels) s += " sentinels";
    if (sentinel_every > 0) s += " sentinel_every=" + std::to_string(sentinel_every);
    return s;
  }
};

struct ExpertsProblem {
  ProblemConfig config;
  Experts experts;  // CPU
  Tensor hidden_states, top_k_index, top_k_weights;  // CPU
  std::vector<double> reference;  // [T, H]
};

// A gate only a model could define: tanh(gate) * up + gate / 4.
inline void custom_gate_fn(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::tanh(g[i]) * u[i] + 0.25f * g[i];
}

// CPU experts of `c` with weights scaled so every stage has values of order one.
inline Experts make_experts(const ProblemConfig& c, std::mt19937_64& rng) {
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
  if (c.gate == GateKind::clamped_swiglu) s.limit = c.limit;
  if (c.gate == GateKind::custom) s.custom_gate = custom_gate_fn;
  const int64_t E = c.E, H = c.H, I = c.I, N1 = c.has_gate ? 2 * I : I;
  ExpertsWeights w;
  Tensor first = randn(c.transposed ? Shape{E, H, N1} : Shape{E, N1, H}, c.wdt, rng, 1.0 / std::sqrt(double(H)));
  (c.has_gate ? w.gate_up_proj : w.up_proj) = first;
  w.down_proj = randn(c.transposed ? Shape{E, I, H} : Shape{E, H, I}, c.wdt, rng, 1.0 / std::sqrt(double(I)));
  if (c.has_bias) {
    (c.has_gate ? w.gate_up_proj_bias : w.up_proj_bias) = randn({E, N1}, c.wdt, rng, c.bias_std);
    w.down_proj_bias = randn({E, H}, c.wdt, rng, c.bias_std);
  }
  return Experts(s, w, "eager");
}

// Routing and hidden states of `c` for experts of c.E experts (CPU tensors), into p.
inline void make_inputs(const ProblemConfig& c, std::mt19937_64& rng, ExpertsProblem& p) {
  const int64_t E = c.E, K = c.K;
  p.hidden_states = randn({c.T, c.H}, c.act, rng);
  std::vector<int64_t> allowed;
  if (c.used > 0) {
    std::vector<int64_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    allowed.assign(perm.begin(), perm.begin() + std::min(c.used, E));
  } else {
    for (int64_t e = 0; e < E; ++e)
      if (!c.empty_experts || e % 2 == 0) allowed.push_back(e);
  }
  Tensor idx = Tensor::empty({c.T, K}, DType::i64), rw = Tensor::empty({c.T, K}, DType::f32);
  int64_t* ids = idx.ptr<int64_t>();
  float* wts = rw.ptr<float>();
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<int64_t> pool = allowed;
    std::shuffle(pool.begin(), pool.end(), rng);
    float sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t p_ = t * K + k;
      ids[p_] = pool[size_t(k) % pool.size()];
      wts[p_] = u(rng);
      if (c.sentinels && rng() % 4 == 0) {
        ids[p_] = E;
        wts[p_] = NAN;  // skipped entirely, so even a NaN weight must not reach the output
        continue;
      }
      sum += wts[p_];
      if (c.sentinel_every > 0 && (p_ % c.sentinel_every == c.sentinel_every - 1 || t == 0)) ids[p_] = E;
    }
    for (int64_t k = 0; k < K; ++k)
      if (sum > 0 && !std::isnan(wts[t * K + k])) wts[t * K + k] /= sum;
  }
  if (c.idt == DType::i32) {
    Tensor i32 = Tensor::empty({c.T, K}, DType::i32);
    for (int64_t i = 0; i < c.T * K; ++i) i32.ptr<int32_t>()[i] = int32_t(ids[i]);
    p.top_k_index = i32;
  } else {
    p.top_k_index = idx;
  }
  p.top_k_weights = rw.to(c.rwt);
}

// The one random-problem generator: experts, inputs and the f64 reference.
inline ExpertsProblem make_problem(const ProblemConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ExpertsProblem p;
  p.config = c;
  p.experts = make_experts(c, rng);
  make_inputs(c, rng, p);
  p.reference = reference_forward(p.experts, p.hidden_states, p.top_k_index, p.top_k_weights);
  return p;
}

// The CUDA tests' default case: bf16 experts (E = 8, H = 64, I = 32), biases ~ N(0, 0.2), gpt-oss's clamp
// limit; no tokens.
inline ProblemConfig cuda_case() {
  return {.act = DType::bf16, .wdt = DType::bf16, .T = 0, .E = 8, .K = 1, .H = 64, .I = 32, .limit = 7.0f,
          .bias_std = 0.2};
}

// ---- devices ----

// Built with CUDA, a device present and usable by the CUDA kernels of this build.
inline bool have_cuda() {
  if (!cuda_available()) return false;
  return ExpertsInterface::global().get(default_experts_implementation(Device::cuda(0)))->available(Device::cuda(0)).ok;
}

#define MOEKIT_SKIP_WITHOUT_CUDA() \
  if (!::moekit::test::have_cuda()) GTEST_SKIP() << "no usable CUDA device (or moekit built without CUDA)"

// The CPU, and cuda:0 when present.
inline std::vector<Device> test_devices() {
  std::vector<Device> d{Device::cpu()};
  if (have_cuda()) d.push_back(Device::cuda(0));
  return d;
}

// The registered backends that are available on `device`, in registry order.
inline std::vector<BackendPtr> backends_on(Device device) {
  std::vector<BackendPtr> out;
  for (const auto& b : ExpertsInterface::global().backends())
    if (b->available(device)) out.push_back(b);
  return out;
}

// ---- running and comparing ----

// Runs `backend` on `experts` (on their device) with copies of the inputs there, the output poisoned first;
// returns the output on the CPU.
inline Tensor run_backend(const Experts& experts, std::string_view backend, const Tensor& hidden_states,
                          const Tensor& top_k_index, const Tensor& top_k_weights) {
  const Device dev = experts.device();
  const Tensor x = hidden_states.to(dev), idx = top_k_index.to(dev), w = top_k_weights.to(dev);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), dev);
  if (out.numel() > 0) poison(out);
  experts.forward_with(backend, ExpertsCall{x.view(), idx.view(), w.view(), out.view(), nullptr});
  stream_synchronize(nullptr, dev);
  return out.to(Device::cpu());
}
inline Tensor run_backend(const Experts& experts, std::string_view backend, const ExpertsProblem& p) {
  return run_backend(experts, backend, p.hidden_states, p.top_k_index, p.top_k_weights);
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// "" when `out` (CPU) matches the problem: shape, relative L2 error within experts_tolerance(), and with
// sentinel_every, token 0 (only sentinel slots) exactly +0. Otherwise what is wrong.
inline std::string compare_with_reference(const ExpertsProblem& p, const Tensor& out, double* err_out = nullptr) {
  const ProblemConfig& c = p.config;
  if (out.shape() != Shape{c.T, c.H}) return "output shape " + shape_to_string(out.shape());
  const double err = relative_l2(out.view(), p.reference), tol = experts_tolerance(c.act);
  if (err_out) *err_out = err;
  if (!(err <= tol)) return "rel L2 " + std::to_string(err) + " > " + std::to_string(tol);
  if (c.sentinel_every > 0 && c.T > 0)
    for (int64_t h = 0; h < c.H; ++h) {
      const double v = load_as_f64(out.data(), out.dtype(), h);
      if (v != 0.0 || std::signbit(v)) return "all-sentinel token has out[0, " + std::to_string(h) + "] = " + std::to_string(v);
    }
  return "";
}

struct Outcome {
  int ok = 0, fail = 0, unsupported = 0;
  std::map<std::string, int> ran, failed;  // per backend label
};

// Runs one backend (by name; `label` names it in the report) on the problem's experts moved to their device
// and compares with the reference. `report`: a mismatch is a test failure (else only counted).
inline void check_backend(const ExpertsProblem& p, const Experts& experts, const std::string& name,
                          const std::string& label, Outcome& outcome, bool report = true) {
  const std::string where = experts.device().to_string();
  const Support s = ExpertsInterface::global().get(name)->supports(experts, p.config.act);
  if (!s) {
    ++outcome.unsupported;
    std::printf("  %-16s %-7s %s  NOT SUPPORTED (%s)\n", label.c_str(), where.c_str(), p.config.to_string().c_str(),
                s.reason.c_str());
    return;
  }
  std::string problem;
  double err = 0;
  try {
    problem = compare_with_reference(p, run_backend(experts, name, p), &err);
  } catch (const std::exception& e) {
    problem = std::string("error: ") + e.what();
  }
  const bool ok = problem.empty();
  ok ? ++outcome.ok : ++outcome.fail;
  ++outcome.ran[label];
  if (!ok) ++outcome.failed[label];
  std::printf("  %-16s %-7s %s  %s (rel L2 %.2e, tolerance %.0e) %s\n", label.c_str(), where.c_str(),
              p.config.to_string().c_str(), ok ? "OK" : "FAIL", err, experts_tolerance(p.config.act), problem.c_str());
  if (report) EXPECT_TRUE(ok) << label << " on " << where << ": " << p.config.to_string() << ": " << problem;
}

// The differential loop: every registered backend available on `device` runs the problem.
inline void check_backends_on(const ExpertsProblem& p, Device device, Outcome& outcome, bool report = true) {
  const Experts experts = p.experts.to(device);
  for (const auto& b : backends_on(device)) {
    const std::string name(b->name());
    check_backend(p, experts, name, name, outcome, report);
  }
}

// The same on every device present.
inline void run_all_backends(const ProblemConfig& cfg, uint64_t seed, Outcome& outcome, bool report = true) {
  const ExpertsProblem p = make_problem(cfg, seed);
  for (const Device dev : test_devices()) check_backends_on(p, dev, outcome, report);
}

}  // namespace moekit::test

// Runs moekit's Experts forward on random weights, with every backend that runs here, and compares it
// with the plain loop below (SwiGLU experts in transformers' layout). Exits 0 when all agree.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <moekit/moekit.h>
#include <moekit/version.h>

namespace {

constexpr int64_t E = 4, H = 16, I = 8, T = 5, K = 2;

// out[t] = sum_k w[t,k] * down_e(silu(gate_e(x)) * up_e(x)), gate_up [E, 2I, H] (gate rows first), down [E, H, I].
std::vector<double> simple_loop(const std::vector<float>& x, const std::vector<float>& gate_up,
                                const std::vector<float>& down, const std::vector<int64_t>& idx,
                                const std::vector<float>& w) {
  std::vector<double> out(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = idx[t * K + k];
      std::vector<double> act(I);
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int64_t h = 0; h < H; ++h) {
          g += double(gate_up[(e * 2 * I + i) * H + h]) * x[t * H + h];
          u += double(gate_up[(e * 2 * I + I + i) * H + h]) * x[t * H + h];
        }
        act[i] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t h = 0; h < H; ++h) {
        double y = 0;
        for (int64_t i = 0; i < I; ++i) y += double(down[(e * H + h) * I + i]) * act[i];
        out[t * H + h] += w[t * K + k] * y;
      }
    }
  }
  return out;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto randn = [&](size_t n, float scale) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal(rng) * scale;
    return v;
  };
  std::vector<float> gate_up = randn(E * 2 * I * H, 0.3f), down = randn(E * H * I, 0.3f), x = randn(T * H, 1.0f);
  std::vector<int64_t> idx(T * K);
  std::vector<float> w(T * K);
  for (int64_t t = 0; t < T; ++t) {
    idx[t * K] = t % E;
    idx[t * K + 1] = (t + 1) % E;
    w[t * K] = 0.75f;
    w[t * K + 1] = 0.25f;
  }

  moekit::ExpertsSpec spec;
  spec.num_experts = E;
  spec.hidden = H;
  spec.intermediate = I;
  moekit::ExpertsWeights weights;
  weights.gate_up_proj = moekit::Tensor::wrap(moekit::TensorView(gate_up.data(), moekit::DType::f32, {E, 2 * I, H}), nullptr);
  weights.down_proj = moekit::Tensor::wrap(moekit::TensorView(down.data(), moekit::DType::f32, {E, H, I}), nullptr);
  moekit::Experts experts(spec, weights);

  const moekit::TensorView xv(x.data(), moekit::DType::f32, {T, H});
  const moekit::TensorView iv(idx.data(), moekit::DType::i64, {T, K});
  const moekit::TensorView wv(w.data(), moekit::DType::f32, {T, K});
  const std::vector<double> want = simple_loop(x, gate_up, down, idx, w);

  int failures = 0, ran = 0;
  for (const auto& backend : moekit::ExpertsInterface::global().backends()) {
    if (!backend->supports(experts, moekit::DType::f32)) continue;
    experts.set_implementation(std::string(backend->name()));
    const moekit::Tensor out = experts.forward(xv, iv, wv);
    double err = 0, ref = 0;
    for (int64_t i = 0; i < T * H; ++i) {
      const double d = double(out.ptr<float>()[i]) - want[i];
      err += d * d;
      ref += want[i] * want[i];
    }
    const double rel = std::sqrt(err / ref);
    const bool ok = rel < 1e-5;
    std::printf("moekit %s, %-12s relative error %.3g %s\n", MOEKIT_VERSION_STRING,
                std::string(backend->name()).c_str(), rel, ok ? "OK" : "FAIL");
    failures += !ok;
    ++ran;
  }
  if (ran == 0) {
    std::printf("no backend ran\n");
    return 1;
  }
  return failures == 0 ? 0 : 1;
}

#include "backends/reference.h"

#include <cmath>
#include <limits>

#include "backends/gate.h"

namespace moekit {

std::vector<double> reference_forward(const Experts& experts, const TensorView& x, const TensorView& idx,
                                      const TensorView& w) {
  const ExpertsSpec& s = experts.spec();
  const Experts host = experts.device().is_cpu() ? experts : experts.to(Device::cpu());
  const ExpertsWeights& W = host.weights();
  const Tensor xc = Tensor::copy_of(x, Device::cpu()), ic = Tensor::copy_of(idx, Device::cpu()),
               wc = Tensor::copy_of(w, Device::cpu());
  const int64_t T = x.shape[0], K = idx.dim() == 2 ? idx.shape[1] : 0, H = s.hidden, I = s.intermediate,
                E = s.num_experts;
  const int64_t N1 = s.has_gate ? 2 * I : I;  // width of the first projection
  const TensorView& w1 = W.first().view();
  const TensorView& w2 = W.down_proj.view();
  std::vector<double> out(static_cast<size_t>(T * H), 0.0), xrow(static_cast<size_t>(H)), h1(static_cast<size_t>(N1)),
      act(static_cast<size_t>(I));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) xrow[size_t(h)] = load_as_f64(xc.data(), xc.dtype(), t * H + h);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = int64_t(load_as_f64(ic.data(), ic.dtype(), t * K + k));
      MOEKIT_CHECK(e >= 0 && e <= E, "top_k_index[", t, ", ", k, "] = ", e, " out of range [0, ", E, "]");
      if (e == E) continue;  // expert on another rank: contributes zero
      const double rw = load_as_f64(wc.data(), wc.dtype(), t * K + k);
      for (int64_t n = 0; n < N1; ++n) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t off = s.is_transposed ? (e * H + h) * N1 + n : (e * N1 + n) * H + h;
          acc += xrow[size_t(h)] * load_as_f64(w1.data, w1.dtype, off);
        }
        if (s.has_bias) acc += load_as_f64(W.first_bias().data(), W.first_bias().dtype(), e * N1 + n);
        h1[size_t(n)] = acc;
      }
      apply_gate_row<double>(s, h1.data(), act.data());
      for (int64_t h = 0; h < H; ++h) {
        double acc = 0;
        for (int64_t i = 0; i < I; ++i) {
          const int64_t off = s.is_transposed ? (e * I + i) * H + h : (e * H + h) * I + i;
          acc += act[size_t(i)] * load_as_f64(w2.data, w2.dtype, off);
        }
        if (s.has_bias) acc += load_as_f64(W.down_proj_bias.data(), W.down_proj_bias.dtype(), e * H + h);
        out[size_t(t * H + h)] += rw * acc;
      }
    }
  }
  return out;
}

double relative_l2(const std::vector<double>& a, const std::vector<double>& ref) {
  MOEKIT_CHECK(a.size() == ref.size(), "relative_l2: sizes differ (", a.size(), " vs ", ref.size(), ")");
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

double relative_l2(const TensorView& a, const std::vector<double>& ref) {
  const Tensor host = Tensor::copy_of(a, Device::cpu());
  std::vector<double> v(size_t(host.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = load_as_f64(host.data(), host.dtype(), int64_t(i));
  return relative_l2(v, ref);
}

}  // namespace moekit

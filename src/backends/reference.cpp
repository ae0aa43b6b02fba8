#include "backends/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backends/gate.h"
#include "base/convert.h"
#include "moekit/quant.h"

namespace moekit {

namespace {

// FP8 / FP4 experts (SPEC section 5), the simplest loops: weights dequantized exactly (e4m3 value x block scale, or
// e2m1 value x its power-of-two scale, f64);
// activations quantized per token and 128 inputs as transformers' fine-grained FP8 path does (f32 amax / 448,
// x / scale rounded to nearest even e4m3, saturated; the scale rounded up to a power of two with ue8m0 scales),
// products summed in f64. The quantizer sees what that path materialises: the projection's output in the
// activation dtype (f32 here, or rounded to bf16 / f16), the bias added in that dtype, the gate evaluated in f32.
struct Fp8Ref {
  const ExpertsSpec& s;
  DType act;
  bool pow2;

  bool float_acts = false;  // FP4 weights with float activations (MXFP4)

  // q[k] * scale[k / 128] for one row of activations (the values themselves with float_acts)
  std::vector<double> quantize(const std::vector<float>& x) const {
    const int64_t k = int64_t(x.size());
    std::vector<double> out(x.size());
    if (float_acts) {
      for (size_t i = 0; i < x.size(); ++i) out[i] = x[i];
      return out;
    }
    for (int64_t g0 = 0; g0 < k; g0 += kFp8Block) {
      const int64_t g1 = std::min(k, g0 + kFp8Block);
      float amax = 0.0f;
      for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(x[size_t(i)]));
      float sc = amax / 448.0f;
      if (pow2 && sc > 0.0f) sc = ue8m0_to_f32(f32_to_ue8m0(sc));
      for (int64_t i = g0; i < g1; ++i) {
        const float q = sc > 0.0f ? f8e4m3_to_f32(f32_to_f8e4m3(x[size_t(i)] / sc)) : 0.0f;
        out[size_t(i)] = double(q) * double(sc);
      }
    }
    return out;
  }
  // w [E, N, K] e4m3 with block scales sc (segments halves of N with their own blocks): dequantized element.
  static double weight(const Tensor& w, const Tensor& sc, int64_t e, int64_t n, int64_t k, int64_t segments) {
    const int64_t N = w.size(1), K = w.size(2), SN = sc.size(1), SK = sc.size(2);
    if (w.dtype() == DType::f4e2m1) {  // e2m1 (low nibble first) x 2^(s - 127), one scale per row and 32 inputs
      const int64_t i = (e * N + n) * K + k;
      const uint8_t byte = w.ptr<uint8_t>()[i / 2];
      const double v = f4e2m1_to_f32(uint8_t((i & 1) ? byte >> 4 : byte & 0xf));
      return v * double(ue8m0_to_f32(sc.ptr<uint8_t>()[(e * N + n) * SK + k / kFp4Group]));
    }
    const int64_t si = (e * SN + fp8_scale_row(n, N, segments)) * SK + k / kFp8Block;
    const double scale = sc.dtype() == DType::ue8m0 ? ue8m0_to_f32(sc.ptr<uint8_t>()[si]) : sc.ptr<float>()[si];
    return double(f8e4m3_to_f32(w.ptr<uint8_t>()[(e * N + n) * K + k])) * scale;
  }
  // (FP4 with float activations: the activations as they are, the weights dequantized.)
  float materialise(double v) const { return act == DType::f32 ? float(v) : cpu::round_to(float(v), act); }
  float round_act(float v) const { return act == DType::f32 ? v : cpu::round_to(v, act); }
  // The gate in f32, each step torch runs in a low-precision activation dtype rounded to it.
  void gate(const float* h, float* out) const {
    if (act == DType::f32 || s.gate == GateKind::custom) {
      apply_gate_row<float>(s, h, out);
      for (int64_t i = 0; i < s.intermediate; ++i) out[i] = round_act(out[i]);
      return;
    }
    const int64_t I = s.intermediate;
    if (!s.has_gate) {
      for (int64_t i = 0; i < I; ++i) out[i] = round_act(activate(s.activation, h[i]));
      return;
    }
    const int64_t gs = s.is_concatenated ? 1 : 2, uo = s.is_concatenated ? I : 1;
    for (int64_t i = 0; i < I; ++i) {
      float g = h[i * gs], u = h[i * gs + uo];
      if (s.gate == GateKind::act_mul) {
        out[i] = round_act(round_act(activate(s.activation, g)) * u);
      } else {  // clamped SwiGLU
        g = g < s.limit ? g : s.limit;
        u = u < -s.limit ? -s.limit : (u > s.limit ? s.limit : u);
        const float sig = round_act(1.0f / (1.0f + std::exp(-round_act(g * s.alpha))));
        out[i] = round_act(round_act(u + 1.0f) * round_act(g * sig));
      }
    }
  }
};

std::vector<double> reference_fp8(const Experts& host, const Tensor& xc, const Tensor& ic, const Tensor& wc) {
  const ExpertsSpec& s = host.spec();
  const ExpertsWeights& W = host.weights();
  const int64_t T = xc.size(0), K = ic.dim() == 2 ? ic.size(1) : 0, H = s.hidden, I = s.intermediate,
                E = s.num_experts, N1 = s.has_gate ? 2 * I : I;
  const Fp8Ref ref{s, xc.dtype(), W.first_scale_inv().dtype() == DType::ue8m0, W.fp4_float_activations};
  std::vector<double> out(size_t(T * H), 0.0);
  std::vector<float> xrow(static_cast<size_t>(H)), h1(static_cast<size_t>(N1)), act(static_cast<size_t>(I));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) xrow[size_t(h)] = float(load_as_f64(xc.data(), xc.dtype(), t * H + h));
    const std::vector<double> xq = ref.quantize(xrow);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = int64_t(load_as_f64(ic.data(), ic.dtype(), t * K + k));
      MOEKIT_CHECK(e >= 0 && e <= E, "top_k_index[", t, ", ", k, "] = ", e, " out of range [0, ", E, "]");
      if (e == E) continue;
      const double rw = load_as_f64(wc.data(), wc.dtype(), t * K + k);
      for (int64_t n = 0; n < N1; ++n) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h)
          acc += xq[size_t(h)] * Fp8Ref::weight(W.first(), W.first_scale_inv(), e, n, h, s.has_gate ? 2 : 1);
        float v = ref.materialise(acc);
        if (s.has_bias)
          v = ref.round_act(v + float(load_as_f64(W.first_bias().data(), W.first_bias().dtype(), e * N1 + n)));
        h1[size_t(n)] = v;
      }
      ref.gate(h1.data(), act.data());
      const std::vector<double> aq = ref.quantize(act);
      for (int64_t h = 0; h < H; ++h) {
        double acc = 0;
        for (int64_t i = 0; i < I; ++i) acc += aq[size_t(i)] * Fp8Ref::weight(W.down_proj, W.down_proj_scale_inv, e, h, i, 1);
        if (s.has_bias) acc += load_as_f64(W.down_proj_bias.data(), W.down_proj_bias.dtype(), e * H + h);
        out[size_t(t * H + h)] += rw * acc;
      }
    }
  }
  return out;
}

}  // namespace

std::vector<double> reference_forward(const Experts& experts, const TensorView& x, const TensorView& idx,
                                      const TensorView& w) {
  const ExpertsSpec& s = experts.spec();
  const Experts host = experts.device().is_cpu() ? experts : experts.to(Device::cpu());
  const ExpertsWeights& W = host.weights();
  const Tensor xc = Tensor::copy_of(x, Device::cpu()), ic = Tensor::copy_of(idx, Device::cpu()),
               wc = Tensor::copy_of(w, Device::cpu());
  if (host.is_quantized()) return reference_fp8(host, xc, ic, wc);
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

// Internal: activations and gate functions of SPEC section 1, on one row, in float or double.
#pragma once
#include <cmath>
#include <vector>

#include "moekit/experts.h"

namespace moekit {

template <class T>
inline T activate(Activation a, T x) {
  switch (a) {
    case Activation::silu: return x / (T(1) + std::exp(-x));
    case Activation::gelu: return T(0.5) * x * (T(1) + std::erf(x / std::sqrt(T(2))));
    case Activation::gelu_tanh: {
      const T k = T(0.7978845608028654);  // sqrt(2 / pi)
      return T(0.5) * x * (T(1) + std::tanh(k * (x + T(0.044715) * x * x * x)));
    }
    case Activation::relu: return x > T(0) ? x : T(0);
    case Activation::relu2: return x > T(0) ? x * x : T(0);
    case Activation::sigmoid: return T(1) / (T(1) + std::exp(-x));
    case Activation::identity: return x;
  }
  return x;
}

// gate_up: 2I values (concatenated [g | u] or interleaved g0,u0,...) when has_gate, else I values.
// out: I values.
template <class T>
inline void apply_gate_row(const ExpertsSpec& s, const T* gate_up, T* out) {
  const int64_t I = s.intermediate;
  if (!s.has_gate) {
    for (int64_t i = 0; i < I; ++i) out[i] = activate(s.activation, gate_up[i]);
    return;
  }
  const int64_t gstride = s.is_concatenated ? 1 : 2;
  const T* g = gate_up;
  const T* u = s.is_concatenated ? gate_up + I : gate_up + 1;
  switch (s.gate) {
    case GateKind::act_mul:
      for (int64_t i = 0; i < I; ++i) out[i] = activate(s.activation, g[i * gstride]) * u[i * gstride];
      return;
    case GateKind::clamped_swiglu: {
      const T limit = T(s.limit), alpha = T(s.alpha);
      for (int64_t i = 0; i < I; ++i) {
        T gv = g[i * gstride], uv = u[i * gstride];
        gv = gv < limit ? gv : limit;  // min(gate, limit), NaN propagates as in torch.clamp
        uv = uv < -limit ? -limit : (uv > limit ? limit : uv);
        out[i] = (uv + T(1)) * gv * (T(1) / (T(1) + std::exp(-alpha * gv)));
      }
      return;
    }
    case GateKind::custom: {
      std::vector<float> gf(static_cast<size_t>(I)), uf(gf.size()), of(gf.size());
      for (int64_t i = 0; i < I; ++i) { gf[size_t(i)] = float(g[i * gstride]); uf[size_t(i)] = float(u[i * gstride]); }
      s.custom_gate(gf.data(), uf.data(), of.data(), I);
      for (int64_t i = 0; i < I; ++i) out[i] = T(of[size_t(i)]);
      return;
    }
  }
}

}  // namespace moekit

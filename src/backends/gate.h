// Internal: the gate functions of SPEC section 1 on one row, in float or double, over the activations of
// base/activation.h.
#pragma once
#include <cmath>
#include <vector>

#include "base/activation.h"
#include "moekit/experts.h"

namespace moekit {

template <class T>
inline T activate(Activation a, T x) {
  return act::apply(act::code_of(a), x);
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
      for (int64_t i = 0; i < I; ++i) out[i] = act::clamped_swiglu(g[i * gstride], u[i * gstride], limit, alpha);
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

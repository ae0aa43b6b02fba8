// Internal: the activation functions and gpt-oss's clamped SwiGLU gate, written once for host and device code
// (the CPU backends, the f64 reference, the model's CPU and CUDA ops, the CUDA kernels). In f32 the host and the
// device evaluate the same expression with the same libm-style functions (expf, erff, tanhf).
#pragma once
#include <math.h>

#include <cstdint>

#include "base/host_device.h"

namespace moekit {
enum class Activation : uint8_t;  // include/moekit/experts.h; kernels see only the codes below
}

namespace moekit::act {

// Codes of the activations in kernels' arguments (ints: kernels take no library enums).
constexpr int kSilu = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3, kRelu2 = 4, kSigmoid = 5, kIdentity = 6;

// The code of a moekit::Activation, indexed by its value (silu, gelu, gelu_tanh, relu, sigmoid, identity,
// relu2; activation.cpp checks the order).
inline int code_of(Activation a) {
  constexpr int kCodes[] = {kSilu, kGelu, kGeluTanh, kRelu, kSigmoid, kIdentity, kRelu2};
  const unsigned i = unsigned(a);
  return i < sizeof(kCodes) / sizeof(kCodes[0]) ? kCodes[i] : kIdentity;
}

MOEKIT_HOST_DEVICE_INLINE float exp_of(float x) { return expf(x); }
MOEKIT_HOST_DEVICE_INLINE double exp_of(double x) { return exp(x); }
MOEKIT_HOST_DEVICE_INLINE float erf_of(float x) { return erff(x); }
MOEKIT_HOST_DEVICE_INLINE double erf_of(double x) { return erf(x); }
MOEKIT_HOST_DEVICE_INLINE float tanh_of(float x) { return tanhf(x); }
MOEKIT_HOST_DEVICE_INLINE double tanh_of(double x) { return tanh(x); }

template <class T>
MOEKIT_HOST_DEVICE_INLINE T sigmoid(T x) {
  return T(1) / (T(1) + exp_of(-x));
}
template <class T>
MOEKIT_HOST_DEVICE_INLINE T silu(T x) {
  return x / (T(1) + exp_of(-x));
}
template <class T>
MOEKIT_HOST_DEVICE_INLINE T gelu(T x) {  // erf form: 0.5 x (1 + erf(x / sqrt 2))
  return T(0.5) * x * (T(1) + erf_of(x * T(0.70710678118654752440)));
}
template <class T>
MOEKIT_HOST_DEVICE_INLINE T gelu_tanh(T x) {
  return T(0.5) * x * (T(1) + tanh_of(T(0.7978845608028654) * (x + T(0.044715) * x * x * x)));  // sqrt(2 / pi)
}
template <class T>
MOEKIT_HOST_DEVICE_INLINE T relu(T x) {
  return x > T(0) ? x : T(0);
}
template <class T>
MOEKIT_HOST_DEVICE_INLINE T relu2(T x) {
  return x > T(0) ? x * x : T(0);
}

// The activation of code `a` (kSilu ...); identity for an unknown code.
template <class T>
MOEKIT_HOST_DEVICE_INLINE T apply(int a, T x) {
  switch (a) {
    case kSilu: return silu(x);
    case kGelu: return gelu(x);
    case kGeluTanh: return gelu_tanh(x);
    case kRelu: return relu(x);
    case kRelu2: return relu2(x);
    case kSigmoid: return sigmoid(x);
    default: return x;  // kIdentity
  }
}

// gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit); a NaN gate
// propagates, as in torch.clamp.
template <class T>
MOEKIT_HOST_DEVICE_INLINE T clamped_swiglu(T gate, T up, T limit, T alpha) {
  gate = gate < limit ? gate : limit;
  up = up < -limit ? -limit : (up > limit ? limit : up);
  return (up + T(1)) * gate * (T(1) / (T(1) + exp_of(-alpha * gate)));
}

}  // namespace moekit::act

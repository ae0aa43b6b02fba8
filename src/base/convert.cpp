// Row conversions between f32 and the storage dtypes, shared by the CPU backends and the model's CPU ops.
#include "base/convert.h"

#include "moekit/error.h"

namespace moekit::cpu {

void load_f32(const void* src, DType t, int64_t off, int64_t n, float* dst) {
  switch (t) {
    case DType::f32:
      std::memcpy(dst, static_cast<const float*>(src) + off, size_t(n) * 4);
      return;
    case DType::bf16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::f16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
      return;
    }
    default:
      for (int64_t i = 0; i < n; ++i) dst[i] = float(load_as_f64(src, t, off + i));
  }
}

void store_f32(const float* src, void* dst, DType t, int64_t off, int64_t n) {
  switch (t) {
    case DType::f32:
      std::memcpy(static_cast<float*>(dst) + off, src, size_t(n) * 4);
      return;
    case DType::bf16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + off;
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::f16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + off;
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
      return;
    }
    default:
      MOEKIT_FAIL(internal, "store_f32: unsupported dtype ", dtype_name(t));
  }
}

void round_row(float* x, int64_t n, DType t) {
  if (t == DType::bf16) {
    for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
  } else if (t == DType::f16) {
    for (int64_t i = 0; i < n; ++i) x[i] = half_to_float(float_to_half(x[i]));
  }
}

}  // namespace moekit::cpu

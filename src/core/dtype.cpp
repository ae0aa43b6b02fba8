#include "moekit/dtype.h"

#include <cmath>
#include <limits>

#include "moekit/error.h"

namespace moekit {

int dtype_bits(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 64;
    case DType::f32: case DType::i32: return 32;
    case DType::bf16: case DType::f16: return 16;
    case DType::f8e4m3: case DType::ue8m0: case DType::u8: case DType::i8: case DType::boolean: return 8;
    case DType::f4e2m1: return 4;
  }
  MOEKIT_FAIL(internal, "unknown dtype ", int(t));
}

size_t dtype_nbytes(DType t, int64_t n) { return size_t((n * dtype_bits(t) + 7) / 8); }

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f8e4m3: return "f8e4m3";
    case DType::f4e2m1: return "f4e2m1";
    case DType::ue8m0: return "ue8m0";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::i8: return "i8";
    case DType::f64: return "f64";
    case DType::boolean: return "bool";
  }
  return "?";
}

DType parse_dtype(std::string_view n) {
  if (n == "f32" || n == "float32" || n == "float" || n == "F32") return DType::f32;
  if (n == "bf16" || n == "bfloat16" || n == "BF16") return DType::bf16;
  if (n == "f16" || n == "float16" || n == "half" || n == "F16") return DType::f16;
  if (n == "f8e4m3" || n == "float8_e4m3fn" || n == "F8_E4M3") return DType::f8e4m3;
  if (n == "f4e2m1" || n == "float4_e2m1fn_x2") return DType::f4e2m1;
  if (n == "ue8m0" || n == "float8_e8m0fnu" || n == "F8_E8M0") return DType::ue8m0;
  if (n == "i32" || n == "int32" || n == "I32") return DType::i32;
  if (n == "i64" || n == "int64" || n == "I64") return DType::i64;
  if (n == "u8" || n == "uint8" || n == "U8") return DType::u8;
  if (n == "i8" || n == "int8" || n == "I8") return DType::i8;
  if (n == "f64" || n == "float64" || n == "F64") return DType::f64;
  if (n == "bool" || n == "BOOL") return DType::boolean;
  MOEKIT_FAIL(invalid_argument, "unknown dtype '", n,
              "'; expected one of f32, bf16, f16, f8e4m3, f4e2m1, ue8m0, i32, i64, u8, i8, f64, bool");
}

bool is_floating(DType t) {
  switch (t) {
    case DType::f32: case DType::bf16: case DType::f16: case DType::f8e4m3: case DType::f4e2m1: case DType::f64:
      return true;
    default: return false;
  }
}

namespace {
// Minifloat with `mb` mantissa bits and exponent bias `bias`; codes are unsigned magnitudes.
float minifloat_decode(uint32_t mag, int mb, int bias) {
  uint32_t e = mag >> mb, m = mag & ((1u << mb) - 1);
  if (e == 0) return std::ldexp(float(m), 1 - bias - mb);
  return std::ldexp(float((1u << mb) | m), int(e) - bias - mb);
}
// Round-to-nearest-even encoding of a finite magnitude a >= 0; returns the unsaturated code.
uint32_t minifloat_encode(float a, int mb, int bias) {
  const float min_normal = std::ldexp(1.0f, 1 - bias);
  if (a < min_normal) return uint32_t(std::nearbyint(std::ldexp(a, bias - 1 + mb)));  // may reach 1<<mb = min normal
  int ex;
  float f = std::frexp(a, &ex);  // a = f * 2^ex, f in [0.5, 1)
  int e = ex - 1;
  float q = std::nearbyint((f * 2.0f - 1.0f) * float(1u << mb));
  uint32_t qi = uint32_t(q);
  if (qi == (1u << mb)) { qi = 0; ++e; }
  return (uint32_t(e + bias) << mb) | qi;
}
}  // namespace

float f16_to_f32(uint16_t h) {
  uint32_t sign = (h >> 15) & 1u, mag = h & 0x7fffu;
  float v;
  if ((mag >> 10) == 0x1f) v = (mag & 0x3ffu) ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else v = minifloat_decode(mag, 10, 15);
  return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return 0x7e00;
  float a = std::fabs(f);
  if (std::isinf(a)) return sign | 0x7c00;
  uint32_t code = minifloat_encode(a, 10, 15);
  if (code >= 0x7c00u) return sign | 0x7c00;
  return uint16_t(sign | code);
}

float f8e4m3_to_f32(uint8_t v) {
  uint32_t mag = v & 0x7fu;
  if (mag == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  float r = minifloat_decode(mag, 3, 7);
  return (v & 0x80) ? -r : r;
}

uint8_t f32_to_f8e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  uint32_t code = minifloat_encode(a, 3, 7);
  if (code > 0x7e) code = 0x7e;
  return uint8_t(sign | code);
}

float f4e2m1_to_f32(uint8_t nibble) {
  float r = minifloat_decode(nibble & 0x7u, 1, 1);
  return (nibble & 0x8) ? -r : r;
}

uint8_t f32_to_f4e2m1(float f) {
  uint8_t sign = std::signbit(f) ? 0x8 : 0;
  float a = std::fabs(f);
  if (std::isnan(f)) return 0x7;  // no NaN in e2m1: saturate
  if (a >= 6.0f) return sign | 0x7;
  uint32_t code = minifloat_encode(a, 1, 1);
  if (code > 7) code = 7;
  return uint8_t(sign | code);
}

uint8_t f32_to_ue8m0(float f) {
  if (std::isnan(f)) return 0xff;
  if (!(f > 0.0f)) return 0;
  int ex;
  float m = std::frexp(f, &ex);  // f = m * 2^ex, m in [0.5, 1)
  int e = (m == 0.5f) ? ex - 1 : ex;  // ceil(log2 f)
  int code = e + 127;
  if (code < 0) code = 0;
  if (code > 254) code = 254;
  return uint8_t(code);
}

double load_as_f64(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f64: return static_cast<const double*>(base)[i];
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::f8e4m3: return f8e4m3_to_f32(static_cast<const uint8_t*>(base)[i]);
    case DType::ue8m0: return ue8m0_to_f32(static_cast<const uint8_t*>(base)[i]);
    case DType::f4e2m1: {
      uint8_t byte = static_cast<const uint8_t*>(base)[i / 2];
      return f4e2m1_to_f32((i & 1) ? (byte >> 4) : (byte & 0xf));
    }
    case DType::i32: return static_cast<const int32_t*>(base)[i];
    case DType::i64: return double(static_cast<const int64_t*>(base)[i]);
    case DType::u8: case DType::boolean: return static_cast<const uint8_t*>(base)[i];
    case DType::i8: return static_cast<const int8_t*>(base)[i];
  }
  MOEKIT_FAIL(internal, "unknown dtype");
}

void convert(const void* src, DType st, void* dst, DType dt, int64_t n) {
  MOEKIT_CHECK(is_floating(st) && st != DType::f4e2m1, "convert: unsupported source dtype ", dtype_name(st));
  MOEKIT_CHECK(is_floating(dt) && dt != DType::f4e2m1, "convert: unsupported destination dtype ", dtype_name(dt));
  if (st == dt) { std::memcpy(dst, src, dtype_nbytes(st, n)); return; }
  auto read = [&](int64_t i) -> float {
    switch (st) {
      case DType::f32: return static_cast<const float*>(src)[i];
      case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
      case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
      case DType::f8e4m3: return f8e4m3_to_f32(static_cast<const uint8_t*>(src)[i]);
      default: return float(static_cast<const double*>(src)[i]);
    }
  };
  for (int64_t i = 0; i < n; ++i) {
    float v = read(i);
    switch (dt) {
      case DType::f32: static_cast<float*>(dst)[i] = v; break;
      case DType::bf16: static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v); break;
      case DType::f16: static_cast<uint16_t*>(dst)[i] = f32_to_f16(v); break;
      case DType::f8e4m3: static_cast<uint8_t*>(dst)[i] = f32_to_f8e4m3(v); break;
      case DType::f64: static_cast<double*>(dst)[i] = (st == DType::f64) ? static_cast<const double*>(src)[i] : v; break;
      default: break;
    }
  }
}

}  // namespace moekit

// moekit: element types and exact conversions.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace moekit {

enum class DType : uint8_t { f32, bf16, f16, f8e4m3, f4e2m1, ue8m0, i32, i64, u8, i8, f64, boolean };

// Bits per element (f4e2m1 is 4: two values per byte, low nibble first).
int dtype_bits(DType t);
// Bytes for n elements of t (rounded up for sub-byte types).
size_t dtype_nbytes(DType t, int64_t n);
const char* dtype_name(DType t);           // "f32", "bf16", ...
DType parse_dtype(std::string_view name);  // accepts "f32"/"float32", "bf16"/"bfloat16", ...; throws
bool is_floating(DType t);

// ---- scalar conversions (exact, round-to-nearest-even where narrowing) ----
inline float bits_to_f32(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t b = f32_to_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40);  // quiet NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float f8e4m3_to_f32(uint8_t v);
uint8_t f32_to_f8e4m3(float f);  // saturates to +-448, NaN stays NaN
float f4e2m1_to_f32(uint8_t nibble);
uint8_t f32_to_f4e2m1(float f);  // saturates to +-6
inline float ue8m0_to_f32(uint8_t v) {  // 2^(v-127); 0xff is NaN
  if (v == 0xff) return bits_to_f32(0x7fc00000u);
  if (v == 0) return bits_to_f32(0x00400000u);  // 2^-127
  return bits_to_f32(uint32_t(v) << 23);
}
uint8_t f32_to_ue8m0(float f);  // the exponent of f rounded up to a power of two

// Convert n elements between floating types (any of f32, bf16, f16, f8e4m3, f64) on the CPU.
void convert(const void* src, DType src_type, void* dst, DType dst_type, int64_t n);
// Read element i of a buffer as double (any numeric type).
double load_as_f64(const void* base, DType t, int64_t i);

}  // namespace moekit

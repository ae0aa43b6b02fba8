// Internal: checked arithmetic for sizes computed from untrusted numbers (config values, file headers,
// command-line flags). Every product or sum that sizes an allocation or an index goes through these:
// on overflow they throw Error(invalid_argument) naming what was being computed and the operands.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "moekit/error.h"

namespace moekit {

// a * b as int64; throws naming `what` when either is negative or the product leaves int64.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  MOEKIT_CHECK(a >= 0 && b >= 0, what, ": negative size (", a, " x ", b, ")");
  MOEKIT_CHECK(!__builtin_mul_overflow(a, b, &r), what, ": ", a, " x ", b, " overflows a 64-bit size");
  return r;
}

// a + b as int64; throws naming `what` when either is negative or the sum leaves int64.
inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  MOEKIT_CHECK(a >= 0 && b >= 0, what, ": negative size (", a, " + ", b, ")");
  MOEKIT_CHECK(!__builtin_add_overflow(a, b, &r), what, ": ", a, " + ", b, " overflows a 64-bit size");
  return r;
}

// The product of several sizes, checked (e.g. checked_product({E, 2 * I, H}, "experts gate_up_proj")).
template <class Range>
int64_t checked_product(const Range& dims, const char* what) {
  int64_t n = 1;
  for (int64_t d : dims) n = checked_mul(n, d, what);
  return n;
}
inline int64_t checked_product(std::initializer_list<int64_t> dims, const char* what) {
  int64_t n = 1;
  for (int64_t d : dims) n = checked_mul(n, d, what);
  return n;
}

// Bytes of `numel` elements of `bits` bits each (sub-byte types round up), checked.
inline size_t checked_bytes(int64_t numel, int bits, const char* what) {
  const int64_t b = checked_mul(numel, int64_t(bits), what);
  return size_t(checked_add(b, 7, what) / 8);
}

}  // namespace moekit

// Internal: counter-based random numbers for benchmark data, the same on the host and in CUDA kernels.
#pragma once
#include <cmath>
#include <cstdint>

#include "base/host_device.h"

namespace moekit::bench {

MOEKIT_HOST_DEVICE inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The i-th value of a normal(0, 1) stream keyed by `seed` (Box-Muller on one 64-bit hash).
MOEKIT_HOST_DEVICE inline float normal_at(uint64_t seed, uint64_t i) {
  const uint64_t h = splitmix64(seed * 0x2545f4914f6cdd1dull + i);
  const float u1 = (float(uint32_t(h >> 40)) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1), 24 bits
  const float u2 = float(uint32_t(h & 0xffffffu)) * (1.0f / 16777216.0f);     // [0, 1)
  return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
}

}  // namespace moekit::bench

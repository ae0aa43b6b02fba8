// e2m1 codes (FP4, two per byte, low nibble first) to e4m3, f16, bf16 and f32 in registers, exact (every e2m1
// value, 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, is a value of each), and ue8m0 scale codes to f32.
// Four codes at a time: their magnitudes index an 8-entry byte table with one byte permute (prmt), the sign bit of
// each code is moved to the top bit of its byte.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

namespace moekit::cuda::kernels {

// The sign bits of the four codes in the low 16 bits of v, at bit 7 of bytes 0..3.
__device__ __forceinline__ uint32_t e2m1x4_signs(uint32_t v) {
  return ((v & 0x8u) << 4) | ((v & 0x80u) << 8) | ((v & 0x800u) << 12) | ((v & 0x8000u) << 16);
}

// e4m3 codes of the four e2m1 codes in the low 16 bits of v (byte i: code i).
__device__ __forceinline__ uint32_t e2m1x4_to_e4m3x4(uint32_t v) {
  // magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as e4m3: 0x00 0x30 0x38 0x3c 0x40 0x44 0x48 0x4c
  return __byte_perm(0x3C383000u, 0x4C484440u, v & 0x7777u) | e2m1x4_signs(v);
}

// The four e2m1 codes in the low 16 bits of v as two pairs of 16-bit floats (T = __half or __nv_bfloat16 bits):
// p01 holds codes 0 and 1 (low half: code 0), p23 codes 2 and 3.
template <bool BF16>
__device__ __forceinline__ void e2m1x4_to_16(uint32_t v, uint32_t& p01, uint32_t& p23) {
  const uint32_t sel = v & 0x7777u;
  uint32_t hi, lo;
  if constexpr (BF16) {  // 0x0000 0x3f00 0x3f80 0x3fc0 0x4000 0x4040 0x4080 0x40c0
    hi = __byte_perm(0x3F3F3F00u, 0x40404040u, sel) | e2m1x4_signs(v);
    lo = __byte_perm(0xC0800000u, 0xC0804000u, sel);
  } else {  // 0x0000 0x3800 0x3c00 0x3e00 0x4000 0x4200 0x4400 0x4600
    hi = __byte_perm(0x3E3C3800u, 0x46444240u, sel) | e2m1x4_signs(v);
    lo = 0;
  }
  p01 = __byte_perm(lo, hi, 0x5140);
  p23 = __byte_perm(lo, hi, 0x7362);
}

// Sixteen e2m1 codes (8 bytes: w0 codes 0..7, w1 codes 8..15) as f32, through f16 pairs. (Shifting the bf16
// pairs' bits into f32 instead, integer operations only, measured no faster in the FP4 GEMV: docs/perf.md.)
__device__ __forceinline__ void e2m1x16_to_f32(uint32_t w0, uint32_t w1, float (&f)[16]) {
  const uint32_t w[2] = {w0, w1};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t p01, p23;
    e2m1x4_to_16<false>(w[q / 2] >> (16 * (q % 2)), p01, p23);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&p01));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&p23));
    f[4 * q] = a.x;
    f[4 * q + 1] = a.y;
    f[4 * q + 2] = b.x;
    f[4 * q + 3] = b.y;
  }
}

// d += A (16 x 16, row) B (16 x 8, col) on the tensor cores, bf16 (BF16) or f16 inputs, f32 accumulators: mma.sync's
// fragments (sm_80 and later; nothing before).
template <bool BF16>
__device__ __forceinline__ void mma_k16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (BF16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// 2^(c - 127) (c = 0: 2^-127, a subnormal; 255: NaN), as moekit/dtype.h ue8m0_to_f32.
__device__ __forceinline__ float ue8m0_f32(uint32_t c) {
  return __uint_as_float(c == 0 ? 0x00400000u : (c == 255 ? 0x7fc00000u : c << 23));
}

}  // namespace moekit::cuda::kernels

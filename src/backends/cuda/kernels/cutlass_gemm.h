// The FP8 grouped projection on CUTLASS's Hopper grouped GEMM (grouped_gemm_cutlass_fp8.cu, built where CUTLASS's
// headers were found at configure time): one GEMM per expert over its sorted rows, the whole projection's output
// rounded to bf16, and the gate with the requantisation that follows it at large token counts.
#pragma once

#include "backends/cuda/kernels/kernels.h"

namespace moekit::cuda::kernels {

// out[r, :] = sum over 128-input blocks of (A row r . W_e block) * a_scale[r, block] * w_scale_e[block row, block],
// rounded to bf16, for the rows r of expert e in [offsets[e], offsets[e + 1]) (sorted, contiguous): the whole
// projection (gate and up rows together for a gated one; its gate is applied by gate_quantize_fp8_rows).
struct CutlassFp8Args {
  const uint8_t* a = nullptr;      // e4m3 [rows, k], k bytes apart (16-byte aligned)
  const float* a_scale = nullptr;  // [rows, k / 128]
  const uint8_t* b = nullptr;      // weight (n, k) of expert e at b[e * b_expert_stride + n * b_ld + k]
  int64_t b_expert_stride = 0, b_ld = 0;
  const float* b_scale = nullptr;  // [E, n / 128, k / 128] at b_scale[e * bs_expert_stride + ...]
  int64_t bs_expert_stride = 0;
  const int32_t* offsets = nullptr;  // [E + 1] device
  int experts = 0;
  int64_t n = 0, k = 0;  // multiples of 128
  void* out = nullptr;   // bf16 [rows, n]
  bool pingpong = false;  // the kernel's form: cooperative 128-row tiles, or ping-pong 64-row tiles (few rows per expert)
};
// Whether this build has the kernel (CUTLASS's headers found at configure time), and whether it serves these
// arguments on a device of compute capability `arch` (sm_90 only).
bool grouped_gemm_fp8_cutlass_built();
bool grouped_gemm_fp8_cutlass_ok(const CutlassFp8Args& a, int arch);
// Device workspace for `experts` experts (256-byte aligned; the per-expert arrays and CUTLASS's own).
size_t grouped_gemm_fp8_cutlass_workspace(int experts);
cudaError_t grouped_gemm_fp8_cutlass(const CutlassFp8Args& a, void* workspace, cudaStream_t stream);

// The gate of a gated projection computed from its output h1 [rows, 2 inter] ([gate | up] halves) of `type` (bf16 /
// f16: the projection rounded as the gated epilogues round it), each step as they compute it, the result rounded to
// `type`, then quantised as quantize_fp8_rows does (per row and 128 outputs): q [rows, ldq] e4m3, scale [rows, lds].
// Rows at or past *valid_rows (when set) are left as they are.
cudaError_t gate_quantize_fp8_rows(Elem type, const void* h1, int64_t rows, int64_t inter, const GateParams& gate,
                                   const int32_t* valid_rows, bool pow2_scales, uint8_t* q, int64_t ldq, float* scale,
                                   int64_t lds, cudaStream_t stream);

}  // namespace moekit::cuda::kernels

// FP4 experts (e2m1 weights with one ue8m0 scale per weight row and 32 inputs: MXFP4, FP4 with UE8M0 scales) on
// the GPU: the projection arguments and kernels (grouped_gemm_fp4.cu, and the weight-streaming GEMV of
// gemv_quant.cu). The arguments are the FP8 projection's (kernels.h Fp8GemmArgs) with the FP4 weights' scales and,
// for MXFP4 as transformers runs it, activations that are not quantized.
#pragma once
#include "backends/cuda/kernels/kernels.h"

namespace moekit::cuda::kernels {

// b: e2m1 codes two per byte (low nibble first) and b_k, b_stride_n, b_expert_stride in bytes (a weight row holds
// k / 2 bytes); b_scale unused. b_e8: the ue8m0 scale codes, one per weight row and 32 inputs: row n of expert e at
// b_e8 + e * bs_expert_stride + n * b_e8_ld, b_e8_ld >= ceil(k / 128) * 4 (rows padded to whole groups of four
// codes, so that one 128-input step reads one 4-byte word). k a multiple of 32.
// a_float: A rows of `type` (lda in elements), products with the weights' values as they are (MXFP4's float
// activations); a_scale unused. Else A as the FP8 projection reads it (e4m3 codes quantized per 128 inputs).
struct Fp4GemmArgs : Fp8GemmArgs {
  const uint8_t* b_e8 = nullptr;
  int64_t b_e8_ld = 0;
  bool a_float = false;
};

// Whether this build carries the FP4 projection's code for the current device of compute capability `arch`: float
// activations on the bf16 / f16 tensor cores (8.0 and later), quantized activations on the FP8 ones (8.9 and later).
bool grouped_gemm_fp4_built_for(int arch, bool float_acts);
// The grouped FP4 projection over sorted rows, tiles of tile_m (32 or 128: fp8_tile_m) rows x 128 virtual columns
// x 128 inputs, three cp.async stages (the packed weights, their scale codes and A), e2m1 expanded in registers
// (to e4m3 for quantized A, mma.sync m16n8k32; to bf16 / f16 for float A, mma.sync m16n8k16), each group of 32
// inputs summed on the tensor cores then scaled once (w_scale, times a_scale with quantized A) into f32
// accumulators. Epilogues kEpiGated, kEpiActOnly, kEpiF32. Float A of bf16 or f16 only (f32 activations take the
// GEMV). Serves: k a multiple of 32, 16-byte aligned A rows and weights.
bool grouped_gemm_fp4_ok(const Fp4GemmArgs& a);
cudaError_t grouped_gemm_fp4(const Fp4GemmArgs& a, int tile_m, cudaStream_t stream);

// The FP4 projection as the weight-streaming GEMV (gemv_quant.cu, the FP8 GEMV's kernel over FP4 weights): any
// activation dtype, float or quantized A. Whether it serves these arguments; the launcher.
bool fp4_gemv_ok(const Fp4GemmArgs& a);
cudaError_t fp4_gemv(const Fp4GemmArgs& a, int tile_m, int rows_per_pass, cudaStream_t stream);

// MXFP4 at decode sizes on the tensor cores (gemv_quant.cu fp4_mma_gemv_kernel): the GEMV's rows, tiles and
// epilogues, bf16 activations (a_float), each weight decoded to bf16 times its group's scale once per 8 rows of the
// tile, mma.sync m16n8k16 with f32 accumulation. Whether it serves these arguments on a device of compute capability
// `arch` (8.0 and later); the launcher.
bool fp4_mma_gemv_ok(const Fp4GemmArgs& a, int arch);
cudaError_t fp4_mma_gemv(const Fp4GemmArgs& a, int tile_m, int arch, cudaStream_t stream);
// Its pair form for a few tokens, without the routing sort (as kernels.h fp8_pair_gemv): row p of a.max_rows (a
// multiple of pa.top_k) is pair p, run on the expert pa.index[p] (ids outside [0, experts] recorded in pa.error; the
// sentinel and bad ids contribute nothing) against A row p / a.a_row_div (a.a_rows null); the gated / activation
// epilogues write row p of a.out; kEpiF32 writes row p of a.out (f32) and its last block per token and columns sums
// the token's slots into pa.out as combine does (pa.routing_weights, pa.bias2), on pa.counters (zero at launch, left
// zero; fp4_mma_pair_counters words). The same bits as fp4_mma_gemv over the sorted pairs then combine, for the same
// K slices.
int64_t fp4_mma_pair_counters(const Fp4GemmArgs& a, int top_k);
cudaError_t fp4_mma_pair_gemv(const Fp4GemmArgs& a, const Fp8PairArgs& pa, int arch, cudaStream_t stream);
// Its K slices per group of weight rows (both forms): 0 (default: by the form: 2, the one-chunk form 1), or 1, 2
// or 4 (MOEKIT_FP4_MMA_KSPLIT in the environment at first use). The setter returns the previous value (process-wide).
int fp4_mma_ksplit();
int set_fp4_mma_ksplit(int slices);

// Weights [rows, k] of `type` (k a multiple of 32) quantized as moekit/quant.h quantize_fp4 does: per row and 32
// inputs the scale 2^(floor(log2 amax) - 2), codes rounded to nearest even e2m1, saturated: q [rows, k / 2] packed,
// scales [rows, k / 32] ue8m0. For making FP4 experts from device weights (the benchmark's random experts).
cudaError_t quantize_fp4_groups(Elem type, const void* w, int64_t rows, int64_t k, uint8_t* q, uint8_t* scales,
                                cudaStream_t stream);

}  // namespace moekit::cuda::kernels

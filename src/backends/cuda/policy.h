// Internal: the CUDA backends' per-call policy knobs (no CUDA headers: tests and benchmarks set them).
#pragma once
#include <cstdint>

namespace moekit::cuda {

// Largest number of (token, slot) pairs for which batched_mm runs per-pair GEMVs; above it batched_mm
// runs the grouped kernels. Setting it returns the previous value (process-wide).
int64_t batched_gemv_max_pairs();
int64_t set_batched_gemv_max_pairs(int64_t pairs);
// Whether those GEMVs also serve calls with at least as many pairs as experts. Off by default: some expert
// is then certainly hit by two pairs, which the grouped kernels read once (on the H200 at T = 8:
// mixtral-8x7b 876 -> 616 us, gpt-oss-20b 364 -> 277, olmoe-1b-7b 177 -> 160). Tests turn it on with a
// large max_pairs to force the GEMVs. Setting it returns the previous value (process-wide).
bool batched_gemv_when_shared();
bool set_batched_gemv_when_shared(bool on);

// Largest number of tokens for which batched_mm's per-pair GEMVs run both projections in one launch (kernels.h
// pair_fused: the second projection's rows staged in shared memory while the first runs, a grid barrier between
// them) where it serves (sm_90, 16-bit experts); above it, or where it does not serve, the two launches.
// MOEKIT_SMALLT_ONE_LAUNCH_TOKENS in the environment at first use (0, the default: never; measured slower on the
// H200 at T = 1: qwen3-30b-a3b 33.8 against 25.4 us). Setting it returns the previous value
// (process-wide).
int64_t batched_one_launch_max_tokens();
int64_t set_batched_one_launch_max_tokens(int64_t tokens);

// Whether grouped projections may use the sm_90a wgmma kernel (else mma.sync); on by default.
bool grouped_wgmma_enabled();
bool set_grouped_wgmma_enabled(bool enabled);
// Whether row tiles of 128 take the wide wgmma kernel (256 columns per block, else 128). Off by
// default: on the H200 (qwen3-30b-a3b, T = 4096) it ran the gated projection in 1203 us against 594 us
// for 128 columns (the second projection: 352 against 390 us).
bool grouped_wgmma_wide_enabled();
bool set_grouped_wgmma_wide_enabled(bool enabled);

// Whether grouped_mm may run both projections on the warp-specialised TMA kernel (sm_90a, row tiles
// of 128, or 64 in its ping-pong form; the first projection's rows gathered into a contiguous buffer
// first) where it serves; on by default. Off: the cp.async kernels above.
bool grouped_tma_enabled();
bool set_grouped_tma_enabled(bool enabled);
// Whether grouped_mm and deepgemm on that kernel write their second projection's rows in the activations' dtype
// (rounded once, as transformers' grouped_mm materialises them) for a combine reading 16-bit rows, instead of
// f32 rows (half the bytes written and read back); on by default, MOEKIT_DOWN_ROWS16=0 in the environment at
// first use switches it off. Setting it returns the previous value (process-wide).
bool grouped_down_rows16();
bool set_grouped_down_rows16(bool on);

// Largest number of pairs for which FP8 experts (grouped_mm, batched_mm, deepgemm) run the weight-streaming GEMV
// (kernels/gemv_quant.cu) instead of the tiled projections: 64 by default, MOEKIT_FP8_GEMV_MAX_PAIRS in the
// environment at first use (0: never). Setting it returns the previous value (process-wide).
int64_t fp8_gemv_max_pairs();
int64_t set_fp8_gemv_max_pairs(int64_t pairs);
// Where the sm90 FP8 kernel applies (sm_90a, 16-bit activations), the GEMV within that reach also needs fewer pairs
// than half the experts (2 P < E) and at most the pair form's tokens (fp8_pair_max_tokens(), or its default 4 where
// that is lower: MOEKIT_FP8_PAIR_TOKENS=0 then runs those calls on the sorted GEMV): beyond either the sm90 kernel
// streams the hit experts' weights faster. On by default,
// MOEKIT_FP8_GEMV_SPARSE=0 in the environment at first use (off: the reach alone decides). Setting it returns the
// previous value (process-wide).
bool fp8_gemv_sparse_only();
bool set_fp8_gemv_sparse_only(bool on);
// Within the GEMV's reach, calls of up to this many tokens run its pair form (kernels.h fp8_pair_gemv: no routing
// sort, the activations' quantisation and the combine fused into the projections' last blocks; three launches where
// the sorted form takes six): 4 by default, MOEKIT_FP8_PAIR_TOKENS in the environment at first use (0: never).
// Setting it returns the previous value (process-wide).
int64_t fp8_pair_max_tokens();
int64_t set_fp8_pair_max_tokens(int64_t tokens);
// FP8 experts on CUTLASS's grouped GEMM where the build has it (MOEKIT_FP8_CUTLASS, on), in two forms chosen by the
// rows per expert on average over the call's pairs (P / E): the cooperative form (128-row tiles) from `rows` rows per
// expert and `pairs` pairs; else the ping-pong form (64-row tiles) below pingpong_max_rows rows per expert, from
// pingpong_min_rows below a hidden size of pingpong_hidden and from pingpong_wide_min_rows at or above it; else
// moekit's sm90 kernel. The second projection goes to CUTLASS from a hidden size of second_hidden, below it to
// moekit's kernel. The defaults are what the H200 measured (quantized_fp8.cpp); the environment overrides them at
// first use (MOEKIT_FP8_CUTLASS_ROWS, _PAIRS, _PINGPONG_MIN, _PINGPONG_WIDE_MIN, _PINGPONG_MAX, _PINGPONG_HIDDEN,
// _SECOND_HIDDEN). Setting the policy returns the previous one (process-wide).
struct Fp8CutlassPolicy {
  int64_t rows = 128, pairs = 2048;
  int64_t pingpong_min_rows = 0, pingpong_max_rows = 64, pingpong_hidden = 4096;
  int64_t pingpong_wide_min_rows = 4;
  int64_t second_hidden = 4096;
};
bool set_fp8_cutlass(bool on);
Fp8CutlassPolicy fp8_cutlass_policy();
Fp8CutlassPolicy set_fp8_cutlass_policy(const Fp8CutlassPolicy& policy);
// The calls served in this process by each form.
int64_t fp8_cutlass_calls(bool pingpong);
// The same for FP4 experts (the GEMV over FP4 bytes; the tiled FP4 kernel beyond): 64 by default,
// MOEKIT_FP4_GEMV_MAX_PAIRS in the environment at first use (0: never).
int64_t fp4_gemv_max_pairs();
int64_t set_fp4_gemv_max_pairs(int64_t pairs);
// MXFP4 experts with bf16 activations run the GEMV on the tensor cores (kernels fp4_mma_gemv) rather than the FP32
// units, up to 2048 pairs (MOEKIT_FP4_MMA_MAX_PAIRS) whatever the reach above: on by default, MOEKIT_FP4_MMA_GEMV=0
// in the environment at first use (off). Setting it returns the previous value (process-wide).
bool fp4_mma_gemv();
bool set_fp4_mma_gemv(bool on);
// The projections that form has run in this process (tests).
int64_t fp4_mma_gemv_calls();
// Within that form's reach, calls of up to this many tokens run its pair form (kernels fp4_mma_pair_gemv: no routing
// sort, the combine in the second projection's last blocks; two launches where the sorted form takes four): 2 by
// default, MOEKIT_FP4_PAIR_TOKENS in the environment at first use (0: never). Setting it returns the previous value
// (process-wide). The calls that ran it in this process (tests).
int64_t fp4_pair_max_tokens();
int64_t set_fp4_pair_max_tokens(int64_t tokens);
int64_t fp4_pair_calls();

}  // namespace moekit::cuda

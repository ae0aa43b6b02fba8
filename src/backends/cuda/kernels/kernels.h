// CUDA kernels of the experts backends: raw pointers, sizes, a stream; each returns a cudaError_t.
// Nothing here knows about tensors, the registry or workspaces (src/backends/cuda/*.cpp own those).
//
// Vocabulary: T tokens, K slots per token (top_k), P = T * K (token, slot) pairs, pair p = t * K + k;
// E experts; "sorted rows" are the pairs routed to a local expert, stably sorted by expert.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/route_codes.h"

namespace moekit::cuda::kernels {

enum class Elem : int { f32 = 0, bf16 = 1, f16 = 2 };  // activations, weights, routing weights
enum class Index : int { i32 = 0, i64 = 1 };           // top_k_index

inline int elem_bytes(Elem t) { return t == Elem::f32 ? 4 : 2; }

// Activations (formulas of src/backends/gate.h).
constexpr int kActSilu = 0, kActGelu = 1, kActGeluTanh = 2, kActRelu = 3, kActRelu2 = 4, kActSigmoid = 5,
              kActIdentity = 6;

// The gate applied to the first projection (SPEC section 1).
struct GateParams {
  int kind = 0;          // kGateActMul, kGateClampedSwiglu, kGateActOnly (has_gate = false)
  int activation = 0;    // kAct*
  int concatenated = 1;  // 1: rows [gate | up]; 0: interleaved g0, u0, g1, u1, ...
  float alpha = 1.702f;  // clamped_swiglu
  float limit = 7.0f;
};
constexpr int kGateActMul = 0, kGateClampedSwiglu = 1, kGateActOnly = 2;

// Epilogues of the projection kernels.
//   kEpiGated:   out[r, c] = gate(acc(gate row of c) + bias, acc(up row of c) + bias), c < n (= I), dtype of A
//   kEpiActOnly: out[r, c] = act(acc(row c) + bias), dtype of A
//   kEpiF32:     out[r, c] = acc(row c) in f32 (second projection; its bias is added by combine)
//   kEpiWeighted: out[r, c] = w[row_pair[r]] * (acc(row c) + bias), dtype of A (sonicmoe's second
//                projection: the routing weight of the row's pair applied; TMA kernel only). Without row_pair
//                and row_weights w = 1: the accumulators rounded to 16 bits (grouped_mm's and deepgemm's rows)
constexpr int kEpiGated = 0, kEpiActOnly = 1, kEpiF32 = 2, kEpiWeighted = 3;

// ---- routing (routing.cu) ----

// Error word: the smallest (token << 40 | slot << 32 | uint32(id)) over bad ids (id < 0 or id > E),
// kNoRoutingError when there were none. Set with atomicMin: the same word whatever the thread order.
constexpr unsigned long long kNoRoutingError = ~0ull;
inline void decode_routing_error(unsigned long long w, int64_t* token, int* slot, int32_t* id) {
  *token = int64_t(w >> 40);
  *slot = int((w >> 32) & 0xff);
  *id = int32_t(uint32_t(w & 0xffffffffu));
}

constexpr int kRouteThreads = 256;  // pairs per routing block
constexpr int kRouteMaxExperts = 1024;
inline int64_t route_blocks(int64_t pairs) { return (pairs + kRouteThreads - 1) / kRouteThreads; }

struct RoutingBuffers {
  int32_t* pair_expert = nullptr;   // [P] expert of each pair; E when dropped (sentinel or bad id)
  int32_t* pair_row = nullptr;      // [P] sorted row of each pair, -1 when dropped
  int32_t* sorted_pair = nullptr;   // [P] pair of each sorted row (the first offsets[E] rows are valid)
  int32_t* block_hist = nullptr;    // [route_blocks(P), E] scratch
  int32_t* offsets = nullptr;       // [E + 1] first sorted row of each expert; offsets[E] = valid rows
  int32_t* tile_offsets = nullptr;  // [E + 1] first row tile of each expert, tiles of `tile_m` rows
  unsigned long long* error = nullptr;  // [1] sticky error word (see above)
};

// ExpertsCall::routing before a path that does not route inside its kernels: index [T, K] i32 and weights
// [T, K] f32 from the logits [T, E] f32, as the model's router picks them (kind: kRouteSoftmaxTopk or
// kRouteTopkSoftmax of base/cuda_route.cuh; E <= 32 * kRouteLogitsMaxPerLane, K <= 32).
constexpr int kRouteLogitsMaxPerLane = 32;
cudaError_t route_logits(const float* logits, int64_t tokens, int experts, int top_k, int kind, bool norm,
                         int32_t* index, float* weights, cudaStream_t stream);
// pair_expert only (no sort): for kernels that index the weights per pair.
cudaError_t route_validate(const void* top_k_index, Index index_type, int64_t tokens, int top_k, int experts,
                           int32_t* pair_expert, unsigned long long* error, cudaStream_t stream);
// Stable counting sort of the pairs by expert (three launches, deterministic: no order-dependent atomics).
cudaError_t route_sort(const void* top_k_index, Index index_type, int64_t tokens, int top_k, int experts, int tile_m,
                       const RoutingBuffers& b, cudaStream_t stream);

// ---- element-wise (elementwise.cu) ----

// xs[r, :] = x[sorted_pair[r] / top_k, :] for r < *valid_rows; launched for max_rows rows.
cudaError_t gather_rows(Elem type, const void* x, int64_t hidden, const int32_t* sorted_pair, int top_k,
                        const int32_t* valid_rows, int64_t max_rows, void* xs, cudaStream_t stream);

// act[r, :] = gate(h1[r, :] + bias[e]) for r < *valid_rows, e = pair_expert[sorted_pair[r]].
// h1 [max_rows, n1] f32 (n1 = 2I gated, I otherwise); bias [E, n1] of `type` or null; act [max_rows, inter].
cudaError_t gate_rows(Elem type, const float* h1, int64_t n1, const void* bias, const int32_t* sorted_pair,
                      const int32_t* pair_expert, const int32_t* valid_rows, int64_t max_rows, int64_t inter,
                      const GateParams& gate, void* act, cudaStream_t stream);

// out[t, :] = round( sum over k in slot order of w[t, k] * (y[row(t, k), :] + bias2[e]) ), f32 sum.
// row(t, k) = pair_row[p] (or p when pair_row is null); pairs with pair_expert[p] >= E are skipped.
// y [rows, hidden] f32; bias2 [E, hidden] of `type` or null; w [T, K] of `weight_type`.
cudaError_t combine(Elem type, Elem weight_type, const float* y, const int32_t* pair_row, const int32_t* pair_expert,
                    const void* routing_weights, const void* bias2, int64_t tokens, int top_k, int64_t hidden,
                    int experts, void* out, cudaStream_t stream);

// ---- grouped projections over sorted rows (grouped_gemm_*.cu) ----

struct GroupedGemmArgs {
  Elem type = Elem::bf16;  // A, B, bias and (kEpiGated / kEpiActOnly) the output
  const void* a = nullptr;  // A rows of k elements, row stride lda
  int64_t lda = 0;
  const int32_t* a_rows = nullptr;  // sorted row r reads A row a_rows[r] / a_row_div; null: A row r
  int a_row_div = 1;
  const void* b = nullptr;  // weight element (n, k) of expert e: b[e * b_expert_stride + n * b_stride_n + k * b_stride_k]
  int64_t b_expert_stride = 0, b_stride_n = 0, b_stride_k = 0;
  const void* bias = nullptr;  // bias[e * bias_expert_stride + n] or null (kEpiGated / kEpiActOnly)
  int64_t bias_expert_stride = 0;
  const int32_t* offsets = nullptr;       // [E + 1] device
  const int32_t* tile_offsets = nullptr;  // [E + 1] device, for tile_m
  int tile_m = 128;  // the TMA kernel's route tile (128, or 64: its ping-pong form); the others take a parameter
  int experts = 0;
  int64_t max_rows = 0;  // upper bound on the sorted rows (sizes the grid)
  int64_t n = 0;         // output columns: I for kEpiGated, else weight rows
  int64_t k = 0;         // reduction length
  int64_t inter = 0;     // I: up row of gated column c is I + c (concatenated)
  int epilogue = kEpiF32;
  GateParams gate;
  void* out = nullptr;  // [max_rows, ldo]
  int64_t ldo = 0;
  // kEpiWeighted: the pair of each sorted row and the routing weights [pairs] of `weight_type`; both null:
  // plain 16-bit rows (w = 1)
  const int32_t* row_pair = nullptr;
  const void* row_weights = nullptr;
  Elem weight_type = Elem::f32;
};

// Upper bound on the row tiles of all experts together: sum over e of ceil(rows_e / tile_m).
inline int64_t grouped_max_tiles(int64_t max_rows, int experts, int tile_m) {
  return (max_rows + tile_m - 1) / tile_m + (max_rows < experts ? max_rows : experts);
}
// Row tile height for these sizes: 16, 32, 64 or 128 (route_sort must use the same).
int grouped_tile_m(int64_t max_rows, int experts);
// Whether the tensor-core kernel serves these arguments on a device of this compute capability.
bool grouped_gemm_mma_ok(const GroupedGemmArgs& a, int arch);
// Whether the sm_90a kernel (wgmma, row tiles of 64 or 128) serves them: the mma conditions, a device
// of compute capability 9.0 and this build's sm_90a code for it.
bool grouped_gemm_wgmma_ok(const GroupedGemmArgs& a, int arch);
// The wgmma kernel for tiles of 64 and 128 rows where it serves (`wide`: 256 columns per block for
// tiles of 128 rows), else the mma.sync kernel where it serves, else the SIMT kernel (any dtype,
// layout, alignment).
cudaError_t grouped_gemm(const GroupedGemmArgs& a, int tile_m, int arch, bool wide, cudaStream_t stream);
// The warp-specialised persistent sm_90a kernel (grouped_gemm_sm90_tma.cu): route tiles of a.tile_m = 128
// or 64 rows (route_sort with the same tile_m), K-major weights read by the copy engine (TMA), A either
// contiguous sorted rows (a_rows null, read by TMA) or gathered by row index (a_rows set: the producer
// warpgroup copies row a_rows[r] / a_row_div of A with cp.async into the swizzled stage). Epilogues
// kEpiGated, kEpiActOnly, kEpiF32 and kEpiWeighted (row_pair and row_weights set). Serves bf16/f16 with k,
// lda and the weight strides multiples of 8 and 16-byte aligned A and B, on a device of compute
// capability 9.0 with this build's sm_90a code.
bool grouped_gemm_tma_ok(const GroupedGemmArgs& a, int arch);
// Whether this build carries the kernel's sm_90a code for the current device, of compute capability `arch`.
bool grouped_gemm_tma_built_for(int arch);
cudaError_t grouped_gemm_tma(const GroupedGemmArgs& a, cudaStream_t stream);
// Its form follows tile_m: 64 runs ping-pong (each consumer warpgroup owns items of 64 rows x 256
// columns, one runs its main loop while the other runs its epilogue), 128 runs cooperative (both
// warpgroups share tiles of 128 rows). Whether callers may route with 64 for it (on by default;
// MOEKIT_TMA_PINGPONG=0 in the environment switches it off):
bool grouped_gemm_tma_pingpong();
// The route tile for the TMA kernel: 64 (ping-pong) up to 384 pairs per busy expert on average (128 with
// A rows gathered by index) while ping-pong is allowed (MOEKIT_TMA_PINGPONG=N, N >= 2, sets the limit to
// N), else 128 (cooperative).
int grouped_tma_tile_m(int64_t pairs, int experts, bool gathered_a);
// The staging schedule of its f32 and weighted epilogues: one 8 KB box per round alternating between two
// halves of the staging buffer (on), or two boxes per round (off). Returns the previous setting.
bool set_grouped_gemm_tma_split_out(bool on);
// Its gated 16-bit epilogue for silu with biases or gpt-oss's clamped SwiGLU: unrolled, biases loaded first, exp and
// division in hardware approximations (on), or the generic per-value loop with expf (off). Returns the previous
// setting.
bool set_grouped_gemm_tma_fast_gate(bool on);
// Its cooperative tiles with no row for the second warpgroup (an expert's last tile of at most 64 rows): that
// warpgroup releases the stages without multiplying (on), or multiplies rows it does not store (off). Same bits.
// Returns the previous setting.
bool set_grouped_gemm_tma_skip_idle(bool on);
// Its ping-pong form over clusters of two CTAs (route tiles of 128 rows, one 64-row item per CTA, the weight boxes
// multicast to both) where ping-pong is picked (on), or ping-pong over route tiles of 64 (off). Same bits. Returns
// the previous setting; grouped_tma_tile_m follows it (128 for the pairs).
bool set_grouped_gemm_tma_pair(bool on);
// The pair form's stage releases: arrivals released at CTA scope (on) or at cluster scope (off). Same bits. Returns
// the previous setting.
bool set_grouped_gemm_tma_pair_cta_release(bool on);
bool set_grouped_gemm_tma_pingpong(bool on);  // returns the previous setting
// The three cp.async kernels, for tests and measurements.
cudaError_t grouped_gemm_wgmma(const GroupedGemmArgs& a, int tile_m, bool wide, cudaStream_t stream);
cudaError_t grouped_gemm_mma(const GroupedGemmArgs& a, int tile_m, cudaStream_t stream);
cudaError_t grouped_gemm_simt(const GroupedGemmArgs& a, int tile_m, cudaStream_t stream);

// out[t, :] = round( sum over k in slot order of yw[row(t, k), :] ), f32 sum, row(t, k) = pair_row[p] (or p
// when pair_row is null); pairs with pair_expert[p] >= E (sentinels, bad ids) are skipped. yw [rows, hidden]
// and out [T, hidden] of `type` (sonicmoe's reduction of the weighted rows kEpiWeighted wrote: no atomics, the
// same bits on every run).
cudaError_t sum_slots(Elem type, const void* yw, const int32_t* pair_row, const int32_t* pair_expert,
                      int64_t tokens, int top_k, int64_t hidden, int experts, void* out, cudaStream_t stream);
// combine over 16-bit second-projection rows y [rows, hidden] of `type` (kEpiWeighted without weights):
// out[t, :] = round( sum over k in slot order of w[p] * (y[row(p), :] + bias2[e(p), :]) ), f32, as combine.
cudaError_t combine_rows16(Elem type, Elem weight_type, const void* y, const int32_t* pair_row,
                           const int32_t* pair_expert, const void* weights, const void* bias2, int64_t tokens,
                           int top_k, int64_t hidden, int experts, void* out, cudaStream_t stream);

// ---- DeepGEMM's contiguous layout (expert_layout.cu) ----

// Rows padded per expert to the row tile: row_base[e] = tile_offsets[e] * tile_m (E + 1 entries);
// xl[row_base[e] + j, :] = x[token of expert e's j-th sorted pair, :] and pair_row_l[p] = that row, for
// the valid pairs (dropped pairs and the padding rows are left as they are). Launched for `pairs` rows.
// xl holds at least grouped_max_tiles(pairs, experts, tile_m) * tile_m rows of `hidden` elements.
cudaError_t contiguous_layout(Elem type, const void* x, int64_t hidden, int top_k, const RoutingBuffers& r,
                              int experts, int64_t pairs, int tile_m, int32_t* row_base, void* xl,
                              int32_t* pair_row_l, cudaStream_t stream);

// ---- per-pair GEMV (gemv.cu): each (token, slot) pair reads its expert's weights in place ----

struct PairGemvArgs {
  Elem type = Elem::bf16;
  const void* a = nullptr;  // pair p reads A row p / a_row_div, k elements
  int64_t lda = 0;
  int a_row_div = 1;
  const void* b = nullptr;  // weight rows of k contiguous elements: row n of expert e at b + e * b_expert_stride + n * k
  int64_t b_expert_stride = 0;
  const void* bias = nullptr;  // bias[e * bias_expert_stride + n] or null
  int64_t bias_expert_stride = 0;
  const void* index = nullptr;  // top_k_index [P]: pair p's expert; ids outside [0, experts) are skipped
  Index index_type = Index::i32;
  int top_k = 1;
  unsigned long long* error = nullptr;  // sticky routing error word (ids outside [0, experts]), or null
  int experts = 0;
  int64_t pairs = 0;
  int64_t n = 0, k = 0, inter = 0;
  int epilogue = kEpiF32;
  GateParams gate;
  const void* routing_weights = nullptr;  // pair_gemv_combine: [P] of routing_weight_type
  Elem routing_weight_type = Elem::f32;
  void* out = nullptr;  // pair_gemv: [P, ldo]; pair_gemv_combine: [tokens, ldo]
  int64_t ldo = 0;
  // Routing inside (ExpertsCall::routing; both launches, pair_route_ok): the ids and weights from router logits
  // [tokens, experts] f32 (kind kRouteSoftmaxTopk / kRouteTopkSoftmax, norm: renormalise) instead of index and
  // routing_weights; pair_gemv also writes them to route_index_out / route_weights_out ([tokens, top_k]).
  const float* route_logits = nullptr;
  int route_kind = 0, route_norm = 0;
  int32_t* route_index_out = nullptr;
  float* route_weights_out = nullptr;
};
// The most experts per lane of the routing inside the pair kernels (E <= 32 * kRouteInsidePerLane).
constexpr int kRouteInsidePerLane = 8;
// Whether pair_gemv serves these sizes (the A row is staged in shared memory).
bool pair_gemv_ok(Elem type, int64_t k);
// out[p, :] = epilogue(W[e_p] A[p / a_row_div]) for every pair.
cudaError_t pair_gemv(const PairGemvArgs& a, cudaStream_t stream);
// The second projection with the combine: out[t, :] = sum over slots s in order of
// w[t * K + s] * (W[e] A[t * K + s] + bias[e]), in f32, rounded once to `type` (K = top_k, e the slot's expert).
bool pair_gemv_combine_ok(int top_k);
// Whether pair_gemv then pair_gemv_combine route inside for these arguments (g1 / g2 with route_logits set): their
// default forms (16-byte rows, the direct first form, the streaming combine), a gated or activation-only first
// epilogue, f32 routing weights, E <= 32 * kRouteInsidePerLane, top_k <= 32.
bool pair_route_ok(const PairGemvArgs& g1, const PairGemvArgs& g2);
cudaError_t pair_gemv_combine(const PairGemvArgs& a, int64_t tokens, cudaStream_t stream);
// The small-T kernels' forms (A/B switches, same results bit for bit): pair_gemv reads the activation row in place
// (default) or stages it in shared memory first (MOEKIT_PAIR_GEMV_DIRECT=0 in the environment, read once);
// pair_gemv_combine runs one wave of blocks that split the columns evenly and load their first weights before the
// PDL wait (default; MOEKIT_COMBINE_STREAM=0: one block per group of columns). The setters return the previous value.
// Both projections and the combine in one launch (gemv.cu): one wave of blocks, the second projection's rows
// staged in shared memory by bulk copies while the first projection runs, a grid barrier between the two; the
// same output as pair_gemv then pair_gemv_combine, bit for bit. sm_90 (arch 90), 16-bit types with 16-byte
// aligned rows, T <= multiprocessors. g1 / g2 are the two launches' arguments (g2.a = g1.out); `barrier`: two
// words of device memory, zero between launches (each launch leaves them zero).
bool pair_fused_ok(const PairGemvArgs& g1, const PairGemvArgs& g2, int64_t tokens, int arch);
cudaError_t pair_fused(const PairGemvArgs& g1, const PairGemvArgs& g2, int64_t tokens, int arch, uint32_t* barrier,
                       cudaStream_t stream);
int64_t pair_fused_calls();  // launches so far in this process (tests)
bool pair_gemv_direct();
bool set_pair_gemv_direct(bool on);
bool combine_stream();
bool set_combine_stream(bool on);

// ---- FP8 block-scaled experts (grouped_gemm_fp8.cu) ----

// Dynamic activation quantisation, bit for bit moekit/quant.h quantize_activations_fp8: per row of `k` elements
// of `type` (row stride ldx) and group of 128 inputs, scale[row, g] = amax / 448 (rounded up to a power of two
// with pow2_scales), q[row, i] = e4m3(x / scale) (0 where the scale is 0), the row padded with zero codes to
// ldq >= ceil(k / 128) * 128 bytes. Output row r reads x row src_rows[r] / src_div (row r when src_rows is null).
// Rows at or past *valid_rows (when set) are left as they are.
cudaError_t quantize_fp8_rows(Elem type, const void* x, int64_t ldx, const int32_t* src_rows, int src_div,
                              int64_t rows, int64_t k, const int32_t* valid_rows, bool pow2_scales, uint8_t* q,
                              int64_t ldq, float* scale, int64_t lds, cudaStream_t stream);

// Weights [batch, n, k] of `type` quantized in 128 x 128 blocks as moekit/quant.h quantize_fp8 does with f32
// scales (`segments` equal parts of n with their own blocks): q [batch, n, k] e4m3, scale_inv [batch, SN, ceil(k /
// 128)]. For making FP8 experts from device weights (the benchmark's random experts).
cudaError_t quantize_fp8_blocks(Elem type, const void* w, int64_t batch, int64_t n, int64_t k, int64_t segments,
                               uint8_t* q, float* scale_inv, cudaStream_t stream);

// The grouped projection over quantized rows and FP8 weights: out = sum over 128-input blocks of
// (A block . W block) * a_scale[row, block] * w_scale[block row of n, block], then the epilogue (kernels above).
struct Fp8GemmArgs {
  Elem type = Elem::bf16;       // the output (kEpiGated / kEpiActOnly) and bias dtype
  const uint8_t* a = nullptr;   // e4m3 rows padded to whole 128-input groups, lda bytes apart (multiple of 16)
  int64_t lda = 0;
  const float* a_scale = nullptr;  // [rows, lds]
  int64_t lds = 0;
  const int32_t* a_rows = nullptr;  // sorted row r reads A row a_rows[r] / a_row_div; null: A row r
  int a_row_div = 1;
  const uint8_t* b = nullptr;  // weight (n, k) of expert e at b[e * b_expert_stride + n * b_stride_n + k] (bytes)
  int64_t b_expert_stride = 0, b_stride_n = 0;
  int64_t b_k = 0;  // readable bytes of a weight row (a multiple of 16, >= k; past k: zero codes)
  const float* b_scale = nullptr;  // [E, SN, ceil(k / 128)] f32; block row of weight row n: (n / seg) *
  int64_t bs_expert_stride = 0;    // ceil(seg / 128) + (n % seg) / 128 with seg = b_scale_seg
  int64_t b_scale_seg = 1;
  const void* bias = nullptr;  // bias[e * bias_expert_stride + n] or null
  int64_t bias_expert_stride = 0;
  const int32_t* offsets = nullptr;       // [E + 1] device
  const int32_t* tile_offsets = nullptr;  // [E + 1] device, for the tile_m passed
  int experts = 0;
  int64_t max_rows = 0;
  int64_t n = 0, k = 0, inter = 0;
  int epilogue = kEpiF32;  // kEpiGated, kEpiActOnly or kEpiF32 (the sm90 kernel: kEpiWeighted, 16-bit rows)
  GateParams gate;
  void* out = nullptr;
  int64_t ldo = 0;
};
// Whether this build carries the FP8 projection's code for the current device, of compute capability `arch`
// (the FP8 tensor cores: 8.9 and later).
bool grouped_gemm_fp8_built_for(int arch);
// Row tile of the FP8 projection for these sizes (32 or 128; route_sort must use the same).
int fp8_tile_m(int64_t max_rows, int experts);
cudaError_t grouped_gemm_fp8(const Fp8GemmArgs& a, int tile_m, cudaStream_t stream);
// The warp-specialised persistent sm_90a kernel (grouped_gemm_sm90_fp8.cu): e4m3 wgmma fed by TMA, row tiles of
// 128 (route_sort with tile_m 128), A contiguous sorted rows (a_rows null), gated projections with concatenated
// halves; whether it serves these arguments on a device of compute capability `arch`.
bool grouped_gemm_fp8_sm90_ok(const Fp8GemmArgs& a, int arch);
cudaError_t grouped_gemm_fp8_sm90(const Fp8GemmArgs& a, cudaStream_t stream);
// Its forms (grouped_gemm_sm90_fp8.cu), on by default, each setter returning the previous setting: the scales staged
// in shared memory by the producer (MOEKIT_FP8_SM90_STAGED_SCALES), the 16-bit outputs through shared memory and
// bulk tensor stores (MOEKIT_FP8_SM90_TMA_STORE).
bool set_fp8_sm90_staged_scales(bool on);
bool set_fp8_sm90_tma_store(bool on);
// Its forms for tiles with few rows, on by default: A boxes of 32 / 64 rows where the expert has no more in the tile
// (MOEKIT_FP8_SM90_SHORT_A), no MMAs for a warpgroup whose rows all lie past the expert's end
// (MOEKIT_FP8_SM90_SKIP_IDLE).
bool set_fp8_sm90_short_a(bool on);
bool set_fp8_sm90_skip_idle(bool on);
// And the work items handed from the producer to the consumers through shared memory (MOEKIT_FP8_SM90_ITEM_RING, on).
bool set_fp8_sm90_item_ring(bool on);

// ---- FP8 experts at decode sizes (gemv_quant.cu): the projection above as a weight-streaming GEMV ----

// One block per (row tile of tile_m sorted rows, block of output columns): each warp streams four weight rows of
// the tile's expert once per `rows_per_pass` (1 or 4) rows of the tile, 16-byte loads, e4m3 converted in
// registers, sums as grouped_gemm_fp8 forms them (per 128-input block, scaled by a_scale * w_scale). Same
// arguments and epilogues (kEpiGated, kEpiActOnly, kEpiF32); tile_offsets for tile_m. Whether it serves them:
// b_k and lda multiples of 16 with k <= b_k <= lda (A rows padded with zero codes, as quantize_fp8_rows writes
// them), 16-byte aligned A and B, weight strides multiples of 16.
bool fp8_gemv_ok(const Fp8GemmArgs& a);
cudaError_t fp8_gemv(const Fp8GemmArgs& a, int tile_m, int rows_per_pass, cudaStream_t stream);

// The pair form of the GEMV for a few tokens, without the routing sort: pair p (of a.max_rows, a multiple of
// top_k) runs on the expert top_k_index[p] (ids outside [0, experts] recorded in the error word as route_validate
// does; the sentinel and bad ids contribute nothing) against A row p / a_row_div, one block per (pair, block of
// columns), and the step after each projection is fused into its last block (arrival counters: zero at launch,
// left zero; fp8_pair_counters words per launch):
// - gated / activation epilogue: out [P, n] of `type` as fp8_gemv writes it, then quantized per 128 outputs into
//   q [P, ldq] / scale [P, lds] exactly as quantize_fp8_rows would quantize out;
// - kEpiF32: out [P, n] f32, then pa.out[t, :] = sum over slots s in order of w[t * K + s] * (out[t * K + s, :] +
//   bias2[e, :]), rounded once to `type`, exactly as combine sums them.
// The same values as fp8_gemv over the sorted pairs followed by those kernels, bit for bit.
struct Fp8PairArgs {
  const void* index = nullptr;  // top_k_index [P]
  Index index_type = Index::i32;
  int top_k = 1;
  unsigned long long* error = nullptr;  // sticky routing error word, or null
  uint32_t* counters = nullptr;
  int a_row_div = 1;
  uint8_t* q = nullptr;  // first projection: its outputs' e4m3 rows and scales
  int64_t ldq = 0;
  float* scale = nullptr;
  int64_t lds = 0;
  bool pow2 = false;  // power-of-two scales
  const void* routing_weights = nullptr;  // second projection: [P] of routing_weight_type
  Elem routing_weight_type = Elem::f32;
  const void* bias2 = nullptr;  // [E, n] of `type`, or null
  void* out = nullptr;          // [P / top_k, n] of `type`
};
int64_t fp8_pair_counters(const Fp8GemmArgs& a, int top_k);
cudaError_t fp8_pair_gemv(const Fp8GemmArgs& a, const Fp8PairArgs& pa, cudaStream_t stream);

}  // namespace moekit::cuda::kernels

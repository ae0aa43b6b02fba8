// FP8 block-scaled experts on CUDA (grouped_mm, batched_mm and deepgemm; SPEC section 5): the forward of
// transformers' fine-grained FP8 path, as the f64 reference runs it. Pairs sorted by expert on the device; the
// token rows quantized to e4m3 per 128 inputs (amax / 448); the first projection on the FP8 tensor cores with the
// gate in its epilogue; the gated activations quantized the same way; the second projection; the weighted
// combine. Weights are read as the checkpoint stores them (e4m3, f32 block scales staged once by prepare());
// nothing is dequantized. No host synchronisation, no allocation: capturable.
//
// Kernels: on sm_90a with 16-bit activations, wherever the GEMV below does not run, the warp-specialised TMA / wgmma
// kernel with row tiles of 128 (grouped_gemm_sm90_fp8.cu), over the quantized rows written in sorted order (the
// copy engine has no row gather: each token row is quantized once and its e4m3 bytes and scales copied to its
// sorted rows), its second projection in 16-bit rows summed by combine_rows16; otherwise the mma.sync kernel
// (grouped_gemm_fp8.cu), which gathers the token rows itself. MOEKIT_FP8_WGMMA=0 in the environment keeps to the
// mma.sync kernel (for comparisons).
// Decode sizes (P <= fp8_gemv_max_pairs(), policy.h; where the sm90 kernel applies, also 2 P < E and at most
// fp8_pair_max_tokens() tokens: fp8_gemv_sparse_only): both projections on the FP8 GEMV instead (gemv_quant.cu),
// over the same sorted rows and quantized activations: one block per (hit expert's row tile, block of columns),
// each hit expert's weights streamed once per step, idle experts costing nothing. Up to fp8_pair_max_tokens()
// tokens, its pair form instead: no sort, one block per (pair, block of columns), the activations' quantisation and
// the combine fused into the projections' last blocks (run_fp8_pairs).
//
// FP4 experts (e2m1 with ue8m0 scales per row and 32 inputs) run the same forward over their packed weights
// (kernels/quant_fp4.h): the tiled FP4 kernel (grouped_gemm_fp4.cu, e2m1 expanded in registers) or, at decode sizes,
// the same GEMV over FP4 bytes. With quantized activations (FP4 with UE8M0 scales) the token rows and the gated
// activations are quantized as above with power-of-two scales; with float activations (MXFP4 as transformers runs
// it) the kernels read the token rows (gathered by index) and the gated activations as they are, and f32
// activations keep to the GEMV (the tensor cores would round them).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "backends/cuda/kernels/cutlass_gemm.h"
#include "backends/cuda/kernels/fp8_rows.h"
#include "backends/cuda/kernels/quant_fp4.h"
#include "backends/cuda/policy.h"
#include "backends/cuda/state.h"
#include "base/env.h"
#include "moekit/quant.h"

namespace moekit::cuda {

namespace {
bool wgmma_enabled() {
  static const bool on = env_int("MOEKIT_FP8_WGMMA", 1) != 0;
  return on;
}
// The sm90 path's token rows quantized once per token and the e4m3 rows (and scales) then copied into sorted order,
// rather than each sorted row (top_k copies of a token) quantized from the 16-bit rows: the same bytes, the
// quantisation's arithmetic done once per token. MOEKIT_FP8_TOKEN_QUANT=0 quantizes the sorted rows (the first form).
EnvSwitch g_token_quant{"MOEKIT_FP8_TOKEN_QUANT", true};
// ... from this many pairs: below it one pass quantizes the sorted rows (two launches cost more than the repeated
// arithmetic there; measured on the H200, docs/perf.md 2026-12-03: 1% at qwen3-30b-a3b T <= 64, P <= 512, against
// 1.5-3% the other way at T >= 256). MOEKIT_FP8_TOKEN_QUANT_MIN_PAIRS overrides it.
constexpr int64_t kFp8TokenQuantMinPairs = 1024;
int64_t fp8_token_quant_min_pairs() {
  static const int64_t v = std::max<int64_t>(0, env_int("MOEKIT_FP8_TOKEN_QUANT_MIN_PAIRS", kFp8TokenQuantMinPairs));
  return v;
}
// policy.h fp8_gemv_sparse_only. Measured on the H200 (docs/perf.md), the sm90 kernel against the GEMV: mixtral-8x7b
// (E = 8) T = 1 (P = 2) 1.61x slower, T = 4 / 8 / 16 0.86x / 0.87x / 0.50x; qwen3-30b-a3b (E = 128) T = 1 (P = 8)
// 1.21x, T = 8 (P = 64) 0.92x; deepseek-v3 (E = 256) T = 1 / 8 (P = 8 / 64) 1.28x / 1.25x (2026-12-01). Since then
// the sm90 kernel streams faster (2026-12-03): deepseek-v3 T = 8 615 us against the sorted GEMV's 776, T = 4 366
// against the pair form's 387, T = 1 127 against 120; qwen3-30b-a3b T = 1 / 4 44.5 / 76.9 against the pair form's
// 27.0 / 70.1. Hence the GEMV within the pair form's tokens only.
EnvSwitch g_gemv_sparse{"MOEKIT_FP8_GEMV_SPARSE", true};
// FP8 experts on CUTLASS's grouped GEMM (grouped_gemm_cutlass_fp8.cu, where the build has it): the first projection's
// [gate | up] rows in bf16 (the rounding the gated epilogues apply first), the gate, computed as they compute it, and
// the activations' quantisation in one pass (gate_quantize_fp8_rows), the second projection in bf16 rows summed by
// combine_rows16 or moekit's sm90 kernel reading the gate pass's rows. Measured on the H200 (docs/perf.md,
// 2026-12-02) against the sm90 kernel alone, median us:
// - the first projection on the cooperative form (128 x 128 tiles) from 128 rows per expert and 2048 pairs, at any
//   hidden size: qwen3-30b-a3b (hidden 2048) T = 2048 / 4096 / 16384 392 / 618 / 2059 against 411 / 647 / 2110 with
//   moekit's second projection (CUTLASS's second: 415 / 641 / 2141); mixtral-8x7b T = 1024 (2048 pairs) 1021 against
//   1124, but T = 512 (1024 pairs) 678 against 650;
// - the second projection on CUTLASS from hidden size 4096: mixtral-8x7b T = 4096 / 16384 3145 / 13189 against
//   3394 / 13562 on moekit's; deepseek-v3 within the run's noise either way (5243 / 5017 at T = 4096);
// - the ping-pong form (64 x 128 tiles) below 64 rows per expert (slower from 64): qwen3-30b-a3b T = 128 / 256 / 512
//   221 / 230 / 243 against 235 / 253 / 273; below 8 rows per expert (2026-12-03) qwen3-30b-a3b T = 5 / 8 / 16 / 64
//   83.0 / 96.9 / 133.9 / 187.9 against 89.0 / 103.5 / 143.5 / 206.2, olmoe-1b-7b and qwen1.5-moe-a2.7b 5-9% at
//   T = 5-24, hence from no rows at all below hidden 4096. At hidden 4096 and above from 4 rows per expert:
//   deepseek-v3 T = 128 / 256 (4 / 8 rows) 2656 / 2788 against 2828 / 2975, mixtral-8x7b T = 64 / 128 (16 / 32 rows)
//   393 / 404 against 410 / 416; at 4 rows mixtral-8x7b (T = 16) is the one cell it costs, 385 against 375; below 4
//   rows par on deepseek-v3.
// MOEKIT_FP8_CUTLASS=0 keeps moekit's sm90 kernel everywhere.
EnvSwitch g_fp8_cutlass{"MOEKIT_FP8_CUTLASS", true};
// MXFP4 with bf16 activations within the GEMV's reach: the tensor-core GEMV (policy.h fp4_mma_gemv).
// Measured on an H100 (docs/perf.md, 2026-12-07): gpt-oss-20b MXFP4 T = 2 / 8 / 16 1.1x / 1.7x / 1.9x faster than the
// FP32 GEMV, and with its reach lifted 1.2-2.6x faster than the tiled FP4 kernel at T = 32..512.
EnvSwitch g_fp4_mma{"MOEKIT_FP4_MMA_GEMV", true};
std::atomic<int64_t> g_fp4_mma_calls{0};
std::atomic<int64_t> g_fp4_pair_calls{0};
std::mutex g_fp8_cutlass_mutex;
Fp8CutlassPolicy& fp8_cutlass_policy_locked() {
  static Fp8CutlassPolicy p = [] {
    Fp8CutlassPolicy d;
    d.rows = std::max<int64_t>(1, env_int("MOEKIT_FP8_CUTLASS_ROWS", d.rows));
    d.pairs = std::max<int64_t>(1, env_int("MOEKIT_FP8_CUTLASS_PAIRS", d.pairs));
    d.pingpong_min_rows = std::max<int64_t>(0, env_int("MOEKIT_FP8_CUTLASS_PINGPONG_MIN", d.pingpong_min_rows));
    d.pingpong_wide_min_rows =
        std::max<int64_t>(0, env_int("MOEKIT_FP8_CUTLASS_PINGPONG_WIDE_MIN", d.pingpong_wide_min_rows));
    d.pingpong_max_rows = std::max<int64_t>(0, env_int("MOEKIT_FP8_CUTLASS_PINGPONG_MAX", d.pingpong_max_rows));
    d.pingpong_hidden = std::max<int64_t>(0, env_int("MOEKIT_FP8_CUTLASS_PINGPONG_HIDDEN", d.pingpong_hidden));
    d.second_hidden = std::max<int64_t>(1, env_int("MOEKIT_FP8_CUTLASS_SECOND_HIDDEN", d.second_hidden));
    return d;
  }();
  return p;
}
std::atomic<int64_t> g_fp8_cutlass_calls[2] = {0, 0};  // cooperative, ping-pong

// The GEMV's default reach (policy.h fp8_gemv_max_pairs): 64, the decode sizes of issue 11 (T = 1..64 at top-k
// 1..8 reach it at P = 64). Not yet measured against the mma.sync kernel on the H200: the crossover may lie
// higher, notably for few experts with many rows each (MOEKIT_FP8_GEMV_MAX_PAIRS overrides it for measuring).
constexpr int64_t kFp8GemvMaxPairs = 64;
// The GEMV's pair form up to this many tokens (policy.h fp8_pair_max_tokens).
constexpr int64_t kFp8PairMaxTokens = 4;
// Row tile of the GEMV's routing: up to this many rows of an expert share one block per column block (a tile of
// more rows is another block, streaming the weights again).
constexpr int kFp8GemvTile = 64;
// FP4: 64 as well. Measured on gpt-oss-20b MXFP4 at T = 64 (256 pairs, 8 rows per expert): 723 us on the tiled
// kernel, 1447 us on the GEMV in four-row passes (docs/perf.md).
constexpr int64_t kFp4GemvMaxPairs = 64;
// The tensor-core form's reach (MXFP4, bf16 activations): 2048 pairs (gpt-oss-20b T = 512, 64 rows per expert: 1324
// against the tiled kernel's 1568 us on an H100; T = 128: 408 against 685). Beyond, each 64-row tile passes over its
// expert's weights twice per 64 rows and the tiled kernel is expected to win. MOEKIT_FP4_MMA_MAX_PAIRS overrides it.
constexpr int64_t kFp4MmaMaxPairs = 2048;
// Rows per expert (on average over the call's pairs) from which the FP8 experts take the sm90 kernel's 128-row tiles
// (sm_90a, 16-bit activations) instead of the mma.sync kernel's 32-row tiles: 0, i.e. wherever the GEMV does not
// run. Measured on the H200 (docs/perf.md) against fp8_tile_m's 64: qwen3-30b-a3b T = 64 (4 rows per expert)
// 305 -> 248 us, T = 512 (32 rows) 476 -> 309 us; deepseek-v3 T = 64 (2 rows) 3820 -> 2793 us. Not measured between
// the GEMV's reach and one row per expert (deepseek-v3 T = 9..31). MOEKIT_FP8_TILE128_ROWS overrides it.
constexpr int64_t kFp8Sm90TileRows = 0;
int64_t fp8_sm90_tile_rows() {
  static const int64_t v = std::max<int64_t>(0, env_int("MOEKIT_FP8_TILE128_ROWS", kFp8Sm90TileRows));
  return v;
}
std::atomic<int64_t>& fp8_gemv_limit() {
  static std::atomic<int64_t> v{env_int("MOEKIT_FP8_GEMV_MAX_PAIRS", kFp8GemvMaxPairs)};
  return v;
}
std::atomic<int64_t>& fp8_pair_limit() {
  static std::atomic<int64_t> v{env_int("MOEKIT_FP8_PAIR_TOKENS", kFp8PairMaxTokens)};
  return v;
}
int64_t fp4_mma_max_pairs() {
  static const int64_t v = env_int("MOEKIT_FP4_MMA_MAX_PAIRS", kFp4MmaMaxPairs);
  return v;
}
std::atomic<int64_t>& fp4_gemv_limit() {
  static std::atomic<int64_t> v{env_int("MOEKIT_FP4_GEMV_MAX_PAIRS", kFp4GemvMaxPairs)};
  return v;
}
// The tensor-core GEMV's pair form up to this many tokens (policy.h fp4_pair_max_tokens): 2. Measured on the H200
// (docs/perf.md, 2026-12-07), gpt-oss-20b MXFP4 (top-4 of 32), both forms on two K slices: T = 1 / 2 41.3 / 62.7 us
// against the sorted form's 49.9 / 74.5; T = 4 par (108.4 / 108); T = 8 199 against 163 (pairs on the same expert
// stream its weights once each).
constexpr int64_t kFp4PairMaxTokens = 2;
std::atomic<int64_t>& fp4_pair_limit() {
  static std::atomic<int64_t> v{env_int("MOEKIT_FP4_PAIR_TOKENS", kFp4PairMaxTokens)};
  return v;
}
}  // namespace

int64_t fp8_gemv_max_pairs() { return fp8_gemv_limit().load(); }
int64_t set_fp8_gemv_max_pairs(int64_t pairs) { return fp8_gemv_limit().exchange(pairs); }
int64_t fp8_pair_max_tokens() { return fp8_pair_limit().load(); }
int64_t set_fp8_pair_max_tokens(int64_t tokens) { return fp8_pair_limit().exchange(tokens); }
bool fp8_gemv_sparse_only() { return g_gemv_sparse.on(); }
bool set_fp8_gemv_sparse_only(bool on) { return g_gemv_sparse.set(on); }
bool set_fp8_cutlass(bool on) { return g_fp8_cutlass.set(on); }
Fp8CutlassPolicy fp8_cutlass_policy() {
  std::lock_guard<std::mutex> lock(g_fp8_cutlass_mutex);
  return fp8_cutlass_policy_locked();
}
Fp8CutlassPolicy set_fp8_cutlass_policy(const Fp8CutlassPolicy& policy) {
  std::lock_guard<std::mutex> lock(g_fp8_cutlass_mutex);
  return std::exchange(fp8_cutlass_policy_locked(), policy);
}
int64_t fp8_cutlass_calls(bool pingpong) { return g_fp8_cutlass_calls[pingpong ? 1 : 0].load(); }
int64_t fp4_gemv_max_pairs() { return fp4_gemv_limit().load(); }
int64_t set_fp4_gemv_max_pairs(int64_t pairs) { return fp4_gemv_limit().exchange(pairs); }
bool fp4_mma_gemv() { return g_fp4_mma.on(); }
bool set_fp4_mma_gemv(bool on) { return g_fp4_mma.set(on); }
int64_t fp4_mma_gemv_calls() { return g_fp4_mma_calls.load(); }
int64_t fp4_pair_max_tokens() { return fp4_pair_limit().load(); }
int64_t set_fp4_pair_max_tokens(int64_t tokens) { return fp4_pair_limit().exchange(tokens); }
int64_t fp4_pair_calls() { return g_fp4_pair_calls.load(); }

namespace {

// The arguments of one projection of the call (proj 1: the first, with its gate or activation epilogue; 2: the
// second, f32 out, its bias left to combine) over the routing `r`: A rows `a` (lda bytes for e4m3 codes, elements
// for float A), their scales (quantized A), row r reading A row a_rows[r] / a_row_div (a_rows null: row r).
kernels::Fp4GemmArgs projection_args(const CallContext& c, int proj, const kernels::RoutingBuffers& r, const void* a,
                                     int64_t lda, const float* a_scale, int64_t lds, const int32_t* a_rows,
                                     int a_row_div, void* out) {
  namespace k = kernels;
  const int64_t H = c.hidden, I = c.inter, N1 = c.n1;
  const bool first = proj == 1;
  const int64_t n_rows = first ? N1 : H, kin = first ? H : I;  // weight rows, inputs
  k::Fp4GemmArgs g;
  g.type = c.type;
  g.a = static_cast<const uint8_t*>(a);
  g.lda = lda;
  g.a_scale = a_scale;
  g.lds = lds;
  g.a_rows = a_rows;
  g.a_row_div = a_row_div;
  g.a_float = c.fp4 && c.fp4_float;
  const int64_t ld = first ? c.q1_ld : c.q2_ld;
  g.b = first ? c.q1 : c.q2;
  g.b_expert_stride = n_rows * ld;
  g.b_stride_n = ld;
  g.b_k = ld;
  if (c.fp4) {
    g.b_e8 = first ? c.e1 : c.e2;
    g.b_e8_ld = first ? c.e1_ld : c.e2_ld;
    g.bs_expert_stride = n_rows * g.b_e8_ld;
  } else {
    g.b_scale = first ? c.s1 : c.s2;
    g.bs_expert_stride = (first ? c.s1_rows : c.s2_rows) * fp8_blocks(kin);
    g.b_scale_seg = first ? N1 / c.seg1 : H;
  }
  g.bias = first ? c.b1 : nullptr;  // the second projection's: added by combine
  g.bias_expert_stride = first ? N1 : 0;
  g.offsets = r.offsets;
  g.tile_offsets = r.tile_offsets;
  g.experts = c.experts_count;
  g.max_rows = c.pairs;
  g.n = first ? I : H;
  g.k = kin;
  g.inter = I;
  g.epilogue = first ? c.first_epilogue : kernels::kEpiF32;
  g.gate = c.gate;
  g.out = out;
  g.ldo = first ? I : H;
  return g;
}

// The pair forms' routing: the call's top-k ids, their type, top_k and the workspace's error word.
kernels::Fp8PairArgs pair_args(const CallContext& c) {
  kernels::Fp8PairArgs pa;
  pa.index = c.call.top_k_index.data;
  pa.index_type = c.index_type;
  pa.top_k = int(c.top_k);
  pa.error = c.ws->error();
  return pa;
}

// The GEMV's pair form (kernels.h fp8_pair_gemv): the token rows quantized, the first projection quantizing its
// outputs in its last blocks, the second summing the slots in its (three launches; the sorted form takes six).
// False, with nothing launched, where the arrival counters the call needs exceed the workspace's.
bool run_fp8_pairs(const CallContext& c) {
  namespace k = kernels;
  const int64_t P = c.pairs, T = c.tokens, H = c.hidden, I = c.inter;
  const int64_t HB = fp8_blocks(H), IB = fp8_blocks(I);
  uint8_t *xq = nullptr, *aq = nullptr;
  float *xs = nullptr, *as = nullptr, *y = nullptr;
  void* act = nullptr;
  k::RoutingBuffers none;
  k::Fp4GemmArgs g1 = projection_args(c, 1, none, nullptr, HB * kFp8Block, nullptr, HB, nullptr, 1, nullptr);
  k::Fp4GemmArgs g2 = projection_args(c, 2, none, nullptr, IB * kFp8Block, nullptr, IB, nullptr, 1, nullptr);
  const int64_t words1 = k::fp8_pair_counters(g1, int(c.top_k));
  if (words1 + k::fp8_pair_counters(g2, int(c.top_k)) > StreamWorkspace::kCounterWords) return false;
  uint32_t* const counters = c.ws->counters();
  carve_workspace(*c.ws, [&](Carver& w) {
    xq = w.take<uint8_t>(T * HB * kFp8Block);  // e4m3 token rows, padded to whole groups, and their scales
    xs = w.take<float>(T * HB);
    act = w.take_bytes(P * I * k::elem_bytes(c.type));  // [P, I] gated activations
    aq = w.take<uint8_t>(P * IB * kFp8Block);            // and their e4m3 rows and scales
    as = w.take<float>(P * IB);
    y = w.take<float>(P * H);  // [P, H] f32
  });
  check_launch(k::quantize_fp8_rows(c.type, c.call.hidden_states.data, H, nullptr, 1, T, H, nullptr, c.fp8_pow2, xq,
                                    HB * kFp8Block, xs, HB, c.stream),
               "quantize_fp8_rows (hidden states)");
  k::Fp8PairArgs pa = pair_args(c);
  pa.counters = counters;
  pa.a_row_div = int(c.top_k);
  pa.q = aq;
  pa.ldq = IB * kFp8Block;
  pa.scale = as;
  pa.lds = IB;
  pa.pow2 = c.fp8_pow2;
  g1.a = xq;
  g1.a_scale = xs;
  g1.out = act;
  check_launch(k::fp8_pair_gemv(g1, pa, c.stream), "fp8_pair_gemv (first)");
  k::Fp8PairArgs pb = pair_args(c);
  pb.counters = counters + words1;
  pb.routing_weights = c.call.top_k_weights.data;
  pb.routing_weight_type = c.weight_type;
  pb.bias2 = c.b2;
  pb.out = c.call.out.data;
  g2.a = aq;
  g2.a_scale = as;
  g2.out = y;
  check_launch(k::fp8_pair_gemv(g2, pb, c.stream), "fp8_pair_gemv (second)");
  return true;
}

// MXFP4 with bf16 activations, a few tokens: the tensor-core GEMV's pair form (quant_fp4.h fp4_mma_pair_gemv), the
// token rows read in place, the gated activations written per pair, the second projection summing the slots in its
// last blocks (two launches; the sorted form takes four). False, with nothing launched, where the form does not
// apply (unaligned token rows, counters beyond the workspace's).
bool run_fp4_pairs(const CallContext& c) {
  namespace k = kernels;
  const int64_t P = c.pairs, H = c.hidden, I = c.inter;
  const int arch = c.device->arch();
  k::RoutingBuffers none;
  k::Fp4GemmArgs g1 = projection_args(c, 1, none, c.call.hidden_states.data, H, nullptr, 0, nullptr, int(c.top_k),
                                      nullptr);
  k::Fp4GemmArgs g2 = projection_args(c, 2, none, nullptr, I, nullptr, 0, nullptr, 1, nullptr);
  g2.a = reinterpret_cast<const uint8_t*>(size_t(256));  // the workspace's rows: aligned
  if (!k::fp4_mma_gemv_ok(g1, arch) || !k::fp4_mma_gemv_ok(g2, arch) ||
      k::fp4_mma_pair_counters(g2, int(c.top_k)) > StreamWorkspace::kCounterWords)
    return false;
  void* act = nullptr;
  float* y = nullptr;
  carve_workspace(*c.ws, [&](Carver& w) {
    act = w.take_bytes(P * I * k::elem_bytes(c.type));  // [P, I] gated activations, pair order
    y = w.take<float>(P * H);                           // [P, H] f32, pair order
  });
  k::Fp8PairArgs pa = pair_args(c);
  g1.out = act;
  check_launch(k::fp4_mma_pair_gemv(g1, pa, arch, c.stream), "fp4_mma_pair_gemv (first)");
  pa.counters = c.ws->counters();
  pa.routing_weights = c.call.top_k_weights.data;
  pa.routing_weight_type = c.weight_type;
  pa.bias2 = c.b2;
  pa.out = c.call.out.data;
  g2.a = static_cast<const uint8_t*>(act);
  g2.out = y;
  check_launch(k::fp4_mma_pair_gemv(g2, pa, arch, c.stream), "fp4_mma_pair_gemv (second)");
  g_fp4_mma_calls.fetch_add(2, std::memory_order_relaxed);
  g_fp4_pair_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace

void run_fp8(const CallContext& c) {
  namespace k = kernels;
  const int64_t P = c.pairs, E = c.experts_count, T = c.tokens, H = c.hidden, I = c.inter, N1 = c.n1;
  const int64_t HB = fp8_blocks(H), IB = fp8_blocks(I);
  const bool fp4 = c.fp4, float_acts = c.fp4 && c.fp4_float;
  const auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  const int arch = c.device->arch();

  // The second projection's arguments decide the kernel (the first one's differ only in A and the epilogue).
  k::RoutingBuffers none;
  const k::Fp4GemmArgs probe = projection_args(c, 2, none, reinterpret_cast<const uint8_t*>(size_t(256)),
                                               IB * kFp8Block, nullptr, IB, nullptr, 1, nullptr);
  // f32 activations keep to the mma.sync kernel: wgmma's FP8 accumulation is not exact within a block (its
  // partial sums land within about 1e-4 instead of f32 rounding), which moves the requantized activations
  // enough to miss the f32 tolerance (1e-5); it is well within the bf16 / f16 ones.
  const bool sm90_ok = !fp4 && wgmma_enabled() && c.type != k::Elem::f32 && k::grouped_gemm_fp8_sm90_ok(probe, arch) &&
                       (c.first_epilogue != k::kEpiGated || c.gate.concatenated) && c.q1_ld % 16 == 0 &&
                       (N1 * c.q1_ld) % 16 == 0 && (reinterpret_cast<uintptr_t>(c.q1) & 15) == 0;
  // Decode: the GEMV (its launcher checks the rest: strides are multiples of 16 by construction), where the sm90
  // kernel applies only for fewer pairs than half the experts and within the pair form's tokens
  // (fp8_gemv_sparse_only). f32 float activations always (no tensor-core kernel takes them unrounded).
  // MXFP4 with bf16 activations: the GEMV on the tensor cores (each weight decoded once per 8 rows of an expert),
  // within its own reach.
  const bool fp4_mma_reach = fp4 && float_acts && c.type == k::Elem::bf16 && g_fp4_mma.on() && P <= fp4_mma_max_pairs();
  const bool gemv = fp4 ? (float_acts && c.type == k::Elem::f32) || P <= fp4_gemv_max_pairs() || fp4_mma_reach
                        : P <= fp8_gemv_max_pairs() && c.q1_ld % 16 == 0 && c.q2_ld % 16 == 0 && aligned16(c.q1) &&
                              aligned16(c.q2) &&
                              !(sm90_ok && fp8_gemv_sparse_only() &&
                                (2 * P >= E || T > std::max(fp8_pair_max_tokens(), kFp8PairMaxTokens)));
  // The GEMV's pair form for a few tokens (FP8 weights, quantized activations).
  if (gemv && !fp4 && T <= fp8_pair_max_tokens() && P <= 65535 && run_fp8_pairs(c)) return;
  if (fp4_mma_reach && T <= fp4_pair_max_tokens() && P <= 65535 && run_fp4_pairs(c)) return;
  // Row tiles: the sm90 kernel's 128 from fp8_sm90_tile_rows() rows per expert on average (its TMA pipeline streams
  // the weights faster than the mma.sync kernel's 32-row tiles even when most of a tile is padding); elsewhere
  // fp8_tile_m's choice.
  const int tile_m = gemv ? kFp8GemvTile
                     : sm90_ok && P >= fp8_sm90_tile_rows() * E ? 128
                                                                 : k::fp8_tile_m(P, int(E));
  const bool sm90 = sm90_ok && !gemv && tile_m == 128;
  // CUTLASS's kernel: bf16, [gate | up] rows without bias, whole 128 x 128 scale blocks (inputs and outputs multiples
  // of 128, the gated projection's halves each whole blocks), enough rows per expert.
  k::CutlassFp8Args cut1, cut2;
  // The form from the rows per expert on average (policy.h Fp8CutlassPolicy).
  const Fp8CutlassPolicy cp = fp8_cutlass_policy();
  const bool cooperative = P >= cp.rows * E && P >= cp.pairs;
  const bool pingpong = !cooperative && P < cp.pingpong_max_rows * E &&
                        P >= (H < cp.pingpong_hidden ? cp.pingpong_min_rows : cp.pingpong_wide_min_rows) * E;
  const bool cutlass = sm90 && !float_acts && g_fp8_cutlass.on() && c.type == k::Elem::bf16 &&
                       c.first_epilogue == k::kEpiGated && c.b1 == nullptr && H % 128 == 0 && I % 128 == 0 &&
                       c.s1_rows == N1 / 128 && (N1 / c.seg1) % 128 == 0 && c.s2_rows == H / 128 &&
                       (cooperative || pingpong) && [&] {
                         cut1 = {nullptr, nullptr, c.q1, N1 * c.q1_ld, c.q1_ld, c.s1, c.s1_rows * HB, nullptr,
                                 int(E), N1, H, nullptr, pingpong};
                         cut2 = {nullptr, nullptr, c.q2, H * c.q2_ld, c.q2_ld, c.s2, c.s2_rows * IB, nullptr,
                                 int(E), H, I, nullptr, pingpong};
                         const uint8_t* probe_a = reinterpret_cast<const uint8_t*>(size_t(256));
                         cut1.a = cut2.a = probe_a;
                         cut1.out = cut2.out = const_cast<uint8_t*>(probe_a);
                         return k::grouped_gemm_fp8_cutlass_ok(cut1, arch) && k::grouped_gemm_fp8_cutlass_ok(cut2, arch);
                       }();
  // The second projection on CUTLASS's kernel from a hidden size, else on moekit's sm90 kernel (reading the gate
  // pass's rows as its own first projection's).
  const bool cutlass_second = cutlass && H >= cp.second_hidden;
  const int64_t xrows = sm90 ? P : T;  // quantized token rows: in sorted order for the TMA kernel
  // Quantized per token, then copied into sorted order.
  const bool token_quant = sm90 && g_token_quant.on() && P >= fp8_token_quant_min_pairs();
  // The sm90 path's second projection in 16-bit rows for combine_rows16 (the TMA engine's form; y holds room for
  // f32 rows). MOEKIT_DOWN_ROWS16=0: f32 rows and combine.
  const bool rows16 = sm90 && (cutlass || grouped_down_rows16());
  // Float activations are read in place, gathered by index, unless the token rows are not 16-byte aligned: then
  // gathered into the workspace first.
  const bool gather_x = float_acts && !aligned16(c.call.hidden_states.data);

  k::RoutingBuffers r;
  uint8_t *xq = nullptr, *aq = nullptr, *xq_tok = nullptr;
  float *xs = nullptr, *as = nullptr, *y = nullptr, *xs_tok = nullptr;
  void *act = nullptr, *xg = nullptr, *h1 = nullptr, *cut_ws = nullptr;
  carve_workspace(*c.ws, [&](Carver& w) {
    take_routing(w, r, P, E);
    if (!float_acts) {
      xq = w.take<uint8_t>(xrows * HB * kFp8Block);  // e4m3 token rows, padded to whole groups
      xs = w.take<float>(xrows * HB);                // their scales
      aq = w.take<uint8_t>(P * IB * kFp8Block);  // [P, IB * 128]
      as = w.take<float>(P * IB);
      if (token_quant) {
        xq_tok = w.take<uint8_t>(T * HB * kFp8Block);  // [T, HB * 128] e4m3 token rows, then their scales
        xs_tok = w.take<float>(T * HB);
      }
    }
    if (gather_x) xg = w.take_bytes(P * H * k::elem_bytes(c.type));  // token rows in sorted order
    if (cutlass) {
      h1 = w.take_bytes(P * N1 * 2);  // [P, 2I] bf16 [gate | up] rows
      cut_ws = w.take_bytes(int64_t(k::grouped_gemm_fp8_cutlass_workspace(int(E))));
    } else {
      act = w.take_bytes(P * I * k::elem_bytes(c.type));  // [P, I] gated activations, sorted rows
    }
    y = w.take<float>(P * H);  // [P, H] f32, sorted rows
  });
  r.error = c.ws->error();

  check_launch(k::route_sort(c.call.top_k_index.data, c.index_type, T, int(c.top_k), int(E), tile_m, r, c.stream),
               "route_sort");
  if (float_acts) {
    if (gather_x)
      check_launch(k::gather_rows(c.type, c.call.hidden_states.data, H, r.sorted_pair, int(c.top_k), r.offsets + E, P,
                                  xg, c.stream),
                   "gather_rows");
  } else if (token_quant) {
    check_launch(k::quantize_fp8_rows(c.type, c.call.hidden_states.data, H, nullptr, 1, T, H, nullptr, c.fp8_pow2,
                                      xq_tok, HB * kFp8Block, xs_tok, HB, c.stream),
                 "quantize_fp8_rows (hidden states)");
    check_launch(k::gather_fp8_rows(xq_tok, xs_tok, HB * kFp8Block, HB, r.sorted_pair, int(c.top_k), r.offsets + E, P,
                                    xq, xs, c.stream),
                 "gather_fp8_rows");
  } else if (sm90) {
    check_launch(k::quantize_fp8_rows(c.type, c.call.hidden_states.data, H, r.sorted_pair, int(c.top_k), P, H,
                                      r.offsets + E, c.fp8_pow2, xq, HB * kFp8Block, xs, HB, c.stream),
                 "quantize_fp8_rows (hidden states, sorted)");
  } else {
    check_launch(k::quantize_fp8_rows(c.type, c.call.hidden_states.data, H, nullptr, 1, T, H, nullptr, c.fp8_pow2,
                                      xq, HB * kFp8Block, xs, HB, c.stream),
                 "quantize_fp8_rows (hidden states)");
  }
  // The GEMV passes over 4 rows of an expert at once when experts average more than one row (else 1: each
  // weight chunk converted once).
  const int rows_per_pass = P > E ? 4 : 1;
  const bool fp4_mma = fp4 && gemv && g_fp4_mma.on();
  auto gemm = [&](const k::Fp4GemmArgs& g, const char* what) {
    if (fp4_mma && k::fp4_mma_gemv_ok(g, arch)) {
      check_launch(k::fp4_mma_gemv(g, tile_m, arch, c.stream), what);
      g_fp4_mma_calls.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    check_launch(fp4    ? (gemv ? k::fp4_gemv(g, tile_m, rows_per_pass, c.stream) : k::grouped_gemm_fp4(g, tile_m, c.stream))
                 : gemv ? k::fp8_gemv(g, tile_m, rows_per_pass, c.stream)
                 : sm90 ? k::grouped_gemm_fp8_sm90(g, c.stream)
                        : k::grouped_gemm_fp8(g, tile_m, c.stream),
                 what);
  };

  if (cutlass) {
    cut1.a = xq;
    cut1.a_scale = xs;
    cut1.offsets = r.offsets;
    cut1.out = h1;
    check_launch(k::grouped_gemm_fp8_cutlass(cut1, cut_ws, c.stream), "grouped_gemm_fp8_cutlass (first)");
    check_launch(k::gate_quantize_fp8_rows(c.type, h1, P, I, c.gate, r.offsets + E, c.fp8_pow2, aq, IB * kFp8Block,
                                           as, IB, c.stream),
                 "gate_quantize_fp8_rows");
    g_fp8_cutlass_calls[pingpong ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
  } else if (float_acts)
    gemm(projection_args(c, 1, r, gather_x ? xg : c.call.hidden_states.data, H, nullptr, 0,
                         gather_x ? nullptr : r.sorted_pair, gather_x ? 1 : int(c.top_k), act),
         "quantized projection (first)");
  else
    gemm(projection_args(c, 1, r, xq, HB * kFp8Block, xs, HB, sm90 ? nullptr : r.sorted_pair,
                         sm90 ? 1 : int(c.top_k), act),
         "quantized projection (first)");

  if (float_acts) {
    gemm(projection_args(c, 2, r, act, I, nullptr, 0, nullptr, 1, y), "quantized projection (second)");
  } else if (cutlass_second) {
    cut2.a = aq;
    cut2.a_scale = as;
    cut2.offsets = r.offsets;
    cut2.out = y;
    check_launch(k::grouped_gemm_fp8_cutlass(cut2, cut_ws, c.stream), "grouped_gemm_fp8_cutlass (second)");
  } else {
    if (!cutlass)
      check_launch(k::quantize_fp8_rows(c.type, act, I, nullptr, 1, P, I, r.offsets + E, c.fp8_pow2, aq,
                                        IB * kFp8Block, as, IB, c.stream),
                   "quantize_fp8_rows (activations)");
    k::Fp4GemmArgs g2 = projection_args(c, 2, r, aq, IB * kFp8Block, as, IB, nullptr, 1, y);
    if (rows16) g2.epilogue = k::kEpiWeighted;  // 16-bit rows (no weights): combine_rows16 below
    gemm(g2, "quantized projection (second)");
  }
  if (rows16) {
    check_launch(k::combine_rows16(c.type, c.weight_type, y, r.pair_row, r.pair_expert, c.call.top_k_weights.data,
                                   c.b2, T, int(c.top_k), H, int(E), c.call.out.data, c.stream),
                 "combine_rows16");
    return;
  }

  check_launch(k::combine(c.type, c.weight_type, y, r.pair_row, r.pair_expert, c.call.top_k_weights.data, c.b2, T,
                          int(c.top_k), H, int(E), c.call.out.data, c.stream),
               "combine");
}

}  // namespace moekit::cuda

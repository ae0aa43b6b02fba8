// FP8 block-scaled experts on CUDA (grouped_mm, batched_mm and deepgemm; SPEC section 5): the forward of
// transformers' fine-grained FP8 path, as the f64 reference runs it. Pairs sorted by expert on the device; the
// token rows quantized to e4m3 per 128 inputs (amax / 448); the first projection on the FP8 tensor cores with the
// gate in its epilogue; the gated activations quantized the same way; the second projection; the weighted
// combine. Weights are read as the checkpoint stores them (e4m3, f32 block scales staged once by prepare());
// nothing is dequantized. No host synchronisation, no allocation: capturable.
//
// Kernels: with row tiles of 128 (many rows per expert) on sm_90a and 16-bit activations, the warp-specialised
// TMA / wgmma kernel
// (grouped_gemm_sm90_fp8.cu), over the quantized rows written in sorted order (the copy engine has no row
// gather); otherwise the mma.sync kernel (grouped_gemm_fp8.cu), which gathers the token rows itself.
// MOEKIT_FP8_WGMMA=0 in the environment keeps to the mma.sync kernel (for comparisons).
// Decode sizes (P <= fp8_gemv_max_pairs(), policy.h): both projections on the FP8 GEMV instead (gemv_quant.cu),
// over the same sorted rows and quantized activations: one block per (hit expert's row tile, block of columns),
// each hit expert's weights streamed once per step (the tiled kernels read them at a fraction of the bandwidth
// when the tiles hold one or two rows).
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "backends/cuda/policy.h"
#include "backends/cuda/state.h"
#include "moekit/quant.h"

namespace moekit::cuda {

namespace {
bool wgmma_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOEKIT_FP8_WGMMA");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

// The GEMV's default reach (policy.h fp8_gemv_max_pairs): 64, the decode sizes of issue 11 (T = 1..64 at top-k
// 1..8 reach it at P = 64). Not yet measured against the mma.sync kernel on the H200: the crossover may lie
// higher, notably for few experts with many rows each (MOEKIT_FP8_GEMV_MAX_PAIRS overrides it for measuring).
constexpr int64_t kFp8GemvMaxPairs = 64;
// Row tile of the GEMV's routing: up to this many rows of an expert share one block per column block (a tile of
// more rows is another block, streaming the weights again).
constexpr int kFp8GemvTile = 64;
std::atomic<int64_t>& fp8_gemv_limit() {
  static std::atomic<int64_t> v{[] {
    const char* e = std::getenv("MOEKIT_FP8_GEMV_MAX_PAIRS");
    return e && *e ? int64_t(std::strtoll(e, nullptr, 10)) : kFp8GemvMaxPairs;
  }()};
  return v;
}
}  // namespace

int64_t fp8_gemv_max_pairs() { return fp8_gemv_limit().load(); }
int64_t set_fp8_gemv_max_pairs(int64_t pairs) { return fp8_gemv_limit().exchange(pairs); }

void run_fp8(const CallContext& c) {
  namespace k = kernels;
  const int64_t P = c.pairs, E = c.experts_count, T = c.tokens, H = c.hidden, I = c.inter, N1 = c.n1;
  const int64_t HB = fp8_blocks(H), IB = fp8_blocks(I);
  const auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  // Decode: the GEMV (its launcher checks the rest: strides are multiples of 16 by construction).
  const bool gemv = P <= fp8_gemv_max_pairs() && c.q1_ld % 16 == 0 && c.q2_ld % 16 == 0 && aligned16(c.q1) &&
                    aligned16(c.q2);
  const int tile_m = gemv ? kFp8GemvTile : k::fp8_tile_m(P, int(E));
  const int arch = c.device->arch();

  // The second projection's arguments decide the kernel (the first one's differ only in A and the epilogue).
  k::Fp8GemmArgs probe;
  probe.a = reinterpret_cast<const uint8_t*>(size_t(256));  // carved buffers: 256-byte aligned
  probe.lda = IB * kFp8Block;
  probe.b = c.q2;
  probe.b_expert_stride = H * c.q2_ld;
  probe.b_stride_n = c.q2_ld;
  probe.experts = int(E);
  probe.max_rows = P;
  probe.n = H;
  probe.k = I;
  probe.epilogue = k::kEpiF32;
  probe.gate = c.gate;
  // f32 activations keep to the mma.sync kernel: wgmma's FP8 accumulation is not exact within a block (its
  // partial sums land within about 1e-4 instead of f32 rounding), which moves the requantized activations
  // enough to miss the f32 tolerance (1e-5); it is well within the bf16 / f16 ones.
  const bool sm90 = !gemv && wgmma_enabled() && tile_m == 128 && c.type != k::Elem::f32 &&
                    k::grouped_gemm_fp8_sm90_ok(probe, arch) &&
                    (c.first_epilogue != k::kEpiGated || c.gate.concatenated) && c.q1_ld % 16 == 0 &&
                    (N1 * c.q1_ld) % 16 == 0 && (reinterpret_cast<uintptr_t>(c.q1) & 15) == 0;
  const int64_t xrows = sm90 ? P : T;  // quantized token rows: in sorted order for the TMA kernel

  k::RoutingBuffers r;
  uint8_t *xq = nullptr, *aq = nullptr;
  float *xs = nullptr, *as = nullptr, *y = nullptr;
  void* act = nullptr;
  carve_workspace(*c.ws, [&](Carver& w) {
    take_routing(w, r, P, E);
    xq = w.take<uint8_t>(xrows * HB * kFp8Block);  // e4m3 token rows, padded to whole groups
    xs = w.take<float>(xrows * HB);                // their scales
    act = w.take_bytes(P * I * k::elem_bytes(c.type));  // [P, I] gated activations, sorted rows
    aq = w.take<uint8_t>(P * IB * kFp8Block);  // [P, IB * 128]
    as = w.take<float>(P * IB);
    y = w.take<float>(P * H);  // [P, H] f32, sorted rows
  });
  r.error = c.ws->error();

  check_launch(k::route_sort(c.call.top_k_index.data, c.index_type, T, int(c.top_k), int(E), tile_m, r, c.stream),
               "route_sort");
  if (sm90)
    check_launch(k::quantize_fp8_rows(c.type, c.call.hidden_states.data, H, r.sorted_pair, int(c.top_k), P, H,
                                      r.offsets + E, c.fp8_pow2, xq, HB * kFp8Block, xs, HB, c.stream),
                 "quantize_fp8_rows (hidden states, sorted)");
  else
    check_launch(k::quantize_fp8_rows(c.type, c.call.hidden_states.data, H, nullptr, 1, T, H, nullptr, c.fp8_pow2,
                                      xq, HB * kFp8Block, xs, HB, c.stream),
                 "quantize_fp8_rows (hidden states)");
  // The GEMV passes over 4 rows of an expert at once when experts average more than one row (else 1: each
  // weight chunk converted once).
  const int rows_per_pass = P > E ? 4 : 1;
  auto gemm = [&](const k::Fp8GemmArgs& g, const char* what) {
    check_launch(gemv   ? k::fp8_gemv(g, tile_m, rows_per_pass, c.stream)
                 : sm90 ? k::grouped_gemm_fp8_sm90(g, c.stream)
                        : k::grouped_gemm_fp8(g, tile_m, c.stream),
                 what);
  };

  k::Fp8GemmArgs g1;
  g1.type = c.type;
  g1.a = xq;
  g1.lda = HB * kFp8Block;
  g1.a_scale = xs;
  g1.lds = HB;
  g1.a_rows = sm90 ? nullptr : r.sorted_pair;
  g1.a_row_div = sm90 ? 1 : int(c.top_k);
  g1.b = c.q1;
  g1.b_expert_stride = N1 * c.q1_ld;
  g1.b_stride_n = c.q1_ld;
  g1.b_k = c.q1_ld;
  g1.b_scale = c.s1;
  g1.bs_expert_stride = c.s1_rows * HB;
  g1.b_scale_seg = N1 / c.seg1;
  g1.bias = c.b1;
  g1.bias_expert_stride = N1;
  g1.offsets = r.offsets;
  g1.tile_offsets = r.tile_offsets;
  g1.experts = int(E);
  g1.max_rows = P;
  g1.n = I;
  g1.k = H;
  g1.inter = I;
  g1.epilogue = c.first_epilogue;
  g1.gate = c.gate;
  g1.out = act;
  g1.ldo = I;
  gemm(g1, "grouped_gemm_fp8 (first projection)");

  check_launch(k::quantize_fp8_rows(c.type, act, I, nullptr, 1, P, I, r.offsets + E, c.fp8_pow2, aq,
                                    IB * kFp8Block, as, IB, c.stream),
               "quantize_fp8_rows (activations)");

  k::Fp8GemmArgs g2 = g1;
  g2.a = aq;
  g2.lda = IB * kFp8Block;
  g2.a_scale = as;
  g2.lds = IB;
  g2.a_rows = nullptr;
  g2.a_row_div = 1;
  g2.b = c.q2;
  g2.b_expert_stride = H * c.q2_ld;
  g2.b_stride_n = c.q2_ld;
  g2.b_k = c.q2_ld;
  g2.b_scale = c.s2;
  g2.bs_expert_stride = c.s2_rows * IB;
  g2.b_scale_seg = H;
  g2.bias = nullptr;  // added by combine
  g2.bias_expert_stride = 0;
  g2.n = H;
  g2.k = I;
  g2.epilogue = k::kEpiF32;
  g2.out = y;
  g2.ldo = H;
  gemm(g2, "grouped_gemm_fp8 (second projection)");

  check_launch(k::combine(c.type, c.weight_type, y, r.pair_row, r.pair_expert, c.call.top_k_weights.data, c.b2, T,
                          int(c.top_k), H, int(E), c.call.out.data, c.stream),
               "combine");
}

}  // namespace moekit::cuda

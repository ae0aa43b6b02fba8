// grouped_mm on CUDA: pairs sorted by expert on the device, one grouped projection kernel per
// projection over the sorted rows (offsets read on the device), then the weighted combine. No host
// synchronisation and no allocation: capturable in a CUDA graph.
//
// Kernel choice: on sm_90a, when the row tiles are 64 or 128 high (larger T) and both projections
// suit it, the warp-specialised TMA kernel (grouped_gemm_sm90_tma.cu), with the routed rows of the
// hidden states first gathered into a contiguous [rows, H] buffer that the copy engine reads. Otherwise
// per projection (transparent fallback): the tensor-core kernels for bf16/f16 weights in [out, in]
// layout with sizes a multiple of 8 and aligned pointers (wgmma on sm_90a for row tiles of 64 and 128,
// mma.sync otherwise); else the CUDA-core kernel, which takes any dtype, layout and size.
#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "backends/cuda/state.h"
#include "base/env.h"

namespace moekit::cuda {

namespace {
std::atomic<bool> g_tma{true};
EnvSwitch g_rows16{"MOEKIT_DOWN_ROWS16", true};
}  // namespace
bool grouped_tma_enabled() { return g_tma.load(); }
bool set_grouped_tma_enabled(bool enabled) { return g_tma.exchange(enabled); }
bool grouped_down_rows16() { return g_rows16.on(); }
bool set_grouped_down_rows16(bool on) { return g_rows16.set(on); }

void second_projection_rows16(kernels::GroupedGemmArgs& g2) {
  g2.epilogue = kernels::kEpiWeighted;  // no row weights: the accumulators rounded to the activations' dtype
  g2.row_pair = nullptr;
  g2.row_weights = nullptr;
  g2.bias = nullptr;  // added by combine
}

Projections grouped_projections(const CallContext& c, const void* a, const int32_t* a_rows, int a_row_div,
                                const int32_t* offsets, const int32_t* tile_offsets, int64_t max_rows, void* act,
                                float* y) {
  Projections p;
  kernels::GroupedGemmArgs& g1 = p.first;
  g1.type = c.type;
  g1.a = a;
  g1.lda = c.hidden;
  g1.a_rows = a_rows;
  g1.a_row_div = a_row_div;
  g1.b = c.w1;
  g1.b_expert_stride = c.w1_expert;
  g1.b_stride_n = c.w1_n;
  g1.b_stride_k = c.w1_k;
  g1.bias = c.b1;
  g1.bias_expert_stride = c.n1;
  g1.offsets = offsets;
  g1.tile_offsets = tile_offsets;
  g1.experts = c.experts_count;
  g1.max_rows = max_rows;
  g1.n = c.inter;
  g1.k = c.hidden;
  g1.inter = c.inter;
  g1.epilogue = c.first_epilogue;
  g1.gate = c.gate;
  g1.out = act;
  g1.ldo = c.inter;

  kernels::GroupedGemmArgs& g2 = p.second;
  g2 = g1;
  g2.a = act;
  g2.lda = c.inter;
  g2.a_rows = nullptr;
  g2.a_row_div = 1;
  g2.b = c.w2;
  g2.b_expert_stride = c.w2_expert;
  g2.b_stride_n = c.w2_n;
  g2.b_stride_k = c.w2_k;
  g2.bias = nullptr;  // added by combine
  g2.bias_expert_stride = 0;
  g2.n = c.hidden;
  g2.k = c.inter;
  g2.epilogue = kernels::kEpiF32;
  g2.out = y;
  g2.ldo = c.hidden;
  return p;
}

void run_grouped_mm(const CallContext& c) {
  if (c.fp8) {  // FP8 experts: quantized_fp8.cpp
    run_fp8(c);
    return;
  }
  namespace k = kernels;
  const int64_t P = c.pairs, E = c.experts_count;
  const int tile_cp = k::grouped_tile_m(P, int(E));  // the cp.async kernels' row tile
  const int arch = grouped_wgmma_enabled() ? c.device->arch() : std::min(c.device->arch(), 89);
  const bool wide = grouped_wgmma_wide_enabled();

  // The TMA kernel's size and layout conditions (grouped_gemm_tma_ok checks them again with the pointers).
  // From route tiles of 64 up (its own tile then: 64 in its ping-pong form where the experts hold few rows).
  const bool use_tma = grouped_tma_enabled() && (tile_cp == 128 || (tile_cp == 64 && k::grouped_gemm_tma_pingpong())) &&
                       arch == 90 && c.w1_k == 1 && c.w2_k == 1 &&
                       c.hidden % 8 == 0 && c.inter % 8 == 0 && c.w1_n % 8 == 0 && c.w2_n % 8 == 0 &&
                       c.w1_expert % 8 == 0 && c.w2_expert % 8 == 0 &&
                       (c.type == k::Elem::bf16 || c.type == k::Elem::f16);
  const int tile_m = use_tma ? k::grouped_tma_tile_m(P, int(E), /*gathered_a=*/false) : tile_cp;

  void* xs = nullptr;  // [P, H] gathered rows (TMA path)
  k::RoutingBuffers r;
  void* act = nullptr;
  float* y = nullptr;
  carve_workspace(*c.ws, [&](Carver& w) {
    take_routing(w, r, P, E);
    act = w.take_bytes(P * c.inter * k::elem_bytes(c.type));  // [P, I] sorted rows
    y = w.take<float>(P * c.hidden);                         // [P, H] sorted rows, f32
    if (use_tma) xs = w.take_bytes(P * c.hidden * k::elem_bytes(c.type));
  });
  r.error = c.ws->error();

  check_launch(k::route_sort(c.call.top_k_index.data, c.index_type, c.tokens, int(c.top_k), int(E), tile_m, r,
                             c.stream),
               "route_sort");

  Projections pr = grouped_projections(c, c.call.hidden_states.data, r.sorted_pair, int(c.top_k), r.offsets,
                                       r.tile_offsets, P, act, y);
  pr.first.tile_m = pr.second.tile_m = tile_m;
  const k::GroupedGemmArgs& g1 = pr.first;
  k::GroupedGemmArgs g2 = pr.second;
  // The TMA path's second projection in 16-bit rows (y holds room for f32 ones: the other kernels' form).
  const bool rows16 = use_tma && grouped_down_rows16();
  if (rows16) second_projection_rows16(g2);

  k::GroupedGemmArgs t1 = g1;  // the first projection over the gathered rows
  t1.a = xs;
  t1.a_rows = nullptr;
  t1.a_row_div = 1;
  if (use_tma && k::grouped_gemm_tma_ok(t1, arch) && k::grouped_gemm_tma_ok(g2, arch)) {
    check_launch(k::gather_rows(c.type, c.call.hidden_states.data, c.hidden, r.sorted_pair, int(c.top_k),
                                r.offsets + E, P, xs, c.stream),
                 "gather_rows");
    check_launch(k::grouped_gemm_tma(t1, c.stream), "grouped_gemm_tma (first projection)");
    check_launch(k::grouped_gemm_tma(g2, c.stream), "grouped_gemm_tma (second projection)");
    if (rows16) {
      check_launch(k::combine_rows16(c.type, c.weight_type, y, r.pair_row, r.pair_expert, c.call.top_k_weights.data,
                                     c.b2, c.tokens, int(c.top_k), c.hidden, int(E), c.call.out.data, c.stream),
                   "combine_rows16");
      return;
    }
  } else {
    check_launch(k::grouped_gemm(pr.first, tile_m, arch, wide, c.stream), "grouped_gemm (first projection)");
    check_launch(k::grouped_gemm(pr.second, tile_m, arch, wide, c.stream), "grouped_gemm (second projection)");
  }

  check_launch(k::combine(c.type, c.weight_type, y, r.pair_row, r.pair_expert, c.call.top_k_weights.data, c.b2,
                          c.tokens, int(c.top_k), c.hidden, int(E), c.call.out.data, c.stream),
               "combine");
}

}  // namespace moekit::cuda

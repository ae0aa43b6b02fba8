// batched_mm on CUDA: one small product per (token, slot) pair, reading the expert's weights in place
// (transformers' version copies them per pair; this one never does). No host synchronisation, no
// allocation: capturable.
//
// Policy (measured on the H200, qwen3-30b-a3b shape): per-pair GEMVs while the pairs are few
// (decode); beyond batched_gemv_max_pairs() pairs, experts are hit by several tokens and streaming
// their weights once per pair costs more than sorting, so the call runs the grouped kernels. The
// GEMVs need weights in [out, in] layout; transposed weights also take the grouped kernels.
#include "backends/cuda/state.h"

namespace moekit::cuda {

bool batched_uses_gemv(const CallContext& c) {
  return !c.transposed && c.pairs <= batched_gemv_max_pairs() && kernels::pair_gemv_ok(c.type, c.hidden) &&
         kernels::pair_gemv_ok(c.type, c.inter);
}

void run_batched_mm(const CallContext& c) {
  if (c.fp8) {  // FP8 experts: quantized_fp8.cpp
    run_fp8(c);
    return;
  }
  namespace k = kernels;
  if (!batched_uses_gemv(c)) {
    run_grouped_mm(c);
    return;
  }
  const int64_t P = c.pairs;
  int32_t* pair_expert = nullptr;
  void* act = nullptr;
  float* y = nullptr;
  carve_workspace(*c.ws, [&](Carver& w) {
    pair_expert = w.take<int32_t>(P);
    act = w.take_bytes(P * c.inter * k::elem_bytes(c.type));  // [P, I]
    y = w.take<float>(P * c.hidden);                         // [P, H] f32
  });

  check_launch(k::route_validate(c.call.top_k_index.data, c.index_type, c.tokens, int(c.top_k), c.experts_count,
                                 pair_expert, c.ws->error(), c.stream),
               "route_validate");

  k::PairGemvArgs g1;
  g1.type = c.type;
  g1.a = c.call.hidden_states.data;
  g1.lda = c.hidden;
  g1.a_row_div = int(c.top_k);
  g1.b = c.w1;
  g1.b_expert_stride = c.w1_expert;
  g1.bias = c.b1;
  g1.bias_expert_stride = c.n1;
  g1.pair_expert = pair_expert;
  g1.experts = c.experts_count;
  g1.pairs = P;
  g1.n = c.inter;
  g1.k = c.hidden;
  g1.inter = c.inter;
  g1.epilogue = c.first_epilogue;
  g1.gate = c.gate;
  g1.out = act;
  g1.ldo = c.inter;
  check_launch(k::pair_gemv(g1, c.stream), "pair_gemv (first projection)");

  k::PairGemvArgs g2 = g1;
  g2.a = act;
  g2.lda = c.inter;
  g2.a_row_div = 1;
  g2.b = c.w2;
  g2.b_expert_stride = c.w2_expert;
  g2.bias = nullptr;  // added by combine
  g2.bias_expert_stride = 0;
  g2.n = c.hidden;
  g2.k = c.inter;
  g2.epilogue = k::kEpiF32;
  g2.out = y;
  g2.ldo = c.hidden;
  check_launch(k::pair_gemv(g2, c.stream), "pair_gemv (second projection)");

  check_launch(k::combine(c.type, c.weight_type, y, nullptr, pair_expert, c.call.top_k_weights.data, c.b2, c.tokens,
                          int(c.top_k), c.hidden, c.experts_count, c.call.out.data, c.stream),
               "combine");
}

}  // namespace moekit::cuda

// batched_mm on CUDA: one small product per (token, slot) pair, reading the expert's weights in place
// (transformers' version copies them per pair; this one never does). No host synchronisation, no
// allocation: capturable.
//
// Policy (measured on the H200): per-pair GEMVs while the pairs are few (decode) and fewer than the
// experts; beyond batched_gemv_max_pairs() pairs, or with as many pairs as experts or more (some expert
// is then certainly hit twice; batched_gemv_when_shared() says otherwise), streaming each pair's weights
// costs more than sorting, so the call runs the grouped kernels. The GEMVs need weights in [out, in]
// layout; transposed weights also take the grouped kernels.
#include "backends/cuda/state.h"

namespace moekit::cuda {

bool batched_uses_gemv(const CallContext& c) {
  return !c.transposed && c.pairs <= batched_gemv_max_pairs() &&
         (c.pairs < c.experts_count || batched_gemv_when_shared()) && kernels::pair_gemv_ok(c.type, c.hidden) &&
         kernels::pair_gemv_ok(c.type, c.inter) && kernels::pair_gemv_combine_ok(int(c.top_k));
}

// Two launches: the first projection per pair (gate fused), then the second projection with the routing
// weights and the slot sum (pair_gemv_combine); or, for up to batched_one_launch_max_tokens() tokens on sm_90,
// both in one launch (pair_fused, the same output bit for bit). All read the expert ids from top_k_index directly.
//
// With ExpertsCall::routing the two launches route their tokens themselves from the logits (pair_route_ok); any
// other form routes first (route_first), then reads the ids it wrote.
void run_batched_mm(const CallContext& c) {
  const bool gemv = !c.fp8 && batched_uses_gemv(c);
  if (c.call.routing && !gemv) route_first(c);
  if (c.fp8) {  // FP8 experts: quantized_fp8.cpp
    run_fp8(c);
    return;
  }
  namespace k = kernels;
  if (!gemv) {
    run_grouped_mm(c);
    return;
  }
  const int64_t P = c.pairs;
  void* act = nullptr;
  carve_workspace(*c.ws, [&](Carver& w) {
    act = w.take_bytes(P * c.inter * k::elem_bytes(c.type));  // [P, I]
  });

  k::PairGemvArgs g1;
  g1.type = c.type;
  g1.a = c.call.hidden_states.data;
  g1.lda = c.hidden;
  g1.a_row_div = int(c.top_k);
  g1.b = c.w1;
  g1.b_expert_stride = c.w1_expert;
  g1.bias = c.b1;
  g1.bias_expert_stride = c.n1;
  g1.index = c.call.top_k_index.data;
  g1.index_type = c.index_type;
  g1.top_k = int(c.top_k);
  g1.error = c.ws->error();
  g1.experts = c.experts_count;
  g1.pairs = P;
  g1.n = c.inter;
  g1.k = c.hidden;
  g1.inter = c.inter;
  g1.epilogue = c.first_epilogue;
  g1.gate = c.gate;
  g1.out = act;
  g1.ldo = c.inter;
  k::PairGemvArgs g2 = g1;
  g2.a = act;
  g2.lda = c.inter;
  g2.a_row_div = 1;
  g2.b = c.w2;
  g2.b_expert_stride = c.w2_expert;
  g2.bias = c.b2;
  g2.bias_expert_stride = c.hidden;
  g2.error = nullptr;  // the first launch records bad ids
  g2.n = c.hidden;
  g2.k = c.inter;
  g2.routing_weights = c.call.top_k_weights.data;
  g2.routing_weight_type = c.weight_type;
  g2.out = c.call.out.data;
  g2.ldo = c.hidden;
  if (const ExpertsRouting* r = c.call.routing) {
    for (k::PairGemvArgs* g : {&g1, &g2}) {
      g->route_logits = r->logits.ptr<float>();
      g->route_kind = route_kind_code(r->kind);
      g->route_norm = r->norm_topk_prob ? 1 : 0;
      g->route_index_out = static_cast<int32_t*>(c.call.top_k_index.data);
      g->route_weights_out = static_cast<float*>(c.call.top_k_weights.data);
    }
    if (k::pair_route_ok(g1, g2)) {
      check_launch(k::pair_gemv(g1, c.stream), "pair_gemv (first projection, routing inside)");
      check_launch(k::pair_gemv_combine(g2, c.tokens, c.stream), "pair_gemv_combine (second projection, routing inside)");
      return;
    }
    route_first(c);  // then the ids as usual
    for (k::PairGemvArgs* g : {&g1, &g2}) g->route_logits = nullptr;
  }
  const int arch = c.device->arch();
  if (c.tokens <= batched_one_launch_max_tokens() && k::pair_fused_ok(g1, g2, c.tokens, arch)) {
    // Both projections in one launch; the grid barrier's words are the workspace's last two counters.
    uint32_t* barrier = c.ws->counters() + StreamWorkspace::kCounterWords - 2;
    check_launch(k::pair_fused(g1, g2, c.tokens, arch, barrier, c.stream), "pair_fused (both projections)");
    return;
  }
  check_launch(k::pair_gemv(g1, c.stream), "pair_gemv (first projection)");
  check_launch(k::pair_gemv_combine(g2, c.tokens, c.stream), "pair_gemv_combine (second projection)");
}

}  // namespace moekit::cuda

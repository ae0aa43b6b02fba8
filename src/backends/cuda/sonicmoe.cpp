// sonicmoe on CUDA: the routed forward with nothing written that is not needed, on the warp-specialised TMA
// grouped kernel (grouped_gemm_sm90_tma.cu) that deepgemm runs; the two differ only in how data moves.
//   1. route_sort (tile 128, or 64 where the experts hold few rows): pairs stably sorted by expert.
//   2. gate/up projection: the producer warpgroup gathers each row tile's token rows straight from the
//      hidden states (cp.async by row index into the swizzled stages; sm_90's copy engine has no gather),
//      the gated activation (+ biases, gpt-oss's clamped SwiGLU too) in the epilogue: the [pairs, I]
//      intermediate is written once, in sorted order. No [pairs, H] permuted copy of the hidden states.
//   3. down projection over the intermediate (TMA), the routing weight (and the down bias) applied in the
//      epilogue, rows written in sorted order in the activations' dtype (bulk tensor stores, like the f32 rows
//      of deepgemm's down projection, at half the bytes).
//   4. sum_slots: each token's K rows (found through pair_row) summed in f32 in slot order and rounded once. No
//      atomics: the same bits on every run.
// No host synchronisation and no allocation: capturable in a CUDA graph.
#include "backends/backends.h"
#include "backends/cuda/state.h"

namespace moekit::cuda {

std::string sonicmoe_arch_reason(int arch) {
  if (arch != 90)
    return "sonicmoe needs a Hopper GPU (compute capability 9.0), got " + std::to_string(arch / 10) + "." +
           std::to_string(arch % 10) + "; use grouped_mm";
  if (!kernels::grouped_gemm_tma_built_for(arch))
    return "this build has no sm_90a code for sonicmoe's kernel (build with CMAKE_CUDA_ARCHITECTURES 90a); use "
           "grouped_mm";
  return {};
}

std::string sonicmoe_unsupported_reason(const Experts& experts, DType act_dtype, int arch) {
  DeviceGuard guard(experts.device().index);
  if (std::string why = sonicmoe_arch_reason(arch); !why.empty()) return why;
  if (std::string why = sonicmoe_experts_reason(experts.spec(), experts.weight_dtype()); !why.empty()) return why;
  if (act_dtype != DType::bf16 && act_dtype != DType::f16)
    return std::string("sonicmoe runs bf16 and f16 activations, got ") + dtype_name(act_dtype) + "; use grouped_mm";
  const ExpertsSpec& s = experts.spec();
  if (s.hidden % 8 || s.intermediate % 8)
    return "sonicmoe needs hidden and intermediate sizes that are multiples of 8, got " + std::to_string(s.hidden) +
           " and " + std::to_string(s.intermediate) + "; use grouped_mm";
  return {};
}

void run_sonicmoe(const CallContext& c) {
  namespace k = kernels;
  const std::string why = sonicmoe_unsupported_reason(c.experts, c.call.hidden_states.dtype, c.device->arch());
  MOEKIT_CHECK_CODE(why.empty() && c.w1_k == 1 && c.w2_k == 1, not_supported, "experts implementation 'sonicmoe': ",
                    why.empty() ? "weights must be in [out, in] layout" : why);
  // The engine's row tile: 64 (its ping-pong form) where the experts hold few rows, else 128.
  const int64_t P = c.pairs, E = c.experts_count;
  const int kTile = k::grouped_tma_tile_m(P, int(E), /*gathered_a=*/true);
  const int64_t row_bytes = k::elem_bytes(c.type);

  k::RoutingBuffers r;
  void *act = nullptr, *yw = nullptr;
  carve_workspace(*c.ws, [&](Carver& w) {
    take_routing(w, r, P, E);
    act = w.take_bytes(P * c.inter * row_bytes);  // [P, I] sorted rows
    yw = w.take_bytes(P * c.hidden * row_bytes);  // [P, H] weighted rows, sorted
  });
  r.error = c.ws->error();

  check_launch(k::route_sort(c.call.top_k_index.data, c.index_type, c.tokens, int(c.top_k), int(E), kTile, r, c.stream),
               "route_sort");

  Projections pr = grouped_projections(c, c.call.hidden_states.data, r.sorted_pair, int(c.top_k), r.offsets,
                                       r.tile_offsets, P, act, nullptr);
  k::GroupedGemmArgs &g1 = pr.first, &g2 = pr.second;
  g1.tile_m = g2.tile_m = kTile;
  g2.epilogue = k::kEpiWeighted;
  g2.bias = c.b2;
  g2.bias_expert_stride = c.hidden;
  g2.out = yw;
  g2.ldo = c.hidden;
  g2.row_pair = r.sorted_pair;
  g2.row_weights = c.call.top_k_weights.data;
  g2.weight_type = c.weight_type;
  MOEKIT_CHECK_CODE(k::grouped_gemm_tma_ok(g1, c.device->arch()) && k::grouped_gemm_tma_ok(g2, c.device->arch()),
                    not_supported,
                    "experts implementation 'sonicmoe': the TMA grouped kernel does not serve these arguments "
                    "(16-byte aligned hidden states, weights and routing buffers needed); use grouped_mm");
  check_launch(k::grouped_gemm_tma(g1, c.stream), "grouped_gemm_tma (gate/up, gathered rows)");
  check_launch(k::grouped_gemm_tma(g2, c.stream), "grouped_gemm_tma (down, weighted rows)");
  check_launch(k::sum_slots(c.type, yw, r.pair_row, r.pair_expert, c.tokens, int(c.top_k), c.hidden, int(E),
                            c.call.out.data, c.stream),
               "sum_slots");
}

}  // namespace moekit::cuda

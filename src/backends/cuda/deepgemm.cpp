// deepgemm on CUDA: DeepGEMM's "contiguous" layout on the warp-specialised TMA grouped kernel
// (grouped_gemm_sm90_tma.cu). Pairs sorted by expert on the device; each expert's rows copied to a
// block starting at a multiple of the row tile (128; 64 where the experts hold few rows; padding rows
// never read back), so every row tile is whole and leaves by bulk tensor stores; both projections over
// that layout; the weighted combine reads each pair's padded row. No host synchronisation and no
// allocation: capturable in a CUDA graph, so the "masked" layout (fixed rows per expert, for graphs) is
// not needed on this engine.
//
// Serves sm_90a devices with bf16/f16 experts in [out, in] layout, sizes multiples of 8; elsewhere it
// throws not_supported saying why.
#include "backends/backends.h"
#include "backends/cuda/state.h"

namespace moekit::cuda {

std::string deepgemm_arch_reason(int arch) {
  if (arch != 90)
    return "deepgemm needs a Hopper GPU (compute capability 9.0), got " + std::to_string(arch / 10) + "." +
           std::to_string(arch % 10) + "; use grouped_mm";
  if (!kernels::grouped_gemm_tma_built_for(arch))
    return "this build has no sm_90a code for deepgemm's kernel (build with CMAKE_CUDA_ARCHITECTURES 90a); use "
           "grouped_mm";
  return {};
}

std::string deepgemm_unsupported_reason(const Experts& experts, DType act_dtype, int arch) {
  DeviceGuard guard(experts.device().index);
  if (std::string why = deepgemm_arch_reason(arch); !why.empty()) return why;
  if (experts.is_quantized()) return {};  // FP8: any activation dtype and size (quantized_fp8.cpp)
  if (act_dtype != DType::bf16 && act_dtype != DType::f16)
    return std::string("deepgemm runs bf16 and f16 experts, got ") + dtype_name(act_dtype) + "; use grouped_mm";
  const ExpertsSpec& s = experts.spec();
  if (s.hidden % 8 || s.intermediate % 8)
    return "deepgemm needs hidden and intermediate sizes that are multiples of 8, got " + std::to_string(s.hidden) +
           " and " + std::to_string(s.intermediate) + "; use grouped_mm";
  return {};
}

void run_deepgemm(const CallContext& c) {
  if (c.fp8) {  // FP8 experts: quantized_fp8.cpp
    run_fp8(c);
    return;
  }
  namespace k = kernels;
  const std::string why = deepgemm_unsupported_reason(c.experts, c.call.hidden_states.dtype, c.device->arch());
  MOEKIT_CHECK_CODE(why.empty() && c.w1_k == 1 && c.w2_k == 1, not_supported, "experts implementation 'deepgemm': ",
                    why.empty() ? "weights must be in [out, in] layout" : why);
  // Experts' blocks padded to the engine's row tile: 64 (its ping-pong form) where the experts hold few
  // rows, else 128.
  const int64_t P = c.pairs, E = c.experts_count;
  const int kTile = k::grouped_tma_tile_m(P, int(E), /*gathered_a=*/false);
  const int64_t rows = k::grouped_max_tiles(P, int(E), kTile) * kTile;  // padded rows, upper bound
  const int64_t row_bytes = k::elem_bytes(c.type);

  k::RoutingBuffers r;
  int32_t *row_base = nullptr, *pair_row_l = nullptr;
  void *xl = nullptr, *act = nullptr;
  float* y = nullptr;
  carve_workspace(*c.ws, [&](Carver& w) {
    take_routing(w, r, P, E);
    row_base = w.take<int32_t>(E + 1);
    pair_row_l = w.take<int32_t>(P);
    xl = w.take_bytes(rows * c.hidden * row_bytes);  // [rows, H] padded per expert
    act = w.take_bytes(rows * c.inter * row_bytes);  // [rows, I]
    y = w.take<float>(rows * c.hidden);              // [rows, H] f32
  });
  r.error = c.ws->error();

  check_launch(k::route_sort(c.call.top_k_index.data, c.index_type, c.tokens, int(c.top_k), int(E), kTile, r, c.stream),
               "route_sort");
  check_launch(k::contiguous_layout(c.type, c.call.hidden_states.data, c.hidden, int(c.top_k), r, int(E), P, kTile,
                                    row_base, xl, pair_row_l, c.stream),
               "contiguous_layout");

  // Every expert's block ends where the next one starts: whole tiles, so row_base serves as the offsets.
  Projections pr = grouped_projections(c, xl, nullptr, 1, row_base, r.tile_offsets, rows, act, y);
  pr.first.tile_m = pr.second.tile_m = kTile;
  const k::GroupedGemmArgs& g1 = pr.first;
  k::GroupedGemmArgs g2 = pr.second;
  const bool rows16 = grouped_down_rows16();  // 16-bit rows in y (sized for f32 ones)
  if (rows16) second_projection_rows16(g2);
  MOEKIT_CHECK_CODE(k::grouped_gemm_tma_ok(g1, c.device->arch()) && k::grouped_gemm_tma_ok(g2, c.device->arch()),
                    not_supported, "deepgemm: this build has no sm_90a code for the TMA grouped kernel");
  check_launch(k::grouped_gemm_tma(g1, c.stream), "grouped_gemm_tma (first projection)");
  check_launch(k::grouped_gemm_tma(g2, c.stream), "grouped_gemm_tma (second projection)");

  if (rows16) {
    check_launch(k::combine_rows16(c.type, c.weight_type, y, pair_row_l, r.pair_expert, c.call.top_k_weights.data, c.b2,
                                   c.tokens, int(c.top_k), c.hidden, int(E), c.call.out.data, c.stream),
                 "combine_rows16");
    return;
  }
  check_launch(k::combine(c.type, c.weight_type, y, pair_row_l, r.pair_expert, c.call.top_k_weights.data, c.b2,
                          c.tokens, int(c.top_k), c.hidden, int(E), c.call.out.data, c.stream),
               "combine");
}

}  // namespace moekit::cuda

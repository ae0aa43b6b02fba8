// eager on the CPU: for each expert that got tokens, in order: gather its rows, first projection, gate, down
// projection. Each GEMM is split over column tiles; the weighted sum over slots runs at the end (common.h).
#include "backends/backends.h"
#include "backends/cpu/common.h"
#include "base/parallel.h"

namespace moekit::cpu {
namespace {

void eager_chunk(const Plan& p, const ExpertsCall& call) {
  const ExpertRouting r = route_top_k(call.top_k_index.data, call.top_k_index.dtype, call.tokens(), call.top_k(), p.E);
  const int64_t rows = r.routed(), H = p.H, N1 = p.N1;
  FloatBuffer xy = make_buffer(rows * H);   // [rows, H] gathered inputs, then down outputs (sorted by expert)
  FloatBuffer h1 = make_buffer(rows * N1);  // [rows, N1] first projection; gated activations in [:, :I]
  for (const int64_t e : r.active_experts()) {
    const int64_t r0 = r.offsets[size_t(e)], m = r.counts[size_t(e)];
    float* x = xy.get() + r0 * H;
    float* h = h1.get() + r0 * N1;
    gather_rows(p, call, r.sorted_pairs.data() + r0, m, x);
    if (p.quantized()) {  // activations quantized per row and 128 inputs, weights decoded in the tile
      const Fp8Rows xa = fp8_rows(p, x, H, m, H);
      quant_gemm(p, false, e, xa, 0, m, h, N1);
      parallel_for(m, 8, m * N1 * kGateCost, [&](int64_t i) { first_epilogue_row(p, e, h + i * N1); });
      const Fp8Rows ha = fp8_rows(p, h, N1, m, p.I);
      quant_gemm(p, true, e, ha, 0, m, x, H);
      parallel_for(m, 8, m * H, [&](int64_t i) { down_epilogue(p, e, x + i * H, H, 1, 0, H); });
      continue;
    }
    if (p.packed) {  // bf16 tile over the packed weights
      const Bf16Buffer xa = bf16_rows(x, H, m, H, p.packed->kp1);
      gemm_bf16(*p.kernels, xa.get(), p.packed->kp1, m, p.first_packed(e), h, N1);
    } else {
      gemm(*p.kernels, x, H, m, p.first(e), h, N1);
    }
    parallel_for(m, 8, m * N1 * kGateCost, [&](int64_t i) { first_epilogue_row(p, e, h + i * N1); });
    if (p.packed) {
      const Bf16Buffer ha = bf16_rows(h, N1, m, p.I, p.packed->kp2);
      gemm_bf16(*p.kernels, ha.get(), p.packed->kp2, m, p.down_packed(e), x, H);
    } else {
      gemm(*p.kernels, h, N1, m, p.down(e), x, H);
    }
    parallel_for(m, 8, m * H, [&](int64_t i) { down_epilogue(p, e, x + i * H, H, 1, 0, H); });
  }
  combine(p, call, xy.get(), H, r.position.data());
}

}  // namespace

void eager(const Experts& experts, const ExpertsCall& call) {
  const Plan p = make_plan(experts, call);
  for_each_token_chunk(call, p.H + p.N1, [&](const ExpertsCall& c) { eager_chunk(p, c); });
}

}  // namespace moekit::cpu

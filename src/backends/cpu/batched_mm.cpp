// batched_mm on the CPU: one small product per (token, slot) pair, with that pair's expert weights read in place
// (a pointer into gate_up_proj / down_proj: nothing is copied per pair). Every (pair, column tile) is one task.
#include <algorithm>
#include <vector>

#include "backends/backends.h"
#include "backends/cpu/common.h"
#include "base/parallel.h"

namespace moekit::cpu {
namespace {

template <class I>
int64_t expert_id(const void* ids, int64_t p) {
  return int64_t(static_cast<const I*>(ids)[p]);
}

void batched_chunk(const Plan& p, const ExpertsCall& call) {
  const int64_t T = call.tokens(), K = call.top_k(), H = p.H, N1 = p.N1;
  const GemmKernels& k = *p.kernels;
  const bool i32 = call.top_k_index.dtype == DType::i32;
  // Pairs that reach an expert here (sentinels skipped), in pair order.
  std::vector<int64_t> pair_expert, pair_token, row_of_pair(size_t(T * K), -1);
  for (int64_t q = 0; q < T * K; ++q) {
    const int64_t e = i32 ? expert_id<int32_t>(call.top_k_index.data, q) : expert_id<int64_t>(call.top_k_index.data, q);
    MOEKIT_CHECK(e >= 0 && e <= p.E, "top_k_index[", q / K, ", ", q % K, "] = ", e, " is out of range [0, ", p.E, "]");
    if (e == p.E) continue;
    row_of_pair[size_t(q)] = int64_t(pair_expert.size());
    pair_expert.push_back(e);
    pair_token.push_back(q / K);
  }
  const int64_t pairs = int64_t(pair_expert.size());
  FloatBuffer x = make_buffer(T * H);        // [T, H] f32 inputs
  FloatBuffer h1 = make_buffer(pairs * N1);  // [pairs, N1] first projection; gated activations in [:, :I]
  FloatBuffer y = make_buffer(pairs * H);    // [pairs, H] down outputs
  gather_rows(p, call, nullptr, T, x.get());
  if (p.quantized()) {  // FP8 / FP4 tiles: activations quantized per token and 128 inputs, weights decoded in the tile
    const Fp8Rows xa = fp8_rows(p, x.get(), H, T, H);
    const int64_t b1 = (N1 + kFp8TileN - 1) / kFp8TileN;
    parallel_tasks(pairs * b1, fp8_work_floats(H), pairs * N1 * H, [&](int64_t task, float* work) {
      const int64_t j = task / b1, n0 = (task % b1) * kFp8TileN;
      quant_tile(p, false, pair_expert[size_t(j)], xa, pair_token[size_t(j)], 1, n0, std::min(N1, n0 + kFp8TileN),
                 h1.get() + j * N1, N1, work);
    });
    parallel_for(pairs, 8, pairs * N1 * kGateCost,
                 [&](int64_t j) { first_epilogue_row(p, pair_expert[size_t(j)], h1.get() + j * N1); });
    const Fp8Rows ha = fp8_rows(p, h1.get(), N1, pairs, p.I);
    const int64_t b2 = (H + kFp8TileN - 1) / kFp8TileN;
    parallel_tasks(pairs * b2, fp8_work_floats(p.I), pairs * H * p.I, [&](int64_t task, float* work) {
      const int64_t j = task / b2, n0 = (task % b2) * kFp8TileN, n1 = std::min(H, n0 + kFp8TileN);
      const int64_t e = pair_expert[size_t(j)];
      quant_tile(p, true, e, ha, j, 1, n0, n1, y.get() + j * H, H, work);
      down_epilogue(p, e, y.get() + j * H, H, 1, n0, n1);
    });
    combine(p, call, y.get(), H, row_of_pair.data());
    return;
  }
  if (p.packed) {  // bf16 tile over the packed weights: one row per (pair, column block)
    const int64_t kp1 = p.packed->kp1, kp2 = p.packed->kp2;
    const Bf16Buffer xa = bf16_rows(x.get(), H, T, H, kp1);
    const int64_t b1 = (N1 + kBf16TileN - 1) / kBf16TileN;
    parallel_tasks(pairs * b1, 0, pairs * N1 * H, [&](int64_t task, float*) {
      const int64_t j = task / b1, n0 = (task % b1) * kBf16TileN;
      k.gemm_bf16_tile(xa.get() + pair_token[size_t(j)] * kp1, kp1, 1, p.first_packed(pair_expert[size_t(j)]), n0,
                       std::min(N1, n0 + kBf16TileN), h1.get() + j * N1, N1);
    });
    parallel_for(pairs, 8, pairs * N1 * kGateCost,
                 [&](int64_t j) { first_epilogue_row(p, pair_expert[size_t(j)], h1.get() + j * N1); });
    const Bf16Buffer ha = bf16_rows(h1.get(), N1, pairs, p.I, kp2);
    const int64_t b2 = (H + kBf16TileN - 1) / kBf16TileN;
    parallel_tasks(pairs * b2, 0, pairs * H * p.I, [&](int64_t task, float*) {
      const int64_t j = task / b2, n0 = (task % b2) * kBf16TileN, n1 = std::min(H, n0 + kBf16TileN);
      const int64_t e = pair_expert[size_t(j)];
      k.gemm_bf16_tile(ha.get() + j * kp2, kp2, 1, p.down_packed(e), n0, n1, y.get() + j * H, H);
      down_epilogue(p, e, y.get() + j * H, H, 1, n0, n1);
    });
    combine(p, call, y.get(), H, row_of_pair.data());
    return;
  }

  const int64_t t1 = (N1 + k.max_tile_n - 1) / k.max_tile_n;
  parallel_tasks(pairs * t1, k.work_floats, pairs * N1 * H, [&](int64_t task, float* work) {
    const int64_t j = task / t1, n0 = (task % t1) * k.max_tile_n;
    k.gemm_tile(x.get() + pair_token[size_t(j)] * H, H, 1, p.first(pair_expert[size_t(j)]), n0,
                std::min(N1, n0 + k.max_tile_n), h1.get() + j * N1, N1, work);
  });
  parallel_for(pairs, 8, pairs * N1 * kGateCost,
               [&](int64_t j) { first_epilogue_row(p, pair_expert[size_t(j)], h1.get() + j * N1); });

  const int64_t t2 = (H + k.max_tile_n - 1) / k.max_tile_n;
  parallel_tasks(pairs * t2, k.work_floats, pairs * H * p.I, [&](int64_t task, float* work) {
    const int64_t j = task / t2, n0 = (task % t2) * k.max_tile_n, n1 = std::min(H, n0 + k.max_tile_n);
    const int64_t e = pair_expert[size_t(j)];
    k.gemm_tile(h1.get() + j * N1, N1, 1, p.down(e), n0, n1, y.get() + j * H, H, work);
    down_epilogue(p, e, y.get() + j * H, H, 1, n0, n1);
  });

  combine(p, call, y.get(), H, row_of_pair.data());
}

}  // namespace

void batched_mm(const Experts& experts, const ExpertsCall& call) {
  const Plan p = make_plan(experts, call);
  for_each_token_chunk(call, 2 * p.H + p.N1, [&](const ExpertsCall& c) { batched_chunk(p, c); });
}

}  // namespace moekit::cpu

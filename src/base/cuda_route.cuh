// Internal: the routers of MoE models on the device, one warp per token (softmax then top-k, top-k then softmax,
// DeepSeek-V3's grouped sigmoid with a correction bias). Written once for the model's route kernel and for the
// experts kernels that route their tokens themselves (batched_mm's small-T GEMVs with ExpertsCall::routing), so
// that both pick the same experts with the same weights, bit for bit.
//
// route_warp<PER> serves E <= 32 * PER experts; its results do not depend on PER (a larger PER only adds lanes'
// slots past E, which add exact zeros to the sums and are never chosen).
#pragma once
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "base/activation.h"
#include "base/cuda_warp.cuh"
#include "base/route_codes.h"

namespace moekit::cuda {

struct RouteBest {
  float v;
  int i;
};
// An order-preserving key of a score: larger scores, larger keys (-0 counted as +0); NaN the lowest key, 0, below
// -inf's, so that it is never chosen.
__device__ __forceinline__ uint32_t route_order_key(float v) {
  if (v != v) return 0u;
  const uint32_t u = __float_as_uint(v + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float route_key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// The warp's best of its values whose expert passes `keep` (experts e = lane + 32 * s, s < PER: unrolled, so that
// the values stay in registers): the largest value, the lowest index among equal ones ({-inf, INT_MAX} when none
// is a number), as the CPU router's top_k_desc orders them. Two warp reductions (redux.sync), no shuffle tree.
template <int PER, class Keep>
__device__ __forceinline__ RouteBest route_warp_best(const float (&vals)[PER], int E, Keep keep) {
  const int lane = threadIdx.x % 32;
  uint32_t lk = 0u;
  int li = INT_MAX;
#pragma unroll
  for (int s = 0; s < PER; ++s) {  // ascending experts: the first of equal keys stays
    const int e = lane + 32 * s;
    if (e < E && keep(e)) {
      const uint32_t k = route_order_key(vals[s]);
      if (k > lk) lk = k, li = e;
    }
  }
  const uint32_t mx = __reduce_max_sync(0xffffffffu, lk);
  if (mx == 0u) return RouteBest{-INFINITY, INT_MAX};
  const int i = int(__reduce_min_sync(0xffffffffu, lk == mx ? uint32_t(li) : uint32_t(INT_MAX)));
  return RouteBest{route_key_value(mx), i};
}

// One token's route by the whole warp (every lane calls it): logits l [E] (bias [E] or null: the grouped kind's
// correction bias), K <= 32 choices; lane j < K ends with slot j's expert in e_out and its weight in w_out. Only
// the first `picks` choices are made when picks < K (the weights are then not final: callers that need only the
// ids of the first slots); picks >= K gives the full route.
template <int PER>
__device__ __forceinline__ void route_warp(const float* l, const float* bias, int E, int K, int kind, int norm,
                                           float scale, int G, int topk_group, int picks, int& e_out, float& w_out) {
  const int lane = threadIdx.x % 32;
  float sel[PER], prob[PER];
  float mx = -INFINITY;
#pragma unroll
  for (int s = 0; s < PER; ++s) {
    const int e = lane + 32 * s;
    const float x = e < E ? l[e] : -INFINITY;
    prob[s] = x;
    mx = fmaxf(mx, x);
  }
  if (kind == kRouteSoftmaxTopk) {
    mx = cuda::warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < PER; ++s) {
      prob[s] = lane + 32 * s < E ? expf(prob[s] - mx) : 0.0f;
      sum += prob[s];
    }
    sum = cuda::warp_sum(sum);
#pragma unroll
    for (int s = 0; s < PER; ++s) sel[s] = prob[s] = prob[s] / sum;
  } else if (kind == kRouteTopkSoftmax) {
#pragma unroll
    for (int s = 0; s < PER; ++s) sel[s] = prob[s];
  } else {
#pragma unroll
    for (int s = 0; s < PER; ++s) {
      const int e = lane + 32 * s;
      prob[s] = act::sigmoid(prob[s]);
      sel[s] = e < E ? prob[s] + (bias ? bias[e] : 0.0f) : -INFINITY;
    }
    // A group's score: the sum of its two best choice scores; keep the topk_group best groups.
    const int per = E / G;
    float gscore = -INFINITY;
    for (int g = 0; g < G; ++g) {
      const RouteBest b1 = route_warp_best<PER>(sel, E, [&](int e) { return e / per == g; });
      float s = b1.v;
      if (per >= 2) s += route_warp_best<PER>(sel, E, [&](int e) { return e / per == g && e != b1.i; }).v;
      if (lane == g) gscore = s;
    }
    unsigned keep = 0;
    for (int r = 0; r < topk_group; ++r) {
      const float gs[1] = {gscore};
      const RouteBest b = route_warp_best<1>(gs, G, [](int) { return true; });
      if (b.i >= G) break;  // no group score is a number
      keep |= 1u << b.i;
      if (lane == b.i) gscore = -INFINITY;
    }
#pragma unroll
    for (int s = 0; s < PER; ++s) {
      const int e = lane + 32 * s;
      if (e < E && !((keep >> (e / per)) & 1u)) sel[s] = -INFINITY;
    }
  }
  int my_e = 0;
  float my_w = 0.0f;
  uint32_t taken = 0;  // bit s: this lane's expert lane + 32 * s is chosen already (never chosen twice)
  const int n = picks < K ? picks : K;
  for (int j = 0; j < n; ++j) {
    const RouteBest b = route_warp_best<PER>(sel, E, [&](int e) { return !((taken >> (e / 32)) & 1u); });
    const int e = b.i < E ? b.i : E - 1;  // NaN scores select nothing; stay in bounds
    // prob of the chosen expert, from its owner lane (every lane picks the same slot).
    float pe = 0.0f;
#pragma unroll
    for (int s = 0; s < PER; ++s)
      if (s == e / 32) pe = prob[s];
    const float wj = __shfl_sync(0xffffffffu, pe, e % 32);
    if (lane == j) my_e = e, my_w = wj;
    if (lane == e % 32) taken |= 1u << (e / 32);
  }
  if (n == K) {
    // The slot sums in slot order (as one thread adding them one by one).
    if (kind == kRouteTopkSoftmax) {
      const float top = __shfl_sync(0xffffffffu, my_w, 0);
      const float ex = expf(my_w - top);
      float sum = 0.0f;
      for (int j = 0; j < K; ++j) sum += __shfl_sync(0xffffffffu, ex, j);
      my_w = ex / sum;
    } else if (norm) {
      float sum = 0.0f;
      for (int j = 0; j < K; ++j) sum += __shfl_sync(0xffffffffu, my_w, j);
      if (kind == kRouteGroupedSigmoid) sum += 1e-20f;
      my_w /= sum;
    }
    if (kind == kRouteGroupedSigmoid) my_w *= scale;
  }
  e_out = my_e;
  w_out = my_w;
}

}  // namespace moekit::cuda

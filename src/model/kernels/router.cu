// The model's routers on the device: one warp per token; softmax then top-k, top-k then softmax, and
// DeepSeek-V3's grouped sigmoid with a correction bias.
#include <climits>

#include "base/activation.h"
#include "base/cuda_pdl.cuh"
#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

struct Best {
  float v;
  int i;
};
// Larger value first, then lower index (ops_cpu.cpp's top_k_desc).
__device__ __forceinline__ Best better(Best a, Best b) { return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a; }
__device__ __forceinline__ Best warp_best(Best b) {
  for (int o = 16; o > 0; o >>= 1) {
    Best x{__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
    b = better(b, x);
  }
  return b;
}
// The best of this lane's values whose expert passes `keep` (experts e = lane + 32 * s).
template <class Keep>
__device__ __forceinline__ Best lane_best(const float* vals, int per_lane, int E, Keep keep) {
  const int lane = threadIdx.x % 32;
  Best b{-INFINITY, INT_MAX};
  for (int s = 0; s < per_lane; ++s) {
    const int e = lane + 32 * s;
    if (e < E && keep(e)) b = better(b, Best{vals[s], e});
  }
  return b;
}

__global__ void route_kernel(const float* logits, const float* bias, int64_t T, int E, int K, int kind, int norm,
                             float scale, int G, int topk_group, int32_t* index, float* weights) {
  cuda::pdl_wait();  // PDL: everything below reads what the kernels before wrote
  cuda::pdl_trigger();
  const int lane = threadIdx.x % 32;
  const int64_t token = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (token >= T) return;
  const float* l = logits + token * E;
  const int per_lane = (E + 31) / 32;
  float sel[kRouteMaxPerLane], prob[kRouteMaxPerLane];
  float mx = -INFINITY;
  for (int s = 0; s < per_lane; ++s) {
    const int e = lane + 32 * s;
    const float x = e < E ? l[e] : -INFINITY;
    prob[s] = x;
    mx = fmaxf(mx, x);
  }
  if (kind == kRouteSoftmaxTopk) {
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int s = 0; s < per_lane; ++s) {
      prob[s] = lane + 32 * s < E ? expf(prob[s] - mx) : 0.0f;
      sum += prob[s];
    }
    sum = warp_sum(sum);
    for (int s = 0; s < per_lane; ++s) sel[s] = prob[s] = prob[s] / sum;
  } else if (kind == kRouteTopkSoftmax) {
    for (int s = 0; s < per_lane; ++s) sel[s] = prob[s];
  } else {
    for (int s = 0; s < per_lane; ++s) {
      const int e = lane + 32 * s;
      prob[s] = act::sigmoid(prob[s]);
      sel[s] = e < E ? prob[s] + (bias ? bias[e] : 0.0f) : -INFINITY;
    }
    // A group's score: the sum of its two best choice scores; keep the topk_group best groups.
    const int per = E / G;
    float gscore = -INFINITY;
    for (int g = 0; g < G; ++g) {
      const Best b1 = warp_best(lane_best(sel, per_lane, E, [&](int e) { return e / per == g; }));
      float s = b1.v;
      if (per >= 2) s += warp_best(lane_best(sel, per_lane, E, [&](int e) { return e / per == g && e != b1.i; })).v;
      if (lane == g) gscore = s;
    }
    unsigned keep = 0;
    for (int r = 0; r < topk_group; ++r) {
      const Best b = warp_best(lane < G ? Best{gscore, lane} : Best{-INFINITY, INT_MAX});
      keep |= 1u << b.i;
      if (lane == b.i) gscore = -INFINITY;
    }
    for (int s = 0; s < per_lane; ++s) {
      const int e = lane + 32 * s;
      if (e < E && !((keep >> (e / per)) & 1u)) sel[s] = -INFINITY;
    }
  }
  int chosen[kRouteMaxK];
  float w[kRouteMaxK];
  for (int j = 0; j < K; ++j) {
    const Best b = warp_best(lane_best(sel, per_lane, E, [](int) { return true; }));
    const int e = b.i < E ? b.i : E - 1;  // NaN scores select nothing; stay in bounds
    chosen[j] = e;
    // prob of the chosen expert, from its owner lane (every lane reads the same slot).
    w[j] = __shfl_sync(0xffffffffu, prob[e / 32], e % 32);
    if (lane == e % 32) sel[e / 32] = -INFINITY;
  }
  if (lane != 0) return;
  if (kind == kRouteTopkSoftmax) {
    const float top = w[0];
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) sum += (w[j] = expf(w[j] - top));
    for (int j = 0; j < K; ++j) w[j] /= sum;
  } else if (norm) {
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) sum += w[j];
    if (kind == kRouteGroupedSigmoid) sum += 1e-20f;
    for (int j = 0; j < K; ++j) w[j] /= sum;
  }
  for (int j = 0; j < K; ++j) {
    index[token * K + j] = chosen[j];
    weights[token * K + j] = kind == kRouteGroupedSigmoid ? w[j] * scale : w[j];
  }
}

}  // namespace

cudaError_t route(const float* logits, const float* bias, int64_t T, int E, int K, int kind, bool norm, float scale,
                  int n_group, int topk_group, int32_t* index, float* weights, cudaStream_t s) {
  constexpr int kWarps = 4;
  return cuda::launch_pdl(cuda::pdl_enabled(), route_kernel, dim3(unsigned((T + kWarps - 1) / kWarps)),
                          dim3(32 * kWarps), 0, s, logits, bias, T, E, K, kind, norm ? 1 : 0, scale, n_group,
                          topk_group, index, weights);
}

}  // namespace moekit::model::kernels

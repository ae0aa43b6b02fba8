// The model's routers on the device: one warp per token; softmax then top-k, top-k then softmax, and
// DeepSeek-V3's grouped sigmoid with a correction bias.
#include "base/activation.h"
#include "base/cuda_pdl.cuh"
#include "base/cuda_route.cuh"
#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

static_assert(kRouteSoftmaxTopk == cuda::kRouteSoftmaxTopk && kRouteTopkSoftmax == cuda::kRouteTopkSoftmax &&
                  kRouteGroupedSigmoid == cuda::kRouteGroupedSigmoid,
              "one set of router codes");

// One warp per token; PER >= E / 32 values per lane. Lane j ends with slot j's expert and weight (K <= 32).
template <int PER>
__global__ void route_kernel(const float* logits, const float* bias, int64_t T, int E, int K, int kind, int norm,
                             float scale, int G, int topk_group, int32_t* index, float* weights) {
  cuda::pdl_wait();  // PDL: everything below reads what the kernels before wrote
  cuda::pdl_trigger();
  const int lane = threadIdx.x % 32;
  const int64_t token = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (token >= T) return;
  int my_e;
  float my_w;
  cuda::route_warp<PER>(logits + token * E, bias, E, K, kind, norm, scale, G, topk_group, K, my_e, my_w);
  if (lane < K) {
    index[token * K + lane] = my_e;
    weights[token * K + lane] = my_w;
  }
}

}  // namespace

cudaError_t route(const float* logits, const float* bias, int64_t T, int E, int K, int kind, bool norm, float scale,
                  int n_group, int topk_group, int32_t* index, float* weights, cudaStream_t s) {
  constexpr int kWarps = 4;
  const dim3 grid(unsigned((T + kWarps - 1) / kWarps)), block(32 * kWarps);
  const bool pdl = cuda::pdl_enabled();
  auto go = [&](auto kernel) {
    return cuda::launch_pdl(pdl, kernel, grid, block, 0, s, logits, bias, T, E, K, kind, norm ? 1 : 0, scale, n_group,
                            topk_group, index, weights);
  };
  if (E <= 32) return go(route_kernel<1>);
  if (E <= 64) return go(route_kernel<2>);
  if (E <= 128) return go(route_kernel<4>);
  if (E <= 256) return go(route_kernel<8>);
  if (E <= 512) return go(route_kernel<16>);
  if (E <= 32 * kRouteMaxPerLane) return go(route_kernel<kRouteMaxPerLane>);
  return cudaErrorInvalidValue;
}

}  // namespace moekit::model::kernels

// Internal: the routers' codes in kernels' arguments (base/cuda_route.cuh; ints: kernels take no library enums).
#pragma once

namespace moekit::cuda {
constexpr int kRouteSoftmaxTopk = 0, kRouteTopkSoftmax = 1, kRouteGroupedSigmoid = 2;
}  // namespace moekit::cuda

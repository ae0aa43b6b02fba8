// Internal: what the CUDA backends share beyond the device utilities of base/cuda_device.h.
#pragma once
#include "base/cuda_device.h"
#include "moekit/experts.h"

namespace moekit::cuda {

// The kernels' code of an activation (kernels::kAct*, base/activation.h's codes).
int kernel_activation(Activation a);

}  // namespace moekit::cuda

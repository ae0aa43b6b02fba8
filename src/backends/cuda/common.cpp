#include "backends/cuda/common.h"

#include "base/activation.h"

namespace moekit::cuda {

int kernel_activation(Activation a) { return act::code_of(a); }

}  // namespace moekit::cuda

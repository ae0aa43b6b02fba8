// The model runtime's CUDA layer ops. None are built yet: the model runs on the CPU, and loading it on a
// CUDA device reports that clearly (ops_for in ops.cpp). A CUDA implementation of DeviceOps returns its
// table here.
#include "model/ops.h"

namespace moekit::model {

const DeviceOps* cuda_ops() { return nullptr; }

}  // namespace moekit::model

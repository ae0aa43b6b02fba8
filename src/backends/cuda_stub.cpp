// Builds without CUDA: every CUDA backend reports why it cannot run.
#include "backends/backends.h"

namespace moekit::cuda {

static const char* kNoCuda =
    "moekit was built without CUDA (nvcc not found or MOEKIT_CUDA=OFF); rebuild with CUDA or use the CPU backends";

Support available(std::string_view, Device) { return Support::no(kNoCuda); }
Support supports(std::string_view, const Experts&, DType) { return Support::no(kNoCuda); }
void run(std::string_view backend, const Experts&, const ExpertsCall&) {
  MOEKIT_FAIL(not_supported, "experts implementation '", backend, "': ", kNoCuda);
}

}  // namespace moekit::cuda

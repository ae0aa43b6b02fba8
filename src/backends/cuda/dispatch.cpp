// Placeholder: CUDA backends are not implemented yet in this build.
#include "backends/backends.h"

namespace moekit::cuda {
static const char* kTodo = "the CUDA experts backends are not part of this build yet; use the CPU";
Support available(std::string_view, Device) { return Support::no(kTodo); }
Support supports(std::string_view, const Experts&, DType) { return Support::no(kTodo); }
void run(std::string_view backend, const Experts&, const ExpertsCall&) { MOEKIT_FAIL(not_supported, backend, ": ", kTodo); }
}  // namespace moekit::cuda

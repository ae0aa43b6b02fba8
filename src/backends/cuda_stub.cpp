// Builds without CUDA: every CUDA backend reports why it cannot run.
#include "backends/backends.h"

namespace moekit::cuda {

static const char* kNoCuda =
    "moekit was built without CUDA (nvcc not found or MOEKIT_CUDA=OFF); rebuild with CUDA or use the CPU backends";

Support available(std::string_view, Device, ArchCheck) { return Support::no(kNoCuda); }
Support supports(std::string_view, const Experts&, DType, ExtraCheck) { return Support::no(kNoCuda); }
void prepare(const Experts&) {}
void run(std::string_view backend, const Experts&, const ExpertsCall&, KernelPath) {
  MOEKIT_FAIL(not_supported, "experts implementation '", backend, "': ", kNoCuda);
}

}  // namespace moekit::cuda

// The CUDA graph API (include/moekit/cuda_graph.h) without CUDA.
#include <sstream>

#include "moekit/cuda_graph.h"

namespace moekit {

std::string ExpertsGraphShape::to_string() const {
  std::ostringstream os;
  os << "ExpertsGraphShape{.tokens=" << tokens << ", .top_k=" << top_k << ", .act_dtype=" << dtype_name(act_dtype)
     << ", .index_dtype=" << dtype_name(index_dtype) << ", .weight_dtype=" << dtype_name(weight_dtype) << "}";
  return os.str();
}

struct ExpertsGraph::Impl {};

ExpertsGraph::ExpertsGraph(const Experts&, const ExpertsGraphShape&, const std::string&) {
  MOEKIT_FAIL(not_supported, "ExpertsGraph needs CUDA: ", cuda::kNoCuda);
}
ExpertsGraph::~ExpertsGraph() = default;
ExpertsGraph::ExpertsGraph(ExpertsGraph&&) noexcept = default;
ExpertsGraph& ExpertsGraph::operator=(ExpertsGraph&&) noexcept = default;
Tensor ExpertsGraph::hidden_states() const { MOEKIT_FAIL(not_supported, cuda::kNoCuda); }
Tensor ExpertsGraph::top_k_index() const { MOEKIT_FAIL(not_supported, cuda::kNoCuda); }
Tensor ExpertsGraph::top_k_weights() const { MOEKIT_FAIL(not_supported, cuda::kNoCuda); }
Tensor ExpertsGraph::out() const { MOEKIT_FAIL(not_supported, cuda::kNoCuda); }
void ExpertsGraph::replay(Stream) const { MOEKIT_FAIL(not_supported, cuda::kNoCuda); }
void ExpertsGraph::check_errors(Stream) const { MOEKIT_FAIL(not_supported, cuda::kNoCuda); }
const std::string& ExpertsGraph::backend() const { MOEKIT_FAIL(not_supported, cuda::kNoCuda); }
const ExpertsGraphShape& ExpertsGraph::shape() const { MOEKIT_FAIL(not_supported, cuda::kNoCuda); }

void check_experts_errors(const Experts&, Stream) {}  // CPU experts: ids are checked before every call

}  // namespace moekit

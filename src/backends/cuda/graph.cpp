// ExpertsGraph (include/moekit/cuda_graph.h): one captured forward over persistent buffers.
#include <sstream>

#include "backends/cuda/state.h"
#include "moekit/cuda_graph.h"
#include "moekit/interface.h"

namespace moekit {
namespace {
// "batched_mm, grouped_mm": the registered backends that can be captured.
std::string capturable_backends() {
  std::string out;
  for (const auto& b : ExpertsInterface::global().backends())
    if (b->graph_capturable()) out += (out.empty() ? "" : ", ") + std::string(b->name());
  return out.empty() ? "none" : out;
}
}  // namespace

std::string ExpertsGraphShape::to_string() const {
  std::ostringstream os;
  os << "ExpertsGraphShape{.tokens=" << tokens << ", .top_k=" << top_k << ", .act_dtype=" << dtype_name(act_dtype)
     << ", .index_dtype=" << dtype_name(index_dtype) << ", .weight_dtype=" << dtype_name(weight_dtype) << "}";
  return os.str();
}

struct ExpertsGraph::Impl {
  Experts experts;
  std::string backend;
  ExpertsGraphShape shape;
  Tensor x, idx, w, out;
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;

  ~Impl() {
    if (!stream && !graph && !exec) return;
    const int device = experts.device().index;
    int previous = -1;
    (void)cudaGetDevice(&previous);
    if (previous != device) (void)cudaSetDevice(device);
    if (exec) (void)cudaGraphExecDestroy(exec);
    if (graph) (void)cudaGraphDestroy(graph);
    if (stream) {
      cuda::CudaState& state = cuda::cuda_state(experts);
      {
        std::lock_guard<std::mutex> lock(state.mutex);
        state.release(stream);
      }
      (void)cudaStreamDestroy(stream);
    }
    if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
  }

  ExpertsCall call() const { return ExpertsCall{x.view(), idx.view(), w.view(), out.view(), stream}; }
};

ExpertsGraph::ExpertsGraph(const Experts& experts, const ExpertsGraphShape& shape, const std::string& backend_name)
    : impl_(std::make_unique<Impl>()) {
  Impl& g = *impl_;
  g.experts = experts;
  g.backend = backend_name.empty() ? experts.implementation() : backend_name;
  g.shape = shape;
  const Device dev = experts.device();
  MOEKIT_CHECK_CODE(dev.is_cuda(), not_supported, "ExpertsGraph needs experts on a CUDA device, got ",
                    dev.to_string());
  auto backend = ExpertsInterface::global().get(g.backend);
  MOEKIT_CHECK_CODE(backend->graph_capturable(), not_supported, "experts implementation '", g.backend,
                    "' cannot be captured in a CUDA graph",
                    backend->needs_host_sync() ? " (it synchronises with the host)" : "", "; capturable: ",
                    capturable_backends());
  MOEKIT_CHECK(shape.tokens >= 0 && shape.top_k >= 1, "ExpertsGraph: bad shape ", shape.to_string());
  MOEKIT_CHECK(shape.index_dtype == DType::i32 || shape.index_dtype == DType::i64,
               "ExpertsGraph: index_dtype must be i32 or i64, got ", dtype_name(shape.index_dtype));
  const Support s = backend->supports(experts, shape.act_dtype);
  MOEKIT_CHECK_CODE(s.ok, not_supported, "ExpertsGraph: ", s.reason);

  cuda::DeviceGuard guard(dev.index);
  const int64_t T = shape.tokens, K = shape.top_k, H = experts.spec().hidden;
  g.x = Tensor::zeros({T, H}, shape.act_dtype, dev);
  g.idx = Tensor::zeros({T, K}, shape.index_dtype, dev);  // expert 0: valid
  g.w = Tensor::zeros({T, K}, shape.weight_dtype, dev);
  g.out = Tensor::zeros({T, H}, shape.act_dtype, dev);
  MOEKIT_CUDA_CALL(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));

  // Uncaptured first: sizes the workspace and loads the kernels outside the capture.
  experts.forward_with(g.backend, g.call());
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(g.stream));

  MOEKIT_CUDA_CALL(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal));
  try {
    experts.forward_with(g.backend, g.call());
  } catch (...) {
    cudaGraph_t partial = nullptr;
    (void)cudaStreamEndCapture(g.stream, &partial);
    if (partial) (void)cudaGraphDestroy(partial);
    (void)cudaGetLastError();
    throw;
  }
  MOEKIT_CUDA_CALL(cudaStreamEndCapture(g.stream, &g.graph));
  MOEKIT_CUDA_CALL(cudaGraphInstantiate(&g.exec, g.graph, 0));
}

ExpertsGraph::~ExpertsGraph() = default;
ExpertsGraph::ExpertsGraph(ExpertsGraph&&) noexcept = default;
ExpertsGraph& ExpertsGraph::operator=(ExpertsGraph&&) noexcept = default;

Tensor ExpertsGraph::hidden_states() const { return impl_->x; }
Tensor ExpertsGraph::top_k_index() const { return impl_->idx; }
Tensor ExpertsGraph::top_k_weights() const { return impl_->w; }
Tensor ExpertsGraph::out() const { return impl_->out; }
const std::string& ExpertsGraph::backend() const { return impl_->backend; }
const ExpertsGraphShape& ExpertsGraph::shape() const { return impl_->shape; }

void ExpertsGraph::replay(Stream stream) const {
  MOEKIT_CHECK(impl_ != nullptr, "ExpertsGraph::replay on a moved-from graph");
  cuda::DeviceGuard guard(impl_->experts.device().index);
  MOEKIT_CUDA_CALL(cudaGraphLaunch(impl_->exec, static_cast<cudaStream_t>(stream)));
}

void ExpertsGraph::check_errors(Stream stream) const {
  MOEKIT_CHECK(impl_ != nullptr, "ExpertsGraph::check_errors on a moved-from graph");
  const Experts& experts = impl_->experts;
  cuda::DeviceGuard guard(experts.device().index);
  cuda::CudaState& state = cuda::cuda_state(experts);
  std::lock_guard<std::mutex> lock(state.mutex);
  cuda::StreamWorkspace* ws = state.find(impl_->stream);
  if (!ws) return;
  cuda::check_and_clear_error(*ws, static_cast<cudaStream_t>(stream), experts.spec().num_experts);
}

}  // namespace moekit

// batched_mm: one small product per (token, slot) pair, reading the expert's weights in place (transformers'
// version copies them per pair). Fastest for few tokens; capturable on CUDA.
#include "backends/backends.h"
#include "backends/cpu/common.h"

namespace moekit {
namespace {

class BatchedMmBackend final : public CpuCudaBackend {
 public:
  std::string_view name() const override { return "batched_mm"; }
  std::string_view description() const override {
    return "one small GEMM per (token, slot) pair, weights indexed, not copied";
  }
  bool graph_capturable() const override { return true; }
  // On the CPU: bf16 weights packed once for the bf16 tile (shared by the three CPU backends).
  void prepare(const Experts& experts) const override {
    if (experts.device().is_cpu()) cpu::prepare(experts);
    else CpuCudaBackend::prepare(experts);
  }
  void run(const Experts& experts, const ExpertsCall& call) const override {
    if (experts.device().is_cpu()) cpu::batched_mm(experts, call);
    else cuda::run(name(), experts, call, MOEKIT_CUDA_PATH(run_batched_mm));
  }
};

}  // namespace

BackendPtr make_batched_mm_backend() { return std::make_shared<BatchedMmBackend>(); }

}  // namespace moekit

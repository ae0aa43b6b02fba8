// eager: the reference loop. For each expert that got tokens: gather its tokens, two GEMMs, weighted
// accumulate. On CUDA the host reads the per-expert counts back, so it is not capturable.
#include "backends/backends.h"
#include "backends/cpu/common.h"

namespace moekit {
namespace {

class EagerBackend final : public CpuCudaBackend {
 public:
  std::string_view name() const override { return "eager"; }
  std::string_view description() const override {
    return "reference loop over the experts that got tokens (on CUDA the host reads the counts back)";
  }
  bool needs_host_sync() const override { return true; }
  int default_rank() const override { return 1; }
  // On the CPU: bf16 weights packed once for the bf16 tile (shared by the three CPU backends).
  void prepare(const Experts& experts) const override {
    if (experts.device().is_cpu()) cpu::prepare(experts);
    else CpuCudaBackend::prepare(experts);
  }
  void run(const Experts& experts, const ExpertsCall& call) const override {
    if (experts.device().is_cpu()) cpu::eager(experts, call);
    else cuda::run(name(), experts, call, MOEKIT_CUDA_PATH(run_eager));
  }
};

}  // namespace

BackendPtr make_eager_backend() { return std::make_shared<EagerBackend>(); }

}  // namespace moekit

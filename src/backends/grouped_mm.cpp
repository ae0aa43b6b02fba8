// grouped_mm: pairs sorted by expert, one grouped GEMM per projection, the sort undone in the combine.
// Memory-efficient and best for many tokens; capturable on CUDA. During GPU generation the decode steps
// switch it to batched_mm (SPEC section 4).
#include "backends/backends.h"
#include "backends/cpu/common.h"

namespace moekit {
namespace {

class GroupedMmBackend final : public CpuCudaBackend {
 public:
  std::string_view name() const override { return "grouped_mm"; }
  std::string_view description() const override {
    return "pairs sorted by expert, one grouped GEMM per projection";
  }
  bool graph_capturable() const override { return true; }
  std::string_view decode_backend() const override { return "batched_mm"; }
  int default_rank() const override { return 2; }
  // CUDA's large-T plan: the routed rows gathered into a [P, H] copy for the TMA kernel, f32 down rows.
  double bytes_moved(const ExpertsSpec& s, int64_t tokens, int64_t top_k, double touched, DType dt) const override {
    return routed_bytes(s, tokens, top_k, touched, dt, /*gathered_copy=*/true, /*down_row_bytes=*/4);
  }
  // On the CPU: bf16 weights packed once for the bf16 tile (shared by the three CPU backends).
  void prepare(const Experts& experts) const override {
    if (experts.device().is_cpu()) cpu::prepare(experts);
    else CpuCudaBackend::prepare(experts);
  }
  void run(const Experts& experts, const ExpertsCall& call) const override {
    if (experts.device().is_cpu()) cpu::grouped_mm(experts, call);
    else cuda::run(name(), experts, call, MOEKIT_CUDA_PATH(run_grouped_mm));
  }
};

}  // namespace

BackendPtr make_grouped_mm_backend() { return std::make_shared<GroupedMmBackend>(); }

}  // namespace moekit

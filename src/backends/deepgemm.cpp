// deepgemm (SPEC section 2): DeepGEMM's contiguous layout: each expert's rows copied to a block that starts
// at a multiple of the row tile (128, or 64 where the experts hold few rows), then one warp-specialised TMA
// grouped GEMM per projection on Hopper tensor cores (src/backends/cuda/deepgemm.cpp). CUDA only, compute
// capability 9.0; bf16 and f16 experts. No host synchronisation: capturable in a CUDA graph.
#include "backends/backends.h"

namespace moekit {
namespace {

class DeepgemmBackend final : public ExpertsBackend {
 public:
  std::string_view name() const override { return "deepgemm"; }
  std::string_view description() const override {
    return "rows padded to the row tile (64 or 128) per expert, one TMA grouped GEMM per projection on Hopper "
           "tensor cores";
  }
  std::vector<DeviceType> devices() const override { return {DeviceType::cuda}; }
  std::vector<DType> weight_dtypes() const override { return {DType::bf16, DType::f16}; }
  std::string_view requirements() const override {
    return "CUDA compute capability 9.0 (sm_90a code), bf16 or f16 weights and activations, hidden and "
           "intermediate sizes multiples of 8, built-in gates";
  }
  bool graph_capturable() const override { return true; }
  bool routes_calls() const override { return true; }  // cuda::run routes first
  // The padded copy of the routed rows, f32 down rows (padding rows left out).
  double bytes_moved(const ExpertsSpec& s, int64_t tokens, int64_t top_k, double touched, DType dt) const override {
    return routed_bytes(s, tokens, top_k, touched, dt, /*gathered_copy=*/true, /*down_row_bytes=*/4);
  }
  Support available(Device device) const override {
    if (device.is_cpu())
      return Support::no("deepgemm needs a CUDA GPU of compute capability 9.0 (Hopper); on the CPU use grouped_mm "
                         "or batched_mm");
    return cuda::available(name(), device, MOEKIT_CUDA_CHECK(deepgemm_arch_reason));
  }
  Support supports(const Experts& experts, DType act_dtype) const override {
    if (experts.device().is_cpu()) return available(experts.device());
    return cuda::supports(name(), experts, act_dtype, MOEKIT_CUDA_CHECK(deepgemm_unsupported_reason));
  }
  void prepare(const Experts& experts) const override {
    if (experts.device().is_cuda()) cuda::prepare(experts);
  }
  void run(const Experts& experts, const ExpertsCall& call) const override {
    cuda::run(name(), experts, call, MOEKIT_CUDA_PATH(run_deepgemm));
  }
};

}  // namespace

BackendPtr make_deepgemm_backend() { return std::make_shared<DeepgemmBackend>(); }

}  // namespace moekit

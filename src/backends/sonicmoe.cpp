// sonicmoe (SPEC section 2): the routed forward fused and IO-aware on Hopper for gated bf16 / f16 experts: the
// gather inside the gate/up GEMM's operand loads, the gated activation in its epilogue, the routing weight in
// the down GEMM's epilogue, a deterministic slot-order reduction (src/backends/cuda/sonicmoe.cpp). CUDA only,
// compute capability 9.0; capturable in a CUDA graph. Its requirements are checked before anything runs, each
// refusal naming what is missing and the backend to use instead (transformers raises ImportError there).
#include "backends/backends.h"

namespace moekit {

std::string sonicmoe_experts_reason(const ExpertsSpec& s, DType weight_dtype) {
  if (weight_dtype != DType::bf16 && weight_dtype != DType::f16 && weight_dtype != DType::f32)
    return std::string("sonicmoe runs bf16 and f16 experts, got quantized ") + dtype_name(weight_dtype) +
           " experts; use grouped_mm or batched_mm";
  if (weight_dtype == DType::f32)
    return "sonicmoe runs bf16 and f16 experts, got f32; use grouped_mm (or load the experts in bf16)";
  if (!s.has_gate)
    return std::string("sonicmoe fuses a gated activation (SwiGLU, GeGLU, ReGLU, gpt-oss's clamped SwiGLU); these "
                       "experts are not gated (activation '") +
           activation_name(s.activation) + "' without a gate); use grouped_mm or deepgemm";
  if (s.gate == GateKind::custom)
    return "sonicmoe runs the built-in gates; a custom gate function runs only on the CPU backends (grouped_mm)";
  return {};
}

namespace {

class SonicmoeBackend final : public ExpertsBackend {
 public:
  std::string_view name() const override { return "sonicmoe"; }
  std::string_view description() const override {
    return "gather fused into the gate/up GEMM's loads, activation and routing weight in the epilogues, "
           "deterministic slot-order reduction, on Hopper tensor cores";
  }
  std::vector<DeviceType> devices() const override { return {DeviceType::cuda}; }
  std::vector<DType> weight_dtypes() const override { return {DType::bf16, DType::f16}; }
  std::string_view requirements() const override {
    return "CUDA compute capability 9.0 (sm_90a code), gated experts (act_mul or clamped SwiGLU) in bf16 or f16, "
           "hidden and intermediate sizes multiples of 8";
  }
  bool graph_capturable() const override { return true; }
  bool routes_calls() const override { return true; }  // cuda::run routes first
  double bytes_moved(const ExpertsSpec& s, int64_t tokens, int64_t top_k, double touched, DType dt) const override {
    return routed_bytes(s, tokens, top_k, touched, dt, /*gathered_copy=*/false, /*down_row_bytes=*/dtype_bits(dt) / 8);
  }
  Support available(Device device) const override {
    if (device.is_cpu())
      return Support::no("sonicmoe needs a CUDA GPU of compute capability 9.0 (Hopper); on the CPU use grouped_mm "
                         "or batched_mm");
    return cuda::available(name(), device, MOEKIT_CUDA_CHECK(sonicmoe_arch_reason));
  }
  Support supports(const Experts& experts, DType act_dtype) const override {
    const Support avail = available(experts.device());
    if (!avail) return avail;
    if (std::string why = sonicmoe_experts_reason(experts.spec(), experts.weight_dtype()); !why.empty())
      return Support::no("experts implementation 'sonicmoe': " + why);
    return cuda::supports(name(), experts, act_dtype, MOEKIT_CUDA_CHECK(sonicmoe_unsupported_reason));
  }
  void prepare(const Experts& experts) const override {
    if (experts.device().is_cuda()) cuda::prepare(experts);
  }
  void run(const Experts& experts, const ExpertsCall& call) const override {
    cuda::run(name(), experts, call, MOEKIT_CUDA_PATH(run_sonicmoe));
  }
};

}  // namespace

BackendPtr make_sonicmoe_backend() { return std::make_shared<SonicmoeBackend>(); }

}  // namespace moekit

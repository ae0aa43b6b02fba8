// sonicmoe (SPEC section 2): a fused routed forward for gated bf16 experts. Not in this build yet: it is
// registered so that the name is known and selecting it explains itself; it runs nothing, on any device.
#include "backends/backends.h"

namespace moekit {
namespace {

constexpr const char* kNotYet =
    "sonicmoe is not in this build yet: it needs fused CUDA kernels for Hopper (compute capability 9.0) that "
    "moekit does not have yet; use grouped_mm (or batched_mm for few tokens)";

class SonicmoeBackend final : public ExpertsBackend {
 public:
  std::string_view name() const override { return "sonicmoe"; }
  std::string_view description() const override {
    return "not in this build yet (planned: gather, gate/up GEMM with the activation fused, down GEMM, scatter)";
  }
  std::vector<DeviceType> devices() const override { return {}; }
  std::vector<DType> weight_dtypes() const override { return {}; }
  std::string_view requirements() const override { return kNotYet; }
  Support available(Device) const override { return Support::no(kNotYet); }
  Support supports(const Experts&, DType) const override { return Support::no(kNotYet); }
  void run(const Experts&, const ExpertsCall&) const override { MOEKIT_FAIL(not_supported, kNotYet); }
};

}  // namespace

BackendPtr make_sonicmoe_backend() { return std::make_shared<SonicmoeBackend>(); }

}  // namespace moekit

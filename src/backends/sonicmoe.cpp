// sonicmoe (SPEC section 2): a fused routed forward for gated bf16 experts. Not in this build yet:
// registered so that the name is known and selecting it explains itself.
#include "backends/backends.h"

namespace moekit {
namespace {

class SonicmoeBackend final : public NotInThisBuildBackend {
 public:
  std::string_view name() const override { return "sonicmoe"; }
  std::string_view description() const override {
    return "not in this build yet (planned: gather, gate/up GEMM with the activation fused, down GEMM, scatter)";
  }

 protected:
  std::string_view reason() const override {
    return "sonicmoe is not in this build yet: it needs fused CUDA kernels for Hopper (compute capability 9.0) "
           "that moekit does not have yet; use grouped_mm (or batched_mm for few tokens)";
  }
};

}  // namespace

BackendPtr make_sonicmoe_backend() { return std::make_shared<SonicmoeBackend>(); }

}  // namespace moekit

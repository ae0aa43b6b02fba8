// deepgemm (SPEC section 2): DeepGEMM-style grouped GEMM on Hopper tensor cores over rows padded to 128 per
// expert. Not in this build yet: registered so that the name is known and selecting it explains itself.
#include "backends/backends.h"

namespace moekit {
namespace {

class DeepgemmBackend final : public NotInThisBuildBackend {
 public:
  std::string_view name() const override { return "deepgemm"; }
  std::string_view description() const override {
    return "not in this build yet (planned: rows padded to 128 per expert, one grouped GEMM on Hopper)";
  }

 protected:
  std::string_view reason() const override {
    return "deepgemm is not in this build yet: it needs CUDA grouped-GEMM kernels for Hopper (compute capability "
           "9.0) that moekit does not have yet; use grouped_mm (or batched_mm for few tokens)";
  }
};

}  // namespace

BackendPtr make_deepgemm_backend() { return std::make_shared<DeepgemmBackend>(); }

}  // namespace moekit

// deepgemm_megamoe (SPEC section 2): one fused kernel for expert-parallel dispatch, gated MLP and combine. A
// load-time choice. Not in this build: it needs SM100 GPUs, FP4 experts and an expert-parallel group.
#include "backends/backends.h"

namespace moekit {
namespace {

class MegaMoeBackend final : public NotInThisBuildBackend {
 public:
  std::string_view name() const override { return "deepgemm_megamoe"; }
  std::string_view description() const override {
    return "not in this build (one fused kernel: expert-parallel dispatch, gated MLP, combine)";
  }
  bool load_time_only() const override { return true; }

 protected:
  std::string_view reason() const override {
    return "deepgemm_megamoe is not in this build: it needs CUDA SM100+ (Blackwell) GPUs, FP4 experts and an "
           "expert-parallel group; use grouped_mm";
  }
};

}  // namespace

BackendPtr make_deepgemm_megamoe_backend() { return std::make_shared<MegaMoeBackend>(); }

}  // namespace moekit

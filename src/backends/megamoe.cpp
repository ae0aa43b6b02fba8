// deepgemm_megamoe (SPEC section 2): one fused kernel for expert-parallel dispatch, gated MLP and combine. A
// load-time choice. Not in this build: it needs SM100 GPUs, FP4 experts and an expert-parallel group.
#include "backends/backends.h"

namespace moekit {
namespace {

constexpr const char* kNotHere =
    "deepgemm_megamoe is not in this build: it needs CUDA SM100+ (Blackwell) GPUs, FP4 experts and an "
    "expert-parallel group; use grouped_mm";

class MegaMoeBackend final : public ExpertsBackend {
 public:
  std::string_view name() const override { return "deepgemm_megamoe"; }
  std::string_view description() const override {
    return "not in this build (one fused kernel: expert-parallel dispatch, gated MLP, combine; load-time choice)";
  }
  std::vector<DeviceType> devices() const override { return {}; }
  std::vector<DType> weight_dtypes() const override { return {}; }
  std::string_view requirements() const override { return kNotHere; }
  bool load_time_only() const override { return true; }
  Support available(Device) const override { return Support::no(kNotHere); }
  Support supports(const Experts&, DType) const override { return Support::no(kNotHere); }
  void run(const Experts&, const ExpertsCall&) const override { MOEKIT_FAIL(not_supported, kNotHere); }
};

}  // namespace

BackendPtr make_deepgemm_megamoe_backend() { return std::make_shared<MegaMoeBackend>(); }

}  // namespace moekit

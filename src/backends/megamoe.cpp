// deepgemm_megamoe (SPEC section 2): one fused kernel for expert-parallel dispatch, gated MLP and combine. A
// load-time choice. Its kernel is not in this build (no machine here has an SM100 GPU to run it on); what it
// needs is checked in the SPEC's order, and a module that selects it is told every requirement it misses.
#include "backends/megamoe.h"

#include "backends/backends.h"

namespace moekit {

namespace {

thread_local int recorded_arch = -1;
std::string record_arch(int arch) {
  recorded_arch = arch;
  return "";
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "; (" : "(") + std::to_string(i + 1) + ") " + v[i];
  return s;
}

class MegaMoeBackend final : public NotInThisBuildBackend {
 public:
  std::string_view name() const override { return "deepgemm_megamoe"; }
  std::string_view description() const override {
    return "not in this build (one fused kernel: expert-parallel dispatch, gated MLP, combine)";
  }
  bool load_time_only() const override { return true; }
  // Per module: every unmet requirement, in the SPEC's order; with all of them met, the kernel itself is
  // what this build lacks.
  Support supports(const Experts& experts, DType) const override {
    const auto missing = megamoe_missing(megamoe_facts(experts));
    if (missing.empty()) return Support::no(std::string(reason()));
    return Support::no("deepgemm_megamoe cannot run these experts: it needs " + join(missing) +
                       ". Use grouped_mm (or batched_mm) instead");
  }

 protected:
  std::string_view reason() const override {
    return "deepgemm_megamoe is not in this build: it needs CUDA SM100+ (Blackwell) GPUs, FP4 experts with UE8M0 "
           "scales and an expert-parallel group (ep_size > 1); use grouped_mm";
  }
};

}  // namespace

ExpertParallelState& expert_parallel_state(const Experts& experts) {
  return experts.state<ExpertParallelState>("expert_parallel",
                                            [] { return std::make_unique<ExpertParallelState>(); });
}

MegaMoeFacts megamoe_facts(const Experts& experts) {
  MegaMoeFacts f;
  const Device d = experts.device();
  f.device = d.to_string();
  if (d.is_cuda()) {
    recorded_arch = -1;
    const Support s = cuda::available("deepgemm_megamoe", d, &record_arch);
    if (s.ok && recorded_arch >= 0) {
      f.arch = recorded_arch;
      f.device = s.reason;  // the device's description
    } else {
      f.device = s.reason;
    }
  }
  f.weight_dtype = experts.weight_dtype();
  f.ep_size = expert_parallel_state(experts).ep_size;
  return f;
}

std::vector<std::string> megamoe_missing(const MegaMoeFacts& f) {
  std::vector<std::string> out;
  // 1. The GPU.
  if (!f.arch)
    out.push_back("a CUDA GPU of compute capability 10.0 or newer (SM100+, Blackwell); the experts are on " +
                  f.device);
  else if (*f.arch < 100)
    out.push_back("a CUDA GPU of compute capability 10.0 or newer (SM100+, Blackwell); " + f.device +
                  " is compute capability " + std::to_string(*f.arch / 10) + "." + std::to_string(*f.arch % 10));
  // 2. FP4 experts with UE8M0 (power-of-two) scales.
  if (f.weight_dtype != DType::f4e2m1)
    out.push_back(std::string("FP4 (e2m1) experts with UE8M0 scales; the experts are ") + dtype_name(f.weight_dtype));
  else if (!f.scale_dtype)
    out.push_back("UE8M0 scales beside the FP4 experts; they have none");
  else if (*f.scale_dtype != DType::ue8m0)
    out.push_back(std::string("UE8M0 expert scales (powers of two); these are ") + dtype_name(*f.scale_dtype) +
                  " scales (scale_fmt \"float\"), which would corrupt the output: load the checkpoint with "
                  "scale_fmt \"ue8m0\", or use grouped_mm or batched_mm, which take float32 block scales");
  // 3. The expert-parallel group.
  if (f.ep_size <= 1)
    out.push_back("an expert-parallel group with ep_size > 1 (ParallelExperts, moekit run --ep N); these experts run "
                  "in none");
  return out;
}

BackendPtr make_deepgemm_megamoe_backend() { return std::make_shared<MegaMoeBackend>(); }

}  // namespace moekit

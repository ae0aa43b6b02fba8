// The one ordered list of built-in backends (SPEC section 2), and user registration.
#include <algorithm>

#include "backends/backends.h"

namespace moekit {
namespace {

// eager, batched_mm, grouped_mm: CPU and CUDA.
class PortableBackend final : public ExpertsBackend {
 public:
  using CpuFn = void (*)(const Experts&, const ExpertsCall&);
  PortableBackend(std::string_view name, std::string_view description, CpuFn cpu_fn, bool capturable)
      : name_(name), description_(description), cpu_fn_(cpu_fn), capturable_(capturable) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return description_; }
  Support available(Device device) const override {
    return device.is_cpu() ? Support::yes() : cuda::available(name_, device);
  }
  Support supports(const Experts& experts, DType act_dtype) const override {
    return experts.device().is_cpu() ? cpu::supports(experts, act_dtype)
                                     : cuda::supports(name_, experts, act_dtype);
  }
  bool graph_capturable() const override { return capturable_; }
  void run(const Experts& experts, const ExpertsCall& call) const override {
    if (experts.device().is_cpu()) cpu_fn_(experts, call);
    else cuda::run(name_, experts, call);
  }

 private:
  std::string_view name_, description_;
  CpuFn cpu_fn_;
  bool capturable_;
};

// deepgemm, sonicmoe: CUDA only (SM90+).
class CudaOnlyBackend final : public ExpertsBackend {
 public:
  CudaOnlyBackend(std::string_view name, std::string_view description) : name_(name), description_(description) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return description_; }
  Support available(Device device) const override {
    if (device.is_cpu())
      return Support::no(std::string(name_) + " needs a CUDA GPU of compute capability 9.0 or newer; on the CPU use grouped_mm or batched_mm");
    return cuda::available(name_, device);
  }
  Support supports(const Experts& experts, DType act_dtype) const override {
    if (experts.device().is_cpu()) return available(experts.device());
    return cuda::supports(name_, experts, act_dtype);
  }
  bool graph_capturable() const override { return true; }
  void run(const Experts& experts, const ExpertsCall& call) const override { cuda::run(name_, experts, call); }

 private:
  std::string_view name_, description_;
};

// deepgemm_megamoe: needs SM100+, FP4 experts and an expert-parallel group; none exist on SM90.
class MegaMoeBackend final : public ExpertsBackend {
 public:
  std::string_view name() const override { return "deepgemm_megamoe"; }
  std::string_view description() const override {
    return "one fused kernel: expert-parallel dispatch, gated MLP, combine (load-time choice)";
  }
  Support available(Device device) const override {
    if (device.is_cpu())
      return Support::no("deepgemm_megamoe needs CUDA SM100+ GPUs, FP4 experts and an expert-parallel group; use grouped_mm");
    return Support::no("deepgemm_megamoe needs CUDA SM100+ (Blackwell), FP4 experts and an expert-parallel group; this build has no SM100 kernels, use deepgemm or grouped_mm");
  }
  Support supports(const Experts& experts, DType) const override { return available(experts.device()); }
  void run(const Experts& experts, const ExpertsCall&) const override {
    MOEKIT_FAIL(not_supported, available(experts.device()).reason);
  }
};

// A user function registered by name.
class FunctionBackend final : public ExpertsBackend {
 public:
  FunctionBackend(std::string name, ExpertsInterface::ForwardFn fn, std::vector<DeviceType> devices, std::string desc)
      : name_(std::move(name)), fn_(std::move(fn)), devices_(std::move(devices)), description_(std::move(desc)) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return description_; }
  Support available(Device device) const override {
    if (std::find(devices_.begin(), devices_.end(), device.type) != devices_.end()) return Support::yes();
    return Support::no("user backend '" + name_ + "' was not registered for " + device.to_string());
  }
  Support supports(const Experts& experts, DType) const override { return available(experts.device()); }
  void run(const Experts& experts, const ExpertsCall& call) const override { fn_(experts, call); }

 private:
  std::string name_;
  ExpertsInterface::ForwardFn fn_;
  std::vector<DeviceType> devices_;
  std::string description_;
};

}  // namespace

ExpertsInterface::ExpertsInterface() {
  backends_ = {
      std::make_shared<PortableBackend>("eager", "reference loop over the experts that got tokens (host synchronises)",
                                        &cpu::eager, false),
      std::make_shared<PortableBackend>("batched_mm", "one small GEMM per (token, slot) pair, weights indexed, not copied",
                                        &cpu::batched_mm, true),
      std::make_shared<PortableBackend>("grouped_mm", "pairs sorted by expert, one grouped GEMM per projection",
                                        &cpu::grouped_mm, true),
      std::make_shared<CudaOnlyBackend>("deepgemm", "rows padded to 128 per expert, one grouped GEMM on Hopper tensor cores (bf16, FP8)"),
      std::make_shared<CudaOnlyBackend>("sonicmoe", "fused gather, gate/up GEMM with activation epilogue, down GEMM, weighted scatter"),
      std::make_shared<MegaMoeBackend>(),
  };
  n_builtin_ = backends_.size();
}

ExpertsInterface& ExpertsInterface::global() {
  static ExpertsInterface instance;
  return instance;
}

void ExpertsInterface::register_backend(BackendPtr backend, bool replace) {
  MOEKIT_CHECK(backend != nullptr, "register_backend: backend is null");
  const std::string name(backend->name());
  MOEKIT_CHECK(!name.empty(), "register_backend: backend name is empty");
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < backends_.size(); ++i) {
    if (backends_[i]->name() != name) continue;
    MOEKIT_CHECK(i >= n_builtin_, "register_backend: '", name, "' is a built-in backend and cannot be replaced");
    MOEKIT_CHECK(replace, "register_backend: a backend named '", name, "' is already registered (pass replace=true)");
    backends_[i] = std::move(backend);
    return;
  }
  backends_.push_back(std::move(backend));
}

void ExpertsInterface::register_backend(const std::string& name, ForwardFn fn, std::vector<DeviceType> devices,
                                        const std::string& description, bool replace) {
  MOEKIT_CHECK(static_cast<bool>(fn), "register_backend: function for '", name, "' is empty");
  register_backend(std::make_shared<FunctionBackend>(name, std::move(fn), std::move(devices), description), replace);
}

bool ExpertsInterface::unregister_backend(std::string_view name) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < backends_.size(); ++i) {
    if (backends_[i]->name() != name) continue;
    MOEKIT_CHECK(i >= n_builtin_, "unregister_backend: '", name, "' is a built-in backend");
    backends_.erase(backends_.begin() + std::ptrdiff_t(i));
    return true;
  }
  return false;
}

bool ExpertsInterface::contains(std::string_view name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::any_of(backends_.begin(), backends_.end(), [&](const BackendPtr& b) { return b->name() == name; });
}

bool ExpertsInterface::is_builtin(std::string_view name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < n_builtin_; ++i)
    if (backends_[i]->name() == name) return true;
  return false;
}

BackendPtr ExpertsInterface::get(std::string_view name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& b : backends_)
    if (b->name() == name) return b;
  std::string valid;
  for (const auto& b : backends_) valid += (valid.empty() ? "" : ", ") + std::string(b->name());
  MOEKIT_FAIL(not_found, "unknown experts implementation '", name, "'; valid names: ", valid);
}

std::vector<std::string> ExpertsInterface::names() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> out;
  for (const auto& b : backends_) out.emplace_back(b->name());
  return out;
}

std::vector<BackendPtr> ExpertsInterface::backends() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return backends_;
}

std::string default_experts_implementation(const Experts& experts, DType act_dtype) {
  auto& reg = ExpertsInterface::global();
  if (reg.get("grouped_mm")->supports(experts, act_dtype)) return "grouped_mm";
  return "eager";
}

}  // namespace moekit

// The one ordered list of built-in backends (SPEC section 2), and user registration.
#include <algorithm>

#include "backends/backends.h"

namespace moekit {

// The built-in backends, in the order they are listed. Each is one class in src/backends/<file>.cpp that
// defines make_<name>_backend(); adding one is its file and one line here.
#define MOEKIT_BUILTIN_BACKENDS(X) \
  X(eager)                         \
  X(batched_mm)                    \
  X(grouped_mm)                    \
  X(deepgemm)                      \
  X(sonicmoe)                      \
  X(deepgemm_megamoe)

#define MOEKIT_DECLARE_BACKEND(n) BackendPtr make_##n##_backend();
MOEKIT_BUILTIN_BACKENDS(MOEKIT_DECLARE_BACKEND)
#undef MOEKIT_DECLARE_BACKEND

namespace {

// A user function registered by name.
class FunctionBackend final : public ExpertsBackend {
 public:
  FunctionBackend(std::string name, ExpertsInterface::ForwardFn fn, std::vector<DeviceType> devices, std::string desc)
      : name_(std::move(name)), fn_(std::move(fn)), devices_(std::move(devices)), description_(std::move(desc)) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return description_; }
  std::vector<DeviceType> devices() const override { return devices_; }
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
#define MOEKIT_LIST_BACKEND(n) make_##n##_backend(),
  backends_ = {MOEKIT_BUILTIN_BACKENDS(MOEKIT_LIST_BACKEND)};
#undef MOEKIT_LIST_BACKEND
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

namespace {
// The built-in of highest default_rank() for which `ok` holds; the lowest-ranked one when none does (the
// module then fails at its first forward with that backend's reason).
template <class Ok>
std::string best_default(Ok&& ok) {
  auto& reg = ExpertsInterface::global();
  std::vector<BackendPtr> ranked;
  for (const auto& b : reg.backends())
    if (b->default_rank() > 0 && reg.is_builtin(b->name())) ranked.push_back(b);
  MOEKIT_CHECK_CODE(!ranked.empty(), internal, "no built-in experts backend can be the default");
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const BackendPtr& a, const BackendPtr& b) { return a->default_rank() > b->default_rank(); });
  for (const auto& b : ranked)
    if (ok(*b)) return std::string(b->name());
  return std::string(ranked.back()->name());
}
}  // namespace

std::string default_experts_implementation(const Experts& experts, DType act_dtype) {
  return best_default([&](const ExpertsBackend& b) { return b.supports(experts, act_dtype).ok; });
}

std::string default_experts_implementation(Device device) {
  return best_default([&](const ExpertsBackend& b) { return b.available(device).ok; });
}

void check_runtime_switch(std::string_view from, std::string_view to, std::string_view what) {
  if (from.empty() || from == to) return;
  auto& reg = ExpertsInterface::global();
  for (const std::string_view n : {from, to}) {
    if (!reg.get(n)->load_time_only()) continue;
    MOEKIT_FAIL(not_supported, "cannot switch ", what, " from '", from, "' to '", to, "' at run time: '", n,
                "' is a load-time choice; reload the model (or build the module) with it");
  }
}

}  // namespace moekit

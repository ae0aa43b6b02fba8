// moekit: the ExpertsInterface, the registry of experts backends (SPEC sections 2 and 3).
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/experts.h"

namespace moekit {

struct Support {
  bool ok = true;
  std::string reason;  // why not, and what to use instead
  static Support yes() { return {true, {}}; }
  static Support no(std::string why) { return {false, std::move(why)}; }
  explicit operator bool() const { return ok; }
};

// One experts backend: its identity, its properties and its forward, per device. A backend is one class
// (src/backends/<name>.cpp for the built-ins) and one line in the registry; nothing else names it.
//
//   class MyBackend final : public ExpertsBackend {
//    public:
//     std::string_view name() const override { return "my_backend"; }
//     std::string_view description() const override { return "what it computes, in one line"; }
//     Support available(Device d) const override { return d.is_cpu() ? Support::yes() : Support::no("CPU only"); }
//     Support supports(const Experts& e, DType act) const override { return available(e.device()); }
//     void run(const Experts& e, const ExpertsCall& call) const override { /* write call.out */ }
//   };
//   ExpertsInterface::global().register_backend(std::make_shared<MyBackend>());
class ExpertsBackend {
 public:
  virtual ~ExpertsBackend() = default;

  // ---- identity ----
  virtual std::string_view name() const = 0;
  virtual std::string_view description() const = 0;  // what it computes, as it is in this build

  // ---- properties ----
  // The device types it has an implementation for (in some build; available() says whether it runs here).
  virtual std::vector<DeviceType> devices() const { return {DeviceType::cpu}; }
  // The expert weight dtypes it takes (activations: see supports()).
  virtual std::vector<DType> weight_dtypes() const { return {DType::f32, DType::bf16, DType::f16}; }
  // What it needs beyond devices and dtypes, in words ("" when nothing).
  virtual std::string_view requirements() const { return {}; }
  // Whether a forward can be captured in a CUDA graph (no host synchronisation, no allocation).
  virtual bool graph_capturable() const { return false; }
  // Whether a forward on a GPU synchronises the host with the device.
  virtual bool needs_host_sync() const { return false; }
  // Whether it is chosen at load time only: switching to or from it at run time is an error.
  virtual bool load_time_only() const { return false; }
  // Its rank as the default backend (0: never the default). The default for a module is the built-in with
  // the highest rank that supports it: grouped_mm (2), else eager (1) (SPEC section 3).
  virtual int default_rank() const { return 0; }
  // The backend that replaces it for the decode steps of GPU generation (SPEC section 4); "" keeps it.
  virtual std::string_view decode_backend() const { return {}; }
  // Whether its run() honours ExpertsCall::routing on CUDA (writes top_k_index / top_k_weights from the router
  // logits before or while using them). Calls with routing to a backend that says no are refused.
  virtual bool routes_calls() const { return false; }
  // Bytes of device memory one forward of `tokens` tokens moves in its own plan (the weights of the
  // `experts_touched` experts hit, the activations, and each intermediate it writes and reads back), so that
  // `moekit bench` can show the IO of each backend beside its time; 0 when it does not say.
  virtual double bytes_moved(const ExpertsSpec& /*spec*/, int64_t /*tokens*/, int64_t /*top_k*/,
                             double /*experts_touched*/, DType /*dtype*/) const {
    return 0;
  }

  // ---- per module and call ----
  // Whether it runs on this device in this build and on this machine at all (reason: why not, and what to
  // use instead).
  virtual Support available(Device device) const = 0;
  // Whether it can run these experts with activations of `act_dtype` (device included).
  virtual Support supports(const Experts& experts, DType act_dtype) const = 0;
  // One-time work per Experts module (layout repacks, scale conversion), called by Experts before the first
  // run of this backend on that module; what it builds lives in Experts::state.
  virtual void prepare(const Experts&) const {}
  // The forward. `call` was validated, supports() said yes and prepare() ran; call.out must be fully written.
  virtual void run(const Experts& experts, const ExpertsCall& call) const = 0;
};

using BackendPtr = std::shared_ptr<const ExpertsBackend>;

class ExpertsInterface {
 public:
  // The process-wide registry, built-ins first in a fixed order.
  static ExpertsInterface& global();

  // Adds a backend under backend->name(). A taken name throws unless `replace`; built-ins can't be replaced.
  void register_backend(BackendPtr backend, bool replace = false);
  // Adds a function as a backend.
  using ForwardFn = std::function<void(const Experts&, const ExpertsCall&)>;
  void register_backend(const std::string& name, ForwardFn fn,
                        std::vector<DeviceType> devices = {DeviceType::cpu},
                        const std::string& description = "user backend", bool replace = false);
  // Removes a user backend; returns false when absent. Built-ins cannot be removed (throws).
  bool unregister_backend(std::string_view name);

  bool contains(std::string_view name) const;
  // Throws Error(not_found) listing the valid names.
  BackendPtr get(std::string_view name) const;
  std::vector<std::string> names() const;
  std::vector<BackendPtr> backends() const;
  bool is_builtin(std::string_view name) const;

 private:
  ExpertsInterface();
  mutable std::mutex mutex_;
  std::vector<BackendPtr> backends_;
  size_t n_builtin_ = 0;
};

// The default backend (SPEC section 3): the built-in of highest default_rank() that supports these experts
// (grouped_mm where it can run, else eager).
std::string default_experts_implementation(const Experts& experts, DType act_dtype);
// The same for a device, before any experts exist: the highest-ranked built-in available there.
std::string default_experts_implementation(Device device);

// Throws Error(not_supported) when `what` cannot switch from backend `from` to backend `to` at run time
// (either is load_time_only() and they differ). "" as `from` (nothing chosen yet) always may.
void check_runtime_switch(std::string_view from, std::string_view to, std::string_view what);

}  // namespace moekit

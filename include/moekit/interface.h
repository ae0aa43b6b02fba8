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

class ExpertsBackend {
 public:
  virtual ~ExpertsBackend() = default;
  virtual std::string_view name() const = 0;
  virtual std::string_view description() const = 0;
  // Whether the backend runs on this device in this build and on this machine at all.
  virtual Support available(Device device) const = 0;
  // Whether it can run these experts with activations of `act_dtype` (device included).
  virtual Support supports(const Experts& experts, DType act_dtype) const = 0;
  // Whether a forward can be captured in a CUDA graph (no host synchronisation, no allocation).
  virtual bool graph_capturable() const { return false; }
  // One-time work before the first run (repacking, workspaces). Called by Experts before run.
  virtual void prepare(const Experts&) const {}
  // The forward. `call` was validated; call.out must be fully written.
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

// The default backend for experts on a device: grouped_mm where it can run, else eager.
std::string default_experts_implementation(const Experts& experts, DType act_dtype);

}  // namespace moekit

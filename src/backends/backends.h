// Internal: what the backend classes (src/backends/<name>.cpp) are built from: the CPU implementations, the
// CUDA entry points (src/backends/cuda/, or cuda_stub.cpp in builds without CUDA), and the base class of the
// backends that run on both devices. Each backend's file defines `BackendPtr make_<name>_backend()`; the
// registry (registry.cpp) lists them; nothing else names a backend.
#pragma once
#include <string>
#include <string_view>

#include "moekit/interface.h"

namespace moekit {

// CPU implementations (src/backends/cpu/).
namespace cpu {
Support supports(const Experts& experts, DType act_dtype);  // f32 | bf16 | f16 weights and activations
void eager(const Experts& experts, const ExpertsCall& call);
void batched_mm(const Experts& experts, const ExpertsCall& call);
void grouped_mm(const Experts& experts, const ExpertsCall& call);
}  // namespace cpu

// CUDA: one helper validates a call and builds its CallContext (dispatch.cpp); each backend passes its own
// kernel path. `backend` is the calling backend's name, for messages only.
namespace cuda {
struct CallContext;  // backends/cuda/state.h
using KernelPath = void (*)(const CallContext&);

// A backend's own condition on the device's compute capability `arch` (major * 10 + minor): "" when met.
using ArchCheck = std::string (*)(int arch);
// Whether this build's CUDA kernels run on `device` (build, device present, compute capability, and
// `arch_check` where given).
Support available(std::string_view backend, Device device, ArchCheck arch_check = nullptr);
// A backend's own conditions on top of the common ones: "" when it serves these experts on a device of
// compute capability `arch` (major * 10 + minor), else why not.
using ExtraCheck = std::string (*)(const Experts& experts, DType act_dtype, int arch);
// Whether they run these experts (weights, activation dtype, gate, sizes), and `extra` where given.
Support supports(std::string_view backend, const Experts& experts, DType act_dtype, ExtraCheck extra = nullptr);
// One-time work per module: transposed weights ([E, in, out]) repacked to [E, out, in], kept in the
// module's CUDA state, so every kernel reads rows of `in`.
void prepare(const Experts& experts);
// Checks the call, builds its CallContext over the module's CUDA state and runs `path` on it.
void run(std::string_view backend, const Experts& experts, const ExpertsCall& call, KernelPath path);

// The kernel paths (cuda/eager.cpp, batched_mm.cpp, grouped_mm.cpp). Each enqueues the whole forward.
void run_eager(const CallContext& c);
void run_batched_mm(const CallContext& c);
void run_grouped_mm(const CallContext& c);
void run_deepgemm(const CallContext& c);
// deepgemm's conditions: on the device (compute capability 9.0 with this build's sm_90a code), and on the
// experts (bf16 / f16, sizes multiples of 8).
std::string deepgemm_arch_reason(int arch);
std::string deepgemm_unsupported_reason(const Experts& experts, DType act_dtype, int arch);
void run_sonicmoe(const CallContext& c);
// sonicmoe's conditions: on the device (as deepgemm's) and on the experts (sonicmoe_experts_reason, bf16 / f16
// activations, sizes multiples of 8).
std::string sonicmoe_arch_reason(int arch);
std::string sonicmoe_unsupported_reason(const Experts& experts, DType act_dtype, int arch);
}  // namespace cuda

// sonicmoe's conditions on the experts alone, on every build (src/backends/sonicmoe.cpp): gated, built-in gate,
// bf16 / f16 weights; "" when met, else what is missing and which backend to use.
std::string sonicmoe_experts_reason(const ExpertsSpec& spec, DType weight_dtype);

// A backend's CUDA kernel path (as passed to cuda::run) or condition (cuda::available, cuda::supports): the
// function in CUDA builds, null without CUDA (where those refuse before using it), so neither needs a stub.
#ifdef MOEKIT_WITH_CUDA
#define MOEKIT_CUDA_PATH(fn) (&::moekit::cuda::fn)
#define MOEKIT_CUDA_CHECK(fn) (&::moekit::cuda::fn)
#else
#define MOEKIT_CUDA_PATH(fn) (::moekit::cuda::KernelPath{nullptr})
#define MOEKIT_CUDA_CHECK(fn) nullptr
#endif

// Device-memory bytes of a routed forward on the grouped plans (ExpertsBackend::bytes_moved): the weights of
// the experts hit read once, each pair's hidden-state row read, the [P, I] intermediate written and read, the
// down projection's [P, H] rows written and read back by the combine (`down_row_bytes` per element: 4 for
// f32 rows, 2 for 16-bit), the output written; `gathered_copy`: the [P, H] permuted copy of the hidden
// states written and read once more. P = tokens * top_k; biases and routing buffers left out (small).
inline double routed_bytes(const ExpertsSpec& s, int64_t tokens, int64_t top_k, double experts_touched, DType dtype,
                           bool gathered_copy, int down_row_bytes) {
  const double b = double(dtype_bits(dtype)) / 8, P = double(tokens) * double(top_k), H = double(s.hidden),
               I = double(s.intermediate);
  const double weights = experts_touched * ((s.has_gate ? 2 : 1) * I * H + H * I) * b;
  return weights + P * H * b * (gathered_copy ? 3 : 1) + 2 * P * I * b + 2 * P * H * down_row_bytes +
         double(tokens) * H * b;
}

// Base of the backends with a CPU and a CUDA implementation (eager, batched_mm, grouped_mm): availability,
// support and preparation per device. A derived class adds its identity, its properties and run().
class CpuCudaBackend : public ExpertsBackend {
 public:
  std::vector<DeviceType> devices() const override { return {DeviceType::cpu, DeviceType::cuda}; }
  std::string_view requirements() const override {
    return "CUDA: compute capability 8.0 or newer, activations in the weights' dtype, built-in gates";
  }
  Support available(Device device) const override {
    return device.is_cpu() ? Support::yes() : cuda::available(name(), device);
  }
  Support supports(const Experts& experts, DType act_dtype) const override {
    return experts.device().is_cpu() ? cpu::supports(experts, act_dtype)
                                     : cuda::supports(name(), experts, act_dtype);
  }
  void prepare(const Experts& experts) const override {
    if (experts.device().is_cuda()) cuda::prepare(experts);
  }
  bool routes_calls() const override { return true; }  // cuda::run routes first where the path does not
};

// Base of a backend that is registered (its name is known, and selecting it explains itself) but runs nothing
// in this build: no devices, no dtypes, not capturable, the same reason on every device.
class NotInThisBuildBackend : public ExpertsBackend {
 public:
  std::vector<DeviceType> devices() const override { return {}; }
  std::vector<DType> weight_dtypes() const override { return {}; }
  std::string_view requirements() const override { return reason(); }
  Support available(Device) const override { return Support::no(std::string(reason())); }
  Support supports(const Experts&, DType) const override { return Support::no(std::string(reason())); }
  void run(const Experts&, const ExpertsCall&) const override { MOEKIT_FAIL(not_supported, reason()); }

 protected:
  // Why it does not run, what it needs, and what to use instead.
  virtual std::string_view reason() const = 0;
};

}  // namespace moekit

// The CUDA side of the built-in backends (contract in src/backends/backends.h): availability, support,
// and the forward, which validates the call and hands a CallContext to eager / batched_mm / grouped_mm.
#include <string>

#include "backends/backends.h"
#include "backends/cuda/state.h"
#include "moekit/cuda_graph.h"

namespace moekit::cuda {
namespace {

constexpr int kMinArch = 80;  // this build's kernels: sm_80 (mma.sync, cp.async) and sm_90a

bool is_portable(std::string_view b) { return b == "eager" || b == "batched_mm" || b == "grouped_mm"; }

Support no(std::string_view backend, const std::string& why) {
  return Support::no("experts implementation '" + std::string(backend) + "' on CUDA: " + why);
}

kernels::Elem to_elem(DType t) {
  switch (t) {
    case DType::f32: return kernels::Elem::f32;
    case DType::bf16: return kernels::Elem::bf16;
    case DType::f16: return kernels::Elem::f16;
    default: MOEKIT_FAIL(internal, "no CUDA element type for ", dtype_name(t));
  }
}


}  // namespace

Support available(std::string_view backend, Device device) {
  if (!is_portable(backend))
    return no(backend, "not in this build; use grouped_mm (or batched_mm for decode)");
  if (!device.is_cuda()) return no(backend, "needs a CUDA device, got " + device.to_string());
  const int count = cuda_device_count();
  if (count == 0) return no(backend, "no CUDA device is present (or the driver cannot be loaded); use the CPU");
  if (device.index >= count)
    return no(backend, device.to_string() + " is not present (" + std::to_string(count) + " CUDA devices)");
  const DeviceInfo& info = device_info(device.index);
  if (info.arch() < kMinArch)
    return no(backend, info.to_string() + " is older than compute capability 8.0, which this build's kernels need");
  return Support{true, info.to_string()};
}

Support supports(std::string_view backend, const Experts& experts, DType act_dtype) {
  const Support avail = available(backend, experts.device());
  if (!avail) return avail;
  const ExpertsSpec& s = experts.spec();
  const DType wt = experts.weight_dtype();
  if (wt != DType::f32 && wt != DType::bf16 && wt != DType::f16)
    return no(backend, std::string("takes f32, bf16 or f16 weights, got ") + dtype_name(wt) +
                           " (quantized experts on CUDA are not in this build; dequantize them at load)");
  if (act_dtype != wt)
    return no(backend, std::string("activations must have the weights' dtype (") + dtype_name(wt) + "), got " +
                           dtype_name(act_dtype) + "; convert the hidden states or the weights");
  for (const Tensor* b : {&experts.weights().first_bias(), &experts.weights().down_proj_bias})
    if (b->defined() && b->dtype() != wt)
      return no(backend, std::string("biases must have the weights' dtype (") + dtype_name(wt) + "), got " +
                             dtype_name(b->dtype()));
  if (s.gate == GateKind::custom)
    return no(backend, "a custom gate function runs only on the CPU backends; move the experts to the CPU");
  if (kernel_activation(s.activation) < 0 && !(s.has_gate && s.gate == GateKind::clamped_swiglu))
    return no(backend, std::string("activation '") + activation_name(s.activation) +
                           "' is not in the CUDA kernels; move the experts to the CPU");
  if (s.num_experts > kernels::kRouteMaxExperts)
    return no(backend, "at most " + std::to_string(kernels::kRouteMaxExperts) + " experts per module, got " +
                           std::to_string(s.num_experts));
  if (s.hidden > (int64_t(1) << 30) || s.intermediate > (int64_t(1) << 30))
    return no(backend, "hidden and intermediate sizes must be below 2^30");
  return Support{true, avail.reason};
}

void run(std::string_view backend, const Experts& experts, const ExpertsCall& call) {
  const Support s = supports(backend, experts, call.hidden_states.dtype);
  MOEKIT_CHECK_CODE(s.ok, not_supported, s.reason);
  const ExpertsSpec& spec = experts.spec();
  const int64_t T = call.tokens(), K = call.top_k();
  MOEKIT_CHECK(T * K < (int64_t(1) << 31), "tokens x top_k = ", T * K, " is too large for one CUDA call (< 2^31)");
  if (T == 0) return;

  const int device = experts.device().index;
  DeviceGuard guard(device);
  auto stream = static_cast<cudaStream_t>(call.stream);
  CudaState& state = cuda_state(experts);
  std::lock_guard<std::mutex> lock(state.mutex);

  CallContext c(experts, call);
  c.stream = stream;
  c.device = &device_info(device);
  c.ws = &state.workspace(stream, device);
  c.type = to_elem(call.hidden_states.dtype);
  c.weight_type = to_elem(call.top_k_weights.dtype);
  c.index_type = call.top_k_index.dtype == DType::i64 ? kernels::Index::i64 : kernels::Index::i32;
  c.tokens = T;
  c.top_k = K;
  c.pairs = T * K;
  c.hidden = spec.hidden;
  c.inter = spec.intermediate;
  c.n1 = spec.has_gate ? 2 * spec.intermediate : spec.intermediate;
  c.experts_count = int(spec.num_experts);
  c.gate.kind = !spec.has_gate ? kernels::kGateActOnly
                : spec.gate == GateKind::clamped_swiglu ? kernels::kGateClampedSwiglu
                                                        : kernels::kGateActMul;
  c.gate.activation = kernel_activation(spec.activation);
  c.gate.concatenated = spec.is_concatenated ? 1 : 0;
  c.gate.alpha = spec.alpha;
  c.gate.limit = spec.limit;
  c.first_epilogue = spec.has_gate ? kernels::kEpiGated : kernels::kEpiActOnly;
  c.transposed = spec.is_transposed;

  const ExpertsWeights& w = experts.weights();
  const int64_t H = c.hidden, I = c.inter, N1 = c.n1;
  c.w1 = w.first().data();
  c.w1_expert = N1 * H;
  c.w1_n = spec.is_transposed ? 1 : H;  // [E, N1, H], or [E, H, N1] transposed
  c.w1_k = spec.is_transposed ? N1 : 1;
  c.b1 = w.first_bias().defined() ? w.first_bias().data() : nullptr;
  c.w2 = w.down_proj.data();
  c.w2_expert = H * I;
  c.w2_n = spec.is_transposed ? 1 : I;  // [E, H, I], or [E, I, H] transposed
  c.w2_k = spec.is_transposed ? H : 1;
  c.b2 = w.down_proj_bias.defined() ? w.down_proj_bias.data() : nullptr;

  if (backend == "eager") run_eager(c);
  else if (backend == "batched_mm") run_batched_mm(c);
  else run_grouped_mm(c);
}

}  // namespace moekit::cuda

namespace moekit {

void check_experts_errors(const Experts& experts, Stream stream) {
  if (!experts.device().is_cuda()) return;
  cuda::DeviceGuard guard(experts.device().index);
  cuda::CudaState& state = cuda::cuda_state(experts);
  std::lock_guard<std::mutex> lock(state.mutex);
  auto s = static_cast<cudaStream_t>(stream);
  cuda::StreamWorkspace* ws = state.find(s);
  if (!ws) return;  // no forward on this stream yet
  cuda::check_and_clear_error(*ws, s, experts.spec().num_experts);
}

}  // namespace moekit

// The CUDA helper under the backend classes (contract in src/backends/backends.h): whether this build's
// kernels run on a device and these experts, the one-time repack of transposed weights, and the call:
// checked, described in a CallContext over the module's CUDA state, then handed to the calling backend's
// kernel path. No backend is named here.
#include <string>
#include <tuple>

#include "backends/backends.h"
#include "backends/cuda/kernels/quant_fp4.h"
#include "backends/cuda/state.h"
#include "moekit/cuda_graph.h"
#include "moekit/quant.h"

namespace moekit::cuda {
namespace {

constexpr int kMinArch = 80;  // this build's kernels: sm_80 (mma.sync, cp.async) and sm_90a

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

// What every CUDA kernel path needs of the spec, whatever the weights' dtype: a gate and activation the kernels
// have, the routing's expert limit, sizes that fit the kernels' 32-bit offsets.
Support kernel_limits(std::string_view backend, const ExpertsSpec& s) {
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
  return Support{true, ""};
}

// The backends with an FP8 and FP4 path (quantized_fp8.cpp); the others refuse quantized experts.
bool has_quantized_path(std::string_view backend) {
  return backend == "grouped_mm" || backend == "batched_mm" || backend == "deepgemm";
}

// What the FP4 kernels need of the weights: e2m1 [E, out, in] with `in` a multiple of 32 and ue8m0 scales
// [E, out, in / 32] beside them (make_experts_weights checks the rest). Empty when they serve them, else the reason
// naming the tensor.
std::string fp4_weights_problem(const ExpertsWeights& w) {
  const bool gated = w.gate_up_proj.defined();
  const char* first = gated ? "gate_up_proj" : "up_proj";
  for (const auto& [t, sc, name] : {std::tuple{&w.first(), &w.first_scale_inv(), first},
                                    std::tuple{&w.down_proj, &w.down_proj_scale_inv, "down_proj"}}) {
    if (t->dtype() != DType::f4e2m1 || t->dim() != 3)
      return std::string("FP4 experts need f4e2m1 [E, out, in] weights; '") + name + "' is " + t->view().to_string();
    if (t->size(2) % kFp4Group)
      return std::string("'") + name + "' has " + std::to_string(t->size(2)) +
             " inputs per row; the FP4 kernels need a multiple of 32";
    if (!sc->defined() || sc->dtype() != DType::ue8m0 || sc->dim() != 3 || sc->size(0) != t->size(0) ||
        sc->size(1) != t->size(1) || sc->size(2) != t->size(2) / kFp4Group)
      return std::string("'") + name + "_scale_inv' must be ue8m0 [E, out, in / 32] (one power of two per row and 32 "
             "inputs), got " + (sc->defined() ? sc->view().to_string() : std::string("none"));
  }
  return "";
}

Support supports_quantized(std::string_view backend, const Experts& experts, DType act_dtype, ExtraCheck extra) {
  const ExpertsSpec& s = experts.spec();
  const DType wt = experts.weight_dtype();
  const ExpertsWeights& w = experts.weights();
  if (!w.is_quantized() || !has_quantized_path(backend))
    return no(backend, std::string("has no CUDA kernel for quantized ") + dtype_name(wt) +
                           " experts (FP8 block-scaled and FP4 experts run in grouped_mm, batched_mm and deepgemm); "
                           "run them on the CPU backends, or load the checkpoint with dequantize (moekit run "
                           "--dequantize) to run bf16 weights on the GPU");
  const char* fmt = w.is_fp8() ? "FP8" : "FP4";
  if (act_dtype != DType::f32 && act_dtype != DType::bf16 && act_dtype != DType::f16)
    return no(backend, std::string(fmt) + " experts take f32, bf16 or f16 activations, got " + dtype_name(act_dtype));
  for (const Tensor* b : {&w.first_bias(), &w.down_proj_bias})
    if (b->defined() && b->dtype() != act_dtype)
      return no(backend, std::string("the biases of ") + fmt + " experts must have the activations' dtype (" +
                             dtype_name(act_dtype) + "), got " + dtype_name(b->dtype()));
  if (w.is_fp4())
    if (const std::string why = fp4_weights_problem(w); !why.empty()) return no(backend, why);
  if (const Support k = kernel_limits(backend, s); !k) return k;
  const int device = experts.device().index;
  const int arch = device_info(device).arch();
  {
    DeviceGuard guard(device);
    if (w.is_fp8() && !kernels::grouped_gemm_fp8_built_for(arch))
      return no(backend, device_info(device).to_string() +
                             ": FP8 experts need the FP8 tensor cores (compute capability 8.9 or later) and this "
                             "build's code for them (CMAKE_CUDA_ARCHITECTURES 90a)");
    if (w.is_fp4() && !kernels::grouped_gemm_fp4_built_for(arch, w.fp4_float_activations))
      return no(backend, device_info(device).to_string() +
                             (w.fp4_float_activations
                                  ? ": MXFP4 experts need compute capability 8.0 or later"
                                  : ": FP4 experts with FP8 activations need the FP8 tensor cores (compute capability "
                                    "8.9 or later)") +
                             " and this build's code for them (CMAKE_CUDA_ARCHITECTURES 90a)");
  }
  if (extra) {
    const std::string why = extra(experts, act_dtype, arch);
    if (!why.empty()) return no(backend, why);
  }
  return Support{true, device_info(device).to_string()};
}

// FP8 experts staged on the device once per module (the caller holds state.mutex): f32 block scales, and the
// weights with rows padded to 16 bytes where K is not a multiple of 16.
void stage_fp8(const Experts& experts, CudaState& state) {
  if (state.fp8_ready) return;
  DeviceGuard guard(experts.device().index);
  const ExpertsWeights& w = experts.weights();
  auto f32_scales = [&](const Tensor& sc) {
    if (sc.dtype() == DType::f32) return Tensor::copy_of(sc.view(), experts.device());
    const Tensor h = sc.to(Device::cpu()).contiguous();
    Tensor f = Tensor::empty(h.shape(), DType::f32, Device::cpu());
    for (int64_t i = 0; i < h.numel(); ++i) f.ptr<float>()[i] = ue8m0_to_f32(h.ptr<uint8_t>()[i]);
    return f.to(experts.device());
  };
  auto padded = [&](const Tensor& q) {
    const int64_t K = q.size(-1);
    if (K % 16 == 0) return Tensor();
    const int64_t ld = (K + 15) / 16 * 16, rows = q.numel() / K;
    const Tensor h = q.to(Device::cpu()).contiguous();
    Tensor p = Tensor::zeros({q.size(0), q.size(1), ld}, DType::f8e4m3, Device::cpu());
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(h.ptr<uint8_t>() + r * K, K, p.ptr<uint8_t>() + r * ld);
    return p.to(experts.device());
  };
  state.s1 = f32_scales(w.first_scale_inv());
  state.s2 = f32_scales(w.down_proj_scale_inv);
  state.q1 = padded(w.first());
  state.q2 = padded(w.down_proj);
  state.fp8_ready = true;
}

// FP4 experts staged on the device once per module (the caller holds state.mutex): the scale codes with rows
// padded to whole 4-byte words (code 127, 1.0: the padding's weights are never read as nonzero) where K / 32 is not
// a multiple of 4, so that the tiled kernel reads each 128-input step's four codes as one word.
void stage_fp4(const Experts& experts, CudaState& state) {
  if (state.fp4_ready) return;
  DeviceGuard guard(experts.device().index);
  const ExpertsWeights& w = experts.weights();
  auto padded = [&](const Tensor& sc) {
    const int64_t G = sc.size(-1);
    if (G % 4 == 0) return Tensor();
    const int64_t ld = (G + 3) / 4 * 4, rows = sc.numel() / G;
    const Tensor h = sc.to(Device::cpu()).contiguous();
    Tensor p = Tensor::empty({sc.size(0), sc.size(1), ld}, DType::ue8m0, Device::cpu());
    std::fill_n(p.ptr<uint8_t>(), p.numel(), uint8_t(127));
    for (int64_t r = 0; r < rows; ++r) std::copy_n(h.ptr<uint8_t>() + r * G, G, p.ptr<uint8_t>() + r * ld);
    return p.to(experts.device());
  };
  state.e1 = padded(w.first_scale_inv());
  state.e2 = padded(w.down_proj_scale_inv);
  state.fp4_ready = true;
}

void stage_quantized(const Experts& experts, CudaState& state) {
  if (experts.weights().is_fp8()) stage_fp8(experts, state);
  else stage_fp4(experts, state);
}

}  // namespace

Support available(std::string_view backend, Device device, ArchCheck arch_check) {
  if (!device.is_cuda()) return no(backend, "needs a CUDA device, got " + device.to_string());
  const int count = cuda_device_count();
  if (count == 0) return no(backend, "no CUDA device is present (or the driver cannot be loaded); use the CPU");
  if (device.index >= count)
    return no(backend, device.to_string() + " is not present (" + std::to_string(count) + " CUDA devices)");
  const DeviceInfo& info = device_info(device.index);
  if (info.arch() < kMinArch)
    return no(backend, info.to_string() + " is older than compute capability 8.0, which this build's kernels need");
  if (arch_check) {
    DeviceGuard guard(device.index);
    const std::string why = arch_check(info.arch());
    if (!why.empty()) return no(backend, info.to_string() + ": " + why);
  }
  return Support{true, info.to_string()};
}

Support supports(std::string_view backend, const Experts& experts, DType act_dtype, ExtraCheck extra) {
  const Support avail = available(backend, experts.device());
  if (!avail) return avail;
  const ExpertsSpec& s = experts.spec();
  const DType wt = experts.weight_dtype();
  if (experts.is_quantized()) return supports_quantized(backend, experts, act_dtype, extra);
  if (wt != DType::f32 && wt != DType::bf16 && wt != DType::f16)
    return no(backend, std::string("takes f32, bf16 or f16 weights, got ") + dtype_name(wt));
  if (act_dtype != wt)
    return no(backend, std::string("activations must have the weights' dtype (") + dtype_name(wt) + "), got " +
                           dtype_name(act_dtype) + "; convert the hidden states or the weights");
  for (const Tensor* b : {&experts.weights().first_bias(), &experts.weights().down_proj_bias})
    if (b->defined() && b->dtype() != wt)
      return no(backend, std::string("biases must have the weights' dtype (") + dtype_name(wt) + "), got " +
                             dtype_name(b->dtype()));
  if (const Support k = kernel_limits(backend, s); !k) return k;
  if (extra) {
    const std::string why = extra(experts, act_dtype, device_info(experts.device().index).arch());
    if (!why.empty()) return no(backend, why);
  }
  return Support{true, avail.reason};
}

void prepare(const Experts& experts) {
  if (experts.weights().is_quantized()) {
    CudaState& state = cuda_state(experts);
    std::lock_guard<std::mutex> lock(state.mutex);
    stage_quantized(experts, state);
    return;
  }
  if (!experts.spec().is_transposed) return;
  CudaState& state = cuda_state(experts);
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.repacked) return;
  DeviceGuard guard(experts.device().index);
  // Staged through the host: once per module, before the first forward (never during graph capture:
  // ExpertsGraph runs one uncaptured forward first).
  state.w1 = transpose_expert_weight(experts.weights().first());  // [E, H, N1] -> [E, N1, H]
  state.w2 = transpose_expert_weight(experts.weights().down_proj);  // [E, I, H] -> [E, H, I]
  state.repacked = true;
}

int route_kind_code(RouterKind kind) {
  MOEKIT_CHECK_CODE(kind == RouterKind::softmax_topk || kind == RouterKind::topk_softmax, not_supported,
                    "experts routing inside the call supports the softmax_topk and topk_softmax routers");
  return kind == RouterKind::softmax_topk ? kRouteSoftmaxTopk : kRouteTopkSoftmax;
}

void route_first(const CallContext& c) {
  const ExpertsRouting& r = *c.call.routing;
  check_launch(kernels::route_logits(r.logits.ptr<float>(), c.tokens, c.experts_count, int(c.top_k),
                                     route_kind_code(r.kind), r.norm_topk_prob,
                                     static_cast<int32_t*>(c.call.top_k_index.data),
                                     static_cast<float*>(c.call.top_k_weights.data), c.stream),
               "route_logits (routing before the experts)");
}

void run(std::string_view backend, const Experts& experts, const ExpertsCall& call, KernelPath path) {
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

  // Transposed weights run from the [E, out, in] copy prepare() made; the kernels see one layout.
  const ExpertsWeights& w = experts.weights();
  MOEKIT_CHECK_CODE(!spec.is_transposed || state.repacked, internal,
                    "transposed CUDA experts were not prepared before their first run");
  const int64_t H = c.hidden, I = c.inter, N1 = c.n1;
  c.transposed = false;
  c.w1 = spec.is_transposed ? state.w1.data() : w.first().data();  // [E, N1, H]
  c.w1_expert = N1 * H;
  c.w1_n = H;
  c.w1_k = 1;
  c.b1 = w.first_bias().defined() ? w.first_bias().data() : nullptr;
  c.w2 = spec.is_transposed ? state.w2.data() : w.down_proj.data();  // [E, H, I]
  c.w2_expert = H * I;
  c.w2_n = I;
  c.w2_k = 1;
  c.b2 = w.down_proj_bias.defined() ? w.down_proj_bias.data() : nullptr;

  if (w.is_fp8()) {
    stage_fp8(experts, state);  // done by prepare() before the first forward; here for callers that skip it
    const bool gated = spec.has_gate;
    c.fp8 = true;
    c.fp8_pow2 = w.first_scale_inv().dtype() == DType::ue8m0;
    c.q1 = static_cast<const uint8_t*>(state.q1.defined() ? state.q1.data() : w.first().data());
    c.q2 = static_cast<const uint8_t*>(state.q2.defined() ? state.q2.data() : w.down_proj.data());
    c.q1_ld = (H + 15) / 16 * 16;
    c.q2_ld = (I + 15) / 16 * 16;
    c.s1 = state.s1.ptr<float>();
    c.s2 = state.s2.ptr<float>();
    c.s1_rows = state.s1.size(1);
    c.s2_rows = state.s2.size(1);
    c.seg1 = gated ? 2 : 1;
    MOEKIT_CHECK_CODE(c.s1_rows == c.seg1 * fp8_blocks(N1 / c.seg1) && c.s2_rows == fp8_blocks(H), internal,
                      "FP8 block scales of unexpected shape");
  } else if (w.is_fp4()) {
    stage_fp4(experts, state);  // done by prepare() before the first forward; here for callers that skip it
    c.fp8 = true;  // the quantized forward (run_fp8), over FP4 weights
    c.fp4 = true;
    c.fp4_float = w.fp4_float_activations;
    c.fp8_pow2 = true;  // ue8m0 weight scales: the activations' scales rounded up to powers of two
    c.q1 = static_cast<const uint8_t*>(w.first().data());
    c.q2 = static_cast<const uint8_t*>(w.down_proj.data());
    c.q1_ld = H / 2;
    c.q2_ld = I / 2;
    const Tensor& e1 = state.e1.defined() ? state.e1 : w.first_scale_inv();
    const Tensor& e2 = state.e2.defined() ? state.e2 : w.down_proj_scale_inv;
    c.e1 = static_cast<const uint8_t*>(e1.data());
    c.e2 = static_cast<const uint8_t*>(e2.data());
    c.e1_ld = e1.size(2);
    c.e2_ld = e2.size(2);
    MOEKIT_CHECK_CODE(c.e1_ld % 4 == 0 && c.e2_ld % 4 == 0 && e1.size(1) == N1 && e2.size(1) == H, internal,
                      "FP4 scales of unexpected shape");
  }

  // Routing inside the call: batched_mm decides for itself (its GEMVs route in their own launches); every other
  // path reads ids written first.
  if (call.routing && backend != "batched_mm") route_first(c);
  path(c);
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

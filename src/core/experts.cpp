#include "moekit/experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "moekit/interface.h"
#include "moekit/quant.h"

namespace moekit {

Activation parse_activation(std::string_view a) {
  if (a == "silu" || a == "swish") return Activation::silu;
  if (a == "gelu") return Activation::gelu;
  if (a == "gelu_pytorch_tanh" || a == "gelu_new" || a == "gelu_fast" || a == "gelu_tanh") return Activation::gelu_tanh;
  if (a == "relu") return Activation::relu;
  if (a == "relu2") return Activation::relu2;
  if (a == "sigmoid") return Activation::sigmoid;
  if (a == "identity" || a == "linear") return Activation::identity;
  MOEKIT_FAIL(invalid_argument, "unknown activation '", a,
              "'; expected silu, swish, gelu, gelu_pytorch_tanh, gelu_new, relu, relu2, sigmoid or identity");
}

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::silu: return "silu";
    case Activation::gelu: return "gelu";
    case Activation::gelu_tanh: return "gelu_pytorch_tanh";
    case Activation::relu: return "relu";
    case Activation::relu2: return "relu2";
    case Activation::sigmoid: return "sigmoid";
    case Activation::identity: return "identity";
  }
  return "?";
}

void ExpertsSpec::validate() const {
  MOEKIT_CHECK(num_experts > 0, "ExpertsSpec.num_experts must be > 0, got ", num_experts);
  MOEKIT_CHECK(hidden > 0, "ExpertsSpec.hidden must be > 0, got ", hidden);
  MOEKIT_CHECK(intermediate > 0, "ExpertsSpec.intermediate must be > 0, got ", intermediate);
  MOEKIT_CHECK(gate != GateKind::custom || static_cast<bool>(custom_gate),
               "ExpertsSpec.gate is custom but custom_gate is empty");
  MOEKIT_CHECK(has_gate || gate == GateKind::act_mul, "ExpertsSpec: a gate function needs has_gate = true");
}

std::string ExpertsSpec::to_string() const {
  std::ostringstream os;
  os << "ExpertsSpec{.num_experts=" << num_experts << ", .hidden=" << hidden << ", .intermediate=" << intermediate
     << ", .activation=" << activation_name(activation) << ", .has_gate=" << has_gate << ", .has_bias=" << has_bias
     << ", .is_transposed=" << is_transposed << ", .is_concatenated=" << is_concatenated << ", .gate="
     << (gate == GateKind::act_mul ? "act_mul" : gate == GateKind::clamped_swiglu ? "clamped_swiglu" : "custom");
  if (gate == GateKind::clamped_swiglu) os << ", .alpha=" << alpha << ", .limit=" << limit;
  os << "}";
  return os.str();
}

namespace {
void check_param(const char* name, const Tensor& t, const Shape& expect, bool required) {
  if (!t.defined()) {
    MOEKIT_CHECK(!required, "experts weight '", name, "' is missing; expected shape ", shape_to_string(expect));
    return;
  }
  MOEKIT_CHECK(required, "experts weight '", name, "' given but not used by this spec (check has_gate / has_bias)");
  MOEKIT_CHECK(t.shape() == expect, "experts weight '", name, "' has shape ", shape_to_string(t.shape()),
               ", expected ", shape_to_string(expect));
  MOEKIT_CHECK(t.view().is_contiguous(), "experts weight '", name, "' must be contiguous");
  MOEKIT_CHECK(is_floating(t.dtype()), "experts weight '", name, "' has dtype ", dtype_name(t.dtype()),
               ", expected a floating type");
}

void validate_weights(const ExpertsSpec& s, const ExpertsWeights& w) {
  const int64_t E = s.num_experts, H = s.hidden, I = s.intermediate;
  const Shape gu = s.is_transposed ? Shape{E, H, 2 * I} : Shape{E, 2 * I, H};
  const Shape up = s.is_transposed ? Shape{E, H, I} : Shape{E, I, H};
  const Shape down = s.is_transposed ? Shape{E, I, H} : Shape{E, H, I};
  check_param("gate_up_proj", w.gate_up_proj, gu, s.has_gate);
  check_param("up_proj", w.up_proj, up, !s.has_gate);
  check_param("down_proj", w.down_proj, down, true);
  check_param("gate_up_proj_bias", w.gate_up_proj_bias, {E, 2 * I}, s.has_gate && s.has_bias);
  check_param("up_proj_bias", w.up_proj_bias, {E, I}, !s.has_gate && s.has_bias);
  check_param("down_proj_bias", w.down_proj_bias, {E, H}, s.has_bias);
  const Tensor& first = w.first();
  for (const Tensor* t : {&w.down_proj, &w.first_bias(), &w.down_proj_bias}) {
    if (!t->defined()) continue;
    MOEKIT_CHECK(t->device() == first.device(), "experts weights on different devices: ", first.device().to_string(),
                 " and ", t->device().to_string());
  }
  MOEKIT_CHECK(w.down_proj.dtype() == first.dtype(), "experts weights have different dtypes: ",
               dtype_name(first.dtype()), " and ", dtype_name(w.down_proj.dtype()));
  const char* first_name = s.has_gate ? "gate_up_proj" : "up_proj";
  MOEKIT_CHECK(!w.fp4_float_activations || w.is_fp4(), "ExpertsWeights.fp4_float_activations is set but the weights are ",
               dtype_name(first.dtype()), ", not FP4 (f4e2m1)");
  if (w.is_fp4()) {
    // FP4: [E, out, in] e2m1 with one ue8m0 scale per row and 32 inputs.
    MOEKIT_CHECK(!s.is_transposed, "FP4 experts are stored [E, out, in]; is_transposed = true is not an FP4 layout");
    auto check = [&](const char* name, const Tensor& q, const Tensor& sc, int64_t n, int64_t k) {
      MOEKIT_CHECK(k % kFp4Group == 0, "FP4 experts need inputs in multiples of 32; '", name, "' has ", k);
      const Shape expect{E, n, k / kFp4Group};
      MOEKIT_CHECK(sc.defined(), "experts weight '", name, "' is missing: FP4 weights need their ue8m0 scales, shape ",
                   shape_to_string(expect));
      MOEKIT_CHECK(sc.shape() == expect && sc.dtype() == DType::ue8m0, "experts weight '", name, "' is ",
                   sc.view().to_string(), ", expected ue8m0 ", shape_to_string(expect), " (one per row and 32 inputs)");
      MOEKIT_CHECK(sc.view().is_contiguous() && sc.device() == q.device(), "experts weight '", name,
                   "' must be contiguous and on ", q.device().to_string());
      if (!sc.device().is_cpu()) return;
      const uint8_t* p = sc.ptr<uint8_t>();
      for (int64_t i = 0; i < sc.numel(); ++i)
        MOEKIT_CHECK(p[i] != 0xff, "experts weight '", name, "' holds the ue8m0 NaN (0xff) at flat index ", i);
    };
    check(s.has_gate ? "gate_up_proj_scale_inv" : "up_proj_scale_inv", first, w.first_scale_inv(),
          s.has_gate ? 2 * I : I, H);
    check("down_proj_scale_inv", w.down_proj, w.down_proj_scale_inv, H, I);
    MOEKIT_CHECK(!(s.has_gate ? w.up_proj_scale_inv : w.gate_up_proj_scale_inv).defined(), "experts weight '",
                 s.has_gate ? "up_proj_scale_inv" : "gate_up_proj_scale_inv", "' given but not used by this spec (",
                 first_name, " is the first projection)");
    return;
  }
  if (!w.is_fp8()) {
    for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"gate_up_proj_scale_inv", &w.gate_up_proj_scale_inv},
                                  {"up_proj_scale_inv", &w.up_proj_scale_inv},
                                  {"down_proj_scale_inv", &w.down_proj_scale_inv}})
      MOEKIT_CHECK(!t->defined(), "experts weight '", name, "' given but the weights are ", dtype_name(first.dtype()),
                   ", not FP8 (f8e4m3)");
    return;
  }
  // FP8: [E, out, in] e4m3 with 128 x 128 block scales; the fused gate_up halves have their own blocks.
  MOEKIT_CHECK(!s.is_transposed, "FP8 experts are stored [E, out, in]; is_transposed = true is not an FP8 layout");
  MOEKIT_CHECK(!s.has_gate || s.is_concatenated,
               "FP8 experts need a concatenated gate_up_proj ([gate | up]); interleaved is not an FP8 layout");
  const int64_t n1 = s.has_gate ? 2 * I : I, seg1 = s.has_gate ? 2 : 1;
  auto check_scale = [&](const char* name, const Tensor& q, const Tensor& sc, int64_t n, int64_t k, int64_t segs) {
    MOEKIT_CHECK(sc.defined(), "experts weight '", name, "' is missing: FP8 weights need their block scales, shape ",
                 shape_to_string({E, segs * fp8_blocks(n / segs), fp8_blocks(k)}));
    const Shape expect{E, segs * fp8_blocks(n / segs), fp8_blocks(k)};
    MOEKIT_CHECK(sc.shape() == expect, "experts weight '", name, "' has shape ", shape_to_string(sc.shape()),
                 ", expected ", shape_to_string(expect), " (128 x 128 blocks)");
    MOEKIT_CHECK(sc.dtype() == DType::f32 || sc.dtype() == DType::ue8m0, "experts weight '", name,
                 "' must be f32 or ue8m0, got ", dtype_name(sc.dtype()));
    MOEKIT_CHECK(sc.view().is_contiguous() && sc.device() == q.device(), "experts weight '", name,
                 "' must be contiguous and on ", q.device().to_string());
    if (!sc.device().is_cpu()) return;
    const int64_t count = sc.numel();
    for (int64_t i = 0; i < count; ++i) {
      const float v = sc.dtype() == DType::ue8m0 ? ue8m0_to_f32(sc.ptr<uint8_t>()[i]) : sc.ptr<float>()[i];
      MOEKIT_CHECK(std::isfinite(v) && v >= 0.0f, "experts weight '", name, "' has a scale ", v, " at flat index ", i,
                   "; block scales must be finite and >= 0");
    }
    // e4m3fn's NaN (0x7f / 0xff) is no weight value.
    const uint8_t* p = q.ptr<uint8_t>();
    const int64_t nq = q.numel();
    for (int64_t i = 0; i < nq; ++i)
      MOEKIT_CHECK((p[i] & 0x7f) != 0x7f, "experts weight '", name, "' belongs to an FP8 weight holding NaN at flat index ",
                   i);
  };
  check_scale(s.has_gate ? "gate_up_proj_scale_inv" : "up_proj_scale_inv", first, w.first_scale_inv(), n1, H, seg1);
  check_scale("down_proj_scale_inv", w.down_proj, w.down_proj_scale_inv, H, I, 1);
  MOEKIT_CHECK(w.down_proj_scale_inv.dtype() == w.first_scale_inv().dtype(), "experts scales have different dtypes: ",
               dtype_name(w.first_scale_inv().dtype()), " and ", dtype_name(w.down_proj_scale_inv.dtype()));
  MOEKIT_CHECK(!(s.has_gate ? w.up_proj_scale_inv : w.gate_up_proj_scale_inv).defined(), "experts weight '",
               s.has_gate ? "up_proj_scale_inv" : "gate_up_proj_scale_inv", "' given but not used by this spec (",
               first_name, " is the first projection)");
}
}  // namespace

Experts::Experts(ExpertsSpec spec, ExpertsWeights weights, std::string implementation)
    : spec_(std::move(spec)), weights_(std::move(weights)) {
  spec_.validate();
  validate_weights(spec_, weights_);
  if (implementation.empty()) implementation = default_experts_implementation(*this, weight_dtype());
  ExpertsInterface::global().get(implementation);  // throws on an unknown name
  implementation_ = std::move(implementation);
}

Device Experts::device() const { return weights_.first().device(); }
DType Experts::weight_dtype() const { return weights_.first().dtype(); }

void Experts::set_implementation(const std::string& name) {
  ExpertsInterface::global().get(name);  // throws listing the valid names
  check_runtime_switch(implementation_, name, "experts implementation");
  implementation_ = name;
}

void Experts::clear_state() const {
  std::lock_guard<std::mutex> prepare_lock(*prepare_mutex_);
  std::lock_guard<std::mutex> lock(*state_mutex_);
  states_->clear();
  prepared_->clear();
}

void Experts::prepare_once(const std::shared_ptr<const ExpertsBackend>& backend) const {
  std::lock_guard<std::mutex> lock(*prepare_mutex_);
  if (std::find(prepared_->begin(), prepared_->end(), backend) != prepared_->end()) return;
  backend->prepare(*this);
  prepared_->push_back(backend);  // holds it, so a replaced user backend is never mistaken for this one
}

Experts Experts::to(Device device) const {
  ExpertsWeights w;
  auto mv = [&](const Tensor& t) { return t.defined() ? t.to(device) : Tensor(); };
  w.gate_up_proj = mv(weights_.gate_up_proj);
  w.up_proj = mv(weights_.up_proj);
  w.down_proj = mv(weights_.down_proj);
  w.gate_up_proj_bias = mv(weights_.gate_up_proj_bias);
  w.up_proj_bias = mv(weights_.up_proj_bias);
  w.down_proj_bias = mv(weights_.down_proj_bias);
  w.gate_up_proj_scale_inv = mv(weights_.gate_up_proj_scale_inv);
  w.up_proj_scale_inv = mv(weights_.up_proj_scale_inv);
  w.down_proj_scale_inv = mv(weights_.down_proj_scale_inv);
  w.fp4_float_activations = weights_.fp4_float_activations;
  Experts e(spec_, std::move(w), implementation_);
  return e;
}

void Experts::validate_call(const ExpertsCall& c) const {
  const Device dev = device();
  const auto& x = c.hidden_states;
  MOEKIT_CHECK(x.dim() == 2, "hidden_states must be 2-D [tokens, hidden], got shape ", shape_to_string(x.shape));
  MOEKIT_CHECK(x.shape[1] == spec_.hidden, "hidden_states has hidden size ", x.shape[1], ", experts expect ",
               spec_.hidden);
  MOEKIT_CHECK(x.dtype == DType::f32 || x.dtype == DType::bf16 || x.dtype == DType::f16,
               "hidden_states dtype must be f32, bf16 or f16, got ", dtype_name(x.dtype));
  const int64_t T = x.shape[0];
  const auto& idx = c.top_k_index;
  MOEKIT_CHECK(idx.dim() == 2 && idx.shape[0] == T, "top_k_index must be [", T, ", top_k], got shape ",
               shape_to_string(idx.shape));
  MOEKIT_CHECK(idx.dtype == DType::i32 || idx.dtype == DType::i64, "top_k_index dtype must be i32 or i64, got ",
               dtype_name(idx.dtype));
  MOEKIT_CHECK(idx.shape[1] >= 1 || T == 0, "top_k must be >= 1, got ", idx.shape[1]);
  const auto& w = c.top_k_weights;
  MOEKIT_CHECK(w.shape == idx.shape, "top_k_weights shape ", shape_to_string(w.shape), " must equal top_k_index shape ",
               shape_to_string(idx.shape));
  MOEKIT_CHECK(w.dtype == DType::f32 || w.dtype == DType::bf16 || w.dtype == DType::f16,
               "top_k_weights dtype must be f32, bf16 or f16, got ", dtype_name(w.dtype));
  MOEKIT_CHECK(c.out.shape == x.shape, "out shape ", shape_to_string(c.out.shape), " must equal hidden_states shape ",
               shape_to_string(x.shape));
  MOEKIT_CHECK(c.out.dtype == x.dtype, "out dtype ", dtype_name(c.out.dtype), " must equal hidden_states dtype ",
               dtype_name(x.dtype));
  for (const auto* v : {&x, &idx, &w, &c.out}) {
    MOEKIT_CHECK(v->device == dev, "experts live on ", dev.to_string(), " but an argument is on ",
                 v->device.to_string(), " (", v->to_string(), ")");
    MOEKIT_CHECK(v->is_contiguous(), "experts arguments must be contiguous; got strides ", shape_to_string(v->strides),
                 " for ", v->to_string(), " (make a contiguous copy first)");
  }
  if (c.routing) {
    const ExpertsRouting& r = *c.routing;
    const int64_t E = spec_.num_experts, K = idx.shape[1];
    MOEKIT_CHECK_CODE(dev.is_cuda(), not_supported, "experts routing inside the call runs on CUDA devices; these "
                      "experts live on ", dev.to_string(), " (route first and pass top_k_index / top_k_weights)");
    MOEKIT_CHECK_CODE(r.kind != RouterKind::grouped_sigmoid, not_supported,
                      "experts routing inside the call: the grouped sigmoid router (correction bias, groups) is not "
                      "supported; route first");
    MOEKIT_CHECK(r.logits.dim() == 2 && r.logits.shape[0] == T && r.logits.shape[1] == E &&
                     r.logits.dtype == DType::f32,
                 "routing logits must be [", T, ", ", E, "] f32, got ", r.logits.to_string());
    MOEKIT_CHECK(r.logits.device == dev && r.logits.is_contiguous(), "routing logits ", r.logits.to_string(),
                 " must be contiguous on ", dev.to_string());
    MOEKIT_CHECK(idx.dtype == DType::i32 && w.dtype == DType::f32, "with routing inside the call, top_k_index (",
                 dtype_name(idx.dtype), ") and top_k_weights (", dtype_name(w.dtype), ") are outputs of i32 and f32");
    MOEKIT_CHECK(K <= kRoutingMaxTopK && K <= E && E <= kRoutingMaxExperts, "experts routing inside the call: top_k ",
                 K, " of ", E, " experts; supported up to top_k ", kRoutingMaxTopK, " and ", kRoutingMaxExperts,
                 " experts");
  }
  if (dev.is_cpu()) {
    const int64_t n = idx.numel(), E = spec_.num_experts;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = idx.dtype == DType::i32 ? idx.ptr<int32_t>()[i] : idx.ptr<int64_t>()[i];
      MOEKIT_CHECK(e >= 0 && e <= E, "top_k_index[", i / idx.shape[1], ", ", i % idx.shape[1], "] = ", e,
                   " is out of range [0, ", E, "] (", E, " experts; id ", E, " marks an expert on another rank)");
    }
  }
}

void Experts::forward_with(std::string_view name, const ExpertsCall& call) const {
  validate_call(call);
  auto backend = ExpertsInterface::global().get(name);
  check_runtime_switch(implementation_, name, "experts implementation of this call");
  Support s = backend->supports(*this, call.hidden_states.dtype);
  MOEKIT_CHECK_CODE(s.ok, not_supported, "experts implementation '", name, "' cannot run these experts (",
                    dtype_name(weight_dtype()), " weights on ", device().to_string(), ", ",
                    dtype_name(call.hidden_states.dtype), " activations): ", s.reason);
  MOEKIT_CHECK_CODE(!call.routing || backend->routes_calls(), not_supported, "experts implementation '", name,
                    "' does not route inside the call; route first and pass top_k_index / top_k_weights");
  if (call.tokens() == 0) return;
  prepare_once(backend);
  backend->run(*this, call);
}

void Experts::forward_into(const ExpertsCall& call) const { forward_with(implementation_, call); }

Tensor Experts::forward(const TensorView& hidden_states, const TensorView& top_k_index,
                        const TensorView& top_k_weights, Stream stream) const {
  // Non-contiguous CPU inputs are copied once; on the GPU validate_call rejects them.
  auto dense = [](const TensorView& v) {
    return (v.is_contiguous() || !v.device.is_cpu()) ? Tensor::wrap(v, nullptr) : Tensor::copy_of(v, v.device);
  };
  Tensor x = dense(hidden_states), idx = dense(top_k_index), w = dense(top_k_weights);
  MOEKIT_CHECK(hidden_states.dim() == 2, "hidden_states must be 2-D [tokens, hidden], got shape ",
               shape_to_string(hidden_states.shape));
  Tensor out = Tensor::empty(hidden_states.shape, hidden_states.dtype, hidden_states.device);
  ExpertsCall call{x.view(), idx.view(), w.view(), out.view(), stream};
  forward_into(call);
  return out;
}

ExpertsWeights make_experts_weights(const ExpertsSpec& spec, const std::map<std::string, Tensor>& params) {
  ExpertsWeights w;
  for (const auto& [name, t] : params) {
    if (name == "gate_up_proj") w.gate_up_proj = t;
    else if (name == "up_proj") w.up_proj = t;
    else if (name == "down_proj") w.down_proj = t;
    else if (name == "gate_up_proj_bias") w.gate_up_proj_bias = t;
    else if (name == "up_proj_bias") w.up_proj_bias = t;
    else if (name == "down_proj_bias") w.down_proj_bias = t;
    else if (name == "gate_up_proj_scale_inv") w.gate_up_proj_scale_inv = t;
    else if (name == "up_proj_scale_inv") w.up_proj_scale_inv = t;
    else if (name == "down_proj_scale_inv") w.down_proj_scale_inv = t;
    else MOEKIT_FAIL(invalid_argument, "unknown experts parameter '", name,
                     "'; expected gate_up_proj, up_proj, down_proj, gate_up_proj_bias, up_proj_bias, down_proj_bias, "
                     "gate_up_proj_scale_inv, up_proj_scale_inv, down_proj_scale_inv");
  }
  validate_weights(spec, w);
  return w;
}

double experts_tolerance(DType act_dtype) {
  switch (act_dtype) {
    case DType::f32: return 1e-5;
    case DType::f16: return 5e-3;
    default: return 1e-2;  // bf16
  }
}

Tensor transpose_expert_weight(const Tensor& w) {
  MOEKIT_CHECK(w.defined() && w.dim() == 3, "transpose_expert_weight: expected a 3-D [E, A, B] tensor, got ",
               w.defined() ? shape_to_string(w.shape()) : std::string("none"));
  if (!w.device().is_cpu()) return transpose_expert_weight(w.to(Device::cpu())).to(w.device());
  const Tensor src = w.contiguous();
  const int64_t E = w.shape()[0], A = w.shape()[1], B = w.shape()[2];
  Tensor out = Tensor::empty({E, B, A}, w.dtype(), Device::cpu());
  const size_t es = dtype_nbytes(w.dtype(), 1);
  const char* in = static_cast<const char*>(src.data());
  char* o = static_cast<char*>(out.data());
  constexpr int64_t kBlock = 64;
#pragma omp parallel for collapse(2) schedule(static) if (E * A * B > (int64_t(1) << 20))
  for (int64_t e = 0; e < E; ++e)
    for (int64_t a0 = 0; a0 < A; a0 += kBlock)
      for (int64_t b0 = 0; b0 < B; b0 += kBlock)
        for (int64_t a = a0; a < std::min(A, a0 + kBlock); ++a)
          for (int64_t b = b0; b < std::min(B, b0 + kBlock); ++b)
            std::memcpy(o + size_t((e * B + b) * A + a) * es, in + size_t((e * A + a) * B + b) * es, es);
  return out;
}

ExpertsWeights dequantize_experts(const ExpertsSpec& spec, const ExpertsWeights& w, DType dtype) {
  if (!w.is_quantized()) return w;
  ExpertsWeights r = w;
  const Device dev = w.first().device();
  if (w.is_fp4()) {
    (spec.has_gate ? r.gate_up_proj : r.up_proj) = dequantize_fp4(w.first(), w.first_scale_inv(), dtype,
                                                                  spec.has_gate ? "gate_up_proj" : "up_proj").to(dev);
    r.down_proj = dequantize_fp4(w.down_proj, w.down_proj_scale_inv, dtype, "down_proj").to(dev);
    r.gate_up_proj_scale_inv = r.up_proj_scale_inv = r.down_proj_scale_inv = Tensor();
    r.fp4_float_activations = false;
    return r;
  }
  if (spec.has_gate)
    r.gate_up_proj = dequantize_fp8(w.gate_up_proj, w.gate_up_proj_scale_inv, dtype, 2, "gate_up_proj").to(dev);
  else
    r.up_proj = dequantize_fp8(w.up_proj, w.up_proj_scale_inv, dtype, 1, "up_proj").to(dev);
  r.down_proj = dequantize_fp8(w.down_proj, w.down_proj_scale_inv, dtype, 1, "down_proj").to(dev);
  r.gate_up_proj_scale_inv = r.up_proj_scale_inv = r.down_proj_scale_inv = Tensor();
  return r;
}

}  // namespace moekit

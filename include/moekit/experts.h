// moekit: the Experts module (SPEC section 1).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/tensor.h"

namespace moekit {

class ExpertsBackend;  // moekit/interface.h

enum class Activation : uint8_t { silu, gelu, gelu_tanh, relu, sigmoid, identity, relu2 };
// "silu"/"swish", "gelu", "gelu_pytorch_tanh"/"gelu_new"/"gelu_fast", "relu", "sigmoid", "identity"/"linear",
// "relu2" (squared ReLU, Nemotron-H)
Activation parse_activation(std::string_view hidden_act);
const char* activation_name(Activation a);

enum class GateKind : uint8_t {
  act_mul,         // act(gate) * up
  clamped_swiglu,  // gpt-oss: gate=min(gate,limit), up=clamp(up,-limit,limit), (up+1)*gate*sigmoid(alpha*gate)
  custom,          // ExpertsSpec::custom_gate (CPU backends only)
};

// A model-supplied gate: `gate` and `up` hold n values each; writes n outputs. f32.
using GateFunction = std::function<void(const float* gate, const float* up, float* out, int64_t n)>;

struct ExpertsSpec {
  int64_t num_experts = 0;   // E
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  Activation activation = Activation::silu;
  bool has_gate = true;
  bool has_bias = false;
  bool is_transposed = false;   // weights stored [in, out]
  bool is_concatenated = true;  // false: gate/up interleaved g0,u0,g1,u1,...
  GateKind gate = GateKind::act_mul;
  float alpha = 1.702f;  // clamped_swiglu
  float limit = 7.0f;    // clamped_swiglu
  GateFunction custom_gate;

  void validate() const;          // throws naming the bad field
  std::string to_string() const;  // reproduces the configuration
};

// Weights in the layouts of SPEC section 1 (all on one device, one floating dtype).
struct ExpertsWeights {
  Tensor gate_up_proj;       // has_gate: [E, 2I, H]  (is_transposed: [E, H, 2I])
  Tensor up_proj;            // !has_gate: [E, I, H]  (is_transposed: [E, H, I])
  Tensor down_proj;          // [E, H, I]             (is_transposed: [E, I, H])
  Tensor gate_up_proj_bias;  // [E, 2I]  (has_gate && has_bias)
  Tensor up_proj_bias;       // [E, I]   (!has_gate && has_bias)
  Tensor down_proj_bias;     // [E, H]   (has_bias)
  // FP8 experts (SPEC section 5; moekit/quant.h): the three weights above in f8e4m3, [E, out, in] (not
  // transposed), each with its 128 x 128 block scales, f32 or ue8m0, beside it. The fused gate_up_proj's gate
  // and up halves have their own blocks (as the per-expert gate_proj and up_proj they are made from):
  Tensor gate_up_proj_scale_inv;  // [E, 2 * ceil(I / 128), ceil(H / 128)]
  Tensor up_proj_scale_inv;       // [E, ceil(I / 128), ceil(H / 128)]
  Tensor down_proj_scale_inv;     // [E, ceil(H / 128), ceil(I / 128)]
  // FP4 experts (MXFP4, FP4 with UE8M0 scales): the weights in f4e2m1, [E, out, in] packed two per byte (low
  // nibble first; in a multiple of 32), each *_scale_inv in ue8m0 [E, out, in / 32] (one power of two per row and
  // 32 inputs). Activations are quantized to FP8 per token and 128 inputs (w4a8, FP4 checkpoints with UE8M0 scales)
  // unless fp4_float_activations (MXFP4 as transformers runs it where its kernels are absent: the weights
  // dequantized, the activations as they are).
  bool fp4_float_activations = false;

  const Tensor& first() const { return gate_up_proj.defined() ? gate_up_proj : up_proj; }
  const Tensor& first_bias() const { return gate_up_proj.defined() ? gate_up_proj_bias : up_proj_bias; }
  const Tensor& first_scale_inv() const { return gate_up_proj.defined() ? gate_up_proj_scale_inv : up_proj_scale_inv; }
  // Whether the weights are FP8 (block-scaled e4m3), FP4 (e2m1 with ue8m0 scales per 32), either.
  bool is_fp8() const { return first().defined() && first().dtype() == DType::f8e4m3; }
  bool is_fp4() const { return first().defined() && first().dtype() == DType::f4e2m1; }
  bool is_quantized() const { return is_fp8() || is_fp4(); }
};

enum class RouterKind : uint8_t {
  softmax_topk,     // softmax over experts, top-k, optional renormalisation (qwen, mixtral, olmoe)
  topk_softmax,     // top-k of the logits, then softmax over the k values (gpt-oss)
  grouped_sigmoid,  // DeepSeek-V3: sigmoid, correction bias, group-limited top-k, routed scaling factor
};

// A call that routes its tokens itself (ExpertsCall::routing; CUDA experts, softmax_topk and topk_softmax
// routers): the router's logits [T, E] f32 on the experts' device; top_k_index (i32) and top_k_weights (f32) are
// then outputs, the experts and weights moekit's model router picks from these logits (the same bits). batched_mm's
// per-pair GEMVs route inside their own launches (no routing launch before them); every other path routes first.
constexpr int64_t kRoutingMaxExperts = 1024, kRoutingMaxTopK = 32;
struct ExpertsRouting {
  TensorView logits;
  RouterKind kind = RouterKind::softmax_topk;
  bool norm_topk_prob = false;  // softmax_topk: renormalise the k weights to sum to one
};

// One forward call: every view already validated by Experts::forward_into.
struct ExpertsCall {
  TensorView hidden_states;  // [T, H] bf16 | f16 | f32
  TensorView top_k_index;    // [T, K] i32 | i64, ids in [0, E] (E = sentinel); an output with routing
  TensorView top_k_weights;  // [T, K] f32 | bf16 | f16; an output with routing
  TensorView out;            // [T, H] dtype of hidden_states
  Stream stream = nullptr;
  const ExpertsRouting* routing = nullptr;  // optional: route inside the call (above)
  int64_t tokens() const { return hidden_states.shape.empty() ? 0 : hidden_states.shape[0]; }
  int64_t top_k() const { return top_k_index.shape.size() < 2 ? 0 : top_k_index.shape[1]; }
};

// Per-backend cached state (repacked weights, workspaces, graphs) owned by an Experts module.
struct BackendState {
  virtual ~BackendState() = default;
};

class Experts {
 public:
  Experts() = default;
  // implementation "" picks the default: grouped_mm where it can run, else eager.
  Experts(ExpertsSpec spec, ExpertsWeights weights, std::string implementation = "");

  const ExpertsSpec& spec() const { return spec_; }
  const ExpertsWeights& weights() const { return weights_; }
  Device device() const;
  DType weight_dtype() const;  // f8e4m3 for FP8 experts, f4e2m1 for FP4
  bool is_quantized() const { return weights_.is_quantized(); }

  const std::string& implementation() const { return implementation_; }
  // Switches backend at run time (no weight reload). Unknown names throw with the valid list;
  // switching to or from a load-time-only backend (deepgemm_megamoe) throws.
  void set_implementation(const std::string& name);

  // out = experts(hidden_states, top_k_index, top_k_weights); T = 0 gives an empty [0, H] tensor.
  Tensor forward(const TensorView& hidden_states, const TensorView& top_k_index,
                 const TensorView& top_k_weights, Stream stream = nullptr) const;
  // Writes into call.out (preallocated): validates the call, looks the backend up in the registry, checks
  // that it supports these experts, prepares it once for this module, then runs it.
  void forward_into(const ExpertsCall& call) const;
  // Same, with an explicit backend name instead of implementation().
  void forward_with(std::string_view backend, const ExpertsCall& call) const;

  // A copy of these experts with weights on another device (state is not copied).
  Experts to(Device device) const;

  // Backend state: created on first use by `make`, kept for the life of the module.
  template <class S, class Make>
  S& state(std::string_view backend, Make&& make) const {
    std::lock_guard<std::mutex> lock(*state_mutex_);
    auto& slot = (*states_)[std::string(backend)];
    if (!slot) slot = make();
    return static_cast<S&>(*slot);
  }
  // Drops every backend state; backends are prepared again before their next run.
  void clear_state() const;

 private:
  void validate_call(const ExpertsCall& call) const;
  // Runs backend.prepare(*this) unless it already ran for this module.
  void prepare_once(const std::shared_ptr<const ExpertsBackend>& backend) const;

  ExpertsSpec spec_;
  ExpertsWeights weights_;
  std::string implementation_;
  std::shared_ptr<std::mutex> state_mutex_ = std::make_shared<std::mutex>();
  std::shared_ptr<std::map<std::string, std::unique_ptr<BackendState>>> states_ =
      std::make_shared<std::map<std::string, std::unique_ptr<BackendState>>>();
  std::shared_ptr<std::mutex> prepare_mutex_ = std::make_shared<std::mutex>();
  std::shared_ptr<std::vector<std::shared_ptr<const ExpertsBackend>>> prepared_ =
      std::make_shared<std::vector<std::shared_ptr<const ExpertsBackend>>>();
};

// Builds ExpertsWeights from the tensors of a transformers Experts module, by parameter name
// (gate_up_proj, down_proj, up_proj, *_bias, *_scale_inv), checking shapes against the spec.
ExpertsWeights make_experts_weights(const ExpertsSpec& spec, const std::map<std::string, Tensor>& params);

// The relative L2 error against the f64 reference that every backend meets, by activation dtype (SPEC
// section 1): 1e-5 for f32, 5e-3 for f16, 1e-2 for bf16. The tests, `moekit check` and the benchmarks'
// output check use this one table.
double experts_tolerance(DType act_dtype);

// A stacked expert weight [E, A, B] as [E, B, A] (same dtype, same device): the transposed layout
// ([E, in, out], gpt-oss) into the [E, out, in] one, or back. Used by the model loader and by the CUDA
// backends' prepare. Weights on a GPU are staged through host memory.
Tensor transpose_expert_weight(const Tensor& w);

// FP8 / FP4 experts' weights dequantized to `dtype` (f32, bf16 or f16; moekit/quant.h), scales dropped; other
// weights are returned as they are.
ExpertsWeights dequantize_experts(const ExpertsSpec& spec, const ExpertsWeights& w, DType dtype);

}  // namespace moekit

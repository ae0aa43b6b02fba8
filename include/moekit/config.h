// moekit: model configurations read from a Hugging Face checkpoint's config.json (SPEC section 6).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moekit/experts.h"

namespace moekit {

// Rotary position embedding parameters (config "rope_parameters", or the older rope_theta / rope_scaling).
struct RopeConfig {
  std::string type = "default";  // default | linear | yarn | llama3
  double theta = 10000.0;
  double factor = 1.0;
  double partial_rotary_factor = 1.0;
  // yarn
  std::optional<double> attention_factor;
  double beta_fast = 32.0, beta_slow = 1.0;
  std::optional<double> mscale, mscale_all_dim;
  int64_t original_max_position_embeddings = 0;
  bool truncate = true;
  // llama3
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
};

// RouterKind: moekit/experts.h (ExpertsRouting routes with it too).

enum class QkNorm : uint8_t {
  none,
  per_head,  // RMSNorm over each head's head_dim (qwen3)
  full,      // RMSNorm over the whole projection (olmoe)
};

// How a checkpoint names and lays out one MoE block's tensors.
struct MoeNaming {
  std::string block = "mlp";                                                          // layers.{i}.<block>
  std::string router = "gate";                                                        // <block>.<router>.weight
  std::string gate_proj = "gate_proj", up_proj = "up_proj", down_proj = "down_proj";  // per-expert names
  std::string shared = "";       // <block>.<shared>.{gate,up,down}_proj.weight ("" = none)
  std::string shared_gate = "";  // <block>.<shared_gate>.weight [1, H] ("" = none)
};

// The decoder that holds the MoE layers (the whole model, or a multimodal model's text_config).
struct TextConfig {
  std::string model_type;  // qwen2_moe, qwen3_moe, mixtral, olmoe, deepseek_v3, gpt_oss, qwen3_vl_moe_text
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // one expert
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t max_position_embeddings = 0;
  std::string hidden_act = "silu";
  double rms_norm_eps = 1e-6;
  bool norm_weight_before_cast = false;  // gpt-oss: (w * x).to(dtype); others: w * x.to(dtype)
  bool tie_word_embeddings = false;

  // attention
  bool qkv_bias = false;  // q, k, v projections
  bool o_bias = false;    // output projection
  QkNorm qk_norm = QkNorm::none;
  std::optional<double> clip_qkv;
  bool attention_sinks = false;
  std::vector<int64_t> sliding_window;  // [num_hidden_layers]; 0 = full attention
  RopeConfig rope;
  // multi-head latent attention (DeepSeek)
  bool mla = false;
  int64_t q_lora_rank = 0;  // 0: plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool rope_interleave = false;

  // MoE
  std::vector<bool> moe_layer;  // [num_hidden_layers]: MoE block, else a dense MLP
  RouterKind router = RouterKind::softmax_topk;
  bool norm_topk_prob = false;
  bool router_bias = false;
  double routed_scaling_factor = 1.0;
  int64_t n_group = 1, topk_group = 1;
  int64_t shared_expert_intermediate_size = 0;  // 0: no shared expert
  MoeNaming naming;
  ExpertsSpec experts;  // layout and gate of the routed experts as loaded

  // Softmax scale of attention (head_dim^-0.5, or DeepSeek's with the yarn mscale).
  double attention_scale() const;
};

// config.json's quantization_config, as written (SPEC section 5); Model::from_pretrained says which it loads.
struct QuantizationConfig {
  std::string quant_method;                // "fp8", "mxfp4", ...
  std::string fmt;                         // "e4m3"
  std::string activation_scheme;           // "dynamic" | "static"
  std::string scale_fmt;                   // "" (f32 scales) | "ue8m0"
  std::vector<int64_t> weight_block_size;  // [128, 128]
  std::string expert_dtype;                // the (text) config's "expert_dtype": "fp4" for FP4 routed experts
};

struct ModelConfig {
  std::string dir;                       // checkpoint folder
  std::string model_type;                // top-level model_type
  std::string text_config_key;           // "" when the decoder is the top level, else e.g. "text_config"
  std::vector<std::string> sub_configs;  // names of the sub-configs present (text_config, vision_config, ...)
  TextConfig text;
  std::optional<std::string> dtype;    // "float32", "bfloat16", ... as written in config.json
  std::vector<int64_t> eos_token_ids;  // generation_config.json, else config.json
  std::optional<int64_t> bos_token_id;
  bool has_quantization_config = false;
  std::optional<QuantizationConfig> quantization;  // set when has_quantization_config

  // Reads DIR/config.json (and DIR/generation_config.json when present). Throws Error naming the file
  // and the field that is missing or wrong, or the model_type that is not supported.
  static ModelConfig load(const std::string& dir);
  // Parses config.json text; `source` names it in errors. generation_config_json may be empty.
  static ModelConfig parse(const std::string& config_json, const std::string& source,
                           const std::string& generation_config_json = "");
};

// The model_type values moekit runs (top level, or in text_config for multimodal ones).
std::vector<std::string> supported_model_types();

}  // namespace moekit

// gpt-oss: biased, transposed, interleaved experts with the clamped SwiGLU; top-k then softmax routing;
// attention sinks; sliding window on sliding layers; yarn rope by default.
#include "model/arch.h"

namespace moekit::model {

void parse_gpt_oss(const ConfigReader& r, TextConfig& c) {
  parse_common(r, c, 150000.0);
  if (!r.has("rope_parameters") && !r.has("rope_scaling")) {
    // GptOssConfig's default rope_parameters.
    c.rope.type = "yarn";
    c.rope.factor = 32.0;
    c.rope.beta_fast = 32.0;
    c.rope.beta_slow = 1.0;
    c.rope.truncate = false;
    c.rope.original_max_position_embeddings = 4096;
  }
  c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-5);
  c.norm_weight_before_cast = true;
  c.intermediate_size = r.required_int("intermediate_size");
  c.moe_intermediate_size = c.intermediate_size;
  c.num_experts = r.required_int_any({"num_local_experts", "num_experts"});
  c.num_experts_per_tok = r.required_int("num_experts_per_tok");
  c.router = RouterKind::topk_softmax;
  c.router_bias = true;
  c.naming.router = "router";
  c.qkv_bias = c.o_bias = r.bool_or("attention_bias", true);
  c.attention_sinks = true;
  const int64_t window = r.int_or("sliding_window", 128);
  std::vector<std::string> fallback;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    fallback.push_back((i + 1) % 2 ? "sliding_attention" : "full_attention");
  const auto types = r.string_list_or("layer_types", fallback);
  if (int64_t(types.size()) != c.num_hidden_layers)
    r.fail("layer_types", "has " + std::to_string(types.size()) +
                              " entries, expected num_hidden_layers = " + std::to_string(c.num_hidden_layers));
  for (size_t i = 0; i < types.size(); ++i) c.sliding_window[i] = types[i] == "sliding_attention" ? window : 0;
  set_default_experts_spec(c);
  c.experts.has_bias = true;
  c.experts.is_transposed = true;
  c.experts.is_concatenated = false;
  c.experts.gate = GateKind::clamped_swiglu;
  c.experts.alpha = 1.702f;
  c.experts.limit = 7.0f;  // GptOssExperts hard-codes alpha and limit
}

}  // namespace moekit::model

// The Qwen MoE family: qwen2_moe (shared expert with a sigmoid gate, qkv bias), qwen3_moe (q/k norm per
// head), and the text decoder of qwen3_vl_moe (fused, transposed experts; routing always renormalised).
#include "model/arch.h"

namespace moekit::model {

namespace {
void parse_qwen_moe_fields(const ConfigReader& r, TextConfig& c) {
  c.intermediate_size = r.int_or("intermediate_size", 0);
  c.moe_intermediate_size = r.required_int("moe_intermediate_size");
  c.num_experts = r.required_int_any({"num_experts", "num_local_experts"});
  c.num_experts_per_tok = r.required_int("num_experts_per_tok");
  c.norm_topk_prob = r.bool_or("norm_topk_prob", false);
  c.router = RouterKind::softmax_topk;
  parse_sparse_layers(r, c);
  set_default_experts_spec(c);
}
}  // namespace

void parse_qwen2_moe(const ConfigReader& r, TextConfig& c) {
  parse_common(r, c, 10000.0);
  parse_qwen_moe_fields(r, c);
  c.qkv_bias = r.bool_or("qkv_bias", true);
  c.shared_expert_intermediate_size = r.int_or("shared_expert_intermediate_size", 0);
  if (c.shared_expert_intermediate_size > 0) {
    c.naming.shared = "shared_expert";
    c.naming.shared_gate = "shared_expert_gate";
  }
  // Sliding-window layers as Qwen2MoeConfig lays them out.
  const bool use_sliding = r.bool_or("use_sliding_window", false);
  const int64_t window = use_sliding ? r.int_or("sliding_window", 4096) : 0;  // Qwen2MoeConfig zeroes it
  const int64_t max_window_layers = r.int_or("max_window_layers", 28);
  std::vector<std::string> fallback;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    fallback.push_back(((i + 1) % 2) && i < max_window_layers && use_sliding ? "sliding_attention" : "full_attention");
  const auto types = r.string_list_or("layer_types", fallback);
  if (int64_t(types.size()) != c.num_hidden_layers)
    r.fail("layer_types", "has " + std::to_string(types.size()) +
                              " entries, expected num_hidden_layers = " + std::to_string(c.num_hidden_layers));
  for (size_t i = 0; i < types.size(); ++i) c.sliding_window[i] = types[i] == "sliding_attention" ? window : 0;
}

void parse_qwen3_moe(const ConfigReader& r, TextConfig& c) {
  parse_common(r, c, 10000.0);
  parse_qwen_moe_fields(r, c);
  c.qkv_bias = c.o_bias = r.bool_or("attention_bias", false);
  c.qk_norm = QkNorm::per_head;
  if (r.bool_or("use_sliding_window", false) && r.has("sliding_window"))
    c.sliding_window.assign(size_t(c.num_hidden_layers), r.required_int("sliding_window"));
}

void parse_qwen3_vl_moe_text(const ConfigReader& r, TextConfig& c) {
  parse_common(r, c, 10000.0);
  parse_qwen_moe_fields(r, c);
  c.norm_topk_prob = true;  // Qwen3VLMoeTextTopKRouter always renormalises
  c.qkv_bias = c.o_bias = r.bool_or("attention_bias", false);
  c.qk_norm = QkNorm::per_head;
}

}  // namespace moekit::model

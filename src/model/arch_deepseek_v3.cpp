// DeepSeek-V3: multi-head latent attention (q_lora / kv_lora, rope on the rope part of each head), sigmoid
// routing with a correction bias and group-limited top-k, routed scaling, shared experts, first dense layers.
#include "model/arch.h"

namespace moekit::model {

void parse_deepseek_v3(const ConfigReader& r, TextConfig& c) {
  parse_common(r, c, 10000.0);
  c.mla = true;
  c.q_lora_rank = r.int_or("q_lora_rank", 0);
  c.kv_lora_rank = r.required_int("kv_lora_rank");
  c.qk_nope_head_dim = r.required_int("qk_nope_head_dim");
  c.qk_rope_head_dim = r.required_int("qk_rope_head_dim");
  c.v_head_dim = r.required_int("v_head_dim");
  if (c.qk_rope_head_dim <= 0 || c.qk_rope_head_dim % 2)
    r.fail("qk_rope_head_dim", "must be even and > 0, got " + std::to_string(c.qk_rope_head_dim));
  c.head_dim = c.qk_rope_head_dim;  // DeepseekV3Config: the rotary embedding's dimension
  c.rope_interleave = r.bool_or("rope_interleave", true);
  c.qkv_bias = c.o_bias = r.bool_or("attention_bias", false);
  if (c.num_key_value_heads != c.num_attention_heads)
    r.fail("num_key_value_heads", "must equal num_attention_heads for multi-head latent attention, got " +
                                      std::to_string(c.num_key_value_heads));

  c.intermediate_size = r.required_int("intermediate_size");
  c.moe_intermediate_size = r.required_int("moe_intermediate_size");
  c.num_experts = r.required_int_any({"n_routed_experts", "num_local_experts"});
  c.num_experts_per_tok = r.required_int("num_experts_per_tok");
  c.router = RouterKind::grouped_sigmoid;
  c.norm_topk_prob = r.bool_or("norm_topk_prob", true);
  c.routed_scaling_factor = r.number_or("routed_scaling_factor", 2.5);
  c.n_group = r.int_or("n_group", 1);
  c.topk_group = r.int_or("topk_group", 1);
  if (c.n_group <= 0 || c.num_experts % c.n_group)
    r.fail("n_group", "must divide the number of experts (" + std::to_string(c.num_experts) + "), got " +
                          std::to_string(c.n_group));
  if (c.topk_group <= 0 || c.topk_group > c.n_group)
    r.fail("topk_group",
           "must be in [1, n_group = " + std::to_string(c.n_group) + "], got " + std::to_string(c.topk_group));
  const int64_t n_shared = r.int_or("n_shared_experts", 1);
  c.shared_expert_intermediate_size = c.moe_intermediate_size * n_shared;
  if (n_shared > 0) c.naming.shared = "shared_experts";
  const int64_t first_dense = r.int_or("first_k_dense_replace", 3);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.moe_layer[size_t(i)] = i >= first_dense;
  set_default_experts_spec(c);
}

}  // namespace moekit::model

// The config.json of each tiny architecture, exactly as transformers 5.17 saves it for these sizes
// (hidden 64, 2 layers, vocab 160, 4 heads of 16, 2 KV heads).
#include <map>

#include "tiny/tiny.h"

namespace moekit {

namespace {
const std::map<std::string, const char*>& tiny_config_texts() {
  static const std::map<std::string, const char*> texts = {
    {"qwen2_moe", R"json(
{"architectures":["Qwen2MoeForCausalLM"],"attention_dropout":0.0,"bos_token_id":null,
"decoder_sparse_step":1,"dtype":"float32","eos_token_id":null,"head_dim":16,"hidden_act":"silu",
"hidden_size":64,"initializer_range":0.15,"intermediate_size":96,"layer_types":["full_attention",
"full_attention"],"max_position_embeddings":256,"max_window_layers":28,"mlp_only_layers":[],
"model_type":"qwen2_moe","moe_intermediate_size":32,"norm_topk_prob":false,"num_attention_heads":4,
"num_experts":8,"num_experts_per_tok":3,"num_hidden_layers":2,"num_key_value_heads":2,
"output_router_logits":false,"pad_token_id":null,"qkv_bias":true,"rms_norm_eps":1e-06,
"rope_parameters":{"rope_theta":10000.0,"rope_type":"default"},"router_aux_loss_coef":0.001,
"shared_expert_intermediate_size":48,"sliding_window":0,"tie_word_embeddings":false,
"transformers_version":"5.17.0","use_cache":true,"use_sliding_window":false,"vocab_size":160}
)json"},
    {"qwen3_moe", R"json(
{"architectures":["Qwen3MoeForCausalLM"],"attention_bias":false,"attention_dropout":0.0,"bos_token_id":null,
"decoder_sparse_step":1,"dtype":"float32","eos_token_id":null,"head_dim":16,"hidden_act":"silu",
"hidden_size":64,"initializer_range":0.15,"intermediate_size":96,"max_position_embeddings":256,
"mlp_only_layers":[],"model_type":"qwen3_moe","moe_intermediate_size":32,"norm_topk_prob":true,
"num_attention_heads":4,"num_experts_per_tok":2,"num_hidden_layers":2,"num_key_value_heads":2,
"num_local_experts":8,"output_router_logits":false,"pad_token_id":null,"rms_norm_eps":1e-06,
"rope_parameters":{"rope_theta":10000.0,"rope_type":"default"},"router_aux_loss_coef":0.001,
"sliding_window":null,"tie_word_embeddings":false,"transformers_version":"5.17.0","use_cache":true,
"use_sliding_window":false,"vocab_size":160}
)json"},
    {"mixtral", R"json(
{"architectures":["MixtralForCausalLM"],"attention_dropout":0.0,"bos_token_id":1,"dtype":"float32",
"eos_token_id":2,"head_dim":16,"hidden_act":"silu","hidden_size":64,"initializer_range":0.15,
"intermediate_size":48,"max_position_embeddings":256,"model_type":"mixtral","num_attention_heads":4,
"num_experts_per_tok":2,"num_hidden_layers":2,"num_key_value_heads":2,"num_local_experts":6,
"output_router_logits":false,"pad_token_id":null,"rms_norm_eps":1e-05,
"rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"},"router_aux_loss_coef":0.001,
"router_jitter_noise":0.0,"sliding_window":null,"tie_word_embeddings":false,"transformers_version":"5.17.0",
"use_cache":true,"vocab_size":160}
)json"},
    {"olmoe", R"json(
{"architectures":["OlmoeForCausalLM"],"attention_bias":false,"attention_dropout":0.0,"bos_token_id":null,
"clip_qkv":null,"dtype":"float32","eos_token_id":50279,"head_dim":16,"hidden_act":"silu","hidden_size":64,
"initializer_range":0.15,"intermediate_size":32,"max_position_embeddings":256,"model_type":"olmoe",
"norm_topk_prob":false,"num_attention_heads":4,"num_experts":8,"num_experts_per_tok":2,
"num_hidden_layers":2,"num_key_value_heads":2,"output_router_logits":false,"pad_token_id":1,
"rms_norm_eps":1e-05,"rope_parameters":{"rope_theta":10000.0,"rope_type":"default"},
"router_aux_loss_coef":0.01,"tie_word_embeddings":false,"transformers_version":"5.17.0","use_cache":true,
"vocab_size":160}
)json"},
    {"deepseek_v3", R"json(
{"architectures":["DeepseekV3ForCausalLM"],"attention_bias":false,"attention_dropout":0.0,"bos_token_id":0,
"dtype":"float32","eos_token_id":1,"first_k_dense_replace":1,"head_dim":8,"hidden_act":"silu",
"hidden_size":64,"initializer_range":0.15,"intermediate_size":96,"kv_lora_rank":16,
"max_position_embeddings":256,"model_type":"deepseek_v3","moe_intermediate_size":32,"n_group":2,
"n_routed_experts":8,"n_shared_experts":1,"norm_topk_prob":true,"num_attention_heads":4,
"num_experts_per_tok":2,"num_hidden_layers":2,"num_key_value_heads":4,"num_nextn_predict_layers":1,
"pad_token_id":null,"pretraining_tp":1,"q_lora_rank":32,"qk_head_dim":16,"qk_nope_head_dim":8,
"qk_rope_head_dim":8,"rms_norm_eps":1e-06,"rope_interleave":true,"rope_parameters":{"rope_theta":10000.0,
"rope_type":"default"},"routed_scaling_factor":2.5,"tie_word_embeddings":false,"topk_group":1,
"transformers_version":"5.17.0","use_cache":true,"v_head_dim":16,"vocab_size":160}
)json"},
    {"gpt_oss", R"json(
{"architectures":["GptOssForCausalLM"],"attention_bias":true,"attention_dropout":0.0,"bos_token_id":null,
"dtype":"float32","eos_token_id":null,"head_dim":16,"hidden_act":"silu","hidden_size":64,
"initializer_range":0.15,"intermediate_size":40,"layer_types":["sliding_attention","full_attention"],
"max_position_embeddings":256,"model_type":"gpt_oss","num_attention_heads":4,"num_experts_per_tok":2,
"num_hidden_layers":2,"num_key_value_heads":2,"num_local_experts":8,"output_router_logits":false,
"pad_token_id":null,"rms_norm_eps":1e-05,"rope_parameters":{"beta_fast":32.0,"beta_slow":1.0,"factor":32.0,
"original_max_position_embeddings":4096,"rope_theta":150000.0,"rope_type":"yarn","truncate":false},
"router_aux_loss_coef":0.001,"sliding_window":8,"tie_word_embeddings":false,"transformers_version":"5.17.0",
"use_cache":true,"vocab_size":160}
)json"},
    {"qwen3_vl_moe", R"json(
{"architectures":["Qwen3VLMoeForConditionalGeneration"],"dtype":"float32","image_token_id":151655,
"model_type":"qwen3_vl_moe","text_config":{"attention_bias":false,"attention_dropout":0.0,
"bos_token_id":null,"decoder_sparse_step":1,"dtype":"float32","eos_token_id":null,"head_dim":16,
"hidden_act":"silu","hidden_size":64,"initializer_range":0.15,"intermediate_size":96,
"max_position_embeddings":256,"mlp_only_layers":[],"model_type":"qwen3_vl_moe_text",
"moe_intermediate_size":24,"num_attention_heads":4,"num_experts_per_tok":2,"num_hidden_layers":2,
"num_key_value_heads":2,"num_local_experts":8,"pad_token_id":null,"rms_norm_eps":1e-06,
"rope_parameters":{"mrope_interleaved":true,"mrope_section":[4,2,2],"rope_theta":10000.0,
"rope_type":"default"},"router_aux_loss_coef":0.001,"sliding_window":null,"tie_word_embeddings":false,
"use_cache":true,"vocab_size":160},"tie_word_embeddings":false,"transformers_version":"5.17.0",
"video_token_id":151656,"vision_config":{"deepstack_visual_indexes":[0],"depth":1,"dtype":"float32",
"hidden_act":"gelu_pytorch_tanh","hidden_size":16,"in_channels":3,"initializer_range":0.15,
"intermediate_size":32,"model_type":"qwen3_vl_moe_vision","num_heads":2,"num_position_embeddings":16,
"out_hidden_size":64,"patch_size":8,"rope_parameters":{"rope_theta":10000.0,"rope_type":"axial"},
"spatial_merge_size":2,"temporal_patch_size":2},"vision_end_token_id":151653,"vision_start_token_id":151652}
)json"},
  };
  return texts;
}
}  // namespace

std::vector<std::string> tiny_architectures() {
  return {"qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe"};
}

nlohmann::json tiny_config(const std::string& arch) {
  const auto& texts = tiny_config_texts();
  auto it = texts.find(arch);
  if (it == texts.end()) {
    std::string known;
    for (const auto& a : tiny_architectures()) known += (known.empty() ? "" : ", ") + a;
    MOEKIT_FAIL(not_found, "tiny: unknown architecture '", arch, "' (known: ", known, ")");
  }
  return nlohmann::json::parse(it->second);
}

}  // namespace moekit

// OLMoE: q/k RMSNorm over the whole projection (before the head split), optional clip_qkv.
#include "model/arch.h"

namespace moekit::model {

void parse_olmoe(const ConfigReader& r, TextConfig& c) {
  parse_common(r, c, 10000.0);
  c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-5);
  c.intermediate_size = r.required_int("intermediate_size");
  c.moe_intermediate_size = c.intermediate_size;
  c.num_experts = r.required_int_any({"num_experts", "num_local_experts"});
  c.num_experts_per_tok = r.required_int("num_experts_per_tok");
  c.norm_topk_prob = r.bool_or("norm_topk_prob", false);
  c.router = RouterKind::softmax_topk;
  c.qkv_bias = c.o_bias = r.bool_or("attention_bias", false);
  c.qk_norm = QkNorm::full;
  c.clip_qkv = r.optional_number("clip_qkv");
  set_default_experts_spec(c);
}

}  // namespace moekit::model

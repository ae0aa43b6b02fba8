// Mixtral: softmax top-k routing renormalised over the k experts; experts w1 (gate), w3 (up), w2 (down).
#include "model/arch.h"

namespace moekit::model {

void parse_mixtral(const ConfigReader& r, TextConfig& c) {
  parse_common(r, c, 1000000.0);
  c.intermediate_size = r.required_int("intermediate_size");
  c.moe_intermediate_size = c.intermediate_size;
  c.num_experts = r.required_int_any({"num_local_experts", "num_experts"});
  c.num_experts_per_tok = r.required_int("num_experts_per_tok");
  c.router = RouterKind::softmax_topk;
  c.norm_topk_prob = true;
  c.naming.block = "block_sparse_moe";  // the loader also accepts the renamed "mlp"
  c.naming.gate_proj = "w1";
  c.naming.up_proj = "w3";
  c.naming.down_proj = "w2";
  if (r.has("sliding_window")) c.sliding_window.assign(size_t(c.num_hidden_layers), r.required_int("sliding_window"));
  set_default_experts_spec(c);
}

}  // namespace moekit::model

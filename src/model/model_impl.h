// Internal: the loaded weights of a decoder, the KV cache state, and the model's implementation object.
#pragma once
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "model/ops.h"
#include "moekit/model.h"

namespace moekit::model {

struct Linear {
  Tensor w;  // [out, in]
  Tensor b;  // [out] or undefined
};

struct AttentionWeights {
  // grouped-query attention
  Linear q, k, v, o;
  Tensor q_norm, k_norm;  // [head_dim] (per head) or [heads * head_dim] (full projection)
  Tensor sinks;           // [Hq] f32 (gpt-oss)
  // multi-head latent attention
  Linear q_a, q_b, kv_a, kv_b;
  Tensor q_a_norm, kv_a_norm;
};

struct DenseMlp {
  Linear gate_up;  // [2I, H]: gate rows then up rows
  Linear down;     // [H, I]
};

struct MoeBlock {
  Tensor router_w;         // [E, H] f32
  Tensor router_b;         // [E] f32 (gpt-oss)
  Tensor correction_bias;  // [E] f32 (DeepSeek e_score_correction_bias)
  Experts experts;
  bool has_shared = false;
  DenseMlp shared;
  Tensor shared_gate;  // [1, H] (qwen2_moe)
};

struct Layer {
  Tensor input_norm, post_norm;  // [H]
  AttentionWeights attn;
  bool is_moe = false;
  DenseMlp mlp;
  MoeBlock moe;
  int64_t window = 0;  // sliding window, 0 = full attention
};

struct Weights {
  Tensor embed;  // [V, H]
  std::vector<Layer> layers;
  Tensor norm;     // [H]
  Tensor lm_head;  // [V, H]
};

// Reads and validates every tensor of the decoder described by `c` (names, shapes), converting to `dtype`
// on `device`; per-expert tensors are fused into the Experts layouts. Throws Error(not_found /
// invalid_argument) listing what is missing or has the wrong shape.
Weights load_weights(const Checkpoint& ckpt, TextConfig& c, DType dtype, Device device,
                     const std::string& experts_implementation);

}  // namespace moekit::model

namespace moekit {

struct KvCache::State {
  std::vector<Tensor> k, v;  // per layer: [capacity, Hkv, Dk] and [capacity, Hkv, Dv]
  int64_t length = 0;
  int64_t capacity = 0;
};

struct Model::Impl {
  ModelConfig config;
  ModelOptions options;
  DType dtype = DType::f32;
  model::Weights weights;
  model::RopeSpec rope;
  ExpertsMap experts_map;   // "" and each sub-config
  std::string decoder_key;  // the map entry that drives the decoder's experts ("" or "text_config")

  const model::DeviceOps& ops() const { return model::ops_for(options.device); }
  void apply_experts_map();
  // The decoder forward over `ids` after the cache; logits [n, V] f32 on the CPU.
  Tensor forward(const std::vector<int64_t>& ids, KvCache& cache, bool all_logits);
  void reserve(KvCache& cache, int64_t tokens) const;
};

}  // namespace moekit

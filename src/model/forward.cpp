// The decoder forward: embeddings, per layer (norm, attention, residual, norm, MLP or MoE, residual),
// final norm, lm_head. Written with the ops of ops.h; the routed experts run through Experts::forward.
#include <algorithm>

#include "model/model_impl.h"
#include "moekit/error.h"

namespace moekit {
using model::DeviceOps;
using model::Layer;
using model::reshaped;
using model::rows;

namespace {

Tensor empty(const Shape& s, DType t, Device d) { return Tensor::empty(s, t, d); }

Tensor linear(const DeviceOps& ops, const TensorView& x, const model::Linear& l, DType out_dtype) {
  Tensor y = empty({x.shape[0], l.w.size(0)}, out_dtype, x.device);
  ops.linear(x, l.w.view(), l.b.defined() ? l.b.view() : TensorView(), y.view());
  return y;
}

Tensor dense_mlp(const DeviceOps& ops, const TensorView& x, const model::DenseMlp& m, Activation act) {
  Tensor gu = linear(ops, x, m.gate_up, x.dtype);
  Tensor a = empty({x.shape[0], gu.size(1) / 2}, x.dtype, x.device);
  ops.act_mul(gu.view(), act, a.view());
  return linear(ops, a.view(), m.down, x.dtype);
}

struct Ctx {
  const DeviceOps& ops;
  const TextConfig& c;
  const model::RopeSpec& rope;
  DType dtype;
  Device device;
  int64_t pos0;  // position of the first new token
  int64_t T;     // new tokens
};

// Grouped-query attention (qwen, mixtral, olmoe, gpt-oss); writes this step's keys and values into the cache.
Tensor attention(const Ctx& x, const Layer& L, const TensorView& h, Tensor& kc, Tensor& vc) {
  const TextConfig& c = x.c;
  const auto& a = L.attn;
  const int64_t T = x.T, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.head_dim;
  Tensor q = linear(x.ops, h, a.q, x.dtype), k = linear(x.ops, h, a.k, x.dtype), v = linear(x.ops, h, a.v, x.dtype);
  const float eps = float(c.rms_norm_eps);
  if (c.qk_norm == QkNorm::full) {
    x.ops.rmsnorm(q.view(), a.q_norm.view(), eps, c.norm_weight_before_cast, q.view());
    x.ops.rmsnorm(k.view(), a.k_norm.view(), eps, c.norm_weight_before_cast, k.view());
  }
  if (c.clip_qkv) {
    const float lim = float(*c.clip_qkv);
    x.ops.clamp(q.view(), lim);
    x.ops.clamp(k.view(), lim);
    x.ops.clamp(v.view(), lim);
  }
  if (c.qk_norm == QkNorm::per_head) {
    x.ops.rmsnorm(reshaped(q.view(), {T * Hq, D}), a.q_norm.view(), eps, c.norm_weight_before_cast,
                  reshaped(q.view(), {T * Hq, D}));
    x.ops.rmsnorm(reshaped(k.view(), {T * Hkv, D}), a.k_norm.view(), eps, c.norm_weight_before_cast,
                  reshaped(k.view(), {T * Hkv, D}));
  }
  const TensorView q3 = reshaped(q.view(), {T, Hq, D}), k3 = reshaped(k.view(), {T, Hkv, D});
  x.ops.rope(q3, 0, x.pos0, x.rope);
  x.ops.rope(k3, 0, x.pos0, x.rope);
  memcpy_any(rows(kc.view(), x.pos0, T).data, x.device, k.data(), x.device, k.nbytes());
  memcpy_any(rows(vc.view(), x.pos0, T).data, x.device, v.data(), x.device, v.nbytes());
  Tensor out = empty({T, Hq, D}, x.dtype, x.device);
  const int64_t S = x.pos0 + T;
  x.ops.attention(q3, rows(kc.view(), 0, S), rows(vc.view(), 0, S), out.view(), x.pos0, float(c.attention_scale()),
                  L.window, a.sinks.defined() ? a.sinks.view() : TensorView());
  return linear(x.ops, reshaped(out.view(), {T, Hq * D}), a.o, x.dtype);
}

// Multi-head latent attention (DeepSeek-V3): the cache holds the expanded keys and values.
Tensor mla_attention(const Ctx& x, const Layer& L, const TensorView& h, Tensor& kc, Tensor& vc) {
  const TextConfig& c = x.c;
  const auto& a = L.attn;
  const int64_t T = x.T, Hq = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  const int64_t dqk = nope + rope, dv = c.v_head_dim, R = c.kv_lora_rank;
  constexpr float kLatentEps = 1e-6f;  // DeepseekV3RMSNorm's default: q_a / kv_a norms ignore rms_norm_eps
  Tensor q;
  if (c.q_lora_rank > 0) {
    Tensor qa = linear(x.ops, h, a.q_a, x.dtype);
    x.ops.rmsnorm(qa.view(), a.q_a_norm.view(), kLatentEps, c.norm_weight_before_cast, qa.view());
    q = linear(x.ops, qa.view(), a.q_b, x.dtype);
  } else {
    q = linear(x.ops, h, a.q, x.dtype);
  }
  Tensor ckv = linear(x.ops, h, a.kv_a, x.dtype);  // [T, R + rope]
  Tensor latent = empty({T, R}, x.dtype, x.device);
  x.ops.rmsnorm(model::columns(ckv.view(), 0, R), a.kv_a_norm.view(), kLatentEps, c.norm_weight_before_cast,
                latent.view());
  TensorView k_rot = model::columns(ckv.view(), R, rope);  // [T, rope], row stride R + rope
  TensorView k_rot3 = k_rot;
  k_rot3.shape = {T, 1, rope};
  k_rot3.strides = {R + rope, rope, 1};
  const TensorView q3 = reshaped(q.view(), {T, Hq, dqk});
  x.ops.rope(q3, nope, x.pos0, x.rope);
  x.ops.rope(k_rot3, 0, x.pos0, x.rope);
  Tensor kvb = linear(x.ops, latent.view(), a.kv_b, x.dtype);  // [T, Hq * (nope + dv)]
  x.ops.mla_expand(kvb.view(), k_rot, nope, rows(kc.view(), x.pos0, T), rows(vc.view(), x.pos0, T));
  Tensor out = empty({T, Hq, dv}, x.dtype, x.device);
  const int64_t S = x.pos0 + T;
  x.ops.attention(q3, rows(kc.view(), 0, S), rows(vc.view(), 0, S), out.view(), x.pos0, float(c.attention_scale()),
                  L.window, TensorView());
  return linear(x.ops, reshaped(out.view(), {T, Hq * dv}), a.o, x.dtype);
}

Tensor moe(const Ctx& x, const Layer& L, const TensorView& h) {
  const TextConfig& c = x.c;
  const auto& m = L.moe;
  const int64_t T = x.T, E = c.num_experts, K = c.num_experts_per_tok;
  Tensor logits = empty({T, E}, DType::f32, x.device);
  x.ops.linear(h, m.router_w.view(), m.router_b.defined() ? m.router_b.view() : TensorView(), logits.view());
  Tensor idx = empty({T, K}, DType::i32, x.device), wts = empty({T, K}, DType::f32, x.device);
  model::RouterSpec rs{c.router, K, c.norm_topk_prob, float(c.routed_scaling_factor), c.n_group, c.topk_group};
  x.ops.route(logits.view(), m.correction_bias.defined() ? m.correction_bias.view() : TensorView(), rs, idx.view(),
              wts.view());
  Tensor y = m.experts.forward(h, idx.view(), wts.view());
  if (m.has_shared) {
    Tensor s = dense_mlp(x.ops, h, m.shared, c.experts.activation);
    if (m.shared_gate.defined()) {
      Tensor g = linear(x.ops, h, model::Linear{m.shared_gate, {}}, x.dtype);
      x.ops.add_sigmoid_gated(s.view(), g.view(), y.view());
    } else {
      x.ops.add(y.view(), s.view(), y.view());
    }
  }
  return y;
}

}  // namespace

void Model::Impl::reserve(KvCache& cache, int64_t tokens) const {
  auto& st = cache.state();
  const TextConfig& c = config.text;
  const int64_t Hkv = c.mla ? c.num_attention_heads : c.num_key_value_heads;
  const int64_t dk = c.mla ? c.qk_nope_head_dim + c.qk_rope_head_dim : c.head_dim;
  const int64_t dv = c.mla ? c.v_head_dim : c.head_dim;
  const Device dev = options.device;
  if (!st.k.empty()) {
    const Tensor& k0 = st.k[0];
    MOEKIT_CHECK(int64_t(st.k.size()) == c.num_hidden_layers && k0.size(1) == Hkv && k0.size(2) == dk &&
                     st.v[0].size(2) == dv && k0.dtype() == dtype && k0.device() == dev,
                 "this KV cache belongs to another model (", st.k.size(), " layers of ", shape_to_string(k0.shape()),
                 " ", dtype_name(k0.dtype()), " on ", k0.device().to_string(), ")");
  }
  if (st.length + tokens <= st.capacity && !st.k.empty()) return;
  const int64_t need = st.length + tokens;
  const int64_t cap = std::max<int64_t>({need, 2 * st.capacity, 64});
  std::vector<Tensor> k(size_t(c.num_hidden_layers)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = Tensor::empty({cap, Hkv, dk}, dtype, dev);
    v[i] = Tensor::empty({cap, Hkv, dv}, dtype, dev);
    if (st.length > 0) {
      memcpy_any(k[i].data(), dev, st.k[i].data(), dev, size_t(st.length) * size_t(Hkv * dk) * dtype_nbytes(dtype, 1));
      memcpy_any(v[i].data(), dev, st.v[i].data(), dev, size_t(st.length) * size_t(Hkv * dv) * dtype_nbytes(dtype, 1));
    }
  }
  st.k = std::move(k);
  st.v = std::move(v);
  st.capacity = cap;
}

Tensor Model::Impl::forward(const std::vector<int64_t>& ids, KvCache& cache, bool all_logits) {
  const TextConfig& c = config.text;
  const int64_t T = int64_t(ids.size());
  MOEKIT_CHECK(T > 0, "forward needs at least one token");
  const model::DeviceOps& o = ops();
  reserve(cache, T);
  auto& st = cache.state();
  const Device dev = options.device;
  const Ctx x{o, c, rope, dtype, dev, st.length, T};
  const int64_t H = c.hidden_size;
  Tensor h = empty({T, H}, dtype, dev);
  o.embedding(ids.data(), T, weights.embed.view(), h.view());
  const float eps = float(c.rms_norm_eps);
  Tensor n = empty({T, H}, dtype, dev);
  for (size_t i = 0; i < weights.layers.size(); ++i) {
    const Layer& L = weights.layers[i];
    o.rmsnorm(h.view(), L.input_norm.view(), eps, c.norm_weight_before_cast, n.view());
    Tensor a = c.mla ? mla_attention(x, L, n.view(), st.k[i], st.v[i]) : attention(x, L, n.view(), st.k[i], st.v[i]);
    o.add(h.view(), a.view(), h.view());
    o.rmsnorm(h.view(), L.post_norm.view(), eps, c.norm_weight_before_cast, n.view());
    Tensor m = L.is_moe ? moe(x, L, n.view()) : dense_mlp(o, n.view(), L.mlp, c.experts.activation);
    o.add(h.view(), m.view(), h.view());
  }
  st.length += T;
  const int64_t rows_out = all_logits ? T : 1;
  const TensorView last = rows(h.view(), T - rows_out, rows_out);
  Tensor hn = empty({rows_out, H}, dtype, dev);
  o.rmsnorm(last, weights.norm.view(), eps, c.norm_weight_before_cast, hn.view());
  Tensor logits = empty({rows_out, c.vocab_size}, DType::f32, dev);
  o.linear(hn.view(), weights.lm_head.view(), TensorView(), logits.view());
  return logits.to(Device::cpu());
}

}  // namespace moekit

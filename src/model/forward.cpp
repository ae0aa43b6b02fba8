// The decoder forward: embeddings, per layer (norm, attention, residual, norm, MLP or MoE, residual),
// final norm, lm_head. Written with the ops of ops.h; the routed experts run through Experts::forward.
#include <algorithm>
#include <atomic>

#include "core/checked.h"
#include "model/model_impl.h"
#include "moekit/error.h"
#include "moekit/interface.h"

namespace moekit {
using model::DeviceOps;
using model::Layer;
using model::reshaped;
using model::rows;

namespace {

struct Ctx {
  const DeviceOps& ops;
  const TextConfig& c;
  const model::RopeSpec& rope;
  model::Scratch& scratch;
  DType dtype;
  Device device;
  const std::vector<model::Segment>& segs;  // the sequences whose new tokens are the rows, in order
  int64_t T;                                // new tokens of all sequences
  size_t layer;                             // the layer being run (its cache buffers)

  Tensor empty(const Shape& s, DType t) const { return scratch.empty(s, t); }
  Tensor linear(const TensorView& x, const model::Linear& l, DType out_dtype) const {
    Tensor y = empty({x.shape[0], l.w.size(0)}, out_dtype);
    ops.linear(x, l.w.view(), l.b.defined() ? l.b.view() : TensorView(), y.view());
    return y;
  }
  Tensor dense_mlp(const TensorView& x, const model::DenseMlp& m) const {
    Tensor gu = linear(x, m.gate_up, x.dtype);
    Tensor a = empty({x.shape[0], gu.size(1) / 2}, x.dtype);
    ops.act_mul(gu.view(), c.experts.activation, a.view());
    return linear(a.view(), m.down, x.dtype);
  }
};

// The decode step's attention (one new token per sequence): one QKV projection, then decode_attention over all
// the sequences (per-head norms, rotary, the cache writes and the attention; on CUDA one launch of each).
Tensor attention_decode(const Ctx& x, const Layer& L, const TensorView& h) {
  const TextConfig& c = x.c;
  const auto& a = L.attn;
  const int64_t T = x.T, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.head_dim;
  const int64_t Nq = Hq * D, Nk = Hkv * D;
  Tensor qkv = x.linear(h, a.qkv, x.dtype);  // [T, Nq + 2 Nk]
  const float eps = float(c.rms_norm_eps);
  if (c.qk_norm == QkNorm::full) {
    const TensorView qc = model::columns(qkv.view(), 0, Nq), kc = model::columns(qkv.view(), Nq, Nk);
    x.ops.rmsnorm(qc, a.q_norm.view(), eps, c.norm_weight_before_cast, qc);
    x.ops.rmsnorm(kc, a.k_norm.view(), eps, c.norm_weight_before_cast, kc);
  }
  if (c.clip_qkv) x.ops.clamp(qkv.view(), float(*c.clip_qkv));  // q, k and v alike
  const bool per_head = c.qk_norm == QkNorm::per_head;
  Tensor out = x.empty({T, Hq, D}, x.dtype);
  std::vector<model::DecodeSeq> seqs;
  seqs.reserve(x.segs.size());
  for (const model::Segment& sg : x.segs)  // one row each, in order
    seqs.push_back({sg.cache->k[x.layer].view(), sg.cache->v[x.layer].view(), sg.pos, sg.kv_rows});
  x.ops.decode_attention(qkv.view(), Hq, Hkv, per_head ? a.q_norm.view() : TensorView(),
                         per_head ? a.k_norm.view() : TensorView(), eps, c.norm_weight_before_cast, x.rope, seqs,
                         float(c.attention_scale()), L.window, a.sinks.defined() ? a.sinks.view() : TensorView(),
                         out.view());
  return x.linear(reshaped(out.view(), {T, Hq * D}), a.o, x.dtype);
}

// Grouped-query attention (qwen, mixtral, olmoe, gpt-oss); writes this step's keys and values into the cache.
Tensor attention(const Ctx& x, const Layer& L, const TensorView& h) {
  const TextConfig& c = x.c;
  const auto& a = L.attn;
  const int64_t T = x.T, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.head_dim;
  // A decode step (one new token per sequence) takes the fused path unless MOEKIT_FUSED_DECODE=0.
  if (a.qkv.w.defined() && T == int64_t(x.segs.size()) && model::fused_decode()) return attention_decode(x, L, h);
  Tensor q = x.linear(h, a.q, x.dtype), k = x.linear(h, a.k, x.dtype), v = x.linear(h, a.v, x.dtype);
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
  const TensorView v3 = reshaped(v.view(), {T, Hkv, D});
  Tensor out = x.empty({T, Hq, D}, x.dtype);
  for (const model::Segment& sg : x.segs) {  // positions and caches are per sequence
    const Tensor &kc = sg.cache->k[x.layer], &vc = sg.cache->v[x.layer];
    const TensorView qs = rows(q3, sg.begin, sg.n), ks = rows(k3, sg.begin, sg.n);
    x.ops.rope(qs, 0, sg.pos, x.rope);
    x.ops.rope(ks, 0, sg.pos, x.rope);
    x.ops.write_rows(ks, kc.view(), sg.pos);
    x.ops.write_rows(rows(v3, sg.begin, sg.n), vc.view(), sg.pos);
    x.ops.attention(qs, rows(kc.view(), 0, sg.kv_rows), rows(vc.view(), 0, sg.kv_rows),
                    rows(out.view(), sg.begin, sg.n), sg.pos, float(c.attention_scale()), L.window,
                    a.sinks.defined() ? a.sinks.view() : TensorView());
  }
  return x.linear(reshaped(out.view(), {T, Hq * D}), a.o, x.dtype);
}

// Multi-head latent attention (DeepSeek-V3): the cache holds the expanded keys and values.
Tensor mla_attention(const Ctx& x, const Layer& L, const TensorView& h) {
  const TextConfig& c = x.c;
  const auto& a = L.attn;
  const int64_t T = x.T, Hq = c.num_attention_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  const int64_t dqk = nope + rope, dv = c.v_head_dim, R = c.kv_lora_rank;
  constexpr float kLatentEps = 1e-6f;  // DeepseekV3RMSNorm's default: q_a / kv_a norms ignore rms_norm_eps
  Tensor q;
  if (c.q_lora_rank > 0) {
    Tensor qa = x.linear(h, a.q_a, x.dtype);
    x.ops.rmsnorm(qa.view(), a.q_a_norm.view(), kLatentEps, c.norm_weight_before_cast, qa.view());
    q = x.linear(qa.view(), a.q_b, x.dtype);
  } else {
    q = x.linear(h, a.q, x.dtype);
  }
  Tensor ckv = x.linear(h, a.kv_a, x.dtype);  // [T, R + rope]
  Tensor latent = x.empty({T, R}, x.dtype);
  x.ops.rmsnorm(model::columns(ckv.view(), 0, R), a.kv_a_norm.view(), kLatentEps, c.norm_weight_before_cast,
                latent.view());
  TensorView k_rot = model::columns(ckv.view(), R, rope);  // [T, rope], row stride R + rope
  TensorView k_rot3 = k_rot;
  k_rot3.shape = {T, 1, rope};
  k_rot3.strides = {R + rope, rope, 1};
  const TensorView q3 = reshaped(q.view(), {T, Hq, dqk});
  Tensor kvb = x.linear(latent.view(), a.kv_b, x.dtype);  // [T, Hq * (nope + dv)]
  Tensor out = x.empty({T, Hq, dv}, x.dtype);
  for (const model::Segment& sg : x.segs) {  // positions and caches are per sequence
    const Tensor &kc = sg.cache->k[x.layer], &vc = sg.cache->v[x.layer];
    const TensorView qs = rows(q3, sg.begin, sg.n);
    x.ops.rope(qs, nope, sg.pos, x.rope);
    x.ops.rope(rows(k_rot3, sg.begin, sg.n), 0, sg.pos, x.rope);
    x.ops.mla_expand(rows(kvb.view(), sg.begin, sg.n), rows(k_rot, sg.begin, sg.n), nope, kc.view(), vc.view(),
                     sg.pos);
    x.ops.attention(qs, rows(kc.view(), 0, sg.kv_rows), rows(vc.view(), 0, sg.kv_rows),
                    rows(out.view(), sg.begin, sg.n), sg.pos, float(c.attention_scale()), L.window, TensorView());
  }
  return x.linear(reshaped(out.view(), {T, Hq * dv}), a.o, x.dtype);
}

Tensor moe(const Ctx& x, const Layer& L, const TensorView& h) {
  const TextConfig& c = x.c;
  const auto& m = L.moe;
  const int64_t T = x.T, E = c.num_experts, K = c.num_experts_per_tok;
  Tensor logits = x.empty({T, E}, DType::f32);
  x.ops.linear(h, m.router_w.view(), m.router_b.defined() ? m.router_b.view() : TensorView(), logits.view());
  Tensor idx = x.empty({T, K}, DType::i32), wts = x.empty({T, K}, DType::f32);
  // On CUDA the experts may route the tokens themselves from the logits (model::route_in_experts): the same ids and
  // weights, without a launch of the router's own.
  const ExpertsRouting routing{logits.view(), c.router, c.norm_topk_prob};
  const bool inside = model::route_in_experts() && h.device.is_cuda() && !m.ep &&
                      c.router != RouterKind::grouped_sigmoid && !m.correction_bias.defined() &&
                      E <= kRoutingMaxExperts && K <= kRoutingMaxTopK && K <= E;
  if (!inside) {
    model::RouterSpec rs{c.router, K, c.norm_topk_prob, float(c.routed_scaling_factor), c.n_group, c.topk_group};
    x.ops.route(logits.view(), m.correction_bias.defined() ? m.correction_bias.view() : TensorView(), rs, idx.view(),
                wts.view());
  }
  Tensor y = x.empty({T, h.shape[1]}, h.dtype);
  const ExpertsCall call{h, idx.view(), wts.view(), y.view(), model::current_stream(), inside ? &routing : nullptr};
  if (m.ep)
    m.ep->forward_into(m.experts, call);
  else
    m.experts.forward_into(call);
  if (m.has_shared) {
    Tensor s = x.dense_mlp(h, m.shared);
    if (m.shared_gate.defined()) {
      Tensor g = x.linear(h, model::Linear{m.shared_gate, {}}, x.dtype);
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
  const int64_t need = checked_add(st.length, tokens, "KV cache: cached + new tokens");
  if (need <= st.capacity && !st.k.empty()) return;
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

void Model::Impl::check_ids(const int64_t* ids, int64_t n) const {
  const int64_t V = config.text.vocab_size;
  for (int64_t i = 0; i < n; ++i)
    MOEKIT_CHECK(ids[i] >= 0 && ids[i] < V, "token id ", ids[i], " at position ", i, " is out of range [0, ", V,
                 ") (vocab_size ", V, ")");
}

Tensor Model::Impl::forward_device(const TensorView& ids, model::Position pos, KvCache& cache, bool all_logits) {
  // A position read on the device (graphs) lets the attention see the whole cache; the kernels stop at pos + T.
  auto& st = cache.state();
  const int64_t T = ids.numel();
  const std::vector<model::Segment> segs{{&st, 0, T, pos, pos.device ? st.capacity : pos.value + T}};
  return forward_segments(ids, segs, all_logits);
}

Tensor Model::Impl::forward_segments(const TensorView& ids, const std::vector<model::Segment>& segs, bool all_logits) {
  const TextConfig& c = config.text;
  const int64_t T = ids.numel();
  MOEKIT_CHECK(!segs.empty() && segs.back().begin + segs.back().n == T, "forward: the sequences cover ",
               segs.empty() ? 0 : segs.back().begin + segs.back().n, " of ", T, " tokens");
  MOEKIT_CHECK(!all_logits || segs.size() == 1, "forward: every position's logits are kept for one sequence only");
  const model::DeviceOps& o = ops();
  const Device dev = options.device;
  Ctx x{o, c, rope, scratch, dtype, dev, segs, T, 0};
  const int64_t H = c.hidden_size;
  Tensor h = x.empty({T, H}, dtype);
  o.embedding(ids, weights.embed.view(), h.view());
  const float eps = float(c.rms_norm_eps);
  Tensor n = x.empty({T, H}, dtype);
  const bool wbc = c.norm_weight_before_cast;
  Tensor m;  // the last layer's MLP output, added to the residual by the next norm
  for (size_t i = 0; i < weights.layers.size(); ++i) {
    const Layer& L = weights.layers[i];
    x.layer = i;
    if (i == 0)
      o.rmsnorm(h.view(), L.input_norm.view(), eps, wbc, n.view());
    else
      o.add_rmsnorm(h.view(), m.view(), L.input_norm.view(), eps, wbc, n.view());
    Tensor a = c.mla ? mla_attention(x, L, n.view()) : attention(x, L, n.view());
    o.add_rmsnorm(h.view(), a.view(), L.post_norm.view(), eps, wbc, n.view());
    m = L.is_moe ? moe(x, L, n.view()) : x.dense_mlp(n.view(), L.mlp);
  }
  // Only the rows whose logits are asked for get the last residual add and the final norm: every row
  // (all_logits), else each sequence's last row (all rows when every sequence has one new token).
  const bool every_row = all_logits || int64_t(segs.size()) == T;
  const int64_t rows_out = every_row ? T : int64_t(segs.size());
  Tensor hn = x.empty({rows_out, H}, dtype);
  auto final_norm = [&](int64_t src, int64_t count, int64_t dst) {
    const TensorView last = rows(h.view(), src, count), out = rows(hn.view(), dst, count);
    if (m.defined())
      o.add_rmsnorm(last, rows(m.view(), src, count), weights.norm.view(), eps, wbc, out);
    else
      o.rmsnorm(last, weights.norm.view(), eps, wbc, out);
  };
  if (every_row)
    final_norm(0, T, 0);
  else
    for (size_t s = 0; s < segs.size(); ++s) final_norm(segs[s].begin + segs[s].n - 1, 1, int64_t(s));
  Tensor logits = x.empty({rows_out, c.vocab_size}, DType::f32);
  o.linear(hn.view(), weights.lm_head.view(), TensorView(), logits.view());
  return logits;
}

namespace {
Tensor to_host(const Tensor& t, Stream s) {
  Tensor out = Tensor::empty(t.shape(), t.dtype());
  memcpy_any(out.data(), Device::cpu(), t.data(), t.device(), t.nbytes(), s);  // waits for the stream
  return out;
}
}  // namespace

Tensor Model::Impl::forward(const std::vector<int64_t>& ids, KvCache& cache, bool all_logits) {
  const int64_t T = int64_t(ids.size());
  MOEKIT_CHECK(T > 0, "forward needs at least one token");
  check_ids(ids.data(), T);
  reserve(cache, T);
  auto& st = cache.state();
  const Device dev = options.device;
  const Stream s = model_stream();
  model::StreamScope scope(s);
  scratch.reset();
  Tensor d_ids = scratch.empty({T}, DType::i64);
  memcpy_any(d_ids.data(), dev, ids.data(), Device::cpu(), size_t(T) * sizeof(int64_t), s);
  const Tensor logits = forward_device(d_ids.view(), model::Position{st.length, nullptr}, cache, all_logits);
  Tensor out = to_host(logits, s);
  st.length += T;
  return out;
}

void Model::Impl::require_capturable_experts(const ExpertsMap& map) const {
  const std::string& name = map.at(decoder_key);
  const auto be = ExpertsInterface::global().get(name);
  MOEKIT_CHECK_CODE(be->graph_capturable(), not_supported, "cuda_graph: experts implementation '", name,
                    "' waits for the host and cannot be recorded in a CUDA graph; decode with batched_mm or "
                    "grouped_mm, or turn CUDA graphs off");
}

Tensor Model::Impl::forward_batch(const std::vector<std::vector<int64_t>>& ids, const std::vector<KvCache*>& caches) {
  MOEKIT_CHECK(!ids.empty() && ids.size() == caches.size(), "forward_batch: ", ids.size(), " token lists for ",
               caches.size(), " caches");
  std::vector<int64_t> all;
  for (size_t i = 0; i < ids.size(); ++i) {
    MOEKIT_CHECK(!ids[i].empty(), "forward_batch: sequence ", i, " has no new token");
    MOEKIT_CHECK(caches[i] != nullptr, "forward_batch: sequence ", i, " has no cache");
    for (size_t j = 0; j < i; ++j)
      MOEKIT_CHECK(caches[j] != caches[i], "forward_batch: sequences ", j, " and ", i, " share one KV cache");
    check_ids(ids[i].data(), int64_t(ids[i].size()));
    reserve(*caches[i], int64_t(ids[i].size()));
    all.insert(all.end(), ids[i].begin(), ids[i].end());
  }
  std::vector<model::Segment> segs;
  int64_t begin = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    auto& st = caches[i]->state();
    const int64_t n = int64_t(ids[i].size());
    segs.push_back({&st, begin, n, model::Position{st.length, nullptr}, st.length + n});
    begin += n;
  }
  const Device dev = options.device;
  const Stream s = model_stream();
  model::StreamScope scope(s);
  scratch.reset();
  const int64_t T = int64_t(all.size());
  Tensor d_ids = scratch.empty({T}, DType::i64);
  memcpy_any(d_ids.data(), dev, all.data(), Device::cpu(), size_t(T) * sizeof(int64_t), s);
  const Tensor logits = forward_segments(d_ids.view(), segs, false);
  Tensor out = to_host(logits, s);
  for (size_t i = 0; i < ids.size(); ++i) caches[i]->state().length += int64_t(ids[i].size());
  return out;
}

std::vector<const void*> DecodeGraph::key(const std::vector<KvCache::State*>& slots, const void* io) {
  std::vector<const void*> out;
  for (const KvCache::State* st : slots)
    for (size_t i = 0; i < st->k.size(); ++i) {
      out.push_back(st->k[i].data());
      out.push_back(st->v[i].data());
    }
  out.push_back(io);
  return out;
}

bool DecodeGraph::matches(const std::vector<KvCache::State*>& slots, const void* io, uint64_t epoch,
                          const ExpertsMap& m) const {
  if (capacity.size() != slots.size() || scratch_epoch != epoch || experts != m) return false;
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i]->k.empty() || slots[i]->capacity != capacity[i]) return false;
  return cache == key(slots, io);
}

int64_t Model::Impl::enqueue_ahead(int64_t token, KvCache& cache, int64_t position,
                                   const std::vector<int64_t>& suppress) {
  const Device dev = options.device;
  KvCache::State* st = &cache.state();
  DecodeGraph& g = decode_graph;
  if (!dev.is_cuda() || !g.graph || !step_io.defined() || step_io.numel() < 2 || st->k.empty() ||
      position < 0 || position >= st->capacity || suppress.size() > model::DeviceOps::kMaxSuppress)
    return -1;
  const int64_t* d_io = step_io.ptr<int64_t>();
  if (!g.matches({st}, static_cast<const void*>(d_io + 1), scratch.epoch(), experts_map)) return -1;
  if (!step_pick.defined() || step_pick.numel() < 2) return -1;  // made by the graphed steps that came first
  const Stream s = decode_graph_stream();
  model::StreamScope scope(s);
  auto* host = static_cast<int64_t*>(ahead_out.get(6 * sizeof(int64_t), dev));
  if (ahead_seq == 0) host[2] = host[5] = 0;  // no ticket yet (tickets start at 1)
  if (token >= 0) {
    // Uploaded from page-locked memory without a wait: nothing is in flight when the host hands a token.
    auto* io = static_cast<int64_t*>(step_in.get(2 * sizeof(int64_t), dev));
    io[0] = token;
    io[1] = position;
    memcpy_any_async(step_io.data(), dev, io, Device::cpu(), 2 * sizeof(int64_t), s);
  }
  g.graph->replay();
  ++graph_replays;
  const TensorView pick(step_pick.data(), DType::i64, {2}, dev);
  const int64_t ticket = ++ahead_seq;
  ops().greedy_pick_feed(g.logits.view(), suppress, pick, TensorView(step_io.data(), DType::i64, {2}, dev),
                         host + 3 * (ticket % 2), ticket);
  return ticket;
}

std::pair<int64_t, bool> Model::Impl::wait_ahead(int64_t ticket, KvCache& cache) {
  MOEKIT_CHECK(ticket > 0 && ticket <= ahead_seq && ahead_seq - ticket <= 1, "wait_ahead: ticket ", ticket,
               " is not one of the last two (", ahead_seq, ")");
  volatile int64_t* slot = static_cast<int64_t*>(ahead_out.get(6 * sizeof(int64_t), options.device)) + 3 * (ticket % 2);
  for (int64_t spins = 0; slot[2] != ticket; ++spins) {
    if (spins == (int64_t(1) << 22)) {  // long enough for any step: a failed launch leaves the word unwritten
      drain_ahead();                      // throws the device's error, if any
      MOEKIT_CHECK(slot[2] == ticket, "decode step ", ticket, " ran but its greedy pick never reached the host");
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  const int64_t token = slot[0];
  const bool finite = slot[1] == 1;
  if (finite) cache.state().length += 1;
  return {token, finite};
}

void Model::Impl::drain_ahead() { stream_synchronize(decode_graph_stream(), options.device); }

Model::Impl::StepOut Model::Impl::decode_step_graphed(int64_t token, KvCache& cache,
                                                     const std::vector<int64_t>* greedy_suppress) {
  return decode_batch_graphed({token}, {&cache}, {true}, greedy_suppress);
}

Model::Impl::StepOut Model::Impl::decode_batch_graphed(const std::vector<int64_t>& tokens,
                                                       const std::vector<KvCache*>& caches,
                                                       const std::vector<bool>& advance,
                                                       const std::vector<int64_t>* greedy_suppress) {
  MOEKIT_CHECK_CODE(options.device.is_cuda(), not_supported, "decode graphs need a CUDA device, the model runs on ",
                    options.device.to_string());
  const int64_t B = int64_t(tokens.size());
  MOEKIT_CHECK(B > 0 && caches.size() == tokens.size() && advance.size() == tokens.size(), "decode step: ", B,
               " tokens, ", caches.size(), " caches and ", advance.size(), " flags");
  check_ids(tokens.data(), B);
  std::vector<KvCache::State*> slots;
  for (KvCache* c : caches) {
    MOEKIT_CHECK(c != nullptr, "decode step: a slot has no cache");
    reserve(*c, 1);  // also a slot that does not advance writes one row at its length
    slots.push_back(&c->state());
  }
  for (int64_t i = 0; i < B; ++i)
    for (int64_t j = 0; j < i; ++j)
      MOEKIT_CHECK(!(caches[size_t(i)] == caches[size_t(j)] && (advance[size_t(i)] || advance[size_t(j)])),
                   "decode step: slots ", j, " and ", i, " share one KV cache");
  const Device dev = options.device;
  const Stream s = decode_graph_stream();
  model::StreamScope scope(s);
  DecodeGraph& g = decode_graph;
  if (!step_io.defined() || step_io.numel() < 2 * B) {
    g = DecodeGraph{};  // the inputs move: no recorded graph reads them any more
    step_io = Tensor::empty({2 * B}, DType::i64, dev);
  }
  if (greedy_suppress)
    MOEKIT_CHECK(greedy_suppress->size() <= model::DeviceOps::kMaxSuppress, "decode step: ", greedy_suppress->size(),
                 " suppressed ids; at most ", model::DeviceOps::kMaxSuppress);
  // The inputs go up from page-locked memory without a wait: the last step's synchronisation (below) has
  // finished the copy that read this memory before.
  int64_t* io = static_cast<int64_t*>(step_in.get(size_t(2 * B) * sizeof(int64_t), dev));
  for (int64_t i = 0; i < B; ++i) {
    io[i] = tokens[size_t(i)];
    io[B + i] = slots[size_t(i)]->length;
  }
  memcpy_any_async(step_io.data(), dev, io, Device::cpu(), size_t(2 * B) * sizeof(int64_t), s);
  const int64_t* d_io = step_io.ptr<int64_t>();
  std::vector<model::Segment> segs;
  for (int64_t i = 0; i < B; ++i) {
    KvCache::State* st = slots[size_t(i)];
    segs.push_back({st, i, 1, model::Position{st->length, d_io + B + i}, st->capacity});
  }
  const TensorView ids(step_io.data(), DType::i64, {B}, dev);
  const ExpertsMap map = experts_map;
  // One copy back per step into page-locked memory, then one wait: B (token, finite) pairs for a greedy step
  // (the logits after all when an advancing slot's are not finite), else the logits.
  auto finish = [&](const Tensor& logits_dev) {
    StepOut out;
    const int64_t V = logits_dev.size(1);
    bool need_logits = !greedy_suppress;
    if (greedy_suppress) {
      if (!step_pick.defined() || step_pick.numel() < 2 * B) step_pick = Tensor::empty({2 * B}, DType::i64, dev);
      const TensorView pick(step_pick.data(), DType::i64, {2 * B}, dev);
      ops().argmax_rows(logits_dev.view(), *greedy_suppress, pick);
      auto* h = static_cast<int64_t*>(step_out.get(size_t(2 * B) * sizeof(int64_t), dev));
      memcpy_any_async(h, Device::cpu(), step_pick.data(), dev, size_t(2 * B) * sizeof(int64_t), s);
      stream_synchronize(s, dev);
      for (int64_t i = 0; i < B; ++i) {
        out.ids.push_back(h[2 * i]);
        if (advance[size_t(i)] && h[2 * i + 1] != 1) need_logits = true;
      }
    }
    if (need_logits) {
      out.ids.clear();
      const size_t bytes = size_t(B * V) * sizeof(float);
      void* h = step_out.get(bytes, dev);
      memcpy_any_async(h, Device::cpu(), logits_dev.data(), dev, bytes, s);
      stream_synchronize(s, dev);
      out.logits = static_cast<const float*>(h);
      out.V = V;
    }
    for (int64_t i = 0; i < B; ++i)
      if (advance[size_t(i)]) slots[size_t(i)]->length += 1;
    return out;
  };
  scratch.reset();  // merges blocks (a new epoch) only when the last forward spilled
  const void* io_key = static_cast<const void*>(d_io + B);  // the positions' place depends on B
  if (!g.matches(slots, io_key, scratch.epoch(), map) || !g.graph) {
    if (!g.matches(slots, io_key, scratch.epoch(), map) || !g.warmed) {
      // First step with this key: run it uncaptured, which sizes the scratch memory and workspaces.
      g = DecodeGraph{};
      g.cache = DecodeGraph::key(slots, io_key);
      for (const KvCache::State* st : slots) g.capacity.push_back(st->capacity);
      g.experts = map;
      const Tensor logits = forward_segments(ids, segs, false);
      g.scratch_epoch = scratch.epoch();
      g.warmed = true;
      return finish(logits);
    }
    require_capturable_experts(map);
    Tensor logits;
    g.graph = ops().capture([&] { logits = forward_segments(ids, segs, false); });
    g.logits = logits;
  }
  g.graph->replay();
  ++graph_replays;
  return finish(g.logits);
}

}  // namespace moekit

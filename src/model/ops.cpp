// Device dispatch of the layer ops, view helpers and rotary frequency tables.
#include "model/ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>

#include "base/env.h"
#include "moekit/error.h"

namespace moekit::model {

#ifndef MOEKIT_WITH_CUDA
const DeviceOps* cuda_ops() { return nullptr; }
int64_t last_capture_kernel_nodes() { return 0; }
#endif

namespace {
thread_local Stream t_stream = nullptr;
}
Stream current_stream() { return t_stream; }
StreamScope::StreamScope(Stream s) : saved_(t_stream) { t_stream = s; }
StreamScope::~StreamScope() { t_stream = saved_; }

bool has_ops(Device device) { return device.is_cpu() ? true : cuda_ops() != nullptr; }

const DeviceOps& ops_for(Device device) {
  if (device.is_cpu()) return *cpu_ops();
  const DeviceOps* ops = cuda_ops();
  MOEKIT_CHECK_CODE(ops != nullptr, not_supported, "the model runtime has no layer ops for device ", device.to_string(),
                    " in this build; run the model on the CPU (device cpu)");
  return *ops;
}

int64_t row_stride(const TensorView& v, const char* what) {
  MOEKIT_CHECK(v.dim() == 2, what, " must be 2-D, got ", v.to_string());
  MOEKIT_CHECK(v.stride(1) == 1, what, " must have unit inner stride, got ", shape_to_string(v.strides));
  return v.stride(0);
}

LinearDims check_linear(const TensorView& x, const TensorView& w, const TensorView& bias, const TensorView& y) {
  const int64_t ldx = row_stride(x, "linear input");
  MOEKIT_CHECK(w.dim() == 2 && w.is_contiguous(), "linear weight must be a contiguous [N, K] tensor, got ",
               w.to_string());
  const int64_t M = x.shape[0], K = x.shape[1], N = w.shape[0];
  MOEKIT_CHECK(w.shape[1] == K, "linear: input has ", K, " features, weight ", w.to_string(), " expects ", w.shape[1]);
  MOEKIT_CHECK(y.dim() == 2 && y.shape[0] == M && y.shape[1] == N && y.is_contiguous(),
               "linear output must be a contiguous [", M, ", ", N, "] tensor, got ", y.to_string());
  if (bias.data) MOEKIT_CHECK(bias.numel() == N, "linear bias must have ", N, " values, got ", bias.to_string());
  return {M, K, N, ldx};
}

NormDims check_rmsnorm(const TensorView& x, const TensorView& w, const TensorView& y) {
  const int64_t ldx = row_stride(x, "rmsnorm input");
  const int64_t M = x.shape[0], D = x.shape[1];
  MOEKIT_CHECK(w.numel() == D, "rmsnorm weight has ", w.numel(), " values, rows have ", D);
  MOEKIT_CHECK(y.dim() == 2 && y.shape[0] == M && y.shape[1] == D, "rmsnorm output must be [", M, ", ", D, "], got ",
               y.to_string());
  return {M, D, ldx, row_stride(y, "rmsnorm output")};
}

AttentionDims check_attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              int64_t pos0, const TensorView& sinks) {
  MOEKIT_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "attention operands must be 3-D");
  for (const auto* t : {&q, &k, &v, &out})
    MOEKIT_CHECK(t->is_contiguous(), "attention operands must be contiguous, got ", t->to_string());
  const AttentionDims d{q.shape[0], q.shape[1], q.shape[2], k.shape[0], k.shape[1], v.shape[2]};
  MOEKIT_CHECK(k.shape[2] == d.Dk && v.shape[0] == d.S && v.shape[1] == d.Hkv && d.Hkv > 0 && d.Hq % d.Hkv == 0,
               "attention: q ", q.to_string(), ", k ", k.to_string(), ", v ", v.to_string(), " do not match");
  MOEKIT_CHECK(out.shape == Shape({d.T, d.Hq, d.Dv}), "attention output must be [", d.T, ", ", d.Hq, ", ", d.Dv,
               "], got ", out.to_string());
  MOEKIT_CHECK(pos0 >= 0 && pos0 + d.T <= d.S, "attention: queries at positions [", pos0, ", ", pos0 + d.T,
               ") need that many keys, got ", d.S);
  if (sinks.data)
    MOEKIT_CHECK(sinks.numel() == d.Hq, "attention sinks must have ", d.Hq, " values, got ", sinks.to_string());
  return d;
}

QkvDims check_qk_norm_rope_cache(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& q_norm, const TensorView& k_norm, int64_t pos0,
                                 const RopeSpec& rope, const TensorView& k_cache, const TensorView& v_cache) {
  for (const auto* t : {&q, &k, &v, &k_cache, &v_cache})
    MOEKIT_CHECK(t->dim() == 3 && t->is_contiguous() && t->dtype == q.dtype && t->device == q.device,
                 "qk_norm_rope_cache: q ", q.to_string(), ", k ", k.to_string(), ", v ", v.to_string(), ", caches ",
                 k_cache.to_string(), " and ", v_cache.to_string(), " must be contiguous 3-D tensors of one dtype and device");
  const QkvDims d{q.shape[0], q.shape[1], k.shape[1], q.shape[2]};
  MOEKIT_CHECK(k.shape == Shape({d.T, d.Hkv, d.D}) && v.shape == k.shape && k_cache.shape[1] == d.Hkv &&
                   k_cache.shape[2] == d.D && v_cache.shape == k_cache.shape,
               "qk_norm_rope_cache: q ", q.to_string(), ", k ", k.to_string(), ", v ", v.to_string(), ", caches ",
               k_cache.to_string(), " and ", v_cache.to_string(), " do not match");
  MOEKIT_CHECK(!q_norm.data || q_norm.numel() == d.D, "qk_norm_rope_cache: q norm weight ", q_norm.to_string(),
               " must have ", d.D, " values");
  MOEKIT_CHECK(!k_norm.data || k_norm.numel() == d.D, "qk_norm_rope_cache: k norm weight ", k_norm.to_string(),
               " must have ", d.D, " values");
  MOEKIT_CHECK(rope.rot_dim() <= d.D, "qk_norm_rope_cache: ", rope.rot_dim(), " rotated dims do not fit heads of ",
               d.D);
  MOEKIT_CHECK(pos0 >= 0 && pos0 + d.T <= k_cache.shape[0], "qk_norm_rope_cache: rows [", pos0, ", ", pos0 + d.T,
               ") out of range for the cache ", k_cache.to_string());
  return d;
}

void DeviceOps::qk_norm_rope_cache(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const TensorView& q_norm, const TensorView& k_norm, float eps,
                                   bool weight_before_cast, Position pos0, const RopeSpec& rope,
                                   const TensorView& k_cache, const TensorView& v_cache) const {
  const auto [T, Hq, Hkv, D] = check_qk_norm_rope_cache(q, k, v, q_norm, k_norm, pos0.value, rope, k_cache, v_cache);
  if (T == 0) return;
  if (q_norm.data) {
    const TensorView q2 = reshaped(q, {T * Hq, D});
    rmsnorm(q2, q_norm, eps, weight_before_cast, q2);
  }
  if (k_norm.data) {
    const TensorView k2 = reshaped(k, {T * Hkv, D});
    rmsnorm(k2, k_norm, eps, weight_before_cast, k2);
  }
  this->rope(q, 0, pos0, rope);
  this->rope(k, 0, pos0, rope);
  write_rows(k, k_cache, pos0);
  write_rows(v, v_cache, pos0);
}

ArgmaxDims check_argmax_rows(const TensorView& logits, const std::vector<int64_t>& suppress, const TensorView& out) {
  MOEKIT_CHECK(logits.dtype == DType::f32 && logits.dim() == 2 && logits.is_contiguous() && logits.shape[1] > 0,
               "argmax_rows: logits must be a contiguous [R, V] f32 tensor with V > 0, got ", logits.to_string());
  const int64_t R = logits.shape[0], V = logits.shape[1];
  MOEKIT_CHECK(out.dtype == DType::i64 && out.is_contiguous() && out.numel() == 2 * R && out.device == logits.device,
               "argmax_rows: output must be a contiguous i64 tensor of ", 2 * R, " values on ",
               logits.device.to_string(), ", got ", out.to_string());
  MOEKIT_CHECK(suppress.size() <= DeviceOps::kMaxSuppress, "argmax_rows: ", suppress.size(),
               " suppressed ids; at most ", DeviceOps::kMaxSuppress);
  return {R, V};
}

int64_t check_decode_attention(const TensorView& qkv, int64_t Hq, int64_t Hkv, const std::vector<DecodeSeq>& seqs,
                               const TensorView& out) {
  const int64_t B = int64_t(seqs.size());
  MOEKIT_CHECK(Hq > 0 && Hkv > 0 && Hq % Hkv == 0, "decode_attention: ", Hq, " query heads over ", Hkv,
               " key-value heads");
  MOEKIT_CHECK(qkv.dim() == 2 && qkv.shape[0] == B && qkv.shape[1] % (Hq + 2 * Hkv) == 0,
               "decode_attention: qkv ", qkv.to_string(), " must be [", B, ", (", Hq, " + 2 * ", Hkv, ") * D]");
  row_stride(qkv, "decode_attention qkv");
  const int64_t D = qkv.shape[1] / (Hq + 2 * Hkv);
  MOEKIT_CHECK(out.is_contiguous() && out.shape == Shape({B, Hq, D}) && out.dtype == qkv.dtype &&
                   out.device == qkv.device,
               "decode_attention: output ", out.to_string(), " must be a contiguous [", B, ", ", Hq, ", ", D, "] ",
               dtype_name(qkv.dtype), " tensor");
  for (int64_t i = 0; i < B; ++i) {
    const DecodeSeq& s = seqs[size_t(i)];
    for (const TensorView* c : {&s.k_cache, &s.v_cache})
      MOEKIT_CHECK(c->dim() == 3 && c->is_contiguous() && c->shape[1] == Hkv && c->shape[2] == D &&
                       c->dtype == qkv.dtype && c->device == qkv.device,
                   "decode_attention: sequence ", i, "'s cache ", c->to_string(), " must be a contiguous [S, ", Hkv,
                   ", ", D, "] ", dtype_name(qkv.dtype), " tensor on ", qkv.device.to_string());
    MOEKIT_CHECK(s.v_cache.shape[0] == s.k_cache.shape[0] && s.pos.value >= 0 && s.pos.value < s.kv_rows &&
                     s.kv_rows <= s.k_cache.shape[0],
                 "decode_attention: sequence ", i, " at position ", s.pos.value, " with ", s.kv_rows,
                 " rows given of the caches ", s.k_cache.to_string(), " and ", s.v_cache.to_string());
  }
  return D;
}

void DeviceOps::decode_attention(const TensorView& qkv, int64_t Hq, int64_t Hkv, const TensorView& q_norm,
                                 const TensorView& k_norm, float eps, bool weight_before_cast, const RopeSpec& rope,
                                 const std::vector<DecodeSeq>& seqs, float scale, int64_t window,
                                 const TensorView& sinks, const TensorView& out) const {
  const int64_t D = check_decode_attention(qkv, Hq, Hkv, seqs, out);
  const int64_t Nq = Hq * D, Nk = Hkv * D, ld = row_stride(qkv, "decode_attention qkv");
  const size_t es = dtype_nbytes(qkv.dtype, 1);
  char* base = static_cast<char*>(qkv.data);
  for (size_t i = 0; i < seqs.size(); ++i) {  // one row each
    const DecodeSeq& sq = seqs[i];
    char* row = base + size_t(int64_t(i) * ld) * es;
    const TensorView q(row, qkv.dtype, {1, Hq, D}, qkv.device), k(row + size_t(Nq) * es, qkv.dtype, {1, Hkv, D}, qkv.device);
    const TensorView v(row + size_t(Nq + Nk) * es, qkv.dtype, {1, Hkv, D}, qkv.device);
    qk_norm_rope_cache(q, k, v, q_norm, k_norm, eps, weight_before_cast, sq.pos, rope, sq.k_cache, sq.v_cache);
    attention(q, rows(sq.k_cache, 0, sq.kv_rows), rows(sq.v_cache, 0, sq.kv_rows), rows(out, int64_t(i), 1), sq.pos,
              scale, window, sinks);
  }
}

namespace {
EnvSwitch g_fused_decode{"MOEKIT_FUSED_DECODE", true};
EnvSwitch g_vector_decode_attention{"MOEKIT_VEC_DECODE_ATTENTION", true};
EnvSwitch g_fused_qk_attention{"MOEKIT_ATTN_FUSE_QK", true};
// On: the H100's decode step of the 4-layer Qwen3-30B-A3B-shaped model, 346.8 -> 341.3 us (128 prompt ids) and
// 361.2 -> 353.0 (1024), the same tokens.
EnvSwitch g_attention_prefetch{"MOEKIT_ATTN_PREFETCH", true};
EnvSwitch g_route_in_experts{"MOEKIT_ROUTE_IN_EXPERTS", false};
constexpr int64_t kSplitKeysDefault = 64;
std::atomic<int64_t> g_attention_split_keys{-1};  // -1: not read yet
// On: the H200's decode step of the 4-layer Qwen3-30B-A3B-shaped model, 340 -> 331 us, the same tokens.
EnvSwitch g_decode_ahead{"MOEKIT_DECODE_AHEAD", true};
}  // namespace
bool fused_decode() { return g_fused_decode.on(); }
void set_fused_decode(bool on) { g_fused_decode.set(on); }
bool vector_decode_attention() { return g_vector_decode_attention.on(); }
void set_vector_decode_attention(bool on) { g_vector_decode_attention.set(on); }
bool fused_qk_attention() { return g_fused_qk_attention.on(); }
void set_fused_qk_attention(bool on) { g_fused_qk_attention.set(on); }
bool route_in_experts() { return g_route_in_experts.on(); }
void set_route_in_experts(bool on) { g_route_in_experts.set(on); }
bool attention_prefetch() { return g_attention_prefetch.on(); }
void set_attention_prefetch(bool on) { g_attention_prefetch.set(on); }
int64_t attention_split_keys() {
  int64_t keys = g_attention_split_keys.load(std::memory_order_relaxed);
  if (keys < 0) {
    keys = env_int_in("MOEKIT_ATTN_SPLIT_KEYS", 1, int64_t(1) << 30, kSplitKeysDefault);
    int64_t expected = -1;
    if (!g_attention_split_keys.compare_exchange_strong(expected, keys)) keys = expected;
  }
  return keys;
}
void set_attention_split_keys(int64_t keys) {
  MOEKIT_CHECK(keys >= 1, "attention split keys must be at least 1, got ", keys);
  g_attention_split_keys.store(keys, std::memory_order_relaxed);
}
bool decode_ahead() { return g_decode_ahead.on(); }
void set_decode_ahead(bool on) { g_decode_ahead.set(on); }

void DeviceOps::greedy_pick_feed(const TensorView& logits, const std::vector<int64_t>& suppress,
                                 const TensorView& pick, const TensorView& io, int64_t* host, int64_t seq) const {
  argmax_rows(logits, suppress, pick);
  greedy_feed(pick, io, host, seq);
}

void DeviceOps::greedy_feed(const TensorView&, const TensorView& io, int64_t*, int64_t) const {
  MOEKIT_FAIL(not_supported, "greedy_feed: decode steps run ahead only on CUDA devices, got ", io.device.to_string());
}

namespace {
constexpr int64_t kGemvMaxRowsDefault = 3, kGemvMaxRowsLimit = 8;
std::atomic<int64_t> g_gemv_max_rows{-1};  // -1: not read yet
}
int64_t gemv_max_rows() {
  int64_t rows = g_gemv_max_rows.load(std::memory_order_relaxed);
  if (rows < 0) {
    int64_t want = kGemvMaxRowsDefault;
    if (const char* v = std::getenv("MOEKIT_GEMV_MAX_ROWS")) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      MOEKIT_CHECK(end != v && *end == '\0' && n >= 0 && n <= kGemvMaxRowsLimit,
                   "MOEKIT_GEMV_MAX_ROWS must be an integer from 0 to ", kGemvMaxRowsLimit, ", got '", v, "'");
      want = n;
    }
    int64_t expected = -1;
    g_gemv_max_rows.compare_exchange_strong(expected, want);
    rows = g_gemv_max_rows.load(std::memory_order_relaxed);
  }
  return rows;
}
void set_gemv_max_rows(int64_t rows) {
  MOEKIT_CHECK(rows >= 0 && rows <= kGemvMaxRowsLimit, "gemv max rows must be from 0 to ", kGemvMaxRowsLimit,
               ", got ", rows);
  g_gemv_max_rows.store(rows);
}

RouteDims check_route(const TensorView& logits, const TensorView& correction_bias, const RouterSpec& spec,
                      const TensorView& index, const TensorView& weights) {
  MOEKIT_CHECK(logits.dtype == DType::f32 && logits.dim() == 2 && logits.is_contiguous(),
               "router logits must be a contiguous f32 [T, E] tensor, got ", logits.to_string());
  const int64_t T = logits.shape[0], E = logits.shape[1], K = spec.top_k;
  MOEKIT_CHECK(K >= 1 && K <= E, "router top_k ", K, " must be in [1, ", E, "]");
  MOEKIT_CHECK(index.dtype == DType::i32 && index.shape == Shape({T, K}) && weights.dtype == DType::f32 &&
                   weights.shape == Shape({T, K}) && index.device == logits.device &&
                   weights.device == logits.device,
               "router outputs must be index i32 [", T, ", ", K, "] and weights f32 [", T, ", ", K, "] on ",
               logits.device.to_string());
  if (correction_bias.data)
    MOEKIT_CHECK(correction_bias.dtype == DType::f32 && correction_bias.numel() == E &&
                     correction_bias.device == logits.device,
                 "router correction bias must be f32 [", E, "] on ", logits.device.to_string(), ", got ",
                 correction_bias.to_string());
  if (spec.kind == RouterKind::grouped_sigmoid)
    MOEKIT_CHECK(spec.n_group >= 1 && E % spec.n_group == 0 && spec.topk_group >= 1 &&
                     spec.topk_group <= spec.n_group && K <= spec.topk_group * (E / spec.n_group),
                 "grouped router: n_group ", spec.n_group, ", topk_group ", spec.topk_group, " and top_k ", K,
                 " do not fit ", E, " experts");
  return {T, E, K};
}

TensorView rows(const TensorView& t, int64_t begin, int64_t count) {
  MOEKIT_CHECK(t.dim() >= 1 && begin >= 0 && count >= 0 && begin + count <= t.shape[0], "rows [", begin, ", ",
               begin + count, ") out of range for ", t.to_string());
  TensorView v = t;
  const int64_t stride0 = t.stride(0);
  v.data = static_cast<char*>(t.data) + size_t(begin * stride0) * dtype_nbytes(t.dtype, 1);
  v.shape[0] = count;
  if (!t.strides.empty()) v.strides = t.strides;
  return v;
}

TensorView columns(const TensorView& t, int64_t begin, int64_t count) {
  MOEKIT_CHECK(t.dim() == 2 && begin >= 0 && count >= 0 && begin + count <= t.shape[1], "columns [", begin, ", ",
               begin + count, ") out of range for ", t.to_string());
  MOEKIT_CHECK(t.stride(1) == 1, "columns: the innermost stride must be 1, got ", t.stride(1));
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + size_t(begin) * dtype_nbytes(t.dtype, 1);
  v.strides = {t.stride(0), 1};
  v.shape = {t.shape[0], count};
  return v;
}

TensorView reshaped(const TensorView& t, const Shape& shape) {
  MOEKIT_CHECK(t.is_contiguous(), "reshaped: needs a contiguous view, got ", t.to_string());
  TensorView v = t;
  v.shape = shape;
  v.strides.clear();
  MOEKIT_CHECK(v.numel() == t.numel(), "cannot view ", shape_to_string(t.shape), " as ", shape_to_string(shape));
  return v;
}

RopeSpec make_rope(const RopeConfig& rc, int64_t head_dim, int64_t max_position_embeddings) {
  RopeSpec r;
  const int64_t dim = int64_t(double(head_dim) * rc.partial_rotary_factor);
  MOEKIT_CHECK(dim > 0 && dim % 2 == 0 && dim <= head_dim, "rotary dimension ", dim, " (head_dim ", head_dim,
               " x partial_rotary_factor ", rc.partial_rotary_factor, ") must be even and in (0, head_dim]");
  const int64_t half = dim / 2;
  const double base = rc.theta;
  // transformers computes the exponents and powers in float32.
  std::vector<float> pos_freqs(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float e = float(2 * i) / float(dim);
    pos_freqs[size_t(i)] = std::pow(float(base), e);
  }
  r.inv_freq.resize(size_t(half));
  for (int64_t i = 0; i < half; ++i) r.inv_freq[size_t(i)] = 1.0f / pos_freqs[size_t(i)];

  if (rc.type == "default") return r;
  if (rc.type == "linear") {
    for (auto& f : r.inv_freq) f = float(f / rc.factor);
    return r;
  }
  if (rc.type == "yarn") {
    const double factor = rc.factor;
    auto get_mscale = [](double scale, double mscale) {
      return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
    };
    double attention_factor;
    if (rc.attention_factor)
      attention_factor = *rc.attention_factor;
    else if (rc.mscale && rc.mscale_all_dim && *rc.mscale != 0 && *rc.mscale_all_dim != 0)
      attention_factor = get_mscale(factor, *rc.mscale) / get_mscale(factor, *rc.mscale_all_dim);
    else
      attention_factor = get_mscale(factor, 1.0);
    const double orig =
        double(rc.original_max_position_embeddings > 0 ? rc.original_max_position_embeddings : max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return (double(dim) * std::log(orig / (rotations * 2 * M_PI))) / (2 * std::log(base));
    };
    double low = correction_dim(rc.beta_fast), high = correction_dim(rc.beta_slow);
    if (rc.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, double(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < half; ++i) {
      const float ramp = std::clamp(float((float(i) - float(low)) / float(high - low)), 0.0f, 1.0f);
      const float extrapolation_factor = 1.0f - ramp;
      const float extra = 1.0f / pos_freqs[size_t(i)];
      const float inter = 1.0f / (float(factor) * pos_freqs[size_t(i)]);
      r.inv_freq[size_t(i)] = inter * (1.0f - extrapolation_factor) + extra * extrapolation_factor;
    }
    r.attention_scaling = float(attention_factor);
    return r;
  }
  if (rc.type == "llama3") {
    const double factor = rc.factor, lo = rc.low_freq_factor, hi = rc.high_freq_factor;
    const double old_ctx =
        double(rc.original_max_position_embeddings > 0 ? rc.original_max_position_embeddings : max_position_embeddings);
    const double low_wavelen = old_ctx / lo, high_wavelen = old_ctx / hi;
    for (auto& f : r.inv_freq) {
      const double wavelen = 2 * M_PI / double(f);
      double v = wavelen > low_wavelen ? double(f) / factor : double(f);
      const double smooth = (old_ctx / wavelen - lo) / (hi - lo);
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      if (medium) v = (1 - smooth) * v / factor + smooth * v;
      f = float(v);
    }
    return r;
  }
  MOEKIT_FAIL(not_supported, "rope_type '", rc.type, "' is not supported; supported: default, linear, yarn, llama3");
}

}  // namespace moekit::model

// Internal: the layer ops the model runtime is written with, dispatched by device.
//
// Every op takes tensor views (data on the op's device), computes in f32 whatever the storage dtype
// (f32 | bf16 | f16) and writes its output in the output's dtype. 2-D inputs may carry a row stride
// (strides {ld, 1}); outputs are contiguous unless stated. The CPU implementation is ops_cpu.cpp, the CUDA
// one ops_cuda.cu. CUDA ops are enqueued on the thread's current stream (StreamScope) and never wait for
// the host, so a sequence of them can be captured into a CUDA graph (capture()).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "moekit/config.h"
#include "moekit/experts.h"
#include "moekit/tensor.h"

namespace moekit::model {

struct RopeSpec {
  std::vector<float> inv_freq;  // [rot_dim / 2]
  float attention_scaling = 1.0f;
  bool interleaved = false;  // DeepSeek: pairs (x0, x1), (x2, x3), ... ; else halves
  int64_t rot_dim() const { return int64_t(inv_freq.size()) * 2; }
};
// The inverse frequencies and cos/sin scaling of transformers' ROPE_INIT_FUNCTIONS for `rope` over `head_dim`.
RopeSpec make_rope(const RopeConfig& rope, int64_t head_dim, int64_t max_position_embeddings);

struct RouterSpec {
  RouterKind kind = RouterKind::softmax_topk;
  int64_t top_k = 1;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  int64_t n_group = 1, topk_group = 1;
};

// A sequence position: `value` as the host knows it at the call, or (CUDA only) read by the kernels from
// `device` (one int64 in device memory) when set, so that one captured decode step replays at successive
// positions. Host-side checks use `value`.
struct Position {
  int64_t value = 0;
  const int64_t* device = nullptr;
};

// The stream the calling thread's CUDA ops are enqueued on while the scope lives (nullptr: the legacy
// default stream). Scopes nest.
Stream current_stream();
class StreamScope {
 public:
  explicit StreamScope(Stream s);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  Stream saved_;
};

// A recorded sequence of ops, replayed on the stream it was captured on.
class StepGraph {
 public:
  virtual ~StepGraph() = default;
  virtual void replay() const = 0;
};

// One sequence of a decode step's attention (DeviceOps::decode_attention).
struct DecodeSeq {
  TensorView k_cache, v_cache;  // [S, Hkv, D]
  Position pos;                 // the new token's position (its cache row)
  int64_t kv_rows = 0;          // the cache rows the attention is given (pos + 1 <= kv_rows <= S)
};

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  // out [n, H] = table [V, H] rows ids [n] (i64 on the op's device). Ids on the host are checked against V;
  // on a GPU the caller checks them (an id out of range there gives a row of zeros, never a wild read).
  virtual void embedding(const TensorView& ids, const TensorView& table, const TensorView& out) const = 0;
  // y [M, N] = x [M, K] @ w [N, K]^T + bias [N] (bias.data may be null).
  virtual void linear(const TensorView& x, const TensorView& w, const TensorView& bias, const TensorView& y) const = 0;
  // y [M, D] = rmsnorm(x [M, D]) * w [D]; x may equal y. weight_before_cast: (w * x_hat) rounded once
  // (gpt-oss), else w * round(x_hat) as transformers' RMSNorm does in low precision.
  virtual void rmsnorm(const TensorView& x, const TensorView& w, float eps, bool weight_before_cast,
                       const TensorView& y) const = 0;
  // h [M, D] += a (in place, both contiguous), then y = rmsnorm(h) * w as rmsnorm does: the residual add
  // and the next norm in one pass.
  virtual void add_rmsnorm(const TensorView& h, const TensorView& a, const TensorView& w, float eps,
                           bool weight_before_cast, const TensorView& y) const = 0;
  // In place on x [T, heads, S] (strides allowed on the first two dimensions): rotates dims
  // [offset, offset + rot_dim) of every head; row t sits at position pos0 + t.
  virtual void rope(const TensorView& x, int64_t offset, Position pos0, const RopeSpec& rope) const = 0;
  // out [T, Hq, Dv] = softmax(q k^T * scale) v with q [T, Hq, Dk], k [S, Hkv, Dk], v [S, Hkv, Dv]
  // (Hq a multiple of Hkv, S >= pos0 + T: rows past the last key are not read). Query t sits at position
  // pos0 + t and sees keys j <= pos0 + t, and only j > pos0 + t - window when window > 0. sinks [Hq]
  // (data may be null): one extra logit per head that takes probability mass and contributes no value.
  virtual void attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                         Position pos0, float scale, int64_t window, const TensorView& sinks) const = 0;
  // dst rows [row0, row0 + n) = src [n, ...] (same dtype and row size; both contiguous).
  virtual void write_rows(const TensorView& src, const TensorView& dst, Position row0) const = 0;
  // out [M, I] = act(gate_up[:, :I]) * gate_up[:, I:]  (gate_up [M, 2I]).
  virtual void act_mul(const TensorView& gate_up, Activation act, const TensorView& out) const = 0;
  // out = a + b, same shapes; out may alias a or b.
  virtual void add(const TensorView& a, const TensorView& b, const TensorView& out) const = 0;
  // out [M, H] += sigmoid(gate [M, 1]) * x [M, H]  (qwen2_moe's shared expert).
  virtual void add_sigmoid_gated(const TensorView& x, const TensorView& gate, const TensorView& out) const = 0;
  // x = clamp(x, -limit, limit) in place.
  virtual void clamp(const TensorView& x, float limit) const = 0;
  // Router selection: logits [T, E] f32 -> index [T, K] i32, weights [T, K] f32.
  // correction_bias [E] f32 (grouped_sigmoid only; data may be null).
  virtual void route(const TensorView& logits, const TensorView& correction_bias, const RouterSpec& spec,
                     const TensorView& index, const TensorView& weights) const = 0;
  // Multi-head latent attention: kvb [T, H * (nope + dv)] and the roped shared key k_rot [T, rope] give
  // k [T, H, nope + rope] (k_nope then k_rot) and v [T, H, dv], written at rows [row0, row0 + T) of the
  // caches k [S, H, nope + rope] and v [S, H, dv].
  virtual void mla_expand(const TensorView& kvb, const TensorView& k_rot, int64_t nope, const TensorView& k,
                          const TensorView& v, Position row0) const = 0;
  // The attention inputs of one sequence's new tokens, prepared for attention: q [T, Hq, D] and k [T, Hkv, D]
  // get the per-head RMS norms q_norm / k_norm [D] (when their data are set; else none), then the rotary
  // embedding of dims [0, rot_dim) at positions pos0 + t, in place; then the rows of k and v [T, Hkv, D]
  // go to rows [pos0, pos0 + T) of the caches k_cache / v_cache [S, Hkv, D]. All contiguous, one dtype.
  // Same result as rmsnorm, rope and write_rows in that order (this default runs them); a device may
  // override it with one kernel (the decode step's fusion).
  virtual void qk_norm_rope_cache(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& q_norm, const TensorView& k_norm, float eps,
                                  bool weight_before_cast, Position pos0, const RopeSpec& rope,
                                  const TensorView& k_cache, const TensorView& v_cache) const;
  // The decode step's attention of B sequences with one new token each: row i of qkv [B, (Hq + 2 Hkv) D] (q
  // heads, then k, then v; unit inner stride) is sequence i's. Per sequence, qk_norm_rope_cache (norms when
  // their data are set, rotary, the cache writes at seqs[i].pos; q and k rewritten in place), then attention
  // over the first kv_rows rows of its caches into row i of out [B, Hq, D]. This default runs those two ops
  // per sequence; a device may override it with one launch of each over all the sequences.
  virtual void decode_attention(const TensorView& qkv, int64_t Hq, int64_t Hkv, const TensorView& q_norm,
                                const TensorView& k_norm, float eps, bool weight_before_cast, const RopeSpec& rope,
                                const std::vector<DecodeSeq>& seqs, float scale, int64_t window,
                                const TensorView& sinks, const TensorView& out) const;
  // Greedy choice per row: out [R, 2] i64 (on the op's device) gets, for row r of logits [R, V] f32 (contiguous),
  // the first index of the largest value with the ids in `suppress` counted as -inf (ids outside [0, V) ignored;
  // index 0 when every value is -inf), and 1 when the row holds no NaN or Inf, else 0 (the index is then
  // unspecified: the caller reports the row). The host sampler's greedy choice for finite rows. At most
  // kMaxSuppress ids.
  static constexpr size_t kMaxSuppress = 16;
  virtual void argmax_rows(const TensorView& logits, const std::vector<int64_t>& suppress,
                           const TensorView& out) const = 0;
  // The greedy pick of a one-sequence decode step handed to the next step and to the host without a wait:
  // io ({token, position}: [2] i64 on the device, a graphed step's input) becomes {pick[0], io[1] + 1}, and
  // host[0], host[1] (page-locked host memory) get pick[0], pick[1], then host[2] gets seq, written last, so
  // that the host may poll host[2] for seq and then read the pick. The default: Error(not_supported).
  virtual void greedy_feed(const TensorView& pick, const TensorView& io, int64_t* host, int64_t seq) const;
  // argmax_rows of one row of logits into pick ([2] i64), then greedy_feed(pick, io, host, seq). The default calls
  // the two; CUDA hands the pick over in the choice's own last launch.
  virtual void greedy_pick_feed(const TensorView& logits, const std::vector<int64_t>& suppress, const TensorView& pick,
                                const TensorView& io, int64_t* host, int64_t seq) const;
  // Records what `body` enqueues on the current stream into a graph (nothing runs). Throws
  // Error(not_supported) on devices without graphs.
  virtual std::unique_ptr<StepGraph> capture(const std::function<void()>& body) const = 0;
};

// Host memory that a device's step inputs and outputs cross in: page-locked for a CUDA device (copies to and from
// it run asynchronously, without a staging copy), plain memory for the CPU. get() grows it (contents not kept).
class HostStaging {
 public:
  HostStaging() = default;
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;
  void* get(size_t bytes, Device device);

 private:
  void release() noexcept;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool pinned_ = false;
};

// Shape checks shared by the device implementations (dtypes and devices are theirs to check). Each throws
// Error(invalid_argument) naming the operands, and returns the sizes the op runs over.
struct LinearDims {
  int64_t M, K, N, ldx;
};
LinearDims check_linear(const TensorView& x, const TensorView& w, const TensorView& bias, const TensorView& y);
struct NormDims {
  int64_t M, D, ldx, ldy;
};
NormDims check_rmsnorm(const TensorView& x, const TensorView& w, const TensorView& y);
struct AttentionDims {
  int64_t T, Hq, Dk, S, Hkv, Dv;
};
AttentionDims check_attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              int64_t pos0, const TensorView& sinks);
struct RouteDims {
  int64_t T, E, K;
};
RouteDims check_route(const TensorView& logits, const TensorView& correction_bias, const RouterSpec& spec,
                      const TensorView& index, const TensorView& weights);
struct QkvDims {
  int64_t T, Hq, Hkv, D;
};
// decode_attention's operands; returns D.
int64_t check_decode_attention(const TensorView& qkv, int64_t Hq, int64_t Hkv, const std::vector<DecodeSeq>& seqs,
                               const TensorView& out);
struct ArgmaxDims {
  int64_t R, V;
};
// argmax_rows' operands (logits contiguous [R, V] f32, V > 0; out contiguous [R, 2] i64 on its device; at most
// kMaxSuppress ids).
ArgmaxDims check_argmax_rows(const TensorView& logits, const std::vector<int64_t>& suppress, const TensorView& out);
QkvDims check_qk_norm_rope_cache(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& q_norm, const TensorView& k_norm, int64_t pos0,
                                 const RopeSpec& rope, const TensorView& k_cache, const TensorView& v_cache);
// Whether the model's decode step uses the fused forms (one QKV projection, decode_attention; on CUDA also the
// GEMV for linears of few rows, gemv_max_rows): on unless
// the environment sets MOEKIT_FUSED_DECODE=0 (read once), or set_fused_decode says otherwise (tests; a model's
// recorded decode graph keeps the form it was recorded with).
bool fused_decode();
void set_fused_decode(bool on);
// Whether the CUDA decode_attention reads 16-bit caches with heads of 64, 128 or 256 dims in 16-byte pieces (all of
// a key tile's loads in flight) rather than one element at a time: on unless MOEKIT_VEC_DECODE_ATTENTION=0 (read
// once) or set_vector_decode_attention says otherwise (tests; a recorded decode graph keeps its kernel).
bool vector_decode_attention();
void set_vector_decode_attention(bool on);
// Whether the CUDA decode_attention of that 16-byte-load kernel also norms and rotates q and k and writes the new
// key and value to the caches (no launch before it): on unless MOEKIT_ATTN_FUSE_QK=0 (read once) or
// set_fused_qk_attention says otherwise (tests; a recorded decode graph keeps its kernels).
bool fused_qk_attention();
void set_fused_qk_attention(bool on);
// Whether the CUDA decode_attention of the 16-byte-load kernel with its norms fused copies each block's cached
// keys and values into shared memory before its PDL wait (they were written by earlier steps), so that the loads
// overlap the QKV projection and the tile loop reads shared memory; its splits then also fit that memory. On
// unless MOEKIT_ATTN_PREFETCH=0 (read once) or set_attention_prefetch says otherwise (tests; a recorded decode
// graph keeps its kernels).
bool attention_prefetch();
void set_attention_prefetch(bool on);
// Whether the model's MoE blocks on CUDA let the experts route the tokens from the router logits
// (ExpertsCall::routing: batched_mm's decode GEMVs route inside their own launches, the route launch goes) for
// the softmax_topk and topk_softmax routers. Off unless MOEKIT_ROUTE_IN_EXPERTS=1 (read once) or
// set_route_in_experts says otherwise (tests; a recorded decode graph keeps its kernels). Measured slower: the
// H100's decode step 346.8 -> 358.5 us (the second projection's blocks route before their first weight loads).
bool route_in_experts();
void set_route_in_experts(bool on);
// The fewest keys a split of the CUDA decode attention takes (rounded up to whole tiles of 64): 64 unless
// MOEKIT_ATTN_SPLIT_KEYS (read once) or set_attention_split_keys says otherwise (tests). More: fewer splits, no
// merge launch for caches of that many rows or fewer.
int64_t attention_split_keys();
void set_attention_split_keys(int64_t keys);
// The most rows a CUDA linear of 16-bit weights runs as the decode step's GEMV (fused decode); more go to cuBLAS,
// which streams the weights faster from about 4 rows on. 3 unless MOEKIT_GEMV_MAX_ROWS (0 to 8, read once) or
// set_gemv_max_rows says otherwise. Linears of f32 weights (the router) keep the GEMV up to 8 rows.
int64_t gemv_max_rows();
void set_gemv_max_rows(int64_t rows);
// Whether greedy generation of one sequence with CUDA graphs runs its decode steps ahead: step n + 1 is queued
// (its token and position fed on the device by greedy_feed) before step n's token is read back, so that the
// host's part of each step overlaps the device's. On unless MOEKIT_DECODE_AHEAD=0 in the environment (read once)
// or set_decode_ahead says otherwise.
bool decode_ahead();
void set_decode_ahead(bool on);
// The kernel nodes of the last graph the CUDA ops' capture() recorded in this process (0 before any, and
// without CUDA): what one decode step launches, for tests and measurements.
int64_t last_capture_kernel_nodes();
// The row stride of a 2-D view with unit inner stride.
int64_t row_stride(const TensorView& v, const char* what);

const DeviceOps* cpu_ops();
const DeviceOps* cuda_ops();  // nullptr in a build without CUDA
bool has_ops(Device device);
// The ops of a device; throws Error(not_supported) naming the device when there are none.
const DeviceOps& ops_for(Device device);

// Views: rows [begin, begin + count) of a tensor's first dimension, and a 2-D column range with a row stride.
TensorView rows(const TensorView& t, int64_t begin, int64_t count);
TensorView columns(const TensorView& t2d, int64_t begin, int64_t count);
TensorView reshaped(const TensorView& t, const Shape& shape);  // contiguous views only

}  // namespace moekit::model

// Internal: the CUDA kernels of the model's layer ops (ops_cuda.cu), behind raw pointers. Each function takes
// device pointers, element-type codes, sizes and a stream, enqueues its kernel(s) and returns the launch status;
// nothing here knows tensors, checks shapes or allocates. Operands of a call may have different element types
// (codes below); accumulation is in f32 with one rounding to the output type.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moekit::model::kernels {

constexpr int kF32 = 0, kBF16 = 1, kF16 = 2;  // element types (f32, bf16, f16)

// Positions (KV-cache rows) come as (value, device): read on the device when `device` is set, else `value`,
// so that one recorded graph serves every decode step.

// out[i, :] = table[ids[i], :] for i < n (rows of ids outside [0, V) read as zeros); table [V, H].
cudaError_t embedding(const int64_t* ids, int64_t n, int64_t V, int64_t H, const void* table, int tt, void* out, int ot,
                      cudaStream_t s);

// y [M, N] = bias [N] on every row.
cudaError_t fill_bias(const void* bias, int bt, void* y, int yt, int64_t M, int64_t N, cudaStream_t s);
// y [M, K] (contiguous) = x [M, K] (row stride ldx), converted.
cudaError_t convert_rows(const void* x, int xt, int64_t ldx, void* y, int yt, int64_t M, int64_t K, cudaStream_t s);

// y = rmsnorm(x) * w over rows of D (see DeviceOps::rmsnorm for weight_before_cast).
cudaError_t rmsnorm(const void* x, int xt, int64_t ldx, const void* w, int wt, void* y, int yt, int64_t ldy, int64_t M,
                    int64_t D, float eps, bool weight_before_cast, cudaStream_t s);
// h = round(h + a) in place, then y = rmsnorm(h) * w; all [M, D] contiguous.
cudaError_t add_rmsnorm(void* h, int ht, const void* a, int at, const void* w, int wt, void* y, int yt, int64_t M,
                        int64_t D, float eps, bool weight_before_cast, cudaStream_t s);

// y [M, N] = x [M, K] w [N, K]^T + bias (null: none) for M <= kSmallM rows, operands of any element types.
constexpr int kSmallM = 8;
cudaError_t small_m_linear(const void* x, int xt, int64_t ldx, const void* w, int wt, const void* bias, int bt, void* y,
                           int yt, int M, int64_t N, int64_t K, cudaStream_t s);

// The decode step's GEMV: y [M, N] = x [M, K] w [N, K]^T + bias (null: none) for M <= kGemvMaxM rows of a 16-bit x
// and w of x's type or f32 (the router), each weight row read once; sms: the device's multiprocessors. gemv_ok:
// whether it serves these operands (sizes, types, 16-byte alignment of the weight pieces).
constexpr int kGemvMaxM = 8;
bool gemv_ok(const void* x, int xt, int64_t ldx, const void* w, int wt, int M, int64_t K);
cudaError_t gemv(const void* x, int xt, int64_t ldx, const void* w, int wt, const void* bias, int bt, void* y, int yt,
                 int M, int64_t N, int64_t K, int sms, cudaStream_t s);
// Which form gemv runs: the streaming one (one wave, even split; default) or the first one (MOEKIT_GEMV_STREAM=0 in
// the environment, read once). set_gemv_stream returns the previous setting.
bool gemv_stream();
bool set_gemv_stream(bool on);

constexpr int kMaxRopeHalf = 256;
struct RopeArgs {
  float inv_freq[kMaxRopeHalf];
  int half = 0;
  int interleaved = 0;
  float scaling = 1.0f;
};
// Rotates dims [offset, offset + 2 * half) of x [T, NH, S] (strides s0, s1, 1) in place, at positions pos + t.
cudaError_t rope(void* x, int t, int64_t s0, int64_t s1, int64_t T, int64_t NH, int64_t offset, int64_t pos_value,
                 const int64_t* pos_device, const RopeArgs& a, cudaStream_t s);

// The decode step's attention inputs of T tokens: q [T, Hq, D] and k [T, Hkv, D] get the per-head RMS norms
// (q_norm / k_norm [D] of types qwt / kwt, or null: none) and the rotary embedding of dims [0, 2 * half) at
// positions pos + t, in place (as rmsnorm, then rope); k and v [T, Hkv, D] rows go to rows pos + t of the caches
// [S, Hkv, D] (rows at or past S are not written). q, k, v and the caches share type t. One kernel.
constexpr int kMaxQkvHeadDim = 1024;
cudaError_t qk_norm_rope_cache(void* q, void* k, const void* v, int t, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                               const void* q_norm, int qwt, const void* k_norm, int kwt, float eps,
                               bool weight_before_cast, int64_t pos_value, const int64_t* pos_device, void* k_cache,
                               void* v_cache, int64_t S, const RopeArgs& a, cudaStream_t s);

// The KV caches and positions of the sequences of one decode step (one new token each: row i of q, k, v is
// sequence i's), passed by value to the kernels. With one entry, every row uses it, row t at position pos + t.
constexpr int kMaxDecodeSeqs = 32;
struct DecodeSeqs {
  int n = 0;
  void* k_cache[kMaxDecodeSeqs];
  void* v_cache[kMaxDecodeSeqs];
  int64_t rows[kMaxDecodeSeqs];  // cache rows S (rows at or past S are never written or read)
  int64_t pos_value[kMaxDecodeSeqs];
  const int64_t* pos_device[kMaxDecodeSeqs];
};

constexpr int kAttnThreads = 128, kAttnTile = 64, kAttnMaxDv = 4 * kAttnThreads;
constexpr int kAttnMaxSplits = 64;  // splits of the keys per (query, head) at most (attention_combine_kernel)
struct AttentionArgs {
  const void* q;  // [T, Hq, Dk]
  const void* k;  // [S, Hkv, Dk] cache rows
  const void* v;  // [S, Hkv, Dv]
  void* out;      // [T, Hq, Dv]
  int t;          // element type of q, k, v and out
  int Hq, Hkv, Dk, Dv;
  int64_t T;
  int64_t pos_value;
  const int64_t* pos_device;
  float scale;
  int64_t window;     // > 0: sliding window of that many keys
  const void* sinks;  // [Hq] or null
  int sink_t;
  int64_t splits, chunk;  // the keys in `splits` chunks of `chunk` (multiple of kAttnTile)
  float* part;            // splits > 1: [T * Hq * splits, Dv + 2] f32 scratch
  // Decode steps of several sequences: query t at q + t * ldq reads the caches and position of seqs entry t
  // (k, v and the positions above unused). Null: one sequence, q [T, Hq, Dk] contiguous.
  const DecodeSeqs* seqs = nullptr;
  int64_t ldq = 0;
  // With seqs: 16-byte loads (16-bit caches, Dk == Dv of 64, 128 or 256, 16-byte aligned caches), else the
  // scalar kernel.
  bool vec = false;
  // With seqs: q, k and v are the rows of one QKV projection (k and v heads k_off and v_off elements after a
  // row's q); the per-head norms (q_norm / k_norm of types qwt / kwt, or null), the rotary embedding and the cache
  // writes of qk_norm_rope_cache_seqs happen here first: inside the 16-byte-load kernel where vec applies and
  // qk_inside asks for it (the new key and value read from the row, not the cache), else by that kernel's own
  // launch before.
  bool qk = false;
  bool qk_inside = true;
  int64_t k_off = 0, v_off = 0;
  const void* q_norm = nullptr;
  int qwt = 0;
  const void* k_norm = nullptr;
  int kwt = 0;
  float eps = 0.0f;
  bool weight_before_cast = false;
  const RopeArgs* rope = nullptr;
  // With the norms inside the 16-byte-load kernel: each block copies its split's cached keys and values (all but
  // the new one) into shared memory before its PDL wait; the chunk must fit (attention_prefetch_keys). The merge
  // of the splits then also loads its first values with the maxima and sums rather than after them.
  bool prefetch = false;
};
// The shared memory the decode attention's prefetch may take per block, and the keys (with their values) of heads
// of D dims, es bytes a value, that fit it.
constexpr size_t kAttnPrefetchBytes = 192 * 1024;
constexpr int64_t attention_prefetch_keys(int64_t D, size_t es) {
  return D > 0 && es > 0 ? int64_t(kAttnPrefetchBytes / (2 * size_t(D) * es)) : 0;
}
// Causal attention of the T queries at positions pos .. pos + T - 1 (flash-decoding when splits > 1).
cudaError_t attention(const AttentionArgs& a, cudaStream_t s);

// Rows [row0, row0 + bytes / row_bytes) of dst = src (bytes in all), row0 read as a position.
cudaError_t write_rows(const void* src, void* dst, int64_t bytes, int64_t row_bytes, int64_t row0_value,
                       const int64_t* row0_device, cudaStream_t s);
// MLA: cache rows row0 + t of k [., H, nope + rope] = [kvb k_nope | k_rot[t]] and of v [., H, dv] = kvb v, from
// kvb [T, H, nope + dv] and k_rot [T, rope] (row stride ld_rot).
cudaError_t mla_expand(const void* kvb, const void* k_rot, int64_t ld_rot, int in_t, void* k, void* v, int out_t,
                       int64_t T, int64_t H, int64_t nope, int64_t rope, int64_t dv, int64_t row0_value,
                       const int64_t* row0_device, cudaStream_t s);

// out [M, I] = act(gu[:, :I]) * gu[:, I:] (gu row stride ld_gu); act: a base/activation.h code.
cudaError_t act_mul(const void* gu, int gt, int64_t ld_gu, void* out, int ot, int64_t M, int64_t I, int act,
                    cudaStream_t s);
// out = a + b, n elements.
cudaError_t add(const void* a, int at, const void* b, int bt, void* out, int ot, int64_t n, cudaStream_t s);
// out[m, :] += round(sigmoid(gate[m])) * x[m, :], products rounded to x's type; [M, H].
cudaError_t add_sigmoid_gated(const void* x, int xt, const void* gate, int gt, void* out, int ot, int64_t M, int64_t H,
                              cudaStream_t s);
// x = clamp(x, -limit, limit), n elements in place.
cudaError_t clamp(void* x, int t, int64_t n, float limit, cudaStream_t s);

// Routers: index / weights [T, K] from f32 logits [T, E] (bias: grouped_sigmoid's correction, or null).
constexpr int kRouteMaxPerLane = 32;  // E <= 1024
constexpr int kRouteMaxK = 32;
constexpr int kRouteMaxGroups = 32;
constexpr int kRouteSoftmaxTopk = 0, kRouteTopkSoftmax = 1, kRouteGroupedSigmoid = 2;
cudaError_t route(const float* logits, const float* bias, int64_t T, int E, int K, int kind, bool norm, float scale,
                  int n_group, int topk_group, int32_t* index, float* weights, cudaStream_t s);

// Greedy choice per row (DeviceOps::argmax_rows): out[2r] = the first index of the largest value of row r of
// logits [R, V] f32 with the ids of `suppress` counted as -inf, out[2r + 1] = 1 when the row is all finite, else 0.
constexpr int kArgmaxMaxSuppress = 16;
struct Suppress {
  int n = 0;
  int64_t ids[kArgmaxMaxSuppress];
};
// work: argmax_work_bytes(R, V) bytes of device memory (the per-block candidates; R <= 65535).
size_t argmax_work_bytes(int64_t R, int64_t V);
cudaError_t argmax_rows(const float* logits, int64_t R, int64_t V, const Suppress& suppress, int64_t* out, void* work,
                        cudaStream_t s);
// argmax_rows of one row into pick [2], then greedy_feed's hand-over of pick to io and host, in the same launches.
cudaError_t argmax_feed(const float* logits, int64_t V, const Suppress& suppress, int64_t* pick, void* work,
                        int64_t* io, int64_t* host, int64_t seq, cudaStream_t s);
// DeviceOps::greedy_feed: io[0] = pick[0], io[1] += 1; host[0], host[1] = pick[0], pick[1], then (after a system
// fence) host[2] = seq. host: page-locked memory mapped for the device.
cudaError_t greedy_feed(const int64_t* pick, int64_t* io, int64_t* host, int64_t seq, cudaStream_t s);

}  // namespace moekit::model::kernels

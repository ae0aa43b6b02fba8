// The model runtime's CUDA layer ops (the DeviceOps of ops.h): cuBLAS for the projections, small kernels
// for the rest. Every op is enqueued on the thread's current stream (StreamScope), reads positions from
// device memory when given one, allocates nothing while a graph is being recorded and never waits for the
// host, so one decode step can be captured and replayed (capture()).
//
// Numerics follow ops_cpu.cpp: f32 accumulation, one rounding to the output dtype; the attention is an
// online softmax over tiles of keys (same result as the CPU's two passes up to f32 rounding).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "base/activation.h"
#include "base/cuda_device.h"
#include "base/env.h"
#include "model/kernels/layer_kernels.h"
#include "model/ops.h"
#include "moekit/error.h"

namespace moekit::model {
namespace {

using cuda::DeviceGuard;
using kernels::kBF16;
using kernels::kF16;
using kernels::kF32;

cudaStream_t stream() { return static_cast<cudaStream_t>(current_stream()); }

int code(const TensorView& v, const char* what) {
  MOEKIT_CHECK(v.device.is_cuda(), what, " must be on a CUDA device, got ", v.to_string());
  switch (v.dtype) {
    case DType::f32: return kF32;
    case DType::bf16: return kBF16;
    case DType::f16: return kF16;
    default: MOEKIT_FAIL(invalid_argument, what, " must be f32, bf16 or f16, got ", v.to_string());
  }
}

std::atomic<int64_t> g_capture_kernels{0};

class CudaGraph final : public StepGraph {
 public:
  CudaGraph(cudaGraph_t g, cudaGraphExec_t e, cudaStream_t s, int device) : graph_(g), exec_(e), stream_(s), device_(device) {}
  ~CudaGraph() override {
    DeviceGuard guard(device_);
    (void)cudaGraphExecDestroy(exec_);
    (void)cudaGraphDestroy(graph_);
  }
  void replay() const override {
    DeviceGuard guard(device_);
    MOEKIT_CUDA_CALL(cudaGraphLaunch(exec_, stream_));
  }

 private:
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
  int device_;
};

// The split of the keys for the decode attention (flash-decoding): few (query, head) pairs spread over more
// blocks, then merged. It depends on S (the cache rows given), not on the position, so a recorded graph keeps
// its shape. Chunks cover absolute key indices [0, S); with a window narrower than S, one split. The fewest keys
// a split takes is attention_split_keys() (rounded up to whole tiles). With the prefetch (attention_prefetch()),
// a chunk also fits the block's shared memory for its keys and values (heads of D dims, es bytes a value);
// prefetch says whether it does (else the blocks load their tiles in the loop, after the wait).
struct AttentionSplit {
  int64_t splits, chunk;
  bool prefetch;
};
AttentionSplit attention_split(int64_t bh, int64_t S, int64_t window, int dev, int64_t D = 0, size_t es = 0) {
  using kernels::kAttnTile;
  const int64_t keys_max = window > 0 ? std::min(window, S) : S;
  const int64_t target = 2 * int64_t(cuda::device_info(dev).multiprocessors);
  int64_t splits = std::clamp<int64_t>((target + bh - 1) / bh, 1, std::max<int64_t>(1, (keys_max + kAttnTile - 1) / kAttnTile));
  splits = std::min<int64_t>(splits, kernels::kAttnMaxSplits);
  int64_t chunk = std::max<int64_t>(attention_split_keys(), (S + splits - 1) / splits);
  if (window > 0 && keys_max < S) splits = 1, chunk = S;
  const auto tiles = [](int64_t c) { return (c + kAttnTile - 1) / kAttnTile * kAttnTile; };
  chunk = tiles(chunk);
  bool prefetch = false;
  if (D > 0 && attention_prefetch()) {
    const int64_t fit = kernels::attention_prefetch_keys(D, es) / kAttnTile * kAttnTile;
    const int64_t c = std::min(chunk, std::max<int64_t>(fit, kAttnTile));
    if (fit >= kAttnTile && (S + c - 1) / c <= kernels::kAttnMaxSplits && !(window > 0 && keys_max < S && c < S))
      chunk = c, prefetch = true;
  }
  splits = (S + chunk - 1) / chunk;
  return {splits, chunk, prefetch};
}

kernels::RopeArgs rope_args(const RopeSpec& rope) {
  const int64_t half = int64_t(rope.inv_freq.size());
  MOEKIT_CHECK(half <= kernels::kMaxRopeHalf, "rope: ", 2 * half, " rotated dims; the CUDA ops support up to ",
               2 * kernels::kMaxRopeHalf);
  kernels::RopeArgs a;
  for (int64_t i = 0; i < half; ++i) a.inv_freq[i] = rope.inv_freq[size_t(i)];
  a.half = int(half);
  a.interleaved = rope.interleaved ? 1 : 0;
  a.scaling = rope.attention_scaling;
  return a;
}

class CudaOps final : public DeviceOps {
 public:
  void embedding(const TensorView& ids, const TensorView& table, const TensorView& out) const override {
    const int tt = code(table, "embedding table"), ot = code(out, "embedding output");
    MOEKIT_CHECK(ids.dtype == DType::i64 && ids.device == table.device && ids.is_contiguous(),
                 "embedding ids must be contiguous i64 on ", table.device.to_string(), ", got ", ids.to_string());
    MOEKIT_CHECK(table.dim() == 2 && table.is_contiguous(), "embedding table must be a contiguous [V, H] tensor");
    const int64_t n = ids.numel(), V = table.shape[0], H = table.shape[1];
    MOEKIT_CHECK(out.is_contiguous() && out.numel() == n * H, "embedding output must hold [", n, ", ", H, "]");
    if (n == 0) return;
    DeviceGuard g(table.device.index);
    MOEKIT_CUDA_CALL(kernels::embedding(ids.ptr<int64_t>(), n, V, H, table.data, tt, out.data, ot, stream()));
  }

  void linear(const TensorView& x, const TensorView& w, const TensorView& bias, const TensorView& y) const override {
    int xt = code(x, "linear input"), wt = code(w, "linear weight");
    const int yt = code(y, "linear output");
    const LinearDims dims = check_linear(x, w, bias, y);
    const int64_t M = dims.M, K = dims.K, N = dims.N;
    int64_t ldx = dims.ldx;
    if (M == 0 || N == 0) return;
    const int dev = x.device.index;
    DeviceGuard g(dev);
    const cudaStream_t s = stream();
    // The decode step's few rows (fused decode): a GEMV that streams each weight row once, up to gemv_max_rows()
    // rows (cuBLAS reads the weights better from there on) and for f32 weights (the router) up to kGemvMaxM.
    if (M <= kernels::kGemvMaxM && (M <= gemv_max_rows() || wt != xt) && fused_decode() &&
        kernels::gemv_ok(x.data, xt, ldx, w.data, wt, int(M), K)) {
      MOEKIT_CUDA_CALL(kernels::gemv(x.data, xt, ldx, w.data, wt, bias.data, bias.data ? code(bias, "linear bias") : 0,
                                     y.data, yt, int(M), N, K, cuda::device_info(dev).multiprocessors, s));
      return;
    }
    if (xt != wt && M <= kernels::kSmallM) {
      MOEKIT_CUDA_CALL(kernels::small_m_linear(x.data, xt, ldx, w.data, wt, bias.data,
                                               bias.data ? code(bias, "linear bias") : 0, y.data, yt, int(M), N, K, s));
      return;
    }
    // cuBLAS multiplies operands of one dtype; a lone f32 operand turns the other into f32 (exact).
    const void* xp = x.data;
    const void* wp = w.data;
    size_t need = 0;
    const bool cvt_x = xt != wt && xt != kF32, cvt_w = xt != wt && wt != kF32;
    const size_t x_bytes = size_t(M * K) * 4, w_bytes = size_t(N * K) * 4;
    // Output: into y when cuBLAS can write its dtype for these operands, else into f32 scratch then converted.
    const int op_t = cvt_x || cvt_w ? kF32 : xt;
    const bool direct = yt == kF32 || yt == op_t;
    const size_t y_bytes = direct ? 0 : size_t(M * N) * 4;
    need = (cvt_x ? x_bytes : 0) + (cvt_w ? w_bytes : 0) + y_bytes;
    char* ws = need ? static_cast<char*>(scratch().get(dev, s, need)) : nullptr;
    if (cvt_x) {
      MOEKIT_CUDA_CALL(kernels::convert_rows(x.data, xt, ldx, ws, kF32, M, K, s));
      xp = ws;
      ws += x_bytes;
      ldx = K;
      xt = kF32;
    }
    if (cvt_w) {
      MOEKIT_CUDA_CALL(kernels::convert_rows(w.data, wt, K, ws, kF32, N, K, s));
      wp = ws;
      ws += w_bytes;
      wt = kF32;
    }
    void* yp = direct ? y.data : ws;
    const int yp_t = direct ? yt : kF32;
    float beta = 0.0f;
    if (bias.data) {
      MOEKIT_CUDA_CALL(kernels::fill_bias(bias.data, code(bias, "linear bias"), yp, yp_t, M, N, s));
      beta = 1.0f;
    }
    auto cuda_type = [](int t) { return t == kF32 ? CUDA_R_32F : t == kBF16 ? CUDA_R_16BF : CUDA_R_16F; };
    const float alpha = 1.0f;
    auto& h = *cublas(dev);
    {
      std::lock_guard<std::mutex> lock(h.mutex());
      MOEKIT_CUBLAS_CALL(cublasSetStream(h.get(), s));
      void* cws = cublas_workspace().get(dev, s, kCublasWorkspace);
      MOEKIT_CUBLAS_CALL(cublasSetWorkspace(h.get(), cws, kCublasWorkspace));
      // Row-major y [M, N] = x [M, K] w [N, K]^T is column-major y^T [N, M] = w^T x^T.
      MOEKIT_CUBLAS_CALL(cublasGemmEx(h.get(), CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &alpha, wp,
                                      cuda_type(wt), int(K), xp, cuda_type(xt), int(ldx), &beta, yp, cuda_type(yp_t),
                                      int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    if (!direct) {
      MOEKIT_CUDA_CALL(kernels::convert_rows(yp, kF32, N, y.data, yt, M, N, s));
    }
  }

  void rmsnorm(const TensorView& x, const TensorView& w, float eps, bool weight_before_cast,
               const TensorView& y) const override {
    const int xt = code(x, "rmsnorm input"), wt = code(w, "rmsnorm weight"), yt = code(y, "rmsnorm output");
    const auto [M, D, ldx, ldy] = check_rmsnorm(x, w, y);
    if (M == 0) return;
    DeviceGuard g(x.device.index);
    MOEKIT_CUDA_CALL(
        kernels::rmsnorm(x.data, xt, ldx, w.data, wt, y.data, yt, ldy, M, D, eps, weight_before_cast, stream()));
  }

  void add_rmsnorm(const TensorView& h, const TensorView& a, const TensorView& w, float eps, bool weight_before_cast,
                   const TensorView& y) const override {
    const int ht = code(h, "residual"), at = code(a, "residual addend"), wt = code(w, "rmsnorm weight");
    const int yt = code(y, "rmsnorm output");
    MOEKIT_CHECK(h.dim() == 2 && h.is_contiguous() && a.shape == h.shape && a.is_contiguous() && y.shape == h.shape &&
                     y.is_contiguous(),
                 "add_rmsnorm: residual ", h.to_string(), ", addend ", a.to_string(), " and output ", y.to_string(),
                 " must be contiguous [M, D] tensors");
    const int64_t M = h.shape[0], D = h.shape[1];
    MOEKIT_CHECK(w.numel() == D, "rmsnorm weight has ", w.numel(), " values, rows have ", D);
    if (M == 0) return;
    DeviceGuard g(h.device.index);
    MOEKIT_CUDA_CALL(
        kernels::add_rmsnorm(h.data, ht, a.data, at, w.data, wt, y.data, yt, M, D, eps, weight_before_cast, stream()));
  }

  void rope(const TensorView& x, int64_t offset, Position pos, const RopeSpec& rope) const override {
    const int t = code(x, "rope input");
    MOEKIT_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope input must be [T, heads, S] with unit inner stride, got ",
                 x.to_string());
    const int64_t T = x.shape[0], NH = x.shape[1], S = x.shape[2], half = int64_t(rope.inv_freq.size());
    MOEKIT_CHECK(half <= kernels::kMaxRopeHalf, "rope: ", 2 * half, " rotated dims; the CUDA ops support up to ",
                 2 * kernels::kMaxRopeHalf);
    MOEKIT_CHECK(offset >= 0 && offset + 2 * half <= S, "rope: dims [", offset, ", ", offset + 2 * half,
                 ") do not fit heads of size ", S);
    if (T == 0 || NH == 0 || half == 0) return;
    kernels::RopeArgs a;
    for (int64_t i = 0; i < half; ++i) a.inv_freq[i] = rope.inv_freq[size_t(i)];
    a.half = int(half);
    a.interleaved = rope.interleaved ? 1 : 0;
    a.scaling = rope.attention_scaling;
    DeviceGuard g(x.device.index);
    MOEKIT_CUDA_CALL(
        kernels::rope(x.data, t, x.stride(0), x.stride(1), T, NH, offset, pos.value, pos.device, a, stream()));
  }

  void qk_norm_rope_cache(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& q_norm,
                          const TensorView& k_norm, float eps, bool weight_before_cast, Position pos,
                          const RopeSpec& rope, const TensorView& k_cache, const TensorView& v_cache) const override {
    const int t = code(q, "qk_norm_rope_cache q");
    const auto [T, Hq, Hkv, D] = check_qk_norm_rope_cache(q, k, v, q_norm, k_norm, pos.value, rope, k_cache, v_cache);
    const int64_t half = int64_t(rope.inv_freq.size());
    MOEKIT_CHECK(half <= kernels::kMaxRopeHalf, "rope: ", 2 * half, " rotated dims; the CUDA ops support up to ",
                 2 * kernels::kMaxRopeHalf);
    MOEKIT_CHECK(D <= kernels::kMaxQkvHeadDim, "qk_norm_rope_cache: heads of ", D,
                 " dims; the CUDA kernel supports up to ", kernels::kMaxQkvHeadDim);
    const int qwt = q_norm.data ? code(q_norm, "q norm weight") : 0;
    const int kwt = k_norm.data ? code(k_norm, "k norm weight") : 0;
    if (T == 0) return;
    kernels::RopeArgs a;
    for (int64_t i = 0; i < half; ++i) a.inv_freq[i] = rope.inv_freq[size_t(i)];
    a.half = int(half);
    a.interleaved = rope.interleaved ? 1 : 0;
    a.scaling = rope.attention_scaling;
    DeviceGuard g(q.device.index);
    MOEKIT_CUDA_CALL(kernels::qk_norm_rope_cache(q.data, k.data, v.data, t, T, Hq, Hkv, D, q_norm.data, qwt,
                                                 k_norm.data, kwt, eps, weight_before_cast, pos.value, pos.device,
                                                 k_cache.data, v_cache.data, k_cache.shape[0], a, stream()));
  }

  void attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out, Position pos,
                 float scale, int64_t window, const TensorView& sinks) const override {
    const int qt = code(q, "attention q");
    MOEKIT_CHECK(code(k, "attention k") == qt && code(v, "attention v") == qt && code(out, "attention output") == qt,
                 "attention operands must share one dtype: q ", q.to_string(), ", k ", k.to_string(), ", v ",
                 v.to_string(), ", out ", out.to_string());
    const auto [T, Hq, Dk, S, Hkv, Dv] = check_attention(q, k, v, out, pos.value, sinks);
    using kernels::kAttnTile;
    MOEKIT_CHECK(Dv <= kernels::kAttnMaxDv, "attention: value heads of ", Dv, " dims; the CUDA ops support up to ",
                 kernels::kAttnMaxDv);
    const int sink_t = sinks.data ? code(sinks, "attention sinks") : 0;
    if (T == 0) return;
    const int dev = q.device.index;
    DeviceGuard g(dev);
    const cudaStream_t s = stream();
    const size_t smem = size_t(Dk + kAttnTile) * sizeof(float);
    MOEKIT_CHECK(smem <= 48 * 1024, "attention: key heads of ", Dk, " dims do not fit the CUDA kernel");
    const int64_t bh = T * Hq;
    const AttentionSplit sp = attention_split(bh, S, window, dev);
    const int64_t splits = sp.splits, chunk = sp.chunk;
    float* part = nullptr;
    if (splits > 1)
      part = static_cast<float*>(scratch().get(dev, s, size_t(bh * splits * (Dv + 2)) * sizeof(float)));
    const kernels::AttentionArgs args{.q = q.data,
                                      .k = k.data,
                                      .v = v.data,
                                      .out = out.data,
                                      .t = qt,
                                      .Hq = int(Hq),
                                      .Hkv = int(Hkv),
                                      .Dk = int(Dk),
                                      .Dv = int(Dv),
                                      .T = T,
                                      .pos_value = pos.value,
                                      .pos_device = pos.device,
                                      .scale = scale,
                                      .window = window,
                                      .sinks = sinks.data,
                                      .sink_t = sink_t,
                                      .splits = splits,
                                      .chunk = chunk,
                                      .part = part};
    MOEKIT_CUDA_CALL(kernels::attention(args, s));
  }

  void decode_attention(const TensorView& qkv, int64_t Hq, int64_t Hkv, const TensorView& q_norm,
                        const TensorView& k_norm, float eps, bool weight_before_cast, const RopeSpec& rope,
                        const std::vector<DecodeSeq>& seqs, float scale, int64_t window, const TensorView& sinks,
                        const TensorView& out) const override {
    const int t = code(qkv, "decode_attention qkv");
    const int64_t D = check_decode_attention(qkv, Hq, Hkv, seqs, out);
    const int64_t B = int64_t(seqs.size());
    MOEKIT_CHECK(rope.rot_dim() <= D, "decode_attention: ", rope.rot_dim(), " rotated dims do not fit heads of ", D);
    MOEKIT_CHECK(D <= kernels::kMaxQkvHeadDim && D <= kernels::kAttnMaxDv &&
                     size_t(D + kernels::kAttnTile) * sizeof(float) <= 48 * 1024,
                 "decode_attention: heads of ", D, " dims; the CUDA kernels support up to ", kernels::kAttnMaxDv);
    MOEKIT_CHECK(!q_norm.data || q_norm.numel() == D, "decode_attention: q norm weight ", q_norm.to_string(),
                 " must have ", D, " values");
    MOEKIT_CHECK(!k_norm.data || k_norm.numel() == D, "decode_attention: k norm weight ", k_norm.to_string(),
                 " must have ", D, " values");
    if (sinks.data)
      MOEKIT_CHECK(sinks.numel() == Hq, "attention sinks must have ", Hq, " values, got ", sinks.to_string());
    const int qwt = q_norm.data ? code(q_norm, "q norm weight") : 0;
    const int kwt = k_norm.data ? code(k_norm, "k norm weight") : 0;
    const int sink_t = sinks.data ? code(sinks, "attention sinks") : 0;
    if (B == 0) return;
    const kernels::RopeArgs ra = rope_args(rope);
    const int dev = qkv.device.index;
    DeviceGuard g(dev);
    const cudaStream_t s = stream();
    const int64_t ld = row_stride(qkv, "decode_attention qkv"), Nq = Hq * D, Nk = Hkv * D;
    const size_t es = dtype_nbytes(qkv.dtype, 1);
    // Up to kMaxDecodeSeqs sequences per launch (their caches and positions go by value).
    for (int64_t b0 = 0; b0 < B; b0 += kernels::kMaxDecodeSeqs) {
      const int64_t n = std::min<int64_t>(kernels::kMaxDecodeSeqs, B - b0);
      kernels::DecodeSeqs tab{};
      tab.n = int(n);
      int64_t S = 1;
      for (int64_t i = 0; i < n; ++i) {
        const DecodeSeq& sq = seqs[size_t(b0 + i)];
        tab.k_cache[i] = sq.k_cache.data;
        tab.v_cache[i] = sq.v_cache.data;
        tab.rows[i] = sq.k_cache.shape[0];
        tab.pos_value[i] = sq.pos.value;
        tab.pos_device[i] = sq.pos.device;
        S = std::max(S, sq.kv_rows);
      }
      char* row = static_cast<char*>(qkv.data) + size_t(b0 * ld) * es;
      const int64_t bh = n * Hq;
      const auto [splits, chunk, prefetch] = attention_split(bh, S, window, dev, D, es);
      float* part = nullptr;
      if (splits > 1)
        part = static_cast<float*>(scratch().get(dev, s, size_t(bh * splits * (D + 2)) * sizeof(float)));
      kernels::AttentionArgs args{.q = row,
                                  .k = nullptr,
                                  .v = nullptr,
                                  .out = static_cast<char*>(out.data) + size_t(b0 * Hq * D) * es,
                                  .t = t,
                                  .Hq = int(Hq),
                                  .Hkv = int(Hkv),
                                  .Dk = int(D),
                                  .Dv = int(D),
                                  .T = n,
                                  .pos_value = 0,
                                  .pos_device = nullptr,
                                  .scale = scale,
                                  .window = window,
                                  .sinks = sinks.data,
                                  .sink_t = sink_t,
                                  .splits = splits,
                                  .chunk = chunk,
                                  .part = part,
                                  .seqs = &tab,
                                  .ldq = ld,
                                  .vec = vector_decode_attention(),
                                  .qk = true,
                                  .qk_inside = fused_qk_attention(),
                                  .k_off = Nq,
                                  .v_off = Nq + Nk,
                                  .q_norm = q_norm.data,
                                  .qwt = qwt,
                                  .k_norm = k_norm.data,
                                  .kwt = kwt,
                                  .eps = eps,
                                  .weight_before_cast = weight_before_cast,
                                  .rope = &ra,
                                  .prefetch = prefetch};
      MOEKIT_CUDA_CALL(kernels::attention(args, s));
    }
  }

  void write_rows(const TensorView& src, const TensorView& dst, Position row0) const override {
    MOEKIT_CHECK(src.dtype == dst.dtype && src.is_contiguous() && dst.is_contiguous() && src.dim() >= 1 &&
                     dst.dim() == src.dim() && src.device.is_cuda() && dst.device == src.device,
                 "write_rows: source ", src.to_string(), " and destination ", dst.to_string(),
                 " must be contiguous tensors of one dtype, rank and CUDA device");
    const int64_t n = src.shape[0];
    const int64_t row_bytes = n > 0 ? int64_t(dtype_nbytes(src.dtype, src.numel() / n)) : 0;
    MOEKIT_CHECK(n == 0 || (dst.numel() / std::max<int64_t>(dst.shape[0], 1)) == src.numel() / n,
                 "write_rows: rows of ", src.to_string(), " do not match ", dst.to_string());
    MOEKIT_CHECK(row0.value >= 0 && row0.value + n <= dst.shape[0], "write_rows: rows [", row0.value, ", ",
                 row0.value + n, ") out of range for ", dst.to_string());
    if (n == 0 || row_bytes == 0) return;
    DeviceGuard g(src.device.index);
    const cudaStream_t s = stream();
    if (!row0.device) {
      MOEKIT_CUDA_CALL(cudaMemcpyAsync(static_cast<char*>(dst.data) + row0.value * row_bytes, src.data,
                                       size_t(n * row_bytes), cudaMemcpyDeviceToDevice, s));
      return;
    }
    MOEKIT_CUDA_CALL(
        kernels::write_rows(src.data, dst.data, n * row_bytes, row_bytes, row0.value, row0.device, s));
  }

  void act_mul(const TensorView& gu, Activation act, const TensorView& out) const override {
    const int gt = code(gu, "act_mul input"), ot = code(out, "act_mul output");
    const int64_t ld = row_stride(gu, "act_mul input");
    const int64_t M = gu.shape[0], I = gu.shape[1] / 2;
    MOEKIT_CHECK(
        gu.shape[1] % 2 == 0 && out.dim() == 2 && out.shape[0] == M && out.shape[1] == I && out.is_contiguous(),
        "act_mul: input ", gu.to_string(), " and output ", out.to_string(), " do not match");
    if (M * I == 0) return;
    DeviceGuard g(gu.device.index);
    MOEKIT_CUDA_CALL(kernels::act_mul(gu.data, gt, ld, out.data, ot, M, I, act::code_of(act), stream()));
  }

  void add(const TensorView& a, const TensorView& b, const TensorView& out) const override {
    const int at = code(a, "add input"), bt = code(b, "add input"), ot = code(out, "add output");
    MOEKIT_CHECK(
        a.shape == b.shape && a.shape == out.shape && a.is_contiguous() && b.is_contiguous() && out.is_contiguous(),
        "add: shapes ", a.to_string(), ", ", b.to_string(), ", ", out.to_string(), " must match");
    const int64_t n = a.numel();
    if (n == 0) return;
    DeviceGuard g(a.device.index);
    MOEKIT_CUDA_CALL(kernels::add(a.data, at, b.data, bt, out.data, ot, n, stream()));
  }

  void add_sigmoid_gated(const TensorView& x, const TensorView& gate, const TensorView& out) const override {
    const int xt = code(x, "gated add input"), gt = code(gate, "gated add gate"), ot = code(out, "gated add output");
    MOEKIT_CHECK(x.dim() == 2 && x.shape == out.shape && x.is_contiguous() && out.is_contiguous() &&
                     gate.numel() == x.shape[0] && gate.is_contiguous(),
                 "gated add: x ", x.to_string(), ", gate ", gate.to_string(), ", out ", out.to_string());
    const int64_t M = x.shape[0], H = x.shape[1];
    if (M * H == 0) return;
    DeviceGuard g(x.device.index);
    MOEKIT_CUDA_CALL(kernels::add_sigmoid_gated(x.data, xt, gate.data, gt, out.data, ot, M, H, stream()));
  }

  void clamp(const TensorView& x, float limit) const override {
    const int t = code(x, "clamp input");
    MOEKIT_CHECK(x.is_contiguous(), "clamp input must be contiguous, got ", x.to_string());
    const int64_t n = x.numel();
    if (n == 0) return;
    DeviceGuard g(x.device.index);
    MOEKIT_CUDA_CALL(kernels::clamp(x.data, t, n, limit, stream()));
  }

  void route(const TensorView& logits, const TensorView& correction_bias, const RouterSpec& spec,
             const TensorView& index, const TensorView& weights) const override {
    MOEKIT_CHECK(logits.device.is_cuda(), "router logits must be on a CUDA device, got ", logits.to_string());
    const auto [T, E, K] = check_route(logits, correction_bias, spec, index, weights);
    using namespace kernels;  // kRoute*
    MOEKIT_CHECK(E <= 32 * kRouteMaxPerLane && K <= kRouteMaxK, "router: ", E, " experts, top_k ", K,
                 "; the CUDA router supports up to ", 32 * kRouteMaxPerLane, " experts and top_k ", kRouteMaxK);
    const float* bias = correction_bias.data ? correction_bias.ptr<float>() : nullptr;
    int kind = kRouteSoftmaxTopk;
    if (spec.kind == RouterKind::topk_softmax) kind = kRouteTopkSoftmax;
    if (spec.kind == RouterKind::grouped_sigmoid) {
      kind = kRouteGroupedSigmoid;
      MOEKIT_CHECK(spec.n_group <= kRouteMaxGroups, "grouped router: ", spec.n_group,
                   " groups; the CUDA router supports up to ", kRouteMaxGroups);
    }
    if (T == 0) return;
    DeviceGuard g(logits.device.index);
    MOEKIT_CUDA_CALL(kernels::route(logits.ptr<float>(), bias, T, int(E), int(K), kind, spec.norm_topk_prob,
                                    spec.routed_scaling_factor, int(spec.n_group), int(spec.topk_group),
                                    index.ptr<int32_t>(), weights.ptr<float>(), stream()));
  }

  void mla_expand(const TensorView& kvb, const TensorView& k_rot, int64_t nope, const TensorView& k,
                  const TensorView& v, Position row0) const override {
    const int in_t = code(kvb, "mla kv_b output");
    MOEKIT_CHECK(code(k_rot, "mla k_rot") == in_t, "mla_expand: k_rot ", k_rot.to_string(), " and kv_b output ",
                 kvb.to_string(), " must share a dtype");
    const int out_t = code(k, "mla key cache");
    MOEKIT_CHECK(code(v, "mla value cache") == out_t, "mla_expand: caches must share a dtype");
    MOEKIT_CHECK(k.dim() == 3 && v.dim() == 3 && k.is_contiguous() && v.is_contiguous() && kvb.is_contiguous(),
                 "mla_expand: k ", k.to_string(), " and v ", v.to_string(), " must be contiguous 3-D");
    const int64_t ld_rot = row_stride(k_rot, "mla k_rot");
    const int64_t T = k_rot.shape[0], H = k.shape[1], dk = k.shape[2], dv = v.shape[2], rope = dk - nope;
    MOEKIT_CHECK(kvb.numel() == T * H * (nope + dv) && k_rot.shape[1] == rope && v.shape[1] == H &&
                     v.shape[0] == k.shape[0],
                 "mla_expand: kvb ", kvb.to_string(), ", k_rot ", k_rot.to_string(), ", k ", k.to_string(), ", v ",
                 v.to_string(), " do not match");
    MOEKIT_CHECK(row0.value >= 0 && row0.value + T <= k.shape[0], "mla_expand: rows [", row0.value, ", ",
                 row0.value + T, ") out of range for the cache ", k.to_string());
    if (T == 0) return;
    DeviceGuard g(kvb.device.index);
    MOEKIT_CUDA_CALL(kernels::mla_expand(kvb.data, k_rot.data, ld_rot, in_t, k.data, v.data, out_t, T, H, nope, rope,
                                         dv, row0.value, row0.device, stream()));
  }

  void argmax_rows(const TensorView& logits, const std::vector<int64_t>& suppress,
                   const TensorView& out) const override {
    const auto [R, V] = check_argmax_rows(logits, suppress, out);
    MOEKIT_CHECK(logits.device.is_cuda(), "argmax_rows: logits must be on a CUDA device, got ", logits.to_string());
    if (R == 0) return;
    MOEKIT_CHECK(R <= 65535, "argmax_rows: ", R, " rows; the CUDA ops take up to 65535 at once");
    const int dev = logits.device.index;
    DeviceGuard g(dev);
    const cudaStream_t s = stream();
    void* work = pick_scratch().get(dev, s, kernels::argmax_work_bytes(R, V));
    MOEKIT_CUDA_CALL(
        kernels::argmax_rows(logits.ptr<float>(), R, V, to_suppress(suppress), out.ptr<int64_t>(), work, s));
  }

  void greedy_pick_feed(const TensorView& logits, const std::vector<int64_t>& suppress, const TensorView& pick,
                        const TensorView& io, int64_t* host, int64_t seq) const override {
    const auto [R, V] = check_argmax_rows(logits, suppress, pick);
    MOEKIT_CHECK(R == 1 && logits.device.is_cuda(), "greedy_pick_feed: logits ", logits.to_string(),
                 " must be one row on a CUDA device");
    check_feed("greedy_pick_feed", pick, io, host);
    const int dev = logits.device.index;
    DeviceGuard g(dev);
    const cudaStream_t s = stream();
    void* work = pick_scratch().get(dev, s, kernels::argmax_work_bytes(1, V));
    MOEKIT_CUDA_CALL(kernels::argmax_feed(logits.ptr<float>(), V, to_suppress(suppress), pick.ptr<int64_t>(), work,
                                          io.ptr<int64_t>(), host, seq, s));
  }

  void greedy_feed(const TensorView& pick, const TensorView& io, int64_t* host, int64_t seq) const override {
    check_feed("greedy_feed", pick, io, host);
    DeviceGuard g(io.device.index);
    MOEKIT_CUDA_CALL(kernels::greedy_feed(pick.ptr<int64_t>(), io.ptr<int64_t>(), host, seq, stream()));
  }

  std::unique_ptr<StepGraph> capture(const std::function<void()>& body) const override {
    const cudaStream_t s = stream();
    MOEKIT_CHECK_CODE(s != nullptr, invalid_argument,
                      "graph capture needs a stream of its own (StreamScope), not the legacy default stream");
    int dev = 0;
    MOEKIT_CUDA_CALL(cudaGetDevice(&dev));
    const cuda::RecordedGraph g = cuda::record_graph(s, body);
    auto out = std::make_unique<CudaGraph>(g.graph, g.exec, s, dev);  // owns them from here
    size_t n = 0;
    MOEKIT_CUDA_CALL(cudaGraphGetNodes(g.graph, nullptr, &n));
    std::vector<cudaGraphNode_t> nodes(n);
    if (n > 0) MOEKIT_CUDA_CALL(cudaGraphGetNodes(g.graph, nodes.data(), &n));
    int64_t kernels = 0;
    for (size_t i = 0; i < n; ++i) {
      cudaGraphNodeType type{};
      MOEKIT_CUDA_CALL(cudaGraphNodeGetType(nodes[i], &type));
      kernels += type == cudaGraphNodeTypeKernel ? 1 : 0;
    }
    g_capture_kernels.store(kernels);
    return out;
  }

 private:
  // Per (device, stream): grow-only scratch for operand conversions and attention splits, and cuBLAS's
  // workspace (made before any capture: the first, uncaptured step sizes it).
  static constexpr size_t kCublasWorkspace = size_t(32) << 20;
  static cuda::StreamScratch& scratch() {
    static cuda::StreamScratch w("the layer ops", size_t(1) << 20);
    return w;
  }
  static kernels::Suppress to_suppress(const std::vector<int64_t>& suppress) {
    static_assert(DeviceOps::kMaxSuppress <= size_t(kernels::kArgmaxMaxSuppress));
    kernels::Suppress sup{};
    sup.n = int(suppress.size());
    for (size_t i = 0; i < suppress.size(); ++i) sup.ids[i] = suppress[i];
    return sup;
  }
  // greedy_feed's operands: pick [>= 2] and io [2] contiguous i64 on one CUDA device, a host buffer.
  static void check_feed(const char* op, const TensorView& pick, const TensorView& io, const int64_t* host) {
    MOEKIT_CHECK(pick.dtype == DType::i64 && pick.numel() >= 2 && pick.is_contiguous() && pick.device.is_cuda() &&
                     io.dtype == DType::i64 && io.numel() == 2 && io.is_contiguous() && io.device == pick.device &&
                     host != nullptr,
                 op, ": pick ", pick.to_string(), " and io ", io.to_string(),
                 " must be contiguous i64 on one CUDA device ([>= 2] and [2]), with a host buffer");
  }
  // The greedy pick's per-block candidates: apart from the layer ops' scratch, which a recorded decode graph points
  // into, so that a pick after a replay never grows (moves) a buffer the graph reads.
  static cuda::StreamScratch& pick_scratch() {
    static cuda::StreamScratch w("the greedy pick", size_t(64) << 10);
    return w;
  }
  static cuda::StreamScratch& cublas_workspace() {
    static cuda::StreamScratch w("the layer ops' cuBLAS workspace", kCublasWorkspace);
    return w;
  }
  static std::shared_ptr<cuda::CublasHandle> cublas(int device) {
    static std::mutex mutex;
    static std::map<int, std::shared_ptr<cuda::CublasHandle>> handles;
    std::lock_guard<std::mutex> lock(mutex);
    auto& h = handles[device];
    if (!h) h = cuda::shared_cublas_handle(device);
    return h;
  }
};

}  // namespace

int64_t last_capture_kernel_nodes() { return g_capture_kernels.load(); }

const DeviceOps* cuda_ops() {
  static const CudaOps ops;
  return &ops;
}

}  // namespace moekit::model

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
#include <climits>
#include <cmath>
#include <map>
#include <mutex>
#include <utility>

#include "backends/cuda/common.h"
#include "backends/cuda/kernels/device_math.cuh"
#include "model/ops.h"
#include "moekit/error.h"

namespace moekit::model {
namespace {

using cuda::DeviceBuffer;
using cuda::DeviceGuard;
using cuda::kernels::activate;
using cuda::kernels::bf16;
using cuda::kernels::f16;
using cuda::kernels::from_f32;
using cuda::kernels::to_f32;

// ---- element access by run-time dtype (uniform across a launch) ----

constexpr int kF32 = 0, kBF16 = 1, kF16 = 2;

__device__ __forceinline__ float ld(const void* p, int t, int64_t i) {
  if (t == kF32) return static_cast<const float*>(p)[i];
  if (t == kBF16) return __bfloat162float(static_cast<const bf16*>(p)[i]);
  return __half2float(static_cast<const f16*>(p)[i]);
}
__device__ __forceinline__ void st(void* p, int t, int64_t i, float v) {
  if (t == kF32)
    static_cast<float*>(p)[i] = v;
  else if (t == kBF16)
    static_cast<bf16*>(p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<f16*>(p)[i] = __float2half_rn(v);
}
// The value an f32 takes once stored in dtype t.
__device__ __forceinline__ float round_as(int t, float v) {
  if (t == kBF16) return __bfloat162float(__float2bfloat16_rn(v));
  if (t == kF16) return __half2float(__float2half_rn(v));
  return v;
}
__device__ __forceinline__ int64_t position(int64_t value, const int64_t* device) {
  return device ? *device : value;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0;
  for (int w = 0; w < warps; ++w) s += red[w];
  return s;
}

// ---- kernels ----

__global__ void embedding_kernel(const int64_t* ids, int64_t V, int64_t H, const void* table, int tt, void* out,
                                 int ot) {
  const int64_t i = blockIdx.x;
  const int64_t id = ids[i];
  const bool ok = id >= 0 && id < V;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) st(out, ot, i * H + c, ok ? ld(table, tt, id * H + c) : 0.0f);
}

// Rows of y (f32 or the GEMM's output dtype) start as the bias; the GEMM then accumulates onto them (beta 1),
// so the bias is added before the one rounding, as a fused addmm does.
__global__ void fill_bias_kernel(const void* bias, int bt, void* y, int yt, int64_t M, int64_t N) {
  const int64_t n = M * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(y, yt, i, ld(bias, bt, i % N));
}

__global__ void convert_rows_kernel(const void* x, int xt, int64_t ldx, void* y, int yt, int64_t M, int64_t K) {
  const int64_t n = M * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(y, yt, i, ld(x, xt, (i / K) * ldx + i % K));
}

// The second pass of both norms: y = w * (x * inv), with x_hat rounded to x's dtype first unless
// weight_before_cast (see DeviceOps::rmsnorm).
__device__ __forceinline__ void store_normed(const void* x, int xt, int64_t x0, const void* w, int wt, void* y, int yt,
                                             int64_t y0, int64_t D, float inv, int weight_before_cast) {
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float h = ld(x, xt, x0 + i) * inv;
    const float wv = ld(w, wt, i);
    st(y, yt, y0 + i, weight_before_cast ? wv * h : wv * round_as(xt, h));
  }
}

__global__ void rmsnorm_kernel(const void* x, int xt, int64_t ldx, const void* w, int wt, void* y, int yt, int64_t ldy,
                               int64_t D, float eps, int weight_before_cast) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = ld(x, xt, r * ldx + i);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, red) / float(D) + eps);
  store_normed(x, xt, r * ldx, w, wt, y, yt, r * ldy, D, inv, weight_before_cast);
}

// h = round(h + a) in place, then y = rmsnorm(h) * w: each thread re-reads only what it wrote.
__global__ void add_rmsnorm_kernel(void* h, int ht, const void* a, int at, const void* w, int wt, void* y, int yt,
                                   int64_t D, float eps, int weight_before_cast) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = round_as(ht, ld(h, ht, r * D + i) + ld(a, at, r * D + i));
    st(h, ht, r * D + i, v);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, red) / float(D) + eps);
  store_normed(h, ht, r * D, w, wt, y, yt, r * D, D, inv, weight_before_cast);
}

// y [M, N] = x [M, K] w [N, K]^T + bias for a few rows (M <= kSmallM) of operands of different dtypes (the
// f32 router under bf16 activations): one block per output column, the block's threads split K so that
// all of the column's loads are in flight at once; no conversion pass.
constexpr int kSmallM = 8;
__global__ void small_m_linear_kernel(const void* x, int xt, int64_t ldx, const void* w, int wt, const void* bias,
                                      int bt, void* y, int yt, int M, int64_t N, int64_t K) {
  __shared__ float red[32];
  const int64_t n = blockIdx.x;
  float acc[kSmallM];
#pragma unroll
  for (int m = 0; m < kSmallM; ++m) acc[m] = 0.0f;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const float wv = ld(w, wt, n * K + k);
#pragma unroll
    for (int m = 0; m < kSmallM; ++m)
      if (m < M) acc[m] += wv * ld(x, xt, m * ldx + k);
  }
  for (int m = 0; m < M; ++m) {
    const float s = block_sum(acc[m], red);
    if (threadIdx.x == 0) st(y, yt, m * N + n, s + (bias ? ld(bias, bt, n) : 0.0f));
  }
}

constexpr int kMaxRopeHalf = 256;
struct RopeArgs {
  float inv_freq[kMaxRopeHalf];
  int half = 0;
  int interleaved = 0;
  float scaling = 1.0f;
};

// One block per (token, head): loads the rotated dims, then writes them (in place).
__global__ void rope_kernel(void* x, int t, int64_t s0, int64_t s1, int64_t NH, int64_t offset, int64_t pos_value,
                            const int64_t* pos_device, RopeArgs a) {
  extern __shared__ float v[];  // [2 * half]
  const int64_t row = blockIdx.x / NH, head = blockIdx.x % NH;
  const int64_t base = row * s0 + head * s1 + offset;
  const int rd = 2 * a.half;
  for (int i = threadIdx.x; i < rd; i += blockDim.x) v[i] = ld(x, t, base + i);
  __syncthreads();
  const float pos = float(position(pos_value, pos_device) + row);
  for (int i = threadIdx.x; i < a.half; i += blockDim.x) {
    const float f = pos * a.inv_freq[i];
    // transformers casts cos / sin to the activation dtype before using them.
    const float c = round_as(t, cosf(f) * a.scaling), s = round_as(t, sinf(f) * a.scaling);
    const float x1 = a.interleaved ? v[2 * i] : v[i];
    const float x2 = a.interleaved ? v[2 * i + 1] : v[i + a.half];
    st(x, t, base + i, x1 * c - x2 * s);
    st(x, t, base + i + a.half, x2 * c + x1 * s);
  }
}

constexpr int kAttnThreads = 128, kAttnTile = 64, kAttnMaxDv = 4 * kAttnThreads;
constexpr int kAttnThreadsPerKey = kAttnThreads / kAttnTile;
static_assert(kAttnThreads % kAttnTile == 0 && kAttnThreadsPerKey == 2, "two threads score each key of a tile");

// One block per (query, head, split of the keys): an online softmax over tiles of kAttnTile keys. Two threads
// score each key of a tile (all the tile's key loads are in flight at once), then every thread rescales and
// accumulates its own value dims. Without `part` (one split) the block writes the normalised output, the
// sink included; with it, the split's running max, sum and unnormalised values go to
// part[(query * Hq + head) * splits + split] ([m, l, acc[Dv]]) for attention_combine_kernel.
template <class T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                     int Hq, int Hkv, int Dk, int Dv, int64_t pos_value, const int64_t* pos_device, float scale,
                     int64_t window, const void* sinks, int sink_t, int64_t chunk, float* __restrict__ part) {
  extern __shared__ float sm[];
  float* qs = sm;        // [Dk]
  float* p = sm + Dk;    // [kAttnTile]
  const int bh = blockIdx.x, t = bh / Hq, h = bh % Hq, g = h / (Hq / Hkv);
  const int split = blockIdx.y, splits = gridDim.y;
  const int tid = threadIdx.x;
  const int64_t pos = position(pos_value, pos_device) + t;
  int64_t lo = window > 0 ? max(int64_t(0), pos - window + 1) : 0;
  int64_t hi = pos;  // last key, inclusive
  lo = max(lo, split * chunk);
  hi = min(hi, (split + 1) * chunk - 1);
  for (int d = tid; d < Dk; d += blockDim.x) qs[d] = to_f32(q[(int64_t(t) * Hq + h) * Dk + d]);
  float m = -INFINITY, l = 0.0f;
  if (sinks && !part) {  // the sink's logit: probability mass, no value
    m = ld(sinks, sink_t, h);
    l = 1.0f;
  }
  float acc[kAttnMaxDv / kAttnThreads] = {0.0f, 0.0f, 0.0f, 0.0f};
  __syncthreads();
  const int key = tid / kAttnThreadsPerKey, sub = tid % kAttnThreadsPerKey;
  const int per = (Dk + kAttnThreadsPerKey - 1) / kAttnThreadsPerKey;
  const int d0 = sub * per, d1 = min(Dk, d0 + per);
  for (int64_t j0 = lo; j0 <= hi; j0 += kAttnTile) {
    const int n = int(min(int64_t(kAttnTile), hi + 1 - j0));
    float sc = 0.0f;
    if (key < n) {
      const T* kr = k + ((j0 + key) * Hkv + g) * int64_t(Dk);
#pragma unroll 8
      for (int d = d0; d < d1; ++d) sc += qs[d] * to_f32(kr[d]);
    }
    sc += __shfl_xor_sync(0xffffffffu, sc, 1);  // the two halves of the key's dot product
    if (key < n && sub == 0) p[key] = sc * scale;
    __syncthreads();
    float tmax = -INFINITY;
    for (int jj = 0; jj < n; ++jj) tmax = fmaxf(tmax, p[jj]);
    const float mnew = fmaxf(m, tmax);
    const float corr = m == -INFINITY ? 0.0f : expf(m - mnew);
    __syncthreads();  // every thread has read the scores
    if (tid < n) p[tid] = expf(p[tid] - mnew);
    __syncthreads();
    float sum = 0.0f;
    for (int jj = 0; jj < n; ++jj) sum += p[jj];
    l = l * corr + sum;
#pragma unroll
    for (int i = 0; i < kAttnMaxDv / kAttnThreads; ++i) {
      const int d = tid + i * kAttnThreads;
      if (d >= Dv) break;
      const T* vc = v + (j0 * Hkv + g) * int64_t(Dv) + d;
      float a = acc[i] * corr;
#pragma unroll 8
      for (int jj = 0; jj < n; ++jj) a += p[jj] * to_f32(vc[int64_t(jj) * Hkv * Dv]);
      acc[i] = a;
    }
    m = mnew;
    __syncthreads();  // before the next tile's scores overwrite p
  }
  if (part) {
    float* o = part + (int64_t(bh) * splits + split) * (Dv + 2);
    if (tid == 0) {
      o[0] = m;
      o[1] = l;
    }
#pragma unroll
    for (int i = 0; i < kAttnMaxDv / kAttnThreads; ++i) {
      const int d = tid + i * kAttnThreads;
      if (d < Dv) o[2 + d] = acc[i];
    }
    return;
  }
  const float inv = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kAttnMaxDv / kAttnThreads; ++i) {
    const int d = tid + i * kAttnThreads;
    if (d < Dv) out[(int64_t(t) * Hq + h) * Dv + d] = from_f32<T>(acc[i] * inv);
  }
}

// Merges the splits of attention_kernel: one block per (query, head).
template <class T>
__global__ void attention_combine_kernel(const float* __restrict__ part, int splits, int Hq, int Dv, const void* sinks,
                                         int sink_t, T* __restrict__ out) {
  const int bh = blockIdx.x;
  const float* pp = part + int64_t(bh) * splits * (Dv + 2);
  float M = sinks ? ld(sinks, sink_t, bh % Hq) : -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, pp[int64_t(s) * (Dv + 2)]);
  float L = sinks ? expf(ld(sinks, sink_t, bh % Hq) - M) : 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float ms = pp[int64_t(s) * (Dv + 2)];
    if (ms != -INFINITY) L += pp[int64_t(s) * (Dv + 2) + 1] * expf(ms - M);
  }
  const float inv = 1.0f / L;
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
    float a = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float ms = pp[int64_t(s) * (Dv + 2)];
      if (ms != -INFINITY) a += pp[int64_t(s) * (Dv + 2) + 2 + d] * expf(ms - M);
    }
    out[int64_t(bh) * Dv + d] = from_f32<T>(a * inv);
  }
}

// Rows [row0, row0 + n) of dst = src, in 16-, 4- or 1-byte words (`Word`), row0 read on the device.
template <class Word>
__global__ void write_rows_kernel(const Word* src, Word* dst, int64_t words, int64_t row_words, int64_t row0_value,
                                  const int64_t* row0_device) {
  Word* d = dst + position(row0_value, row0_device) * row_words;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words; i += int64_t(gridDim.x) * blockDim.x)
    d[i] = src[i];
}

__global__ void act_mul_kernel(const void* gu, int gt, int64_t ld_gu, void* out, int ot, int64_t M, int64_t I, int act) {
  const int64_t n = M * I;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / I, c = i % I;
    st(out, ot, i, activate(act, ld(gu, gt, r * ld_gu + c)) * ld(gu, gt, r * ld_gu + I + c));
  }
}

__global__ void add_kernel(const void* a, int at, const void* b, int bt, void* out, int ot, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(out, ot, i, ld(a, at, i) + ld(b, bt, i));
}

// out[m, :] += round(sigmoid(gate[m])) * x[m, :], each product rounded to x's dtype (as transformers does).
__global__ void add_sigmoid_gated_kernel(const void* x, int xt, const void* gate, int gt, void* out, int ot, int64_t M,
                                         int64_t H) {
  const int64_t n = M * H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float s = round_as(xt, 1.0f / (1.0f + expf(-ld(gate, gt, i / H))));
    st(out, ot, i, ld(out, ot, i) + round_as(xt, s * ld(x, xt, i)));
  }
}

__global__ void clamp_kernel(void* x, int t, int64_t n, float limit) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(x, t, i, fminf(fmaxf(ld(x, t, i), -limit), limit));
}

// ---- router: one warp per token ----

constexpr int kRouteMaxPerLane = 32;  // E <= 1024
constexpr int kRouteMaxK = 32;
constexpr int kRouteMaxGroups = 32;
constexpr int kRouteSoftmaxTopk = 0, kRouteTopkSoftmax = 1, kRouteGroupedSigmoid = 2;

struct Best {
  float v;
  int i;
};
// Larger value first, then lower index (ops_cpu.cpp's top_k_desc).
__device__ __forceinline__ Best better(Best a, Best b) { return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a; }
__device__ __forceinline__ Best warp_best(Best b) {
  for (int o = 16; o > 0; o >>= 1) {
    Best x{__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
    b = better(b, x);
  }
  return b;
}
// The best of this lane's values whose expert passes `keep` (experts e = lane + 32 * s).
template <class Keep>
__device__ __forceinline__ Best lane_best(const float* vals, int per_lane, int E, Keep keep) {
  const int lane = threadIdx.x % 32;
  Best b{-INFINITY, INT_MAX};
  for (int s = 0; s < per_lane; ++s) {
    const int e = lane + 32 * s;
    if (e < E && keep(e)) b = better(b, Best{vals[s], e});
  }
  return b;
}

__global__ void route_kernel(const float* logits, const float* bias, int64_t T, int E, int K, int kind, int norm,
                             float scale, int G, int topk_group, int32_t* index, float* weights) {
  const int lane = threadIdx.x % 32;
  const int64_t token = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (token >= T) return;
  const float* l = logits + token * E;
  const int per_lane = (E + 31) / 32;
  float sel[kRouteMaxPerLane], prob[kRouteMaxPerLane];
  float mx = -INFINITY;
  for (int s = 0; s < per_lane; ++s) {
    const int e = lane + 32 * s;
    const float x = e < E ? l[e] : -INFINITY;
    prob[s] = x;
    mx = fmaxf(mx, x);
  }
  if (kind == kRouteSoftmaxTopk) {
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int s = 0; s < per_lane; ++s) {
      prob[s] = lane + 32 * s < E ? expf(prob[s] - mx) : 0.0f;
      sum += prob[s];
    }
    sum = warp_sum(sum);
    for (int s = 0; s < per_lane; ++s) sel[s] = prob[s] = prob[s] / sum;
  } else if (kind == kRouteTopkSoftmax) {
    for (int s = 0; s < per_lane; ++s) sel[s] = prob[s];
  } else {
    for (int s = 0; s < per_lane; ++s) {
      const int e = lane + 32 * s;
      prob[s] = 1.0f / (1.0f + expf(-prob[s]));
      sel[s] = e < E ? prob[s] + (bias ? bias[e] : 0.0f) : -INFINITY;
    }
    // A group's score: the sum of its two best choice scores; keep the topk_group best groups.
    const int per = E / G;
    float gscore = -INFINITY;
    for (int g = 0; g < G; ++g) {
      const Best b1 = warp_best(lane_best(sel, per_lane, E, [&](int e) { return e / per == g; }));
      float s = b1.v;
      if (per >= 2) s += warp_best(lane_best(sel, per_lane, E, [&](int e) { return e / per == g && e != b1.i; })).v;
      if (lane == g) gscore = s;
    }
    unsigned keep = 0;
    for (int r = 0; r < topk_group; ++r) {
      const Best b = warp_best(lane < G ? Best{gscore, lane} : Best{-INFINITY, INT_MAX});
      keep |= 1u << b.i;
      if (lane == b.i) gscore = -INFINITY;
    }
    for (int s = 0; s < per_lane; ++s) {
      const int e = lane + 32 * s;
      if (e < E && !((keep >> (e / per)) & 1u)) sel[s] = -INFINITY;
    }
  }
  int chosen[kRouteMaxK];
  float w[kRouteMaxK];
  for (int j = 0; j < K; ++j) {
    const Best b = warp_best(lane_best(sel, per_lane, E, [](int) { return true; }));
    const int e = b.i < E ? b.i : E - 1;  // NaN scores select nothing; stay in bounds
    chosen[j] = e;
    // prob of the chosen expert, from its owner lane (every lane reads the same slot).
    w[j] = __shfl_sync(0xffffffffu, prob[e / 32], e % 32);
    if (lane == e % 32) sel[e / 32] = -INFINITY;
  }
  if (lane != 0) return;
  if (kind == kRouteTopkSoftmax) {
    const float top = w[0];
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) sum += (w[j] = expf(w[j] - top));
    for (int j = 0; j < K; ++j) w[j] /= sum;
  } else if (norm) {
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) sum += w[j];
    if (kind == kRouteGroupedSigmoid) sum += 1e-20f;
    for (int j = 0; j < K; ++j) w[j] /= sum;
  }
  for (int j = 0; j < K; ++j) {
    index[token * K + j] = chosen[j];
    weights[token * K + j] = kind == kRouteGroupedSigmoid ? w[j] * scale : w[j];
  }
}

// One block per (token, head): k = [k_nope | k_rot], v, written at cache rows row0 + token.
__global__ void mla_expand_kernel(const void* kvb, const void* k_rot, int64_t ld_rot, int in_t, void* k, void* v,
                                  int out_t, int64_t H, int64_t nope, int64_t rope, int64_t dv, int64_t row0_value,
                                  const int64_t* row0_device) {
  const int64_t t = blockIdx.x / H, h = blockIdx.x % H;
  const int64_t row = position(row0_value, row0_device) + t;
  const int64_t dk = nope + rope;
  const int64_t src = (t * H + h) * (nope + dv);
  const int64_t kd = (row * H + h) * dk, vd = (row * H + h) * dv;
  for (int64_t i = threadIdx.x; i < nope; i += blockDim.x) st(k, out_t, kd + i, ld(kvb, in_t, src + i));
  for (int64_t i = threadIdx.x; i < rope; i += blockDim.x) st(k, out_t, kd + nope + i, ld(k_rot, in_t, t * ld_rot + i));
  for (int64_t i = threadIdx.x; i < dv; i += blockDim.x) st(v, out_t, vd + i, ld(kvb, in_t, src + nope + i));
}

// ---- host side ----

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
void launched() { MOEKIT_CUDA_CALL(cudaGetLastError()); }
// Grid for a grid-stride elementwise loop over n elements.
unsigned blocks_for(int64_t n, int threads = 256) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65535)));
}

// Per (device, stream): grow-only scratch for operand conversions, and cuBLAS's workspace.
class Workspaces {
 public:
  void* get(int device, cudaStream_t s, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceBuffer& b = buffers_[{device, s}];
    if (b.size() < bytes) {
      MOEKIT_CHECK_CODE(!cuda::stream_is_capturing(s), runtime, "the layer ops need ", bytes,
                        " bytes of scratch during graph capture; run the step once uncaptured first");
      MOEKIT_CUDA_CALL(cudaStreamSynchronize(s));  // earlier ops on the stream may still read the old buffer
      b = DeviceBuffer();
      b = DeviceBuffer(std::max(bytes, size_t(1) << 20), device);
    }
    return b.data();
  }
  void* cublas(int device, cudaStream_t s, size_t* bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceBuffer& b = cublas_[{device, s}];
    if (!b.data()) {
      MOEKIT_CHECK_CODE(!cuda::stream_is_capturing(s), runtime,
                        "the layer ops' cuBLAS workspace must exist before graph capture; run the step once first");
      b = DeviceBuffer(kCublasWorkspace, device);
    }
    *bytes = b.size();
    return b.data();
  }

 private:
  static constexpr size_t kCublasWorkspace = size_t(32) << 20;
  std::mutex mutex_;
  std::map<std::pair<int, cudaStream_t>, DeviceBuffer> buffers_, cublas_;
};

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
    embedding_kernel<<<unsigned(n), 256, 0, stream()>>>(ids.ptr<int64_t>(), V, H, table.data, tt, out.data, ot);
    launched();
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
    if (xt != wt && M <= kSmallM) {
      small_m_linear_kernel<<<unsigned(N), 256, 0, s>>>(
          x.data, xt, ldx, w.data, wt, bias.data, bias.data ? code(bias, "linear bias") : 0, y.data, yt, int(M), N, K);
      launched();
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
    char* ws = need ? static_cast<char*>(workspaces().get(dev, s, need)) : nullptr;
    if (cvt_x) {
      convert_rows_kernel<<<blocks_for(M * K), 256, 0, s>>>(x.data, xt, ldx, ws, kF32, M, K);
      launched();
      xp = ws;
      ws += x_bytes;
      ldx = K;
      xt = kF32;
    }
    if (cvt_w) {
      convert_rows_kernel<<<blocks_for(N * K), 256, 0, s>>>(w.data, wt, K, ws, kF32, N, K);
      launched();
      wp = ws;
      ws += w_bytes;
      wt = kF32;
    }
    void* yp = direct ? y.data : ws;
    const int yp_t = direct ? yt : kF32;
    float beta = 0.0f;
    if (bias.data) {
      fill_bias_kernel<<<blocks_for(M * N), 256, 0, s>>>(bias.data, code(bias, "linear bias"), yp, yp_t, M, N);
      launched();
      beta = 1.0f;
    }
    auto cuda_type = [](int t) { return t == kF32 ? CUDA_R_32F : t == kBF16 ? CUDA_R_16BF : CUDA_R_16F; };
    const float alpha = 1.0f;
    auto& h = *cublas(dev);
    {
      std::lock_guard<std::mutex> lock(h.mutex());
      MOEKIT_CUBLAS_CALL(cublasSetStream(h.get(), s));
      size_t wsb = 0;
      void* cws = workspaces().cublas(dev, s, &wsb);
      MOEKIT_CUBLAS_CALL(cublasSetWorkspace(h.get(), cws, wsb));
      // Row-major y [M, N] = x [M, K] w [N, K]^T is column-major y^T [N, M] = w^T x^T.
      MOEKIT_CUBLAS_CALL(cublasGemmEx(h.get(), CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &alpha, wp,
                                      cuda_type(wt), int(K), xp, cuda_type(xt), int(ldx), &beta, yp, cuda_type(yp_t),
                                      int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    if (!direct) {
      convert_rows_kernel<<<blocks_for(M * N), 256, 0, s>>>(yp, kF32, N, y.data, yt, M, N);
      launched();
    }
  }

  void rmsnorm(const TensorView& x, const TensorView& w, float eps, bool weight_before_cast,
               const TensorView& y) const override {
    const int xt = code(x, "rmsnorm input"), wt = code(w, "rmsnorm weight"), yt = code(y, "rmsnorm output");
    const auto [M, D, ldx, ldy] = check_rmsnorm(x, w, y);
    if (M == 0) return;
    DeviceGuard g(x.device.index);
    rmsnorm_kernel<<<unsigned(M), norm_threads(D), 0, stream()>>>(x.data, xt, ldx, w.data, wt, y.data, yt, ldy, D, eps,
                                                          weight_before_cast ? 1 : 0);
    launched();
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
    add_rmsnorm_kernel<<<unsigned(M), norm_threads(D), 0, stream()>>>(h.data, ht, a.data, at, w.data, wt, y.data, yt,
                                                                      D, eps, weight_before_cast ? 1 : 0);
    launched();
  }

  void rope(const TensorView& x, int64_t offset, Position pos, const RopeSpec& rope) const override {
    const int t = code(x, "rope input");
    MOEKIT_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope input must be [T, heads, S] with unit inner stride, got ",
                 x.to_string());
    const int64_t T = x.shape[0], NH = x.shape[1], S = x.shape[2], half = int64_t(rope.inv_freq.size());
    MOEKIT_CHECK(half <= kMaxRopeHalf, "rope: ", 2 * half, " rotated dims; the CUDA ops support up to ",
                 2 * kMaxRopeHalf);
    MOEKIT_CHECK(offset >= 0 && offset + 2 * half <= S, "rope: dims [", offset, ", ", offset + 2 * half,
                 ") do not fit heads of size ", S);
    if (T == 0 || NH == 0 || half == 0) return;
    RopeArgs a;
    for (int64_t i = 0; i < half; ++i) a.inv_freq[i] = rope.inv_freq[size_t(i)];
    a.half = int(half);
    a.interleaved = rope.interleaved ? 1 : 0;
    a.scaling = rope.attention_scaling;
    DeviceGuard g(x.device.index);
    const int threads = half >= 64 ? 64 : 32;
    rope_kernel<<<unsigned(T * NH), threads, size_t(2 * half) * sizeof(float), stream()>>>(
        x.data, t, x.stride(0), x.stride(1), NH, offset, pos.value, pos.device, a);
    launched();
  }

  void attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out, Position pos,
                 float scale, int64_t window, const TensorView& sinks) const override {
    const int qt = code(q, "attention q");
    MOEKIT_CHECK(code(k, "attention k") == qt && code(v, "attention v") == qt && code(out, "attention output") == qt,
                 "attention operands must share one dtype: q ", q.to_string(), ", k ", k.to_string(), ", v ",
                 v.to_string(), ", out ", out.to_string());
    const auto [T, Hq, Dk, S, Hkv, Dv] = check_attention(q, k, v, out, pos.value, sinks);
    MOEKIT_CHECK(Dv <= kAttnMaxDv, "attention: value heads of ", Dv, " dims; the CUDA ops support up to ", kAttnMaxDv);
    const int sink_t = sinks.data ? code(sinks, "attention sinks") : 0;
    if (T == 0) return;
    const int dev = q.device.index;
    DeviceGuard g(dev);
    const cudaStream_t s = stream();
    const size_t smem = size_t(Dk + kAttnTile) * sizeof(float);
    MOEKIT_CHECK(smem <= 48 * 1024, "attention: key heads of ", Dk, " dims do not fit the CUDA kernel");
    // Few (query, head) pairs (decode): split the keys over more blocks, then merge (flash-decoding). The
    // split depends on S (the cache rows given), not on the position, so a recorded graph keeps its shape.
    const int64_t bh = T * Hq;
    const int64_t keys_max = window > 0 ? std::min(window, S) : S;
    const int64_t target = 2 * int64_t(cuda::device_info(dev).multiprocessors);
    int64_t splits = std::clamp<int64_t>((target + bh - 1) / bh, 1, std::max<int64_t>(1, (keys_max + kAttnTile - 1) / kAttnTile));
    splits = std::min<int64_t>(splits, 64);
    // Chunks over absolute key indices [0, S): with a window the live keys sit at the end, so each split
    // covers a window-sized share when the window is narrower.
    int64_t chunk = std::max<int64_t>(kAttnTile, (S + splits - 1) / splits);
    if (window > 0 && keys_max < S) splits = 1, chunk = S;
    chunk = (chunk + kAttnTile - 1) / kAttnTile * kAttnTile;
    splits = (S + chunk - 1) / chunk;
    float* part = nullptr;
    if (splits > 1)
      part = static_cast<float*>(workspaces().get(dev, s, size_t(bh * splits * (Dv + 2)) * sizeof(float)));
    const dim3 grid{unsigned(bh), unsigned(splits)};
    auto run = [&](auto tag) {
      using E = decltype(tag);
      attention_kernel<E><<<grid, kAttnThreads, smem, s>>>(
          static_cast<const E*>(q.data), static_cast<const E*>(k.data), static_cast<const E*>(v.data),
          static_cast<E*>(out.data), int(Hq), int(Hkv), int(Dk), int(Dv), pos.value, pos.device, scale, window,
          sinks.data, sink_t, chunk, part);
      launched();
      if (part) {
        attention_combine_kernel<E><<<unsigned(bh), 128, 0, s>>>(part, int(splits), int(Hq), int(Dv), sinks.data,
                                                                 sink_t, static_cast<E*>(out.data));
        launched();
      }
    };
    if (qt == kF32)
      run(float());
    else if (qt == kBF16)
      run(bf16());
    else
      run(f16());
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
    const auto aligned = [&](int64_t a) {
      return row_bytes % a == 0 && reinterpret_cast<uintptr_t>(src.data) % a == 0 &&
             reinterpret_cast<uintptr_t>(dst.data) % a == 0;
    };
    const int64_t bytes = n * row_bytes;
    if (aligned(16))
      write_rows_kernel<<<blocks_for(bytes / 16), 256, 0, s>>>(static_cast<const int4*>(src.data),
                                                               static_cast<int4*>(dst.data), bytes / 16,
                                                               row_bytes / 16, row0.value, row0.device);
    else if (aligned(4))
      write_rows_kernel<<<blocks_for(bytes / 4), 256, 0, s>>>(static_cast<const int32_t*>(src.data),
                                                              static_cast<int32_t*>(dst.data), bytes / 4, row_bytes / 4,
                                                              row0.value, row0.device);
    else
      write_rows_kernel<<<blocks_for(bytes), 256, 0, s>>>(static_cast<const char*>(src.data),
                                                          static_cast<char*>(dst.data), bytes, row_bytes, row0.value,
                                                          row0.device);
    launched();
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
    act_mul_kernel<<<blocks_for(M * I), 256, 0, stream()>>>(gu.data, gt, ld, out.data, ot, M, I,
                                                            cuda::kernel_activation(act));
    launched();
  }

  void add(const TensorView& a, const TensorView& b, const TensorView& out) const override {
    const int at = code(a, "add input"), bt = code(b, "add input"), ot = code(out, "add output");
    MOEKIT_CHECK(
        a.shape == b.shape && a.shape == out.shape && a.is_contiguous() && b.is_contiguous() && out.is_contiguous(),
        "add: shapes ", a.to_string(), ", ", b.to_string(), ", ", out.to_string(), " must match");
    const int64_t n = a.numel();
    if (n == 0) return;
    DeviceGuard g(a.device.index);
    add_kernel<<<blocks_for(n), 256, 0, stream()>>>(a.data, at, b.data, bt, out.data, ot, n);
    launched();
  }

  void add_sigmoid_gated(const TensorView& x, const TensorView& gate, const TensorView& out) const override {
    const int xt = code(x, "gated add input"), gt = code(gate, "gated add gate"), ot = code(out, "gated add output");
    MOEKIT_CHECK(x.dim() == 2 && x.shape == out.shape && x.is_contiguous() && out.is_contiguous() &&
                     gate.numel() == x.shape[0] && gate.is_contiguous(),
                 "gated add: x ", x.to_string(), ", gate ", gate.to_string(), ", out ", out.to_string());
    const int64_t M = x.shape[0], H = x.shape[1];
    if (M * H == 0) return;
    DeviceGuard g(x.device.index);
    add_sigmoid_gated_kernel<<<blocks_for(M * H), 256, 0, stream()>>>(x.data, xt, gate.data, gt, out.data, ot, M, H);
    launched();
  }

  void clamp(const TensorView& x, float limit) const override {
    const int t = code(x, "clamp input");
    MOEKIT_CHECK(x.is_contiguous(), "clamp input must be contiguous, got ", x.to_string());
    const int64_t n = x.numel();
    if (n == 0) return;
    DeviceGuard g(x.device.index);
    clamp_kernel<<<blocks_for(n), 256, 0, stream()>>>(x.data, t, n, limit);
    launched();
  }

  void route(const TensorView& logits, const TensorView& correction_bias, const RouterSpec& spec,
             const TensorView& index, const TensorView& weights) const override {
    MOEKIT_CHECK(logits.device.is_cuda(), "router logits must be on a CUDA device, got ", logits.to_string());
    const auto [T, E, K] = check_route(logits, correction_bias, spec, index, weights);
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
    constexpr int kWarps = 4;
    route_kernel<<<unsigned((T + kWarps - 1) / kWarps), 32 * kWarps, 0, stream()>>>(
        logits.ptr<float>(), bias, T, int(E), int(K), kind, spec.norm_topk_prob ? 1 : 0, spec.routed_scaling_factor,
        int(spec.n_group), int(spec.topk_group), index.ptr<int32_t>(), weights.ptr<float>());
    launched();
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
    mla_expand_kernel<<<unsigned(T * H), 64, 0, stream()>>>(kvb.data, k_rot.data, ld_rot, in_t, k.data, v.data, out_t,
                                                            H, nope, rope, dv, row0.value, row0.device);
    launched();
  }

  std::unique_ptr<StepGraph> capture(const std::function<void()>& body) const override {
    const cudaStream_t s = stream();
    MOEKIT_CHECK_CODE(s != nullptr, invalid_argument,
                      "graph capture needs a stream of its own (StreamScope), not the legacy default stream");
    int dev = 0;
    MOEKIT_CUDA_CALL(cudaGetDevice(&dev));
    MOEKIT_CUDA_CALL(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t graph = nullptr;
    try {
      body();
    } catch (...) {
      (void)cudaStreamEndCapture(s, &graph);
      if (graph) (void)cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    MOEKIT_CUDA_CALL(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    if (err != cudaSuccess) {
      (void)cudaGraphDestroy(graph);
      MOEKIT_CUDA_CALL(err);
    }
    return std::make_unique<CudaGraph>(graph, exec, s, dev);
  }

 private:
  // About four elements per thread: one row per block, so a single decode row is spread wide.
  static int norm_threads(int64_t D) { return int(std::clamp<int64_t>((D / 4 + 31) / 32 * 32, 64, 1024)); }
  static Workspaces& workspaces() {
    static Workspaces w;
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

const DeviceOps* cuda_ops() {
  static const CudaOps ops;
  return &ops;
}

}  // namespace moekit::model

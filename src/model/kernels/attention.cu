// Attention kernels of the model: rotary embedding in place, and causal attention as an online softmax
// over tiles of keys, split over blocks for decode (flash-decoding) and merged by a second kernel.
#include <algorithm>

#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

using cuda::from_f32;
using cuda::to_f32;

constexpr int kAttnThreadsPerKey = kAttnThreads / kAttnTile;
static_assert(kAttnThreads % kAttnTile == 0 && kAttnThreadsPerKey == 2, "two threads score each key of a tile");

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

// One block per (token, head) of q then k: the head's per-head RMS norm (w null: none) rounded to the storage
// type as rmsnorm stores it, then the rotation as rope_kernel computes it, written back in place; a k block also
// writes its k head and the matching v head at cache row pos + token (when below S).
__global__ void qk_norm_rope_cache_kernel(void* q, void* k, const void* v, int t, int64_t Hq, int64_t Hkv, int64_t D,
                                          int64_t ldq, int64_t ldk, int64_t ldv, const void* q_norm, int qwt,
                                          const void* k_norm, int kwt, float eps, int weight_before_cast,
                                          DecodeSeqs seqs, RopeArgs a) {
  extern __shared__ float x[];  // [D]
  __shared__ float red[32];
  const int64_t NH = Hq + Hkv;
  const int64_t row = blockIdx.x / NH, head = blockIdx.x % NH;
  const bool is_q = head < Hq;
  void* p = is_q ? q : k;
  const int64_t base = is_q ? row * ldq + head * D : row * ldk + (head - Hq) * D;
  const int64_t vbase = row * ldv + (head - Hq) * D;
  const int sq = seqs.n == 1 ? 0 : int(row);  // this row's sequence
  void* k_cache = seqs.k_cache[sq];
  void* v_cache = seqs.v_cache[sq];
  const int64_t S = seqs.rows[sq];
  const void* w = is_q ? q_norm : k_norm;
  const int wt = is_q ? qwt : kwt;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float e = ld(p, t, base + i);
    x[i] = e;
    ss += e * e;
  }
  if (w) {  // the same for the whole block
    const float inv = rsqrtf(block_sum(ss, red) / float(D) + eps);
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const float h = x[i] * inv, wv = ld(w, wt, i);
      x[i] = round_as(t, weight_before_cast ? wv * h : wv * round_as(t, h));
    }
  }
  __syncthreads();
  const int64_t pos = position(seqs.pos_value[sq], seqs.pos_device[sq]) + (seqs.n == 1 ? row : 0);
  const float fpos = float(pos);
  // Each thread owns the pairs i = threadIdx.x, threadIdx.x + blockDim.x, ...: read all, sync, write all.
  constexpr int kMaxPairs = (kMaxRopeHalf + 31) / 32;
  float o1[kMaxPairs], o2[kMaxPairs];
#pragma unroll
  for (int j = 0; j < kMaxPairs; ++j) {
    const int i = threadIdx.x + j * int(blockDim.x);
    if (i < a.half) {
      const float f = fpos * a.inv_freq[i];
      const float c = round_as(t, cosf(f) * a.scaling), s = round_as(t, sinf(f) * a.scaling);
      const float x1 = a.interleaved ? x[2 * i] : x[i];
      const float x2 = a.interleaved ? x[2 * i + 1] : x[i + a.half];
      o1[j] = round_as(t, x1 * c - x2 * s);
      o2[j] = round_as(t, x2 * c + x1 * s);
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kMaxPairs; ++j) {
    const int i = threadIdx.x + j * int(blockDim.x);
    if (i < a.half) {
      x[i] = o1[j];
      x[i + a.half] = o2[j];
    }
  }
  __syncthreads();
  const bool to_cache = !is_q && pos >= 0 && pos < S;
  const int64_t cbase = (pos * Hkv + (head - Hq)) * D;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    st(p, t, base + i, x[i]);
    if (to_cache) {
      st(k_cache, t, cbase + i, x[i]);
      st(v_cache, t, cbase + i, ld(v, t, vbase + i));
    }
  }
}

// One block per (query, head, split of the keys): an online softmax over tiles of kAttnTile keys. Two threads
// score each key of a tile (all the tile's key loads are in flight at once), then every thread rescales and
// accumulates its own value dims. Without `part` (one split) the block writes the normalised output, the
// sink included; with it, the split's running max, sum and unnormalised values go to
// part[(query * Hq + head) * splits + split] ([m, l, acc[Dv]]) for attention_combine_kernel.
template <class T>
__global__ void __launch_bounds__(kAttnThreads)
    attention_kernel(const T* __restrict__ q, int64_t ldq, DecodeSeqs seqs, T* __restrict__ out, int Hq, int Hkv,
                     int Dk, int Dv, float scale, int64_t window, const void* sinks, int sink_t, int64_t chunk,
                     float* __restrict__ part) {
  extern __shared__ float sm[];
  float* qs = sm;        // [Dk]
  float* p = sm + Dk;    // [kAttnTile]
  const int bh = blockIdx.x, t = bh / Hq, h = bh % Hq, g = h / (Hq / Hkv);
  const int split = blockIdx.y, splits = gridDim.y;
  const int tid = threadIdx.x;
  const int sq = seqs.n == 1 ? 0 : t;  // this query's sequence
  const T* __restrict__ k = static_cast<const T*>(seqs.k_cache[sq]);
  const T* __restrict__ v = static_cast<const T*>(seqs.v_cache[sq]);
  const int64_t pos = position(seqs.pos_value[sq], seqs.pos_device[sq]) + (seqs.n == 1 ? t : 0);
  int64_t lo = window > 0 ? max(int64_t(0), pos - window + 1) : 0;
  int64_t hi = pos;  // last key, inclusive
  lo = max(lo, split * chunk);
  hi = min(hi, (split + 1) * chunk - 1);
  for (int d = tid; d < Dk; d += blockDim.x) qs[d] = to_f32(q[int64_t(t) * ldq + int64_t(h) * Dk + d]);
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

}  // namespace

cudaError_t rope(void* x, int t, int64_t s0, int64_t s1, int64_t T, int64_t NH, int64_t offset, int64_t pos_value,
                 const int64_t* pos_device, const RopeArgs& a, cudaStream_t s) {
  const int threads = a.half >= 64 ? 64 : 32;
  rope_kernel<<<unsigned(T * NH), threads, size_t(2 * a.half) * sizeof(float), s>>>(x, t, s0, s1, NH, offset,
                                                                                    pos_value, pos_device, a);
  return cudaGetLastError();
}

cudaError_t qk_norm_rope_cache_seqs(void* q, void* k, const void* v, int t, int64_t T, int64_t Hq, int64_t Hkv,
                                    int64_t D, int64_t ldq, int64_t ldk, int64_t ldv, const void* q_norm, int qwt,
                                    const void* k_norm, int kwt, float eps, bool weight_before_cast,
                                    const DecodeSeqs& seqs, const RopeArgs& a, cudaStream_t s) {
  if (seqs.n < 1 || seqs.n > kMaxDecodeSeqs || (seqs.n != 1 && seqs.n != T)) return cudaErrorInvalidValue;
  // Enough threads that each owns at most kMaxRopeHalf / 32 rotated pairs, about one element each otherwise.
  const int64_t want = std::max<int64_t>(D, 32);
  const int threads = int(std::min<int64_t>((want + 31) / 32 * 32, 256));
  qk_norm_rope_cache_kernel<<<unsigned(T * (Hq + Hkv)), threads, size_t(D) * sizeof(float), s>>>(
      q, k, v, t, Hq, Hkv, D, ldq, ldk, ldv, q_norm, qwt, k_norm, kwt, eps, weight_before_cast ? 1 : 0, seqs, a);
  return cudaGetLastError();
}

cudaError_t qk_norm_rope_cache(void* q, void* k, const void* v, int t, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                               const void* q_norm, int qwt, const void* k_norm, int kwt, float eps,
                               bool weight_before_cast, int64_t pos_value, const int64_t* pos_device, void* k_cache,
                               void* v_cache, int64_t S, const RopeArgs& a, cudaStream_t s) {
  DecodeSeqs one{};
  one.n = 1;
  one.k_cache[0] = k_cache;
  one.v_cache[0] = v_cache;
  one.rows[0] = S;
  one.pos_value[0] = pos_value;
  one.pos_device[0] = pos_device;
  return qk_norm_rope_cache_seqs(q, k, v, t, T, Hq, Hkv, D, Hq * D, Hkv * D, Hkv * D, q_norm, qwt, k_norm, kwt, eps,
                                 weight_before_cast, one, a, s);
}

cudaError_t attention(const AttentionArgs& a, cudaStream_t s) {
  const int64_t bh = a.T * a.Hq;
  const size_t smem = size_t(a.Dk + kAttnTile) * sizeof(float);
  const dim3 grid{unsigned(bh), unsigned(a.splits)};
  DecodeSeqs one{};
  if (a.seqs) {
    if (a.seqs->n != a.T || a.T > kMaxDecodeSeqs) return cudaErrorInvalidValue;
  } else {
    one.n = 1;
    one.k_cache[0] = const_cast<void*>(a.k);
    one.v_cache[0] = const_cast<void*>(a.v);
    one.rows[0] = 0;  // not read by the attention
    one.pos_value[0] = a.pos_value;
    one.pos_device[0] = a.pos_device;
  }
  const DecodeSeqs& seqs = a.seqs ? *a.seqs : one;
  const int64_t ldq = a.seqs ? a.ldq : int64_t(a.Hq) * a.Dk;
  auto run = [&](auto tag) {
    using E = decltype(tag);
    attention_kernel<E><<<grid, kAttnThreads, smem, s>>>(static_cast<const E*>(a.q), ldq, seqs, static_cast<E*>(a.out),
                                                         a.Hq, a.Hkv, a.Dk, a.Dv, a.scale, a.window, a.sinks,
                                                         a.sink_t, a.chunk, a.part);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || !a.part) return err;
    attention_combine_kernel<E><<<unsigned(bh), 128, 0, s>>>(a.part, int(a.splits), a.Hq, a.Dv, a.sinks, a.sink_t,
                                                             static_cast<E*>(a.out));
    return cudaGetLastError();
  };
  if (a.t == kF32) return run(float());
  if (a.t == kBF16) return run(bf16());
  return run(f16());
}

}  // namespace moekit::model::kernels

// Attention kernels of the model: rotary embedding in place, and causal attention as an online softmax
// over tiles of keys, split over blocks for decode (flash-decoding) and merged by a second kernel.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "base/cuda_pdl.cuh"
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

// A head x [D] in shared memory (every thread's ss: the sum of squares of the elements it loaded) gets the per-head
// RMS norm (w null: none) rounded to the storage type t as rmsnorm stores it, then the rotation of dims
// [0, 2 * half) at position fpos as rope_kernel computes it, rounded to t; ends with a barrier. Every thread of the
// block calls it.
__device__ __forceinline__ void norm_rope_shared(float* x, float ss, int64_t D, const void* w, int wt, float eps,
                                                 int weight_before_cast, int t, float fpos, const RopeArgs& a,
                                                 float* red) {
  if (w) {  // the same for the whole block
    const float inv = rsqrtf(block_sum(ss, red) / float(D) + eps);
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const float h = x[i] * inv, wv = ld(w, wt, i);
      x[i] = round_as(t, weight_before_cast ? wv * h : wv * round_as(t, h));
    }
  }
  __syncthreads();
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
  cuda::pdl_wait();  // PDL: everything below reads what the kernels before wrote
  cuda::pdl_trigger();
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
  float ss = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float e = ld(p, t, base + i);
    x[i] = e;
    ss += e * e;
  }
  const int64_t pos = position(seqs.pos_value[sq], seqs.pos_device[sq]) + (seqs.n == 1 ? row : 0);
  norm_rope_shared(x, ss, D, is_q ? q_norm : k_norm, is_q ? qwt : kwt, eps, weight_before_cast, t, float(pos), a, red);
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
  cuda::pdl_wait();  // PDL: everything below reads what the kernels before wrote
  cuda::pdl_trigger();
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

// 16 bytes global -> shared, asynchronously (sm_80+), and the wait for all of a thread's copies.
__device__ __forceinline__ void cp_async16(uint4* dst, const void* src) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Eight 16-bit values of a 16-byte piece as f32.
template <class T>
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = uint16_t(w[i] & 0xffffu), hi = uint16_t(w[i] >> 16);
    if constexpr (std::is_same_v<T, bf16>) {
      f[2 * i] = __uint_as_float(uint32_t(lo) << 16);
      f[2 * i + 1] = __uint_as_float(uint32_t(hi) << 16);
    } else {
      f[2 * i] = __half2float(__ushort_as_half(lo));
      f[2 * i + 1] = __half2float(__ushort_as_half(hi));
    }
  }
}

// The decode step's q/k norms, rotary embedding and cache writes done inside decode_attention_vec_kernel (on = 0:
// done before by qk_norm_rope_cache_kernel): q is a QKV projection's row, its k and v heads k_off and v_off
// elements after the row's q.
struct QkFuse {
  int on;
  int64_t k_off, v_off;
  const void* q_norm;
  int qwt;
  const void* k_norm;
  int kwt;
  float eps;
  int weight_before_cast;
  RopeArgs rope;
};

template <class T>
constexpr int type_code() {
  return std::is_same_v<T, bf16> ? kBF16 : kF16;
}

// attention_kernel for the decode step of 16-bit caches whose heads are P pieces of 16 bytes (D = 8 P, Dk = Dv):
// the same splits, online softmax and outputs, with 16-byte loads. P threads share a key (one piece each, the dot
// product summed over the P lanes); each thread issues its loads of a tile's keys and values before using any, so a
// tile's 2 x 64 rows are in flight at once. The tile's max and sum meet by shuffles within each warp, then across
// the warps in warp order (two barriers per tile, no pass over the scores in shared memory). Each thread
// accumulates its piece's 8 value dims over the keys of its key slot; the slots' sums meet in shared memory at the
// end, added in slot order.
//
// With f.on, every block first norms and rotates its query head as qk_norm_rope_cache_kernel would (the same
// arithmetic, rounded alike); the block whose keys end at the new one (position pos) does so for its key head too
// and reads the new key and value from there rather than from the cache, and of the query heads sharing that key
// head the first writes both to cache row pos.
template <class T, int P>
__global__ void __launch_bounds__(kAttnThreads)
    decode_attention_vec_kernel(const T* __restrict__ q, int64_t ldq, DecodeSeqs seqs, T* __restrict__ out, int Hq,
                                int Hkv, float scale, int64_t window, const void* sinks, int sink_t, int64_t chunk,
                                float* __restrict__ part, QkFuse f, int prefetch) {
  constexpr int E = 8;                      // values per piece
  constexpr int D = P * E;
  constexpr int KPP = kAttnThreads / P;     // keys per pass (key slots)
  constexpr int NP = kAttnTile / KPP;       // passes per tile
  static_assert(32 % P == 0 && kAttnTile % KPP == 0, "a key's lanes sit in one warp");
  __shared__ float red[KPP * D];
  __shared__ float xs[D];
  __shared__ float red32[32];
  __shared__ __align__(16) T kn[D];  // fused: the new key and value
  __shared__ __align__(16) T vn[D];
  extern __shared__ uint4 kv_pre[];  // prefetch: the split's keys [chunk][P] pieces, then its values
  const int bh = blockIdx.x, t = bh / Hq, h = bh % Hq, g = h / (Hq / Hkv);
  const int split = blockIdx.y, splits = gridDim.y;
  const int tid = threadIdx.x, slot = tid / P, pc = tid % P;
  const int sq = seqs.n == 1 ? 0 : t;
  const T* __restrict__ k = static_cast<const T*>(seqs.k_cache[sq]);
  const T* __restrict__ v = static_cast<const T*>(seqs.v_cache[sq]);
  const int64_t row = int64_t(Hkv) * D;  // elements from one key to the next
  // The block's keys [lo, hi] (inclusive) up to the new one at pos; fresh: they include it (block-uniform).
  int64_t pos = 0, lo = 0, hi = -1;
  bool fresh = false;
  auto locate = [&] {
    pos = position(seqs.pos_value[sq], seqs.pos_device[sq]) + (seqs.n == 1 ? t : 0);
    lo = max(window > 0 ? max(int64_t(0), pos - window + 1) : int64_t(0), split * chunk);
    hi = min(pos, (split + 1) * chunk - 1);
    fresh = f.on && lo <= pos && pos <= hi;
  };
  // Prefetch (only with f.on: the new row comes from the QKV row, every other cache row was written by an earlier
  // step): the split's rows go to shared memory before the wait, overlapping the launches before this one. The
  // position is read before the wait then: it was written two or more launches back (by the host, or by the step
  // before's greedy_feed). Without the prefetch it is read after the wait, as it always was.
  const bool pre = prefetch && f.on;
  if (pre) {
    locate();
    const int64_t nrows = hi >= lo ? hi + 1 - lo : 0;
    const T* kb = k + lo * row + int64_t(g) * D;
    const T* vb = v + lo * row + int64_t(g) * D;
    for (int64_t i = tid; i < nrows * P; i += kAttnThreads) {
      const int64_t j = i / P;
      const int c = int(i % P);
      if (fresh && lo + j == pos) continue;
      cp_async16(&kv_pre[i], kb + j * row + c * E);
      cp_async16(&kv_pre[chunk * P + i], vb + j * row + c * E);
    }
    cp_async_commit();
  }
  cuda::pdl_wait();  // PDL: everything below reads what the kernels before wrote
  cuda::pdl_trigger();
  if (!pre) locate();
  const T* qrow = q + int64_t(t) * ldq;
  float qv[E];
  if (f.on) {
    constexpr int tc = type_code<T>();
    float ss = 0.0f;
    for (int i = tid; i < D; i += kAttnThreads) {
      const float e = to_f32(qrow[int64_t(h) * D + i]);
      xs[i] = e;
      ss += e * e;
    }
    norm_rope_shared(xs, ss, D, f.q_norm, f.qwt, f.eps, f.weight_before_cast, tc, float(pos), f.rope, red32);
#pragma unroll
    for (int e = 0; e < E; ++e) qv[e] = xs[pc * E + e];
    if (fresh) {
      __syncthreads();  // every thread has its query values
      const T* kh = qrow + f.k_off + int64_t(g) * D;
      const T* vh = qrow + f.v_off + int64_t(g) * D;
      ss = 0.0f;
      for (int i = tid; i < D; i += kAttnThreads) {
        const float e = to_f32(kh[i]);
        xs[i] = e;
        ss += e * e;
        vn[i] = vh[i];
      }
      norm_rope_shared(xs, ss, D, f.k_norm, f.kwt, f.eps, f.weight_before_cast, tc, float(pos), f.rope, red32);
      const bool writer = h % (Hq / Hkv) == 0 && pos < seqs.rows[sq];
      T* kc = static_cast<T*>(seqs.k_cache[sq]) + (pos * Hkv + g) * int64_t(D);
      T* vc = static_cast<T*>(seqs.v_cache[sq]) + (pos * Hkv + g) * int64_t(D);
      for (int i = tid; i < D; i += kAttnThreads) {
        kn[i] = from_f32<T>(xs[i]);
        if (writer) {
          kc[i] = kn[i];
          vc[i] = vn[i];
        }
      }
      __syncthreads();
    }
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) qv[e] = to_f32(qrow[int64_t(h) * D + pc * E + e]);
  }
  float m = -INFINITY, l = 0.0f;
  if (sinks && !part) {  // one split, written here: the sink's logit, probability mass without a value
    m = ld(sinks, sink_t, h);
    l = 1.0f;
  }
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.0f;
  if (pre) {
    cp_async_wait_all();
    __syncthreads();  // every thread's copies are in
  }
  constexpr int kWarps = kAttnThreads / 32;
  __shared__ float wmax[2][kWarps], wsum[2][kWarps];  // per warp, by tile parity (no third barrier per tile)
  const int warp = tid / 32;
  int parity = 0;
  for (int64_t j0 = lo; j0 <= hi; j0 += kAttnTile, parity ^= 1) {
    const int n = int(min(int64_t(kAttnTile), hi + 1 - j0));
    const T* kt = k + j0 * row + int64_t(g) * D + pc * E;
    const T* vt = v + j0 * row + int64_t(g) * D + pc * E;
    uint4 kr[NP], vr[NP];  // the tile's key and value loads all go out before any is used
    if (pre) {
      const uint4* ks = kv_pre + (j0 - lo) * P + pc;
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        const int jj = i * KPP + slot;
        const bool from_cache = jj < n && !(fresh && j0 + jj == pos);
        kr[i] = from_cache ? ks[jj * P] : make_uint4(0, 0, 0, 0);
        vr[i] = from_cache ? ks[(chunk + jj) * P] : make_uint4(0, 0, 0, 0);
      }
    } else {
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        const int jj = i * KPP + slot;
        const bool from_cache = jj < n && !(fresh && j0 + jj == pos);
        kr[i] = from_cache ? *reinterpret_cast<const uint4*>(kt + jj * row) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        const int jj = i * KPP + slot;
        const bool from_cache = jj < n && !(fresh && j0 + jj == pos);
        vr[i] = from_cache ? *reinterpret_cast<const uint4*>(vt + jj * row) : make_uint4(0, 0, 0, 0);
      }
    }
    if (fresh && pos - j0 < kAttnTile) {  // the new key: from shared memory
#pragma unroll
      for (int i = 0; i < NP; ++i)
        if (j0 + i * KPP + slot == pos) {
          kr[i] = *reinterpret_cast<const uint4*>(kn + pc * E);
          vr[i] = *reinterpret_cast<const uint4*>(vn + pc * E);
        }
    }
    float sc[NP];
    float lmax = -INFINITY;
#pragma unroll
    for (int i = 0; i < NP; ++i) {
      float fv[E];
      unpack8<T>(kr[i], fv);
      float d = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) d += qv[e] * fv[e];
#pragma unroll
      for (int o = P / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      sc[i] = d * scale;
      if (i * KPP + slot < n) lmax = fmaxf(lmax, sc[i]);
    }
    // The tile's max and sum by shuffles across the warp's key slots, then across the warps in warp order.
#pragma unroll
    for (int o = P; o < 32; o <<= 1) lmax = fmaxf(lmax, __shfl_xor_sync(0xffffffffu, lmax, o));
    if (tid % 32 == 0) wmax[parity][warp] = lmax;
    __syncthreads();
    float tmax = wmax[parity][0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) tmax = fmaxf(tmax, wmax[parity][w]);
    const float mnew = fmaxf(m, tmax);
    const float corr = m == -INFINITY ? 0.0f : expf(m - mnew);
    float lsum = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= corr;
#pragma unroll
    for (int i = 0; i < NP; ++i) {
      if (i * KPP + slot < n) {
        const float w = expf(sc[i] - mnew);
        lsum += w;
        float fv[E];
        unpack8<T>(vr[i], fv);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] += w * fv[e];
      }
    }
#pragma unroll
    for (int o = P; o < 32; o <<= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
    if (tid % 32 == 0) wsum[parity][warp] = lsum;
    __syncthreads();
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += wsum[parity][w];
    l = l * corr + sum;
    m = mnew;
  }
#pragma unroll
  for (int e = 0; e < E; ++e) red[slot * D + pc * E + e] = acc[e];
  __syncthreads();
  if (part) {
    float* o = part + (int64_t(bh) * splits + split) * (D + 2);
    if (tid == 0) {
      o[0] = m;
      o[1] = l;
    }
    for (int d = tid; d < D; d += kAttnThreads) {
      float a = 0.0f;
      for (int s2 = 0; s2 < KPP; ++s2) a += red[s2 * D + d];
      o[2 + d] = a;
    }
    return;
  }
  // One split: the block writes the output itself.
  const float inv = 1.0f / l;
  for (int d = tid; d < D; d += kAttnThreads) {
    float a = 0.0f;
    for (int s2 = 0; s2 < KPP; ++s2) a += red[s2 * D + d];
    out[(int64_t(t) * Hq + h) * D + d] = from_f32<T>(a * inv);
  }
}

// Merges the splits of attention_kernel: one block per (query, head).
template <class T>
__global__ void attention_combine_kernel(const float* __restrict__ part, int splits, int Hq, int Dv, const void* sinks,
                                         int sink_t, T* __restrict__ out, int early) {
  __shared__ float ms_s[kAttnMaxSplits], fs[kAttnMaxSplits], ls[kAttnMaxSplits];
  cuda::pdl_wait();  // PDL: everything below reads what the kernels before wrote
  cuda::pdl_trigger();
  const int bh = blockIdx.x;
  const float* pp = part + int64_t(bh) * splits * (Dv + 2);
  constexpr int kBatch = 8;  // value loads in flight per thread
  // early: the first batch of splits' values of this thread's first column, loaded with the maxima and sums
  // (every split writes its values, zeros where it saw no key), not after them.
  float v0[kBatch];
#pragma unroll
  for (int i = 0; i < kBatch; ++i)
    v0[i] = early && i < splits && int(threadIdx.x) < Dv ? pp[int64_t(i) * (Dv + 2) + 2 + threadIdx.x] : 0.0f;
  // Each split's max and sum loaded once, by one thread each (all in flight together), then the same arithmetic
  // in split order as one thread would do it.
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    ms_s[s] = pp[int64_t(s) * (Dv + 2)];
    ls[s] = pp[int64_t(s) * (Dv + 2) + 1];
  }
  __syncthreads();
  float M = sinks ? ld(sinks, sink_t, bh % Hq) : -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, ms_s[s]);
  for (int s = threadIdx.x; s < splits; s += blockDim.x) fs[s] = ms_s[s] != -INFINITY ? expf(ms_s[s] - M) : 0.0f;
  __syncthreads();
  float L = sinks ? expf(ld(sinks, sink_t, bh % Hq) - M) : 0.0f;
  for (int s = 0; s < splits; ++s)
    if (ms_s[s] != -INFINITY) L += ls[s] * fs[s];
  const float inv = 1.0f / L;
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
    float a = 0.0f;
    for (int s0 = 0; s0 < splits; s0 += kBatch) {
      float v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
        v[i] = early && s0 == 0 && d == int(threadIdx.x) ? v0[i]
               : s0 + i < splits && ms_s[s0 + i] != -INFINITY ? pp[int64_t(s0 + i) * (Dv + 2) + 2 + d]
                                                              : 0.0f;
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
        if (s0 + i < splits && ms_s[s0 + i] != -INFINITY) a += v[i] * fs[s0 + i];
    }
    out[int64_t(bh) * Dv + d] = from_f32<T>(a * inv);
  }
}

// qk_norm_rope_cache for T rows of q, k, v with row strides ldq, ldk, ldv (elements; rows of one QKV projection),
// row t's caches and position from seqs (n == T, or n == 1: one sequence).
cudaError_t qk_norm_rope_cache_seqs(void* q, void* k, const void* v, int t, int64_t T, int64_t Hq, int64_t Hkv,
                                    int64_t D, int64_t ldq, int64_t ldk, int64_t ldv, const void* q_norm, int qwt,
                                    const void* k_norm, int kwt, float eps, bool weight_before_cast,
                                    const DecodeSeqs& seqs, const RopeArgs& a, cudaStream_t s) {
  if (seqs.n < 1 || seqs.n > kMaxDecodeSeqs || (seqs.n != 1 && seqs.n != T)) return cudaErrorInvalidValue;
  // Enough threads that each owns at most kMaxRopeHalf / 32 rotated pairs, about one element each otherwise.
  const int64_t want = std::max<int64_t>(D, 32);
  const int threads = int(std::min<int64_t>((want + 31) / 32 * 32, 256));
  return cuda::launch_pdl(cuda::pdl_enabled(), qk_norm_rope_cache_kernel, dim3(unsigned(T * (Hq + Hkv))),
                          dim3(threads), size_t(D) * sizeof(float), s, q, k, v, t, Hq, Hkv, D, ldq, ldk, ldv, q_norm,
                          qwt, k_norm, kwt, eps, weight_before_cast ? 1 : 0, seqs, a);
}

}  // namespace

cudaError_t rope(void* x, int t, int64_t s0, int64_t s1, int64_t T, int64_t NH, int64_t offset, int64_t pos_value,
                 const int64_t* pos_device, const RopeArgs& a, cudaStream_t s) {
  const int threads = a.half >= 64 ? 64 : 32;
  rope_kernel<<<unsigned(T * NH), threads, size_t(2 * a.half) * sizeof(float), s>>>(x, t, s0, s1, NH, offset,
                                                                                    pos_value, pos_device, a);
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
  if (a.splits < 1 || a.splits > kAttnMaxSplits) return cudaErrorInvalidValue;
  const int64_t bh = a.T * a.Hq;
  const size_t smem = size_t(a.Dk + kAttnTile) * sizeof(float);
  const dim3 grid{unsigned(bh), unsigned(a.splits)};
  DecodeSeqs one{};
  if (a.seqs) {
    if (a.seqs->n != a.T || a.T > kMaxDecodeSeqs) return cudaErrorInvalidValue;
  } else {
    if (a.qk) return cudaErrorInvalidValue;
    one.n = 1;
    one.k_cache[0] = const_cast<void*>(a.k);
    one.v_cache[0] = const_cast<void*>(a.v);
    one.rows[0] = 0;  // not read by the attention
    one.pos_value[0] = a.pos_value;
    one.pos_device[0] = a.pos_device;
  }
  if ((a.splits > 1 && !a.part) || (a.qk && (!a.rope || a.Dk != a.Dv))) return cudaErrorInvalidValue;
  const DecodeSeqs& seqs = a.seqs ? *a.seqs : one;
  const int64_t ldq = a.seqs ? a.ldq : int64_t(a.Hq) * a.Dk;
  // The decode step's 16-bit caches with heads of 64, 128 or 256 dims and 16-byte aligned buffers: 16-byte loads.
  bool vec = a.vec && a.seqs && a.t != kF32 && a.Dk == a.Dv && (a.Dk == 64 || a.Dk == 128 || a.Dk == 256);
  for (int i = 0; vec && i < seqs.n; ++i)
    vec = reinterpret_cast<uintptr_t>(seqs.k_cache[i]) % 16 == 0 && reinterpret_cast<uintptr_t>(seqs.v_cache[i]) % 16 == 0;
  const bool pdl = cuda::pdl_enabled();
  QkFuse f{};
  if (a.qk) {
    if (vec && a.qk_inside) {
      f = QkFuse{1, a.k_off, a.v_off, a.q_norm, a.qwt, a.k_norm, a.kwt, a.eps, a.weight_before_cast ? 1 : 0, *a.rope};
    } else {  // the norms, rotary and cache writes by their own kernel first
      const size_t es = a.t == kF32 ? 4 : 2;
      char* q = static_cast<char*>(const_cast<void*>(a.q));
      const cudaError_t err = qk_norm_rope_cache_seqs(
          q, q + size_t(a.k_off) * es, q + size_t(a.v_off) * es, a.t, a.T, a.Hq, a.Hkv, a.Dk, ldq, ldq, ldq,
          a.q_norm, a.qwt, a.k_norm, a.kwt, a.eps, a.weight_before_cast, seqs, *a.rope, s);
      if (err != cudaSuccess) return err;
    }
  }
  auto run = [&](auto tag) {
    using E = decltype(tag);
    cudaError_t err = cudaSuccess;
    if constexpr (!std::is_same_v<E, float>) {
      if (vec) {
        const E* qe = static_cast<const E*>(a.q);
        E* oe = static_cast<E*>(a.out);
        auto kernel = a.Dk == 64 ? decode_attention_vec_kernel<E, 8>
                                 : a.Dk == 128 ? decode_attention_vec_kernel<E, 16> : decode_attention_vec_kernel<E, 32>;
        // The prefetch: the chunk's keys and values in shared memory (the host sized the chunk to fit).
        const bool pre = a.prefetch && f.on;
        const size_t pre_bytes = pre ? 2 * size_t(a.chunk) * size_t(a.Dk) * sizeof(E) : 0;
        if (pre && (a.chunk > attention_prefetch_keys(a.Dk, sizeof(E)) || a.chunk % kAttnTile != 0))
          return cudaErrorInvalidValue;
        if (pre_bytes > 48 * 1024) {
          err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(pre_bytes));
          if (err != cudaSuccess) return err;
        }
        err = cuda::launch_pdl(pdl, kernel, grid, dim3(kAttnThreads), pre_bytes, s, qe, ldq, seqs, oe, a.Hq, a.Hkv,
                               a.scale, a.window, a.sinks, a.sink_t, a.chunk, a.part, f, pre ? 1 : 0);
      }
    }
    if (!vec)
      err = cuda::launch_pdl(pdl, attention_kernel<E>, grid, dim3(kAttnThreads), smem, s,
                             static_cast<const E*>(a.q), ldq, seqs, static_cast<E*>(a.out), a.Hq, a.Hkv, a.Dk, a.Dv,
                             a.scale, a.window, a.sinks, a.sink_t, a.chunk, a.part);
    if (err != cudaSuccess || !a.part) return err;
    return cuda::launch_pdl(pdl, attention_combine_kernel<E>, dim3(unsigned(bh)), dim3(128), 0, s,
                            static_cast<const float*>(a.part), int(a.splits), a.Hq, a.Dv, a.sinks, a.sink_t,
                            static_cast<E*>(a.out), a.prefetch ? 1 : 0);
  };
  if (a.t == kF32) return run(float());
  if (a.t == kBF16) return run(bf16());
  return run(f16());
}

}  // namespace moekit::model::kernels

// batched_mm's small-T projections: GEMVs per (token, slot) pair, reading the expert's weight rows in place
// (no copy of the weights, no sort). Memory-bound: each warp streams kRowsPerWarp weight rows together, each
// lane keeping kUnroll 16-byte loads of every row in flight before the first multiply, and reduces with
// shuffles.
//
//   pair_gemv:         out[p, :] = epilogue(W1[e_p] a[p / a_row_div]) for every pair (first projection).
//   pair_gemv_combine: out[t, :] = sum over slots k in order of w[t, k] * (W2[e_(t,k)] act[t * K + k] + b2[e]),
//                      rounded once: the second projection, the routing weights and the slot sum in one
//                      launch; each block's partial dot products meet in shared memory and one thread per
//                      column sums them in slot order (deterministic, no atomics on the values). Its streaming
//                      form (default) runs one wave of blocks over evenly split columns and issues each warp's
//                      first weight loads before the PDL wait; the same sums, bit for bit.
// Both read the expert ids straight from top_k_index (ids outside [0, E] are recorded in the sticky error
// word, as route_validate does, and contribute nothing; E is the dropped-pair sentinel). Both launch with
// Programmatic Dependent Launch (base/cuda_pdl.cuh): the second projection's blocks are placed while the first
// runs, read their slots' ids (and optionally prefetch their weight rows) and then wait for it.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>

#include "backends/cuda/kernels/device_math.cuh"
#include "base/cuda_device.h"
#include "base/cuda_pdl.cuh"
#include "base/env.h"

namespace moekit::cuda::kernels {
namespace {

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kRowsPerWarp = 4;  // weight rows a warp streams together
constexpr int kUnroll = 4;       // 16-byte pieces per row and lane in flight
constexpr size_t kGemvMaxSmem = 48 * 1024;

// The VEC elements of T in one 16-byte piece as floats.
template <class T, int VEC>
__device__ __forceinline__ void to_floats(const uint4& raw, float (&v)[VEC]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = to_f32(e[i]);
}

// One round of kUnroll pieces per row in two halves, so that a round's weight loads can be issued before the PDL
// wait that the activations need: load_round loads the round's weight pieces (zero past k; guarded pieces load the
// round's first piece, in range, so that the loads stay unconditional), fma_round loads the activation pieces and
// multiplies.
template <class T, int VEC, int ROWS, bool GUARD>
__device__ __forceinline__ void load_round(const T* (&rows)[ROWS], int64_t base, int64_t k, uint4 (&w)[kUnroll][ROWS]) {
  constexpr int64_t kStep = 32 * VEC;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const bool in = !GUARD || base + u * kStep < k;
    const int64_t i = in ? base + u * kStep : base;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      w[u][r] = *reinterpret_cast<const uint4*>(rows[r] + i);
      if (!in) w[u][r] = make_uint4(0, 0, 0, 0);
    }
  }
}
template <class T, int VEC, int ROWS, bool GUARD>
__device__ __forceinline__ void fma_round(const uint4 (&w)[kUnroll][ROWS], const T* a, int64_t base, int64_t k,
                                          float (&acc)[ROWS]) {
  constexpr int64_t kStep = 32 * VEC;
  uint4 av[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const bool in = !GUARD || base + u * kStep < k;
    const int64_t i = in ? base + u * kStep : base;
    av[u] = *reinterpret_cast<const uint4*>(a + i);
    if (!in) av[u] = make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    float af[VEC];
    to_floats<T, VEC>(av[u], af);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float wf[VEC];
      to_floats<T, VEC>(w[u][r], wf);
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[r] = fmaf(af[v], wf[v], acc[r]);
    }
  }
}

// acc[r] += dot(rows[r][0, k), a[0, k)) over this lane's pieces for one round: every load before the first multiply.
template <class T, int VEC, int ROWS, bool GUARD>
__device__ __forceinline__ void stream_round(const T* (&rows)[ROWS], const T* a, int64_t base, int64_t k,
                                             float (&acc)[ROWS]) {
  uint4 w[kUnroll][ROWS];
  load_round<T, VEC, ROWS, GUARD>(rows, base, k, w);
  fma_round<T, VEC, ROWS, GUARD>(w, a, base, k, acc);
}

// acc[r] += dot(rows[r][0, k), a[0, k)) over this lane's pieces: VEC elements per piece (16 bytes when
// VEC > 1, single elements otherwise), kUnroll pieces of every row loaded before the first multiply (full
// rounds unguarded, so that the compiler issues all of their loads at once; then one guarded round). The
// warp's lanes cover interleaved pieces; the caller reduces over the lanes.
template <class T, int VEC, int ROWS>
__device__ __forceinline__ void stream_rows(const T* (&rows)[ROWS], const T* a, int64_t k, int lane,
                                            float (&acc)[ROWS]) {
  constexpr int64_t kStep = 32 * VEC;
  if constexpr (VEC > 1) {
    int64_t base = int64_t(lane) * VEC;
    for (; base + (kUnroll - 1) * kStep < k; base += kStep * kUnroll) stream_round<T, VEC, ROWS, false>(rows, a, base, k, acc);
    if (base < k) stream_round<T, VEC, ROWS, true>(rows, a, base, k, acc);
  } else {
    for (int64_t i = lane; i < k; i += 32) {
      const float av = to_f32(a[i]);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(av, to_f32(rows[r][i]), acc[r]);
    }
  }
}

template <int ROWS>
__device__ __forceinline__ void warp_sum(float (&acc)[ROWS]) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int d = 16; d > 0; d /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], d);
}

// The first projection's epilogue: lane j < kCols of the warp stores column col0 + j (bias, gate, activation).
template <class T, int EPI, int kCols>
__device__ __forceinline__ void pair_gemv_store(const PairGemvArgs& args, const float (&acc)[kRowsPerWarp], int64_t p,
                                                int e, int64_t col0, int lane) {
  if (lane >= kCols) return;
  const int64_t c = col0 + lane;
  if (c >= args.n) return;
  float first = 0.0f, second = 0.0f;  // pick this lane's column from the unrolled accumulators
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    if (j == lane) {
      if constexpr (EPI == kEpiGated) {
        first = acc[2 * j];
        second = acc[2 * j + 1];
      } else {
        first = acc[j];
      }
    }
  }
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(e) * args.bias_expert_stride : nullptr;
  if constexpr (EPI == kEpiGated) {
    const int64_t gr = gate_row(args.gate, c), ur = up_row(args.gate, c, args.inter);
    if (bias) {
      first += to_f32(bias[gr]);
      second += to_f32(bias[ur]);
    }
    static_cast<T*>(args.out)[p * args.ldo + c] = from_f32<T>(gate_value(args.gate, first, second));
  } else if constexpr (EPI == kEpiActOnly) {
    if (bias) first += to_f32(bias[c]);
    static_cast<T*>(args.out)[p * args.ldo + c] = from_f32<T>(activate(args.gate.activation, first));
  } else {
    static_cast<float*>(args.out)[p * args.ldo + c] = first;
  }
}

// ---- first projection: one block per (pair, kGemvWarps * columns-per-warp columns) ----

// DIRECT (16-byte pieces only): the warps read the activation row in place (the block's warps share it through
// L1) instead of staging it in shared memory first, so that their first weight loads go out with it rather than
// after the staging's round trip and the barrier; the same sums as the staged form, bit for bit.
template <class T, int VEC, int EPI, int MINB, bool DIRECT>
__global__ void __launch_bounds__(kGemvThreads, MINB) pair_gemv_kernel(PairGemvArgs args) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  T* a_s = reinterpret_cast<T*>(gemv_smem);  // [k]
  // Everything here reads what the kernels before wrote (the ids, the activations): wait first, then let the
  // second projection start (it reads top_k_index before its own wait: done by the time any block gets here).
  pdl_wait();
  pdl_trigger();
  const int64_t p = blockIdx.x;
  const int e = pair_expert_of(args.index, args.index_type, p, args.top_k, args.experts, args.error);
  if (e >= args.experts) return;  // sentinel or bad id: the row is never read
  const int64_t k = args.k;
  const T* a_row = static_cast<const T*>(args.a) + (p / args.a_row_div) * args.lda;
  constexpr int kCols = EPI == kEpiGated ? kRowsPerWarp / 2 : kRowsPerWarp;  // output columns per warp
  constexpr bool direct = DIRECT && VEC > 1;
  if constexpr (!direct) {
    if constexpr (VEC > 1) {
      for (int64_t i = threadIdx.x; i < k / VEC; i += kGemvThreads)
        reinterpret_cast<uint4*>(a_s)[i] = reinterpret_cast<const uint4*>(a_row)[i];
    } else {
      for (int64_t i = threadIdx.x; i < k; i += kGemvThreads) a_s[i] = a_row[i];
    }
    __syncthreads();
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t col0 = (int64_t(blockIdx.y) * kGemvWarps + warp) * kCols;
  if (col0 >= args.n) return;
  const T* w_expert = static_cast<const T*>(args.b) + int64_t(e) * args.b_expert_stride;
  const T* rows[kRowsPerWarp];
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    const int64_t c = min(col0 + j, args.n - 1);  // columns past n recompute the last one, never stored
    if constexpr (EPI == kEpiGated) {
      rows[2 * j] = w_expert + gate_row(args.gate, c) * k;
      rows[2 * j + 1] = w_expert + up_row(args.gate, c, args.inter) * k;
    } else {
      rows[j] = w_expert + c * k;
    }
  }
  float acc[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) acc[r] = 0.0f;
  stream_rows<T, VEC, kRowsPerWarp>(rows, direct ? a_row : a_s, k, lane, acc);
  warp_sum(acc);
  pair_gemv_store<T, EPI, kCols>(args, acc, p, e, col0, lane);
}

// Blocks per multiprocessor the kernels are compiled for: 0 (no bound) lets the compiler take the registers it
// wants (72-76 for the 16-byte kernels: three blocks of 256 threads per multiprocessor), 4 caps them at 64 (24-60
// bytes of spills) so that four blocks fit (qwen3-30b-a3b's second projection at T = 1, 512 blocks, in one wave
// on 132 multiprocessors). MOEKIT_PAIR_GEMV_BLOCKS=4 / MOEKIT_PAIR_COMBINE_BLOCKS=4 in the environment (read
// once) pick 4 for the first / second projection. Off by default: on the H200 both at 4 ran qwen3-30b-a3b at
// T = 1 / 8 in 31.5 / 152.3 us against 29.3 / 140.5.
int min_blocks_from_env(const char* name) { return env_int(name, 0) == 4 ? 4 : 0; }
int pair_gemv_min_blocks() {
  static const int v = min_blocks_from_env("MOEKIT_PAIR_GEMV_BLOCKS");
  return v;
}
int pair_combine_min_blocks() {
  static const int v = min_blocks_from_env("MOEKIT_PAIR_COMBINE_BLOCKS");
  return v;
}

EnvSwitch g_pair_gemv_direct{"MOEKIT_PAIR_GEMV_DIRECT", true}, g_combine_stream{"MOEKIT_COMBINE_STREAM", true};

template <class T, int VEC, int MINB, bool DIRECT>
cudaError_t launch_gemv_mb(const PairGemvArgs& a, cudaStream_t stream) {
  const int cols_per_warp = a.epilogue == kEpiGated ? kRowsPerWarp / 2 : kRowsPerWarp;
  const int64_t cols_per_block = int64_t(kGemvWarps) * cols_per_warp;
  const dim3 grid(unsigned(a.pairs), unsigned((a.n + cols_per_block - 1) / cols_per_block));
  const size_t smem = DIRECT ? 0 : size_t(a.k) * sizeof(T);
  const bool pdl = pdl_enabled();
  switch (a.epilogue) {
    case kEpiGated:
      return launch_pdl(pdl, pair_gemv_kernel<T, VEC, kEpiGated, MINB, DIRECT>, grid, kGemvThreads, smem, stream, a);
    case kEpiActOnly:
      return launch_pdl(pdl, pair_gemv_kernel<T, VEC, kEpiActOnly, MINB, DIRECT>, grid, kGemvThreads, smem, stream, a);
    case kEpiF32:
      return launch_pdl(pdl, pair_gemv_kernel<T, VEC, kEpiF32, MINB, DIRECT>, grid, kGemvThreads, smem, stream, a);
    default: return cudaErrorInvalidValue;
  }
}

template <class T, int VEC>
cudaError_t launch_gemv(const PairGemvArgs& a, cudaStream_t stream) {
  if constexpr (VEC > 1) {
    if (pair_gemv_min_blocks() == 4) return launch_gemv_mb<T, VEC, 4, false>(a, stream);
    if (pair_gemv_direct()) return launch_gemv_mb<T, VEC, 0, true>(a, stream);
  }
  return launch_gemv_mb<T, VEC, 0, false>(a, stream);
}

// ---- second projection with the combine: one block per (token, group of columns) ----
//
// The block's work units are (slot k, kRowsPerWarp consecutive columns); warps take units in turn, each
// streaming the unit's kRowsPerWarp rows of W2[e_k] against act[t * K + k] (read in place: a few KB that the
// block's warps share through L1). The dot products land in shared memory part[k][c]; then one thread per
// column sums w_k * (part + b2) over k in slot order and rounds once.
constexpr int kCombineMaxSlots = 64;

template <class T, class W, int VEC, int MINB>
__global__ void __launch_bounds__(kGemvThreads, MINB)
    pair_gemv_combine_kernel(PairGemvArgs args, int64_t cols_per_block, int prefetch) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  float* part = reinterpret_cast<float*>(gemv_smem);                   // [K, cols_per_block]
  int* slot_e = reinterpret_cast<int*>(part + args.top_k * cols_per_block);  // [K]
  const int64_t t = blockIdx.x;
  const int K = args.top_k;
  const int64_t col_base = int64_t(blockIdx.y) * cols_per_block;
  // Before the wait (PDL, base/cuda_pdl.cuh): top_k_index (written before the first projection, which has
  // passed its own wait by the time this block runs) and the weights only.
  for (int s = threadIdx.x; s < K; s += kGemvThreads)
    slot_e[s] = pair_expert_of(args.index, args.index_type, t * K + s, K, args.experts, args.error);
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t k = args.k;
  const int64_t groups = cols_per_block / kRowsPerWarp;
  if (prefetch) {  // this block's weight rows into L2 while the first projection still runs
    for (int64_t unit = warp; unit < K * groups; unit += kGemvWarps) {
      const int s = int(unit / groups);
      const int64_t c0 = col_base + (unit % groups) * kRowsPerWarp;
      const int e = slot_e[s];
      if (e >= args.experts || c0 >= args.n) continue;
      const T* w_expert = static_cast<const T*>(args.b) + int64_t(e) * args.b_expert_stride;
      prefetch_l2(w_expert + c0 * k, min(int64_t(kRowsPerWarp), args.n - c0) * k * int64_t(sizeof(T)), lane, 32);
    }
  }
  pdl_wait();
  pdl_trigger();
  for (int64_t unit = warp; unit < K * groups; unit += kGemvWarps) {
    const int s = int(unit / groups);
    const int64_t c0 = col_base + (unit % groups) * kRowsPerWarp;
    const int e = slot_e[s];
    if (e >= args.experts || c0 >= args.n) continue;  // dropped slot: its part is never read
    const T* w_expert = static_cast<const T*>(args.b) + int64_t(e) * args.b_expert_stride;
    const T* rows[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
      rows[r] = w_expert + min(c0 + r, args.n - 1) * k;  // columns past n recompute the last one, never stored
    const T* a_row = static_cast<const T*>(args.a) + (t * K + s) * args.lda;
    float acc[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[r] = 0.0f;
    stream_rows<T, VEC, kRowsPerWarp>(rows, a_row, k, lane, acc);
    warp_sum(acc);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) part[s * cols_per_block + (c0 - col_base) + r] = acc[r];
    }
  }
  __syncthreads();

  const W* weights = static_cast<const W*>(args.routing_weights);
  const T* bias2 = static_cast<const T*>(args.bias);
  for (int64_t j = threadIdx.x; j < cols_per_block; j += kGemvThreads) {
    const int64_t c = col_base + j;
    if (c >= args.n) break;
    float acc = 0.0f;
    for (int s = 0; s < K; ++s) {  // slot order: deterministic
      const int e = slot_e[s];
      if (e >= args.experts) continue;  // sentinel or bad id: exactly zero contribution
      const float y = part[s * cols_per_block + j] + (bias2 ? to_f32(bias2[int64_t(e) * args.bias_expert_stride + c]) : 0.0f);
      acc += to_f32(weights[t * K + s]) * y;
    }
    static_cast<T*>(args.out)[t * args.ldo + c] = from_f32<T>(acc);
  }
}

// The streaming form of the second projection with the combine (16-byte pieces): one wave of blocks. Token t's
// column groups (kRowsPerWarp columns each) are split evenly over gridDim.y blocks, block (t, b) taking the groups
// [b * G / gridDim.y, (b + 1) * G / gridDim.y) for all K slots; its warps take the (slot, group) units in turn,
// each streamed as in the first form (same per-unit sums, so the same output bit for bit). The slots' expert ids
// come from top_k_index before the PDL wait (written two launches back), and so does the first round of each
// warp's first unit: those weight loads are in flight while the first projection finishes.
template <class T, class W, int VEC>
__global__ void __launch_bounds__(kGemvThreads, 2)
    pair_combine_stream_kernel(PairGemvArgs args, int groups, int max_cols) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  float* part = reinterpret_cast<float*>(gemv_smem);                // [K, max_cols]
  int* slot_e = reinterpret_cast<int*>(part + args.top_k * max_cols);  // [K]
  const int64_t t = blockIdx.x;
  const int K = args.top_k;
  const int g0 = int(int64_t(groups) * blockIdx.y / gridDim.y), g1 = int(int64_t(groups) * (blockIdx.y + 1) / gridDim.y);
  const int ng = g1 - g0;
  const int64_t col_base = int64_t(g0) * kRowsPerWarp;
  for (int s = threadIdx.x; s < K; s += kGemvThreads)
    slot_e[s] = pair_expert_of(args.index, args.index_type, t * K + s, K, args.experts, args.error);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t k = args.k;
  constexpr int64_t kStep = 32 * VEC;
  bool waited = false;
#pragma unroll 1
  for (int unit = warp; unit < K * ng; unit += kGemvWarps) {
    const int s = unit / ng;
    const int64_t c0 = col_base + int64_t(unit % ng) * kRowsPerWarp;
    const int e = slot_e[s];
    if (e >= args.experts) continue;  // dropped slot: its part is never read
    const T* w_expert = static_cast<const T*>(args.b) + int64_t(e) * args.b_expert_stride;
    const T* rows[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = w_expert + min(c0 + r, args.n - 1) * k;
    const T* a_row = static_cast<const T*>(args.a) + (t * K + s) * args.lda;
    float acc[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[r] = 0.0f;
    int64_t base = int64_t(lane) * VEC;
    uint4 w[kUnroll][kRowsPerWarp];
#pragma unroll 1
    for (; base + (kUnroll - 1) * kStep < k; base += kStep * kUnroll) {
      load_round<T, VEC, kRowsPerWarp, false>(rows, base, k, w);
      if (!waited) {  // the activations are the first projection's output
        pdl_wait();
        pdl_trigger();
        waited = true;
      }
      fma_round<T, VEC, kRowsPerWarp, false>(w, a_row, base, k, acc);
    }
    if (base < k) {
      load_round<T, VEC, kRowsPerWarp, true>(rows, base, k, w);
      if (!waited) {
        pdl_wait();
        pdl_trigger();
        waited = true;
      }
      fma_round<T, VEC, kRowsPerWarp, true>(w, a_row, base, k, acc);
    }
    warp_sum(acc);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) part[s * max_cols + (c0 - col_base) + r] = acc[r];
    }
  }
  if (!waited) {
    pdl_wait();
    pdl_trigger();
  }
  __syncthreads();

  const W* weights = static_cast<const W*>(args.routing_weights);
  const T* bias2 = static_cast<const T*>(args.bias);
  for (int64_t j = threadIdx.x; j < int64_t(ng) * kRowsPerWarp; j += kGemvThreads) {
    const int64_t c = col_base + j;
    if (c >= args.n) break;
    float acc = 0.0f;
    for (int s = 0; s < K; ++s) {  // slot order: deterministic
      const int e = slot_e[s];
      if (e >= args.experts) continue;
      const float y = part[s * max_cols + j] + (bias2 ? to_f32(bias2[int64_t(e) * args.bias_expert_stride + c]) : 0.0f);
      acc += to_f32(weights[t * K + s]) * y;
    }
    static_cast<T*>(args.out)[t * args.ldo + c] = from_f32<T>(acc);
  }
}

bool aligned16(const PairGemvArgs& a) {
  const int64_t vec = 16 / elem_bytes(a.type);
  return a.k % vec == 0 && a.lda % vec == 0 && a.b_expert_stride % vec == 0 &&
         reinterpret_cast<uintptr_t>(a.a) % 16 == 0 && reinterpret_cast<uintptr_t>(a.b) % 16 == 0;
}

}  // namespace

bool pair_gemv_ok(Elem type, int64_t k) { return k > 0 && size_t(k) * elem_bytes(type) <= kGemvMaxSmem; }

cudaError_t pair_gemv(const PairGemvArgs& a, cudaStream_t stream) {
  if (a.pairs == 0 || a.n == 0) return cudaSuccess;
  if (!pair_gemv_ok(a.type, a.k) || a.top_k < 1 || a.pairs > INT_MAX ||
      (a.n + kGemvWarps - 1) / kGemvWarps > 65535)
    return cudaErrorInvalidValue;
  const bool aligned = aligned16(a);
  return with_elem(a.type, [&](auto tag) {
    using T = decltype(tag);
    return aligned ? launch_gemv<T, 16 / sizeof(T)>(a, stream) : launch_gemv<T, 1>(a, stream);
  });
}

bool pair_gemv_direct() { return g_pair_gemv_direct.on(); }
bool set_pair_gemv_direct(bool on) { return g_pair_gemv_direct.set(on); }
bool combine_stream() { return g_combine_stream.on(); }
bool set_combine_stream(bool on) { return g_combine_stream.set(on); }

bool pair_gemv_combine_ok(int top_k) { return top_k >= 1 && top_k <= kCombineMaxSlots; }

cudaError_t pair_gemv_combine(const PairGemvArgs& a, int64_t tokens, cudaStream_t stream) {
  if (tokens == 0 || a.n == 0) return cudaSuccess;
  if (!pair_gemv_combine_ok(a.top_k) || tokens > INT_MAX || a.routing_weights == nullptr) return cudaErrorInvalidValue;
  // Enough columns per block that its kGemvWarps warps each get a unit when the slots are few (8 slots:
  // 4 columns per block; 2 slots: 16).
  const int64_t groups = (kGemvWarps + a.top_k - 1) / a.top_k;
  const int64_t cols_per_block = groups * kRowsPerWarp;
  const int64_t blocks_y = (a.n + cols_per_block - 1) / cols_per_block;
  if (blocks_y > 65535) return cudaErrorInvalidValue;
  const dim3 grid{unsigned(tokens), unsigned(blocks_y)};
  const size_t smem = size_t(a.top_k) * size_t(cols_per_block) * sizeof(float) + size_t(a.top_k) * sizeof(int);
  const bool aligned = aligned16(a);
  // With PDL the blocks that start while the first projection runs prefetch their weight rows, when all the
  // launch's rows fit the prefetch budget (they would be evicted before use otherwise).
  const bool pdl = pdl_enabled();
  const int prefetch = pdl_prefetch(int64_t(tokens) * a.top_k * a.n * a.k * int64_t(elem_bytes(a.type))) ? 1 : 0;
  if (aligned && combine_stream() && pair_combine_min_blocks() != 4) {
    // One wave: about blocks_per_sm blocks per multiprocessor over all tokens (MOEKIT_COMBINE_BLOCKS_PER_SM in the
    // environment, read once; 2 by default: the kernel's 124 registers fit two blocks of 256 threads, and one block
    // per multiprocessor ran qwen3-30b-a3b at T = 1 / 8 in 27.9 / 150.5 us against 25.7 / 127.2 on the H200).
    static const int per_sm = int(std::max<int64_t>(1, std::min<int64_t>(8, env_int("MOEKIT_COMBINE_BLOCKS_PER_SM", 2))));
    const int sms = current_multiprocessors();
    if (sms <= 0) return cudaErrorInvalidValue;
    const int64_t col_groups = (a.n + kRowsPerWarp - 1) / kRowsPerWarp;
    if (col_groups > INT_MAX / 2) return cudaErrorInvalidValue;
    int64_t by = std::max<int64_t>(1, std::min<int64_t>(col_groups, (int64_t(sms) * per_sm + tokens - 1) / tokens));
    int64_t max_cols = 0;
    size_t smem2 = 0;
    for (;;) {  // more blocks when a block's partial sums would not fit in shared memory
      max_cols = (col_groups + by - 1) / by * kRowsPerWarp;
      smem2 = size_t(a.top_k) * size_t(max_cols) * sizeof(float) + size_t(a.top_k) * sizeof(int);
      if (smem2 <= kGemvMaxSmem || by == col_groups) break;
      by = std::min(col_groups, by * 2);
    }
    if (smem2 > kGemvMaxSmem || by > 65535) return cudaErrorInvalidValue;
    const dim3 grid2{unsigned(tokens), unsigned(by)};
    return with_elem(a.type, [&](auto tag) {
      using T = decltype(tag);
      return with_elem(a.routing_weight_type, [&](auto wtag) {
        using W = decltype(wtag);
        return launch_pdl(pdl, pair_combine_stream_kernel<T, W, 16 / sizeof(T)>, grid2, kGemvThreads, smem2, stream, a,
                          int(col_groups), int(max_cols));
      });
    });
  }
  return with_elem(a.type, [&](auto tag) {
    using T = decltype(tag);
    return with_elem(a.routing_weight_type, [&](auto wtag) {
      using W = decltype(wtag);
      if (aligned && pair_combine_min_blocks() == 4)
        return launch_pdl(pdl, pair_gemv_combine_kernel<T, W, 16 / sizeof(T), 4>, grid, kGemvThreads, smem, stream,
                          a, cols_per_block, prefetch);
      if (aligned)
        return launch_pdl(pdl, pair_gemv_combine_kernel<T, W, 16 / sizeof(T), 0>, grid, kGemvThreads, smem, stream,
                          a, cols_per_block, prefetch);
      return launch_pdl(pdl, pair_gemv_combine_kernel<T, W, 1, 0>, grid, kGemvThreads, smem, stream, a,
                        cols_per_block, prefetch);
    });
  });
}

}  // namespace moekit::cuda::kernels

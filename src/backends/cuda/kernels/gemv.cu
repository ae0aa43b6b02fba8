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
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "backends/cuda/kernels/device_math.cuh"
#include "base/cuda_device.h"
#include "base/cuda_pdl.cuh"
#include "base/cuda_route.cuh"
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
// A 16-byte weight piece that is not kept in L1 (NA) or through the default path.
template <bool NA>
__device__ __forceinline__ uint4 load_piece(const void* p) {
  if constexpr (NA) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  } else {
    return *reinterpret_cast<const uint4*>(p);
  }
}

template <class T, int VEC, int ROWS, bool GUARD, bool NA = false>
__device__ __forceinline__ void load_round(const T* (&rows)[ROWS], int64_t base, int64_t k, uint4 (&w)[kUnroll][ROWS]) {
  constexpr int64_t kStep = 32 * VEC;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const bool in = !GUARD || base + u * kStep < k;
    const int64_t i = in ? base + u * kStep : base;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      w[u][r] = load_piece<NA>(rows[r] + i);
      if (!in) w[u][r] = make_uint4(0, 0, 0, 0);
    }
  }
}
// CG: the activations are read past L1 (__ldcg), for activations other blocks of the same launch wrote.
template <class T, int VEC, int ROWS, bool GUARD, bool CG = false>
__device__ __forceinline__ void fma_round(const uint4 (&w)[kUnroll][ROWS], const T* a, int64_t base, int64_t k,
                                          float (&acc)[ROWS]) {
  constexpr int64_t kStep = 32 * VEC;
  uint4 av[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const bool in = !GUARD || base + u * kStep < k;
    const int64_t i = in ? base + u * kStep : base;
    av[u] = CG ? __ldcg(reinterpret_cast<const uint4*>(a + i)) : *reinterpret_cast<const uint4*>(a + i);
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
template <class T, int VEC, int ROWS, bool GUARD, bool NA = false>
__device__ __forceinline__ void stream_round(const T* (&rows)[ROWS], const T* a, int64_t base, int64_t k,
                                             float (&acc)[ROWS]) {
  uint4 w[kUnroll][ROWS];
  load_round<T, VEC, ROWS, GUARD, NA>(rows, base, k, w);
  fma_round<T, VEC, ROWS, GUARD>(w, a, base, k, acc);
}

// acc[r] += dot(rows[r][0, k), a[0, k)) over this lane's pieces: VEC elements per piece (16 bytes when
// VEC > 1, single elements otherwise), kUnroll pieces of every row loaded before the first multiply (full
// rounds unguarded, so that the compiler issues all of their loads at once; then one guarded round). The
// warp's lanes cover interleaved pieces; the caller reduces over the lanes.
template <class T, int VEC, int ROWS, bool NA = false>
__device__ __forceinline__ void stream_rows(const T* (&rows)[ROWS], const T* a, int64_t k, int lane,
                                            float (&acc)[ROWS]) {
  constexpr int64_t kStep = 32 * VEC;
  if constexpr (VEC > 1) {
    int64_t base = int64_t(lane) * VEC;
    for (; base + (kUnroll - 1) * kStep < k; base += kStep * kUnroll)
      stream_round<T, VEC, ROWS, false, NA>(rows, a, base, k, acc);
    if (base < k) stream_round<T, VEC, ROWS, true, NA>(rows, a, base, k, acc);
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
//
// ROUTE (ExpertsCall::routing): the block's first warp routes the pair's token from the router logits
// (base/cuda_route.cuh, the model router's code) as far as the pair's slot, instead of reading top_k_index; the
// token's slot-0 block of column block 0 routes it in full and writes top_k_index / top_k_weights (outputs).
template <class T, int VEC, int EPI, int MINB, bool DIRECT, bool ROUTE = false>
__global__ void __launch_bounds__(kGemvThreads, MINB) pair_gemv_kernel(PairGemvArgs args) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  T* a_s = reinterpret_cast<T*>(gemv_smem);  // [k]
  // Everything here reads what the kernels before wrote (the ids or logits, the activations): wait first, then let
  // the second projection start (it reads top_k_index, or the logits, before its own wait: done by the time any
  // block gets here).
  pdl_wait();
  pdl_trigger();
  const int64_t p = blockIdx.x;
  int e;
  if constexpr (ROUTE) {
    __shared__ int routed_e;
    const int K = args.top_k;
    const int64_t tok = p / K;
    const int slot = int(p % K);
    const bool writer = blockIdx.y == 0 && slot == 0;
    if (threadIdx.x < 32) {
      int re;
      float rw;
      route_warp<kRouteInsidePerLane>(args.route_logits + tok * args.experts, nullptr, args.experts, K,
                                      args.route_kind, args.route_norm, 1.0f, 1, 1, writer ? K : slot + 1, re, rw);
      if (int(threadIdx.x) == slot) routed_e = re;
      if (writer && int(threadIdx.x) < K) {
        args.route_index_out[tok * K + threadIdx.x] = re;
        args.route_weights_out[tok * K + threadIdx.x] = rw;
      }
    }
    __syncthreads();
    e = routed_e;
  } else {
    e = pair_expert_of(args.index, args.index_type, p, args.top_k, args.experts, args.error);
  }
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

template <class T, int VEC, int MINB, bool DIRECT, bool ROUTE = false>
cudaError_t launch_gemv_mb(const PairGemvArgs& a, cudaStream_t stream) {
  const int cols_per_warp = a.epilogue == kEpiGated ? kRowsPerWarp / 2 : kRowsPerWarp;
  const int64_t cols_per_block = int64_t(kGemvWarps) * cols_per_warp;
  const dim3 grid(unsigned(a.pairs), unsigned((a.n + cols_per_block - 1) / cols_per_block));
  const size_t smem = DIRECT ? 0 : size_t(a.k) * sizeof(T);
  const bool pdl = pdl_enabled();
  switch (a.epilogue) {
    case kEpiGated:
      return launch_pdl(pdl, pair_gemv_kernel<T, VEC, kEpiGated, MINB, DIRECT, ROUTE>, grid, kGemvThreads, smem,
                        stream, a);
    case kEpiActOnly:
      return launch_pdl(pdl, pair_gemv_kernel<T, VEC, kEpiActOnly, MINB, DIRECT, ROUTE>, grid, kGemvThreads, smem,
                        stream, a);
    case kEpiF32:
      if constexpr (!ROUTE)
        return launch_pdl(pdl, pair_gemv_kernel<T, VEC, kEpiF32, MINB, DIRECT>, grid, kGemvThreads, smem, stream, a);
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
}

template <class T, int VEC>
cudaError_t launch_gemv(const PairGemvArgs& a, cudaStream_t stream) {
  if constexpr (VEC > 1) {
    if (a.route_logits) {  // pair_route_ok: the default form only
      if (pair_gemv_min_blocks() == 4 || !pair_gemv_direct()) return cudaErrorInvalidValue;
      return launch_gemv_mb<T, VEC, 0, true, true>(a, stream);
    }
    if (pair_gemv_min_blocks() == 4) return launch_gemv_mb<T, VEC, 4, false>(a, stream);
    if (pair_gemv_direct()) return launch_gemv_mb<T, VEC, 0, true>(a, stream);
  }
  if (a.route_logits) return cudaErrorInvalidValue;
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
//
// ROUTE (ExpertsCall::routing): the block's first warp routes token t from the router logits (written two launches
// back, like top_k_index otherwise) before the wait; its slots' experts and weights replace top_k_index and the
// routing weights (the same values: the model router's code, f32 weights).
template <class T, class W, int VEC, bool ROUTE = false>
__global__ void __launch_bounds__(kGemvThreads, 2)
    pair_combine_stream_kernel(PairGemvArgs args, int groups, int max_cols) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  float* part = reinterpret_cast<float*>(gemv_smem);                // [K, max_cols]
  int* slot_e = reinterpret_cast<int*>(part + args.top_k * max_cols);  // [K]
  float* slot_w = reinterpret_cast<float*>(slot_e + args.top_k);       // ROUTE: [K]
  const int64_t t = blockIdx.x;
  const int K = args.top_k;
  const int g0 = int(int64_t(groups) * blockIdx.y / gridDim.y), g1 = int(int64_t(groups) * (blockIdx.y + 1) / gridDim.y);
  const int ng = g1 - g0;
  const int64_t col_base = int64_t(g0) * kRowsPerWarp;
  if constexpr (ROUTE) {
    if (threadIdx.x < 32) {
      int re;
      float rw;
      route_warp<kRouteInsidePerLane>(args.route_logits + t * args.experts, nullptr, args.experts, K,
                                      args.route_kind, args.route_norm, 1.0f, 1, 1, K, re, rw);
      if (int(threadIdx.x) < K) {
        slot_e[threadIdx.x] = re;
        slot_w[threadIdx.x] = rw;
      }
    }
  } else {
    for (int s = threadIdx.x; s < K; s += kGemvThreads)
      slot_e[s] = pair_expert_of(args.index, args.index_type, t * K + s, K, args.experts, args.error);
  }
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
      acc += (ROUTE ? slot_w[s] : to_f32(weights[t * K + s])) * y;
    }
    static_cast<T*>(args.out)[t * args.ldo + c] = from_f32<T>(acc);
  }
}

// ---- both projections and the combine in one launch (small T, sm_90) ----
//
// The two-launch path above pays two ramps and two tails of a DRAM stream and the boundary between them; at T = 1
// on the fine-grained shapes that fixed part is as large as a third of the call. Here one wave of blocks (one per
// multiprocessor, all resident at once) does it all:
//   1. block (t, b) takes column groups [b G / by, (b + 1) G / by) of token t's output (G groups of kRowsPerWarp
//      columns) and, right after the PDL wait, starts bulk copies (cp.async.bulk, one per slot) of those rows of
//      its first `staged` slots' second-projection weights into shared memory: they stream while step 2 runs;
//   2. the first projection over the whole grid: the (pair, kCols columns) units split evenly over every warp of
//      the grid, each computed exactly as pair_gemv computes it, into act [P, I];
//   3. a grid barrier (two arrival counters of the workspace, left zero);
//   4. the second projection and the combine as pair_combine_stream_kernel computes them (same per-unit sums,
//      same slot order), the staged slots' rows read from shared memory, the others from global memory.
// The output is bit for bit the two-launch path's.
struct PairFusedParams {
  int groups;    // column groups of the output (kRowsPerWarp columns each)
  int max_cols;  // columns of the widest block
  int staged;    // slots whose rows are staged in shared memory
  uint32_t* barrier;  // two words, zero between launches
};

constexpr int kFusedMaxThreads = 768, kFusedMaxPairs = 256;

template <class T, class W, int EPI, bool NA>
__global__ void __launch_bounds__(kFusedMaxThreads, 1)
    pair_fused_kernel(const PairGemvArgs g1, const PairGemvArgs g2, const PairFusedParams fp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int VEC = 16 / sizeof(T);
  constexpr int64_t kStep = 32 * VEC;
  extern __shared__ __align__(128) unsigned char fused_smem[];
  const int K = g2.top_k;
  float* part = reinterpret_cast<float*>(fused_smem);                    // [K, max_cols]
  int* pair_e = reinterpret_cast<int*>(part + K * fp.max_cols);           // [P]: every pair's expert
  const size_t head = (size_t(K) * fp.max_cols * 4 + size_t(g1.pairs) * 4 + 8 + 127) / 128 * 128;
  uint64_t* bar = reinterpret_cast<uint64_t*>(fused_smem + head - 8);
  T* staged_w = reinterpret_cast<T*>(fused_smem + head);                  // [staged, max_cols, I]
  const uint32_t bar_s = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  const int nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t by = int64_t(gridDim.x) / (g2.pairs / K > 1 ? g2.pairs / K : int64_t(1));  // column blocks per token
  const int64_t t = blockIdx.x / by, b = blockIdx.x % by;
  const int gb0 = int(int64_t(fp.groups) * b / by), gb1 = int(int64_t(fp.groups) * (b + 1) / by);
  const int ng = gb1 - gb0;
  const int64_t col_base = int64_t(gb0) * kRowsPerWarp;
  const int64_t ncols = min(int64_t(ng) * kRowsPerWarp, g2.n - col_base);  // rows staged per slot
  const int64_t I = g2.k;

  // Everything below reads what the kernels before wrote (ids, activations): wait first.
  pdl_wait();
  pdl_trigger();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar_s));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int p = threadIdx.x; p < g1.pairs; p += blockDim.x)
    pair_e[p] = pair_expert_of(g1.index, g1.index_type, p, K, g1.experts, g1.error);
  __syncthreads();
  const int* slot_e = pair_e + t * K;
  if (threadIdx.x == 0) {
    uint32_t bytes = 0;
    for (int s = 0; s < fp.staged; ++s)
      if (slot_e[s] < g2.experts && ncols > 0) bytes += uint32_t(ncols * I * int64_t(sizeof(T)));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar_s), "r"(bytes) : "memory");
    for (int s = 0; s < fp.staged; ++s) {
      const int e = slot_e[s];
      if (e >= g2.experts || ncols <= 0) continue;
      const T* src = static_cast<const T*>(g2.b) + int64_t(e) * g2.b_expert_stride + col_base * I;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(staged_w + int64_t(s) * fp.max_cols * I));
      const uint32_t n_bytes = uint32_t(ncols * I * int64_t(sizeof(T)));
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
          "l"(src), "r"(n_bytes), "r"(bar_s)
          : "memory");
    }
  }

  // 2. The first projection: units (pair, kCols columns), pair-major, split evenly over the grid's warps.
  {
    constexpr int kCols = EPI == kEpiGated ? kRowsPerWarp / 2 : kRowsPerWarp;
    const int64_t per_pair = (g1.n + kCols - 1) / kCols;
    const int64_t units = g1.pairs * per_pair;
    const int64_t nwarps = int64_t(gridDim.x) * nw, w = int64_t(blockIdx.x) * nw + warp;
    const int64_t u1 = units * (w + 1) / nwarps;
    const int64_t k = g1.k;
#pragma unroll 1
    for (int64_t u = units * w / nwarps; u < u1; ++u) {
      const int64_t p = u / per_pair, col0 = (u % per_pair) * kCols;
      const int e = pair_e[p];
      if (e >= g1.experts) continue;  // sentinel or bad id: the row is never read
      const T* a_row = static_cast<const T*>(g1.a) + (p / g1.a_row_div) * g1.lda;
      const T* w_expert = static_cast<const T*>(g1.b) + int64_t(e) * g1.b_expert_stride;
      const T* rows[kRowsPerWarp];
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int64_t c = min(col0 + j, g1.n - 1);
        if constexpr (EPI == kEpiGated) {
          rows[2 * j] = w_expert + gate_row(g1.gate, c) * k;
          rows[2 * j + 1] = w_expert + up_row(g1.gate, c, g1.inter) * k;
        } else {
          rows[j] = w_expert + c * k;
        }
      }
      float acc[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) acc[r] = 0.0f;
      stream_rows<T, VEC, kRowsPerWarp, NA>(rows, a_row, k, lane, acc);
      warp_sum(acc);
      pair_gemv_store<T, EPI, kCols>(g1, acc, p, e, col0, lane);
    }
  }

  // 3. Grid barrier: every block's act rows written and visible before any block reads them.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(fp.barrier, 1u);
    uint32_t seen = 0;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(fp.barrier) : "memory");
      if (seen >= gridDim.x) break;
      __nanosleep(20);
    }
    // The last block through resets both words (no block reads the first one any more).
    if (atomicAdd(fp.barrier + 1, 1u) == gridDim.x - 1) {
      atomicExch(fp.barrier, 0u);
      atomicExch(fp.barrier + 1, 0u);
    }
    __threadfence();
  }
  __syncthreads();

  // 4. The second projection with the combine.
  if (fp.staged > 0) {  // the staged rows have landed
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar_s)
          : "memory");
    }
  }
#pragma unroll 1
  for (int unit = warp; unit < K * ng; unit += nw) {
    const int s = unit / ng;
    const int64_t c0 = col_base + int64_t(unit % ng) * kRowsPerWarp;
    const int e = slot_e[s];
    if (e >= g2.experts) continue;
    const T* rows[kRowsPerWarp];
    if (s < fp.staged) {
      const T* base_s = staged_w + int64_t(s) * fp.max_cols * I;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = base_s + (min(c0 + r, g2.n - 1) - col_base) * I;
    } else {
      const T* w_expert = static_cast<const T*>(g2.b) + int64_t(e) * g2.b_expert_stride;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = w_expert + min(c0 + r, g2.n - 1) * I;
    }
    const T* a_row = static_cast<const T*>(g2.a) + (t * K + s) * g2.lda;
    float acc[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[r] = 0.0f;
    int64_t base = int64_t(lane) * VEC;
    uint4 wr[kUnroll][kRowsPerWarp];
#pragma unroll 1
    for (; base + (kUnroll - 1) * kStep < I; base += kStep * kUnroll) {
      load_round<T, VEC, kRowsPerWarp, false, false>(rows, base, I, wr);
      fma_round<T, VEC, kRowsPerWarp, false, true>(wr, a_row, base, I, acc);
    }
    if (base < I) {
      load_round<T, VEC, kRowsPerWarp, true>(rows, base, I, wr);
      fma_round<T, VEC, kRowsPerWarp, true, true>(wr, a_row, base, I, acc);
    }
    warp_sum(acc);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) part[s * fp.max_cols + (c0 - col_base) + r] = acc[r];
    }
  }
  __syncthreads();
  const W* weights = static_cast<const W*>(g2.routing_weights);
  const T* bias2 = static_cast<const T*>(g2.bias);
  for (int64_t j = threadIdx.x; j < int64_t(ng) * kRowsPerWarp; j += blockDim.x) {
    const int64_t c = col_base + j;
    if (c >= g2.n) break;
    float acc = 0.0f;
    for (int s = 0; s < K; ++s) {  // slot order: deterministic
      const int e = slot_e[s];
      if (e >= g2.experts) continue;
      const float y = part[s * fp.max_cols + j] + (bias2 ? to_f32(bias2[int64_t(e) * g2.bias_expert_stride + c]) : 0.0f);
      acc += to_f32(weights[t * K + s]) * y;
    }
    static_cast<T*>(g2.out)[t * g2.ldo + c] = from_f32<T>(acc);
  }
#endif
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

bool pair_route_ok(const PairGemvArgs& g1, const PairGemvArgs& g2) {
  return g1.route_logits && g2.route_logits == g1.route_logits && g1.experts >= 1 &&
         g1.experts <= 32 * kRouteInsidePerLane && g1.top_k >= 1 && g1.top_k <= 32 && g1.top_k <= g1.experts &&
         g2.top_k == g1.top_k && g2.experts == g1.experts && g1.route_index_out && g1.route_weights_out &&
         (g1.route_kind == kRouteSoftmaxTopk || g1.route_kind == kRouteTopkSoftmax) &&
         (g1.epilogue == kEpiGated || g1.epilogue == kEpiActOnly) && g2.routing_weight_type == Elem::f32 &&
         aligned16(g1) && aligned16(g2) && pair_gemv_direct() && pair_gemv_min_blocks() != 4 && combine_stream() &&
         pair_combine_min_blocks() != 4;
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
      smem2 = size_t(a.top_k) * size_t(max_cols) * sizeof(float) + size_t(a.top_k) * (sizeof(int) + sizeof(float));
      if (smem2 <= kGemvMaxSmem || by == col_groups) break;
      by = std::min(col_groups, by * 2);
    }
    if (smem2 > kGemvMaxSmem || by > 65535) return cudaErrorInvalidValue;
    const dim3 grid2{unsigned(tokens), unsigned(by)};
    return with_elem(a.type, [&](auto tag) {
      using T = decltype(tag);
      return with_elem(a.routing_weight_type, [&](auto wtag) {
        using W = decltype(wtag);
        if (a.route_logits) {  // the routing weights are f32 outputs
          if constexpr (std::is_same_v<W, float>)
            return launch_pdl(pdl, pair_combine_stream_kernel<T, W, 16 / sizeof(T), true>, grid2, kGemvThreads, smem2,
                              stream, a, int(col_groups), int(max_cols));
          return cudaErrorInvalidValue;
        }
        return launch_pdl(pdl, pair_combine_stream_kernel<T, W, 16 / sizeof(T)>, grid2, kGemvThreads, smem2, stream, a,
                          int(col_groups), int(max_cols));
      });
    });
  }
  if (a.route_logits) return cudaErrorInvalidValue;  // pair_route_ok: the streaming form only
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

namespace {
// The fused launch's layout for these calls, or false when it does not serve them: sm_90, 16-bit types with
// 16-byte aligned rows, a gated or activation-only first epilogue, at most one block per multiprocessor per token,
// and at least half of the slots' second-projection rows staged in shared memory.
struct FusedPlan {
  int by = 0, warps = 0, groups = 0, max_cols = 0, staged = 0;
  size_t smem = 0;
};
bool fused_plan(const PairGemvArgs& g1, const PairGemvArgs& g2, int64_t tokens, int arch, FusedPlan* plan) {
  if (arch != 90 || tokens < 1 || g1.type == Elem::f32 || g1.type != g2.type) return false;
  if (g1.epilogue != kEpiGated && g1.epilogue != kEpiActOnly) return false;
  if (!aligned16(g1) || !aligned16(g2) || g2.routing_weights == nullptr || !pair_gemv_combine_ok(g2.top_k)) return false;
  if (g1.pairs != tokens * g2.top_k || g2.pairs != g1.pairs || g1.a_row_div != g2.top_k || g1.pairs > kFusedMaxPairs)
    return false;
  const int sms = current_multiprocessors();
  if (sms <= 0 || tokens > sms) return false;
  FusedPlan f;
  f.by = int(sms / tokens);
  const int64_t groups = (g2.n + kRowsPerWarp - 1) / kRowsPerWarp;
  if (groups > INT_MAX / 2) return false;
  f.groups = int(groups);
  f.by = int(std::min<int64_t>(f.by, groups));
  f.max_cols = int((groups + f.by - 1) / f.by * kRowsPerWarp);
  const int K = g2.top_k;
  const size_t head = (size_t(K) * f.max_cols * 4 + size_t(g1.pairs) * 4 + 8 + 127) / 128 * 128;
  const size_t per_slot = size_t(f.max_cols) * size_t(g2.k) * elem_bytes(g2.type);
  constexpr size_t kSmemMax = 227 * 1024;
  if (head >= kSmemMax) return false;
  // MOEKIT_FUSED_STAGE_BYTES (environment, read once): the most bytes of staged rows per block (A/B knob; the
  // default stages as many slots as shared memory holds and needs half of them staged).
  static const int64_t stage_cap = env_int("MOEKIT_FUSED_STAGE_BYTES", -1);
  const size_t room = stage_cap >= 0 ? std::min<size_t>(size_t(stage_cap), kSmemMax - head) : kSmemMax - head;
  f.staged = int(std::min<size_t>(K, room / per_slot));
  if ((stage_cap < 0 && 2 * f.staged < K) || (size_t(f.staged) * per_slot) >= (size_t(1) << 20)) return false;
  f.smem = head + size_t(f.staged) * per_slot;
  // Warps per block: the first projection's units split over the grid's warps with the least imbalance (8-24; the
  // most warps among equals, for the most loads in flight).
  const int kcols = g1.epilogue == kEpiGated ? kRowsPerWarp / 2 : kRowsPerWarp;
  const int64_t units = g1.pairs * ((g1.n + kcols - 1) / kcols);
  const int64_t grid = tokens * f.by;
  double best = -1;
  for (int nw = kFusedMaxThreads / 32; nw >= 8; --nw) {
    const double per = double(units) / double(grid * nw);
    const double eff = per / std::ceil(per);
    if (eff > best + 1e-3) best = eff, f.warps = nw;
  }
  *plan = f;
  return true;
}

template <class T, class W>
cudaError_t launch_fused(const PairGemvArgs& g1, const PairGemvArgs& g2, int64_t tokens, const FusedPlan& f,
                         uint32_t* barrier, cudaStream_t stream) {
  const PairFusedParams fp{f.groups, f.max_cols, f.staged, barrier};
  // MOEKIT_FUSED_NOALLOC (environment, read once): the first projection's weight loads not kept in L1 (on by
  // default: with the staged rows in shared memory, L1 is small).
  static const bool na = env_int("MOEKIT_FUSED_NOALLOC", 1) != 0;
  auto kernel = g1.epilogue == kEpiGated ? (na ? pair_fused_kernel<T, W, kEpiGated, true> : pair_fused_kernel<T, W, kEpiGated, false>)
                                         : (na ? pair_fused_kernel<T, W, kEpiActOnly, true> : pair_fused_kernel<T, W, kEpiActOnly, false>);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(f.smem));
  if (err != cudaSuccess) return err;
  return launch_pdl(pdl_enabled(), kernel, dim3(unsigned(tokens * f.by)), dim3(unsigned(f.warps * 32)), f.smem, stream,
                    g1, g2, fp);
}
}  // namespace

bool pair_fused_ok(const PairGemvArgs& g1, const PairGemvArgs& g2, int64_t tokens, int arch) {
  FusedPlan f;
  return fused_plan(g1, g2, tokens, arch, &f);
}

namespace {
std::atomic<int64_t> g_fused_calls{0};
}
int64_t pair_fused_calls() { return g_fused_calls.load(); }

cudaError_t pair_fused(const PairGemvArgs& g1, const PairGemvArgs& g2, int64_t tokens, int arch, uint32_t* barrier,
                       cudaStream_t stream) {
  FusedPlan f;
  if (!fused_plan(g1, g2, tokens, arch, &f) || barrier == nullptr) return cudaErrorInvalidValue;
  g_fused_calls.fetch_add(1);
  return with_elem(g1.type, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;
    } else {
      return with_elem(g2.routing_weight_type, [&](auto wtag) {
        using W = decltype(wtag);
        return launch_fused<T, W>(g1, g2, tokens, f, barrier, stream);
      });
    }
  });
}

}  // namespace moekit::cuda::kernels

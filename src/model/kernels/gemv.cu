// y [M, N] = x [M, K] w [N, K]^T + bias for the decode step's few rows (M <= kGemvMaxM): a memory-bound
// GEMV that reads each weight row once for all M rows. Each warp streams kGemvRows weight rows together
// with 16-byte loads, every lane keeping several pieces of each row in flight before the first multiply.
// Two forms: the streaming form (default) runs one wave of blocks that split the weights evenly (below); the
// first form (MOEKIT_GEMV_STREAM=0 or set_gemv_stream(false)) gives each block a fixed set of columns and, when the
// columns are few (router, o_proj), splits K over the block's warps. Both add the partial sums in shared memory in
// warp order (deterministic).
#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "base/cuda_pdl.cuh"
#include "base/env.h"
#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kGemvRows = 4;  // weight rows (output columns) per warp

template <class T>
struct Elem;
template <>
struct Elem<float> {
  static __device__ __forceinline__ float f(float v) { return v; }
};
template <>
struct Elem<bf16> {
  static __device__ __forceinline__ float f(bf16 v) { return __bfloat162float(v); }
};
template <>
struct Elem<f16> {
  static __device__ __forceinline__ float f(f16 v) { return __half2float(v); }
};

// VEC consecutive elements of T at p (aligned to VEC * sizeof(T) bytes) as floats.
template <class T, int VEC>
struct Piece {
  struct alignas(VEC * sizeof(T)) Raw {
    T v[VEC];
  };
  Raw raw;
  __device__ __forceinline__ void load(const T* p) { raw = *reinterpret_cast<const Raw*>(p); }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < VEC; ++i) raw.v[i] = T(0.0f);
  }
  __device__ __forceinline__ float operator[](int i) const { return Elem<T>::f(raw.v[i]); }
};

// One round: U pieces of every weight row loaded, then (after the PDL wait, on the first round of a kernel that has
// not waited yet) the x pieces, then the multiplies. Pieces past k_end are zeroed after their loads, so that the
// loads stay unconditional.
template <class XT, class WT, int MR, int U, bool GUARD>
__device__ __forceinline__ void stream_gemv_round(const WT* (&rows)[kGemvRows], const XT* (&xr)[MR], int64_t base,
                                                  int64_t k_end, float (&acc)[MR][kGemvRows], bool& waited) {
  constexpr int VEC = 16 / sizeof(WT);
  constexpr int64_t kStep = 32 * VEC;
  Piece<WT, VEC> wp[U][kGemvRows];
  Piece<XT, VEC> xp[U][MR];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool in = !GUARD || base + u * kStep < k_end;
    const int64_t i = in ? base + u * kStep : base;
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) wp[u][r].load(rows[r] + i);
  }
  if (!waited) {  // x is written by the kernel before: wait for it after the first weight loads
    cuda::pdl_wait();
    cuda::pdl_trigger();
    waited = true;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool in = !GUARD || base + u * kStep < k_end;
    const int64_t i = in ? base + u * kStep : base;
#pragma unroll
    for (int m = 0; m < MR; ++m) xp[u][m].load(xr[m] + i);
    if (!in) {
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) wp[u][r].zero();
#pragma unroll
      for (int m = 0; m < MR; ++m) xp[u][m].zero();
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float wv = wp[u][r][v];
#pragma unroll
        for (int m = 0; m < MR; ++m) acc[m][r] = fmaf(xp[u][m][v], wv, acc[m][r]);
      }
}

// Block: kWarps / ksplit column groups of kGemvRows columns; warp w takes group w / ksplit and the K slice
// w % ksplit. MR >= M rows of x (rows past M are computed on row 0 and never stored).
template <class XT, class WT, int MR>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(const XT* x, int64_t ldx, const WT* w, const void* bias, int bt, void* y, int yt, int M, int64_t N,
                int64_t K, int ksplit, int64_t slice, int prefetch) {
  constexpr int VEC = 16 / sizeof(WT);
  constexpr int U = MR <= 2 ? 4 : 2;  // pieces of each row in flight per lane
  constexpr int64_t kStep = 32 * VEC;
  __shared__ float part[kWarps][MR][kGemvRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = kWarps / ksplit;
  const int group = warp / ksplit, ks = warp % ksplit;
  const int64_t col0 = (int64_t(blockIdx.x) * groups + group) * kGemvRows;
  const WT* rows[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) rows[r] = w + min(col0 + r, N - 1) * K;
  const XT* xr[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) xr[m] = x + (m < M ? m : 0) * ldx;
  float acc[MR][kGemvRows];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) acc[m][r] = 0.0f;

  const int64_t k_end = min(K, (ks + 1) * slice);
  // PDL (base/cuda_pdl.cuh): the weights are constant, so this warp's slice of its rows can go to L2 while the
  // kernel before (which writes x) still runs; then wait for it.
  if (prefetch && ks * slice < k_end) {
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r)
      if (col0 + r < N) cuda::prefetch_l2(rows[r] + ks * slice, (k_end - ks * slice) * int64_t(sizeof(WT)), lane, 32);
  }
  cuda::pdl_wait();
  cuda::pdl_trigger();
  int64_t base = ks * slice + int64_t(lane) * VEC;
  bool waited = true;  // the rounds (stream_gemv_round below) run after the wait above
  for (; base + (U - 1) * kStep < k_end; base += kStep * U)  // full rounds: unguarded loads, all issued at once
    stream_gemv_round<XT, WT, MR, U, false>(rows, xr, base, k_end, acc, waited);
  if (base < k_end) stream_gemv_round<XT, WT, MR, U, true>(rows, xr, base, k_end, acc, waited);
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) acc[m][r] = warp_sum(acc[m][r]);
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) part[warp][m][r] = acc[m][r];
  }
  __syncthreads();
  // One thread per (group, row, column): the K slices summed in order.
  for (int j = threadIdx.x; j < groups * MR * kGemvRows; j += kThreads) {
    const int g = j / (MR * kGemvRows), m = (j / kGemvRows) % MR, r = j % kGemvRows;
    const int64_t c = (int64_t(blockIdx.x) * groups + g) * kGemvRows + r;
    if (m >= M || c >= N) continue;
    float s = 0.0f;
    for (int q = 0; q < ksplit; ++q) s += part[g * ksplit + q][m][r];
    if (bias) s += ld(bias, bt, c);
    st(y, yt, m * N + c, s);
  }
}

// ---- the streaming form: one wave of blocks, each warp a balanced span of the weights ----
//
// The weight matrix is a sequence of steps: column group g (kGemvRows rows) times the K steps of kStep elements
// (one 16-byte piece per lane and row). The grid is one wave (about as many blocks as fit at once); block b takes
// the column groups [b * G / grid, (b + 1) * G / grid) and its warps split the block's steps into eight equal
// spans, so every multiprocessor reads the same share of the weights whatever N and K are. A warp's span meets
// one or a few column groups: per group it streams its K range in rounds of U pieces per row (all of a round's
// loads before its first multiply), reduces over the lanes and leaves the partial sums in shared memory; then one
// thread per (row, column) adds the partials of the warps that met its group, in warp order (deterministic).
// With PDL the first round's weight loads are issued before the wait (the weights are constants), so they are in
// flight while the kernel before still runs.
struct StreamSpan {
  int lo, hi;  // the warp's steps, relative to the block's first
};
__device__ __forceinline__ StreamSpan stream_span(int steps, int warp) {
  return {int(int64_t(steps) * warp / kWarps), int(int64_t(steps) * (warp + 1) / kWarps)};
}

// part (dynamic shared memory): [kWarps][jmax][MR][kGemvRows], jmax >= the column groups any warp's span meets.
template <class XT, class WT, int MR, int UB>
__global__ void __launch_bounds__(kThreads)
    gemv_stream_kernel(const XT* x, int64_t ldx, const WT* w, const void* bias, int bt, void* y, int yt, int M,
                       int64_t N, int64_t K, int groups, int ksteps, int jmax) {
  constexpr int VEC = 16 / sizeof(WT);
  constexpr int U = MR <= 2 ? UB : MR == 4 ? (UB + 1) / 2 : (UB + 3) / 4;  // pieces of each row in flight per lane
  constexpr int64_t kStep = 32 * VEC;
  extern __shared__ float stream_part[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g0 = int(int64_t(groups) * blockIdx.x / gridDim.x), g1 = int(int64_t(groups) * (blockIdx.x + 1) / gridDim.x);
  const int steps = (g1 - g0) * ksteps;
  const StreamSpan sp = stream_span(steps, warp);
  const XT* xr[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) xr[m] = x + (m < M ? m : 0) * ldx;
  bool waited = false;
#pragma unroll 1
  for (int t = sp.lo; t < sp.hi;) {
    const int gl = t / ksteps;                        // the block's column group
    const int t_end = min(sp.hi, (gl + 1) * ksteps);  // this warp's last step in it (exclusive)
    const int64_t col0 = int64_t(g0 + gl) * kGemvRows;
    const WT* rows[kGemvRows];
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) rows[r] = w + min(col0 + r, N - 1) * K;
    float acc[MR][kGemvRows];
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) acc[m][r] = 0.0f;
    const int64_t k_end = min(K, int64_t(t_end - gl * ksteps) * kStep);
    int64_t base = int64_t(t - gl * ksteps) * kStep + int64_t(lane) * VEC;
#pragma unroll 1
    for (; base + (U - 1) * kStep < k_end; base += kStep * U)
      stream_gemv_round<XT, WT, MR, U, false>(rows, xr, base, k_end, acc, waited);
    if (base < k_end) stream_gemv_round<XT, WT, MR, U, true>(rows, xr, base, k_end, acc, waited);
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) acc[m][r] = warp_sum(acc[m][r]);
    if (lane == 0) {
      const int j = gl - sp.lo / ksteps;
      float* p = stream_part + (warp * jmax + j) * MR * kGemvRows;
#pragma unroll
      for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int r = 0; r < kGemvRows; ++r) p[m * kGemvRows + r] = acc[m][r];
    }
    t = t_end;
  }
  if (!waited) {
    cuda::pdl_wait();
    cuda::pdl_trigger();
  }
  __syncthreads();
  // One thread per (column group, row, column): the partials of the warps whose spans met the group, in warp order.
  const int items = (g1 - g0) * MR * kGemvRows;
  for (int i = threadIdx.x; i < items; i += kThreads) {
    const int gl = i / (MR * kGemvRows);
    const int m = i / kGemvRows % MR, r = i % kGemvRows;
    const int64_t c = int64_t(g0 + gl) * kGemvRows + r;
    if (m >= M || c >= N) continue;
    float s = 0.0f;
    for (int q = 0; q < kWarps; ++q) {
      const StreamSpan o = stream_span(steps, q);
      if (o.lo >= o.hi || gl < o.lo / ksteps || gl > (o.hi - 1) / ksteps) continue;
      s += stream_part[((q * jmax + gl - o.lo / ksteps) * MR + m) * kGemvRows + r];
    }
    if (bias) s += ld(bias, bt, c);
    st(y, yt, m * N + c, s);
  }
}

EnvSwitch g_gemv_stream{"MOEKIT_GEMV_STREAM", true};

// The streaming form's launch: grid = the blocks that fit at once (MOEKIT_GEMV_BLOCKS_PER_SM in the environment,
// read once, caps the blocks per multiprocessor; 0 or unset: the occupancy, three blocks of about 80 registers),
// fewer when the weights would give a warp less than a step; more (several waves) only when the partial sums would
// not fit in shared memory. On the H200 the decode step ran 309 us with the occupancy, 312 with 2 and 315 with 1.
template <class XT, class WT, int MR, int UB>
cudaError_t launch_stream_mr(bool pdl, const XT* x, int64_t ldx, const WT* w, const void* bias, int bt, void* y, int yt,
                             int M, int64_t N, int64_t K, int sms, cudaStream_t s) {
  constexpr int VEC = 16 / sizeof(WT);
  constexpr int64_t kStep = 32 * VEC;
  static const int occupancy = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, gemv_stream_kernel<XT, WT, MR, UB>, kThreads, 4096) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      b = 0;
    }
    return b > 0 ? b : 1;
  }();
  static const int cap = int(std::min<int64_t>(64, env_int("MOEKIT_GEMV_BLOCKS_PER_SM", 0)));
  const int per_sm = cap > 0 ? std::min(cap, occupancy) : occupancy;
  const int64_t ksteps = (K + kStep - 1) / kStep, groups = (N + kGemvRows - 1) / kGemvRows;
  int64_t grid = std::min<int64_t>(int64_t(std::max(sms, 1)) * per_sm, (groups * ksteps + kWarps - 1) / kWarps);
  grid = std::max<int64_t>(1, std::min(grid, groups));
  int64_t jmax = 0;
  size_t smem = 0;
  for (;;) {
    const int64_t gmax = (groups + grid - 1) / grid, span = (gmax * ksteps + kWarps - 1) / kWarps;
    jmax = std::min(gmax, (span + ksteps - 1) / ksteps + 1);
    smem = size_t(kWarps) * size_t(jmax) * MR * kGemvRows * sizeof(float);
    if (smem <= 48 * 1024 || grid == groups) break;
    grid = std::min(groups, grid * 2);
  }
  if (smem > 48 * 1024 || groups * ksteps > 0x7fffffff) return cudaErrorInvalidValue;
  return cuda::launch_pdl(pdl, gemv_stream_kernel<XT, WT, MR, UB>, dim3(unsigned(grid)), dim3(kThreads), smem, s, x, ldx, w,
                          bias, bt, y, yt, M, N, K, int(groups), int(ksteps), int(jmax));
}

template <class XT, class WT>
cudaError_t launch_stream(const void* x, int64_t ldx, const void* w, const void* bias, int bt, void* y, int yt, int M,
                          int64_t N, int64_t K, int sms, cudaStream_t s) {
  const XT* xp = static_cast<const XT*>(x);
  const WT* wp = static_cast<const WT*>(w);
  const bool pdl = cuda::pdl_enabled();
  // Pieces per row and lane in flight: 2 (about 80 registers for one row of x: three blocks per multiprocessor) or
  // 4 (MOEKIT_GEMV_UNROLL=4 in the environment, read once: about 155 registers, one block; the decode step 2.5 us
  // slower on the H200), halved for 4 rows of x and quartered for 8.
  static const int unroll = env_int("MOEKIT_GEMV_UNROLL", 2) == 4 ? 4 : 2;
#define MOEKIT_GEMV_STREAM_CASE(MR)                                                                       \
  return unroll == 2 ? launch_stream_mr<XT, WT, MR, 2>(pdl, xp, ldx, wp, bias, bt, y, yt, M, N, K, sms, s) \
                     : launch_stream_mr<XT, WT, MR, 4>(pdl, xp, ldx, wp, bias, bt, y, yt, M, N, K, sms, s);
  switch (M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : 8) {
    case 1: MOEKIT_GEMV_STREAM_CASE(1)
    case 2: MOEKIT_GEMV_STREAM_CASE(2)
    case 4: MOEKIT_GEMV_STREAM_CASE(4)
    default: MOEKIT_GEMV_STREAM_CASE(8)
  }
#undef MOEKIT_GEMV_STREAM_CASE
}

template <class XT, class WT>
cudaError_t launch(const void* x, int64_t ldx, const void* w, const void* bias, int bt, void* y, int yt, int M,
                   int64_t N, int64_t K, int sms, cudaStream_t s) {
  constexpr int VEC = 16 / sizeof(WT);
  // The fewest K slices per column group that still give every multiprocessor about four blocks.
  int ksplit = 1;
  while (ksplit < kWarps && (N + int64_t(kWarps / ksplit) * kGemvRows - 1) / (int64_t(kWarps / ksplit) * kGemvRows) <
                                int64_t(4) * sms)
    ksplit *= 2;
  const int64_t step = 32 * VEC;
  const int64_t slice = ((K + ksplit - 1) / ksplit + step - 1) / step * step;
  const int64_t cols_per_block = int64_t(kWarps / ksplit) * kGemvRows;
  const int64_t blocks = (N + cols_per_block - 1) / cols_per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const XT* xp = static_cast<const XT*>(x);
  const WT* wp = static_cast<const WT*>(w);
  // With PDL, the weights go to L2 before the wait when they fit the prefetch budget (lm_head does not).
  const bool pdl = cuda::pdl_enabled();
  const int prefetch = cuda::pdl_prefetch(N * K * int64_t(sizeof(WT))) ? 1 : 0;
#define MOEKIT_GEMV_CASE(MR)                                                                                     \
  return cuda::launch_pdl(pdl, gemv_kernel<XT, WT, MR>, dim3(unsigned(blocks)), dim3(kThreads), 0, s, xp, ldx, wp, \
                          bias, bt, y, yt, M, N, K, ksplit, slice, prefetch);
  switch (M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : 8) {
    case 1: MOEKIT_GEMV_CASE(1)
    case 2: MOEKIT_GEMV_CASE(2)
    case 4: MOEKIT_GEMV_CASE(4)
    default: MOEKIT_GEMV_CASE(8)
  }
#undef MOEKIT_GEMV_CASE
}

}  // namespace

bool gemv_ok(const void* x, int xt, int64_t ldx, const void* w, int wt, int M, int64_t K) {
  if (M < 1 || M > kGemvMaxM || K < 1) return false;
  if (!((xt == wt && xt != kF32) || (xt != kF32 && wt == kF32))) return false;  // 16-bit x, w of x's type or f32
  const int64_t vec = wt == kF32 ? 4 : 8;  // elements per 16-byte weight piece; x pieces have as many
  const int64_t x_align = vec * (xt == kF32 ? 4 : 2);
  return K % vec == 0 && ldx % vec == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % x_align == 0;
}

cudaError_t gemv(const void* x, int xt, int64_t ldx, const void* w, int wt, const void* bias, int bt, void* y, int yt,
                 int M, int64_t N, int64_t K, int sms, cudaStream_t s) {
  if (M == 0 || N == 0) return cudaSuccess;
  if (!gemv_ok(x, xt, ldx, w, wt, M, K)) return cudaErrorInvalidValue;
  const int64_t piece = wt == kF32 ? 4 : 8;  // the streaming form counts its steps in int
  if (gemv_stream() && ((N + kGemvRows - 1) / kGemvRows) * ((K + 32 * piece - 1) / (32 * piece)) <= 0x7fffffff) {
    if (xt == kBF16 && wt == kBF16) return launch_stream<bf16, bf16>(x, ldx, w, bias, bt, y, yt, M, N, K, sms, s);
    if (xt == kF16 && wt == kF16) return launch_stream<f16, f16>(x, ldx, w, bias, bt, y, yt, M, N, K, sms, s);
    if (xt == kBF16) return launch_stream<bf16, float>(x, ldx, w, bias, bt, y, yt, M, N, K, sms, s);
    return launch_stream<f16, float>(x, ldx, w, bias, bt, y, yt, M, N, K, sms, s);
  }
  if (xt == kBF16 && wt == kBF16) return launch<bf16, bf16>(x, ldx, w, bias, bt, y, yt, M, N, K, sms, s);
  if (xt == kF16 && wt == kF16) return launch<f16, f16>(x, ldx, w, bias, bt, y, yt, M, N, K, sms, s);
  if (xt == kBF16) return launch<bf16, float>(x, ldx, w, bias, bt, y, yt, M, N, K, sms, s);
  return launch<f16, float>(x, ldx, w, bias, bt, y, yt, M, N, K, sms, s);
}

bool gemv_stream() { return g_gemv_stream.on(); }
bool set_gemv_stream(bool on) { return g_gemv_stream.set(on); }

}  // namespace moekit::model::kernels

// The CUDA side of ep_ops.h: id remapping, byte-row gathers and the fixed-order combine.
#include <climits>
#include <cstdint>
#include <type_traits>

#include "base/cuda_check.h"
#include "base/cuda_elem.cuh"
#include "parallel/ep_ops.h"

namespace moekit::ep::cuda {
namespace {

template <class I>
__global__ void remap_kernel(const I* ids, int64_t n, int64_t start, int64_t end, int64_t E, int32_t sentinel,
                             int32_t* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t e = int64_t(ids[i]);
  // Bad ids stay bad in the local numbering (the local experts' device check reports them).
  out[i] = e < 0 ? -1 : e > E ? sentinel + 1 : (e >= start && e < end) ? int32_t(e - start) : sentinel;
}

// One block per row; 16-byte words when every pitch and the width allow, else bytes.
__global__ void gather_kernel(const char* src, int64_t src_pitch, const int32_t* rows, int64_t row_bytes, char* dst,
                              int64_t dst_pitch, bool vec16) {
  const int64_t i = blockIdx.x;
  const char* s = src + int64_t(rows[i]) * src_pitch;
  char* d = dst + i * dst_pitch;
  if (vec16) {
    const int64_t nv = row_bytes / 16;
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x)
      reinterpret_cast<uint4*>(d)[j] = reinterpret_cast<const uint4*>(s)[j];
  } else {
    for (int64_t j = threadIdx.x; j < row_bytes; j += blockDim.x) d[j] = s[j];
  }
}

template <class T>
__global__ void combine_kernel(const T* rows, int64_t H, const int32_t* map, int64_t T_, int N, T* out) {
  const int64_t h = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= H) return;
  for (int64_t t = blockIdx.y; t < T_; t += gridDim.y) {
    float acc = 0.0f;
    for (int r = 0; r < N; ++r) {
      const int32_t p = map[t * N + r];
      if (p >= 0) acc += moekit::cuda::to_f32<T>(rows[int64_t(p) * H + h]);
    }
    out[t * H + h] = moekit::cuda::from_f32<T>(acc);
  }
}

// One block: tokens in tiles of its threads; per rank, a block-wide exclusive scan of "token t goes to r".
constexpr int kPlanThreads = 1024;
template <class I>
__global__ void plan_count_kernel(const I* ids, int64_t T, int64_t K, int64_t E, PlanRanks ranks, int32_t* pos,
                                  int32_t* counts) {
  __shared__ int32_t base[kMaxPlanRanks];
  __shared__ int32_t warp_sum[kPlanThreads / 32];
  __shared__ int bad;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, N = ranks.n;
  if (tid < N) base[tid] = 0;
  if (tid == 0) bad = INT32_MAX;
  __syncthreads();
  for (int64_t tile = 0; tile < T; tile += kPlanThreads) {
    const int64_t t = tile + tid;
    uint32_t mask = 0;
    if (t < T)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = int64_t(ids[t * K + k]);
        if (e < 0 || e > E) {
          atomicMin(&bad, int(t * K + k));
        } else if (e < E) {
          for (int r = 0; r < N; ++r)
            if (e >= ranks.start[r] && e < ranks.end[r]) mask |= 1u << r;
        }
      }
    for (int r = 0; r < N; ++r) {
      const int v = (mask >> r) & 1;
      int x = v;  // inclusive scan within the warp
      for (int o = 1; o < 32; o *= 2) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
      }
      if (lane == 31) warp_sum[warp] = x;
      __syncthreads();
      if (warp == 0) {
        int s = lane < kPlanThreads / 32 ? warp_sum[lane] : 0;
        for (int o = 1; o < 32; o *= 2) {
          const int y = __shfl_up_sync(0xffffffffu, s, o);
          if (lane >= o) s += y;
        }
        if (lane < kPlanThreads / 32) warp_sum[lane] = s;  // inclusive over warps
      }
      __syncthreads();
      const int before = (warp ? warp_sum[warp - 1] : 0) + x - v;
      if (t < T) pos[t * N + r] = v ? base[r] + before : -1;
      __syncthreads();
      if (tid == 0) base[r] += warp_sum[kPlanThreads / 32 - 1];
      __syncthreads();
    }
  }
  if (tid < N) counts[tid] = base[tid];
  if (tid == 0) counts[N] = bad;
}

template <class I, class W>
__global__ void plan_fill_kernel(const I* ids, const W* w, int64_t T, int64_t K, PlanRanks ranks, const int32_t* pos,
                                 int32_t* rows, int32_t* map, int32_t* meta) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int N = ranks.n;
  for (int r = 0; r < N; ++r) {
    const int32_t q = pos[t * N + r];
    if (q < 0) {
      map[t * N + r] = -1;
      continue;
    }
    const int64_t p = ranks.offset[r] + q;
    rows[p] = int32_t(t);
    map[t * N + r] = int32_t(p);
    int32_t* m = meta + p * 2 * K;
    const int64_t s = ranks.start[r], e_end = ranks.end[r];
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = int64_t(ids[t * K + k]);
      m[k] = e >= s && e < e_end ? int32_t(e - s) : int32_t(e_end - s);
      m[K + k] = __float_as_int(moekit::cuda::to_f32<W>(w[t * K + k]));
    }
  }
}

void check_launch() { MOEKIT_CUDA_CALL(cudaGetLastError()); }

}  // namespace

void remap_ids(const void* ids, bool i64, int64_t n, int64_t start, int64_t end, int64_t E, int32_t sentinel,
               int32_t* out, void* stream) {
  const unsigned blocks = unsigned((n + 255) / 256);
  auto s = static_cast<cudaStream_t>(stream);
  if (i64)
    remap_kernel<<<blocks, 256, 0, s>>>(static_cast<const int64_t*>(ids), n, start, end, E, sentinel, out);
  else
    remap_kernel<<<blocks, 256, 0, s>>>(static_cast<const int32_t*>(ids), n, start, end, E, sentinel, out);
  check_launch();
}

void gather_rows(const void* src, int64_t src_pitch, const int32_t* rows, int64_t n, int64_t row_bytes, void* dst,
                 int64_t dst_pitch, void* stream) {
  const bool vec16 = row_bytes % 16 == 0 && src_pitch % 16 == 0 && dst_pitch % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  gather_kernel<<<unsigned(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const char*>(src), src_pitch, rows, row_bytes, static_cast<char*>(dst), dst_pitch, vec16);
  check_launch();
}

void combine_rows(const void* rows, int dtype_code, int64_t H, const int32_t* map, int64_t T, int N, void* out,
                  void* stream) {
  const dim3 grid(unsigned((H + 255) / 256), unsigned(T < 65535 ? T : 65535));
  auto s = static_cast<cudaStream_t>(stream);
  using moekit::cuda::bf16;
  using moekit::cuda::f16;
  if (dtype_code == 0)
    combine_kernel<<<grid, 256, 0, s>>>(static_cast<const float*>(rows), H, map, T, N, static_cast<float*>(out));
  else if (dtype_code == 1)
    combine_kernel<<<grid, 256, 0, s>>>(static_cast<const bf16*>(rows), H, map, T, N, static_cast<bf16*>(out));
  else
    combine_kernel<<<grid, 256, 0, s>>>(static_cast<const f16*>(rows), H, map, T, N, static_cast<f16*>(out));
  check_launch();
}

void plan_count(const void* ids, bool i64, int64_t T, int64_t K, int64_t E, const PlanRanks& ranks, int32_t* pos,
                int32_t* counts, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (i64)
    plan_count_kernel<<<1, kPlanThreads, 0, s>>>(static_cast<const int64_t*>(ids), T, K, E, ranks, pos, counts);
  else
    plan_count_kernel<<<1, kPlanThreads, 0, s>>>(static_cast<const int32_t*>(ids), T, K, E, ranks, pos, counts);
  check_launch();
}

void plan_fill(const void* ids, bool i64, const void* weights, int w_code, int64_t T, int64_t K,
               const PlanRanks& ranks, const int32_t* pos, int32_t* rows, int32_t* map, int32_t* meta, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const unsigned blocks = unsigned((T + 255) / 256);
  using moekit::cuda::bf16;
  using moekit::cuda::f16;
  auto launch = [&](auto id_ptr) {
    using I = std::remove_const_t<std::remove_pointer_t<decltype(id_ptr)>>;
    if (w_code == 0)
      plan_fill_kernel<I, float><<<blocks, 256, 0, s>>>(id_ptr, static_cast<const float*>(weights), T, K, ranks, pos,
                                                        rows, map, meta);
    else if (w_code == 1)
      plan_fill_kernel<I, bf16><<<blocks, 256, 0, s>>>(id_ptr, static_cast<const bf16*>(weights), T, K, ranks, pos,
                                                       rows, map, meta);
    else
      plan_fill_kernel<I, f16><<<blocks, 256, 0, s>>>(id_ptr, static_cast<const f16*>(weights), T, K, ranks, pos, rows,
                                                      map, meta);
  };
  if (i64)
    launch(static_cast<const int64_t*>(ids));
  else
    launch(static_cast<const int32_t*>(ids));
  check_launch();
}

}  // namespace moekit::ep::cuda

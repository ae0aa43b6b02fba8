// Device-side routing: validate expert ids, count pairs per expert, offsets, and the stable
// permutation of the (token, slot) pairs sorted by expert. No host synchronisation.
//
// route_sort is a counting sort in three launches over blocks of kRouteThreads pairs:
//   1. histogram: per block, the count of each expert and each pair's rank among the block's pairs of
//      its expert (warp match + per-warp counts in shared memory: no atomics, so the ranks are stable);
//   2. scan (one block): expert offsets, tile offsets and each block's first row among its expert's;
//   3. place: row = offset + base + rank; sorted_pair[row] = pair.
// Up to 4096 pairs and kOneBlockExperts experts (prefill of a few hundred tokens) the same sort
// runs in one launch of one block: chunks of 1024 pairs ranked in order against running per-expert
// counts in shared memory, then the scan and the placement, with the same results bit for bit.
#include <cstdlib>

#include "backends/cuda/kernels/device_math.cuh"
#include "base/cuda_pdl.cuh"
#include "base/cuda_route.cuh"
#include "base/env.h"

namespace moekit::cuda::kernels {
namespace {

constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kScanThreads = 1024;
static_assert(kRouteMaxExperts <= kScanThreads, "route_scan handles one expert per thread");

template <class IdxT>
__device__ __forceinline__ int load_expert(const IdxT* index, int64_t p, int top_k, int experts,
                                           unsigned long long* error) {
  const long long v = static_cast<long long>(index[p]);
  if (v >= 0 && v <= experts) return static_cast<int>(v);  // v == experts: sentinel, dropped
  record_bad_id(error, p, top_k, v);
  return experts;
}

template <class IdxT>
__global__ void route_validate_kernel(const IdxT* index, int64_t pairs, int top_k, int experts,
                                      int32_t* pair_expert, unsigned long long* error) {
  const int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (p < pairs) pair_expert[p] = load_expert(index, p, top_k, experts, error);
}

template <class IdxT>
__global__ void __launch_bounds__(kRouteThreads)
    route_histogram_kernel(const IdxT* index, int64_t pairs, int top_k, int experts, int32_t* pair_expert,
                           int32_t* pair_row, int32_t* block_hist, unsigned long long* error) {
  extern __shared__ int32_t warp_count[];  // [kRouteWarps, experts]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < kRouteWarps * experts; i += kRouteThreads) warp_count[i] = 0;
  __syncthreads();
  const int64_t p = blockIdx.x * int64_t(kRouteThreads) + threadIdx.x;
  int e = experts;  // past the end or dropped
  if (p < pairs) {
    e = load_expert(index, p, top_k, experts, error);
    pair_expert[p] = e;
  }
  const unsigned same = __match_any_sync(0xffffffffu, e);
  const int rank_in_warp = __popc(same & ((1u << lane) - 1u));
  if (e < experts && rank_in_warp == 0) warp_count[warp * experts + e] = __popc(same);
  __syncthreads();
  if (p < pairs) {
    int rank = -1;
    if (e < experts) {
      rank = rank_in_warp;
      for (int w = 0; w < warp; ++w) rank += warp_count[w * experts + e];
    }
    pair_row[p] = rank;  // rank within the block; route_place adds the block's base
  }
  for (int x = threadIdx.x; x < experts; x += kRouteThreads) {
    int s = 0;
    for (int w = 0; w < kRouteWarps; ++w) s += warp_count[w * experts + x];
    block_hist[blockIdx.x * int64_t(experts) + x] = s;
  }
}

__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// Exclusive block-wide scan of v over kScanThreads threads; returns the exclusive prefix.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int incl = warp_inclusive_scan(v);
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) warp_sums[lane] = warp_inclusive_scan(warp_sums[lane]);
  __syncthreads();
  const int r = incl - v + (warp > 0 ? warp_sums[warp - 1] : 0);
  __syncthreads();  // warp_sums is reused by the next scan
  return r;
}

__global__ void __launch_bounds__(kScanThreads)
    route_scan_kernel(int32_t* block_hist, int nblocks, int experts, int tile_m, int32_t* offsets,
                      int32_t* tile_offsets) {
  __shared__ int warp_sums[32];
  const int e = threadIdx.x;
  // One pass over the blocks' counts: each becomes the block's first row among the expert's (relative;
  // route_place adds the expert's offset), eight loads in flight before the stores.
  int total = 0;
  if (e < experts) {
    for (int b0 = 0; b0 < nblocks; b0 += 8) {
      int c[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) c[j] = b0 + j < nblocks ? block_hist[(b0 + j) * int64_t(experts) + e] : 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (b0 + j < nblocks) block_hist[(b0 + j) * int64_t(experts) + e] = total;
        total += c[j];
      }
    }
  }
  const int tiles = (total + tile_m - 1) / tile_m;
  const int row0 = block_exclusive_scan(total, warp_sums);
  const int tile0 = block_exclusive_scan(tiles, warp_sums);
  if (e < experts) {
    offsets[e] = row0;
    tile_offsets[e] = tile0;
  }
  if (e == experts - 1) {
    offsets[experts] = row0 + total;
    tile_offsets[experts] = tile0 + tiles;
  }
}

__global__ void route_place_kernel(int64_t pairs, int experts, const int32_t* pair_expert, int32_t* pair_row,
                                   const int32_t* block_base, const int32_t* offsets, int32_t* sorted_pair) {
  const int64_t p = blockIdx.x * int64_t(kRouteThreads) + threadIdx.x;
  if (p >= pairs) return;
  const int e = pair_expert[p];
  if (e >= experts) return;
  const int row = offsets[e] + block_base[blockIdx.x * int64_t(experts) + e] + pair_row[p];
  pair_row[p] = row;
  sorted_pair[row] = int32_t(p);
}

constexpr int kOneBlockThreads = 1024, kOneBlockWarps = kOneBlockThreads / 32;
constexpr int64_t kOneBlockPairs = 16384;  // the most the kernel takes
// Where it runs: up to 4096 pairs (MOEKIT_ROUTE_ONE_BLOCK=N sets another limit up to kOneBlockPairs, 0 none:
// a measurement knob). On the H200 the one block took ~50 us more than the three launches at 16384 pairs
// (16 chunks one after the other).
int64_t one_block_pairs() {
  static const int64_t limit = [] {
    const int64_t n = env_int("MOEKIT_ROUTE_ONE_BLOCK", 4096);
    return n < 0 ? int64_t(0) : (n > kOneBlockPairs ? kOneBlockPairs : int64_t(n));
  }();
  return limit;
}
constexpr int kOneBlockExperts = 256;

template <class IdxT>
__global__ void __launch_bounds__(kOneBlockThreads)
    route_sort_one_block_kernel(const IdxT* index, int64_t pairs, int top_k, int experts, int tile_m,
                                int32_t* pair_expert, int32_t* pair_row, int32_t* sorted_pair, int32_t* offsets,
                                int32_t* tile_offsets, unsigned long long* error) {
  __shared__ int32_t warp_count[kOneBlockWarps * kOneBlockExperts];
  __shared__ int32_t running[kOneBlockExperts];  // pairs of each expert in the chunks so far, then its first row
  __shared__ int warp_sums[32];
  pdl_wait();  // launched with PDL at decode sizes: the ids are written by the kernel before
  pdl_trigger();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < kOneBlockWarps * experts; i += kOneBlockThreads) warp_count[i] = 0;
  for (int i = threadIdx.x; i < experts; i += kOneBlockThreads) running[i] = 0;
  __syncthreads();
  for (int64_t p0 = 0; p0 < pairs; p0 += kOneBlockThreads) {
    const int64_t p = p0 + threadIdx.x;
    int e = experts;  // past the end or dropped
    if (p < pairs) {
      e = load_expert(index, p, top_k, experts, error);
      pair_expert[p] = e;
    }
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int rank_in_warp = __popc(same & ((1u << lane) - 1u));
    if (e < experts && rank_in_warp == 0) warp_count[warp * experts + e] = __popc(same);
    __syncthreads();
    if (p < pairs) {
      int rank = -1;
      if (e < experts) {
        rank = running[e] + rank_in_warp;
        for (int w = 0; w < warp; ++w) rank += warp_count[w * experts + e];
      }
      pair_row[p] = rank;  // rank within the expert; the placement below adds its first row
    }
    __syncthreads();
    for (int x = threadIdx.x; x < experts; x += kOneBlockThreads) {
      int c = 0;
      for (int w = 0; w < kOneBlockWarps; ++w) {
        c += warp_count[w * experts + x];
        warp_count[w * experts + x] = 0;
      }
      running[x] += c;
    }
    __syncthreads();
  }
  const int e = threadIdx.x;
  const int total = e < experts ? running[e] : 0;
  const int tiles = (total + tile_m - 1) / tile_m;
  const int row0 = block_exclusive_scan(total, warp_sums);
  const int tile0 = block_exclusive_scan(tiles, warp_sums);
  if (e < experts) {
    offsets[e] = row0;
    tile_offsets[e] = tile0;
    running[e] = row0;
  }
  if (e == experts - 1) {
    offsets[experts] = row0 + total;
    tile_offsets[experts] = tile0 + tiles;
  }
  __syncthreads();
  for (int64_t p = threadIdx.x; p < pairs; p += kOneBlockThreads) {  // the pairs this thread ranked
    const int pe = pair_expert[p];
    if (pe >= experts) continue;
    const int row = running[pe] + pair_row[p];
    pair_row[p] = row;
    sorted_pair[row] = int32_t(p);
  }
}

template <class IdxT>
cudaError_t route_sort_typed(const IdxT* index, int64_t tokens, int top_k, int experts, int tile_m,
                             const RoutingBuffers& b, cudaStream_t stream) {
  const int64_t pairs = tokens * top_k;
  if (pairs <= one_block_pairs() && experts <= kOneBlockExperts) {
    return launch_pdl(pdl_enabled(), route_sort_one_block_kernel<IdxT>, dim3(1), dim3(kOneBlockThreads), 0, stream,
                      index, pairs, top_k, experts, tile_m, b.pair_expert, b.pair_row, b.sorted_pair, b.offsets,
                      b.tile_offsets, b.error);
  }
  const int64_t nblocks = route_blocks(pairs);
  const size_t smem = size_t(kRouteWarps) * experts * sizeof(int32_t);
  route_histogram_kernel<IdxT><<<unsigned(nblocks), kRouteThreads, smem, stream>>>(
      index, pairs, top_k, experts, b.pair_expert, b.pair_row, b.block_hist, b.error);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  route_scan_kernel<<<1, kScanThreads, 0, stream>>>(b.block_hist, int(nblocks), experts, tile_m, b.offsets,
                                                    b.tile_offsets);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  route_place_kernel<<<unsigned(nblocks), kRouteThreads, 0, stream>>>(pairs, experts, b.pair_expert, b.pair_row,
                                                                      b.block_hist, b.offsets, b.sorted_pair);
  return cudaGetLastError();
}

// ExpertsCall::routing for the paths that do not route inside their kernels: one warp per token, the model
// router's code (base/cuda_route.cuh).
template <int PER>
__global__ void route_logits_kernel(const float* logits, int64_t T, int E, int K, int kind, int norm, int32_t* index,
                                     float* weights) {
  pdl_wait();
  pdl_trigger();
  const int64_t token = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (token >= T) return;
  int e;
  float w;
  route_warp<PER>(logits + token * E, nullptr, E, K, kind, norm, 1.0f, 1, 1, K, e, w);
  const int lane = threadIdx.x % 32;
  if (lane < K) {
    index[token * K + lane] = e;
    weights[token * K + lane] = w;
  }
}

}  // namespace

cudaError_t route_logits(const float* logits, int64_t tokens, int experts, int top_k, int kind, bool norm,
                         int32_t* index, float* weights, cudaStream_t stream) {
  if (experts < 1 || experts > 32 * kRouteLogitsMaxPerLane || top_k < 1 || top_k > 32 || top_k > experts ||
      (kind != kRouteSoftmaxTopk && kind != kRouteTopkSoftmax))
    return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  constexpr int kWarps = 4;
  const dim3 grid(unsigned((tokens + kWarps - 1) / kWarps)), block(32 * kWarps);
  auto go = [&](auto kernel) {
    return launch_pdl(pdl_enabled(), kernel, grid, block, 0, stream, logits, tokens, experts, top_k, kind,
                      norm ? 1 : 0, index, weights);
  };
  if (experts <= 32) return go(route_logits_kernel<1>);
  if (experts <= 64) return go(route_logits_kernel<2>);
  if (experts <= 128) return go(route_logits_kernel<4>);
  if (experts <= 256) return go(route_logits_kernel<8>);
  return go(route_logits_kernel<kRouteLogitsMaxPerLane>);
}

cudaError_t route_validate(const void* index, Index index_type, int64_t tokens, int top_k, int experts,
                           int32_t* pair_expert, unsigned long long* error, cudaStream_t stream) {
  const int64_t pairs = tokens * top_k;
  if (pairs == 0) return cudaSuccess;
  const unsigned grid = unsigned((pairs + 255) / 256);
  if (index_type == Index::i32)
    route_validate_kernel<<<grid, 256, 0, stream>>>(static_cast<const int32_t*>(index), pairs, top_k, experts,
                                                    pair_expert, error);
  else
    route_validate_kernel<<<grid, 256, 0, stream>>>(static_cast<const int64_t*>(index), pairs, top_k, experts,
                                                    pair_expert, error);
  return cudaGetLastError();
}

cudaError_t route_sort(const void* index, Index index_type, int64_t tokens, int top_k, int experts, int tile_m,
                       const RoutingBuffers& b, cudaStream_t stream) {
  if (experts < 1 || experts > kRouteMaxExperts || tile_m < 1) return cudaErrorInvalidValue;
  if (tokens * top_k == 0) return cudaSuccess;
  if (index_type == Index::i32)
    return route_sort_typed(static_cast<const int32_t*>(index), tokens, top_k, experts, tile_m, b, stream);
  return route_sort_typed(static_cast<const int64_t*>(index), tokens, top_k, experts, tile_m, b, stream);
}

}  // namespace moekit::cuda::kernels

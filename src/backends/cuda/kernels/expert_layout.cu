// DeepGEMM's "contiguous" layout of the routed rows: each expert's rows start at a multiple of the row
// tile (its first row is tile_offsets[e] * tile_m), so every row tile of the grouped GEMM is whole and
// belongs to one expert. Built on the device from route_sort's buffers: no host synchronisation.
#include "backends/cuda/kernels/device_math.cuh"

namespace moekit::cuda::kernels {
namespace {

__global__ void padded_bases_kernel(const int32_t* tile_offsets, int experts, int tile_m, int32_t* row_base) {
  for (int e = threadIdx.x; e <= experts; e += blockDim.x) row_base[e] = tile_offsets[e] * tile_m;
}

template <class T>
__global__ void scatter_rows_kernel(const T* x, int64_t hidden, int top_k, const int32_t* sorted_pair,
                                    const int32_t* pair_expert, const int32_t* offsets, const int32_t* row_base,
                                    int experts, T* xl, int32_t* pair_row_l, bool vec16) {
  const int64_t r = blockIdx.x;
  if (r >= offsets[experts]) return;
  const int32_t p = sorted_pair[r];
  const int e = pair_expert[p];
  const int64_t dst = row_base[e] + (r - offsets[e]);
  if (threadIdx.x == 0) pair_row_l[p] = int32_t(dst);
  const T* src = x + int64_t(p / top_k) * hidden;
  T* out = xl + dst * hidden;
  if (vec16) {
    constexpr int kVec = 16 / sizeof(T);
    for (int64_t i = threadIdx.x; i < hidden / kVec; i += blockDim.x)
      reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = src[i];
  }
}

}  // namespace

cudaError_t contiguous_layout(Elem type, const void* x, int64_t hidden, int top_k, const RoutingBuffers& r, int experts,
                              int64_t pairs, int tile_m, int32_t* row_base, void* xl, int32_t* pair_row_l,
                              cudaStream_t stream) {
  if (experts < 1 || tile_m < 1) return cudaErrorInvalidValue;
  padded_bases_kernel<<<1, 256, 0, stream>>>(r.tile_offsets, experts, tile_m, row_base);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || pairs == 0) return err;
  const bool vec16 = (hidden * elem_bytes(type)) % 16 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0 &&
                     (reinterpret_cast<uintptr_t>(xl) & 15) == 0;
  return with_elem(type, [&](auto tag) {
    using T = decltype(tag);
    scatter_rows_kernel<T><<<unsigned(pairs), 128, 0, stream>>>(static_cast<const T*>(x), hidden, top_k, r.sorted_pair,
                                                                r.pair_expert, r.offsets, row_base, experts,
                                                                static_cast<T*>(xl), pair_row_l, vec16);
    return cudaGetLastError();
  });
}

}  // namespace moekit::cuda::kernels

// The CUDA side of ep_ops.h: id remapping, byte-row gathers and the fixed-order combine.
#include <cstdint>

#include "base/cuda_check.h"
#include "base/cuda_elem.cuh"
#include "parallel/ep_ops.h"

namespace moekit::ep::cuda {
namespace {

template <class I>
__global__ void remap_kernel(const I* ids, int64_t n, int64_t start, int64_t end, int32_t sentinel, int32_t* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t e = int64_t(ids[i]);
  out[i] = (e >= start && e < end) ? int32_t(e - start) : sentinel;
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

void check_launch() { MOEKIT_CUDA_CALL(cudaGetLastError()); }

}  // namespace

void remap_ids(const void* ids, bool i64, int64_t n, int64_t start, int64_t end, int32_t sentinel, int32_t* out,
               void* stream) {
  const unsigned blocks = unsigned((n + 255) / 256);
  auto s = static_cast<cudaStream_t>(stream);
  if (i64)
    remap_kernel<<<blocks, 256, 0, s>>>(static_cast<const int64_t*>(ids), n, start, end, sentinel, out);
  else
    remap_kernel<<<blocks, 256, 0, s>>>(static_cast<const int32_t*>(ids), n, start, end, sentinel, out);
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

}  // namespace moekit::ep::cuda

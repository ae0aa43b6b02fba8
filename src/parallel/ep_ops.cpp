// The CPU side of ep_ops.h, and the dispatch to the CUDA side.
#include "parallel/ep_ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/convert.h"
#include "moekit/error.h"

#if defined(MOEKIT_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "base/cuda_check.h"
#include "base/cuda_device.h"
#endif

namespace moekit::ep {

namespace {
#if defined(MOEKIT_WITH_CUDA)
cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }
#endif
[[noreturn]] void no_cuda() { MOEKIT_FAIL(not_supported, "expert parallelism on CUDA devices needs a CUDA build"); }
}  // namespace

void remap_ids(Device d, const void* ids, DType id_dtype, int64_t n, int64_t K, int64_t start, int64_t end, int64_t E,
               int32_t sentinel, int32_t* out, Stream stream) {
  if (n == 0) return;
  const bool i64 = id_dtype == DType::i64;
  if (d.is_cpu()) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = i64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
      MOEKIT_CHECK(e >= 0 && e <= E, "top_k_index[", i / K, ", ", i % K, "] = ", e, " is out of range [0, ", E, "]");
      out[i] = (e >= start && e < end) ? int32_t(e - start) : sentinel;
    }
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  ep::cuda::remap_ids(ids, i64, n, start, end, E, sentinel, out, stream);
#else
  no_cuda();
#endif
}

void gather_rows(Device d, const void* src, int64_t src_pitch, const int32_t* rows, int64_t n, int64_t row_bytes,
                 void* dst, int64_t dst_pitch, Stream stream) {
  if (n == 0 || row_bytes == 0) return;
  if (d.is_cpu()) {
#pragma omp parallel for if (n * row_bytes > (1 << 20))
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(static_cast<char*>(dst) + i * dst_pitch, static_cast<const char*>(src) + rows[i] * src_pitch,
                  size_t(row_bytes));
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  ep::cuda::gather_rows(src, src_pitch, rows, n, row_bytes, dst, dst_pitch, stream);
#else
  no_cuda();
#endif
}

void combine_rows(Device d, const void* rows, DType dtype, int64_t H, const int32_t* map, int64_t T, int N, void* out,
                  Stream stream) {
  if (T == 0 || H == 0) return;
  MOEKIT_CHECK(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16,
               "expert parallel combine: dtype ", dtype_name(dtype), " is not f32, bf16 or f16");
  if (d.is_cpu()) {
#pragma omp parallel if (T * H > (1 << 16))
    {
      std::vector<float> acc(static_cast<size_t>(H)), row(static_cast<size_t>(H));
#pragma omp for
      for (int64_t t = 0; t < T; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int r = 0; r < N; ++r) {
          const int32_t p = map[t * N + r];
          if (p < 0) continue;
          moekit::cpu::load_f32(rows, dtype, int64_t(p) * H, H, row.data());
          for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += row[size_t(h)];
        }
        moekit::cpu::store_f32(acc.data(), out, dtype, t * H, H);
      }
    }
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  ep::cuda::combine_rows(rows, dtype == DType::f32 ? 0 : dtype == DType::bf16 ? 1 : 2, H, map, T, N, out, stream);
#else
  no_cuda();
#endif
}

void copy(Device d, void* dst, const void* src, int64_t bytes, Stream stream) {
  if (bytes == 0) return;
  if (d.is_cpu()) {
    std::memmove(dst, src, size_t(bytes));
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  MOEKIT_CUDA_CALL(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, cs(stream)));
#else
  no_cuda();
#endif
}

void copy_2d(Device d, void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, int64_t width, int64_t rows,
             Stream stream) {
  if (rows == 0 || width == 0) return;
  if (d.is_cpu()) {
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(static_cast<char*>(dst) + i * dst_pitch, static_cast<const char*>(src) + i * src_pitch,
                  size_t(width));
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  MOEKIT_CUDA_CALL(cudaMemcpy2DAsync(dst, size_t(dst_pitch), src, size_t(src_pitch), size_t(width), size_t(rows),
                                     cudaMemcpyDeviceToDevice, cs(stream)));
#else
  no_cuda();
#endif
}

void upload(Device d, void* dst, const void* host_src, int64_t bytes, Stream stream) {
  if (bytes == 0) return;
  if (d.is_cpu()) {
    std::memcpy(dst, host_src, size_t(bytes));
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  // Pageable host memory: the copy is staged before the call returns, so the host vector may go.
  MOEKIT_CUDA_CALL(cudaMemcpyAsync(dst, host_src, size_t(bytes), cudaMemcpyHostToDevice, cs(stream)));
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(cs(stream)));
#else
  no_cuda();
#endif
}

void download(Device d, void* host_dst, const void* src, int64_t bytes, Stream stream) {
  if (bytes == 0) return;
  if (d.is_cpu()) {
    std::memcpy(host_dst, src, size_t(bytes));
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  MOEKIT_CUDA_CALL(cudaMemcpyAsync(host_dst, src, size_t(bytes), cudaMemcpyDeviceToHost, cs(stream)));
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(cs(stream)));
#else
  no_cuda();
#endif
}

void zero(Device d, void* dst, int64_t bytes, Stream stream) {
  if (bytes == 0) return;
  if (d.is_cpu()) {
    std::memset(dst, 0, size_t(bytes));
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  MOEKIT_CUDA_CALL(cudaMemsetAsync(dst, 0, size_t(bytes), cs(stream)));
#else
  no_cuda();
#endif
}

}  // namespace moekit::ep

namespace moekit {
void use_device(Device d) {
  if (d.is_cpu()) return;
#if defined(MOEKIT_WITH_CUDA)
  MOEKIT_CUDA_CALL(cudaSetDevice(d.index));
#else
  MOEKIT_FAIL(not_supported, "device ", d.to_string(), ": moekit was built without CUDA");
#endif
}
}  // namespace moekit

namespace moekit::ep {

void plan_count(Device d, const void* ids, DType id_dtype, int64_t T, int64_t K, int64_t E, const PlanRanks& ranks,
                int32_t* pos, int32_t* counts, Stream stream) {
  MOEKIT_CHECK(d.is_cuda() && ranks.n <= kMaxPlanRanks, "plan_count: a GPU plan for at most ", kMaxPlanRanks,
               " ranks");
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  ep::cuda::plan_count(ids, id_dtype == DType::i64, T, K, E, ranks, pos, counts, stream);
#else
  no_cuda();
#endif
}

void plan_fill(Device d, const void* ids, DType id_dtype, const void* weights, DType w_dtype, int64_t T, int64_t K,
               const PlanRanks& ranks, const int32_t* pos, int32_t* rows, int32_t* map, int32_t* meta, Stream stream) {
  MOEKIT_CHECK(d.is_cuda(), "plan_fill: a GPU plan");
  if (T == 0) return;
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  ep::cuda::plan_fill(ids, id_dtype == DType::i64, weights, w_dtype == DType::f32 ? 0 : w_dtype == DType::bf16 ? 1 : 2,
                      T, K, ranks, pos, rows, map, meta, stream);
#else
  no_cuda();
#endif
}

void order(Device d, Stream from, Stream to) {
  if (d.is_cpu() || from == to) return;
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  cudaEvent_t ev;
  MOEKIT_CUDA_CALL(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  const cudaError_t rec = cudaEventRecord(ev, cs(from));
  const cudaError_t wait = rec == cudaSuccess ? cudaStreamWaitEvent(cs(to), ev, 0) : rec;
  (void)cudaEventDestroy(ev);  // released once the work it marks is done
  MOEKIT_CUDA_CALL(wait);
#else
  no_cuda();
#endif
}

void sync(Device d, Stream stream) {
  if (d.is_cpu()) return;
#if defined(MOEKIT_WITH_CUDA)
  moekit::cuda::DeviceGuard g(d.index);
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(cs(stream)));
#else
  no_cuda();
#endif
}

}  // namespace moekit::ep

// The CUDA side of `moekit bench`: card properties, the two ceilings, random fills, event timing.
// Raw CUDA runtime and cuBLAS; every call's status is checked.
#include "bench/cuda_bench.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "base/cuda_device.h"
#include "base/cuda_elem.cuh"
#include "bench/random.h"
#include "moekit/error.h"

namespace moekit::bench::cuda {
namespace {

using ::moekit::cuda::DeviceBuffer;

template <class T>
__global__ void fill_normal_kernel(T* data, int64_t n, float std, uint64_t seed) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    data[i] = ::moekit::cuda::from_f32<T>(std * normal_at(seed, uint64_t(i)));
}

// Random e4m3 codes of moderate magnitude (exponent fields 4..11, both signs; never NaN).
__global__ void fill_e4m3_kernel(uint8_t* data, int64_t n, uint64_t seed) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float u = normal_at(seed, uint64_t(i));
    const uint32_t h = __float_as_uint(u) * 2654435761u;
    data[i] = uint8_t((u < 0 ? 0x80u : 0u) | (((h >> 8) % 8u + 4u) << 3) | ((h >> 16) & 7u));
  }
}

// Holds the stream for `ns` nanoseconds of the device's global timer (one thread).
__global__ void hold_kernel(uint64_t ns) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (uint64_t t = t0; t - t0 < ns;) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median microseconds of `timed` calls after `warmup` ones.
double median_call_us(Stream stream, const std::function<void()>& enqueue, int warmup, int timed) {
  for (int i = 0; i < warmup; ++i) enqueue();
  synchronize(stream);
  std::vector<double> us;
  for (int i = 0; i < timed; ++i) us.push_back(time_call_us(stream, enqueue));
  return median_of(us);
}

}  // namespace

CardInfo card_info(int device) {
  cudaDeviceProp prop{};
  MOEKIT_CUDA_CALL(cudaGetDeviceProperties(&prop, device));
  MOEKIT_CUDA_CALL(cudaSetDevice(device));
  CardInfo c;
  c.name = prop.name;
  c.l2_bytes = prop.l2CacheSize;
  c.sm_count = prop.multiProcessorCount;
  c.cc_major = prop.major;
  c.cc_minor = prop.minor;
  MOEKIT_CUDA_CALL(cudaMemGetInfo(&c.free_bytes, &c.total_bytes));
  return c;
}

void fill_normal(void* data, DType dtype, int64_t n, double std, uint64_t seed, Stream stream) {
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((n + threads - 1) / threads, 4096));
  switch (dtype) {
    case DType::f32: fill_normal_kernel<<<blocks, threads, 0, s>>>(static_cast<float*>(data), n, float(std), seed); break;
    case DType::bf16:
      fill_normal_kernel<<<blocks, threads, 0, s>>>(static_cast<__nv_bfloat16*>(data), n, float(std), seed);
      break;
    case DType::f16: fill_normal_kernel<<<blocks, threads, 0, s>>>(static_cast<__half*>(data), n, float(std), seed); break;
    default: MOEKIT_FAIL(invalid_argument, "fill_normal: dtype ", dtype_name(dtype), " is not f32, bf16 or f16");
  }
  MOEKIT_CUDA_CALL(cudaGetLastError());
}

double gemm_bf16_tflops(int device, int n) {
  MOEKIT_CUDA_CALL(cudaSetDevice(device));
  const size_t elems = size_t(n) * size_t(n);
  DeviceBuffer a(elems * 2, device), b(elems * 2, device), c(elems * 2, device);
  Stream stream = create_stream(device);
  std::shared_ptr<void> stream_guard(stream, [](void* s) { destroy_stream(s); });
  // Random operands: a product of zeros runs faster than real data.
  fill_normal(a.data(), DType::bf16, int64_t(elems), 1.0, 11, stream);
  fill_normal(b.data(), DType::bf16, int64_t(elems), 1.0, 12, stream);
  const ::moekit::cuda::CublasHandle cublas(device);
  cublasHandle_t handle = cublas.get();
  MOEKIT_CUBLAS_CALL(cublasSetStream(handle, static_cast<cudaStream_t>(stream)));
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&] {
    MOEKIT_CUBLAS_CALL(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.data(), CUDA_R_16BF, n,
                                    b.data(), CUDA_R_16BF, n, &beta, c.data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
  };
  const double us = median_call_us(stream, gemm, 3, 10);
  return 2.0 * double(n) * n * n / (us * 1e-6) / 1e12;
}

double gemm_fp8_tflops(int device, int n) {
  MOEKIT_CUDA_CALL(cudaSetDevice(device));
  const size_t elems = size_t(n) * size_t(n);
  const size_t ws_bytes = size_t(32) << 20;
  DeviceBuffer a(elems, device), b(elems, device), c(elems * 2, device), ws(ws_bytes, device);
  Stream stream = create_stream(device);
  std::shared_ptr<void> stream_guard(stream, [](void* s) { destroy_stream(s); });
  auto cs = static_cast<cudaStream_t>(stream);
  fill_e4m3_kernel<<<4096, 256, 0, cs>>>(static_cast<uint8_t*>(a.data()), int64_t(elems), 21);
  fill_e4m3_kernel<<<4096, 256, 0, cs>>>(static_cast<uint8_t*>(b.data()), int64_t(elems), 22);
  MOEKIT_CUDA_CALL(cudaGetLastError());

  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  std::shared_ptr<void> lt_guard(nullptr, [&](void*) {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    if (lt) cublasLtDestroy(lt);
  });
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const uint64_t ws_size = ws_bytes;
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  const bool ready =
      cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, n, n, n) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, n, n, n) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, n, n) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                           sizeof(ws_size)) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &found) == CUBLAS_STATUS_SUCCESS &&
      found > 0;
  if (!ready) return 0.0;  // no FP8 GEMM here (before compute capability 8.9)
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  auto gemm = [&] {
    const cublasStatus_t st = cublasLtMatmul(lt, op, &alpha, a.data(), la, b.data(), lb, &beta, c.data(), lc,
                                             c.data(), lc, &heur.algo, ws.data(), ws_bytes, cs);
    if (st != CUBLAS_STATUS_SUCCESS) status = st;
  };
  const double us = median_call_us(stream, gemm, 3, 10);
  if (status != CUBLAS_STATUS_SUCCESS) return 0.0;
  return 2.0 * double(n) * n * n / (us * 1e-6) / 1e12;
}

double copy_gbps(int device, size_t bytes) {
  MOEKIT_CUDA_CALL(cudaSetDevice(device));
  DeviceBuffer src(bytes, device), dst(bytes, device);
  Stream stream = create_stream(device);
  std::shared_ptr<void> stream_guard(stream, [](void* s) { destroy_stream(s); });
  fill_normal(src.data(), DType::f32, int64_t(bytes / 4), 1.0, 13, stream);
  auto copy = [&] {
    MOEKIT_CUDA_CALL(
        cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  };
  const double us = median_call_us(stream, copy, 2, 10);
  return 2.0 * double(bytes) / (us * 1e-6) / 1e9;
}

void memset_bytes(void* data, int value, size_t bytes, Stream stream) {
  MOEKIT_CUDA_CALL(cudaMemsetAsync(data, value, bytes, static_cast<cudaStream_t>(stream)));
}

Stream create_stream(int device) {
  MOEKIT_CUDA_CALL(cudaSetDevice(device));
  cudaStream_t s = nullptr;
  MOEKIT_CUDA_CALL(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void destroy_stream(Stream stream) {
  if (stream) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

void synchronize(Stream stream) {
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  MOEKIT_CUDA_CALL(cudaGetLastError());
}

double time_call_us(Stream stream, const std::function<void()>& enqueue, double queue_ahead_us) {
  auto s = static_cast<cudaStream_t>(stream);
  cudaEvent_t start = nullptr, stop = nullptr;
  MOEKIT_CUDA_CALL(cudaEventCreate(&start));
  MOEKIT_CUDA_CALL(cudaEventCreate(&stop));
  std::shared_ptr<void> guard(nullptr, [&](void*) {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  });
  if (queue_ahead_us > 0) {
    hold_kernel<<<1, 1, 0, s>>>(uint64_t(queue_ahead_us * 1e3));
    MOEKIT_CUDA_CALL(cudaGetLastError());
  }
  MOEKIT_CUDA_CALL(cudaEventRecord(start, s));
  enqueue();
  MOEKIT_CUDA_CALL(cudaEventRecord(stop, s));
  MOEKIT_CUDA_CALL(cudaEventSynchronize(stop));
  MOEKIT_CUDA_CALL(cudaGetLastError());
  float ms = 0;
  MOEKIT_CUDA_CALL(cudaEventElapsedTime(&ms, start, stop));
  return double(ms) * 1e3;
}

}  // namespace moekit::bench::cuda

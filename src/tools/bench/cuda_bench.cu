// The CUDA side of `moekit bench`: card properties, the two ceilings, random fills, event timing.
// Raw CUDA runtime and cuBLAS; every call's status is checked.
#include "bench/cuda_bench.h"

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

double time_call_us(Stream stream, const std::function<void()>& enqueue) {
  auto s = static_cast<cudaStream_t>(stream);
  cudaEvent_t start = nullptr, stop = nullptr;
  MOEKIT_CUDA_CALL(cudaEventCreate(&start));
  MOEKIT_CUDA_CALL(cudaEventCreate(&stop));
  std::shared_ptr<void> guard(nullptr, [&](void*) {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  });
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

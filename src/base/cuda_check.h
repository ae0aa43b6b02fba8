// Internal: the checked CUDA runtime and cuBLAS calls of the whole library (backends, model ops, device memory,
// benchmark). A failed call throws moekit::Error(runtime) naming the call, the error and the place.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

// Every CUDA runtime / cuBLAS call goes through these: the error names the call.
#define MOEKIT_CUDA_CALL(expr)                                                                       \
  do {                                                                                               \
    const cudaError_t moekit_err_ = (expr);                                                          \
    if (moekit_err_ != cudaSuccess) ::moekit::cuda::throw_cuda_error(#expr, moekit_err_, __FILE__, __LINE__); \
  } while (0)
#define MOEKIT_CUBLAS_CALL(expr)                                                                     \
  do {                                                                                               \
    const cublasStatus_t moekit_st_ = (expr);                                                        \
    if (moekit_st_ != CUBLAS_STATUS_SUCCESS)                                                         \
      ::moekit::cuda::throw_cublas_error(#expr, moekit_st_, __FILE__, __LINE__);                     \
  } while (0)

namespace moekit::cuda {

[[noreturn]] void throw_cuda_error(const char* call, cudaError_t err, const char* file, int line);
[[noreturn]] void throw_cublas_error(const char* call, cublasStatus_t status, const char* file, int line);

}  // namespace moekit::cuda

// Internal: CUDA resources of the CUDA backends, owned by RAII holders, and checked calls.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include "moekit/error.h"
#include "moekit/experts.h"

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

// The kernels' code of an activation (kernels::kAct*), or -1 when they do not implement it.
int kernel_activation(Activation a);

[[noreturn]] void throw_cuda_error(const char* call, cudaError_t err, const char* file, int line);
[[noreturn]] void throw_cublas_error(const char* call, cublasStatus_t status, const char* file, int line);

struct DeviceInfo {
  int index = 0;
  std::string name;
  int major = 0, minor = 0;
  int multiprocessors = 0;
  int arch() const { return major * 10 + minor; }  // 90 for compute capability 9.0
  std::string to_string() const;                   // "cuda:0 (NVIDIA H200, compute capability 9.0)"
};
// Cached properties of a present device; throws when there is no such device.
const DeviceInfo& device_info(int device);

// Makes `device` current for the scope.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1, device_ = -1;
};

// Whether work enqueued on `stream` is being recorded into a CUDA graph.
bool stream_is_capturing(cudaStream_t stream);

// cudaMalloc'd bytes on one device.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, int device);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }

 private:
  void reset() noexcept;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  int device_ = 0;
};

// Page-locked host bytes (device-to-host readbacks).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A cuBLAS handle on one device. Shared by the modules of a device (one cuBLAS workspace per device,
// not per layer); lock() serialises the enqueueing threads, which set their own stream.
class CublasHandle {
 public:
  explicit CublasHandle(int device);
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }
  std::mutex& mutex() { return mutex_; }

 private:
  cublasHandle_t handle_ = nullptr;
  int device_ = 0;
  std::mutex mutex_;
};
// The device's handle, created on first use and destroyed when its last user lets go.
std::shared_ptr<CublasHandle> shared_cublas_handle(int device);

}  // namespace moekit::cuda

// Internal: CUDA device utilities shared by the CUDA backends, the model's CUDA ops and the benchmark: the one
// checked-call macro pair, device properties, RAII holders of device memory, pinned memory and cuBLAS handles,
// and grow-only per-stream scratch.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "base/cuda_check.h"
#include "moekit/error.h"

namespace moekit::cuda {

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
// A number read once per device (a device attribute, a kernel's attributes, an occupancy query), then without a
// lock: get() runs `query(device)` for the current device until it gives a value >= 0 and keeps that. A query that
// fails gives a negative number, which is not kept: get() returns `fallback` then, and where there is no current
// device or its index is past the first 64.
class PerDeviceValue {
 public:
  template <class Query>
  int get(Query&& query, int fallback) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      return fallback;
    }
    if (device < 0 || device >= kDevices) return fallback;
    int v = known_[device].load(std::memory_order_relaxed);  // 0 unknown, else the value + 1
    if (v == 0) {
      const int q = query(device);
      if (q < 0) return fallback;
      v = q + 1;
      known_[device].store(v, std::memory_order_relaxed);
    }
    return v - 1;
  }

 private:
  static constexpr int kDevices = 64;
  std::atomic<int> known_[kDevices] = {};
};

// The current device's multiprocessors, for kernel launchers that size a grid on every call: cached per device
// without a lock after the first query; 0 where there is no current device (never throws).
int current_multiprocessors();

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

// Lets this thread allocate (cudaMalloc) while one of its streams is being recorded into a graph, even when
// the capture was begun in global mode (torch.cuda.graph's default): the thread's capture mode is relaxed for
// the scope, as torch's own allocator does. Memory so allocated must outlive the graphs that use it.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode previous_ = cudaStreamCaptureModeRelaxed;
};

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

// A CUDA graph recorded from a stream, and its executable.
struct RecordedGraph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};
// Records what `body` enqueues on `stream` (thread-local capture mode) and instantiates it; the caller owns both
// handles. When `body` throws, the capture is ended and discarded and the exception rethrown.
RecordedGraph record_graph(cudaStream_t stream, const std::function<void()>& body);

// Grow-only device scratch per (device, stream), for work whose size is known only at the call. Growing
// waits for the stream (earlier work may still read the old buffer) and is refused while the stream is being
// recorded into a graph (`what` names the user in that message).
class StreamScratch {
 public:
  explicit StreamScratch(const char* what, size_t min_bytes = 0) : what_(what), min_bytes_(min_bytes) {}
  // At least `bytes` on `device`, valid until the next get() on the same stream with more bytes.
  void* get(int device, cudaStream_t stream, size_t bytes);

 private:
  const char* what_;
  size_t min_bytes_;
  std::mutex mutex_;
  std::map<std::pair<int, cudaStream_t>, DeviceBuffer> buffers_;
};

}  // namespace moekit::cuda

#include "base/cuda_device.h"

#include <algorithm>
#include <map>
#include <vector>

namespace moekit::cuda {

void throw_cuda_error(const char* call, cudaError_t err, const char* file, int line) {
  (void)cudaGetLastError();  // clear a non-sticky error so later calls start clean
  detail::throw_error(ErrorCode::runtime,
                      detail::concat(call, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"),
                      file, line);
}

void throw_cublas_error(const char* call, cublasStatus_t status, const char* file, int line) {
  detail::throw_error(ErrorCode::runtime,
                      detail::concat(call, " failed: ", cublasGetStatusName(status), " (",
                                     cublasGetStatusString(status), ")"),
                      file, line);
}

std::string DeviceInfo::to_string() const {
  return detail::concat("cuda:", index, " (", name, ", compute capability ", major, ".", minor, ")");
}

int current_multiprocessors() {
  static PerDeviceValue known;
  return known.get(
      [](int device) {
        int v = 0;
        if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || v <= 0) {
          (void)cudaGetLastError();
          return -1;
        }
        return v;
      },
      0);
}

const DeviceInfo& device_info(int device) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<DeviceInfo>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = cache[device];
  if (!slot) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      count = 0;
    }
    MOEKIT_CHECK(device >= 0 && device < count, "CUDA device ", device, " is not present (", count,
                 " CUDA devices found)");
    cudaDeviceProp prop{};
    MOEKIT_CUDA_CALL(cudaGetDeviceProperties(&prop, device));
    auto info = std::make_unique<DeviceInfo>();
    info->index = device;
    info->name = prop.name;
    info->major = prop.major;
    info->minor = prop.minor;
    info->multiprocessors = prop.multiProcessorCount;
    slot = std::move(info);
  }
  return *slot;
}

DeviceGuard::DeviceGuard(int device) : device_(device) {
  MOEKIT_CUDA_CALL(cudaGetDevice(&previous_));
  if (previous_ != device_) MOEKIT_CUDA_CALL(cudaSetDevice(device_));
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0 && previous_ != device_) (void)cudaSetDevice(previous_);
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MOEKIT_CUDA_CALL(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

RelaxedCaptureMode::RelaxedCaptureMode() { MOEKIT_CUDA_CALL(cudaThreadExchangeStreamCaptureMode(&previous_)); }

RelaxedCaptureMode::~RelaxedCaptureMode() { (void)cudaThreadExchangeStreamCaptureMode(&previous_); }

DeviceBuffer::DeviceBuffer(size_t bytes, int device) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  const cudaError_t err = cudaMalloc(&ptr_, bytes);
  if (err != cudaSuccess) {
    ptr_ = nullptr;
    (void)cudaGetLastError();
    MOEKIT_FAIL(runtime, "cudaMalloc of ", bytes, " bytes of workspace on cuda:", device,
                " failed: ", cudaGetErrorString(err));
  }
}

DeviceBuffer::~DeviceBuffer() { reset(); }

void DeviceBuffer::reset() noexcept {
  if (ptr_) {
    int previous = -1;
    (void)cudaGetDevice(&previous);
    if (previous != device_) (void)cudaSetDevice(device_);
    (void)cudaFree(ptr_);
    if (previous >= 0 && previous != device_) (void)cudaSetDevice(previous);
  }
  ptr_ = nullptr;
  bytes_ = 0;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_), device_(o.device_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    device_ = o.device_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  MOEKIT_CUDA_CALL(cudaMallocHost(&ptr_, bytes));
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_) (void)cudaFreeHost(ptr_);
}

CublasHandle::CublasHandle(int device) : device_(device) {
  DeviceGuard guard(device);
  MOEKIT_CUBLAS_CALL(cublasCreate(&handle_));
}

CublasHandle::~CublasHandle() {
  if (!handle_) return;
  int previous = -1;
  (void)cudaGetDevice(&previous);
  if (previous != device_) (void)cudaSetDevice(device_);
  (void)cublasDestroy(handle_);
  if (previous >= 0 && previous != device_) (void)cudaSetDevice(previous);
}

std::shared_ptr<CublasHandle> shared_cublas_handle(int device) {
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<CublasHandle>> handles;
  std::lock_guard<std::mutex> lock(mutex);
  auto& weak = handles[device];
  if (auto h = weak.lock()) return h;
  auto h = std::make_shared<CublasHandle>(device);
  weak = h;
  return h;
}

RecordedGraph record_graph(cudaStream_t stream, const std::function<void()>& body) {
  MOEKIT_CUDA_CALL(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  RecordedGraph g;
  try {
    body();
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &g.graph);
    if (g.graph) (void)cudaGraphDestroy(g.graph);
    (void)cudaGetLastError();
    throw;
  }
  MOEKIT_CUDA_CALL(cudaStreamEndCapture(stream, &g.graph));
  const cudaError_t err = cudaGraphInstantiate(&g.exec, g.graph, 0);
  if (err != cudaSuccess) {
    (void)cudaGraphDestroy(g.graph);
    MOEKIT_CUDA_CALL(err);
  }
  return g;
}

void* StreamScratch::get(int device, cudaStream_t stream, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceBuffer& b = buffers_[{device, stream}];
  if (b.size() < bytes) {
    MOEKIT_CHECK_CODE(!stream_is_capturing(stream), runtime, what_, " need ", bytes,
                      " bytes of scratch during graph capture; run the step once uncaptured first");
    MOEKIT_CUDA_CALL(cudaStreamSynchronize(stream));  // earlier work on the stream may still read the old buffer
    b = DeviceBuffer();
    b = DeviceBuffer(std::max(bytes, min_bytes_), device);
  }
  return b.data();
}

}  // namespace moekit::cuda

// HostStaging and copy_async (ops.h): page-locked host memory and asynchronous copies for the decode step's
// inputs and outputs. CUDA runtime calls only when built with CUDA.
#include <cstdlib>
#include <cstring>

#include "model/ops.h"
#include "moekit/error.h"

#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime.h>

#include "base/cuda_check.h"
#endif

namespace moekit::model {

HostStaging::~HostStaging() { release(); }

void HostStaging::release() noexcept {
  if (!ptr_) return;
#ifdef MOEKIT_WITH_CUDA
  if (pinned_) {
    (void)cudaFreeHost(ptr_);
  } else {
    std::free(ptr_);
  }
#else
  std::free(ptr_);
#endif
  ptr_ = nullptr;
  bytes_ = 0;
  pinned_ = false;
}

void* HostStaging::get(size_t bytes, Device device) {
  const bool pinned = device.is_cuda();
  if (ptr_ && bytes <= bytes_ && pinned == pinned_) return ptr_;
  release();
  const size_t n = bytes < 64 ? 64 : bytes;
#ifdef MOEKIT_WITH_CUDA
  if (pinned) {
    MOEKIT_CUDA_CALL(cudaMallocHost(&ptr_, n));
    bytes_ = n;
    pinned_ = true;
    return ptr_;
  }
#else
  MOEKIT_CHECK_CODE(!pinned, not_supported, "page-locked memory for ", device.to_string(),
                    ": moekit was built without CUDA");
#endif
  ptr_ = std::malloc(n);
  MOEKIT_CHECK(ptr_ != nullptr, "host staging: cannot allocate ", n, " bytes");
  bytes_ = n;
  return ptr_;
}

void copy_async(void* dst, Device dd, const void* src, Device sd, size_t bytes, Stream s) {
  if (bytes == 0) return;
  if (dd.is_cpu() && sd.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef MOEKIT_WITH_CUDA
  const cudaMemcpyKind kind = dd.is_cpu() ? cudaMemcpyDeviceToHost
                              : sd.is_cpu() ? cudaMemcpyHostToDevice
                                            : cudaMemcpyDeviceToDevice;
  MOEKIT_CUDA_CALL(cudaMemcpyAsync(dst, src, bytes, kind, static_cast<cudaStream_t>(s)));
#else
  (void)s;
  MOEKIT_FAIL(not_supported, "cannot copy between ", sd.to_string(), " and ", dd.to_string(),
              ": moekit was built without CUDA");
#endif
}

}  // namespace moekit::model

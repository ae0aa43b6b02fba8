// HostStaging (ops.h): page-locked host memory for the decode step's inputs and outputs (copied by
// memcpy_any_async). CUDA runtime calls only when built with CUDA.
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

}  // namespace moekit::model

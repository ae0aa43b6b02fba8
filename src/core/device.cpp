// Device memory and copies. CUDA runtime calls only when built with CUDA.
#include <cstring>

#include "moekit/tensor.h"

#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime.h>
#include "base/cuda_check.h"
#endif

namespace moekit {

int cuda_device_count() {
#ifdef MOEKIT_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

bool cuda_available() { return cuda_device_count() > 0; }

void* device_malloc(size_t bytes, Device device) {
#ifdef MOEKIT_WITH_CUDA
  MOEKIT_CHECK(device.index < cuda_device_count(), "device ", device.to_string(), " not present (",
               cuda_device_count(), " CUDA devices)");
  MOEKIT_CUDA_CALL(cudaSetDevice(device.index));
  void* p = nullptr;
  MOEKIT_CUDA_CALL(cudaMalloc(&p, bytes));
  return p;
#else
  (void)bytes;
  MOEKIT_FAIL(not_supported, "cannot allocate on ", device.to_string(), ": moekit was built without CUDA");
#endif
}

void device_free(void* p, Device device) {
#ifdef MOEKIT_WITH_CUDA
  (void)device;
  cudaFree(p);
#else
  (void)p;
  (void)device;
#endif
}

void memcpy_any_async(void* dst, Device dd, const void* src, Device sd, size_t bytes, Stream s) {
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

void memcpy_any(void* dst, Device dd, const void* src, Device sd, size_t bytes, Stream s) {
  memcpy_any_async(dst, dd, src, sd, bytes, s);
  if (bytes != 0) stream_synchronize(s, dd.is_cpu() ? sd : dd);
}

void stream_synchronize(Stream s, Device device) {
  if (device.is_cpu()) return;
#ifdef MOEKIT_WITH_CUDA
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
#else
  (void)s;
#endif
}

Stream stream_create(Device device) {
  if (device.is_cpu()) return nullptr;
#ifdef MOEKIT_WITH_CUDA
  MOEKIT_CHECK(device.index < cuda_device_count(), "device ", device.to_string(), " not present (",
               cuda_device_count(), " CUDA devices)");
  MOEKIT_CUDA_CALL(cudaSetDevice(device.index));
  cudaStream_t s = nullptr;
  MOEKIT_CUDA_CALL(cudaStreamCreate(&s));  // blocking: ordered with the legacy default stream
  return s;
#else
  MOEKIT_FAIL(not_supported, "cannot create a stream on ", device.to_string(), ": moekit was built without CUDA");
#endif
}

void stream_destroy(Stream s, Device device) noexcept {
  if (device.is_cpu() || s == nullptr) return;
#ifdef MOEKIT_WITH_CUDA
  (void)cudaStreamSynchronize(static_cast<cudaStream_t>(s));
  (void)cudaStreamDestroy(static_cast<cudaStream_t>(s));
#endif
}

}  // namespace moekit

// moekit: devices, tensor views (non-owning) and tensors (owning, shared storage).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "moekit/dtype.h"
#include "moekit/error.h"

namespace moekit {

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::cuda, i}; }
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  std::string to_string() const;                 // "cpu", "cuda:0"
  static Device parse(const std::string& name);  // "cpu", "cuda", "cuda:1"; throws
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

// Opaque stream handle: a cudaStream_t on CUDA devices, ignored on the CPU. nullptr = default stream.
using Stream = void*;

using Shape = std::vector<int64_t>;
std::string shape_to_string(const Shape& s);  // "[2, 3]"

// Non-owning view: data pointer, shape, strides (in elements), dtype, device.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  Shape shape;
  Shape strides;  // elements; empty means contiguous row-major

  TensorView() = default;
  TensorView(void* d, DType t, Shape s, Device dev = Device::cpu(), Shape st = {});

  int64_t dim() const { return int64_t(shape.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end; throws when out of range
  int64_t stride(int64_t d) const;
  int64_t numel() const;
  size_t nbytes() const { return dtype_nbytes(dtype, numel()); }
  bool is_contiguous() const;
  bool defined() const { return data != nullptr || numel() == 0; }
  template <class T> T* ptr() const { return static_cast<T*>(data); }
  std::string to_string() const;  // "bf16[2, 3] cuda:0"
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Wraps external memory; `keepalive` (may be null) is held as long as the tensor lives.
  static Tensor wrap(const TensorView& view, std::shared_ptr<void> keepalive);
  // Copies a view into a new contiguous tensor on `device` (any device pair).
  static Tensor copy_of(const TensorView& view, Device device);

  bool defined() const { return storage_ != nullptr || (view_.shape.size() && view_.numel() == 0); }
  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  void* data() const { return view_.data; }
  template <class T> T* ptr() const { return static_cast<T*>(view_.data); }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  const Shape& shape() const { return view_.shape; }
  int64_t dim() const { return view_.dim(); }
  int64_t size(int64_t d) const { return view_.size(d); }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }

  Tensor to(Device device) const;  // same tensor when already there
  Tensor to(DType dtype) const;    // CPU only; converts floating types
  Tensor contiguous() const;
  Tensor reshape(const Shape& shape) const;  // contiguous tensors only; shares storage
  void fill_(double value);                  // CPU only
  void copy_from(const TensorView& src);     // same shape and dtype, any device pair

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Device memory helpers (CUDA when built with it; throw otherwise).
bool cuda_available();            // built with CUDA and a device is present
int cuda_device_count();
void* device_malloc(size_t bytes, Device device);
void device_free(void* p, Device device);
void memcpy_any(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes, Stream s = nullptr);
// The same copy enqueued on stream s without waiting for it (host buffers must stay valid and unchanged until the
// stream has run it: stream_synchronize waits; page-locked host memory makes it truly asynchronous). Copies
// between CPU buffers run at once.
void memcpy_any_async(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes, Stream s);
void stream_synchronize(Stream s, Device device);
// A new stream on a CUDA device (nullptr on the CPU), and its release (waits for its work first).
Stream stream_create(Device device);
void stream_destroy(Stream s, Device device) noexcept;

}  // namespace moekit

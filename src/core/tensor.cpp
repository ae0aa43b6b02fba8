#include "moekit/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/checked.h"

namespace moekit {

std::string Device::to_string() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

Device Device::parse(const std::string& name) {
  if (name == "cpu") return cpu();
  if (name == "cuda" || name == "gpu") return cuda(0);
  if (name.rfind("cuda:", 0) == 0) {
    const std::string idx = name.substr(5);
    char* end = nullptr;
    long v = std::strtol(idx.c_str(), &end, 10);
    if (!idx.empty() && end && *end == '\0' && v >= 0 && v < 1024) return cuda(int(v));
  }
  MOEKIT_FAIL(invalid_argument, "unknown device '", name, "'; expected cpu, cuda or cuda:N");
}

std::string shape_to_string(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

TensorView::TensorView(void* d, DType t, Shape s, Device dev, Shape st)
    : data(d), dtype(t), device(dev), shape(std::move(s)), strides(std::move(st)) {
  for (int64_t x : shape) MOEKIT_CHECK(x >= 0, "negative dimension in shape ", shape_to_string(shape));
  MOEKIT_CHECK(strides.empty() || strides.size() == shape.size(), "strides ", shape_to_string(strides),
               " do not match shape ", shape_to_string(shape));
}

int64_t TensorView::size(int64_t d) const {
  const int64_t n = dim();
  if (d < 0) d += n;
  MOEKIT_CHECK(d >= 0 && d < n, "dimension ", d, " out of range for a ", n, "-D tensor");
  return shape[size_t(d)];
}

int64_t TensorView::stride(int64_t d) const {
  const int64_t n = dim();
  if (d < 0) d += n;
  MOEKIT_CHECK(d >= 0 && d < n, "dimension ", d, " out of range for a ", n, "-D tensor");
  if (!strides.empty()) return strides[size_t(d)];
  int64_t s = 1;
  for (int64_t i = n - 1; i > d; --i) s *= shape[size_t(i)];
  return s;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  return n;
}

bool TensorView::is_contiguous() const {
  if (strides.empty()) return true;
  int64_t expect = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (shape[size_t(i)] != 1 && strides[size_t(i)] != expect) return false;
    expect *= shape[size_t(i)];
  }
  return true;
}

std::string TensorView::to_string() const {
  return std::string(dtype_name(dtype)) + shape_to_string(shape) + " " + device.to_string();
}

namespace {
std::shared_ptr<void> allocate(size_t bytes, Device device) {
  if (bytes == 0) bytes = 1;
  if (device.is_cpu()) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    MOEKIT_CHECK_CODE(p != nullptr, runtime, "out of host memory allocating ", bytes, " bytes");
    return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }
  void* p = device_malloc(bytes, device);
  return std::shared_ptr<void>(p, [device](void* q) { device_free(q, device); });
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  // Shapes may come from untrusted numbers (config values, headers): the size is checked before allocating.
  const std::string what = std::string("tensor ") + shape_to_string(shape) + " of " + dtype_name(dtype);
  checked_bytes(checked_product(shape, what.c_str()), dtype_bits(dtype), what.c_str());
  Tensor t;
  t.view_ = TensorView(nullptr, dtype, shape, device);
  t.storage_ = allocate(t.view_.nbytes(), device);
  t.view_.data = t.storage_.get();
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  if (device.is_cpu()) {
    std::memset(t.data(), 0, t.nbytes());
  } else {
    std::vector<uint8_t> z(t.nbytes(), 0);
    memcpy_any(t.data(), device, z.data(), Device::cpu(), z.size());
  }
  return t;
}

Tensor Tensor::wrap(const TensorView& view, std::shared_ptr<void> keepalive) {
  Tensor t;
  t.view_ = view;
  t.storage_ = keepalive ? std::move(keepalive) : std::shared_ptr<void>(view.data, [](void*) {});
  return t;
}

Tensor Tensor::copy_of(const TensorView& v, Device device) {
  Tensor t = empty(v.shape, v.dtype, device);
  t.copy_from(v);
  return t;
}

void Tensor::copy_from(const TensorView& src) {
  MOEKIT_CHECK(src.shape == view_.shape, "copy_from: shape ", shape_to_string(src.shape), " != ",
               shape_to_string(view_.shape));
  MOEKIT_CHECK(src.dtype == view_.dtype, "copy_from: dtype ", dtype_name(src.dtype), " != ", dtype_name(view_.dtype));
  MOEKIT_CHECK(view_.is_contiguous(), "copy_from: destination must be contiguous");
  if (src.is_contiguous()) {
    memcpy_any(view_.data, view_.device, src.data, src.device, view_.nbytes());
    return;
  }
  MOEKIT_CHECK(src.device.is_cpu() && dtype_bits(src.dtype) % 8 == 0,
               "copy_from: non-contiguous source must be a byte-addressable CPU tensor, got ", src.to_string());
  // Gather element by element on the host, then one copy to the destination.
  const size_t es = size_t(dtype_bits(src.dtype) / 8);
  std::vector<uint8_t> tmp(view_.nbytes());
  const int64_t n = src.numel(), nd = src.dim();
  std::vector<int64_t> idx(size_t(nd), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int64_t d = 0; d < nd; ++d) off += idx[size_t(d)] * src.stride(d);
    std::memcpy(tmp.data() + size_t(i) * es, static_cast<const uint8_t*>(src.data) + off * int64_t(es), es);
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < src.shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  memcpy_any(view_.data, view_.device, tmp.data(), Device::cpu(), tmp.size());
}

Tensor Tensor::to(Device device) const {
  if (device == view_.device) return *this;
  return copy_of(view_, device);
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == view_.dtype) return *this;
  MOEKIT_CHECK(view_.device.is_cpu(), "Tensor::to(dtype) needs a CPU tensor, got ", view_.to_string());
  Tensor src = contiguous();
  Tensor t = empty(view_.shape, dtype, view_.device);
  convert(src.data(), src.dtype(), t.data(), dtype, numel());
  return t;
}

Tensor Tensor::contiguous() const {
  if (view_.is_contiguous()) return *this;
  return copy_of(view_, view_.device);
}

Tensor Tensor::reshape(const Shape& shape) const {
  MOEKIT_CHECK(view_.is_contiguous(), "reshape needs a contiguous tensor, got strides ", shape_to_string(view_.strides));
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  MOEKIT_CHECK(n == numel(), "cannot reshape ", shape_to_string(view_.shape), " into ", shape_to_string(shape));
  Tensor t = *this;
  t.view_.shape = shape;
  t.view_.strides.clear();
  return t;
}

void Tensor::fill_(double value) {
  MOEKIT_CHECK(view_.device.is_cpu(), "fill_ needs a CPU tensor, got ", view_.to_string());
  MOEKIT_CHECK(view_.is_contiguous(), "fill_ needs a contiguous tensor");
  const int64_t n = numel();
  switch (view_.dtype) {
    case DType::i32: for (int64_t i = 0; i < n; ++i) ptr<int32_t>()[i] = int32_t(value); break;
    case DType::i64: for (int64_t i = 0; i < n; ++i) ptr<int64_t>()[i] = int64_t(value); break;
    case DType::u8: case DType::boolean: std::memset(data(), int(value), size_t(n)); break;
    default: {
      MOEKIT_CHECK(is_floating(view_.dtype) && view_.dtype != DType::f4e2m1, "fill_: unsupported dtype ",
                   dtype_name(view_.dtype));
      const double v = value;
      for (int64_t i = 0; i < n; ++i) convert(&v, DType::f64, static_cast<uint8_t*>(data()) + dtype_nbytes(view_.dtype, i), view_.dtype, 1);
    }
  }
}

}  // namespace moekit

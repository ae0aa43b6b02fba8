#include "model/scratch.h"

#include <algorithm>

namespace moekit::model {
namespace {
constexpr size_t kAlign = 256;
constexpr size_t kMinBlock = size_t(4) << 20;
size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
}  // namespace

size_t Scratch::capacity() const {
  size_t n = 0;
  for (const auto& b : blocks_) n += b.size;
  return n;
}

void Scratch::reset() {
  if (blocks_.size() > 1) {
    const size_t total = capacity();
    blocks_.clear();
    Block b;
    b.mem = std::make_shared<Tensor>(Tensor::empty({int64_t(total / 8)}, DType::i64, device_));
    b.size = total;
    blocks_.push_back(std::move(b));
    ++epoch_;
  }
  for (auto& b : blocks_) b.used = 0;
}

Tensor Scratch::empty(const Shape& shape, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const size_t bytes = round_up(std::max<size_t>(dtype_nbytes(dtype, n), 1), kAlign);
  Block* b = blocks_.empty() ? nullptr : &blocks_.back();
  if (!b || b->size - b->used < bytes) {
    Block nb;
    nb.size = round_up(std::max({bytes, kMinBlock, capacity()}), kAlign);
    nb.mem = std::make_shared<Tensor>(Tensor::empty({int64_t(nb.size / 8)}, DType::i64, device_));
    blocks_.push_back(std::move(nb));
    b = &blocks_.back();
  }
  void* p = static_cast<char*>(b->mem->data()) + b->used;
  b->used += bytes;
  return Tensor::wrap(TensorView(p, dtype, shape, device_), b->mem);
}

}  // namespace moekit::model

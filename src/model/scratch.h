// Internal: the model runtime's scratch memory. One forward's temporaries are carved out of a few large
// blocks instead of one allocation each: cudaMalloc / cudaFree per tensor would synchronise the device on
// every layer, and a CUDA graph needs its buffers at the same addresses on every replay.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "moekit/tensor.h"

namespace moekit::model {

class Scratch {
 public:
  explicit Scratch(Device device = Device::cpu()) : device_(device) {}

  // Starts a forward: every tensor handed out before may be overwritten from now on (tensors still held
  // keep their block alive, so nothing dangles). When the last forward spilled into more than one block,
  // they are merged into one, which moves memory: epoch() changes.
  void reset();
  // A contiguous tensor of the forward (256-byte aligned, contents undefined).
  Tensor empty(const Shape& shape, DType dtype);
  // Changes whenever addresses handed out by a forward with the same sequence of requests may differ.
  uint64_t epoch() const { return epoch_; }
  size_t capacity() const;

 private:
  struct Block {
    std::shared_ptr<Tensor> mem;
    size_t size = 0, used = 0;
  };
  Device device_;
  std::vector<Block> blocks_;
  uint64_t epoch_ = 0;
};

}  // namespace moekit::model

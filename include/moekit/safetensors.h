// moekit: safetensors files (memory-mapped, validated) and writing them.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moekit/tensor.h"

namespace moekit {

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data section
};

class SafetensorsFile {
 public:
  // Maps and validates the file; throws Error(io) naming the file and what is wrong.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // in file order
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;  // throws not_found listing close names
  // Zero-copy CPU tensor over the mapping (kept alive by the tensor).
  Tensor get(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<void> mapping_;  // the mapped bytes
  const uint8_t* data_ = nullptr;  // start of the data section
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;
};

// Writes tensors (any device; copied to the host) in order, with optional string metadata.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace moekit

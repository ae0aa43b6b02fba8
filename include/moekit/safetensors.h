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
  uint64_t nbytes() const { return end - begin; }
};

class SafetensorsFile {
 public:
  // Maps and validates the file; throws Error(io) naming the file and what is wrong. Accepts exactly
  // the files the reference implementation accepts: header length <= 100 MB, the header a JSON object
  // without duplicate keys, every tensor with a known dtype, integer shape and offsets, the offsets
  // tiling the data section with no overlap, gap or trailing bytes, and byte sizes matching shapes.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // in data offset order
  std::vector<std::string> names() const;                                    // in data offset order
  bool contains(const std::string& name) const;
  // Throws not_found naming the file and listing close names.
  const SafetensorsEntry& entry(const std::string& name) const;
  // CPU tensor over the mapping (kept alive by the tensor): zero-copy when the data is aligned to its
  // element size, an aligned copy otherwise. The mapping is private (writes never reach the file) and
  // copy-on-write, except for files larger than the system will commit, where it is read-only: treat
  // the tensors as read-only and copy before changing them.
  Tensor get(const std::string& name) const;
  // Drops the tensor's whole pages from this process's memory (they are read from the file again if
  // touched): for loaders that have copied or converted a tensor and no longer need the mapped bytes.
  // Pages written through a tensor (copy-on-write) would be lost: tensors here are read-only.
  void release(const std::string& name) const;
  uint64_t file_size() const { return file_size_; }
  uint64_t header_size() const { return header_size_; }  // the JSON header, without the 8-byte length

 private:
  std::string path_;
  std::shared_ptr<void> mapping_;  // the mapped bytes
  const uint8_t* data_ = nullptr;  // start of the data section
  uint64_t file_size_ = 0, header_size_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;
};

// The safetensors name of a dtype ("F32", "BF16", "F8_E4M3", ...) and back (throws io on unknown).
const char* safetensors_dtype_name(DType t);
DType parse_safetensors_dtype(const std::string& name);

// Writes tensors (any device; copied to the host) in order, with optional string metadata. The file
// is written beside `path` and renamed into place, so a failed write leaves no partial file.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace moekit

// Internal: a Hugging Face checkpoint folder: config.json and one or many safetensors files.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moekit/safetensors.h"

namespace moekit {

class Checkpoint {
 public:
  // Reads DIR/config.json (and generation_config.json when present) and DIR/model.safetensors, or
  // else the shards named by DIR/model.safetensors.index.json (as transformers, the single file wins
  // when both exist). Every file is memory-mapped and validated. Throws Error(not_found) for a missing
  // folder, config or shard, Error(io) for a malformed one, a tensor in two shards, or an index entry
  // naming a shard that lacks the tensor.
  static Checkpoint open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& config() const { return config_; }
  // generation_config.json, or an empty object when the folder has none.
  const nlohmann::json& generation_config() const { return generation_config_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // Zero-copy CPU tensor; throws not_found naming the tensor, the folder and close names.
  Tensor get(const std::string& name) const;
  // Drops a tensor's mapped pages once it has been copied or converted (SafetensorsFile::release).
  void release(const std::string& name) const { file_of(name).release(name); }
  // Name, dtype, shape and offsets without touching the data; throws as get().
  const SafetensorsEntry& entry(const std::string& name) const;
  // The file holding a tensor; throws as get().
  const SafetensorsFile& file_of(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  const std::vector<SafetensorsFile>& files() const { return files_; }
  bool sharded() const { return sharded_; }

 private:
  std::string dir_;
  nlohmann::json config_, generation_config_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> file
  bool sharded_ = false;
};

// Reads a JSON file; throws not_found when it is missing, io when it is not valid JSON.
nlohmann::json read_json_file(const std::string& path);

}  // namespace moekit

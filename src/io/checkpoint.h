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
  // Reads DIR/config.json and DIR/model.safetensors, or the shards named by
  // DIR/model.safetensors.index.json. Throws Error(io / not_found) naming what is missing or wrong.
  static Checkpoint open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& config() const { return config_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // Zero-copy CPU tensor; throws not_found naming the tensor and the folder.
  Tensor get(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  const std::vector<SafetensorsFile>& files() const { return files_; }

 private:
  std::string dir_;
  nlohmann::json config_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> file
};

}  // namespace moekit

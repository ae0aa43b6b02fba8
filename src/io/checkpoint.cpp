#include "io/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <set>

namespace moekit {
namespace fs = std::filesystem;

namespace {
nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  MOEKIT_CHECK_CODE(in.good(), not_found, p.string(), ": cannot open");
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    MOEKIT_FAIL(io, p.string(), ": not valid JSON (", e.what(), ")");
  }
}
}  // namespace

Checkpoint Checkpoint::open(const std::string& dir) {
  Checkpoint c;
  c.dir_ = dir;
  const fs::path d(dir);
  MOEKIT_CHECK_CODE(fs::is_directory(d), not_found, dir, ": not a checkpoint folder (no such directory)");
  c.config_ = read_json(d / "config.json");
  MOEKIT_CHECK_CODE(c.config_.is_object(), io, (d / "config.json").string(), ": not a JSON object");
  std::vector<std::string> shards;
  if (fs::exists(d / "model.safetensors.index.json")) {
    const auto index = read_json(d / "model.safetensors.index.json");
    MOEKIT_CHECK_CODE(index.contains("weight_map") && index["weight_map"].is_object(), io,
                      (d / "model.safetensors.index.json").string(), ": no weight_map object");
    std::set<std::string> seen;
    for (const auto& [name, file] : index["weight_map"].items()) {
      MOEKIT_CHECK_CODE(file.is_string(), io, "weight_map entry for '", name, "' is not a file name");
      const std::string f = file.get<std::string>();
      MOEKIT_CHECK_CODE(f.find('/') == std::string::npos && f.find("..") == std::string::npos, io,
                        "weight_map names shard '", f, "' outside the checkpoint folder");
      if (seen.insert(f).second) shards.push_back(f);
    }
  } else if (fs::exists(d / "model.safetensors")) {
    shards.push_back("model.safetensors");
  } else {
    MOEKIT_FAIL(not_found, dir, ": neither model.safetensors nor model.safetensors.index.json found");
  }
  for (const auto& s : shards) {
    c.files_.push_back(SafetensorsFile::open((d / s).string()));
    for (const auto& e : c.files_.back().entries()) {
      MOEKIT_CHECK_CODE(c.where_.emplace(e.name, c.files_.size() - 1).second, io, dir, ": tensor '", e.name,
                        "' appears in more than one shard");
    }
  }
  return c;
}

Tensor Checkpoint::get(const std::string& name) const {
  auto it = where_.find(name);
  MOEKIT_CHECK_CODE(it != where_.end(), not_found, dir_, ": checkpoint has no tensor '", name, "'");
  return files_[it->second].get(name);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [n, i] : where_) out.push_back(n);
  return out;
}

}  // namespace moekit

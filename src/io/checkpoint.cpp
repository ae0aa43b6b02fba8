#include "io/checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "io/input.h"

namespace moekit {
namespace fs = std::filesystem;

nlohmann::json read_json_file(const std::string& path) {
  // Regular files of bounded size only (a FIFO would hang, a directory is not "no such file"), parsed in
  // linear time with a nesting limit.
  return parse_json_bounded(read_regular_file(path, kMaxJsonFileBytes), path);
}

namespace {

std::string close_to(const std::string& name, const std::map<std::string, size_t>& where) {
  // The names sorted next to the missing one share its longest prefixes.
  auto it = where.lower_bound(name);
  if (it != where.begin()) --it;
  std::string s;
  for (int k = 0; k < 3 && it != where.end(); ++k, ++it) s += (s.empty() ? "'" : ", '") + it->first + "'";
  return s;
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& dir) {
  Checkpoint c;
  c.dir_ = dir;
  const fs::path d(dir);
  std::error_code ec;
  MOEKIT_CHECK_CODE(fs::is_directory(d, ec), not_found, dir, ": not a checkpoint folder (no such directory)");
  const std::string config_path = (d / "config.json").string();
  MOEKIT_CHECK_CODE(fs::exists(config_path, ec), not_found, dir, ": checkpoint folder has no config.json");
  c.config_ = read_json_file(config_path);
  MOEKIT_CHECK_CODE(c.config_.is_object(), io, config_path, ": not a JSON object (", c.config_.type_name(), ")");
  const std::string gen_path = (d / "generation_config.json").string();
  c.generation_config_ = nlohmann::json::object();
  if (fs::exists(gen_path, ec)) {
    c.generation_config_ = read_json_file(gen_path);
    MOEKIT_CHECK_CODE(c.generation_config_.is_object(), io, gen_path, ": not a JSON object");
  }

  const std::string index_path = (d / "model.safetensors.index.json").string();
  std::vector<std::string> shards;
  std::map<std::string, std::string> index_map;  // tensor -> shard, from the index
  if (fs::exists(d / "model.safetensors", ec)) {
    shards.push_back("model.safetensors");
  } else if (fs::exists(index_path, ec)) {
    c.sharded_ = true;
    const auto index = read_json_file(index_path);
    MOEKIT_CHECK_CODE(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), io,
                      index_path, ": no weight_map object");
    MOEKIT_CHECK_CODE(!index["weight_map"].empty(), io, index_path, ": weight_map is empty");
    std::set<std::string> seen;
    for (const auto& [name, file] : index["weight_map"].items()) {
      MOEKIT_CHECK_CODE(file.is_string(), io, index_path, ": weight_map entry for '", printable(name),
                        "' is not a file name");
      const std::string f = file.get<std::string>();
      MOEKIT_CHECK_CODE(printable(f, f.size()) == f, io, index_path, ": weight_map names shard '", printable(f),
                        "', which has a control character");
      MOEKIT_CHECK_CODE(
          !f.empty() && f.find('/') == std::string::npos && f.find('\\') == std::string::npos && f != "." && f != "..",
          io, index_path, ": weight_map names shard '", printable(f), "' outside the checkpoint folder");
      index_map[name] = f;
      if (seen.insert(f).second) shards.push_back(f);
    }
    for (const auto& s : shards)
      MOEKIT_CHECK_CODE(fs::exists(d / s, ec), not_found, dir, ": shard '", s,
                        "' named by model.safetensors.index.json is missing");
  } else {
    MOEKIT_FAIL(not_found, dir, ": neither model.safetensors nor model.safetensors.index.json found");
  }

  for (const auto& s : shards) {
    c.files_.push_back(SafetensorsFile::open((d / s).string()));
    for (const auto& e : c.files_.back().entries()) {
      auto [it, fresh] = c.where_.emplace(e.name, c.files_.size() - 1);
      MOEKIT_CHECK_CODE(fresh, io, dir, ": tensor '", printable(e.name), "' appears in more than one shard ('",
                        fs::path(c.files_[it->second].path()).filename().string(), "' and '", s, "')");
    }
  }
  for (const auto& [name, shard] : index_map) {
    auto it = c.where_.find(name);
    MOEKIT_CHECK_CODE(it != c.where_.end(), io, index_path, ": tensor '", printable(name), "' is listed in shard '",
                      shard, "' but no shard holds it");
    const std::string holder = fs::path(c.files_[it->second].path()).filename().string();
    MOEKIT_CHECK_CODE(holder == shard, io, index_path, ": tensor '", printable(name), "' is listed in shard '", shard,
                      "' but is stored in '", holder, "'");
  }
  return c;
}

const SafetensorsFile& Checkpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) {
    MOEKIT_FAIL(not_found, dir_, ": checkpoint has no tensor '", printable(name), "' (", where_.size(), " tensors",
                where_.empty() ? std::string() : "; close: " + close_to(name, where_), ")");
  }
  return files_[it->second];
}

const SafetensorsEntry& Checkpoint::entry(const std::string& name) const { return file_of(name).entry(name); }

Tensor Checkpoint::get(const std::string& name) const { return file_of(name).get(name); }

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [n, i] : where_) out.push_back(n);
  return out;
}

}  // namespace moekit

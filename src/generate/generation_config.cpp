// GenerationConfig::from_pretrained: the checkpoint's generation_config.json over the defaults.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moekit/error.h"
#include "moekit/model.h"

namespace moekit {

GenerationConfig GenerationConfig::from_pretrained(const std::string& dir) {
  GenerationConfig gc;
  const auto path = std::filesystem::path(dir) / "generation_config.json";
  if (!std::filesystem::exists(path)) return gc;
  std::ifstream f(path);
  MOEKIT_CHECK_CODE(f.good(), io, "cannot read ", path.string());
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    MOEKIT_FAIL(io, path.string(), ": not valid JSON: ", e.what());
  }
  MOEKIT_CHECK_CODE(j.is_object(), io, path.string(), ": expected a JSON object");
  auto has = [&](const char* k) { return j.contains(k) && !j.at(k).is_null(); };
  auto bad = [&](const char* k, const char* want) {
    MOEKIT_FAIL(io, path.string(), ": \"", k, "\" must be ", want, ", got ", j.at(k).dump());
  };
  auto number = [&](const char* k) {
    if (!j.at(k).is_number()) bad(k, "a number");
    return j.at(k).get<double>();
  };
  auto integer = [&](const char* k) {
    if (!j.at(k).is_number_integer()) bad(k, "an integer");
    return j.at(k).get<int64_t>();
  };
  if (has("do_sample")) {
    if (!j.at("do_sample").is_boolean()) bad("do_sample", "true or false");
    gc.do_sample = j.at("do_sample").get<bool>();
  }
  if (has("temperature")) gc.temperature = float(number("temperature"));
  if (has("top_k")) gc.top_k = integer("top_k");
  if (has("top_p")) gc.top_p = float(number("top_p"));
  if (has("repetition_penalty")) gc.repetition_penalty = float(number("repetition_penalty"));
  if (has("max_new_tokens")) gc.max_new_tokens = integer("max_new_tokens");
  if (has("eos_token_id")) {
    const auto& e = j.at("eos_token_id");
    std::vector<int64_t> ids;
    if (e.is_number_integer()) {
      ids.push_back(e.get<int64_t>());
    } else if (e.is_array()) {
      for (const auto& v : e) {
        if (!v.is_number_integer()) bad("eos_token_id", "an integer or a list of integers");
        ids.push_back(v.get<int64_t>());
      }
    } else {
      bad("eos_token_id", "an integer or a list of integers");
    }
    gc.eos_token_ids = ids;
  }
  return gc;
}

}  // namespace moekit

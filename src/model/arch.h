// Internal: reading config.json fields, and the per-architecture config parsers (arch_*.cpp).
#pragma once
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "moekit/config.h"

namespace moekit::model {

// Config integers beyond this are refused (no size, id or count of a real model comes near 2^40); the
// products that size tensors are checked separately (check_sizes), and against the checkpoint's bytes
// when it loads.
constexpr int64_t kMaxConfigInt = int64_t(1) << 40;
constexpr int64_t kMaxLayers = int64_t(1) << 16;  // num_hidden_layers: per-layer tables are built while parsing

// Typed access to one JSON object of a config file; errors name the file and the field
// (with the sub-config prefix, e.g. "text_config.hidden_size").
class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& object, std::string source, std::string prefix, std::string model_type);

  const nlohmann::json& json() const { return j_; }
  const std::string& model_type() const { return model_type_; }
  bool has(const char* key) const;  // present and not null

  int64_t required_int(const char* key) const;
  // The first of `keys` that is present (config classes alias some names, e.g. num_experts / num_local_experts).
  int64_t required_int_any(std::initializer_list<const char*> keys) const;
  int64_t int_or(const char* key, int64_t fallback) const;
  std::optional<int64_t> optional_int(const char* key) const;
  double number_or(const char* key, double fallback) const;
  std::optional<double> optional_number(const char* key) const;
  bool bool_or(const char* key, bool fallback) const;
  std::string string_or(const char* key, const std::string& fallback) const;
  std::vector<int64_t> int_list_or(const char* key, std::vector<int64_t> fallback) const;
  std::vector<std::string> string_list_or(const char* key, std::vector<std::string> fallback) const;
  // A nested object (e.g. rope_parameters); empty object when absent.
  ConfigReader object(const char* key) const;

  [[noreturn]] void fail(const char* key, const std::string& what) const;
  std::string field(const char* key) const { return prefix_ + key; }

 private:
  const nlohmann::json& at(const char* key) const;
  nlohmann::json empty_;
  const nlohmann::json& j_;
  std::string source_, prefix_, model_type_;
};

// Throws naming the fields when a product that sizes a tensor (heads x head_dim x hidden, vocab x hidden,
// experts x intermediate x hidden, ...) overflows int64.
void check_sizes(const ConfigReader& r, const TextConfig& c);

// Fields every decoder has (sizes, heads, norms, rope, embeddings); `default_theta` as the config class sets it.
void parse_common(const ConfigReader& r, TextConfig& c, double default_theta);
// decoder_sparse_step / mlp_only_layers (qwen family).
void parse_sparse_layers(const ConfigReader& r, TextConfig& c);
// The default routed-experts spec: E, H, moe_intermediate_size, hidden_act, gated and concatenated.
void set_default_experts_spec(TextConfig& c);

using ArchParseFn = void (*)(const ConfigReader& r, TextConfig& c);
struct ArchParser {
  const char* model_type;
  ArchParseFn parse;
};
// Decoders moekit runs, by model_type.
const std::vector<ArchParser>& arch_parsers();

void parse_qwen2_moe(const ConfigReader& r, TextConfig& c);          // arch_qwen.cpp
void parse_qwen3_moe(const ConfigReader& r, TextConfig& c);          // arch_qwen.cpp
void parse_qwen3_vl_moe_text(const ConfigReader& r, TextConfig& c);  // arch_qwen.cpp
void parse_mixtral(const ConfigReader& r, TextConfig& c);            // arch_mixtral.cpp
void parse_olmoe(const ConfigReader& r, TextConfig& c);              // arch_olmoe.cpp
void parse_deepseek_v3(const ConfigReader& r, TextConfig& c);        // arch_deepseek_v3.cpp
void parse_gpt_oss(const ConfigReader& r, TextConfig& c);            // arch_gpt_oss.cpp

}  // namespace moekit::model

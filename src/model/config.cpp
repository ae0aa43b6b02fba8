// config.json parsing: typed fields with clear errors, rope parameters, sub-configs, EOS tokens.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/input.h"
#include "model/arch.h"
#include "moekit/error.h"

namespace moekit {
namespace model {

namespace {
std::string json_short(const nlohmann::json& v) { return json_brief(v, 60); }
}  // namespace

ConfigReader::ConfigReader(const nlohmann::json& object, std::string source, std::string prefix, std::string model_type)
    : empty_(nlohmann::json::object()),
      j_(object),
      source_(std::move(source)),
      prefix_(std::move(prefix)),
      model_type_(std::move(model_type)) {}

void ConfigReader::fail(const char* key, const std::string& what) const {
  MOEKIT_FAIL(invalid_argument, source_, ": field '", prefix_, key, "' ", what,
              model_type_.empty() ? "" : " (model_type " + model_type_ + ")");
}

bool ConfigReader::has(const char* key) const {
  auto it = j_.find(key);
  return it != j_.end() && !it->is_null();
}

const nlohmann::json& ConfigReader::at(const char* key) const { return j_.at(key); }

int64_t ConfigReader::required_int(const char* key) const {
  if (!has(key)) fail(key, "is required but missing");
  return *optional_int(key);
}

int64_t ConfigReader::required_int_any(std::initializer_list<const char*> keys) const {
  for (const char* k : keys)
    if (has(k)) return required_int(k);
  std::string names;
  for (const char* k : keys) names += std::string(names.empty() ? "" : " or ") + "'" + prefix_ + k + "'";
  MOEKIT_FAIL(invalid_argument, source_, ": required field ", names, " is missing",
              model_type_.empty() ? "" : " (model_type " + model_type_ + ")");
}

std::optional<int64_t> ConfigReader::optional_int(const char* key) const {
  if (!has(key)) return std::nullopt;
  const auto& v = at(key);
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(kMaxConfigInt))
    fail(key, "is " + std::to_string(v.get<uint64_t>()) + ", larger than any value moekit accepts (" +
                  std::to_string(kMaxConfigInt) + ")");
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if (x < -kMaxConfigInt)
      fail(key, "is " + std::to_string(x) + ", smaller than any value moekit accepts (" +
                    std::to_string(-kMaxConfigInt) + ")");
    return x;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::floor(d) == d && std::fabs(d) <= double(kMaxConfigInt)) return int64_t(d);
  }
  fail(key, "must be an integer, got " + json_short(v));
}

int64_t ConfigReader::int_or(const char* key, int64_t fallback) const {
  auto v = optional_int(key);
  return v ? *v : fallback;
}

std::optional<double> ConfigReader::optional_number(const char* key) const {
  if (!has(key)) return std::nullopt;
  const auto& v = at(key);
  if (!v.is_number()) fail(key, "must be a number, got " + json_short(v));
  const double d = v.get<double>();
  if (!std::isfinite(d)) fail(key, "must be a finite number, got " + json_short(v));
  return d;
}

double ConfigReader::number_or(const char* key, double fallback) const {
  auto v = optional_number(key);
  return v ? *v : fallback;
}

bool ConfigReader::bool_or(const char* key, bool fallback) const {
  if (!has(key)) return fallback;
  const auto& v = at(key);
  if (!v.is_boolean()) fail(key, "must be true or false, got " + json_short(v));
  return v.get<bool>();
}

std::string ConfigReader::string_or(const char* key, const std::string& fallback) const {
  if (!has(key)) return fallback;
  const auto& v = at(key);
  if (!v.is_string()) fail(key, "must be a string, got " + json_short(v));
  return v.get<std::string>();
}

std::vector<int64_t> ConfigReader::int_list_or(const char* key, std::vector<int64_t> fallback) const {
  if (!has(key)) return fallback;
  const auto& v = at(key);
  auto in_range = [](const nlohmann::json& e) {
    return e.is_number_integer() &&
           (e.is_number_unsigned() ? e.get<uint64_t>() <= uint64_t(kMaxConfigInt) : e.get<int64_t>() >= -kMaxConfigInt);
  };
  if (in_range(v)) return {v.get<int64_t>()};
  if (!v.is_array()) fail(key, "must be a list of integers, got " + json_short(v));
  std::vector<int64_t> out;
  for (const auto& e : v) {
    if (!in_range(e))
      fail(key,
           "must be a list of integers (each within +-" + std::to_string(kMaxConfigInt) + "), got " + json_short(v));
    out.push_back(e.get<int64_t>());
  }
  return out;
}

std::vector<std::string> ConfigReader::string_list_or(const char* key, std::vector<std::string> fallback) const {
  if (!has(key)) return fallback;
  const auto& v = at(key);
  if (!v.is_array()) fail(key, "must be a list of strings, got " + json_short(v));
  std::vector<std::string> out;
  for (const auto& e : v) {
    if (!e.is_string()) fail(key, "must be a list of strings, got " + json_short(v));
    out.push_back(e.get<std::string>());
  }
  return out;
}

ConfigReader ConfigReader::object(const char* key) const {
  if (!has(key)) return ConfigReader(empty_, source_, prefix_ + key + ".", model_type_);
  const auto& v = at(key);
  if (!v.is_object()) fail(key, "must be an object, got " + json_short(v));
  return ConfigReader(v, source_, prefix_ + key + ".", model_type_);
}

namespace {
void parse_rope(const ConfigReader& r, TextConfig& c, double default_theta) {
  const ConfigReader p = r.has("rope_parameters") ? r.object("rope_parameters") : r.object("rope_scaling");
  RopeConfig& rope = c.rope;
  rope.type = p.string_or("rope_type", p.string_or("type", "default"));
  rope.theta = p.number_or("rope_theta", r.number_or("rope_theta", default_theta));
  rope.partial_rotary_factor = p.number_or("partial_rotary_factor", r.number_or("partial_rotary_factor", 1.0));
  rope.original_max_position_embeddings = r.int_or(
      "original_max_position_embeddings", p.int_or("original_max_position_embeddings", c.max_position_embeddings));
  if (!(rope.theta > 0)) r.fail("rope_theta", "must be > 0, got " + std::to_string(rope.theta));
  if (!(rope.partial_rotary_factor > 0 && rope.partial_rotary_factor <= 1))
    r.fail("partial_rotary_factor", "must be in (0, 1], got " + std::to_string(rope.partial_rotary_factor));
  if (rope.type == "default") return;
  if (rope.type == "linear") {
    if (!p.has("factor")) p.fail("factor", "is required for rope_type linear");
    rope.factor = *p.optional_number("factor");
  } else if (rope.type == "yarn") {
    rope.factor = p.has("factor") ? *p.optional_number("factor")
                                  : double(c.max_position_embeddings) / double(rope.original_max_position_embeddings);
    rope.attention_factor = p.optional_number("attention_factor");
    rope.beta_fast = p.number_or("beta_fast", 32.0);
    rope.beta_slow = p.number_or("beta_slow", 1.0);
    if (rope.beta_fast == 0) rope.beta_fast = 32.0;  // transformers: `get("beta_fast") or 32`
    if (rope.beta_slow == 0) rope.beta_slow = 1.0;
    rope.mscale = p.optional_number("mscale");
    rope.mscale_all_dim = p.optional_number("mscale_all_dim");
    rope.truncate = p.bool_or("truncate", true);
  } else if (rope.type == "llama3") {
    if (!p.has("factor")) p.fail("factor", "is required for rope_type llama3");
    rope.factor = *p.optional_number("factor");
    rope.low_freq_factor = p.number_or("low_freq_factor", 1.0);
    rope.high_freq_factor = p.number_or("high_freq_factor", 4.0);
  } else {
    p.fail("rope_type", "is '" + printable(rope.type, 60) +
                            "', which moekit does not run; supported: default, linear, yarn, llama3");
  }
}

bool is_sub_config_key(const std::string& key) {
  static const char* kNotModels[] = {"quantization_config", "generation_config", "rope_config"};
  if (key.size() < 7 || key.compare(key.size() - 7, 7, "_config") != 0) return false;
  return std::none_of(std::begin(kNotModels), std::end(kNotModels), [&](const char* n) { return key == n; });
}

std::vector<int64_t> eos_from(const nlohmann::json& j) {
  auto it = j.find("eos_token_id");
  if (it == j.end() || it->is_null()) return {};
  std::vector<int64_t> out;
  if (it->is_number_integer())
    out.push_back(it->get<int64_t>());
  else if (it->is_array())
    for (const auto& e : *it)
      if (e.is_number_integer()) out.push_back(e.get<int64_t>());
  return out;
}

nlohmann::json parse_json(const std::string& text, const std::string& source) {
  return parse_json_bounded(text, source);  // linear, nesting-limited
}

std::string read_text(const std::filesystem::path& p) {
  return read_regular_file(p.string(), kMaxJsonFileBytes);  // a FIFO or a directory is an error, not a hang
}
}  // namespace

void parse_common(const ConfigReader& r, TextConfig& c, double default_theta) {
  c.vocab_size = r.required_int("vocab_size");
  c.hidden_size = r.required_int("hidden_size");
  c.num_hidden_layers = r.required_int("num_hidden_layers");
  c.num_attention_heads = r.required_int("num_attention_heads");
  if (c.vocab_size <= 0) r.fail("vocab_size", "must be > 0, got " + std::to_string(c.vocab_size));
  if (c.hidden_size <= 0) r.fail("hidden_size", "must be > 0, got " + std::to_string(c.hidden_size));
  if (c.num_hidden_layers <= 0) r.fail("num_hidden_layers", "must be > 0, got " + std::to_string(c.num_hidden_layers));
  if (c.num_attention_heads <= 0)
    r.fail("num_attention_heads", "must be > 0, got " + std::to_string(c.num_attention_heads));
  c.num_key_value_heads = r.int_or("num_key_value_heads", c.num_attention_heads);
  if (c.num_key_value_heads <= 0 || c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_key_value_heads", "must divide num_attention_heads (" + std::to_string(c.num_attention_heads) +
                                      "), got " + std::to_string(c.num_key_value_heads));
  c.head_dim = r.int_or("head_dim", c.hidden_size / c.num_attention_heads);
  if (c.head_dim <= 0) r.fail("head_dim", "must be > 0, got " + std::to_string(c.head_dim));
  c.hidden_act = r.string_or("hidden_act", "silu");
  c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-6);
  if (!(c.rms_norm_eps > 0)) r.fail("rms_norm_eps", "must be > 0, got " + json_short(r.json().at("rms_norm_eps")));
  c.max_position_embeddings = r.int_or("max_position_embeddings", 4096);
  c.tie_word_embeddings = r.bool_or("tie_word_embeddings", false);
  if (c.num_hidden_layers > kMaxLayers)
    r.fail("num_hidden_layers", "is " + std::to_string(c.num_hidden_layers) + ", more than moekit accepts (" +
                                    std::to_string(kMaxLayers) + ")");
  c.sliding_window.assign(size_t(c.num_hidden_layers), 0);
  c.moe_layer.assign(size_t(c.num_hidden_layers), true);
  parse_rope(r, c, default_theta);
}

void check_sizes(const ConfigReader& r, const TextConfig& c) {
  // Every product that sizes a tensor must fit in int64 (a config with heads x head_dim wrapping around
  // to a plausible number would pass every shape check). Each is named with its fields.
  struct Field {
    const char* name;
    int64_t value;
  };
  auto product = [&](std::initializer_list<Field> fields) {
    int64_t n = 1;
    for (const Field& f : fields) {
      if (f.value < 0) r.fail(f.name, "must be >= 0, got " + std::to_string(f.value));
      if (__builtin_mul_overflow(n, f.value, &n)) {
        std::string what;
        for (const Field& g : fields)
          what += (what.empty() ? "" : " x ") + std::string(g.name) + " " + std::to_string(g.value);
        r.fail(fields.begin()->name, "makes a tensor too large: " + what + " overflows a 64-bit size");
      }
    }
  };
  const int64_t H = c.hidden_size;
  product({{"num_attention_heads", c.num_attention_heads}, {"head_dim", c.head_dim}, {"hidden_size", H}});
  product({{"num_key_value_heads", c.num_key_value_heads}, {"head_dim", c.head_dim}, {"hidden_size", H}});
  product({{"vocab_size", c.vocab_size}, {"hidden_size", H}});
  product({{"intermediate_size", c.intermediate_size}, {"hidden_size", H}, {"2", 2}});
  product({{"num_experts", c.num_experts},
           {"moe_intermediate_size", c.moe_intermediate_size},
           {"hidden_size", H},
           {"3", 3}});
  product({{"shared_expert_intermediate_size", c.shared_expert_intermediate_size}, {"hidden_size", H}, {"3", 3}});
  product({{"max_position_embeddings", c.max_position_embeddings}, {"head_dim", c.head_dim}});
  if (c.mla) {
    product({{"num_attention_heads", c.num_attention_heads},
             {"qk_nope_head_dim", c.qk_nope_head_dim},
             {"qk_rope_head_dim", c.qk_rope_head_dim},
             {"v_head_dim", c.v_head_dim},
             {"kv_lora_rank", c.kv_lora_rank}});
    product({{"q_lora_rank", c.q_lora_rank}, {"hidden_size", H}});
    product({{"num_attention_heads", c.num_attention_heads},
             {"qk_nope_head_dim", c.qk_nope_head_dim},
             {"qk_rope_head_dim", c.qk_rope_head_dim},
             {"q_lora_rank", std::max<int64_t>(c.q_lora_rank, H)}});
  }
}

void parse_sparse_layers(const ConfigReader& r, TextConfig& c) {
  const int64_t step = r.int_or("decoder_sparse_step", 1);
  if (step <= 0) r.fail("decoder_sparse_step", "must be > 0, got " + std::to_string(step));
  const auto mlp_only = r.int_list_or("mlp_only_layers", {});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const bool dense = std::find(mlp_only.begin(), mlp_only.end(), i) != mlp_only.end();
    c.moe_layer[size_t(i)] = !dense && c.num_experts > 0 && (i + 1) % step == 0;
  }
}

void set_default_experts_spec(TextConfig& c) {
  ExpertsSpec& s = c.experts;
  s.num_experts = c.num_experts;
  s.hidden = c.hidden_size;
  s.intermediate = c.moe_intermediate_size;
  s.activation = parse_activation(c.hidden_act);
  s.has_gate = true;
  s.has_bias = false;
  s.is_transposed = false;
  s.is_concatenated = true;
  s.gate = GateKind::act_mul;
}

const std::vector<ArchParser>& arch_parsers() {
  static const std::vector<ArchParser> parsers = {
      {"qwen2_moe", parse_qwen2_moe},
      {"qwen3_moe", parse_qwen3_moe},
      {"mixtral", parse_mixtral},
      {"olmoe", parse_olmoe},
      {"deepseek_v3", parse_deepseek_v3},
      {"gpt_oss", parse_gpt_oss},
      {"qwen3_vl_moe_text", parse_qwen3_vl_moe_text},
  };
  return parsers;
}

}  // namespace model

double TextConfig::attention_scale() const {
  if (!mla) return 1.0 / std::sqrt(double(head_dim));
  double scale = 1.0 / std::sqrt(double(qk_nope_head_dim + qk_rope_head_dim));
  // DeepSeek's yarn_apply_mscale: the softmax scale grows with mscale_all_dim^2.
  if (rope.type != "default" && rope.mscale_all_dim && *rope.mscale_all_dim != 0 && rope.factor > 1) {
    const double m = 0.1 * *rope.mscale_all_dim * std::log(rope.factor) + 1.0;
    scale *= m * m;
  }
  return scale;
}

std::vector<std::string> supported_model_types() {
  std::vector<std::string> out;
  for (const auto& p : model::arch_parsers()) {
    std::string n = p.model_type;
    if (n.size() > 5 && n.compare(n.size() - 5, 5, "_text") == 0) n = n.substr(0, n.size() - 5) + " (text_config)";
    out.push_back(n);
  }
  return out;
}

ModelConfig ModelConfig::parse(const std::string& config_json, const std::string& source,
                               const std::string& generation_config_json) {
  const nlohmann::json j = model::parse_json(config_json, source);
  MOEKIT_CHECK_CODE(j.is_object(), io, source, ": not a JSON object");
  ModelConfig mc;
  const model::ConfigReader top(j, source, "", "");
  if (!top.has("model_type")) top.fail("model_type", "is required but missing");
  mc.model_type = top.string_or("model_type", "");
  for (const auto& [key, value] : j.items())
    if (value.is_object() && model::is_sub_config_key(key)) mc.sub_configs.push_back(key);
  mc.has_quantization_config = top.has("quantization_config");
  if (mc.has_quantization_config && j["quantization_config"].is_object()) {
    const nlohmann::json& q = j["quantization_config"];
    QuantizationConfig qc;
    auto text = [&](const char* key) {
      return q.contains(key) && q[key].is_string() ? q[key].get<std::string>() : std::string();
    };
    qc.quant_method = text("quant_method");
    qc.fmt = text("fmt");
    qc.activation_scheme = text("activation_scheme");
    qc.scale_fmt = text("scale_fmt");
    if (q.contains("weight_block_size") && q["weight_block_size"].is_array())
      for (const auto& v : q["weight_block_size"])
        qc.weight_block_size.push_back(v.is_number_integer() ? v.get<int64_t>() : -1);
    for (const nlohmann::json* c : {&j, j.contains("text_config") ? &j["text_config"] : &j})
      if (c->is_object() && c->contains("expert_dtype") && (*c)["expert_dtype"].is_string())
        qc.expert_dtype = (*c)["expert_dtype"].get<std::string>();
    mc.quantization = qc;
  }

  const auto find_parser = [](const std::string& type) -> const model::ArchParser* {
    for (const auto& p : model::arch_parsers())
      if (type == p.model_type) return &p;
    return nullptr;
  };
  auto unsupported = [&](const std::string& type) {
    std::string list;
    for (const auto& n : supported_model_types()) list += (list.empty() ? "" : ", ") + n;
    MOEKIT_FAIL(not_supported, source, ": model_type '", type, "' is not supported; moekit runs: ", list);
  };

  const nlohmann::json* text = &j;
  std::string prefix;
  std::string text_type = mc.model_type;
  const model::ArchParser* parser = find_parser(text_type);
  if (!parser) {
    auto it = j.find("text_config");
    if (it == j.end() || !it->is_object()) unsupported(mc.model_type);
    text = &*it;
    mc.text_config_key = "text_config";
    prefix = "text_config.";
    text_type = model::ConfigReader(*it, source, prefix, "").string_or("model_type", mc.model_type + "_text");
    parser = find_parser(text_type);
    if (!parser) parser = find_parser(mc.model_type + "_text");
    if (!parser) unsupported(mc.model_type);
    text_type = parser->model_type;
  }
  const model::ConfigReader r(*text, source, prefix, text_type);
  mc.text.model_type = text_type;
  parser->parse(r, mc.text);
  model::check_sizes(r, mc.text);
  const TextConfig& tc = mc.text;
  if (std::find(tc.moe_layer.begin(), tc.moe_layer.end(), true) != tc.moe_layer.end()) {
    if (tc.num_experts <= 0) r.fail("num_experts", "must be > 0, got " + std::to_string(tc.num_experts));
    if (tc.num_experts_per_tok < 1 || tc.num_experts_per_tok > tc.num_experts)
      r.fail("num_experts_per_tok", "must be in [1, " + std::to_string(tc.num_experts) + "], got " +
                                        std::to_string(tc.num_experts_per_tok));
    if (tc.moe_intermediate_size <= 0)
      r.fail("moe_intermediate_size", "(the size of one expert) must be > 0, got " +
                                          std::to_string(tc.moe_intermediate_size));
  }
  if (!mc.text_config_key.empty()) {
    // Composite (multimodal) configs: the output projection belongs to the top-level model, and
    // transformers ties it to the embedding by that model's config alone (PreTrainedModel reads
    // self.config.tie_word_embeddings, whose default is false for the composite config classes);
    // text_config.tie_word_embeddings only concerns a text model built alone, which has no lm_head.
    mc.text.tie_word_embeddings = top.bool_or("tie_word_embeddings", false);
  }

  for (const char* key : {"dtype", "torch_dtype"}) {
    if (r.has(key) && r.json().at(key).is_string()) {
      mc.dtype = r.string_or(key, "");
      break;
    }
    if (top.has(key) && j.at(key).is_string()) {
      mc.dtype = top.string_or(key, "");
      break;
    }
  }
  mc.eos_token_ids = model::eos_from(j);
  if (mc.eos_token_ids.empty()) mc.eos_token_ids = model::eos_from(*text);
  if (top.has("bos_token_id") && j.at("bos_token_id").is_number_integer())
    mc.bos_token_id = j.at("bos_token_id").get<int64_t>();
  if (!generation_config_json.empty()) {
    const auto g = model::parse_json(generation_config_json, source + " (generation_config.json)");
    if (g.is_object() && g.contains("eos_token_id")) mc.eos_token_ids = model::eos_from(g);
  }
  return mc;
}

ModelConfig ModelConfig::load(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path d(dir);
  MOEKIT_CHECK_CODE(fs::is_directory(d), not_found, dir, ": not a checkpoint folder (no such directory)");
  const fs::path cfg = d / "config.json";
  MOEKIT_CHECK_CODE(fs::exists(cfg), not_found, cfg.string(),
                    ": not found (every checkpoint folder needs config.json)");
  const std::string gen =
      fs::exists(d / "generation_config.json") ? model::read_text(d / "generation_config.json") : "";
  ModelConfig mc = parse(model::read_text(cfg), cfg.string(), gen);
  mc.dir = dir;
  return mc;
}

}  // namespace moekit

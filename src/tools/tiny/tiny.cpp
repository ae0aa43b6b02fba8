// Tiny random checkpoints: tensor names and shapes of each architecture, as transformers and published
// checkpoints store them, filled from a seeded generator.
#include "tiny/tiny.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "moekit/experts.h"
#include "moekit/quant.h"
#include "moekit/safetensors.h"

namespace moekit {
namespace fs = std::filesystem;

namespace {

using Shapes = std::vector<std::pair<std::string, Shape>>;

int64_t get_int(const nlohmann::json& c, const char* key) {
  MOEKIT_CHECK_CODE(c.contains(key) && c[key].is_number_integer(), invalid_argument, "tiny: config needs an integer '",
                    key, "'");
  return c[key].get<int64_t>();
}

int64_t get_int_or(const nlohmann::json& c, const char* key, int64_t fallback) {
  return c.contains(key) && c[key].is_number_integer() ? c[key].get<int64_t>() : fallback;
}

bool get_bool_or(const nlohmann::json& c, const char* key, bool fallback) {
  return c.contains(key) && c[key].is_boolean() ? c[key].get<bool>() : fallback;
}

int64_t num_experts(const nlohmann::json& c) {
  for (const char* k : {"num_experts", "num_local_experts", "n_routed_experts"})
    if (c.contains(k) && c[k].is_number_integer()) return c[k].get<int64_t>();
  MOEKIT_FAIL(invalid_argument, "tiny: config has no num_experts / num_local_experts / n_routed_experts");
}

// Qwen-style sparse layer choice: mlp_only_layers, then decoder_sparse_step.
bool qwen_sparse_layer(const nlohmann::json& c, int64_t layer) {
  if (c.contains("mlp_only_layers"))
    for (const auto& l : c["mlp_only_layers"])
      if (l.is_number_integer() && l.get<int64_t>() == layer) return false;
  const int64_t step = get_int_or(c, "decoder_sparse_step", 1);
  return num_experts(c) > 0 && step > 0 && (layer + 1) % step == 0;
}

void add_gated_mlp(Shapes& t, const std::string& p, int64_t h, int64_t i) {
  t.push_back({p + "gate_proj.weight", {i, h}});
  t.push_back({p + "up_proj.weight", {i, h}});
  t.push_back({p + "down_proj.weight", {h, i}});
}

void add_per_expert(Shapes& t, const std::string& p, int64_t e, int64_t h, int64_t i, bool mixtral_names) {
  for (int64_t x = 0; x < e; ++x) {
    const std::string q = p + std::to_string(x) + ".";
    if (mixtral_names) {
      t.push_back({q + "w1.weight", {i, h}});  // gate
      t.push_back({q + "w2.weight", {h, i}});  // down
      t.push_back({q + "w3.weight", {i, h}});  // up
    } else {
      add_gated_mlp(t, q, h, i);
    }
  }
}

// Standard multi-head attention with grouped KV heads.
void add_attention(Shapes& t, const std::string& p, const nlohmann::json& c, const std::string& type) {
  const int64_t h = get_int(c, "hidden_size"), nh = get_int(c, "num_attention_heads");
  const int64_t nkv = get_int_or(c, "num_key_value_heads", nh), hd = get_int_or(c, "head_dim", h / nh);
  const bool bias_o = get_bool_or(c, "attention_bias", false);
  const bool bias_qkv = bias_o || get_bool_or(c, "qkv_bias", false);
  t.push_back({p + "q_proj.weight", {nh * hd, h}});
  t.push_back({p + "k_proj.weight", {nkv * hd, h}});
  t.push_back({p + "v_proj.weight", {nkv * hd, h}});
  t.push_back({p + "o_proj.weight", {h, nh * hd}});
  if (bias_qkv) {
    t.push_back({p + "q_proj.bias", {nh * hd}});
    t.push_back({p + "k_proj.bias", {nkv * hd}});
    t.push_back({p + "v_proj.bias", {nkv * hd}});
  }
  if (bias_o) t.push_back({p + "o_proj.bias", {h}});
  if (type == "qwen3_moe" || type == "qwen3_vl_moe_text") {
    t.push_back({p + "q_norm.weight", {hd}});
    t.push_back({p + "k_norm.weight", {hd}});
  }
  if (type == "olmoe") {  // OLMoE normalises the whole projection, not each head
    t.push_back({p + "q_norm.weight", {nh * hd}});
    t.push_back({p + "k_norm.weight", {nkv * hd}});
  }
  if (type == "gpt_oss") t.push_back({p + "sinks", {nh}});
}

// DeepSeek-V3 multi-head latent attention.
void add_mla(Shapes& t, const std::string& p, const nlohmann::json& c) {
  const int64_t h = get_int(c, "hidden_size"), nh = get_int(c, "num_attention_heads");
  const int64_t nope = get_int(c, "qk_nope_head_dim"), rope = get_int(c, "qk_rope_head_dim");
  const int64_t vd = get_int(c, "v_head_dim"), kv_lora = get_int(c, "kv_lora_rank");
  const int64_t q_lora = get_int_or(c, "q_lora_rank", 0);
  if (q_lora > 0) {
    t.push_back({p + "q_a_proj.weight", {q_lora, h}});
    t.push_back({p + "q_a_layernorm.weight", {q_lora}});
    t.push_back({p + "q_b_proj.weight", {nh * (nope + rope), q_lora}});
  } else {
    t.push_back({p + "q_proj.weight", {nh * (nope + rope), h}});
  }
  t.push_back({p + "kv_a_proj_with_mqa.weight", {kv_lora + rope, h}});
  t.push_back({p + "kv_a_layernorm.weight", {kv_lora}});
  t.push_back({p + "kv_b_proj.weight", {nh * (nope + vd), kv_lora}});
  t.push_back({p + "o_proj.weight", {h, nh * vd}});
}

void add_decoder_mlp(Shapes& t, const std::string& p, const nlohmann::json& c, const std::string& type, int64_t l) {
  const int64_t h = get_int(c, "hidden_size");
  if (type == "mixtral") {
    const int64_t e = num_experts(c), i = get_int(c, "intermediate_size");
    t.push_back({p + "block_sparse_moe.gate.weight", {e, h}});
    add_per_expert(t, p + "block_sparse_moe.experts.", e, h, i, true);
  } else if (type == "olmoe") {
    const int64_t e = num_experts(c), i = get_int(c, "intermediate_size");
    t.push_back({p + "mlp.gate.weight", {e, h}});
    add_per_expert(t, p + "mlp.experts.", e, h, i, false);
  } else if (type == "gpt_oss") {
    const int64_t e = num_experts(c), i = get_int(c, "intermediate_size");
    t.push_back({p + "mlp.router.weight", {e, h}});
    t.push_back({p + "mlp.router.bias", {e}});
    t.push_back({p + "mlp.experts.gate_up_proj", {e, h, 2 * i}});  // [in, out], gate/up interleaved
    t.push_back({p + "mlp.experts.gate_up_proj_bias", {e, 2 * i}});
    t.push_back({p + "mlp.experts.down_proj", {e, i, h}});
    t.push_back({p + "mlp.experts.down_proj_bias", {e, h}});
  } else if (type == "deepseek_v3") {
    if (l < get_int_or(c, "first_k_dense_replace", 0)) {
      add_gated_mlp(t, p + "mlp.", h, get_int(c, "intermediate_size"));
      return;
    }
    const int64_t e = num_experts(c), i = get_int(c, "moe_intermediate_size");
    t.push_back({p + "mlp.gate.weight", {e, h}});
    t.push_back({p + "mlp.gate.e_score_correction_bias", {e}});
    add_per_expert(t, p + "mlp.experts.", e, h, i, false);
    const int64_t shared = get_int_or(c, "n_shared_experts", 0);
    if (shared > 0) add_gated_mlp(t, p + "mlp.shared_experts.", h, i * shared);
  } else if (type == "qwen2_moe" || type == "qwen3_moe" || type == "qwen3_vl_moe_text") {
    if (!qwen_sparse_layer(c, l)) {
      add_gated_mlp(t, p + "mlp.", h, get_int(c, "intermediate_size"));
      return;
    }
    const int64_t e = num_experts(c), i = get_int(c, "moe_intermediate_size");
    t.push_back({p + "mlp.gate.weight", {e, h}});
    if (type == "qwen3_vl_moe_text") {  // fused, [in, out] as in the published Qwen3-VL-MoE checkpoints
      t.push_back({p + "mlp.experts.gate_up_proj", {e, h, 2 * i}});
      t.push_back({p + "mlp.experts.down_proj", {e, i, h}});
    } else {
      add_per_expert(t, p + "mlp.experts.", e, h, i, false);
    }
    if (type == "qwen2_moe") {
      const int64_t si = get_int(c, "shared_expert_intermediate_size");
      add_gated_mlp(t, p + "mlp.shared_expert.", h, si);
      t.push_back({p + "mlp.shared_expert_gate.weight", {1, h}});
    }
  } else {
    MOEKIT_FAIL(not_supported, "tiny: no tensor layout for model_type '", type, "'");
  }
}

// The decoder stack under `prefix` ("model." or "model.language_model.").
void add_decoder(Shapes& t, const std::string& prefix, const nlohmann::json& c, const std::string& type) {
  const int64_t h = get_int(c, "hidden_size"), v = get_int(c, "vocab_size"), layers = get_int(c, "num_hidden_layers");
  t.push_back({prefix + "embed_tokens.weight", {v, h}});
  t.push_back({prefix + "norm.weight", {h}});
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = prefix + "layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {h}});
    t.push_back({p + "post_attention_layernorm.weight", {h}});
    if (type == "deepseek_v3")
      add_mla(t, p + "self_attn.", c);
    else
      add_attention(t, p + "self_attn.", c, type);
    add_decoder_mlp(t, p, c, type, l);
  }
}

// The Qwen3-VL vision tower (patch embedding, blocks, merger, deepstack mergers).
void add_qwen3_vl_vision(Shapes& t, const std::string& p, const nlohmann::json& c) {
  const int64_t vh = get_int(c, "hidden_size"), vi = get_int(c, "intermediate_size"), depth = get_int(c, "depth");
  const int64_t ps = get_int(c, "patch_size"), tps = get_int(c, "temporal_patch_size");
  const int64_t in = get_int_or(c, "in_channels", 3), m = get_int(c, "spatial_merge_size");
  const int64_t out = get_int(c, "out_hidden_size"), merged = vh * m * m;
  auto linear = [&](const std::string& n, int64_t o, int64_t i) {
    t.push_back({n + ".weight", {o, i}});
    t.push_back({n + ".bias", {o}});
  };
  auto norm = [&](const std::string& n, int64_t d) {
    t.push_back({n + ".weight", {d}});
    t.push_back({n + ".bias", {d}});
  };
  t.push_back({p + "patch_embed.proj.weight", {vh, in, tps, ps, ps}});
  t.push_back({p + "patch_embed.proj.bias", {vh}});
  t.push_back({p + "pos_embed.weight", {get_int(c, "num_position_embeddings"), vh}});
  for (int64_t b = 0; b < depth; ++b) {
    const std::string q = p + "blocks." + std::to_string(b) + ".";
    norm(q + "norm1", vh);
    norm(q + "norm2", vh);
    linear(q + "attn.qkv", 3 * vh, vh);
    linear(q + "attn.proj", vh, vh);
    linear(q + "mlp.linear_fc1", vi, vh);
    linear(q + "mlp.linear_fc2", vh, vi);
  }
  norm(p + "merger.norm", vh);  // before the spatial merge
  linear(p + "merger.linear_fc1", merged, merged);
  linear(p + "merger.linear_fc2", out, merged);
  const size_t n_deepstack = c.contains("deepstack_visual_indexes") ? c["deepstack_visual_indexes"].size() : 0;
  for (size_t j = 0; j < n_deepstack; ++j) {
    const std::string q = p + "deepstack_merger_list." + std::to_string(j) + ".";
    norm(q + "norm", merged);  // after the spatial merge
    linear(q + "linear_fc1", merged, merged);
    linear(q + "linear_fc2", out, merged);
  }
}

// ---- deterministic values: a pure function of (seed, name, index), the same on every platform ----

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

enum class Init { weight, norm, bias };

Init init_of(const std::string& name) {
  const auto dot = name.rfind('.');
  const std::string last = name.substr(dot + 1);
  const std::string module = dot == std::string::npos ? "" : name.substr(0, dot);
  const std::string owner = module.substr(module.rfind('.') + 1);
  if (last == "bias" || (last.size() > 5 && last.compare(last.size() - 5, 5, "_bias") == 0)) return Init::bias;
  if (last == "weight" && owner.find("norm") != std::string::npos) return Init::norm;
  return Init::weight;
}

// Irwin-Hall sum of 12 uniforms: normal-ish with unit variance, bounded tails, exact arithmetic only
// (no libm), so the bytes are identical on every machine.
Tensor random_tensor(const std::string& name, const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32);
  uint64_t state = seed * 0x2545f4914f6cdd1dull ^ fnv1a64(name);
  const Init init = init_of(name);
  const double std = init == Init::weight ? 0.15 : 0.1, mean = init == Init::norm ? 1.0 : 0.0;
  float* p = t.ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    double s = 0;
    for (int k = 0; k < 12; ++k) s += double(splitmix64(state) >> 11) * (1.0 / 9007199254740992.0);
    p[i] = float(mean + std * (s - 6.0));
  }
  return t;
}

const char* torch_dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    default: MOEKIT_FAIL(invalid_argument, "tiny: dtype must be f32, bf16 or f16, got ", dtype_name(t));
  }
}

void write_json(const fs::path& p, const nlohmann::json& j) {
  std::ofstream out(p);
  MOEKIT_CHECK_CODE(out.good(), io, p.string(), ": cannot open for writing");
  out << j.dump(2) << "\n";
  MOEKIT_CHECK_CODE(out.good(), io, p.string(), ": write failed");
}

std::string shard_name(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i, n);
  return buf;
}

}  // namespace

std::vector<std::pair<std::string, Shape>> tiny_tensor_shapes(const nlohmann::json& config) {
  MOEKIT_CHECK(config.is_object() && config.contains("model_type") && config["model_type"].is_string(),
               "tiny: config needs a model_type");
  const std::string type = config["model_type"];
  Shapes t;
  if (type == "qwen3_vl_moe") {
    MOEKIT_CHECK(config.contains("text_config") && config.contains("vision_config"),
                 "tiny: qwen3_vl_moe config needs text_config and vision_config");
    const auto& text = config["text_config"];
    add_decoder(t, "model.language_model.", text, "qwen3_vl_moe_text");
    add_qwen3_vl_vision(t, "model.visual.", config["vision_config"]);
    if (!get_bool_or(config, "tie_word_embeddings", false))
      t.push_back({"lm_head.weight", {get_int(text, "vocab_size"), get_int(text, "hidden_size")}});
  } else {
    add_decoder(t, "model.", config, type);
    if (!get_bool_or(config, "tie_word_embeddings", false))
      t.push_back({"lm_head.weight", {get_int(config, "vocab_size"), get_int(config, "hidden_size")}});
  }
  std::sort(t.begin(), t.end());
  for (size_t i = 1; i < t.size(); ++i) MOEKIT_ASSERT(t[i].first != t[i - 1].first);
  return t;
}

void write_tiny_checkpoint(const std::string& arch, const std::string& dir, uint64_t seed) {
  TinyOptions o;
  o.seed = seed;
  write_tiny_checkpoint(arch, dir, o);
}

bool fp8_quantized_tensor(const std::string& name, const Shape& shape) {
  auto ends = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (shape.size() != 2 || !ends(".weight")) return false;
  for (const char* skip : {"embed_tokens", "lm_head", "visual.", "vision"})
    if (name.find(skip) != std::string::npos) return false;
  return !ends(".gate.weight") && !ends("shared_expert_gate.weight") && !ends(".router.weight");
}

nlohmann::json fp8_quantization_config() {
  return {{"quant_method", "fp8"},
          {"fmt", "e4m3"},
          {"activation_scheme", "dynamic"},
          {"weight_block_size", {kFp8Block, kFp8Block}}};
}

namespace {
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
}  // namespace

void quantize_tensors(std::vector<std::pair<std::string, Tensor>>& tensors, nlohmann::json& config,
                      const std::string& format) {
  MOEKIT_CHECK(format == "fp8" || format == "fp4" || format == "mxfp4", "quantize: the format is fp8, fp4 or mxfp4, got '",
               format, "'");
  MOEKIT_CHECK(!config.contains("quantization_config"), "quantize: the checkpoint is already quantized (",
               config["quantization_config"].dump(), ")");
  nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;
  std::vector<std::pair<std::string, Tensor>> out;
  bool any_experts = false;
  for (auto& [name, t] : tensors) {
    const bool fused = ends_with(name, "experts.gate_up_proj") || ends_with(name, "experts.down_proj");
    if (format == "mxfp4") {
      if (!fused) {
        out.push_back({name, t});
        continue;
      }
      MOEKIT_CHECK(t.dim() == 3, "quantize mxfp4: ", name, " is ", shape_to_string(t.shape()), ", expected [E, in, out]");
      // gpt-oss stores [E, in, out]; MXFP4 blocks are [E, out, in / 32, 16].
      auto [q, sc] = quantize_fp4(transpose_expert_weight(t.to(DType::f32)));
      const int64_t E = q.size(0), N = q.size(1), K = q.size(2);
      Tensor blocks = Tensor::empty({E, N, K / 32, 16}, DType::u8), scales = Tensor::empty({E, N, K / 32}, DType::u8);
      std::memcpy(blocks.data(), q.data(), q.nbytes());
      std::memcpy(scales.data(), sc.data(), sc.nbytes());
      out.push_back({name + "_blocks", blocks});
      out.push_back({name + "_scales", scales});
      any_experts = true;
      continue;
    }
    MOEKIT_CHECK(!fused, "quantize ", format, ": ", name, " holds fused experts; ", format,
                 " checkpoints store per-expert weights (mxfp4 is the format of gpt-oss's fused experts)");
    if (!fp8_quantized_tensor(name, t.shape())) {
      out.push_back({name, t});
      continue;
    }
    const std::string sn = name.substr(0, name.size() - 7) + ".weight_scale_inv";
    if (format == "fp4" && name.find(".experts.") != std::string::npos) {
      auto [q, sc] = quantize_fp4(t);
      Tensor packed = Tensor::empty({q.size(0), q.size(1) / 2}, DType::i8);
      std::memcpy(packed.data(), q.data(), q.nbytes());
      out.push_back({name, packed});
      out.push_back({sn, sc});
      any_experts = true;
      continue;
    }
    auto [q, sc] = quantize_fp8(t, format == "fp4" ? DType::ue8m0 : DType::f32);
    out.push_back({name, q});
    out.push_back({sn, sc});
    if (name.find(".experts.") != std::string::npos) any_experts = true;
  }
  MOEKIT_CHECK(any_experts, "quantize ", format, ": no routed experts found to quantize (",
               format == "mxfp4" ? "mxfp4 needs gpt-oss's fused experts.gate_up_proj / down_proj"
                                 : "expected per-expert experts.{e}.*.weight tensors", ")");
  tensors = std::move(out);
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  if (format == "mxfp4") {
    config["quantization_config"] = {
        {"quant_method", "mxfp4"},
        {"modules_to_not_convert", {"model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                    "lm_head"}}};
  } else {
    config["quantization_config"] = fp8_quantization_config();
    if (format == "fp4") {
      config["quantization_config"]["scale_fmt"] = "ue8m0";
      text["expert_dtype"] = "fp4";
    }
  }
}

int64_t quantize_checkpoint(const std::string& in, const std::string& out, const std::string& format) {
  const fs::path src(in), dst(out);
  MOEKIT_CHECK_CODE(fs::is_regular_file(src / "config.json"), not_found, in, ": no config.json");
  std::error_code ec;
  MOEKIT_CHECK(!fs::equivalent(src, dst, ec), "quantize: --out must be another folder than --in");
  nlohmann::json config = nlohmann::json::parse(std::ifstream(src / "config.json"));
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<SafetensorsFile> files;
  for (const auto& f : fs::directory_iterator(src))
    if (f.path().extension() == ".safetensors") files.push_back(SafetensorsFile::open(f.path().string()));
  MOEKIT_CHECK_CODE(!files.empty(), not_found, in, ": no *.safetensors file");
  for (const auto& f : files)
    for (const auto& name : f.names()) tensors.push_back({name, f.get(name)});
  quantize_tensors(tensors, config, format);
  fs::create_directories(dst, ec);
  MOEKIT_CHECK_CODE(fs::is_directory(dst), io, out, ": cannot create the folder (", ec.message(), ")");
  for (const auto& f : fs::directory_iterator(src)) {
    const std::string n = f.path().filename().string();
    if (f.path().extension() == ".safetensors" || n == "model.safetensors.index.json" || n == "config.json" ||
        !f.is_regular_file())
      continue;
    fs::copy_file(f.path(), dst / n, fs::copy_options::overwrite_existing);
  }
  for (const auto& f : fs::directory_iterator(dst))
    if (f.path().extension() == ".safetensors" || f.path().filename() == "model.safetensors.index.json")
      fs::remove(f.path());
  write_json(dst / "config.json", config);
  save_safetensors((dst / "model.safetensors").string(), tensors, {{"format", "pt"}});
  return int64_t(tensors.size());
}

void write_tiny_checkpoint(const std::string& arch, const std::string& dir, const TinyOptions& options) {
  nlohmann::json config = tiny_config(arch);
  const bool quantized = !options.quantize.empty();
  // gpt-oss's MXFP4 needs inputs in multiples of 32: intermediate 96 (2I != H still).
  if (options.quantize == "mxfp4" && arch == "gpt_oss") config["intermediate_size"] = 96;
  const char* dtype = torch_dtype_name(options.dtype);
  MOEKIT_CHECK(options.shards >= 1 && options.shards <= 99, "tiny: shards must be in [1, 99], got ", options.shards);
  config["dtype"] = dtype;
  for (const char* sub : {"text_config", "vision_config"})
    if (config.contains(sub) && config[sub].contains("dtype")) config[sub]["dtype"] = dtype;
  const auto shapes = tiny_tensor_shapes(config);

  std::vector<std::pair<std::string, Tensor>> tensors;
  uint64_t total_bytes = 0, total_params = 0;
  for (const auto& [name, shape] : shapes) {
    Tensor t = random_tensor(name, shape, options.seed);
    // DeepSeek-V3 keeps its router correction bias in float32 whatever the checkpoint dtype.
    if (name.find("e_score_correction_bias") == std::string::npos) t = t.to(options.dtype);
    tensors.push_back({name, std::move(t)});
  }
  if (quantized) quantize_tensors(tensors, config, options.quantize);
  for (const auto& [name, t] : tensors) {
    total_bytes += t.nbytes();
    total_params += uint64_t(t.numel());
  }
  const fs::path d(dir);
  std::error_code ec;
  fs::create_directories(d, ec);
  MOEKIT_CHECK_CODE(fs::is_directory(d), io, dir, ": cannot create the folder (", ec.message(), ")");
  // As save_pretrained: weight files of an earlier checkpoint in the folder would mix with these.
  for (const auto& f : fs::directory_iterator(d)) {
    const std::string n = f.path().filename().string();
    if (n == "model.safetensors" || n == "model.safetensors.index.json" ||
        (n.rfind("model-", 0) == 0 && n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0))
      fs::remove(f.path());
  }

  write_json(d / "config.json", config);
  nlohmann::json gen = {{"_from_model_config", true}, {"output_attentions", false}, {"output_hidden_states", false},
                        {"transformers_version", config.value("transformers_version", "5.17.0")},
                        {"use_cache", true}};
  for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (config.contains(k) && !config[k].is_null()) gen[k] = config[k];
  write_json(d / "generation_config.json", gen);
  const nlohmann::json& text_config = config.contains("text_config") ? config["text_config"] : config;
  write_json(d / "tokenizer.json", tiny_tokenizer(get_int(text_config, "vocab_size")));

  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (options.shards == 1) {
    save_safetensors((d / "model.safetensors").string(), tensors, meta);
    return;
  }
  // Contiguous runs of the sorted names, split by bytes.
  nlohmann::json weight_map = nlohmann::json::object();
  const int n = options.shards;
  size_t next = 0;
  uint64_t done = 0;
  for (int s = 1; s <= n; ++s) {
    std::vector<std::pair<std::string, Tensor>> part;
    const uint64_t target = total_bytes * uint64_t(s) / uint64_t(n);
    while (next < tensors.size() && (s == n || done < target || part.empty())) {
      done += tensors[next].second.nbytes();
      part.push_back(tensors[next++]);
    }
    const std::string file = shard_name(s, n);
    for (const auto& [name, t] : part) weight_map[name] = file;
    save_safetensors((d / file).string(), part, meta);
  }
  write_json(d / "model.safetensors.index.json",
             {{"metadata", {{"total_parameters", total_params}, {"total_size", total_bytes}}},
              {"weight_map", weight_map}});
}

}  // namespace moekit

#include "bench/presets.h"

#include <charconv>

#include <fmt/core.h>

namespace moekit::bench {

ExpertsSpec ShapePreset::spec() const {
  ExpertsSpec s;
  s.num_experts = num_experts;
  s.hidden = hidden;
  s.intermediate = intermediate;
  s.activation = activation;
  s.has_bias = has_bias;
  s.is_transposed = is_transposed;
  s.is_concatenated = is_concatenated;
  s.gate = gate;
  return s;
}

std::string ShapePreset::to_string() const {
  std::string flags = gate == GateKind::clamped_swiglu ? "gated clamped_swiglu" : fmt::format("gated {}", activation_name(activation));
  if (has_bias) flags += ", bias";
  if (is_transposed) flags += ", transposed";
  if (!is_concatenated) flags += ", interleaved";
  return fmt::format("{} (H={} I={} E={} K={}, {})", name, hidden, intermediate, num_experts, top_k, flags);
}

const std::vector<ShapePreset>& shape_presets() {
  static const std::vector<ShapePreset> presets = {
      {.name = "qwen3-30b-a3b", .hidden = 2048, .intermediate = 768, .num_experts = 128, .top_k = 8},
      {.name = "qwen1.5-moe-a2.7b", .hidden = 2048, .intermediate = 1408, .num_experts = 60, .top_k = 4},
      {.name = "mixtral-8x7b", .hidden = 4096, .intermediate = 14336, .num_experts = 8, .top_k = 2},
      {.name = "gpt-oss-20b", .hidden = 2880, .intermediate = 2880, .num_experts = 32, .top_k = 4,
       .has_bias = true, .is_transposed = true, .is_concatenated = false, .gate = GateKind::clamped_swiglu},
      {.name = "deepseek-v3", .hidden = 7168, .intermediate = 2048, .num_experts = 256, .top_k = 8},
      {.name = "olmoe-1b-7b", .hidden = 2048, .intermediate = 1024, .num_experts = 64, .top_k = 8},
  };
  return presets;
}

ShapePreset find_shape_preset(std::string_view name) {
  std::string names;
  for (const auto& p : shape_presets()) {
    if (p.name == name) return p;
    names += (names.empty() ? "" : ", ") + p.name;
  }
  MOEKIT_FAIL(not_found, "unknown shape preset '", name, "'; expected one of: ", names, " (or --dims H,I,E,K)");
}

ShapePreset parse_dims(std::string_view dims) {
  static const char* kFields[4] = {"H (hidden)", "I (intermediate)", "E (experts)", "K (top-k)"};
  int64_t v[4] = {0, 0, 0, 0};
  size_t pos = 0;
  for (int f = 0; f < 4; ++f) {
    const size_t comma = f < 3 ? dims.find(',', pos) : dims.size();
    MOEKIT_CHECK(comma != std::string_view::npos, "--dims '", dims, "': expected 4 comma-separated integers H,I,E,K");
    const std::string_view part = dims.substr(pos, comma - pos);
    auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), v[f]);
    MOEKIT_CHECK(ec == std::errc() && end == part.data() + part.size() && !part.empty(), "--dims '", dims, "': ",
                 kFields[f], " = '", part, "' is not an integer");
    MOEKIT_CHECK(v[f] > 0, "--dims '", dims, "': ", kFields[f], " must be > 0, got ", v[f]);
    pos = comma + 1;
  }
  MOEKIT_CHECK(v[3] <= v[2], "--dims '", dims, "': top-k K = ", v[3], " exceeds the number of experts E = ", v[2]);
  ShapePreset p{.name = "dims", .hidden = v[0], .intermediate = v[1], .num_experts = v[2], .top_k = v[3]};
  p.name = fmt::format("dims-{}x{}x{}x{}", v[0], v[1], v[2], v[3]);
  return p;
}

}  // namespace moekit::bench

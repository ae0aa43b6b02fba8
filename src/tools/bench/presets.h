// Internal: experts shapes of real models for `moekit bench`.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/experts.h"

namespace moekit::bench {

// The routed experts of one model layer; `spec()` gives the ExpertsSpec it benchmarks.
struct ShapePreset {
  std::string name;           // "qwen3-30b-a3b", or "dims" for --dims H,I,E,K
  int64_t hidden = 0;         // H
  int64_t intermediate = 0;   // I
  int64_t num_experts = 0;    // E
  int64_t top_k = 0;          // K
  bool has_bias = false;
  bool is_transposed = false;
  bool is_concatenated = true;
  GateKind gate = GateKind::act_mul;
  Activation activation = Activation::silu;

  ExpertsSpec spec() const;
  std::string to_string() const;  // "qwen3-30b-a3b (H=2048 I=768 E=128 K=8, gated silu)"
};

const std::vector<ShapePreset>& shape_presets();
// Throws Error(not_found) listing the preset names.
ShapePreset find_shape_preset(std::string_view name);
// "H,I,E,K" with 1 <= K <= E; throws naming the bad field.
ShapePreset parse_dims(std::string_view dims);

}  // namespace moekit::bench

// Internal: choosing the next token from a row of logits (greedy, or temperature / top-k / top-p sampling
// in transformers' order), with a portable, seeded random source.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "moekit/model.h"

namespace moekit::generate {

class TokenSampler {
 public:
  explicit TokenSampler(const GenerationConfig& config);
  // logits: one row [vocab] (modified in place). suppress: token ids that must not be chosen (EOS before
  // min_new_tokens). history: the sequence so far (prompt and new tokens), for the repetition penalty.
  int64_t next(std::vector<float>& logits, const std::vector<int64_t>& suppress,
               const std::vector<int64_t>& history = {});

 private:
  double uniform();  // [0, 1), the same sequence on every platform for a seed
  GenerationConfig config_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;
  std::vector<bool> seen_;
};

}  // namespace moekit::generate

// Internal: a small backtracking regular-expression matcher over code points, for the pre-tokenizer
// patterns tokenizer.json files carry (GPT-2, cl100k / o200k, Qwen2, DeepSeek-V3 and the like).
// Syntax: literals and escapes (\r \n \t \f \v \xHH \x{H..} \uHHHH, escaped punctuation), `.`, classes
// [...] / [^...] with ranges, \p{..} / \P{..} (general categories: L Lu Ll Lt Lm Lo M Mn Mc Me N Nd Nl No
// P.. S.. Z.. C..), \s \S \d \D \w \W; groups (...) (?:...) (?i:...) and lookahead (?=...) (?!...);
// alternation; quantifiers ? * + {n} {n,} {n,m}, lazy (?) and possessive (+) forms; ^ and $. Semantics:
// leftmost-first, as Oniguruma (the `tokenizers` package's engine) and Perl.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace moekit::text {

class Regex {
 public:
  // Throws Error (invalid_argument) naming the pattern and the position of what it does not support.
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // The non-overlapping matches in `text` as [begin, end) code point offsets, left to right.
  std::vector<std::pair<size_t, size_t>> find_all(const std::vector<uint32_t>& text) const;

  struct Node;

 private:
  std::unique_ptr<Node> root_;
  std::string pattern_;
};

}  // namespace moekit::text

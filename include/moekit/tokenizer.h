// moekit: text in and out. Loads a Hugging Face `tokenizer.json` (the BPE models checkpoints ship:
// byte-level BPE as in Qwen2/Qwen3, DeepSeek-V3, OLMoE and gpt-oss; Metaspace / byte-fallback BPE as in
// Llama and Mixtral) and encodes and decodes as the `tokenizers` package does.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace moekit {

class Tokenizer {
 public:
  // Reads a tokenizer.json file; throws Error (io) naming the file and the offending field.
  static Tokenizer from_file(const std::string& path);
  // Reads DIR/tokenizer.json; throws Error (not_found) when the folder has none.
  static Tokenizer from_pretrained(const std::string& dir);
  // Parses tokenizer.json text; `source` names it in errors.
  static Tokenizer from_json(const std::string& json, const std::string& source = "tokenizer.json");

  Tokenizer();
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // UTF-8 text -> ids. add_special_tokens applies the post-processor's template (e.g. Llama's <s>).
  // Throws Error (invalid_argument) on invalid UTF-8, naming the byte offset.
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = true) const;
  // ids -> UTF-8 text (bytes that do not form UTF-8 become U+FFFD, as the `tokenizers` package does).
  // Throws Error (invalid_argument) naming an id outside the vocabulary.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  // Vocabulary size including added tokens (one past the largest id).
  int64_t vocab_size() const;
  std::optional<int64_t> token_to_id(const std::string& token) const;
  // Whether id names a token (a model's vocab_size is often larger than its tokenizer's).
  bool contains(int64_t id) const;
  // Throws Error (invalid_argument) for an unknown id.
  std::string id_to_token(int64_t id) const;

 private:
  static Tokenizer parse_tokenizer(const std::string& json, const std::string& source);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit

// The tokenizer.json written beside a tiny checkpoint: byte-level BPE (GPT-2's pre-tokenizer and decoder)
// over the printable ASCII bytes and the newline, with merges learnt from a short built-in text so that the
// vocabulary fills the model's vocab_size exactly, and <|endoftext|> as the last id.
#include <algorithm>
#include <cctype>
#include <map>
#include <string>
#include <vector>

#include "moekit/error.h"
#include "tiny/tiny.h"

namespace moekit {
namespace {

const char* kText =
    "The experts of a mixture of experts model are small feed forward networks. For each token the router "
    "picks the top k experts, runs the token through them and adds their outputs with the router weights. "
    "The model is large, but each token only reads the weights of the experts it is routed to, so the "
    "tokens per second depend on how fast those weights stream from memory. The backends run the same "
    "computation in different ways: one loop per expert, one batched matrix product, or one grouped kernel "
    "over the tokens sorted by expert. The test compares every backend with the reference in double "
    "precision, and the demo generates text with each of them on the same tiny model.\n";

// GPT-2's byte -> character map, for the bytes the tiny vocabulary holds (all below 0x7F).
std::string byte_char(unsigned char b) {
  if (b > ' ' && b < 0x7F) return std::string(1, char(b));
  const uint32_t cp = b == ' ' ? 0x120 : b == '\n' ? 0x10A : 0;  // Ġ, Ċ
  MOEKIT_CHECK(cp != 0, "tiny tokenizer: byte ", int(b), " has no token");
  return std::string{char(0xC0 | (cp >> 6)), char(0x80 | (cp & 0x3F))};
}

}  // namespace

nlohmann::json tiny_tokenizer(int64_t vocab_size) {
  std::vector<std::string> vocab;
  vocab.push_back(byte_char('\n'));
  for (int b = ' '; b < 0x7F; ++b) vocab.push_back(byte_char(static_cast<unsigned char>(b)));
  MOEKIT_CHECK(vocab_size > int64_t(vocab.size()), "tiny tokenizer: vocab_size ", vocab_size, " is below the ",
               vocab.size() + 1, " ids of the bytes and <|endoftext|>");

  // Words as GPT-2's pre-tokenizer cuts this text: a space joins the word after it.
  std::vector<std::vector<std::string>> words;
  std::string t = kText;
  for (size_t i = 0; i < t.size();) {
    size_t j = i + 1;
    auto alnum = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; };
    if (t[i] == ' ' && j < t.size() && alnum(t[j])) ++j;
    if (alnum(t[j - 1]))
      while (j < t.size() && alnum(t[j])) ++j;
    std::vector<std::string> w;
    for (size_t k = i; k < j; ++k) w.push_back(byte_char(static_cast<unsigned char>(t[k])));
    words.push_back(std::move(w));
    i = j;
  }
  // BPE training: merge the most frequent adjacent pair (ties: the smaller pair) until the vocabulary is full.
  nlohmann::json merges = nlohmann::json::array();
  while (int64_t(vocab.size()) + 1 < vocab_size) {
    std::map<std::pair<std::string, std::string>, int> counts;
    for (const auto& w : words)
      for (size_t k = 0; k + 1 < w.size(); ++k) ++counts[{w[k], w[k + 1]}];
    auto best = counts.end();
    for (auto it = counts.begin(); it != counts.end(); ++it)
      if (std::find(vocab.begin(), vocab.end(), it->first.first + it->first.second) == vocab.end() &&
          (best == counts.end() || it->second > best->second))
        best = it;
    if (best == counts.end() || best->second < 2) break;
    const auto [a, b] = best->first;
    merges.push_back(a + " " + b);
    vocab.push_back(a + b);
    for (auto& w : words)
      for (size_t k = 0; k + 1 < w.size(); ++k)
        if (w[k] == a && w[k + 1] == b) {
          w[k] += b;
          w.erase(w.begin() + long(k) + 1);
        }
  }
  nlohmann::json added = nlohmann::json::array();
  auto add_special = [&](const std::string& content) {
    added.push_back({{"id", vocab.size()}, {"content", content}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
    vocab.push_back(content);
  };
  while (int64_t(vocab.size()) + 1 < vocab_size) add_special("<|reserved_" + std::to_string(vocab.size()) + "|>");
  add_special("<|endoftext|>");
  nlohmann::json v = nlohmann::json::object();
  for (size_t i = 0; i < vocab.size(); ++i)
    if (i + added.size() < vocab.size()) v[vocab[i]] = i;
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
          {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                     {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
                     {"ignore_merges", false}, {"vocab", v}, {"merges", merges}}}};
}

}  // namespace moekit

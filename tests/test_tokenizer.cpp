// Tokenizer: encodings and decodings equal to the `tokenizers` package's on committed fixtures
// (scripts/make_tokenizer_fixtures.py), the regex matcher and NFC, and errors on bad input.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "moekit/error.h"
#include "moekit/tokenizer.h"
#include "test_util.h"
#include "text/regex.h"
#include "text/unicode.h"
#include "tiny/tiny.h"

using namespace moekit;
using nlohmann::json;

namespace {

std::string tok_dir() { return moekit::test::fixtures_dir() + "/tokenizers"; }

json read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return json::parse(f);
}

const char* kFamilies[] = {"qwen2", "gpt2", "deepseek_v3", "gpt_oss", "llama", "metaspace"};

std::string ids_str(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

}  // namespace

class TokenizerFamily : public ::testing::TestWithParam<const char*> {};

TEST_P(TokenizerFamily, EncodesAndDecodesAsTheTokenizersPackage) {
  const std::string name = GetParam();
  const json cases = read_json(tok_dir() + "/" + name + ".cases.json");
  const Tokenizer tok = Tokenizer::from_file(tok_dir() + "/" + cases["tokenizer"].get<std::string>());
  EXPECT_EQ(tok.vocab_size(), cases["vocab_size"].get<int64_t>());
  for (const json& c : cases["cases"]) {
    const std::string text = c["text"];
    SCOPED_TRACE(name + ": " + json(text).dump());
    const auto ids = c["ids"].get<std::vector<int64_t>>();
    EXPECT_EQ(ids_str(tok.encode(text)), ids_str(ids));
    EXPECT_EQ(ids_str(tok.encode(text, false)), ids_str(c["ids_no_special"].get<std::vector<int64_t>>()));
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>());
    EXPECT_EQ(tok.decode(ids, true), c["decoded_skip_special"].get<std::string>());
  }
  for (const json& c : cases["decodes"]) {
    const auto ids = c["ids"].get<std::vector<int64_t>>();
    SCOPED_TRACE(name + ": decode " + ids_str(ids));
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>());
    EXPECT_EQ(tok.decode(ids, true), c["decoded_skip_special"].get<std::string>());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TokenizerFamily, ::testing::ValuesIn(kFamilies));

// With the `tokenizers` package installed, random strings (skipped otherwise).
TEST(Tokenizer, RandomStringsMatchTheTokenizersPackage) {
  if (std::system("python3 -c 'import tokenizers' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "the tokenizers Python package is not installed";
  const std::vector<std::string> alphabet = {"a", "b", "Z", " ", " ", "  ", "\n", "\t", "\r\n", "1", "23", "'s",
                                             "'LL", ".", "!?", "é", "e\xCC\x81", "\xE4\xB8\xAD", "\xE3\x81\x82",
                                             "\xF0\x9F\x98\x80", "\xE2\x96\x81", "<|im_start|>", "<s>", "</s>",
                                             "\xC2\xA0", "_", "/", "x{", "\xD9\xA3"};
  std::mt19937 rng(1234);
  json strings = json::array();
  for (int i = 0; i < 200; ++i) {
    std::string s;
    const int n = int(rng() % 16);
    for (int k = 0; k < n; ++k) s += alphabet[rng() % alphabet.size()];
    strings.push_back(s);
  }
  const std::string tmp = ::testing::TempDir() + "moekit_tokenizer_live";
  std::filesystem::create_directories(tmp);
  {
    std::ofstream(tmp + "/strings.json") << strings.dump();
  }
  {
    std::ofstream(tmp + "/tiny.tokenizer.json") << tiny_tokenizer(160).dump();
  }
  std::vector<std::string> files;
  for (const char* fam : kFamilies) files.push_back(tok_dir() + "/" + fam + ".tokenizer.json");
  files.push_back(tmp + "/tiny.tokenizer.json");
  for (const std::string& file : files) {
    const std::string fam = file;
    const std::string cmd = "python3 -c \"import json,sys; from tokenizers import Tokenizer; t=Tokenizer.from_file(sys.argv[1]); "
                            "s=json.load(open(sys.argv[2])); json.dump([t.encode(x).ids for x in s], open(sys.argv[3],'w'))\" '" +
                            file + "' '" + tmp + "/strings.json' '" + tmp + "/ids.json'";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const json want = read_json(tmp + "/ids.json");
    const Tokenizer tok = Tokenizer::from_file(file);
    for (size_t i = 0; i < strings.size(); ++i) {
      const auto ids = want[i].get<std::vector<int64_t>>();
      EXPECT_EQ(ids_str(tok.encode(strings[i].get<std::string>())), ids_str(ids))
          << fam << ": " << strings[i].dump();
    }
  }
}

// The tiny checkpoints' tokenizer (string merges "a b"), with the ids the tokenizers package gives.
TEST(Tokenizer, TinyCheckpointTokenizer) {
  const Tokenizer tok = Tokenizer::from_json(tiny_tokenizer(160).dump(), "tiny");
  EXPECT_EQ(tok.vocab_size(), 160);
  EXPECT_EQ(ids_str(tok.encode("The experts of a model, h\xC3\xA9llo 123\n")),
            "123,128,129,119,147,13,1,73,77,77,80,1,18,19,20,0");  // bytes outside the vocabulary are dropped
  EXPECT_EQ(tok.decode({123, 128, 159}), "The experts<|endoftext|>");
  EXPECT_EQ(tok.decode({123, 128, 159}, true), "The experts");
  EXPECT_THROW(tiny_tokenizer(90), Error);
}

TEST(Tokenizer, BadInputGivesClearErrors) {
  const Tokenizer tok = Tokenizer::from_file(tok_dir() + "/qwen2.tokenizer.json");
  try {
    tok.decode({5, 99999});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("99999"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tok.decode({-1}), Error);
  EXPECT_THROW(tok.id_to_token(700), Error);
  try {
    tok.encode("ok \xC3\x28 bad");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("offset 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tok.encode("\xED\xA0\x80"), Error);  // a surrogate
  EXPECT_THROW(tok.encode("\xC0\x80"), Error);      // overlong

  auto fails_with = [](const std::string& text, const std::string& needle) {
    try {
      Tokenizer::from_json(text, "bad.json");
      ADD_FAILURE() << "expected an error for " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fails_with("{", "bad.json");
  fails_with("[]", "JSON object");
  fails_with(R"({"model": {"type": "WordPiece", "vocab": {}}})", "WordPiece");
  fails_with(R"({"model": {"type": "BPE", "vocab": {"a": "x"}}})", "model.vocab[\"a\"]");
  fails_with(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})", "\"b\"");
  fails_with(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "Foo"}})", "Foo");
  fails_with(R"({"model": {"type": "BPE", "vocab": {"a": 0}},
                 "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(?<=a)b"}, "behavior": "Isolated"}})",
             "pre_tokenizer.pattern");
  fails_with(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "normalizer": {"type": "NFKD"}})", "NFKD");
  fails_with(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [{"content": "x"}]})",
             "added_tokens[0]");
  fails_with(R"({"model": {"type": "BPE", "vocab": {"a": 2000000000}}})", "out of range");
  // Truncated and corrupted files: an Error, never a crash.
  std::ifstream f(tok_dir() + "/llama.tokenizer.json");
  const std::string good((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  for (size_t cut = 1; cut < good.size(); cut += good.size() / 23)
    EXPECT_THROW(Tokenizer::from_json(good.substr(0, cut)), Error) << cut;
  std::mt19937 rng(7);
  for (int k = 0; k < 40; ++k) {
    std::string bad = good;
    for (int m = 0; m < 3; ++m) bad[rng() % bad.size()] = "\"{}[],:0x\xC3"[rng() % 10];
    try {
      const Tokenizer t = Tokenizer::from_json(bad);
      t.decode(t.encode("Hello <s> world \xF0\x9F\x98\x80 123"));
    } catch (const Error&) {
    }
  }
  try {
    Tokenizer::from_pretrained(::testing::TempDir());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_found);
    EXPECT_NE(std::string(e.what()).find("tokenizer.json"), std::string::npos) << e.what();
  }
}

TEST(TokenizerRegex, LeftmostFirstAlternativesAndLookahead) {
  using text::Regex;
  auto split = [](const std::string& pattern, const std::string& s) {
    const auto cps = text::utf8_decode(s);
    std::vector<std::string> out;
    for (auto [lo, hi] : Regex(pattern).find_all(cps))
      out.push_back(text::utf8_encode(std::vector<uint32_t>(cps.begin() + long(lo), cps.begin() + long(hi))));
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(split(R"(\s+(?!\S)|\s+)", "a   b"), (V{"  ", " "}));
  EXPECT_EQ(split(R"(\p{N}{1,3})", "12345x6"), (V{"123", "45", "6"}));
  EXPECT_EQ(split(R"((?i:'s|'t)|\p{L}+)", "IT'S it'T"), (V{"IT", "'S", "it", "'T"}));
  EXPECT_EQ(split(R"([^\r\n\p{L}\p{N}]?\p{L}+)", " héllo\nwörld"), (V{" héllo", "wörld"}));
  EXPECT_EQ(split(R"([一-龥]+|a{2,})", "中文aaab"), (V{"中文", "aaa"}));
  EXPECT_EQ(split(R"(x*?y|x++)", "xxy xx"), (V{"xxy", "xx"}));
  EXPECT_EQ(split(R"([\-\]\\]+)", "a-]\\b"), (V{"-]\\"}));
  EXPECT_THROW(Regex("(a"), Error);
  EXPECT_THROW(Regex("\\p{Foo}"), Error);
  EXPECT_THROW(Regex("a{3,2}"), Error);
}

TEST(TokenizerUnicode, NfcComposesAndReorders) {
  auto nfc = [](const std::string& s) { return text::utf8_encode(text::nfc(text::utf8_decode(s))); };
  EXPECT_EQ(nfc("e\xCC\x81"), "\xC3\xA9");                          // e + acute -> é
  EXPECT_EQ(nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // Hangul jamo -> 각
  EXPECT_EQ(nfc("\xE2\x84\xAB"), "\xC3\x85");                        // ANGSTROM SIGN -> Å
  EXPECT_EQ(nfc("a\xCC\xA3\xCC\x81"), nfc("a\xCC\x81\xCC\xA3"));     // canonical order
  EXPECT_EQ(text::utf8_lossy("a\xF0\x9F\x98"), "a\xEF\xBF\xBD");
  EXPECT_EQ(text::utf8_lossy("\xFF\xC3\xA9"), "\xEF\xBF\xBD\xC3\xA9");
}

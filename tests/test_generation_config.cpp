// generation_config.json defaults (GenerationConfig::from_pretrained and `moekit run`), the repetition
// penalty, and text in and out of `moekit run` / `moekit tokenize` on a tiny checkpoint with its tokenizer.json.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "generate/sampling.h"
#include "moekit/error.h"
#include "moekit/model.h"
#include "moekit/tokenizer.h"
#include "test_util.h"
#include "tiny/tiny.h"

using namespace moekit;
using moekit::test::CliResult;
using moekit::test::run_cli;
namespace fs = std::filesystem;

namespace {

// A tiny qwen3_moe checkpoint (with tokenizer.json) in a fresh folder.
std::string tiny_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("moekit_genconf_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  write_tiny_checkpoint("qwen3_moe", d.string(), 0);
  return d.string();
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

}  // namespace

TEST(GenerationConfig, FromPretrainedReadsTheFileOverTheDefaults) {
  const std::string dir = tiny_dir("read");
  GenerationConfig def = GenerationConfig::from_pretrained(dir);
  EXPECT_FALSE(def.do_sample);
  EXPECT_EQ(def.top_k, 50);
  EXPECT_EQ(def.repetition_penalty, 1.0f);
  write_file(dir + "/generation_config.json",
             R"({"do_sample": true, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.3,
                 "eos_token_id": [3, 4], "max_new_tokens": 7, "transformers_version": "5.17.0"})");
  const GenerationConfig gc = GenerationConfig::from_pretrained(dir);
  EXPECT_TRUE(gc.do_sample);
  EXPECT_FLOAT_EQ(gc.temperature, 0.7f);
  EXPECT_EQ(gc.top_k, 5);
  EXPECT_FLOAT_EQ(gc.top_p, 0.9f);
  EXPECT_FLOAT_EQ(gc.repetition_penalty, 1.3f);
  EXPECT_EQ(gc.max_new_tokens, 7);
  ASSERT_TRUE(gc.eos_token_ids.has_value());
  EXPECT_EQ(*gc.eos_token_ids, (std::vector<int64_t>{3, 4}));
  write_file(dir + "/generation_config.json", R"({"top_k": "five"})");
  try {
    GenerationConfig::from_pretrained(dir);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("top_k"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(GenerationConfig::from_pretrained(fs::temp_directory_path().string() + "/no_such_dir").do_sample);
  fs::remove_all(dir);
}

TEST(GenerationConfig, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  GenerationConfig gc;
  gc.repetition_penalty = 2.0f;
  generate::TokenSampler s(gc);
  std::vector<float> a = {3.0f, -2.0f, 2.0f};
  EXPECT_EQ(s.next(a, {}, {0, 0}), 2);  // 3 / 2 < 2
  std::vector<float> b = {-1.0f, -1.5f};
  EXPECT_EQ(s.next(b, {}, {0}), 1);  // -1 * 2 < -1.5
  gc.repetition_penalty = 0.0f;
  EXPECT_THROW(gc.validate(), Error);
}

TEST(GenerationConfig, RunUsesTheFileUnlessFlagsOverride) {
  const std::string dir = tiny_dir("run");
  const std::string base = "run --quiet --json --model " + dir + " --prompt-ids 5,17,99,3 --max-new-tokens 12";
  auto ids = [](const CliResult& r) {
    EXPECT_EQ(r.code, 0) << r.out;
    return nlohmann::json::parse(r.out)["generated_ids"].get<std::vector<int64_t>>();
  };
  const auto greedy = ids(run_cli(base, false));
  write_file(dir + "/generation_config.json",
             R"({"do_sample": true, "temperature": 1.5, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.2})");
  GenerationConfig gc = GenerationConfig::from_pretrained(dir);
  gc.max_new_tokens = 12;
  Model model = Model::from_pretrained(dir);
  const auto sampled = model.generate({5, 17, 99, 3}, gc).tokens;
  EXPECT_NE(sampled, greedy);
  EXPECT_EQ(ids(run_cli(base, false)), sampled);                    // the file's settings
  EXPECT_EQ(ids(run_cli(base + " --greedy --repetition-penalty 1", false)), greedy);  // overridden
  gc.temperature = 0.5f;
  EXPECT_EQ(ids(run_cli(base + " --temperature 0.5", false)), model.generate({5, 17, 99, 3}, gc).tokens);
  fs::remove_all(dir);
}

TEST(TextCli, TokenizeAndRunWithAPrompt) {
  const std::string dir = tiny_dir("text");
  const Tokenizer tok = Tokenizer::from_pretrained(dir);
  EXPECT_EQ(tok.vocab_size(), 160);
  const std::string text = "The experts of a model";
  const auto ids = tok.encode(text);
  EXPECT_EQ(tok.decode(ids), text);

  CliResult r = run_cli("tokenize --model " + dir + " --text '" + text + "' --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["ids"].get<std::vector<int64_t>>(), ids);
  EXPECT_EQ(j["text"], text);
  std::string list;
  for (int64_t t : ids) list += (list.empty() ? "" : ",") + std::to_string(t);
  r = run_cli("tokenize --tokenizer " + dir + "/tokenizer.json --text '" + text + "'");
  EXPECT_EQ(r.out, list + "\n");
  r = run_cli("tokenize --model " + dir + " --ids " + list);
  EXPECT_EQ(r.out, text + "\n");
  r = run_cli("tokenize --model " + dir + " --ids 1,999");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("999"), std::string::npos) << r.out;
  r = run_cli("tokenize --model " + dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--text"), std::string::npos) << r.out;

  // --prompt gives what --prompt-ids gives for its ids; the text is decoded and in --json.
  const std::string base = "run --quiet --model " + dir + " --max-new-tokens 8 --min-new-tokens 8";
  r = run_cli(base + " --json --prompt '" + text + "'", false);
  ASSERT_EQ(r.code, 0) << r.out;
  j = nlohmann::json::parse(r.out);
  const auto gen = j["generated_ids"].get<std::vector<int64_t>>();
  EXPECT_EQ(j["text"], tok.decode(gen));
  r = run_cli(base + " --json --prompt-ids " + list, false);
  EXPECT_EQ(nlohmann::json::parse(r.out)["generated_ids"].get<std::vector<int64_t>>(), gen);
  write_file(dir + "/prompt.txt", text);
  r = run_cli(base + " --prompt-file " + dir + "/prompt.txt", false);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("text           " + tok.decode(gen) + "\n"), std::string::npos) << r.out;

  r = run_cli(base + " --prompt 'a' --prompt-ids 1,2");
  EXPECT_NE(r.code, 0);
  // A tokenizer smaller than the model's vocabulary: ids it lacks are left out of the text.
  write_file(dir + "/tokenizer.json", tiny_tokenizer(100).dump());
  const Tokenizer small = Tokenizer::from_pretrained(dir);
  r = run_cli(base + " --json --prompt-ids " + list, false);
  ASSERT_EQ(r.code, 0) << r.out;
  j = nlohmann::json::parse(r.out);
  std::vector<int64_t> known;
  for (int64_t t : j["generated_ids"].get<std::vector<int64_t>>())
    if (t < 100) known.push_back(t);
  EXPECT_EQ(j["text"], small.decode(known));
  EXPECT_FALSE(small.contains(100));
  EXPECT_EQ(run_cli(base + " --prompt-ids " + list, false).code, 0);
  fs::remove(dir + "/tokenizer.json");
  r = run_cli(base + " --prompt 'hello'");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("no tokenizer.json"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

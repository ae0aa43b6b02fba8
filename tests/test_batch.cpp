// Model::generate_batch: every sequence of a batch of ragged prompts gets the tokens it gets alone, for
// every fixture architecture, with sequences stopping at different steps (EOS and max_new_tokens), on the
// CPU and (when present) on CUDA with and without decode graphs; `moekit run --prompts-file`; loading progress.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "moekit/model.h"
#include "moekit/safetensors.h"
#include "test_experts_problem.h"
#include "test_util.h"

using namespace moekit;

namespace {

std::string model_dir(const std::string& arch) { return test::models_dir() + "/" + arch; }

// Ragged prompts: prefixes of the reference prompt and fresh random ids, lengths 1 .. L + 5.
std::vector<std::vector<int64_t>> ragged_prompts(const std::string& arch, int64_t vocab, std::mt19937_64& rng) {
  const auto ref = SafetensorsFile::open(model_dir(arch) + "/reference.safetensors");
  const std::vector<int64_t> p = test::row_ids(ref.get("input_ids"), 0);
  const int64_t L = int64_t(p.size());
  std::uniform_int_distribution<int64_t> id(0, vocab - 1);
  std::vector<std::vector<int64_t>> out{p, {p[0]}, std::vector<int64_t>(p.begin(), p.begin() + std::max<int64_t>(2, L / 2))};
  for (int64_t n : {L + 5, int64_t(3)}) {
    std::vector<int64_t> r;
    for (int64_t i = 0; i < n; ++i) r.push_back(id(rng));
    out.push_back(r);
  }
  return out;
}

std::vector<GenerationResult> alone(Model& m, const std::vector<std::vector<int64_t>>& prompts,
                                    const GenerationConfig& gc) {
  std::vector<GenerationResult> r;
  for (const auto& p : prompts) r.push_back(m.generate(p, gc));
  return r;
}

// A stop token that makes the sequences stop at different steps, some on it and some at max_new_tokens:
// one of the tokens they generate without one.
std::vector<int64_t> ragged_stop(Model& m, const std::vector<std::vector<int64_t>>& prompts, GenerationConfig gc) {
  gc.eos_token_ids = std::vector<int64_t>{};
  const auto free_run = alone(m, prompts, gc);
  for (const auto& r : free_run)
    for (size_t k = 1; k < r.tokens.size(); ++k) {
      gc.eos_token_ids = std::vector<int64_t>{r.tokens[k]};
      std::set<size_t> lengths;
      bool eos = false, max = false;
      for (const auto& a : alone(m, prompts, gc)) {
        lengths.insert(a.tokens.size());
        (a.stopped_on_eos ? eos : max) = true;
      }
      if (lengths.size() >= 2 && eos && max) return *gc.eos_token_ids;
    }
  return {};
}

void expect_batch_equals_alone(Model& m, const std::vector<std::vector<int64_t>>& prompts, const GenerationConfig& gc,
                               const std::string& what) {
  const auto expect = alone(m, prompts, gc);
  std::vector<std::vector<int64_t>> streamed(prompts.size());
  GenerationConfig g = gc;
  g.on_sequence_token = [&](size_t i, int64_t t) { streamed.at(i).push_back(t); };
  const auto got = m.generate_batch(prompts, g);
  ASSERT_EQ(got.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(what + ", sequence " + std::to_string(i) + " (prompt of " + std::to_string(prompts[i].size()) +
                 " tokens)");
    EXPECT_EQ(got[i].tokens, expect[i].tokens);
    EXPECT_EQ(got[i].stopped_on_eos, expect[i].stopped_on_eos);
    EXPECT_EQ(streamed[i], got[i].tokens);
    EXPECT_EQ(got[i].batch_size, int64_t(prompts.size()));
    EXPECT_EQ(got[i].decode_steps, int64_t(got[i].tokens.size()) - 1);
    EXPECT_EQ(got[i].prefill_experts, expect[i].prefill_experts);
    EXPECT_EQ(got[i].decode_experts, expect[i].decode_experts);
  }
}

class BatchFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(BatchFixture, EverySequenceGetsItsTokensAloneOnTheCpu) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Model m = Model::from_pretrained(model_dir(GetParam()));
  const auto prompts = ragged_prompts(GetParam(), m.config().text.vocab_size, rng);
  GenerationConfig gc;
  gc.max_new_tokens = 7;
  gc.eos_token_ids = ragged_stop(m, prompts, gc);
  ASSERT_FALSE(gc.eos_token_ids->empty()) << "no generated token makes the sequences stop at different steps";
  for (const std::string be : {"grouped_mm", "eager"}) {
    m.set_experts_implementation(be);
    expect_batch_equals_alone(m, prompts, gc, "cpu " + be);
  }
  // A batch of one is generate.
  expect_batch_equals_alone(m, {prompts[1]}, gc, "one sequence");
}

TEST_P(BatchFixture, EverySequenceGetsItsTokensAloneOnCuda) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (bool graphs : {false, true}) {
    Model m = Model::from_pretrained(model_dir(GetParam()),
                                     ModelOptions{.device = Device::cuda(0), .dtype = DType::f32, .cuda_graph = graphs});
    const auto prompts = ragged_prompts(GetParam(), m.config().text.vocab_size, rng);
    GenerationConfig gc;
    gc.max_new_tokens = 7;
    gc.eos_token_ids = ragged_stop(m, prompts, gc);
    ASSERT_FALSE(gc.eos_token_ids->empty());
    for (const std::string be : {"grouped_mm", "batched_mm"}) {
      m.set_experts_implementation(be);
      expect_batch_equals_alone(m, prompts, gc, std::string("cuda ") + be + (graphs ? " graphs" : ""));
      if (graphs) {  // 5 sequences run in a bucket of 8; the slots shrink to 4, 2, 1 as they finish
        const auto r = m.generate_batch(prompts, gc);
        EXPECT_GT(r[0].graph_replays, 0);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, BatchFixture, ::testing::ValuesIn(test::fixture_models()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(Batch, BadBatchesAreRefusedNamingTheSequence) {
  Model m = Model::from_pretrained(model_dir("qwen3_moe"));
  EXPECT_NE(test::error_of([&] { m.generate_batch({}); }).find("no prompts"), std::string::npos);
  EXPECT_NE(test::error_of([&] { m.generate_batch({{1, 2}, {}}); }).find("prompt 1 is empty"), std::string::npos);
  EXPECT_NE(test::error_of([&] { m.generate_batch({{1, 2}, {3, 1000000}}); }).find("1000000"), std::string::npos);
  GenerationConfig gc;
  gc.keep_prompt_logits = true;
  EXPECT_NE(test::error_of([&] { m.generate_batch({{1, 2}}, gc); }).find("keep_prompt_logits"), std::string::npos);
  gc = GenerationConfig{};
  gc.max_new_tokens = 0;
  const auto r = m.generate_batch({{1, 2}, {3}}, gc);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_TRUE(r[0].tokens.empty() && r[1].tokens.empty());
  // The map comes back when a callback throws midway.
  gc = GenerationConfig{};
  gc.max_new_tokens = 5;
  gc.decode_experts_implementation = ExpertsImplementation("eager");
  int calls = 0;
  gc.on_sequence_token = [&](size_t, int64_t) {
    if (++calls == 4) throw std::runtime_error("stop");
  };
  const ExpertsMap before = m.get_experts_implementation();
  EXPECT_THROW(m.generate_batch({{1, 2}, {3}}, gc), std::runtime_error);
  EXPECT_EQ(m.get_experts_implementation(), before);
}

// ---- moekit run --prompts-file ----

TEST(RunCommand, PromptsFileBatchesAndPrintsOneJsonLinePerSequence) {
  const std::string dir = model_dir("qwen3_moe");
  Model m = Model::from_pretrained(dir);
  const std::vector<std::vector<int64_t>> prompts{{15, 51, 6, 85, 76}, {3}, {9, 8, 7, 6, 5, 4, 3, 2, 1}};
  GenerationConfig gc = GenerationConfig::from_pretrained(dir);
  gc.max_new_tokens = 6;
  test::TempDir tmp;
  {
    std::ofstream f(tmp.file("prompts.jsonl"));
    f << R"({"ids": [15, 51, 6, 85, 76]})" << "\n\n" << R"({"ids": [3], "other": 1})" << "\n"
      << R"({"ids": [9, 8, 7, 6, 5, 4, 3, 2, 1]})" << "\n";
  }
  for (const char* batch : {"1", "2", "8"}) {
    const test::CliResult r = test::run_cli("run --quiet --model " + dir + " --prompts-file " +
                                                tmp.file("prompts.jsonl") + " --max-new-tokens 6 --json --batch " + batch,
                                            false);
    ASSERT_EQ(r.code, 0) << r.out;
    std::istringstream lines(r.out);
    std::string line;
    size_t n = 0;
    while (std::getline(lines, line)) {
      const auto j = nlohmann::json::parse(line);
      ASSERT_LT(n, prompts.size());
      EXPECT_EQ(j["index"].get<size_t>(), n);
      EXPECT_EQ(j["prompt_ids"].get<std::vector<int64_t>>(), prompts[n]);
      EXPECT_EQ(j["generated_ids"].get<std::vector<int64_t>>(), m.generate(prompts[n], gc).tokens) << "batch " << batch;
      const size_t b = std::stoul(batch), first = n / b * b;
      EXPECT_EQ(j["batch_size"].get<size_t>(), std::min(b, prompts.size() - first)) << "batch " << batch;
      ++n;
    }
    EXPECT_EQ(n, prompts.size()) << r.out;
  }
}

TEST(RunCommand, PromptsFileOfTextLinesUsesTheTokenizer) {
  test::TempDir tmp;
  test::CliResult r = test::run_cli("tiny --arch qwen3_moe --out " + tmp.file("m"), true);
  ASSERT_EQ(r.code, 0) << r.out;
  {
    std::ofstream f(tmp.file("prompts.txt"));
    f << "Hello world\nThe quick brown fox\n" << R"({"text": "héllo 123"})" << "\n";
  }
  r = test::run_cli("run --quiet --model " + tmp.file("m") + " --prompts-file " + tmp.file("prompts.txt") +
                        " --max-new-tokens 4 --batch 3 --json",
                    false);
  ASSERT_EQ(r.code, 0) << r.out;
  std::istringstream lines(r.out);
  std::string line;
  std::vector<nlohmann::json> js;
  while (std::getline(lines, line)) js.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(js.size(), 3u) << r.out;
  EXPECT_EQ(js[0]["prompt"].get<std::string>(), "Hello world");
  EXPECT_EQ(js[2]["prompt"].get<std::string>(), "héllo 123");
  for (const auto& j : js) {
    EXPECT_EQ(j["generated_ids"].size(), 4u);
    EXPECT_TRUE(j["text"].is_string());
  }
  // Without --json: each sequence's text, in order.
  r = test::run_cli("run --quiet --model " + tmp.file("m") + " --prompts-file " + tmp.file("prompts.txt") +
                        " --max-new-tokens 4 --batch 2",
                    false);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[0]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[2]"), std::string::npos) << r.out;
}

TEST(RunCommand, BadPromptsFilesFailNamingTheLine) {
  const std::string base = "run --quiet --model " + model_dir("qwen3_moe");
  test::TempDir tmp;
  auto with = [&](const std::string& text, const std::string& extra = "") {
    std::ofstream(tmp.file("p")) << text;
    return test::run_cli(base + " --prompts-file " + tmp.file("p") + extra);
  };
  test::CliResult r = with(R"({"ids": [1, "x"]})");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("line 1"), std::string::npos) << r.out;
  r = with("{\"ids\": [1]}\n{\"ids\": [1, 2]\n");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("line 2"), std::string::npos) << r.out;
  r = with(R"({"nothing": 1})");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("\"text\" or \"ids\""), std::string::npos) << r.out;
  r = with("hello\n");  // text without a tokenizer.json
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("tokenizer.json"), std::string::npos) << r.out;
  r = with("\n\n");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("no prompts"), std::string::npos) << r.out;
  r = with(R"({"ids": [1]})", " --batch 0");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--batch"), std::string::npos) << r.out;
  r = with(R"({"ids": [1]})", " --prompt-ids 1,2");
  EXPECT_NE(r.code, 0);
  r = test::run_cli(base + " --prompt-ids 1,2 --batch 2");  // --batch belongs to --prompts-file
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--prompts-file"), std::string::npos) << r.out;
  r = test::run_cli(base + " --prompts-file " + tmp.file("missing"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("missing"), std::string::npos) << r.out;
}

// ---- loading progress ----

TEST(LoadProgress, CountsEveryTensorAndByteOnce) {
  for (const std::string arch : {"qwen3_moe", "mixtral", "gpt_oss"}) {
    SCOPED_TRACE(arch);
    std::vector<LoadProgress> seen;
    ModelOptions mo;
    mo.on_load_progress = [&](const LoadProgress& p) { seen.push_back(p); };
    Model m = Model::from_pretrained(model_dir(arch), mo);
    ASSERT_GE(seen.size(), 2u);
    const LoadProgress last = seen.back();
    EXPECT_EQ(last.tensors, last.total_tensors);
    EXPECT_EQ(last.bytes, last.total_bytes);
    EXPECT_GT(last.total_tensors, m.config().text.num_hidden_layers);
    // The decoder's bytes are nearly all of the checkpoint's (the fixture files hold nothing else).
    uint64_t file_bytes = 0;
    for (const auto& e : std::filesystem::directory_iterator(model_dir(arch)))
      if (e.path().filename() == "model.safetensors") file_bytes = e.file_size();
    EXPECT_LE(last.total_bytes, file_bytes);
    EXPECT_GT(double(last.total_bytes), 0.9 * double(file_bytes));
    for (size_t i = 1; i < seen.size(); ++i) {
      EXPECT_GE(seen[i].tensors, seen[i - 1].tensors);
      EXPECT_GE(seen[i].bytes, seen[i - 1].bytes);
      EXPECT_EQ(seen[i].total_bytes, last.total_bytes);
    }
    EXPECT_EQ(seen[seen.size() - 2].tensors, last.total_tensors);  // the last tensor read, then the end
  }
  // A callback that throws aborts the load with its error.
  ModelOptions mo;
  mo.on_load_progress = [](const LoadProgress& p) {
    if (p.tensors == 3) throw Error(ErrorCode::runtime, "stop at 3");
  };
  EXPECT_EQ(test::error_of([&] { Model::from_pretrained(model_dir("qwen3_moe"), mo); }), "stop at 3");
}

TEST(RunCommand, LoadingProgressOnlyWhenAskedOffATerminal) {
  const std::string base = "run --model " + model_dir("qwen3_moe") + " --prompt-ids 1,2,3 --max-new-tokens 1";
  test::CliResult r = test::run_cli(base + " --progress --quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("69 / 69 tensors"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("69 / 69 tensors"), r.out.rfind("69 / 69 tensors")) << r.out;
  r = test::run_cli(base);  // stderr is a pipe here: no progress lines
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("tensors"), std::string::npos) << r.out;
}

}  // namespace

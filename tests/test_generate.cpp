// Generation: sampling determinism, EOS and min_new_tokens, the decode-step switch and its restore
// (also when a step throws), and the `moekit run` command.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "moekit/interface.h"
#include "moekit/model.h"
#include "moekit/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace moekit;
using moekit::test::CliResult;
using moekit::test::run_cli;

namespace {

std::string model_dir(const std::string& arch) { return test::fixtures_dir() + "/models/" + arch; }

const std::vector<int64_t> kPrompt = {15, 51, 6, 85, 76, 84, 152, 25, 15, 49, 23};

TEST(Generate, SamplingIsDeterministicForASeed) {
  Model model = Model::from_pretrained(model_dir("qwen2_moe"));
  GenerationConfig gc;
  gc.do_sample = true;
  gc.max_new_tokens = 16;
  gc.temperature = 1.5f;
  gc.top_k = 40;
  gc.top_p = 0.95f;
  gc.seed = 1234;
  const auto a = model.generate(kPrompt, gc).tokens, b = model.generate(kPrompt, gc).tokens;
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 16u);
  int differing = 0;
  for (uint64_t s = 1; s <= 4; ++s) {
    gc.seed = 1234 + s;
    differing += model.generate(kPrompt, gc).tokens != a;
  }
  EXPECT_GE(differing, 3) << "other seeds should give other samples";
  // top_k = 1 sampling is greedy decoding.
  GenerationConfig greedy;
  greedy.max_new_tokens = 16;
  gc.top_k = 1;
  EXPECT_EQ(model.generate(kPrompt, gc).tokens, model.generate(kPrompt, greedy).tokens);
  // A tiny top_p keeps only the most likely token as well.
  gc.top_k = 0;
  gc.top_p = 1e-6f;
  EXPECT_EQ(model.generate(kPrompt, gc).tokens, model.generate(kPrompt, greedy).tokens);
}

TEST(Generate, StopsOnEosAfterMinNewTokens) {
  Model model = Model::from_pretrained(model_dir("qwen3_moe"));
  GenerationConfig gc;
  gc.max_new_tokens = 20;
  const auto free_run = model.generate(kPrompt, gc).tokens;  // the config has no EOS: runs to the end
  ASSERT_EQ(free_run.size(), 20u);
  // Make the 6th generated token the EOS token: generation stops right there, EOS included.
  const int64_t eos = free_run[5];
  const size_t first = size_t(std::find(free_run.begin(), free_run.end(), eos) - free_run.begin());
  gc.eos_token_ids = std::vector<int64_t>{eos, 159};
  auto r = model.generate(kPrompt, gc);
  EXPECT_TRUE(r.stopped_on_eos);
  ASSERT_EQ(r.tokens.size(), first + 1);
  EXPECT_EQ(r.tokens.back(), eos);
  EXPECT_TRUE(std::equal(r.tokens.begin(), r.tokens.end(), free_run.begin()));
  // Before min_new_tokens the EOS token cannot be chosen.
  gc.min_new_tokens = int64_t(first) + 3;
  r = model.generate(kPrompt, gc);
  ASSERT_GE(r.tokens.size(), size_t(gc.min_new_tokens));
  for (int64_t i = 0; i < gc.min_new_tokens; ++i) EXPECT_NE(r.tokens[size_t(i)], eos) << "token " << i;
  // generation_config.json's eos_token_id is the default (mixtral's is 2).
  Model mixtral = Model::from_pretrained(model_dir("mixtral"));
  EXPECT_EQ(mixtral.config().eos_token_ids, std::vector<int64_t>{2});
}

TEST(Generate, InvalidSettingsAreRejected) {
  Model model = Model::from_pretrained(model_dir("qwen3_moe"));
  GenerationConfig gc;
  gc.do_sample = true;
  gc.temperature = 0;
  EXPECT_THROW(model.generate(kPrompt, gc), Error);
  gc.temperature = 1;
  gc.top_p = 0;
  EXPECT_THROW(model.generate(kPrompt, gc), Error);
  EXPECT_THROW(model.generate({}, GenerationConfig{}), Error);
}

TEST(DecodeSwitch, GroupedMmBecomesBatchedMmOnGpusOnly) {
  const ExpertsMap m{{"", "grouped_mm"}, {"text_config", "grouped_mm"}, {"vision_config", "eager"}};
  const ExpertsMap switched{{"", "batched_mm"}, {"text_config", "batched_mm"}, {"vision_config", "eager"}};
  EXPECT_EQ(decode_experts_map(m, Device::cuda(), DecodeSwitch::automatic), switched);
  EXPECT_EQ(decode_experts_map(m, Device::cpu(), DecodeSwitch::automatic), m);
  EXPECT_EQ(decode_experts_map(m, Device::cpu(), DecodeSwitch::always), switched);
  EXPECT_EQ(decode_experts_map(m, Device::cuda(), DecodeSwitch::never), m);
}

TEST(DecodeSwitch, CpuKeepsTheMapAndPhasesAreRecorded) {
  Model model = Model::from_pretrained(model_dir("mixtral"));
  const ExpertsMap start = model.get_experts_implementation();
  ASSERT_EQ(start.at(""), "grouped_mm");
  std::vector<ExpertsMap> seen;
  GenerationConfig gc;
  gc.max_new_tokens = 4;
  gc.on_token = [&](int64_t) { seen.push_back(model.get_experts_implementation()); };
  const auto r = model.generate(kPrompt, gc);
  EXPECT_EQ(r.prefill_experts, start);
  EXPECT_EQ(r.decode_experts, start);
  for (const auto& m : seen) EXPECT_EQ(m, start);
  EXPECT_EQ(r.decode_steps, 3);
}

TEST(DecodeSwitch, SwitchedForDecodeStepsAndRestoredAfterwards) {
  Model model = Model::from_pretrained(model_dir("qwen3_moe"));
  const ExpertsMap start = model.get_experts_implementation();
  GenerationConfig plain;
  plain.max_new_tokens = 8;
  const auto expect = model.generate(kPrompt, plain).tokens;
  std::vector<std::string> during;
  GenerationConfig gc = plain;
  gc.decode_switch = DecodeSwitch::always;
  gc.on_token = [&](int64_t) { during.push_back(model.experts_backend()); };
  const auto r = model.generate(kPrompt, gc);
  EXPECT_EQ(r.tokens, expect);  // batched_mm computes the same function
  EXPECT_EQ(r.prefill_experts.at(""), "grouped_mm");
  EXPECT_EQ(r.decode_experts.at(""), "batched_mm");
  ASSERT_EQ(during.size(), 8u);
  EXPECT_EQ(during[0], "grouped_mm");  // the prefill's token
  for (size_t i = 1; i < during.size(); ++i) EXPECT_EQ(during[i], "batched_mm") << i;
  EXPECT_EQ(model.get_experts_implementation(), start);
  for (const Experts* e : model.experts_modules()) EXPECT_EQ(e->implementation(), "grouped_mm");

  // Aborting from inside a decode step still restores the map.
  gc.on_token = [&](int64_t) {
    if (model.experts_backend() == "batched_mm") throw std::runtime_error("stop");
  };
  EXPECT_THROW(model.generate(kPrompt, gc), std::runtime_error);
  EXPECT_EQ(model.get_experts_implementation(), start);
}

// A user backend that computes like eager but fails on single-token (decode) calls.
struct ThrowingBackend {
  ThrowingBackend() {
    auto eager = ExpertsInterface::global().get("eager");
    ExpertsInterface::global().register_backend(
        kName,
        [eager](const Experts& e, const ExpertsCall& c) {
          if (c.tokens() == 1) throw Error(ErrorCode::runtime, "decode step failed on purpose");
          eager->run(e, c);
        },
        {DeviceType::cpu}, "fails on one-token calls", true);
  }
  ~ThrowingBackend() { ExpertsInterface::global().unregister_backend(kName); }
  static constexpr const char* kName = "test_fails_on_decode";
};

TEST(DecodeSwitch, MapIsRestoredWhenAUserBackendThrowsDuringDecode) {
  ThrowingBackend backend;
  Model model = Model::from_pretrained(model_dir("qwen2_moe"));
  const ExpertsMap start = model.get_experts_implementation();
  GenerationConfig gc;
  gc.max_new_tokens = 5;
  gc.decode_experts_implementation = ExpertsImplementation(ThrowingBackend::kName);
  try {
    model.generate(kPrompt, gc);
    FAIL() << "expected the decode step to throw";
  } catch (const Error& e) { EXPECT_NE(std::string(e.what()).find("on purpose"), std::string::npos) << e.what(); }
  EXPECT_EQ(model.get_experts_implementation(), start);
  for (const Experts* e : model.experts_modules()) EXPECT_EQ(e->implementation(), start.at(""));

  // The same backend chosen for the whole model: the prefill runs, the first decode step throws.
  model.set_experts_implementation(ThrowingBackend::kName);
  int tokens = 0;
  gc.decode_experts_implementation.reset();
  gc.decode_switch = DecodeSwitch::always;
  gc.on_token = [&](int64_t) { ++tokens; };
  EXPECT_THROW(model.generate(kPrompt, gc), Error);
  EXPECT_EQ(tokens, 1);
  EXPECT_EQ(model.experts_backend(), ThrowingBackend::kName);
  model.set_experts_implementation(start);
  EXPECT_EQ(model.generate(kPrompt, GenerationConfig{}).tokens.size(), 20u);
}

// ---- moekit run ----

std::string ids_arg(const std::vector<int64_t>& ids) {
  std::string s;
  for (int64_t t : ids) s += (s.empty() ? "" : ",") + std::to_string(t);
  return s;
}

TEST(RunCommand, JsonLineHasTokensMapsAndTimings) {
  const std::string dir = model_dir("mixtral");
  const auto ref = SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor gen = ref.get("generated_ids");
  const std::vector<int64_t> expect(gen.ptr<int64_t>() + 11, gen.ptr<int64_t>() + gen.size(1));
  const fs::path logits = fs::temp_directory_path() / ("moekit_run_logits_" + std::to_string(::getpid()));
  const CliResult r =
      run_cli("run --quiet --model " + dir + " --prompt-ids " + ids_arg(kPrompt) +
              " --max-new-tokens 20 --min-new-tokens 20 --experts =eager --json --dump-logits " + logits.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["generated_ids"].get<std::vector<int64_t>>(), expect);
  EXPECT_EQ(j["experts_implementation"], nlohmann::json({{"", "eager"}}));
  EXPECT_EQ(j["phases"]["prefill"], nlohmann::json({{"", "eager"}}));
  EXPECT_EQ(j["phases"]["decode"], nlohmann::json({{"", "eager"}}));
  for (const char* k : {"prefill_ms", "decode_ms", "tokens_per_s"}) EXPECT_GT(j["timings"][k].get<double>(), 0) << k;
  const auto f = SafetensorsFile::open(logits.string());
  const Tensor l = f.get("logits");
  EXPECT_EQ(l.dtype(), DType::f32);
  EXPECT_EQ(l.shape(), Shape({11, 160}));
  fs::remove(logits);
}

TEST(RunCommand, BadArgumentsFailWithClearMessages) {
  const std::string base = "run --quiet --model " + model_dir("qwen3_moe");
  CliResult r = run_cli(base + " --prompt-ids 1,2,3 --experts no_such_backend");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("grouped_mm"), std::string::npos) << r.out;
  r = run_cli(base + " --prompt-ids 1,x,3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("'x'"), std::string::npos) << r.out;
  r = run_cli(base + " --prompt-ids 1,2,3 --cuda-graph");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("CUDA"), std::string::npos) << r.out;
  r = run_cli(base + " --prompt-ids 1,2,3 --experts text_config=eager");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("text_config"), std::string::npos) << r.out;
  r = run_cli(base + " --prompt-ids 1,2,3 --max-new-tokens 3 --sample --seed 7 --top-k 5");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("generated      3 tokens"), std::string::npos) << r.out;
}

}  // namespace

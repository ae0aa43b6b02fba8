// The model runtime against transformers' reference logits and greedy tokens, for every fixture model and
// every CPU experts backend; the experts_implementation map; config and checkpoint errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moekit/model.h"
#include "moekit/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace moekit;
using test::fixture_models;
using test::model_reference;
using test::ModelReference;
using test::models_dir;
using test::rel_l2;
using test::row_ids;

namespace {

std::vector<std::string> cpu_backends() {
  std::vector<std::string> out;
  auto& reg = ExpertsInterface::global();
  for (const auto& b : reg.backends())
    if (reg.is_builtin(b->name()) && b->available(Device::cpu())) out.emplace_back(b->name());
  return out;
}

class FixtureModel : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureModel, LogitsAndGreedyTokensMatchTransformersForEveryCpuBackend) {
  const ModelReference fx = model_reference(GetParam());
  const Tensor& ids = fx.ids;
  ASSERT_EQ(ids.dim(), 2);
  const int64_t B = ids.size(0), L = fx.L;
  Model model = Model::from_pretrained(fx.dir, ModelOptions{.device = Device::cpu(), .dtype = DType::f32});
  const int64_t V = model.config().text.vocab_size;
  const auto backends = cpu_backends();
  ASSERT_FALSE(backends.empty());
  for (const auto& be : backends) {
    SCOPED_TRACE("backend " + be);
    model.set_experts_implementation(be);  // switched at run time, no reload
    for (const Experts* e : model.experts_modules()) ASSERT_EQ(e->implementation(), be);
    const std::string ref_name = fx.ref.contains("logits." + be) ? "logits." + be : "logits.eager";
    const Tensor ref_logits = fx.ref.get(ref_name);
    ASSERT_EQ(ref_logits.shape(), Shape({B, L, V}));
    for (int64_t r = 0; r < B; ++r) {
      const Tensor logits = model.logits(row_ids(ids, r));
      ASSERT_EQ(logits.shape(), Shape({L, V}));
      const double err = rel_l2(logits.ptr<float>(), ref_logits.ptr<float>() + r * L * V, L * V);
      EXPECT_LT(err, 1e-4) << GetParam() << " row " << r << " vs " << ref_name;
    }
    GenerationConfig gc;
    gc.max_new_tokens = fx.n_new;
    gc.min_new_tokens = fx.n_new;
    const GenerationResult res = model.generate(row_ids(ids, 0), gc);
    EXPECT_EQ(res.tokens, fx.expect) << GetParam();
    EXPECT_EQ(res.prefill_experts, model.get_experts_implementation());
  }
}

INSTANTIATE_TEST_SUITE_P(Models, FixtureModel, ::testing::ValuesIn(fixture_models()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(FixtureModel);

TEST(Model, IncrementalDecodingMatchesTheFullForward) {
  Model model = Model::from_pretrained(models_dir() + "/qwen3_moe");
  const std::vector<int64_t> ids = {5, 17, 99, 3, 42, 150, 7, 8, 64};
  const Tensor full = model.logits(ids);
  KvCache cache;
  model.forward({ids.begin(), ids.begin() + 4}, cache);
  Tensor last;
  for (size_t i = 4; i < ids.size(); ++i) last = model.forward({ids[i]}, cache);
  EXPECT_EQ(cache.length(), int64_t(ids.size()));
  const int64_t V = full.size(1);
  EXPECT_LT(rel_l2(last.ptr<float>(), full.ptr<float>() + (full.size(0) - 1) * V, V), 1e-5);
}

TEST(Model, LowPrecisionDtypesStayCloseToTheReference) {
  const std::string dir = models_dir() + "/qwen3_moe";
  const auto ref = SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = ref.get("input_ids"), ref_logits = ref.get("logits.eager");
  for (DType t : {DType::bf16, DType::f16}) {
    Model model = Model::from_pretrained(dir, ModelOptions{.dtype = t});
    EXPECT_EQ(model.dtype(), t);
    for (const Experts* e : model.experts_modules()) EXPECT_EQ(e->weight_dtype(), t);
    const Tensor logits = model.logits(row_ids(ids, 0));
    const double err = rel_l2(logits.ptr<float>(), ref_logits.ptr<float>(), logits.numel());
    EXPECT_LT(err, 3e-2) << dtype_name(t);
    EXPECT_GT(err, 0.0) << dtype_name(t) << ": weights were not converted";
  }
  EXPECT_THROW(Model::from_pretrained(dir, ModelOptions{.dtype = DType::i32}), Error);
}

// ---- experts_implementation ----

TEST(ExpertsImplementation, ParsesNamesAndMaps) {
  EXPECT_EQ(*ExpertsImplementation::parse("eager").all(), "eager");
  const auto m = ExpertsImplementation::parse("=grouped_mm,text_config=eager").per_config();
  EXPECT_EQ(m, (ExpertsMap{{"", "grouped_mm"}, {"text_config", "eager"}}));
  EXPECT_THROW(ExpertsImplementation::parse("a,b"), Error);
  EXPECT_THROW(ExpertsImplementation::parse("=eager,=grouped_mm"), Error);
  EXPECT_THROW(ExpertsImplementation::parse("text_config="), Error);
}

TEST(ExpertsImplementation, DefaultIsGroupedMmAndMapsRoundTrip) {
  Model model = Model::from_pretrained(models_dir() + "/qwen2_moe");
  EXPECT_EQ(model.get_experts_implementation(), (ExpertsMap{{"", "grouped_mm"}}));
  model.set_experts_implementation(ExpertsMap{{"", "eager"}});
  EXPECT_EQ(model.experts_backend(), "eager");
  for (const Experts* e : model.experts_modules()) EXPECT_EQ(e->implementation(), "eager");
  model.set_experts_implementation("batched_mm");
  EXPECT_EQ(model.get_experts_implementation(), (ExpertsMap{{"", "batched_mm"}}));
}

TEST(ExpertsImplementation, UnknownNamesAndKeysAreErrorsListingTheValidOnes) {
  Model model = Model::from_pretrained(models_dir() + "/mixtral", ModelOptions{.experts_implementation = "eager"});
  const ExpertsMap before = model.get_experts_implementation();
  try {
    model.set_experts_implementation("no_such_backend");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_found);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("no_such_backend"), std::string::npos) << msg;
    for (const char* n : {"eager", "batched_mm", "grouped_mm"}) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  }
  try {
    model.set_experts_implementation(ExpertsMap{{"vision_config", "eager"}});
    FAIL() << "expected an error";
  } catch (const Error& e) { EXPECT_NE(std::string(e.what()).find("vision_config"), std::string::npos) << e.what(); }
  EXPECT_EQ(model.get_experts_implementation(), before);
  EXPECT_THROW(Model::from_pretrained(models_dir() + "/mixtral", ModelOptions{.experts_implementation = "nope"}),
               Error);
}

TEST(ExpertsImplementation, MultimodalMapHasOneEntryPerSubConfig) {
  const std::string dir = models_dir() + "/qwen3_vl_moe";
  if (!fs::exists(dir + "/model.safetensors")) GTEST_SKIP() << "no multimodal fixture";
  Model model =
      Model::from_pretrained(dir, ModelOptions{.experts_implementation = ExpertsMap{{"vision_config", "eager"}}});
  const ExpertsMap start = model.get_experts_implementation();
  EXPECT_EQ(start, (ExpertsMap{{"", "grouped_mm"}, {"text_config", "grouped_mm"}, {"vision_config", "eager"}}));
  // Keys left out keep their value; the text_config entry drives the decoder's experts.
  model.set_experts_implementation(ExpertsMap{{"text_config", "batched_mm"}});
  EXPECT_EQ(model.get_experts_implementation(),
            (ExpertsMap{{"", "grouped_mm"}, {"text_config", "batched_mm"}, {"vision_config", "eager"}}));
  for (const Experts* e : model.experts_modules()) EXPECT_EQ(e->implementation(), "batched_mm");
  model.set_experts_implementation(ExpertsMap{{"", "eager"}});
  EXPECT_EQ(model.experts_backend(), "batched_mm");
  // A name applies everywhere; feeding a snapshot back restores it exactly.
  model.set_experts_implementation("eager");
  EXPECT_EQ(model.get_experts_implementation(),
            (ExpertsMap{{"", "eager"}, {"text_config", "eager"}, {"vision_config", "eager"}}));
  model.set_experts_implementation(start);
  EXPECT_EQ(model.get_experts_implementation(), start);
  for (const Experts* e : model.experts_modules()) EXPECT_EQ(e->implementation(), "grouped_mm");
}

// ---- bad checkpoints ----

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    path = fs::temp_directory_path() / ("moekit_test_model_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string str() const { return path.string(); }
};

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}
void write_json(const fs::path& p, const nlohmann::json& j) { std::ofstream(p) << j.dump(2); }

std::string load_error(const std::string& dir) {
  try {
    Model::from_pretrained(dir);
  } catch (const Error& e) { return e.what(); }
  return "";
}

TEST(ModelErrors, MissingRequiredConfigFieldNamesTheFieldAndFile) {
  TempDir tmp("config");
  const fs::path src = models_dir() + "/qwen3_moe";
  fs::copy_file(src / "model.safetensors", tmp.path / "model.safetensors");
  auto cfg = read_json(src / "config.json");
  cfg.erase("hidden_size");
  write_json(tmp.path / "config.json", cfg);
  std::string msg = load_error(tmp.str());
  EXPECT_NE(msg.find("'hidden_size'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;

  cfg = read_json(src / "config.json");
  cfg["num_experts_per_tok"] = "two";
  write_json(tmp.path / "config.json", cfg);
  msg = load_error(tmp.str());
  EXPECT_NE(msg.find("num_experts_per_tok"), std::string::npos) << msg;

  cfg = read_json(src / "config.json");
  cfg["model_type"] = "llama_moe_unknown";
  write_json(tmp.path / "config.json", cfg);
  msg = load_error(tmp.str());
  EXPECT_NE(msg.find("llama_moe_unknown"), std::string::npos) << msg;
  EXPECT_NE(msg.find("qwen3_moe"), std::string::npos) << msg;  // lists what is supported

  // A sub-config's field is named with its prefix.
  nlohmann::json mm = {{"model_type", "qwen3_vl_moe"}, {"text_config", read_json(src / "config.json")}};
  mm["text_config"]["model_type"] = "qwen3_vl_moe_text";
  mm["text_config"].erase("num_attention_heads");
  write_json(tmp.path / "config.json", mm);
  msg = load_error(tmp.str());
  EXPECT_NE(msg.find("text_config.num_attention_heads"), std::string::npos) << msg;
}

TEST(ModelErrors, MissingOrMisshapenTensorsAreListed) {
  TempDir tmp("tensors");
  const fs::path src = models_dir() + "/qwen3_moe";
  fs::copy_file(src / "config.json", tmp.path / "config.json");
  const auto file = SafetensorsFile::open((src / "model.safetensors").string());
  const std::string dropped = "model.layers.1.mlp.experts.3.up_proj.weight";
  const std::string reshaped = "model.layers.0.self_attn.k_proj.weight";
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& name : file.names()) {
    if (name == dropped) continue;
    Tensor t = file.get(name);
    if (name == reshaped) t = Tensor::zeros({t.size(0) / 2, t.size(1) * 2}, t.dtype());
    tensors.emplace_back(name, t);
  }
  save_safetensors((tmp.path / "model.safetensors").string(), tensors);
  const std::string msg = load_error(tmp.str());
  EXPECT_NE(msg.find(dropped), std::string::npos) << msg;
  EXPECT_NE(msg.find(reshaped), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
}

TEST(ModelErrors, DevicesAndOptionsThatCannotRunAreRejected) {
  const std::string dir = models_dir() + "/qwen3_moe";
  if (!cuda_available()) EXPECT_THROW(Model::from_pretrained(dir, ModelOptions{.device = Device::cuda()}), Error);
  try {
    Model::from_pretrained(dir, ModelOptions{.cuda_graph = true});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_supported);
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
  Model model = Model::from_pretrained(dir);
  EXPECT_THROW(model.logits({1, 2, 160}), Error);  // token id out of the vocabulary
  EXPECT_THROW(model.logits({}), Error);
}

}  // namespace

// `moekit tiny`: random checkpoints in transformers' own format for every supported architecture.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "io/checkpoint.h"
#include "tiny/tiny.h"
#include "test_util.h"

using namespace moekit;
namespace fs = std::filesystem;

namespace {

using moekit::test::TempDir;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

uint64_t fnv1a64(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

int run_shell(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

struct Stats {
  double mean = 0, std = 0;
  bool finite = true;
};

Stats stats_of(const Tensor& t) {
  const Tensor f = t.to(DType::f32);
  Stats s;
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < f.numel(); ++i) {
    const double v = f.ptr<float>()[i];
    s.finite = s.finite && std::isfinite(v);
    sum += v;
    sq += v * v;
  }
  s.mean = sum / double(f.numel());
  s.std = std::sqrt(std::max(0.0, sq / double(f.numel()) - s.mean * s.mean));
  return s;
}

const std::vector<std::string> kArchs = {"qwen2_moe", "qwen3_moe", "mixtral",     "olmoe",
                                         "deepseek_v3", "gpt_oss", "qwen3_vl_moe"};

// Tensors each architecture must have, with their shapes, as transformers names them.
const std::map<std::string, std::vector<std::pair<std::string, Shape>>> kExpected = {
    {"qwen2_moe",
     {{"model.layers.1.mlp.experts.7.gate_proj.weight", {32, 64}},
      {"model.layers.1.mlp.experts.7.down_proj.weight", {64, 32}},
      {"model.layers.0.mlp.shared_expert.up_proj.weight", {48, 64}},
      {"model.layers.0.mlp.shared_expert_gate.weight", {1, 64}},
      {"model.layers.0.self_attn.q_proj.bias", {64}}}},
    {"qwen3_moe",
     {{"model.layers.0.mlp.experts.3.gate_proj.weight", {32, 64}},
      {"model.layers.0.mlp.experts.3.up_proj.weight", {32, 64}},
      {"model.layers.1.self_attn.q_norm.weight", {16}},
      {"model.layers.1.mlp.gate.weight", {8, 64}}}},
    {"mixtral",
     {{"model.layers.0.block_sparse_moe.experts.5.w1.weight", {48, 64}},
      {"model.layers.0.block_sparse_moe.experts.5.w2.weight", {64, 48}},
      {"model.layers.0.block_sparse_moe.experts.5.w3.weight", {48, 64}},
      {"model.layers.1.block_sparse_moe.gate.weight", {6, 64}}}},
    {"olmoe",
     {{"model.layers.1.mlp.experts.7.down_proj.weight", {64, 32}},
      {"model.layers.0.self_attn.q_norm.weight", {64}},
      {"model.layers.0.self_attn.k_norm.weight", {32}}}},
    {"deepseek_v3",
     {{"model.layers.0.mlp.gate_proj.weight", {96, 64}},
      {"model.layers.1.mlp.experts.7.gate_proj.weight", {32, 64}},
      {"model.layers.1.mlp.gate.e_score_correction_bias", {8}},
      {"model.layers.1.mlp.shared_experts.down_proj.weight", {64, 32}},
      {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", {24, 64}},
      {"model.layers.0.self_attn.kv_b_proj.weight", {96, 16}},
      {"model.layers.0.self_attn.q_b_proj.weight", {64, 32}}}},
    {"gpt_oss",
     {{"model.layers.0.mlp.experts.gate_up_proj", {8, 64, 80}},
      {"model.layers.0.mlp.experts.gate_up_proj_bias", {8, 80}},
      {"model.layers.0.mlp.experts.down_proj", {8, 40, 64}},
      {"model.layers.0.mlp.experts.down_proj_bias", {8, 64}},
      {"model.layers.1.mlp.router.bias", {8}},
      {"model.layers.1.self_attn.sinks", {4}},
      {"model.layers.1.self_attn.o_proj.bias", {64}}}},
    {"qwen3_vl_moe",
     {{"model.language_model.layers.1.mlp.experts.gate_up_proj", {8, 64, 48}},
      {"model.language_model.layers.1.mlp.experts.down_proj", {8, 24, 64}},
      {"model.language_model.embed_tokens.weight", {160, 64}},
      {"lm_head.weight", {160, 64}},
      {"model.visual.patch_embed.proj.weight", {16, 3, 2, 8, 8}},
      {"model.visual.deepstack_merger_list.0.linear_fc2.weight", {64, 64}}}},
};

}  // namespace

TEST(Tiny, ArchitectureList) {
  EXPECT_EQ(tiny_architectures(), kArchs);
  try {
    tiny_config("llama");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_found);
    EXPECT_NE(std::string(e.what()).find("qwen3_vl_moe"), std::string::npos) << e.what();
  }
  TempDir dir;
  EXPECT_THROW(write_tiny_checkpoint("llama", dir.str(), 0), Error);
  EXPECT_THROW(write_tiny_checkpoint("qwen3_moe", dir.str(), TinyOptions{.dtype = DType::i32}), Error);
}

TEST(Tiny, EachArchWritesAndReopens) {
  for (const auto& arch : kArchs) {
    SCOPED_TRACE(arch);
    TempDir dir;
    write_tiny_checkpoint(arch, dir.str(), 0);
    const Checkpoint ck = Checkpoint::open(dir.str());
    EXPECT_EQ(ck.config()["model_type"], arch);
    EXPECT_EQ(ck.config()["transformers_version"], "5.17.0");
    EXPECT_EQ(ck.generation_config()["_from_model_config"], true);
    EXPECT_EQ(ck.files()[0].metadata().at("format"), "pt");
    const auto want = tiny_tensor_shapes(ck.config());
    ASSERT_EQ(ck.names().size(), want.size());
    for (const auto& [name, shape] : want) {
      ASSERT_TRUE(ck.contains(name)) << name;
      EXPECT_EQ(ck.entry(name).shape, shape) << name;
      EXPECT_EQ(ck.entry(name).dtype, DType::f32) << name;
    }
    for (const auto& [name, shape] : kExpected.at(arch)) {
      ASSERT_TRUE(ck.contains(name)) << name;
      EXPECT_EQ(ck.entry(name).shape, shape) << name;
    }
    // Values: weights ~ N(0, 0.15), RMSNorm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.1).
    for (const auto& name : ck.names()) {
      const Tensor t = ck.get(name);
      const Stats s = stats_of(t);
      ASSERT_TRUE(s.finite) << name;
      if (t.numel() < 256) continue;
      const bool norm = name.find("norm") != std::string::npos && name.find("weight") != std::string::npos;
      const bool bias = name.size() > 4 && name.compare(name.size() - 4, 4, "bias") == 0;
      EXPECT_NEAR(s.mean, norm ? 1.0 : 0.0, 0.03) << name;
      EXPECT_NEAR(s.std, norm || bias ? 0.1 : 0.15, 0.015) << name;
    }
  }
}

TEST(Tiny, SameNamesConfigAndLayoutAsTransformersSaved) {
  // The committed fixtures were saved by transformers for the same sizes: tiny's config must be equal and
  // its tensors the same, in published layouts (Qwen3-VL-MoE's fused experts are [E, H, 2I] / [E, I, H]
  // in published checkpoints; transformers saves [E, 2I, H] / [E, H, I] and loads both).
  for (const auto& arch : kArchs) {
    SCOPED_TRACE(arch);
    const std::string fixture = test::fixtures_dir() + "/models/" + arch;
    if (!fs::exists(fixture)) {
      ADD_FAILURE() << "no fixture " << fixture;
      continue;
    }
    const Checkpoint ref = Checkpoint::open(fixture);
    EXPECT_EQ(tiny_config(arch), ref.config());
    const auto mine = tiny_tensor_shapes(tiny_config(arch));
    ASSERT_EQ(mine.size(), ref.names().size());
    for (const auto& [name, shape] : mine) {
      ASSERT_TRUE(ref.contains(name)) << name;
      Shape want = ref.entry(name).shape;
      if (arch == "qwen3_vl_moe" && name.find("mlp.experts.") != std::string::npos) std::swap(want[1], want[2]);
      EXPECT_EQ(shape, want) << name;
    }
  }
}

TEST(Tiny, DeterministicPerSeedAndMatchesCommittedReferences) {
  TempDir dir;
  write_tiny_checkpoint("gpt_oss", dir.file("a"), 5);
  write_tiny_checkpoint("gpt_oss", dir.file("b"), 5);
  write_tiny_checkpoint("gpt_oss", dir.file("c"), 6);
  const std::string a = read_bytes(dir.file("a/model.safetensors"));
  EXPECT_EQ(a, read_bytes(dir.file("b/model.safetensors")));
  EXPECT_NE(a, read_bytes(dir.file("c/model.safetensors")));
  EXPECT_EQ(read_bytes(dir.file("a/config.json")), read_bytes(dir.file("c/config.json")));
  // tests/fixtures/tiny/ARCH/reference.safetensors holds transformers' outputs for the seed-0 checkpoint;
  // the hash ties them to these exact bytes (regenerate them when the generator changes).
  for (const auto& arch : kArchs) {
    SCOPED_TRACE(arch);
    const std::string ref_path = test::fixtures_dir() + "/tiny/" + arch + "/reference.safetensors";
    ASSERT_TRUE(fs::exists(ref_path));
    const auto ref = SafetensorsFile::open(ref_path);
    write_tiny_checkpoint(arch, dir.file(arch), 0);
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(fnv1a64(read_bytes(dir.file(arch + "/model.safetensors")))));
    EXPECT_EQ(ref.metadata().at("weights_fnv1a64"), hex);
    EXPECT_EQ(ref.metadata().at("model_type"), arch);
    EXPECT_EQ(ref.entry("logits.eager").shape, (Shape{2, 11, 160}));
  }
}

TEST(Tiny, Bf16ShardedAndRewritten) {
  TempDir dir;
  write_tiny_checkpoint("deepseek_v3", dir.file("f32"), 9);
  write_tiny_checkpoint("deepseek_v3", dir.file("bf16"), TinyOptions{.seed = 9, .dtype = DType::bf16, .shards = 3});
  const Checkpoint f = Checkpoint::open(dir.file("f32"));
  const Checkpoint b = Checkpoint::open(dir.file("bf16"));
  EXPECT_TRUE(b.sharded());
  EXPECT_EQ(b.files().size(), 3u);
  EXPECT_EQ(b.config()["dtype"], "bfloat16");
  ASSERT_EQ(b.names(), f.names());
  for (const auto& name : f.names()) {
    const bool f32_kept = name.find("e_score_correction_bias") != std::string::npos;
    EXPECT_EQ(b.entry(name).dtype, f32_kept ? DType::f32 : DType::bf16) << name;
    const Tensor x = f.get(name), y = b.get(name).to(DType::f32);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float want = f32_kept ? x.ptr<float>()[i] : bf16_to_f32(f32_to_bf16(x.ptr<float>()[i]));
      ASSERT_EQ(y.ptr<float>()[i], want) << name << " " << i;
    }
  }
  const auto index = read_json_file(dir.file("bf16/model.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"].size(), f.names().size());
  // Writing a single-file checkpoint over it removes the old shards.
  write_tiny_checkpoint("deepseek_v3", dir.file("bf16"), 9);
  EXPECT_FALSE(fs::exists(dir.file("bf16/model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(dir.file("bf16/model-00001-of-00003.safetensors")));
  EXPECT_EQ(read_bytes(dir.file("bf16/model.safetensors")), read_bytes(dir.file("f32/model.safetensors")));
}

TEST(TinyCli, WritesListsAndRejects) {
  TempDir dir;
  const std::string cli = MOEKIT_CLI;
  ASSERT_EQ(run_shell(cli + " tiny --arch olmoe --out " + dir.file("cli") + " --seed 3 >" + dir.file("out")), 0);
  write_tiny_checkpoint("olmoe", dir.file("lib"), 3);
  EXPECT_EQ(read_bytes(dir.file("cli/model.safetensors")), read_bytes(dir.file("lib/model.safetensors")));
  EXPECT_NE(read_bytes(dir.file("out")).find("69 tensors"), std::string::npos) << read_bytes(dir.file("out"));
  ASSERT_EQ(run_shell(cli + " tiny --list >" + dir.file("list")), 0);
  for (const auto& a : kArchs) EXPECT_NE(read_bytes(dir.file("list")).find(a), std::string::npos);
  EXPECT_NE(run_shell(cli + " tiny --arch nope --out " + dir.file("x") + " 2>" + dir.file("err")), 0);
  EXPECT_NE(read_bytes(dir.file("err")).find("unknown architecture 'nope'"), std::string::npos)
      << read_bytes(dir.file("err"));
  EXPECT_NE(run_shell(cli + " tiny --arch olmoe 2>/dev/null"), 0);  // no --out
}

TEST(TinyTransformers, LoadsWithoutMissingOrUnexpectedKeys) {
  if (run_shell("python3 -c 'import torch, transformers' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3 with torch and transformers is not available";
  TempDir dir;
  std::string dirs;
  for (const auto& arch : kArchs) {
    write_tiny_checkpoint(arch, dir.file(arch), 1);
    dirs.append(" ").append(dir.file(arch));
  }
  write_tiny_checkpoint("qwen3_vl_moe", dir.file("vl_bf16"), TinyOptions{.seed = 2, .dtype = DType::bf16, .shards = 2});
  dirs.append(" ").append(dir.file("vl_bf16"));
  std::ofstream(dir.file("check.py")) << R"py(
import json, os, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import torch, transformers
transformers.logging.set_verbosity_error()
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
bad = 0
for d in sys.argv[1:]:
    cfg = AutoConfig.from_pretrained(d)
    try:
        m, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True, dtype=torch.float32)
    except ValueError:
        m, info = AutoModelForImageTextToText.from_pretrained(d, output_loading_info=True, dtype=torch.float32)
    problems = {k: sorted(v)[:4] for k, v in info.items() if v}
    with tempfile.TemporaryDirectory() as t:  # the config as transformers itself would save it
        cfg.save_pretrained(t)
        same = json.load(open(os.path.join(t, "config.json"))) == json.load(open(os.path.join(d, "config.json")))
    with torch.no_grad():
        logits = m(input_ids=torch.arange(9)[None] * 17 % 160).logits
    ok = not problems and same and bool(torch.isfinite(logits).all()) and float(logits.std()) > 0.1
    bad += not ok
    print(os.path.basename(d), type(m).__name__, "OK" if ok else "FAIL", problems, "config equal" if same else "config differs")
sys.exit(1 if bad else 0)
)py";
  const int rc = run_shell("python3 " + dir.file("check.py") + dirs + " >" + dir.file("log") + " 2>&1");
  const std::string log = read_bytes(dir.file("log"));
  EXPECT_EQ(rc, 0) << log;
  for (const auto& arch : kArchs) EXPECT_NE(log.find(arch + " "), std::string::npos) << log;
  EXPECT_EQ(log.find("FAIL"), std::string::npos) << log;
}

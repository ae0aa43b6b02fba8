// FP8 checkpoints (SPEC section 5): the fixtures of tests/fixtures/quant (made with transformers on weights
// dequantized with exact 128 x 128 blocks, scripts/make_fp8_fixture.py), `moekit tiny --quantize fp8` for every
// per-expert architecture, `moekit run --dequantize`, and the refusals.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moekit/model.h"
#include "moekit/safetensors.h"
#include "test_util.h"
#include "tiny/tiny.h"

namespace fs = std::filesystem;
using namespace moekit;
using test::rel_l2;
using test::row_ids;

namespace {

std::vector<std::string> quant_fixtures() {
  std::vector<std::string> out;
  const std::string d = test::fixtures_dir() + "/quant";
  if (!fs::is_directory(d)) return out;
  for (const auto& e : fs::directory_iterator(d))
    if (fs::exists(e.path() / "reference.safetensors")) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

class QuantFixture : public ::testing::TestWithParam<std::string> {};

// Dequantized at load (--dequantize): transformers' logits and greedy tokens on the same weights, every CPU backend.
// Kept in FP8: the experts run quantized (activations too), a few percent from the dequantized logits, the same on
// every backend. MXFP4 (gpt-oss; transformers dequantizes it on the CPU): kept in FP4 with float activations, the
// logits and tokens are transformers' too.
TEST_P(QuantFixture, DequantizedMatchesTransformersAndFp8StaysClose) {
  const std::string dir = test::fixtures_dir() + "/quant/" + GetParam();
  const auto ref = SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = ref.get("input_ids"), gen = ref.get("generated_ids"), ref_logits = ref.get("logits.grouped_mm");
  const int64_t B = ids.size(0), L = ids.size(1);
  Model deq = Model::from_pretrained(dir, {.device = Device::cpu(), .dtype = DType::f32, .dequantize = true});
  for (const Experts* e : deq.experts_modules()) EXPECT_FALSE(e->is_quantized());
  Model fp8 = Model::from_pretrained(dir, {.device = Device::cpu(), .dtype = DType::f32});
  ASSERT_FALSE(fp8.experts_modules().empty());
  for (const Experts* e : fp8.experts_modules()) EXPECT_TRUE(e->is_quantized());
  const int64_t V = deq.config().text.vocab_size;
  const bool mxfp4 = GetParam().find("mxfp4") != std::string::npos;
  std::vector<float> first_fp8;
  for (const char* be : {"eager", "batched_mm", "grouped_mm"}) {
    SCOPED_TRACE(std::string("backend ") + be);
    deq.set_experts_implementation(be);
    fp8.set_experts_implementation(be);
    for (int64_t r = 0; r < B; ++r) {
      const Tensor a = deq.logits(row_ids(ids, r)), q = fp8.logits(row_ids(ids, r));
      const float* rl = ref_logits.ptr<float>() + r * L * V;
      EXPECT_LT(rel_l2(a.ptr<float>(), rl, L * V), 1e-4) << GetParam() << " row " << r;
      const double e8 = rel_l2(q.ptr<float>(), rl, L * V);
      if (mxfp4) {  // float activations: the quantized run is the dequantized one
        EXPECT_LT(e8, 1e-4) << GetParam() << " row " << r;
        continue;
      }
      EXPECT_LT(e8, 0.1) << GetParam() << " row " << r;
      std::printf("%s %s row %lld: FP8 logits vs dequantized reference, relative L2 %.3g\n", GetParam().c_str(), be,
                  static_cast<long long>(r), e8);
      EXPECT_GT(e8, 1e-6) << GetParam() << " row " << r << ": the FP8 run did not quantize the activations";
      if (r == 0) {
        if (first_fp8.empty())
          first_fp8.assign(q.ptr<float>(), q.ptr<float>() + L * V);
        else
          EXPECT_LT(rel_l2(q.ptr<float>(), first_fp8.data(), L * V), 1e-5) << "FP8 backends disagree";
      }
    }
    GenerationConfig gc;
    gc.max_new_tokens = gc.min_new_tokens = gen.size(1) - L;
    const std::vector<int64_t> expect(gen.ptr<int64_t>() + L, gen.ptr<int64_t>() + gen.size(1));
    EXPECT_EQ(deq.generate(row_ids(ids, 0), gc).tokens, expect) << GetParam();
    if (mxfp4) EXPECT_EQ(fp8.generate(row_ids(ids, 0), gc).tokens, expect) << GetParam();
  }
}

INSTANTIATE_TEST_SUITE_P(Fp8, QuantFixture, ::testing::ValuesIn(quant_fixtures()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(QuantFixture);

TEST(QuantCheckpoint, TinyFp8LoadsForEveryPerExpertArchitecture) {
  for (const char* arch : {"qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3"}) {
    SCOPED_TRACE(arch);
    test::TempDir q("moekit_fp8"), f("moekit_f32");
    write_tiny_checkpoint(arch, q.str(), TinyOptions{.seed = 9, .quantize = "fp8"});
    write_tiny_checkpoint(arch, f.str(), TinyOptions{.seed = 9});
    const auto st = SafetensorsFile::open(q.file("model.safetensors"));
    int fp8 = 0;
    for (const auto& name : st.names())
      if (st.get(name).dtype() == DType::f8e4m3) {
        ++fp8;
        EXPECT_TRUE(st.contains(name.substr(0, name.size() - 7) + ".weight_scale_inv")) << name;
      }
    EXPECT_GT(fp8, 0);
    Model m8 = Model::from_pretrained(q.str(), {.dtype = DType::f32});
    Model mf = Model::from_pretrained(f.str(), {.dtype = DType::f32});
    const std::vector<int64_t> ids{3, 1, 4, 1, 5, 9, 2, 6};
    const Tensor a = m8.logits(ids), b = mf.logits(ids);
    const double err = rel_l2(a.ptr<float>(), b.ptr<float>(), a.numel());
    EXPECT_LT(err, 0.2) << "FP8 weights and activations against the float checkpoint";
    EXPECT_GT(err, 1e-6);
  }
}

TEST(QuantCheckpoint, ShardedFp8LoadsAsTheSingleFile) {
  test::TempDir one("moekit_fp8_one"), two("moekit_fp8_two");
  write_tiny_checkpoint("deepseek_v3", one.str(), TinyOptions{.seed = 2, .quantize = "fp8"});
  write_tiny_checkpoint("deepseek_v3", two.str(), TinyOptions{.seed = 2, .shards = 3, .quantize = "fp8"});
  ASSERT_TRUE(fs::exists(two.file("model.safetensors.index.json")));
  const std::vector<int64_t> ids{7, 3, 9, 1};
  const Tensor a = Model::from_pretrained(one.str()).logits(ids), b = Model::from_pretrained(two.str()).logits(ids);
  ASSERT_EQ(a.numel(), b.numel());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
}

TEST(QuantCheckpoint, TinyFp4AndMxfp4Load) {
  struct Case {
    const char* arch;
    const char* format;
  };
  {  // tiny mixtral's intermediate size (48) is no multiple of 32: FP4 is refused, naming it
    test::TempDir q("moekit_fp4");
    const std::string msg =
        test::error_of([&] { write_tiny_checkpoint("mixtral", q.str(), TinyOptions{.quantize = "fp4"}); });
    EXPECT_NE(msg.find("multiple of 32, got 48"), std::string::npos) << msg;
  }
  for (const Case c : {Case{"qwen3_moe", "fp4"}, Case{"deepseek_v3", "fp4"}, Case{"olmoe", "fp4"},
                       Case{"gpt_oss", "mxfp4"}}) {
    SCOPED_TRACE(std::string(c.arch) + " " + c.format);
    test::TempDir q("moekit_fp4");
    write_tiny_checkpoint(c.arch, q.str(), TinyOptions{.seed = 4, .quantize = c.format});
    Model m = Model::from_pretrained(q.str(), {.dtype = DType::f32});
    Model d = Model::from_pretrained(q.str(), {.dtype = DType::f32, .dequantize = true});
    ASSERT_FALSE(m.experts_modules().empty());
    for (const Experts* e : m.experts_modules()) EXPECT_EQ(e->weight_dtype(), DType::f4e2m1);
    for (const Experts* e : d.experts_modules()) EXPECT_EQ(e->weight_dtype(), DType::f32);
    const std::vector<int64_t> ids{3, 1, 4, 1, 5, 9, 2, 6};
    const Tensor a = m.logits(ids), b = d.logits(ids);
    const double err = rel_l2(a.ptr<float>(), b.ptr<float>(), a.numel());
    if (std::string(c.format) == "mxfp4")
      EXPECT_LT(err, 1e-5);  // float activations: FP4 weights in the tile are the dequantized ones
    else
      EXPECT_LT(err, 0.1);  // w4a8: activations quantized to FP8
  }
}

TEST(QuantCheckpoint, CliQuantizeWritesWhatTinyQuantizeWrites) {
  test::TempDir f("moekit_float"), q("moekit_q"), t("moekit_t");
  write_tiny_checkpoint("qwen3_moe", f.str(), TinyOptions{.seed = 5, .shards = 2});
  for (const char* format : {"fp8", "fp4"}) {
    SCOPED_TRACE(format);
    const test::CliResult r = test::run_cli("quantize --in " + f.str() + " --out " + q.str() + " --format " + format);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(fs::exists(q.file("tokenizer.json")));
    EXPECT_FALSE(fs::exists(q.file("model.safetensors.index.json")));
    write_tiny_checkpoint("qwen3_moe", t.str(), TinyOptions{.seed = 5, .quantize = format});
    const auto a = SafetensorsFile::open(q.file("model.safetensors")), b = SafetensorsFile::open(t.file("model.safetensors"));
    ASSERT_EQ(a.names().size(), b.names().size());
    for (const auto& name : b.names()) {
      ASSERT_TRUE(a.contains(name)) << name;
      const Tensor x = a.get(name), y = b.get(name);
      ASSERT_EQ(x.dtype(), y.dtype()) << name;
      ASSERT_EQ(x.shape(), y.shape()) << name;
      EXPECT_EQ(std::memcmp(x.data(), y.data(), x.nbytes()), 0) << name;
    }
    const test::CliResult again = test::run_cli("quantize --in " + q.str() + " --out " + t.str() + " --format fp8");
    EXPECT_NE(again.code, 0);
    EXPECT_NE(again.out.find("already quantized"), std::string::npos) << again.out;
  }
  const test::CliResult mx = test::run_cli("quantize --in " + f.str() + " --out " + q.str() + " --format mxfp4");
  EXPECT_NE(mx.code, 0);
  EXPECT_NE(mx.out.find("gpt-oss"), std::string::npos) << mx.out;
}

TEST(QuantCheckpoint, StaticActivationsAndOtherSchemesAreRefused) {
  test::TempDir d("moekit_fp8_static");
  write_tiny_checkpoint("qwen3_moe", d.str(), TinyOptions{.quantize = "fp8"});
  nlohmann::json c = nlohmann::json::parse(std::ifstream(d.file("config.json")));
  auto expect_refused = [&](const nlohmann::json& qc, const std::string& needle) {
    c["quantization_config"] = qc;
    std::ofstream(d.file("config.json")) << c.dump();
    ErrorCode code{};
    const std::string msg = test::error_of([&] { Model::from_pretrained(d.str()); }, &code);
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(code, ErrorCode::not_supported) << msg;
  };
  nlohmann::json qc = fp8_quantization_config();
  qc["activation_scheme"] = "static";
  expect_refused(qc, "activation_scheme 'static' is not supported");
  qc = fp8_quantization_config();
  qc["weight_block_size"] = {64, 64};
  expect_refused(qc, "[128, 128]");
  qc = fp8_quantization_config();
  qc["quant_method"] = "awq";
  expect_refused(qc, "quant_method 'awq'");
  // FP8 tensors without a quantization_config: an error naming the tensor, not silently converted values.
  c.erase("quantization_config");
  std::ofstream(d.file("config.json")) << c.dump();
  const std::string msg = test::error_of([&] { Model::from_pretrained(d.str()); });
  EXPECT_NE(msg.find("is f8e4m3 but config.json has no FP8 quantization_config"), std::string::npos) << msg;
}

TEST(QuantCheckpoint, CliTinyInspectAndRunDequantize) {
  test::TempDir d("moekit_fp8_cli");
  const test::CliResult w = test::run_cli("tiny --arch qwen3_moe --quantize fp8 --out " + d.str());
  ASSERT_EQ(w.code, 0) << w.out;
  EXPECT_NE(w.out.find("fp8"), std::string::npos) << w.out;
  const test::CliResult i = test::run_cli("inspect " + d.str());
  EXPECT_NE(i.out.find("F8_E4M3"), std::string::npos) << i.out;
  EXPECT_NE(i.out.find("weight_scale_inv"), std::string::npos) << i.out;
  EXPECT_NE(i.out.find("\"quant_method\":\"fp8\""), std::string::npos) << i.out;
  for (const char* extra : {"", " --dequantize"}) {
    const test::CliResult r =
        test::run_cli("run --model " + d.str() + " --prompt-ids 1,2,3 --max-new-tokens 3 --json --quiet" + extra, false);
    EXPECT_EQ(r.code, 0) << extra << r.out;
    EXPECT_NE(r.out.find("generated_ids"), std::string::npos) << r.out;
  }
}

TEST(QuantBench, FloorCountsTheQuantizedBytesAndOutputsAreChecked) {
  auto records = [](const std::string& quant) {
    const test::CliResult r = test::run_cli(
        "bench --dims 256,128,4,2 --tokens 1,8 --backends grouped_mm,batched_mm --json - --iters 2 --min-iters 1 "
        "--min-time 0 --warmup 1 --peak-tflops 1 --bandwidth-gbps 10 --quiet" + quant,
        false);
    EXPECT_EQ(r.code, 0) << r.out;
    return nlohmann::json::parse(r.out)["records"];
  };
  const nlohmann::json bf16 = records(""), fp8 = records(" --quant fp8"), mx = records(" --quant mxfp4");
  ASSERT_EQ(fp8.size(), 4u);
  ASSERT_EQ(mx.size(), 4u);
  for (size_t i = 0; i < fp8.size(); ++i) {
    EXPECT_EQ(fp8[i]["dtype"], "bf16+fp8");
    EXPECT_LT(fp8[i]["rel_err"].get<double>(), 1e-2);
    EXPECT_LT(mx[i]["rel_err"].get<double>(), 1e-2);
    // Per expert hit: 3 * 256 * 128 weights, 2 bytes each in bf16, 1 in fp8 plus 6 f32 block scales, 0.5 + 1/32 in
    // mxfp4 (same routing: same seed).
    const double touched = fp8[i]["experts_touched"].get<double>(), n = 3 * 256 * 128;
    EXPECT_EQ(touched, bf16[i]["experts_touched"].get<double>());
    EXPECT_NEAR(bf16[i]["bytes"].get<double>() - fp8[i]["bytes"].get<double>(), touched * (n - 24), 1e-6) << i;
    EXPECT_NEAR(fp8[i]["bytes"].get<double>() - mx[i]["bytes"].get<double>(), touched * (n + 24 - n * (0.5 + 1.0 / 32)),
                1e-6) << i;
  }
}

}  // namespace

// Hardening: malformed or hostile checkpoints, configs, case files and flags get one clear error
// naming the value (never a crash, a hang or unbounded memory); valid extremes run in memory
// proportional to the checkpoint. One test per reproducer of the hardening issue, and the fidelity
// rule for tied embeddings in composite configs.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "experts_case.h"
#include "io/input.h"
#include "tiny/tiny.h"
#include "moekit/moekit.h"
#include "moekit/safetensors.h"
#include "test_util.h"

using namespace moekit;
using moekit::test::error_of;
using moekit::test::TempDir;
using moekit::test::CliResult;
using moekit::test::run_cli;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr double kSlowdown = 20;  // sanitizer builds
#else
constexpr double kSlowdown = 1;
#endif

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

// One line: the message has no newline inside (the CLI adds one at the end).
bool one_line(const std::string& s) {
  const size_t nl = s.find('\n');
  return nl == std::string::npos || nl + 1 == s.size();
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}
void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), std::streamsize(text.size()));
}
void write_json(const std::string& path, const json& j) { write_text(path, j.dump()); }

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char(uint8_t(v >> (8 * i)));
  return s;
}

// A tiny checkpoint of `arch` in dir/name, its config edited by `edit`.
std::string tiny(const TempDir& dir, const std::string& arch, const std::function<void(json&)>& edit = {},
                 const std::string& name = "m") {
  const std::string d = dir.file(name);
  write_tiny_checkpoint(arch, d, 0);
  if (edit) {
    json c = read_json(d + "/config.json");
    edit(c);
    write_json(d + "/config.json", c);
  }
  return d;
}

// The checkpoint's tensors rewritten by `edit` (name -> tensor; erase to drop one).
void edit_weights(const std::string& d, const std::function<void(std::map<std::string, Tensor>&)>& edit) {
  std::map<std::string, Tensor> t;
  {
    const auto f = SafetensorsFile::open(d + "/model.safetensors");
    for (const auto& n : f.names()) t[n] = f.get(n).contiguous().to(Device::cpu());
    for (auto& [n, v] : t) v = Tensor::copy_of(v.view(), Device::cpu());
  }
  edit(t);
  std::vector<std::pair<std::string, Tensor>> out(t.begin(), t.end());
  save_safetensors(d + "/model.safetensors", out);
}

std::string load_error(const std::string& dir, ModelOptions o = {}) {
  return error_of([&] { Model::from_pretrained(dir, o); });
}

}  // namespace

// ---- 1. size arithmetic: the KV cache and prompt + max_new_tokens ----

TEST(Hardening, HugeShapeIsAnErrorNotAWrappedAllocation) {
  const std::string e = error_of([] { Tensor::empty({int64_t(1) << 40, int64_t(1) << 40}, DType::f32); });
  EXPECT_TRUE(has(e, "overflows") && has(e, "1099511627776")) << e;
  const std::string e2 = error_of([] { Tensor::empty({int64_t(1) << 61, 4}, DType::f32); });
  EXPECT_TRUE(has(e2, "overflows")) << e2;
}

TEST(Hardening, MaxNewTokensExtremes) {
  TempDir dir;
  const std::string d = tiny(dir, "qwen3_moe");
  Model m = Model::from_pretrained(d);
  GenerationConfig gc;
  // prompt + max_new_tokens overflows int64: one error naming both.
  gc.max_new_tokens = std::numeric_limits<int64_t>::max();
  std::string e = error_of([&] { m.generate({1, 2, 3}, gc); });
  EXPECT_TRUE(has(e, "max_new_tokens") && has(e, "overflows")) << e;
  // Valid but huge (the reproducer's 18014398509481981): the cache is not sized for it up front, so a
  // generation that stops early costs memory for the tokens it made only.
  gc.max_new_tokens = 18014398509481981;
  std::vector<int64_t> all(160);
  for (int64_t i = 0; i < 160; ++i) all[size_t(i)] = i;
  gc.eos_token_ids = all;  // every token stops
  GenerationResult r;
  EXPECT_EQ(error_of([&] { r = m.generate({1, 2, 3}, gc); }), "");
  EXPECT_EQ(r.tokens.size(), 1u);
  EXPECT_TRUE(r.stopped_on_eos);
  gc.max_new_tokens = 1000000000;
  EXPECT_EQ(error_of([&] { r = m.generate({1, 2, 3}, gc); }), "");
  // And through the CLI, refused before loading when negative.
  const CliResult c = run_cli("run --quiet --model " + d + " --prompt-ids 1,2,3 --max-new-tokens -5");
  EXPECT_EQ(c.code, 2) << c.out;
  EXPECT_TRUE(has(c.out, "-5") && one_line(c.out)) << c.out;
}

// ---- 2. config values whose products wrap ----

TEST(Hardening, WrappingHeadCountsAreRefused) {
  TempDir dir;
  const std::string d = tiny(dir, "qwen3_moe", [](json& c) {
    c["num_attention_heads"] = 2305843009213693956ull;
    c["num_key_value_heads"] = 1152921504606846978ull;
    c["head_dim"] = 16;
  });
  const std::string e = load_error(d);
  EXPECT_TRUE(has(e, "num_attention_heads")) << e;
  EXPECT_TRUE(has(e, "2305843009213693956")) << e;
  EXPECT_TRUE(one_line(e)) << e;
  // Within the integer bound but heads x head_dim x hidden overflowing int64.
  const std::string d2 = tiny(
      dir, "qwen3_moe",
      [](json& c) {
        c["num_attention_heads"] = int64_t(1) << 36;
        c["num_key_value_heads"] = int64_t(1) << 36;
        c["head_dim"] = int64_t(1) << 30;
      },
      "m2");
  const std::string e2 = load_error(d2);
  EXPECT_TRUE(has(e2, "num_attention_heads") && has(e2, "overflows")) << e2;
}

TEST(Hardening, ConfigClaimsBeyondTheCheckpointBytes) {
  TempDir dir;
  // Heads x head_dim that fit in int64 but describe far more than the tensors hold.
  const std::string d = tiny(dir, "qwen3_moe", [](json& c) {
    c["num_attention_heads"] = 1 << 20;
    c["num_key_value_heads"] = 1 << 20;
  });
  const std::string e = load_error(d);
  EXPECT_TRUE(has(e, "more than the checkpoint holds") && has(e, "num_attention_heads")) << e;
}

// ---- 3. moekit check --case validates the call before the reference runs ----

TEST(Hardening, CaseFileCallIsValidatedBeforeAnyRead) {
  const std::string src = test::fixtures_dir() + "/experts/mixtral_gated_silu.safetensors";
  TempDir dir;
  auto variant = [&](const std::string& name, const std::function<void(std::map<std::string, Tensor>&)>& edit) {
    const auto f = SafetensorsFile::open(src);
    std::map<std::string, Tensor> t;
    for (const auto& n : f.names()) t[n] = Tensor::copy_of(f.get(n).view(), Device::cpu());
    edit(t);
    const std::string path = dir.file(name + ".safetensors");
    save_safetensors(path, std::vector<std::pair<std::string, Tensor>>(t.begin(), t.end()), f.metadata());
    return path;
  };
  const std::vector<std::pair<std::string, Shape>> bad_x = {{"x37x1", {37, 1}}, {"x1d", {37}}, {"x0d", {}}};
  for (const auto& [name, shape] : bad_x) {
    const std::string path = variant(name, [&](auto& t) { t["hidden_states"] = Tensor::zeros(shape, DType::f32); });
    const std::string e = error_of([&] { load_experts_case(path); });
    EXPECT_TRUE(has(e, "hidden_states must be")) << name << ": " << e;
    const CliResult c = run_cli("check --case " + path);
    EXPECT_EQ(c.code, 2) << c.out;
    EXPECT_TRUE(has(c.out, "hidden_states must be") && one_line(c.out)) << c.out;
  }
  const std::string idx = variant("idx", [&](auto& t) {
    Tensor i = Tensor::copy_of(t["top_k_index"].view(), Device::cpu());
    if (i.dtype() == DType::i64)
      i.template ptr<int64_t>()[0] = 1 << 30;
    else
      i.template ptr<int32_t>()[0] = 1 << 30;
    t["top_k_index"] = i;
  });
  const std::string e = error_of([&] { load_experts_case(idx); });
  EXPECT_TRUE(has(e, "expert 1073741824")) << e;
  const std::string w = variant("w", [&](auto& t) { t["top_k_weights"] = Tensor::zeros({1}, DType::f32); });
  EXPECT_TRUE(has(error_of([&] { load_experts_case(w); }), "top_k_weights must be"));
}

// ---- 4. deeply nested JSON ----

TEST(Hardening, DeeplyNestedJsonIsRefused) {
  TempDir dir;
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  // In a safetensors header field.
  const std::string header = R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":)" + deep + "}}";
  write_text(dir.file("deep.safetensors"), le64(header.size()) + header);
  std::string e = error_of([&] { SafetensorsFile::open(dir.file("deep.safetensors")); });
  EXPECT_TRUE(has(e, "nests deeper")) << e;
  // In a config field.
  const std::string d = tiny(dir, "qwen3_moe");
  std::string cfg = read_json(d + "/config.json").dump();
  cfg.insert(1, "\"deep\":" + deep + ",");
  write_text(d + "/config.json", cfg);
  e = load_error(d);
  EXPECT_TRUE(has(e, "nests deeper than 128")) << e;
  EXPECT_TRUE(one_line(e)) << e;
  // Messages quote values within bounds.
  json wide = json::array();
  for (int i = 0; i < 100000; ++i) wide.push_back(i);
  EXPECT_LE(json_brief(wide).size(), 60u);
}

// ---- 5. linear-time header parsing ----

TEST(Hardening, HundredThousandTensorHeaderParsesFast) {
  std::string header = "{";
  for (int i = 0; i < 100000; ++i)
    header += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
  header += "}";
  TempDir dir;
  write_text(dir.file("many.safetensors"), le64(header.size()) + header);
  // CPU time of this thread, so that a busy machine does not fail the test (the parse is single-threaded).
  auto cpu_seconds = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  const double t0 = cpu_seconds();
  const auto f = SafetensorsFile::open(dir.file("many.safetensors"));
  const double s = cpu_seconds() - t0;
  EXPECT_EQ(f.entries().size(), 100000u);
  EXPECT_LT(s, 1.0 * kSlowdown) << "100k tensors took " << s << " s of CPU time";
}

TEST(Hardening, HeaderUnknownFieldsAreSkippedUnread) {
  // The reference implementation ignores fields a tensor entry does not have; so does moekit, without
  // keeping them (the header is read one entry at a time, never as a whole DOM).
  std::string extra;
  for (int i = 0; i < 200000; ++i) extra += ",\"x" + std::to_string(i) + "\":" + std::to_string(i);
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"y":{"k":1},"z":[1,2])" +
                             extra + R"(},"__metadata__":{"m":"v"}})";
  TempDir dir;
  write_text(dir.file("extra.safetensors"), le64(header.size()) + header + std::string(8, '\0'));
  const auto f = SafetensorsFile::open(dir.file("extra.safetensors"));
  ASSERT_EQ(f.entries().size(), 1u);
  EXPECT_EQ(f.entry("a").shape, (Shape{2}));
  EXPECT_EQ(f.metadata().at("m"), "v");
  // Containers nested in a skipped field are still bounded: a fourth level is refused.
  const std::string deep = R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"y":{"k":[[1]]}}})";
  write_text(dir.file("deep4.safetensors"), le64(deep.size()) + deep);
  EXPECT_TRUE(has(error_of([&] { SafetensorsFile::open(dir.file("deep4.safetensors")); }), "nests deeper"));
}

// ---- 6. unbounded work from config values ----

TEST(Hardening, HugeExpertAndLayerCountsFailFast) {
  TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string d = tiny(dir, "qwen3_moe", [](json& c) { c["num_experts"] = int64_t(1) << 31; });
  std::string e = load_error(d);
  EXPECT_TRUE(has(e, "num_experts") && has(e, "2147483648") && has(e, "more than the checkpoint holds")) << e;
  const std::string d2 = tiny(
      dir, "qwen3_moe", [](json& c) { c["num_hidden_layers"] = int64_t(1) << 29; }, "m2");
  e = load_error(d2);
  EXPECT_TRUE(has(e, "num_hidden_layers") && has(e, "536870912")) << e;
  const std::string d3 = tiny(
      dir, "qwen3_moe", [](json& c) { c["num_hidden_layers"] = 5000; }, "m3");
  e = load_error(d3);
  EXPECT_TRUE(has(e, "num_hidden_layers 5000") && has(e, "more than the checkpoint holds")) << e;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10 * kSlowdown);
}

// ---- 7. validation before conversion ----

TEST(Hardening, MissingLmHeadIsReportedBeforeConversion) {
  TempDir dir;
  const std::string d = tiny(dir, "qwen3_moe");
  edit_weights(d, [](auto& t) { t.erase("lm_head.weight"); });
  ModelOptions o;
  o.dtype = DType::bf16;
  const std::string e = load_error(d, o);
  EXPECT_TRUE(has(e, "lm_head.weight") && has(e, "missing")) << e;
  // A header nesting arrays inside a tensor is refused by the linear pre-pass, before any DOM is built.
  const std::string header = R"({"a":{"dtype":"F32","shape":[[0]],"data_offsets":[0,0]}})";
  write_text(dir.file("nested.safetensors"), le64(header.size()) + header);
  EXPECT_TRUE(has(error_of([&] { SafetensorsFile::open(dir.file("nested.safetensors")); }), "nests deeper"));
}

// ---- 8. files, non-finite values, eps / theta, flags, names ----

TEST(Hardening, FifoAndDirectoryInPlaceOfFiles) {
  TempDir dir;
  const std::string d = tiny(dir, "qwen3_moe");
  fs::remove(d + "/config.json");
  ASSERT_EQ(mkfifo((d + "/config.json").c_str(), 0600), 0);
  std::string e = load_error(d);
  EXPECT_TRUE(has(e, "FIFO")) << e;
  fs::remove(d + "/config.json");
  fs::create_directory(d + "/config.json");
  e = load_error(d);
  EXPECT_TRUE(has(e, "is a directory")) << e;
  EXPECT_FALSE(has(e, "no such file")) << e;
  // A FIFO shard.
  const std::string d2 = tiny(dir, "qwen3_moe", {}, "m2");
  fs::remove(d2 + "/model.safetensors");
  ASSERT_EQ(mkfifo((d2 + "/model.safetensors").c_str(), 0600), 0);
  e = load_error(d2);
  EXPECT_TRUE(has(e, "FIFO")) << e;
  e = error_of([&] { SafetensorsFile::open(d2 + "/model.safetensors"); });
  EXPECT_TRUE(has(e, "FIFO")) << e;
  e = error_of([&] { SafetensorsFile::open(dir.str()); });
  EXPECT_TRUE(has(e, "is a directory")) << e;
}

TEST(Hardening, NonFiniteWeightsAndLogits) {
  TempDir dir;
  const std::string d = tiny(dir, "qwen3_moe");
  edit_weights(d, [](auto& t) {
    Tensor& w = t["model.layers.1.self_attn.o_proj.weight"];
    w.template ptr<float>()[5] = std::numeric_limits<float>::quiet_NaN();
  });
  std::string e = load_error(d);
  EXPECT_TRUE(has(e, "model.layers.1.self_attn.o_proj.weight") && has(e, "non-finite") && has(e, "element 5")) << e;
  // Unchecked, the NaN reaches the logits: reported, not a silent token.
  ModelOptions o;
  o.check_finite = false;
  Model m = Model::from_pretrained(d, o);
  GenerationConfig gc;
  gc.max_new_tokens = 2;
  e = error_of([&] { m.generate({1, 2, 3}, gc); });
  EXPECT_TRUE(has(e, "not finite")) << e;
  const CliResult c = run_cli("run --quiet --model " + d + " --prompt-ids 1,2,3 --no-check-finite");
  EXPECT_EQ(c.code, 2) << c.out;
  // With a tokenizer.json the text streams to stdout first; the error itself is one line, and the last.
  const size_t at = c.out.find("moekit: error");
  ASSERT_NE(at, std::string::npos) << c.out;
  EXPECT_TRUE(has(c.out, "not finite") && one_line(c.out.substr(at))) << c.out;
}

TEST(Hardening, EpsAndRopeThetaMustBePositive) {
  TempDir dir;
  for (double eps : {0.0, -1e-6}) {
    const std::string d = tiny(
        dir, "qwen3_moe", [&](json& c) { c["rms_norm_eps"] = eps; }, "eps");
    const std::string e = load_error(d);
    EXPECT_TRUE(has(e, "rms_norm_eps") && has(e, "must be > 0")) << e;
  }
  const std::string d = tiny(
      dir, "qwen3_moe",
      [](json& c) {
        if (c.contains("rope_parameters")) c["rope_parameters"]["rope_theta"] = 0.0;
        c["rope_theta"] = 0.0;
      },
      "theta");
  const std::string e = load_error(d);
  EXPECT_TRUE(has(e, "rope_theta") && has(e, "must be > 0")) << e;
}

TEST(Hardening, StrictFlags) {
  TempDir dir;
  const std::string d = tiny(dir, "qwen3_moe");
  const std::string base = "run --quiet --model " + d + " --prompt-ids 1,2,3 --max-new-tokens 2";
  for (const std::string seed : {"-1", "18446744073709551616", "1e3", " 7"}) {
    const CliResult c = run_cli(base + " --sample --seed '" + seed + "'");
    EXPECT_EQ(c.code, 2) << seed << ": " << c.out;
    EXPECT_TRUE(has(c.out, "--seed") && one_line(c.out)) << c.out;
  }
  EXPECT_EQ(run_cli(base + " --sample --seed 18446744073709551615").code, 0);
  for (const std::string flag : {"--temperature 0.5", "--top-k 3", "--top-p 0.9", "--seed 4"}) {
    const CliResult c = run_cli(base + " " + flag);
    EXPECT_EQ(c.code, 2) << flag << ": " << c.out;
    EXPECT_TRUE(has(c.out, "--sample") && one_line(c.out)) << c.out;
  }
  for (const std::string ids : {"1,,2", "+1", " 1", "1,2,", "9223372036854775808", ""}) {
    const CliResult c = run_cli("run --quiet --model " + d + " --prompt-ids '" + ids + "'");
    EXPECT_EQ(c.code, 2) << ids << ": " << c.out;
  }
  EXPECT_EQ(run_cli("tiny --arch olmoe --out " + dir.file("t") + " --seed -1").code, 2);
}

TEST(Hardening, NamesAndLargeValuesPrintFaithfully) {
  TempDir dir;
  // 2^63 in a config prints as itself.
  const std::string d = tiny(dir, "qwen3_moe", [](json& c) { c["vocab_size"] = 9223372036854775808ull; });
  std::string e = load_error(d);
  EXPECT_TRUE(has(e, "9223372036854775808") && !has(e, "-9223372036854775808")) << e;
  // A NUL in a shard name does not cut the message.
  const std::string d2 = tiny(dir, "qwen3_moe", {}, "m2");
  fs::rename(d2 + "/model.safetensors", d2 + "/shard.safetensors");
  json index;
  index["weight_map"]["model.embed_tokens.weight"] = std::string("sh\0ard.safetensors", 18);
  write_json(d2 + "/model.safetensors.index.json", index);
  e = load_error(d2);
  EXPECT_TRUE(has(e, "sh\\x00ard.safetensors") && has(e, "control character")) << e;
}

// ---- 9. tie_word_embeddings in composite configs follows the top-level config ----

TEST(Hardening, CompositeTieFollowsTopLevelConfig) {
  TempDir dir;
  const std::string plain = tiny(dir, "qwen3_vl_moe", {}, "plain");
  const std::string text_tied = tiny(
      dir, "qwen3_vl_moe", [](json& c) { c["text_config"]["tie_word_embeddings"] = true; }, "text_tied");
  EXPECT_FALSE(ModelConfig::load(text_tied).text.tie_word_embeddings);
  // Same logits as the checkpoint's stored lm_head (transformers' rule), not the embedding's.
  Model a = Model::from_pretrained(plain), b = Model::from_pretrained(text_tied);
  const Tensor la = a.logits({1, 2, 3}), lb = b.logits({1, 2, 3});
  ASSERT_EQ(la.shape(), lb.shape());
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.nbytes()), 0);
  // Top-level true ties, whatever text_config says.
  const std::string top_tied = tiny(
      dir, "qwen3_vl_moe",
      [](json& c) {
        c["tie_word_embeddings"] = true;
        c["text_config"]["tie_word_embeddings"] = false;
      },
      "top_tied");
  EXPECT_TRUE(ModelConfig::load(top_tied).text.tie_word_embeddings);
  const Tensor lt = Model::from_pretrained(top_tied).logits({1, 2, 3});
  EXPECT_NE(std::memcmp(la.data(), lt.data(), la.nbytes()), 0);
  // Absent at the top level: the composite config's default, false.
  const std::string absent = tiny(
      dir, "qwen3_vl_moe",
      [](json& c) {
        c.erase("tie_word_embeddings");
        c["text_config"]["tie_word_embeddings"] = true;
      },
      "absent");
  EXPECT_FALSE(ModelConfig::load(absent).text.tie_word_embeddings);
}

// ---- peak memory while loading ----

namespace {
// Peak RSS (bytes) of `moekit ARGS` run as a child process; -1 when it fails.
int64_t child_peak_rss(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  std::string cli = MOEKIT_CLI;
  argv.push_back(cli.data());
  std::vector<std::string> a = args;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    freopen("/dev/null", "w", stdout);
    execv(cli.c_str(), argv.data());
    _exit(127);
  }
  int status = 0;
  rusage ru{};
  if (wait4(pid, &status, 0, &ru) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  return int64_t(ru.ru_maxrss) * 1024;
}
}  // namespace

TEST(Hardening, PeakRssWhileLoadingStaysNearTheCheckpointSize) {
  if (kSlowdown > 1) GTEST_SKIP() << "RSS is not meaningful under the sanitizers";
  TempDir dir;
  // A qwen3_moe checkpoint of about 100 MB (per-expert tensors, fused at load) written with tiny's names.
  json c = tiny_config("qwen3_moe");
  c["hidden_size"] = 512;
  c["num_experts"] = 32;
  c["moe_intermediate_size"] = 256;
  c["num_hidden_layers"] = 3;
  c["vocab_size"] = 2048;
  std::mt19937_64 rng(1);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [name, shape] : tiny_tensor_shapes(c)) {
    const bool norm = name.find("norm") != std::string::npos;
    Tensor t = test::randn(shape, DType::f32, rng, norm ? 0.0 : 0.02);
    if (norm) t.fill_(1.0);
    tensors.emplace_back(name, std::move(t));
  }
  const std::string big = dir.file("big"), small = dir.file("small");
  fs::create_directories(big);
  write_json(big + "/config.json", c);
  save_safetensors(big + "/model.safetensors", tensors);
  tensors.clear();
  write_tiny_checkpoint("qwen3_moe", small, 0);
  const int64_t size = int64_t(fs::file_size(big + "/model.safetensors"));
  ASSERT_GT(size, 60 << 20);
  const int64_t base =
      child_peak_rss({"run", "--quiet", "--model", small, "--prompt-ids", "1,2,3", "--max-new-tokens", "1"});
  ASSERT_GT(base, 0);
  for (const char* dtype : {"f32", "bf16"}) {
    const int64_t peak = child_peak_rss(
        {"run", "--quiet", "--model", big, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--dtype", dtype});
    ASSERT_GT(peak, 0) << dtype;
    // The checkpoint's size plus 10%, over what the process needs for a tiny model (KV cache negligible).
    EXPECT_LE(peak - base, size + size / 10)
        << dtype << ": peak RSS " << peak << " bytes, tiny-model baseline " << base << ", checkpoint " << size;
  }
}

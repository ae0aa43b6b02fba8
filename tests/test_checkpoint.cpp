// Checkpoint folders (single file and sharded) and `moekit inspect`: reading them back, and a clear
// error for every broken folder or file.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "io/checkpoint.h"
#include "test_util.h"

using namespace moekit;
namespace fs = std::filesystem;

namespace {

using moekit::test::TempDir;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const char* kConfig = R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 1, "num_experts": 4,
                         "num_experts_per_tok": 2, "text_config": {"model_type": "inner", "hidden_size": 8}})";

// Six random tensors with names as in a real checkpoint.
std::vector<std::pair<std::string, Tensor>> some_tensors(std::mt19937_64& rng) {
  std::vector<std::pair<std::string, Tensor>> ts;
  for (int e = 0; e < 2; ++e)
    for (const char* p : {"gate_proj", "up_proj", "down_proj"})
      ts.push_back({"model.layers.0.mlp.experts." + std::to_string(e) + "." + p + ".weight",
                    test::randn({4, 8}, e ? DType::bf16 : DType::f32, rng)});
  return ts;
}

// Writes the tensors as `n` shards with an index (or model.safetensors when n == 0).
void write_checkpoint(const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& ts, int n) {
  write_text(dir + "/config.json", kConfig);
  if (n == 0) {
    save_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
    return;
  }
  nlohmann::json map = nlohmann::json::object();
  for (int s = 0; s < n; ++s) {
    std::vector<std::pair<std::string, Tensor>> part;
    const std::string file = "model-0000" + std::to_string(s + 1) + "-of-0000" + std::to_string(n) + ".safetensors";
    for (size_t i = size_t(s); i < ts.size(); i += size_t(n)) {
      part.push_back(ts[i]);
      map[ts[i].first] = file;
    }
    save_safetensors(dir + "/" + file, part, {{"format", "pt"}});
  }
  write_text(dir + "/model.safetensors.index.json", nlohmann::json({{"metadata", {{"total_size", 0}}}, {"weight_map", map}}).dump(1));
}

void expect_same(const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.dtype(), b.dtype());
  ASSERT_EQ(a.shape(), b.shape());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
}

// Checkpoint::open(dir) must throw `code` with a message containing each of `what`.
void expect_open_error(const std::string& dir, ErrorCode code, const std::vector<std::string>& what) {
  try {
    Checkpoint::open(dir);
    ADD_FAILURE() << "opened a broken checkpoint; expected " << error_code_name(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& w : what) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << "no '" << w << "' in: " << e.what();
  }
}

struct CliResult {
  int status = -1;
  std::string out, err;
};

CliResult run_cli(const std::string& args) {
  TempDir tmp;
  const std::string cmd =
      std::string(MOEKIT_CLI) + " " + args + " >" + tmp.file("out") + " 2>" + tmp.file("err");
  const int rc = std::system(cmd.c_str());
  CliResult r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + (WIFSIGNALED(rc) ? WTERMSIG(rc) : 0);
  r.out = read_text(tmp.file("out"));
  r.err = read_text(tmp.file("err"));
  return r;
}

}  // namespace

TEST(Checkpoint, SingleFile) {
  TempDir dir;
  std::mt19937_64 rng(1);
  const auto ts = some_tensors(rng);
  write_checkpoint(dir.str(), ts, 0);
  const Checkpoint ck = Checkpoint::open(dir.str());
  EXPECT_FALSE(ck.sharded());
  EXPECT_EQ(ck.files().size(), 1u);
  EXPECT_EQ(ck.config()["model_type"], "qwen3_moe");
  EXPECT_TRUE(ck.generation_config().is_object() && ck.generation_config().empty());
  auto names = ck.names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  ASSERT_EQ(names.size(), ts.size());
  for (const auto& [n, t] : ts) {
    ASSERT_TRUE(ck.contains(n));
    expect_same(ck.get(n), t);
    EXPECT_EQ(ck.entry(n).shape, t.shape());
  }
}

TEST(Checkpoint, ShardedReadsBackEveryTensor) {
  TempDir dir;
  std::mt19937_64 rng(2);
  const auto ts = some_tensors(rng);
  write_checkpoint(dir.str(), ts, 3);
  write_text(dir.file("generation_config.json"), R"({"eos_token_id": [1, 2]})");
  const Checkpoint ck = Checkpoint::open(dir.str());
  EXPECT_TRUE(ck.sharded());
  EXPECT_EQ(ck.files().size(), 3u);
  EXPECT_EQ(ck.generation_config()["eos_token_id"][1], 2);
  ASSERT_EQ(ck.names().size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    expect_same(ck.get(ts[i].first), ts[i].second);
    EXPECT_EQ(fs::path(ck.file_of(ts[i].first).path()).filename().string(),
              "model-0000" + std::to_string(i % 3 + 1) + "-of-00003.safetensors");
  }
}

TEST(Checkpoint, SingleFileWinsOverIndexAsInTransformers) {
  TempDir dir;
  std::mt19937_64 rng(3);
  const auto ts = some_tensors(rng);
  write_checkpoint(dir.str(), ts, 2);
  const std::vector<std::pair<std::string, Tensor>> one = {{"only", test::randn({2}, DType::f32, rng)}};
  save_safetensors(dir.file("model.safetensors"), one);
  const Checkpoint ck = Checkpoint::open(dir.str());
  EXPECT_EQ(ck.names(), std::vector<std::string>{"only"});
}

TEST(Checkpoint, MissingTensorNamesFolderAndCloseNames) {
  TempDir dir;
  std::mt19937_64 rng(4);
  write_checkpoint(dir.str(), some_tensors(rng), 2);
  const Checkpoint ck = Checkpoint::open(dir.str());
  try {
    ck.get("model.layers.0.mlp.experts.1.gate_proj.wieght");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_found);
    const std::string m = e.what();
    EXPECT_NE(m.find(dir.str()), std::string::npos) << m;
    EXPECT_NE(m.find("'model.layers.0.mlp.experts.1.gate_proj.wieght'"), std::string::npos) << m;
    EXPECT_NE(m.find("'model.layers.0.mlp.experts.1.gate_proj.weight'"), std::string::npos) << m;
  }
  EXPECT_FALSE(ck.contains("nope"));
  EXPECT_THROW(ck.entry("nope"), Error);
}

TEST(CheckpointBad, MissingFolderConfigOrWeights) {
  TempDir dir;
  expect_open_error(dir.file("nowhere"), ErrorCode::not_found, {"no such directory"});
  expect_open_error(dir.str(), ErrorCode::not_found, {"no config.json"});
  write_text(dir.file("config.json"), kConfig);
  expect_open_error(dir.str(), ErrorCode::not_found, {"neither model.safetensors nor model.safetensors.index.json"});
}

TEST(CheckpointBad, ConfigNotJsonOrNotAnObject) {
  TempDir dir;
  std::mt19937_64 rng(5);
  write_checkpoint(dir.str(), some_tensors(rng), 0);
  write_text(dir.file("config.json"), "{\"model_type\": \"qwen3_moe\",");
  expect_open_error(dir.str(), ErrorCode::io, {"config.json", "not valid JSON"});
  write_text(dir.file("config.json"), "[1, 2, 3]");
  expect_open_error(dir.str(), ErrorCode::io, {"config.json", "not a JSON object"});
  write_text(dir.file("config.json"), kConfig);
  write_text(dir.file("generation_config.json"), "eos=2");
  expect_open_error(dir.str(), ErrorCode::io, {"generation_config.json", "not valid JSON"});
}

TEST(CheckpointBad, IndexProblems) {
  TempDir dir;
  std::mt19937_64 rng(6);
  const auto ts = some_tensors(rng);
  write_checkpoint(dir.str(), ts, 2);
  const std::string index = dir.file("model.safetensors.index.json");
  const std::string good = read_text(index);
  write_text(index, "{weight_map}");
  expect_open_error(dir.str(), ErrorCode::io, {"model.safetensors.index.json", "not valid JSON"});
  write_text(index, R"({"metadata": {}})");
  expect_open_error(dir.str(), ErrorCode::io, {"no weight_map"});
  write_text(index, R"({"weight_map": {"a": "../model-00001-of-00002.safetensors"}})");
  expect_open_error(dir.str(), ErrorCode::io, {"outside the checkpoint folder"});
  write_text(index, R"({"weight_map": {"a": 3}})");
  expect_open_error(dir.str(), ErrorCode::io, {"'a'", "not a file name"});
  // The index lists a tensor in a shard that does not hold it.
  auto j = nlohmann::json::parse(good);
  j["weight_map"][ts[0].first] = "model-00002-of-00002.safetensors";
  write_text(index, j.dump());
  expect_open_error(dir.str(), ErrorCode::io, {ts[0].first, "model-00002-of-00002.safetensors", "stored in"});
  j = nlohmann::json::parse(good);
  j["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors";
  write_text(index, j.dump());
  expect_open_error(dir.str(), ErrorCode::io, {"model.extra.weight", "no shard holds it"});
}

TEST(CheckpointBad, MissingShard) {
  TempDir dir;
  std::mt19937_64 rng(7);
  write_checkpoint(dir.str(), some_tensors(rng), 3);
  fs::remove(dir.file("model-00002-of-00003.safetensors"));
  expect_open_error(dir.str(), ErrorCode::not_found, {"model-00002-of-00003.safetensors", "is missing"});
}

TEST(CheckpointBad, TensorInTwoShards) {
  TempDir dir;
  std::mt19937_64 rng(8);
  const auto ts = some_tensors(rng);
  write_checkpoint(dir.str(), ts, 2);
  // Shard 2 also carries the first tensor of shard 1.
  std::vector<std::pair<std::string, Tensor>> part2 = {ts[0]};
  for (size_t i = 1; i < ts.size(); i += 2) part2.push_back(ts[i]);
  save_safetensors(dir.file("model-00002-of-00002.safetensors"), part2);
  expect_open_error(dir.str(), ErrorCode::io, {ts[0].first, "more than one shard"});
}

TEST(CheckpointBad, MalformedShardNamesTheShard) {
  TempDir dir;
  std::mt19937_64 rng(9);
  write_checkpoint(dir.str(), some_tensors(rng), 2);
  const std::string shard = dir.file("model-00001-of-00002.safetensors");
  const std::string bytes = read_text(shard);
  write_text(shard, bytes.substr(0, bytes.size() - 3));
  expect_open_error(dir.str(), ErrorCode::io, {shard, "file truncated?"});
}

TEST(CheckpointFixtures, EveryCommittedModelOpens) {
  int n = 0;
  for (const auto& d : fs::directory_iterator(test::fixtures_dir() + "/models")) {
    const Checkpoint ck = Checkpoint::open(d.path().string());
    EXPECT_TRUE(ck.config().contains("model_type")) << d.path();
    EXPECT_GT(ck.names().size(), 20u) << d.path();
    ++n;
  }
  EXPECT_GE(n, 7);
}

// ---- moekit inspect ----

TEST(InspectCli, FileListsTensorsAndMetadata) {
  TempDir dir;
  std::mt19937_64 rng(10);
  save_safetensors(dir.file("x.safetensors"),
                   {{"alpha.weight", test::randn({3, 5}, DType::bf16, rng)}, {"beta", test::randn({7}, DType::f32, rng)}},
                   {{"format", "pt"}, {"producer", "moekit-test"}});
  const auto r = run_cli("inspect " + dir.file("x.safetensors"));
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* s : {"alpha.weight", "BF16", "[3, 5]", "30", "beta", "F32", "[7]", "28", "producer: moekit-test",
                        "tensors: 2"})
    EXPECT_NE(r.out.find(s), std::string::npos) << "no '" << s << "' in:\n" << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;
}

TEST(InspectCli, FolderSummarisesConfigAndDtypes) {
  TempDir dir;
  std::mt19937_64 rng(11);
  write_checkpoint(dir.str(), some_tensors(rng), 2);
  const auto r = run_cli("inspect " + dir.str());
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* s : {"sharded", "qwen3_moe", "experts", "top-k", "text_config:", "inner", "F32", "BF16",
                        "tensors: 6", "model.layers.0.mlp.experts.1.down_proj.weight", "model-00002-of-00002"})
    EXPECT_NE(r.out.find(s), std::string::npos) << "no '" << s << "' in:\n" << r.out;
  const auto s = run_cli("inspect --summary " + dir.str());
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_EQ(s.out.find("model.layers.0.mlp.experts.1.down_proj.weight"), std::string::npos);
  const auto via_index = run_cli("inspect --summary " + dir.file("model.safetensors.index.json"));
  ASSERT_EQ(via_index.status, 0) << via_index.err;
  EXPECT_NE(via_index.out.find("sharded"), std::string::npos) << via_index.out;
}

TEST(InspectCli, CommittedFixturesInspect) {
  for (const char* arch : {"qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_vl_moe"}) {
    const auto r = run_cli(std::string("inspect ") + test::fixtures_dir() + "/models/" + arch);
    EXPECT_EQ(r.status, 0) << arch << ": " << r.err;
    EXPECT_NE(r.out.find(arch), std::string::npos) << r.out;
  }
}

TEST(InspectCli, EveryBadFileIsAnErrorOnStderr) {
  TempDir dir;
  auto le64 = [](uint64_t v) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[size_t(i)] = char(uint8_t(v >> (8 * i)));
    return s;
  };
  auto file = [&](const std::string& header, size_t data) { return le64(header.size()) + header + std::string(data, 'x'); };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"abc", "truncated"},
      {le64(500) + "{}", "beyond the end"},
      {le64(200'000'000) + "{}", "100 MB"},
      {file("{oops", 0), "not valid JSON"},
      {file("[]", 0), "not a JSON object"},
      {file(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "has no 'data_offsets'"},
      {file(R"({"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype 'Q9'"},
      {file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "reversed"},
      {file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "overlap"},
      {file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4), "leave the data section"},
      {file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "needs 12"},
      {file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8), "overflows"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = dir.file("bad" + std::to_string(i) + ".safetensors");
    write_text(path, cases[i].first);
    const auto r = run_cli("inspect " + path);
    EXPECT_NE(r.status, 0) << cases[i].second;
    EXPECT_LT(r.status, 128) << "crashed on " << cases[i].second;
    EXPECT_NE(r.err.find("error"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(path), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(cases[i].second), std::string::npos) << "no '" << cases[i].second << "' in: " << r.err;
  }
  // Broken folders.
  const auto missing = run_cli("inspect " + dir.file("no_such_thing"));
  EXPECT_NE(missing.status, 0);
  EXPECT_FALSE(missing.err.empty());
  fs::create_directories(dir.file("ck"));
  const auto no_config = run_cli("inspect " + dir.file("ck"));
  EXPECT_NE(no_config.status, 0);
  EXPECT_NE(no_config.err.find("no config.json"), std::string::npos) << no_config.err;
  std::mt19937_64 rng(12);
  write_checkpoint(dir.file("ck"), some_tensors(rng), 2);
  fs::remove(dir.file("ck/model-00001-of-00002.safetensors"));
  const auto no_shard = run_cli("inspect " + dir.file("ck"));
  EXPECT_NE(no_shard.status, 0);
  EXPECT_NE(no_shard.err.find("model-00001-of-00002.safetensors"), std::string::npos) << no_shard.err;
}

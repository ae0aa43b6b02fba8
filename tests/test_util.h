// Test helpers: random tensors, poisoning, fixtures.
#pragma once
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "moekit/moekit.h"
#include "moekit/safetensors.h"

namespace moekit::test {

std::string fixtures_dir();  // tests/fixtures
std::string models_dir();    // tests/fixtures/models
// Fixture models with reference outputs (config.json, weights, reference.safetensors), sorted.
std::vector<std::string> fixture_models();
// Relative L2 distance of a to ref (infinity when a has a non-finite value).
double rel_l2(const float* a, const float* ref, int64_t n);
// Row r of an [B, L] i64 tensor of token ids.
std::vector<int64_t> row_ids(const Tensor& ids, int64_t r);

// A fixture model's reference outputs: its folder, reference.safetensors, the prompt ids [B, L], transformers'
// greedy generation [B, L + n_new] and row 0's new tokens (`expect`).
struct ModelReference {
  std::string dir;
  SafetensorsFile ref;
  Tensor ids, gen;
  int64_t L = 0, n_new = 0;
  std::vector<int64_t> expect;
};
ModelReference model_reference(const std::string& name);

// The message of the moekit::Error `fn` throws ("" when it throws none); its code into `code`.
std::string error_of(const std::function<void()>& fn, ErrorCode* code = nullptr);

// A fresh folder under the system temp dir, removed with everything in it when the object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "moekit_test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};
// The moekit CLI (MOEKIT_CLI) run with `args` through the shell: its exit status (-1 when it did not exit)
// and what it printed on stdout, with stderr merged in (`with_stderr`) or discarded.
struct CliResult {
  int code = -1;
  std::string out;
};
CliResult run_cli(const std::string& args, bool with_stderr = true);

// Normal(0, std) values in `dtype` on the CPU.
Tensor randn(const Shape& shape, DType dtype, std::mt19937_64& rng, double std = 1.0);
// Fills a CPU or CUDA tensor with NaN (floating types) so unwritten outputs are caught.
void poison(Tensor& t);
// Random top-k routing: distinct experts per token, weights normalised to sum 1.
void random_routing(int64_t T, int64_t K, int64_t E, DType index_dtype, DType weight_dtype, std::mt19937_64& rng,
                    Tensor& index, Tensor& weights);

}  // namespace moekit::test

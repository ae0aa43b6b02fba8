#include "test_util.h"

#include <sys/wait.h>

#include <cstdio>
#include "experts_case.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <numeric>
#include <unistd.h>

namespace moekit::test {

std::string fixtures_dir() { return MOEKIT_FIXTURES_DIR; }
std::string models_dir() { return fixtures_dir() + "/models"; }

ModelReference model_reference(const std::string& name) {
  const std::string dir = models_dir() + "/" + name;
  ModelReference r{dir, SafetensorsFile::open(dir + "/reference.safetensors"), {}, {}, 0, 0, {}};
  r.ids = r.ref.get("input_ids");
  r.gen = r.ref.get("generated_ids");
  r.L = r.ids.size(1);
  r.n_new = r.gen.size(1) - r.L;
  r.expect.assign(r.gen.ptr<int64_t>() + r.L, r.gen.ptr<int64_t>() + r.gen.size(1));
  return r;
}

std::vector<std::string> fixture_models() {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  if (!fs::is_directory(models_dir())) return out;
  for (const auto& e : fs::directory_iterator(models_dir()))
    if (fs::exists(e.path() / "reference.safetensors") && fs::exists(e.path() / "config.json") &&
        (fs::exists(e.path() / "model.safetensors") || fs::exists(e.path() / "model.safetensors.index.json")))
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

double rel_l2(const float* a, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

std::vector<int64_t> row_ids(const Tensor& ids, int64_t r) {
  const int64_t L = ids.size(1);
  return std::vector<int64_t>(ids.ptr<int64_t>() + r * L, ids.ptr<int64_t>() + (r + 1) * L);
}

std::string error_of(const std::function<void()>& fn, ErrorCode* code) {
  try {
    fn();
  } catch (const Error& e) {
    if (code) *code = e.code();
    return e.what();
  }
  return "";
}

TempDir::TempDir(const std::string& prefix) {
  std::random_device rd;
  path_ = std::filesystem::temp_directory_path() /
          (prefix + "_" + std::to_string(getpid()) + "_" + std::to_string(rd()));
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

Tensor randn(const Shape& shape, DType dtype, std::mt19937_64& rng, double std) {
  Tensor f = Tensor::empty(shape, DType::f32);
  std::normal_distribution<float> d(0.0f, float(std));
  for (int64_t i = 0; i < f.numel(); ++i) f.ptr<float>()[i] = d(rng);
  return f.to(dtype);
}

void poison(Tensor& t) { poison_tensor(t); }
void random_routing(int64_t T, int64_t K, int64_t E, DType index_dtype, DType weight_dtype, std::mt19937_64& rng,
                    Tensor& index, Tensor& weights) {
  Tensor idx = Tensor::empty({T, K}, DType::i64), w = Tensor::empty({T, K}, DType::f32);
  std::vector<int64_t> perm(static_cast<size_t>(E));
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    float s = 0;
    for (int64_t k = 0; k < K; ++k) {
      idx.ptr<int64_t>()[t * K + k] = perm[size_t(k % E)];
      s += (w.ptr<float>()[t * K + k] = u(rng));
    }
    for (int64_t k = 0; k < K; ++k) w.ptr<float>()[t * K + k] /= s;
  }
  if (index_dtype == DType::i32) {
    Tensor i32 = Tensor::empty({T, K}, DType::i32);
    for (int64_t i = 0; i < T * K; ++i) i32.ptr<int32_t>()[i] = int32_t(idx.ptr<int64_t>()[i]);
    index = i32;
  } else {
    index = idx;
  }
  weights = w.to(weight_dtype);
}

CliResult run_cli(const std::string& args, bool with_stderr) {
  const std::string cmd = std::string(MOEKIT_CLI) + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null");
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace moekit::test

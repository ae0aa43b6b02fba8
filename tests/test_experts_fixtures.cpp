// Every backend that runs here reproduces transformers' outputs on the Experts case files of
// tests/fixtures/experts (made by transformers in f32), directly and through `moekit check`.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "backends/reference.h"
#include "experts_case.h"
#include "moekit/safetensors.h"
#include "test_util.h"

using namespace moekit;
using namespace moekit::test;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> case_files() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(fixtures_dir() + "/experts"))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<Device> test_devices() {
  std::vector<Device> d{Device::cpu()};
  if (cuda_available()) d.push_back(Device::cuda(0));
  return d;
}

struct CommandResult {
  int status = -1;
  std::string output;
};

// Runs a shell command; stdout and stderr captured.
CommandResult run_command(const std::string& cmd) {
  const fs::path log = fs::temp_directory_path() / ("moekit_cli_" + std::to_string(::getpid()) + ".log");
  const int rc = std::system((cmd + " > '" + log.string() + "' 2>&1").c_str());
  CommandResult r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  fs::remove(log);
  return r;
}

}  // namespace

TEST(ExpertsFixtures, CaseFilesArePresent) {
  const auto files = case_files();
  EXPECT_GE(files.size(), 3u);
  for (const char* name : {"qwen3_gated_silu", "qwen3_ep_sentinel", "mixtral_gated_silu"}) {
    EXPECT_TRUE(fs::exists(fixtures_dir() + "/experts/" + name + ".safetensors")) << name;
  }
}

TEST(ExpertsFixtures, ReferenceAgreesWithTransformers) {
  for (const auto& file : case_files()) {
    const ExpertsCase c = load_experts_case(file);
    const auto ref = reference_forward(c.experts, c.hidden_states, c.top_k_index, c.top_k_weights);
    for (const auto& [name, out] : c.outputs) {
      const double err = relative_l2(out.view(), ref);
      std::printf("  %s: f64 reference vs transformers out.%s: rel L2 %.2e\n", fs::path(file).stem().c_str(),
                  name.c_str(), err);
      EXPECT_LT(err, 1e-5) << file << " out." << name;
    }
  }
}

// Each backend against every transformers output of the case (eager, batched_mm, grouped_mm agree there).
TEST(ExpertsFixtures, EveryBackendReproducesTransformers) {
  int ran = 0;
  for (const auto& file : case_files()) {
    const ExpertsCase c = load_experts_case(file);
    for (const Device dev : test_devices()) {
      const Experts experts = c.experts.to(dev);
      for (const auto& b : ExpertsInterface::global().backends()) {
        const std::string name(b->name());
        if (!b->available(dev)) continue;
        const Support s = b->supports(experts, c.hidden_states.dtype());
        if (!s) {
          std::printf("  %-16s %-7s %s NOT SUPPORTED (%s)\n", name.c_str(), dev.to_string().c_str(),
                      fs::path(file).stem().c_str(), s.reason.c_str());
          continue;
        }
        const Tensor x = c.hidden_states.to(dev), idx = c.top_k_index.to(dev), w = c.top_k_weights.to(dev);
        Tensor out = Tensor::empty(x.shape(), x.dtype(), dev);
        poison(out);
        experts.forward_with(name, ExpertsCall{x.view(), idx.view(), w.view(), out.view(), nullptr});
        for (const auto& [hf_name, hf_out] : c.outputs) {
          std::vector<double> expected(size_t(hf_out.numel()));
          for (size_t i = 0; i < expected.size(); ++i)
            expected[i] = load_as_f64(hf_out.data(), hf_out.dtype(), int64_t(i));
          const double err = relative_l2(out.view(), expected);
          std::printf("  %-16s %-7s %s vs transformers out.%s: rel L2 %.2e %s\n", name.c_str(), dev.to_string().c_str(),
                      fs::path(file).stem().c_str(), hf_name.c_str(), err, err < 1e-5 ? "OK" : "FAIL");
          EXPECT_LT(err, 1e-5) << name << " on " << dev.to_string() << ", " << file << " out." << hf_name;
        }
        ++ran;
      }
    }
  }
  EXPECT_GE(ran, 9);  // three CPU backends on three cases at least
}

// In bf16, the CPU backends round intermediates where transformers does (backends/cpu/common.h), so they follow
// transformers' own bf16 batched_mm / grouped_mm outputs far closer than either follows the f64 reference.
TEST(ExpertsFixtures, Bf16CasesFollowTransformersRounding) {
  int ran = 0;
  for (const auto& entry : fs::directory_iterator(fixtures_dir() + "/experts_bf16")) {
    if (entry.path().extension() != ".safetensors") continue;
    const std::string file = entry.path().string();
    const ExpertsCase c = load_experts_case(file);
    ASSERT_EQ(c.hidden_states.dtype(), DType::bf16) << file;
    const auto ref = reference_forward(c.experts, c.hidden_states, c.top_k_index, c.top_k_weights);
    for (const char* name : {"eager", "batched_mm", "grouped_mm"}) {
      Tensor out = Tensor::empty(c.hidden_states.shape(), DType::bf16);
      poison(out);
      c.experts.forward_with(
          name, ExpertsCall{c.hidden_states.view(), c.top_k_index.view(), c.top_k_weights.view(), out.view(), nullptr});
      const double err_ref = relative_l2(out.view(), ref);
      EXPECT_LT(err_ref, 1e-2) << name << " " << file;
      for (const auto& [hf_name, hf_out] : c.outputs) {
        std::vector<double> expected(size_t(hf_out.numel()));
        for (size_t i = 0; i < expected.size(); ++i)
          expected[i] = load_as_f64(hf_out.data(), hf_out.dtype(), int64_t(i));
        const double err_hf = relative_l2(out.view(), expected);
        std::printf("  %-12s %s vs transformers bf16 out.%s: rel L2 %.2e (vs f64 reference %.2e)\n", name,
                    entry.path().stem().c_str(), hf_name.c_str(), err_hf, err_ref);
        EXPECT_LT(err_hf, 1e-3) << name << " " << file << " out." << hf_name;
      }
      ++ran;
    }
  }
  EXPECT_GE(ran, 6);
}

TEST(ExpertsFixtures, CliCheckPassesAndFailsOnCorruptedExpectations) {
  ASSERT_TRUE(fs::exists(MOEKIT_CLI)) << MOEKIT_CLI;
  for (const auto& file : case_files()) {
    const CommandResult ok = run_command(std::string("'") + MOEKIT_CLI + "' check --case '" + file + "'");
    EXPECT_EQ(ok.status, 0) << ok.output;
    EXPECT_NE(ok.output.find("grouped_mm"), std::string::npos) << ok.output;
  }
  // A copy whose expected outputs are off by 1% in one row: check must fail.
  TempDir dir("moekit_fixtures");
  const std::string file = fixtures_dir() + "/experts/qwen3_gated_silu.safetensors";
  const SafetensorsFile f = SafetensorsFile::open(file);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& name : f.names()) {
    Tensor t = Tensor::copy_of(f.get(name), Device::cpu());
    if (name.rfind("out.", 0) == 0) {
      ASSERT_EQ(t.dtype(), DType::f32);
      for (int64_t i = 0; i < t.size(1); ++i) t.ptr<float>()[i] *= 1.5f;
    }
    tensors.emplace_back(name, t);
  }
  const std::string bad = dir.file("corrupted.safetensors");
  save_safetensors(bad, tensors, f.metadata());
  const CommandResult fail = run_command(std::string("'") + MOEKIT_CLI + "' check --case '" + bad + "'");
  EXPECT_NE(fail.status, 0) << fail.output;
  EXPECT_NE(fail.output.find("FAIL"), std::string::npos) << fail.output;
  // The same file unchanged (written by save_safetensors) passes: the failure came from the corruption.
  for (auto& [name, t] : tensors)
    if (name.rfind("out.", 0) == 0) t = Tensor::copy_of(f.get(name), Device::cpu());
  const std::string good = dir.file("copy.safetensors");
  save_safetensors(good, tensors, f.metadata());
  EXPECT_EQ(run_command(std::string("'") + MOEKIT_CLI + "' check --case '" + good + "'").status, 0);
}

// MOEKIT_CPU_ISA picks the CPU kernels for a process; an unknown value is an error naming it.
TEST(ExpertsFixtures, CliHonoursMoekitCpuIsa) {
  const std::string file = fixtures_dir() + "/experts/mixtral_gated_silu.safetensors";
  for (const char* isa : {"scalar", "avx2", "avx512"}) {
    const CommandResult r =
        run_command(std::string("MOEKIT_CPU_ISA=") + isa + " '" + MOEKIT_CLI + "' check --case '" + file + "'");
    if (r.status == 0) continue;
    // Only an ISA this CPU lacks may fail, and then with an error that says so.
    EXPECT_NE(r.output.find("lacks"), std::string::npos) << isa << ": " << r.output;
    EXPECT_NE(std::string(isa), "scalar") << r.output;
  }
  const CommandResult bogus =
      run_command(std::string("MOEKIT_CPU_ISA=sse9 '") + MOEKIT_CLI + "' check --case '" + file + "'");
  EXPECT_NE(bogus.status, 0);
  EXPECT_NE(bogus.output.find("sse9"), std::string::npos) << bogus.output;
}

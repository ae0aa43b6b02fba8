// Expert parallelism against one process: the experts cases (both modes, uneven expert counts, ranks that
// receive no tokens, sentinels, bad ids) and the fixture models' logits and greedy tokens.
//
// Run alone, the group has one rank (the code paths still run: remapping, dispatch, combine). ctest also runs
// this binary under `mpirun -np 2` (the MPI group), and on a machine with two GPUs the NCCL tests drive both
// from one process, one thread per GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <random>
#include <thread>

#include "backends/megamoe.h"
#include "moekit/model.h"
#include "moekit/parallel.h"
#include "moekit/safetensors.h"
#include "test_util.h"

using namespace moekit;
using test::rel_l2;

namespace {

ExpertGroupPtr cpu_group() {
  static ExpertGroupPtr g = mpi_launch_size() > 1 ? mpi_world_group() : single_group();
  return g;
}

Tensor f32_cpu(const Tensor& t) { return t.to(Device::cpu()).to(DType::f32); }

// Random experts of E experts, the same on every rank (one seed).
Experts random_experts(int64_t E, int64_t H, int64_t I, DType dtype, uint64_t seed, bool bias = false) {
  std::mt19937_64 rng(seed);
  ExpertsSpec spec{.num_experts = E, .hidden = H, .intermediate = I};
  spec.has_bias = bias;
  ExpertsWeights w;
  w.gate_up_proj = test::randn({E, 2 * I, H}, dtype, rng, 0.2);
  w.down_proj = test::randn({E, H, I}, dtype, rng, 0.2);
  if (bias) {
    w.gate_up_proj_bias = test::randn({E, 2 * I}, dtype, rng, 0.1);
    w.down_proj_bias = test::randn({E, H}, dtype, rng, 0.1);
  }
  return Experts(spec, std::move(w), "grouped_mm");
}

struct Inputs {
  Tensor x, idx, w;
};
// T tokens routed over [0, E]; `sentinels` replaces some slots by E; `only` (>= 0) routes every slot into
// experts [0, only).
Inputs random_inputs(int64_t T, int64_t K, int64_t E, int64_t H, DType dtype, DType index_dtype, uint64_t seed,
                     bool sentinels, int64_t only = -1) {
  std::mt19937_64 rng(seed);
  Inputs in;
  in.x = test::randn({T, H}, dtype, rng);
  test::random_routing(T, K, only > 0 ? only : E, index_dtype, DType::f32, rng, in.idx, in.w);
  if (sentinels && T > 0) {
    for (int64_t t = 0; t < T; t += 3) {
      if (index_dtype == DType::i64)
        in.idx.ptr<int64_t>()[t * K] = E;
      else
        in.idx.ptr<int32_t>()[t * K] = int32_t(E);
    }
  }
  return in;
}

double experts_error(const Tensor& got, const Tensor& ref) {
  const Tensor a = f32_cpu(got), b = f32_cpu(ref);
  if (a.numel() == 0) return 0;
  return rel_l2(a.ptr<float>(), b.ptr<float>(), a.numel());
}

TEST(ExpertSlice, ContiguousFirstRanksTakeTheRemainder) {
  EXPECT_EQ(expert_slice(7, 0, 2).start, 0);
  EXPECT_EQ(expert_slice(7, 0, 2).end, 4);
  EXPECT_EQ(expert_slice(7, 1, 2).start, 4);
  EXPECT_EQ(expert_slice(7, 1, 2).end, 7);
  EXPECT_EQ(expert_slice(8, 2, 3).start, 6);
  EXPECT_EQ(expert_slice(8, 2, 3).count(), 2);
  EXPECT_NE(test::error_of([] { expert_slice(1, 0, 2); }).find("1 experts cannot be sharded over 2 ranks"),
            std::string::npos);
  EXPECT_NE(test::error_of([] { expert_slice(8, 3, 2); }).find("rank 3 is out of range"), std::string::npos);
  EXPECT_NE(test::error_of([] { parse_ep_mode("ring"); }).find("valid modes: all_reduce, all_to_all"),
            std::string::npos);
}

// Every rank computes the same call; the sharded result must equal the whole module's.
void check_replicated(const ExpertGroupPtr& g, EpMode mode, int64_t E, DType dtype, DType index_dtype, int64_t T,
                      bool bias) {
  const int64_t H = 48, I = 40, K = 3;
  SCOPED_TRACE(std::string(ep_mode_name(mode)) + " E=" + std::to_string(E) + " " + dtype_name(dtype) + " " +
               dtype_name(index_dtype) + " T=" + std::to_string(T) + " ranks=" + std::to_string(g->size()));
  const Device d = g->device();
  const Experts full = random_experts(E, H, I, dtype, 1234 + uint64_t(E), bias).to(d);
  const Inputs in = random_inputs(T, K, E, H, dtype, index_dtype, 99 + uint64_t(T), true);
  const Tensor x = in.x.to(d), idx = in.idx.to(d), w = in.w.to(d);
  const Tensor ref = full.forward(x, idx, w);
  const ParallelExperts ep(g, E, mode);
  const Experts local = slice_experts(full, ep.slice());
  ASSERT_EQ(local.spec().num_experts, ep.slice().count());
  Tensor out = Tensor::empty({T, H}, dtype, d);
  test::poison(out);
  ep.forward_into(local, ExpertsCall{x, idx, w, out.view()});
  g->synchronize(nullptr);
  EXPECT_LE(experts_error(out, ref), experts_tolerance(dtype));
  // Run to run: the same bits (fixed combine order, no atomics).
  Tensor again = Tensor::empty({T, H}, dtype, d);
  test::poison(again);
  ep.forward_into(local, ExpertsCall{x, idx, w, again.view()});
  g->synchronize(nullptr);
  const Tensor a = again.to(Device::cpu()), b = out.to(Device::cpu());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
  // all_reduce in chunks whose all-reduces overlap the next chunk's experts (GPUs; one call on the CPU).
  if (mode == EpMode::all_reduce) {
    ParallelExperts chunked(g, E, mode);
    chunked.set_overlap_chunks(3);
    Tensor c = Tensor::empty({T, H}, dtype, d);
    test::poison(c);
    chunked.forward_into(local, ExpertsCall{x, idx, w, c.view()});
    g->synchronize(nullptr);
    EXPECT_LE(experts_error(c, ref), experts_tolerance(dtype)) << "in 3 overlapped chunks";
  }
}

void check_experts_cases(const ExpertGroupPtr& g) {
  for (EpMode mode : {EpMode::all_reduce, EpMode::all_to_all})
    for (int64_t E : {7, 8})  // 7: not divisible by 2 ranks
      for (int64_t T : {0, 1, 2, 33}) {
        check_replicated(g, mode, E, DType::f32, DType::i64, T, false);
        check_replicated(g, mode, E, DType::bf16, DType::i32, T, T == 2);
      }
}

// Each rank has its own tokens: rank 0 some, the others none; every slot goes to rank 0's experts, so the
// other ranks receive nothing either.
void check_uneven_tokens(const ExpertGroupPtr& g) {
  const int64_t E = 5, H = 32, I = 24, K = 2;
  const Device d = g->device();
  const Experts full = random_experts(E, H, I, DType::f32, 7).to(d);
  const ParallelExperts ep(g, E, EpMode::all_to_all);
  const Experts local = slice_experts(full, ep.slice());
  for (bool only_rank0_experts : {true, false}) {
    SCOPED_TRACE(only_rank0_experts ? "every slot on rank 0's experts" : "slots anywhere");
    const int64_t T = g->rank() == 0 ? 9 : 0;
    const Inputs in = random_inputs(T, K, E, H, DType::f32, DType::i32, 5 + uint64_t(g->rank()), false,
                                    only_rank0_experts ? expert_slice(E, 0, g->size()).count() : -1);
    const Tensor x = in.x.to(d), idx = in.idx.to(d), w = in.w.to(d);
    const Tensor ref = full.forward(x, idx, w);
    Tensor out = Tensor::empty({T, H}, DType::f32, d);
    test::poison(out);
    EpStats st;
    ep.dispatch_combine(local, ExpertsCall{x, idx, w, out.view()}, &st);
    g->synchronize(nullptr);
    EXPECT_LE(experts_error(out, ref), experts_tolerance(DType::f32));
    if (g->rank() != 0) EXPECT_EQ(st.tokens_sent, 0);
    if (only_rank0_experts && g->rank() != 0) EXPECT_EQ(st.tokens_received, 0);
    if (only_rank0_experts && g->rank() == 0 && g->size() > 1) EXPECT_EQ(st.tokens_sent, 0);
    EXPECT_GE(st.dispatch_ms, 0.0);
  }
}

// A bad id on one rank only: every rank gets an error, none waits forever.
void check_bad_id_on_one_rank(const ExpertGroupPtr& g) {
  const int64_t E = 4, H = 16, I = 8, K = 2, T = 3;
  const Device d = g->device();
  const Experts full = random_experts(E, H, I, DType::f32, 3).to(d);
  const ParallelExperts ep(g, E, EpMode::all_to_all);
  const Experts local = slice_experts(full, ep.slice());
  Inputs in = random_inputs(T, K, E, H, DType::f32, DType::i32, 11, false);
  if (g->rank() == 0) in.idx.ptr<int32_t>()[3] = int32_t(E + 2);
  const Tensor x = in.x.to(d), idx = in.idx.to(d), w = in.w.to(d);
  Tensor out = Tensor::empty({T, H}, DType::f32, d);
  const std::string msg = test::error_of([&] { ep.dispatch_combine(local, ExpertsCall{x, idx, w, out.view()}); });
  if (g->rank() == 0)
    EXPECT_NE(msg.find("top_k_index[1, 1] = 6 is out of range [0, 4]"), std::string::npos) << msg;
  else
    EXPECT_NE(msg.find("rank 0 of"), std::string::npos) << msg;
}

TEST(ExpertParallel, ShardedExpertsEqualOneProcess) { check_experts_cases(cpu_group()); }
TEST(ExpertParallel, RanksWithoutTokensAndWithoutWork) { check_uneven_tokens(cpu_group()); }
TEST(ExpertParallel, BadIdOnOneRankIsAnErrorOnEveryRank) { check_bad_id_on_one_rank(cpu_group()); }

// transformers' mode: a bad id (the same on every rank) is an error naming the global value, not a sentinel.
TEST(ExpertParallel, BadIdsAreErrorsNotSentinels) {
  const ExpertGroupPtr g = cpu_group();
  const int64_t E = 5, H = 16, I = 8, K = 2, T = 3;
  const Experts full = random_experts(E, H, I, DType::f32, 9);
  const ParallelExperts ep(g, E, EpMode::all_reduce);
  const Experts local = slice_experts(full, ep.slice());
  for (int64_t bad : {-1, 6, 1000}) {
    Inputs in = random_inputs(T, K, E, H, DType::f32, DType::i64, 12, false);
    in.idx.ptr<int64_t>()[2 * K + 1] = bad;
    const std::string msg = test::error_of([&] { ep.forward(local, in.x, in.idx, in.w); });
    EXPECT_NE(msg.find("top_k_index[2, 1] = " + std::to_string(bad) + " is out of range [0, 5]"), std::string::npos)
        << msg;
  }
}

TEST(ExpertParallel, LocalModuleMustMatchTheSlice) {
  const ExpertGroupPtr g = cpu_group();
  const Experts full = random_experts(6, 16, 8, DType::f32, 1);
  const ParallelExperts ep(g, 6, EpMode::all_reduce);
  const Tensor x = Tensor::zeros({1, 16}, DType::f32), idx = Tensor::zeros({1, 1}, DType::i32),
               w = Tensor::zeros({1, 1}, DType::f32);
  if (g->size() > 1) {
    const std::string msg = test::error_of([&] { ep.forward(full, x, idx, w); });
    EXPECT_NE(msg.find("but its module has 6"), std::string::npos) << msg;
  }
}

// The fixture models: the same greedy tokens as one process (and as transformers), logits within the f32
// tolerance, each rank holding only its experts.
void check_fixture_model(const std::string& name, const ExpertGroupPtr& g, EpMode mode) {
  SCOPED_TRACE(name + " " + ep_mode_name(mode) + " ranks=" + std::to_string(g->size()));
  const std::string dir = test::models_dir() + "/" + name;
  const auto ref = SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = ref.get("input_ids"), gen = ref.get("generated_ids");
  const int64_t L = ids.size(1);
  const std::vector<int64_t> prompt = test::row_ids(ids, 0);
  const Device d = g->device();
  Model one = Model::from_pretrained(dir, ModelOptions{.device = d, .dtype = DType::f32});
  Model ep = Model::from_pretrained(
      dir, ModelOptions{.device = d, .dtype = DType::f32, .expert_group = g, .ep_mode = mode});
  const int64_t E = one.config().text.num_experts;
  for (const Experts* e : ep.experts_modules())
    ASSERT_EQ(e->spec().num_experts, g->size() > 1 ? expert_slice(E, g->rank(), g->size()).count() : E);
  const Tensor a = ep.logits(prompt), b = one.logits(prompt);
  ASSERT_EQ(a.shape(), b.shape());
  EXPECT_LE(rel_l2(a.ptr<float>(), b.ptr<float>(), a.numel()), experts_tolerance(DType::f32));
  const int64_t n_new = gen.size(1) - L;
  GenerationConfig gc;
  gc.max_new_tokens = n_new;
  gc.min_new_tokens = n_new;
  const auto r_ep = ep.generate(prompt, gc), r_one = one.generate(prompt, gc);
  EXPECT_EQ(r_ep.tokens, r_one.tokens);
  const std::vector<int64_t> expect(gen.ptr<int64_t>() + L, gen.ptr<int64_t>() + gen.size(1));
  EXPECT_EQ(r_ep.tokens, expect);
}

class EpFixtureModel : public ::testing::TestWithParam<std::string> {};
TEST_P(EpFixtureModel, GreedyTokensAndLogitsEqualOneProcess) {
  for (EpMode mode : {EpMode::all_reduce, EpMode::all_to_all}) check_fixture_model(GetParam(), cpu_group(), mode);
}
INSTANTIATE_TEST_SUITE_P(Models, EpFixtureModel, ::testing::ValuesIn(test::fixture_models()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(EpFixtureModel);

// Each rank reads only its experts: a checkpoint holding only this rank's experts loads with the group and
// gives the full model's logits; alone, it is missing tensors.
TEST(ExpertParallel, EachRankReadsOnlyItsExperts) {
  const ExpertGroupPtr g = cpu_group();
  if (g->size() < 2) GTEST_SKIP() << "needs a group of 2 or more (mpirun -np 2)";
  const std::string src = test::models_dir() + "/qwen3_moe";
  test::TempDir dir("moekit_ep_rank" + std::to_string(g->rank()));
  for (const char* f : {"config.json", "generation_config.json"})
    std::filesystem::copy_file(src + "/" + f, dir.file(f));
  const auto file = SafetensorsFile::open(src + "/model.safetensors");
  Model one = Model::from_pretrained(src, ModelOptions{.dtype = DType::f32});
  const ExpertSlice mine = expert_slice(one.config().text.num_experts, g->rank(), g->size());
  std::vector<std::pair<std::string, Tensor>> kept;
  int dropped = 0;
  for (const auto& name : file.names()) {
    const size_t at = name.find(".experts.");
    if (at != std::string::npos) {
      const int64_t e = std::stoll(name.substr(at + 9));
      if (e < mine.start || e >= mine.end) {
        ++dropped;
        continue;
      }
    }
    kept.emplace_back(name, file.get(name));
  }
  ASSERT_GT(dropped, 0);
  save_safetensors(dir.file("model.safetensors"), kept, {});
  Model ep = Model::from_pretrained(dir.str(), ModelOptions{.dtype = DType::f32, .expert_group = g});
  const std::vector<int64_t> prompt{1, 5, 9, 2};
  const Tensor a = ep.logits(prompt), b = one.logits(prompt);
  EXPECT_LE(rel_l2(a.ptr<float>(), b.ptr<float>(), a.numel()), experts_tolerance(DType::f32));
  ErrorCode code{};
  const std::string msg = test::error_of([&] { Model::from_pretrained(dir.str(), ModelOptions{.dtype = DType::f32}); }, &code);
  EXPECT_EQ(code, ErrorCode::not_found) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
}

TEST(ExpertParallel, ModelOptionsThatCannotRunAreRefused) {
  const ExpertGroupPtr g = cpu_group();
  if (g->size() < 2) GTEST_SKIP() << "needs a group of 2 or more (mpirun -np 2)";
  const std::string dir = test::models_dir() + "/qwen3_moe";
  const std::string msg = test::error_of(
      [&] { Model::from_pretrained(dir, ModelOptions{.device = Device::cuda(0), .expert_group = g}); });
  EXPECT_NE(msg.find("is on cpu but the model is loaded on cuda:0"), std::string::npos) << msg;
}

// ---- deepgemm_megamoe: its requirements in SPEC order ----

TEST(DeepgemmMegamoe, RequirementsAreCheckedInSpecOrder) {
  MegaMoeFacts f{.device = "cpu", .arch = std::nullopt, .weight_dtype = DType::bf16, .ep_size = 1};
  auto m = megamoe_missing(f);
  ASSERT_EQ(m.size(), 3u);
  EXPECT_NE(m[0].find("SM100+"), std::string::npos) << m[0];
  EXPECT_NE(m[0].find("the experts are on cpu"), std::string::npos) << m[0];
  EXPECT_NE(m[1].find("FP4 (e2m1) experts with UE8M0 scales; the experts are bf16"), std::string::npos) << m[1];
  EXPECT_NE(m[2].find("ep_size > 1"), std::string::npos) << m[2];
  // Hopper, FP4 with UE8M0 scales, a group: only the GPU is missing.
  f = {.device = "cuda:0 (NVIDIA H200, compute capability 9.0)", .arch = 90, .weight_dtype = DType::f4e2m1,
       .scale_dtype = DType::ue8m0, .ep_size = 2};
  m = megamoe_missing(f);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_NE(m[0].find("is compute capability 9.0"), std::string::npos) << m[0];
  // Blackwell with float scales: the seed's error, naming the way out.
  f.arch = 100;
  f.scale_dtype = DType::f32;
  m = megamoe_missing(f);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_NE(m[0].find("scale_fmt \"float\""), std::string::npos) << m[0];
  EXPECT_NE(m[0].find("scale_fmt \"ue8m0\""), std::string::npos) << m[0];
  EXPECT_NE(m[0].find("grouped_mm or batched_mm"), std::string::npos) << m[0];
  f.scale_dtype = std::nullopt;
  EXPECT_NE(megamoe_missing(f).at(0).find("UE8M0 scales beside the FP4 experts"), std::string::npos);
  f.scale_dtype = DType::ue8m0;
  EXPECT_TRUE(megamoe_missing(f).empty());
  f.ep_size = 1;
  m = megamoe_missing(f);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_NE(m[0].find("ep_size > 1"), std::string::npos);
}

TEST(DeepgemmMegamoe, AModuleIsToldEveryMissingRequirementAtTheFirstForward) {
  const ExpertGroupPtr g = cpu_group();
  const int64_t E = 4, H = 16, I = 8, K = 2, T = 3;
  const Experts full = random_experts(E, H, I, DType::bf16, 2);
  const ParallelExperts ep(g, E, EpMode::all_reduce);
  const Experts sliced = slice_experts(full, ep.slice());
  const Experts local(sliced.spec(), sliced.weights(), "deepgemm_megamoe");
  const Inputs in = random_inputs(T, K, E, H, DType::bf16, DType::i32, 4, false);
  ErrorCode code{};
  const std::string msg = test::error_of([&] { ep.forward(local, in.x, in.idx, in.w); }, &code);
  EXPECT_EQ(code, ErrorCode::not_supported);
  EXPECT_NE(msg.find("(1) a CUDA GPU of compute capability 10.0 or newer (SM100+"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(2) FP4 (e2m1) experts with UE8M0 scales; the experts are bf16"), std::string::npos) << msg;
  // The group counts only when it has more than one rank.
  EXPECT_EQ(msg.find("ep_size > 1") == std::string::npos, g->size() > 1) << msg;
  EXPECT_NE(msg.find("Use grouped_mm"), std::string::npos) << msg;
}

// ---- two GPUs of this process over NCCL: one thread per GPU ----

bool two_gpus() { return nccl_built() && cuda_device_count() >= 2 && mpi_launch_size() == 1; }

void on_each_gpu(const std::function<void(const ExpertGroupPtr&)>& fn) {
  const auto groups = nccl_local_groups({0, 1});
  std::vector<std::exception_ptr> errors(groups.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < groups.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        use_device(groups[i]->device());
        fn(groups[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

TEST(ExpertParallelNccl, ShardedExpertsEqualOneGpu) {
  if (!two_gpus()) GTEST_SKIP() << "needs NCCL and two GPUs";
  on_each_gpu([](const ExpertGroupPtr& g) {
    check_experts_cases(g);
    check_uneven_tokens(g);
    check_bad_id_on_one_rank(g);
  });
}

TEST(ExpertParallelNccl, FixtureModelsGreedyTokensEqualOneGpu) {
  if (!two_gpus()) GTEST_SKIP() << "needs NCCL and two GPUs";
  on_each_gpu([](const ExpertGroupPtr& g) {
    for (const auto& name : test::fixture_models())
      for (EpMode mode : {EpMode::all_reduce, EpMode::all_to_all}) check_fixture_model(name, g, mode);
  });
}

}  // namespace

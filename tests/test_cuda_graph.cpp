// ExpertsGraph: replays of every capturable backend are bit-identical to the uncaptured call on the same
// inputs, for new inputs written into the captured buffers; backends that are not capturable are refused;
// errors are reported.
#include <gtest/gtest.h>

#include "test_experts_problem.h"
#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/kernels/kernels.h"
#include "backends/cuda/policy.h"
#include "base/cuda_device.h"
#include "base/cuda_pdl.cuh"
#endif

using namespace moekit;
using namespace moekit::test;

namespace {
// The registered backends that run on cuda:0 and can (or cannot) be captured.
std::vector<std::string> cuda_backends(bool capturable) {
  std::vector<std::string> out;
  for (const auto& b : backends_on(Device::cuda(0)))
    if (b->graph_capturable() == capturable) out.emplace_back(b->name());
  return out;
}
}  // namespace

TEST(CudaGraph, CpuExpertsCannotBeCaptured) {
  const Experts host = make_problem(cuda_case(), 1).experts;
  try {
    ExpertsGraph g(host, {.tokens = 4, .top_k = 2, .act_dtype = DType::bf16}, "grouped_mm");
    ADD_FAILURE() << "captured CPU experts";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_supported);
  }
}

TEST(CudaGraph, BackendsThatAreNotCapturableAreRejected) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const Experts dev = make_problem(cuda_case(), 2).experts.to(Device::cuda(0));
  const auto refused = cuda_backends(false);
  EXPECT_FALSE(refused.empty());
  for (const std::string& b : refused) {
    try {
      ExpertsGraph g(dev, {.tokens = 4, .top_k = 2, .act_dtype = DType::bf16}, b);
      ADD_FAILURE() << "captured " << b;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::not_supported);
      EXPECT_NE(std::string(e.what()).find(b), std::string::npos) << e.what();
      for (const std::string& ok : cuda_backends(true))  // names what can be captured
        EXPECT_NE(std::string(e.what()).find(ok), std::string::npos) << e.what();
    }
  }
}

namespace {

struct GraphCase {
  DType dtype;
  int64_t tokens, top_k, experts;
  bool transposed;
};

// T tokens of `dtype`, top-k K over E experts (every one in use) of H x I with biases; i32 ids, bf16 routing weights.
ProblemConfig biased_case(DType dtype, int64_t T, int64_t K, int64_t H, int64_t I, int64_t E) {
  ProblemConfig cfg = cuda_case();
  cfg.act = cfg.wdt = dtype;
  cfg.T = T;
  cfg.K = K;
  cfg.H = H;
  cfg.I = I;
  cfg.E = cfg.used = E;
  cfg.has_bias = true;
  cfg.idt = DType::i32;
  cfg.rwt = DType::bf16;
  return cfg;
}

void replay_matches_uncaptured(const std::string& backend, const GraphCase& gc, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ProblemConfig cfg = biased_case(gc.dtype, gc.tokens, gc.top_k, 96, 40, gc.experts);
  cfg.transposed = gc.transposed;
  ExpertsProblem p;
  p.config = cfg;
  p.experts = make_experts(cfg, rng);
  const Experts dev = p.experts.to(Device::cuda(0));
  // A backend that does not take these experts (deepgemm: f32) is checked by the tests of its refusal.
  if (!ExpertsInterface::global().get(backend)->supports(dev, gc.dtype)) return;
  const ExpertsGraphShape shape{.tokens = gc.tokens, .top_k = gc.top_k, .act_dtype = gc.dtype,
                                .index_dtype = DType::i32, .weight_dtype = DType::bf16};
  ExpertsGraph g(dev, shape, backend);
  EXPECT_EQ(g.backend(), backend);
  const std::string label = backend + " " + dtype_name(gc.dtype) + " T=" + std::to_string(gc.tokens) +
                            " K=" + std::to_string(gc.top_k) + (gc.transposed ? " transposed" : "");
  for (int round = 0; round < 3; ++round) {
    p.config.sentinel_every = round == 1 ? 4 : 0;
    make_inputs(p.config, rng, p);
    p.reference = reference_forward(p.experts, p.hidden_states, p.top_k_index, p.top_k_weights);
    g.hidden_states().copy_from(p.hidden_states.view());
    g.top_k_index().copy_from(p.top_k_index.view());
    g.top_k_weights().copy_from(p.top_k_weights.view());
    Tensor out = g.out();
    if (out.numel() > 0) poison(out);
    g.replay();
    const Tensor replayed = g.out().to(Device::cpu());  // copies on the default stream: after the replay
    const Tensor direct = run_backend(dev, backend, p);
    EXPECT_TRUE(bitwise_equal(replayed, direct)) << label << " round " << round;
    EXPECT_EQ(compare_with_reference(p, replayed), "") << label << " round " << round;
  }
  EXPECT_NO_THROW(g.check_errors());
}

}  // namespace

// Every capturable backend on each shape.
TEST(CudaGraph, ReplayIsBitIdenticalToTheUncapturedCall) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const GraphCase cases[] = {
      {DType::bf16, 1, 8, 128, false},  {DType::bf16, 8, 8, 128, false}, {DType::f32, 5, 2, 8, false},
      {DType::f16, 333, 2, 8, false},   {DType::bf16, 64, 8, 128, false}, {DType::bf16, 333, 4, 60, false},
      {DType::f32, 17, 2, 8, true},     {DType::f16, 1, 1, 1, false},
  };
  const auto capturable = cuda_backends(true);
  EXPECT_FALSE(capturable.empty());
  uint64_t seed = 100;
  for (const std::string& b : capturable)
    for (const GraphCase& c : cases) replay_matches_uncaptured(b, c, seed++);
}

TEST(CudaGraph, ReplayOnAStreamAndErrorCheck) {
  MOEKIT_SKIP_WITHOUT_CUDA();
#ifdef MOEKIT_WITH_CUDA
  ProblemConfig cfg = cuda_case();
  cfg.T = 6;
  cfg.K = 2;
  cfg.used = 8;
  const ExpertsProblem p = make_problem(cfg, 3);
  const Experts dev = p.experts.to(Device::cuda(0));
  for (const std::string& b : cuda_backends(true)) {
    ExpertsGraph g(dev, {.tokens = 6, .top_k = 2, .act_dtype = DType::bf16, .index_dtype = DType::i64}, b);
    Tensor index = Tensor::copy_of(p.top_k_index.view(), Device::cpu());
    index.ptr<int64_t>()[5] = 99;  // token 2, slot 1
    g.hidden_states().copy_from(p.hidden_states.view());
    g.top_k_index().copy_from(index.view());
    g.top_k_weights().copy_from(p.top_k_weights.view());
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    g.replay(stream);
    try {
      g.check_errors(stream);
      ADD_FAILURE() << b << ": bad id not reported";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("top_k_index[2, 1] = 99"), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(g.check_errors(stream));
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
#endif
}

TEST(CudaGraph, EmptyShape) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const Experts dev = make_problem(cuda_case(), 4).experts.to(Device::cuda(0));
  for (const std::string& b : cuda_backends(true)) {
    ExpertsGraph g(dev, {.tokens = 0, .top_k = 2, .act_dtype = DType::bf16}, b);
    g.replay();
    EXPECT_EQ(g.out().shape(), (Shape{0, 64})) << b;
  }
}

TEST(CudaGraph, MovedGraphStillReplays) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const Experts dev = make_problem(cuda_case(), 5).experts.to(Device::cuda(0));
  for (const std::string& b : cuda_backends(true)) {
    ExpertsGraph a(dev, {.tokens = 3, .top_k = 2, .act_dtype = DType::bf16}, b);
    ExpertsGraph moved = std::move(a);
    moved.replay();
    const Tensor out = moved.out().to(Device::cpu());
    EXPECT_EQ(out.shape(), (Shape{3, 64})) << b;
  }
}

// A forward recorded on a stream it never ran on, in global capture mode, after a warm-up on another stream
// (what torch.cuda.graph does): the stream's workspace is made during the capture, grows during a second,
// larger capture on the same stream, and both graphs replay right afterwards, the first one included.
TEST(CudaGraph, CaptureOnAStreamThatNeverRanAForward) {
  MOEKIT_SKIP_WITHOUT_CUDA();
#ifdef MOEKIT_WITH_CUDA
  for (const std::string& b : cuda_backends(true)) {
    ProblemConfig cfg = cuda_case();
    cfg.K = 2;
    cfg.idt = DType::i32;
    const ExpertsProblem base = make_problem(cfg, 6);
    const Experts dev = base.experts.to(Device::cuda(0));
    if (!ExpertsInterface::global().get(b)->supports(dev, DType::bf16)) continue;
    cudaStream_t capture = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking), cudaSuccess);
    struct Recorded {
      ExpertsProblem p;
      Tensor x, idx, w, out;
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
    };
    std::vector<Recorded> graphs(2);
    const int64_t tokens[2] = {3, 500};  // the second needs a larger workspace than the first
    for (int i = 0; i < 2; ++i) {
      Recorded& r = graphs[i];
      cfg.T = tokens[i];
      r.p.config = cfg;
      r.p.experts = base.experts;  // the module's weights, new inputs
      std::mt19937_64 rng(20 + i);
      make_inputs(cfg, rng, r.p);
      r.p.reference = reference_forward(r.p.experts, r.p.hidden_states, r.p.top_k_index, r.p.top_k_weights);
      r.x = r.p.hidden_states.to(dev.device());
      r.idx = r.p.top_k_index.to(dev.device());
      r.w = r.p.top_k_weights.to(dev.device());
      r.out = Tensor::zeros({cfg.T, cfg.H}, DType::bf16, dev.device());
      const ExpertsCall call{r.x.view(), r.idx.view(), r.w.view(), r.out.view(), capture};
      dev.forward_with(b, ExpertsCall{r.x.view(), r.idx.view(), r.w.view(), r.out.view(), nullptr});  // warm-up
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(cudaStreamBeginCapture(capture, cudaStreamCaptureModeGlobal), cudaSuccess);
      try {
        dev.forward_with(b, call);
      } catch (const Error& e) {
        ADD_FAILURE() << b << " T=" << cfg.T << ": " << e.what();
      }
      ASSERT_EQ(cudaStreamEndCapture(capture, &r.graph), cudaSuccess) << b;
      ASSERT_EQ(cudaGraphInstantiate(&r.exec, r.graph, 0), cudaSuccess) << b;
    }
    for (int round = 0; round < 2; ++round)
      for (Recorded& r : graphs) {
        poison(r.out);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // `capture` does not wait for the default stream
        ASSERT_EQ(cudaGraphLaunch(r.exec, capture), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(capture), cudaSuccess);
        EXPECT_EQ(compare_with_reference(r.p, r.out.to(Device::cpu())), "")
            << b << " T=" << r.p.config.T << " round " << round;
      }
    EXPECT_NO_THROW(check_experts_errors(dev, capture));
    for (Recorded& r : graphs) {
      (void)cudaGraphExecDestroy(r.exec);
      (void)cudaGraphDestroy(r.graph);
    }
    ASSERT_EQ(cudaStreamDestroy(capture), cudaSuccess);
  }
#endif
}

// batched_mm's one-launch small-T form (kernels.h pair_fused: the second projection's rows staged in shared memory
// while the first projection runs, a grid barrier between them) gives the two launches' output bit for bit, in
// graphs and uncaptured, with and without PDL, over shapes where every slot is staged and where only some are,
// column blocks of unequal width, sentinels, biases, both 16-bit types and a non-gated activation.
TEST(CudaGraph, OneLaunchSmallTPathIsBitwiseTheTwoLaunches) {
  MOEKIT_SKIP_WITHOUT_CUDA();
#ifdef MOEKIT_WITH_CUDA
  if (cuda::device_info(0).arch() != 90) GTEST_SKIP() << "the one-launch form needs sm_90";
  const bool pdl_was = cuda::pdl_enabled();
  const int64_t one_was = cuda::set_batched_one_launch_max_tokens(0);
  struct Shape {
    DType dtype;
    int64_t T, H, I, E;
    int K;
    bool gated;
  };
  // (T = 1, H = 2056, I = 1048: 16 columns per block, 33.5 KB per slot, 6 of 8 slots staged.)
  const Shape shapes[] = {{DType::bf16, 1, 2048, 768, 128, 8, true}, {DType::bf16, 1, 2056, 1048, 40, 8, true},
                          {DType::f16, 2, 1032, 392, 32, 8, true},   {DType::bf16, 3, 520, 264, 16, 4, false},
                          {DType::bf16, 1, 64, 48, 8, 2, true},      {DType::f16, 1, 4104, 136, 64, 6, true}};
  std::mt19937_64 rng(91);
  for (const Shape& sh : shapes) {
    ProblemConfig cfg = biased_case(sh.dtype, sh.T, sh.K, sh.H, sh.I, sh.E);
    cfg.has_gate = sh.gated;
    if (!sh.gated) cfg.activation = Activation::gelu;
    ExpertsProblem p;
    p.config = cfg;
    p.experts = make_experts(cfg, rng);
    const Experts dev = p.experts.to(Device::cuda(0));
    const ExpertsGraphShape shape{.tokens = sh.T, .top_k = sh.K, .act_dtype = sh.dtype, .index_dtype = DType::i32,
                                  .weight_dtype = DType::bf16};
    for (int round = 0; round < 2; ++round) {
      p.config.sentinel_every = round == 1 ? 3 : 0;
      make_inputs(p.config, rng, p);
      p.reference = reference_forward(p.experts, p.hidden_states, p.top_k_index, p.top_k_weights);
      Tensor two;
      for (int one = 0; one < 2; ++one)
        for (int pdl = 0; pdl < 2; ++pdl) {
          const std::string label = std::string(one ? "one launch" : "two launches") + (pdl ? " pdl " : " ") +
                                    dtype_name(sh.dtype) + " T=" + std::to_string(sh.T) + " H=" + std::to_string(sh.H) +
                                    " I=" + std::to_string(sh.I) + " round " + std::to_string(round);
          cuda::set_pdl_enabled(pdl != 0);
          cuda::set_batched_one_launch_max_tokens(one ? sh.T : 0);
          const int64_t calls0 = cuda::kernels::pair_fused_calls();
          ExpertsGraph g(dev, shape, "batched_mm");
          g.hidden_states().copy_from(p.hidden_states.view());
          g.top_k_index().copy_from(p.top_k_index.view());
          g.top_k_weights().copy_from(p.top_k_weights.view());
          for (int rep = 0; rep < 3; ++rep) {
            Tensor o = g.out();
            poison(o);
            g.replay();
            const Tensor out = g.out().to(Device::cpu());
            EXPECT_EQ(compare_with_reference(p, out), "") << label;
            if (!two.defined())
              two = out;
            else
              EXPECT_TRUE(bitwise_equal(out, two)) << label << " rep " << rep;
          }
          const Tensor direct = run_backend(dev, "batched_mm", p);
          EXPECT_TRUE(bitwise_equal(direct, two)) << label << " uncaptured";
          EXPECT_NO_THROW(g.check_errors());
          const int64_t calls = cuda::kernels::pair_fused_calls() - calls0;
          if (one)
            EXPECT_GE(calls, 2) << label << ": the one-launch form did not run";
          else
            EXPECT_EQ(calls, 0) << label;
        }
    }
  }
  cuda::set_pdl_enabled(pdl_was);
  cuda::set_batched_one_launch_max_tokens(one_was);
#endif
}

// batched_mm's small-T path with Programmatic Dependent Launch (the second projection starts while the first
// runs and prefetches its weight rows into L2) and in both forms of its kernels (the first projection reading its
// activation row in place, the streaming combine; and the first forms): replays with PDL on, with the prefetch forced on and
// off, with PDL off and with the first forms are bit-identical to each other and match the reference; odd sizes
// (the unaligned kernels), sentinels in top_k_index, T = 1, 3 and 8 with 8 of 128 experts (the GEMVs serve
// pairs < experts), and wider rows of 32 experts, where a block of the streaming combine takes several column
// groups (and a warp several units) unevenly.
TEST(CudaGraph, ProgrammaticDependentLaunchKeepsTheSmallTPathExact) {
  MOEKIT_SKIP_WITHOUT_CUDA();
#ifdef MOEKIT_WITH_CUDA
  const bool pdl_was = cuda::pdl_enabled();
  const int64_t prefetch_was = cuda::pdl_prefetch_bytes();
  const bool direct_was = cuda::kernels::pair_gemv_direct(), stream_was = cuda::kernels::combine_stream();
  struct Mode {
    bool pdl;
    int64_t prefetch;
    bool new_forms;
    const char* name;
  };
  const Mode modes[] = {{false, 0, true, "plain"},
                        {true, int64_t(1) << 40, true, "pdl+prefetch"},
                        {true, 0, true, "pdl"},
                        {true, 0, false, "pdl, first forms"},
                        {false, 0, false, "plain, first forms"}};
  struct Shape {
    DType dtype;
    int64_t T, H, I, E;
  };
  const Shape shapes[] = {{DType::bf16, 1, 96, 40, 128},  {DType::bf16, 3, 256, 72, 128},  {DType::f32, 8, 64, 48, 128},
                          {DType::bf16, 8, 100, 36, 128}, {DType::f16, 5, 98, 40, 128},    {DType::bf16, 1, 1032, 392, 32},
                          {DType::bf16, 3, 520, 1048, 32}, {DType::f16, 2, 2056, 264, 32}};
  std::mt19937_64 rng(77);
  for (const Shape& sh : shapes) {
    const ProblemConfig cfg = biased_case(sh.dtype, sh.T, 8, sh.H, sh.I, sh.E);
    ExpertsProblem p;
    p.config = cfg;
    p.experts = make_experts(cfg, rng);
    const Experts dev = p.experts.to(Device::cuda(0));
    const ExpertsGraphShape shape{.tokens = sh.T, .top_k = 8, .act_dtype = sh.dtype, .index_dtype = DType::i32,
                                  .weight_dtype = DType::bf16};
    for (int round = 0; round < 2; ++round) {
      p.config.sentinel_every = round == 1 ? 3 : 0;
      make_inputs(p.config, rng, p);
      p.reference = reference_forward(p.experts, p.hidden_states, p.top_k_index, p.top_k_weights);
      Tensor first;
      for (const Mode& m : modes) {
        const std::string label = std::string(m.name) + " " + dtype_name(sh.dtype) + " T=" + std::to_string(sh.T) +
                                  " H=" + std::to_string(sh.H) + " I=" + std::to_string(sh.I) + " round " +
                                  std::to_string(round);
        cuda::set_pdl_enabled(m.pdl);
        cuda::set_pdl_prefetch_bytes(m.prefetch);
        cuda::kernels::set_pair_gemv_direct(m.new_forms);
        cuda::kernels::set_combine_stream(m.new_forms);
        ExpertsGraph g(dev, shape, "batched_mm");  // recorded under this mode
        g.hidden_states().copy_from(p.hidden_states.view());
        g.top_k_index().copy_from(p.top_k_index.view());
        g.top_k_weights().copy_from(p.top_k_weights.view());
        for (int rep = 0; rep < 2; ++rep) {
          Tensor o = g.out();
          poison(o);
          g.replay();
          const Tensor out = g.out().to(Device::cpu());
          EXPECT_EQ(compare_with_reference(p, out), "") << label;
          if (!first.defined())
            first = out;
          else
            EXPECT_TRUE(bitwise_equal(out, first)) << label << " rep " << rep;
        }
        const Tensor direct = run_backend(dev, "batched_mm", p);  // uncaptured, same mode
        EXPECT_TRUE(bitwise_equal(direct, first)) << label << " uncaptured";
        EXPECT_NO_THROW(g.check_errors());
      }
    }
  }
  cuda::set_pdl_enabled(pdl_was);
  cuda::set_pdl_prefetch_bytes(prefetch_was);
  cuda::kernels::set_pair_gemv_direct(direct_was);
  cuda::kernels::set_combine_stream(stream_was);
#endif
}

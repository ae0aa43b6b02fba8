// ExpertsGraph: replays of every capturable backend are bit-identical to the uncaptured call on the same
// inputs, for new inputs written into the captured buffers; backends that are not capturable are refused;
// errors are reported.
#include <gtest/gtest.h>

#include "test_experts_problem.h"
#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime_api.h>
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

void replay_matches_uncaptured(const std::string& backend, const GraphCase& gc, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ProblemConfig cfg = cuda_case();
  cfg.act = cfg.wdt = gc.dtype;
  cfg.E = gc.experts;
  cfg.H = 96;
  cfg.I = 40;
  cfg.has_bias = true;
  cfg.transposed = gc.transposed;
  cfg.T = gc.tokens;
  cfg.K = gc.top_k;
  cfg.used = gc.experts;
  cfg.idt = DType::i32;
  cfg.rwt = DType::bf16;
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

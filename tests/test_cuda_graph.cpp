// ExpertsGraph: replays are bit-identical to the uncaptured call on the same inputs, for new inputs
// written into the captured buffers; eager cannot be captured; errors are reported.
#include <gtest/gtest.h>

#include "test_cuda_util.h"
#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace moekit;
using namespace moekit::test;

TEST(CudaGraph, CpuExpertsCannotBeCaptured) {
  std::mt19937_64 rng(1);
  const Experts host = make_random_experts(ExpertsConfig{}, rng);
  try {
    ExpertsGraph g(host, {.tokens = 4, .top_k = 2, .act_dtype = DType::bf16}, "grouped_mm");
    ADD_FAILURE() << "captured CPU experts";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_supported);
  }
}

TEST(CudaGraph, EagerIsRejected) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(2);
  const Experts dev = make_random_experts(ExpertsConfig{}, rng).to(Device::cuda(0));
  try {
    ExpertsGraph g(dev, {.tokens = 4, .top_k = 2, .act_dtype = DType::bf16}, "eager");
    ADD_FAILURE() << "captured eager";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_supported);
    EXPECT_NE(std::string(e.what()).find("eager"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("grouped_mm"), std::string::npos) << e.what();
  }
}

namespace {

struct GraphCase {
  const char* backend;
  DType dtype;
  int64_t tokens, top_k, experts;
  bool transposed;
};

void replay_matches_uncaptured(const GraphCase& gc, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ExpertsConfig cfg;
  cfg.dtype = gc.dtype;
  cfg.experts = gc.experts;
  cfg.hidden = 96;
  cfg.inter = 40;
  cfg.has_bias = true;
  cfg.transposed = gc.transposed;
  const Experts host = make_random_experts(cfg, rng);
  const Experts dev = host.to(Device::cuda(0));
  const ExpertsGraphShape shape{.tokens = gc.tokens, .top_k = gc.top_k, .act_dtype = gc.dtype,
                                .index_dtype = DType::i32, .weight_dtype = DType::bf16};
  ExpertsGraph g(dev, shape, gc.backend);
  EXPECT_EQ(g.backend(), gc.backend);
  const std::string label = std::string(gc.backend) + " " + dtype_name(gc.dtype) + " T=" +
                            std::to_string(gc.tokens) + " K=" + std::to_string(gc.top_k);
  for (int round = 0; round < 3; ++round) {
    const RoutedInputs in = make_routed_inputs(gc.tokens, gc.top_k, gc.experts, cfg.hidden, gc.experts,
                                               round == 1 ? 4 : 0, gc.dtype, DType::i32, DType::bf16, rng);
    g.hidden_states().copy_from(in.x.view());
    g.top_k_index().copy_from(in.index.view());
    g.top_k_weights().copy_from(in.weights.view());
    Tensor out = g.out();
    if (out.numel() > 0) poison(out);
    g.replay();
    const Tensor replayed = g.out().to(Device::cpu());  // copies on the default stream: after the replay
    const Tensor direct = run_on_cuda(dev, gc.backend, in);
    EXPECT_TRUE(bitwise_equal(replayed, direct)) << label << " round " << round;
    const auto ref = reference_forward(host, in.x, in.index, in.weights);
    EXPECT_LE(relative_l2(replayed.view(), ref), cuda_tolerance(gc.dtype)) << label << " round " << round;
  }
  EXPECT_NO_THROW(g.check_errors());
}

}  // namespace

TEST(CudaGraph, ReplayIsBitIdenticalToTheUncapturedCall) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const GraphCase cases[] = {
      {"batched_mm", DType::bf16, 1, 8, 128, false},  {"batched_mm", DType::bf16, 8, 8, 128, false},
      {"batched_mm", DType::f32, 5, 2, 8, false},     {"batched_mm", DType::f16, 333, 2, 8, false},
      {"grouped_mm", DType::bf16, 64, 8, 128, false}, {"grouped_mm", DType::bf16, 333, 4, 60, false},
      {"grouped_mm", DType::f32, 17, 2, 8, true},     {"grouped_mm", DType::f16, 1, 1, 1, false},
  };
  uint64_t seed = 100;
  for (const GraphCase& c : cases) replay_matches_uncaptured(c, seed++);
}

TEST(CudaGraph, ReplayOnAStreamAndErrorCheck) {
  MOEKIT_SKIP_WITHOUT_CUDA();
#ifdef MOEKIT_WITH_CUDA
  std::mt19937_64 rng(3);
  ExpertsConfig cfg;
  cfg.experts = 8;
  const Experts host = make_random_experts(cfg, rng);
  const Experts dev = host.to(Device::cuda(0));
  ExpertsGraph g(dev, {.tokens = 6, .top_k = 2, .act_dtype = DType::bf16, .index_dtype = DType::i64}, "grouped_mm");
  RoutedInputs in = make_routed_inputs(6, 2, 8, cfg.hidden, 8, 0, DType::bf16, DType::i64, DType::f32, rng);
  in.index.ptr<int64_t>()[5] = 99;  // token 2, slot 1
  g.hidden_states().copy_from(in.x.view());
  g.top_k_index().copy_from(in.index.view());
  g.top_k_weights().copy_from(in.weights.view());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  g.replay(stream);
  try {
    g.check_errors(stream);
    ADD_FAILURE() << "bad id not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("top_k_index[2, 1] = 99"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(g.check_errors(stream));
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
#endif
}

TEST(CudaGraph, EmptyShape) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(4);
  const Experts dev = make_random_experts(ExpertsConfig{}, rng).to(Device::cuda(0));
  ExpertsGraph g(dev, {.tokens = 0, .top_k = 2, .act_dtype = DType::bf16}, "batched_mm");
  g.replay();
  EXPECT_EQ(g.out().shape(), (Shape{0, 64}));
}

TEST(CudaGraph, MovedGraphStillReplays) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(5);
  const Experts dev = make_random_experts(ExpertsConfig{}, rng).to(Device::cuda(0));
  ExpertsGraph a(dev, {.tokens = 3, .top_k = 2, .act_dtype = DType::bf16}, "grouped_mm");
  ExpertsGraph b = std::move(a);
  b.replay();
  const Tensor out = b.out().to(Device::cpu());
  EXPECT_EQ(out.shape(), (Shape{3, 64}));
}

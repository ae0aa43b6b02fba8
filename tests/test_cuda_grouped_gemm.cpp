// The grouped projection kernels on the GPU: grouped_mm with the warp-specialised TMA kernel (sm_90a)
// in its path against the f64 reference, and with it switched off against the same reference, over
// odd sizes, empty experts, skewed routing, sentinels, every gate layout and bias; each output poisoned
// first. The kernel-level comparison of every variant with the SIMT kernel, and its timings, are in
// bench/cuda_grouped_bench.cu. Skips without a GPU; on devices other than sm_90a the TMA kernel does
// not serve and the fallback kernels are checked instead.
#include <gtest/gtest.h>

#include "test_cuda_util.h"
#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/policy.h"
#include "backends/cuda/state.h"
#endif

using namespace moekit;
using namespace moekit::test;

namespace {

struct Case {
  ExpertsConfig cfg;
  int64_t tokens = 0, top_k = 2, used = 0, sentinel_every = 0;
  bool skewed = false;
};

// Skewed routing: most pairs go to the first few experts (Zipf-like), the rest spread.
void skew(RoutedInputs& in, int64_t E, std::mt19937_64& rng) {
  auto* idx = in.index.ptr<int64_t>();
  const int64_t n = in.index.numel(), K = in.index.shape()[1];
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t p = 0; p < n; ++p) {
    if (idx[p] >= E || u(rng) < 0.3) continue;
    const int64_t hot = std::min<int64_t>(E - 1, int64_t(std::pow(u(rng), 3.0) * 4));
    bool taken = false;  // keep the token's experts distinct
    for (int64_t k = 0; k < K; ++k) taken |= idx[(p / K) * K + k] == hot;
    if (!taken) idx[p] = hot;
  }
}

int run_case(const Case& c, std::mt19937_64& rng) {
  const Experts host = make_random_experts(c.cfg, rng);
  const Experts dev = host.to(Device::cuda(0));
  RoutedInputs in = make_routed_inputs(c.tokens, c.top_k, c.cfg.experts, c.cfg.hidden, c.used, c.sentinel_every,
                                       c.cfg.dtype, DType::i64, DType::f32, rng);
  if (c.skewed) skew(in, c.cfg.experts, rng);
  const std::vector<double> ref = reference_forward(host, in.x, in.index, in.weights);
  const double tol = cuda_tolerance(c.cfg.dtype);
  int failures = 0;
  for (bool tma : {true, false}) {
#ifdef MOEKIT_WITH_CUDA
    const bool saved = cuda::set_grouped_tma_enabled(tma);
#endif
    const Tensor out = run_on_cuda(dev, "grouped_mm", in);
#ifdef MOEKIT_WITH_CUDA
    cuda::set_grouped_tma_enabled(saved);
#endif
    const double err = relative_l2(out.view(), ref);
    EXPECT_LE(err, tol) << (tma ? "tma on" : "tma off") << " T=" << c.tokens << " K=" << c.top_k
                        << (c.skewed ? " skewed " : " ") << c.cfg.to_string();
    failures += !(err <= tol);
  }
  return failures;
}

}  // namespace

// Sizes that give row tiles of 128 (the TMA kernel's regime): many rows per expert.
TEST(CudaGroupedGemm, TmaKernelAgainstReference) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(91);
  struct Shape3 {
    int64_t E, H, I, T, K;
  };
  const Shape3 shapes[] = {
      {8, 256, 128, 700, 2}, {16, 264, 200, 900, 4}, {7, 328, 136, 613, 3}, {32, 256, 128, 1200, 4}};
  int n = 0;
  for (const Shape3& s : shapes)
    for (DType dt : {DType::bf16, DType::f16}) {
      Case c;
      c.cfg.dtype = dt;
      c.cfg.experts = s.E;
      c.cfg.hidden = s.H;
      c.cfg.inter = s.I;
      c.cfg.has_bias = n % 2 == 1;
      c.cfg.concatenated = n % 3 != 2;
      c.cfg.gate = n % 4 == 3 ? GateKind::clamped_swiglu : GateKind::act_mul;
      c.cfg.act = n % 5 == 4 ? Activation::gelu : Activation::silu;
      c.tokens = s.T;
      c.top_k = s.K;
      c.used = n % 2 ? s.E - 2 : s.E;  // some experts empty
      c.sentinel_every = n % 3 == 1 ? 7 : 0;
      c.skewed = n % 2 == 0;
      EXPECT_EQ(run_case(c, rng), 0);
      ++n;
    }
}

// No gate (act-only first projection) and a single busy expert.
TEST(CudaGroupedGemm, TmaKernelActOnlyAndOneExpert) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(92);
  Case c;
  c.cfg.dtype = DType::bf16;
  c.cfg.experts = 8;
  c.cfg.hidden = 192;
  c.cfg.inter = 96;
  c.cfg.has_gate = false;
  c.cfg.act = Activation::relu2;
  c.cfg.has_bias = true;
  c.tokens = 500;
  c.top_k = 2;
  c.used = 8;
  EXPECT_EQ(run_case(c, rng), 0);
  c.cfg.has_gate = true;
  c.cfg.act = Activation::silu;
  c.cfg.has_bias = false;
  c.used = 1;
  c.top_k = 1;
  c.tokens = 600;
  EXPECT_EQ(run_case(c, rng), 0);
}

#ifdef MOEKIT_WITH_CUDA
namespace {

// run_deepgemm is not in the registry yet: build its call description the way the CUDA dispatch does
// (bf16/f16 experts in [out, in] layout, silu or clamped SwiGLU gate, concatenated or interleaved).
int run_deepgemm_case(const ExpertsConfig& cfg, int64_t T, int64_t K, int64_t used, std::mt19937_64& rng,
                      std::string* skip) {
  const Experts host = make_random_experts(cfg, rng);
  const Experts dev = host.to(Device::cuda(0));
  const RoutedInputs in =
      make_routed_inputs(T, K, cfg.experts, cfg.hidden, used, 5, cfg.dtype, DType::i32, DType::f32, rng);
  const std::vector<double> ref = reference_forward(host, in.x, in.index, in.weights);
  Tensor x = in.x.to(dev.device()), idx = in.index.to(dev.device()), w = in.weights.to(dev.device());
  Tensor out = Tensor::empty(x.shape(), x.dtype(), dev.device());
  poison(out);
  const ExpertsCall call{x.view(), idx.view(), w.view(), out.view(), nullptr};

  const ExpertsSpec& spec = dev.spec();
  cuda::DeviceGuard guard(0);
  cuda::CudaState& state = cuda::cuda_state(dev);
  std::lock_guard<std::mutex> lock(state.mutex);
  cuda::CallContext c(dev, call);
  c.stream = nullptr;
  c.device = &cuda::device_info(0);
  c.ws = &state.workspace(nullptr, 0);
  c.type = cfg.dtype == DType::bf16 ? cuda::kernels::Elem::bf16 : cuda::kernels::Elem::f16;
  c.weight_type = cuda::kernels::Elem::f32;
  c.index_type = cuda::kernels::Index::i32;
  c.tokens = T;
  c.top_k = K;
  c.pairs = T * K;
  c.hidden = spec.hidden;
  c.inter = spec.intermediate;
  c.n1 = 2 * spec.intermediate;
  c.experts_count = int(spec.num_experts);
  c.gate.kind = spec.gate == GateKind::clamped_swiglu ? cuda::kernels::kGateClampedSwiglu : cuda::kernels::kGateActMul;
  c.gate.activation = cuda::kernel_activation(spec.activation);
  c.gate.concatenated = spec.is_concatenated ? 1 : 0;
  c.gate.alpha = spec.alpha;
  c.gate.limit = spec.limit;
  c.first_epilogue = cuda::kernels::kEpiGated;
  const ExpertsWeights& wt = dev.weights();
  c.w1 = wt.first().data();
  c.w1_expert = c.n1 * c.hidden;
  c.w1_n = c.hidden;
  c.w1_k = 1;
  c.b1 = wt.first_bias().defined() ? wt.first_bias().data() : nullptr;
  c.w2 = wt.down_proj.data();
  c.w2_expert = c.hidden * c.inter;
  c.w2_n = c.inter;
  c.w2_k = 1;
  c.b2 = wt.down_proj_bias.defined() ? wt.down_proj_bias.data() : nullptr;
  *skip = cuda::deepgemm_unsupported_reason(c);
  if (!skip->empty()) return 0;
  cuda::run_deepgemm(c);
  EXPECT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  const double err = relative_l2(out.to(Device::cpu()).view(), ref);
  EXPECT_LE(err, cuda_tolerance(cfg.dtype)) << "deepgemm T=" << T << " K=" << K << " " << cfg.to_string();
  return err <= cuda_tolerance(cfg.dtype) ? 0 : 1;
}

}  // namespace

TEST(CudaGroupedGemm, DeepgemmContiguousLayout) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(93);
  struct Sz {
    int64_t E, H, I, T, K, used;
    DType dt;
    bool bias, concat;
  };
  const Sz sizes[] = {{8, 256, 128, 300, 2, 8, DType::bf16, false, true},
                      {16, 264, 200, 411, 4, 13, DType::f16, true, true},
                      {7, 128, 96, 5, 2, 7, DType::bf16, false, false},
                      {32, 256, 128, 1200, 8, 32, DType::bf16, true, false}};
  for (const Sz& z : sizes) {
    ExpertsConfig cfg;
    cfg.experts = z.E;
    cfg.hidden = z.H;
    cfg.inter = z.I;
    cfg.dtype = z.dt;
    cfg.has_bias = z.bias;
    cfg.concatenated = z.concat;
    std::string skip;
    EXPECT_EQ(run_deepgemm_case(cfg, z.T, z.K, z.used, rng, &skip), 0);
    if (!skip.empty()) GTEST_SKIP() << skip;
  }
}
#endif

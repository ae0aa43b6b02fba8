// The grouped projection kernels on the GPU: every registered backend that runs on cuda:0 (grouped_mm with
// the warp-specialised TMA kernel (sm_90a) in its path and with it switched off, deepgemm, the others)
// against the f64 reference in the TMA kernel's regime (row tiles of 128 or 64: many rows per expert), over odd
// sizes, empty experts, skewed routing, sentinels, every gate layout and bias; each output poisoned first.
// The kernel-level comparison of every variant with the SIMT kernel, and its timings, are in
// bench/cuda_grouped_bench.cu. Skips without a GPU; on devices other than sm_90a the TMA kernel does not
// serve and the fallback kernels are checked instead.
#include <gtest/gtest.h>

#include "test_experts_problem.h"
#ifdef MOEKIT_WITH_CUDA
#include "backends/cuda/kernels/kernels.h"
#include "backends/cuda/policy.h"
#endif

using namespace moekit;
using namespace moekit::test;

namespace {

// Skewed routing: most pairs go to the first few experts (Zipf-like), the rest spread; the reference is
// recomputed for the new routing.
void skew(ExpertsProblem& p, std::mt19937_64& rng) {
  auto* idx = p.top_k_index.ptr<int64_t>();
  const int64_t n = p.top_k_index.numel(), K = p.config.K, E = p.config.E;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] >= E || u(rng) < 0.3) continue;
    const int64_t hot = std::min<int64_t>(E - 1, int64_t(std::pow(u(rng), 3.0) * 4));
    bool taken = false;  // keep the token's experts distinct
    for (int64_t k = 0; k < K; ++k) taken |= idx[(i / K) * K + k] == hot;
    if (!taken) idx[i] = hot;
  }
  p.reference = reference_forward(p.experts, p.hidden_states, p.top_k_index, p.top_k_weights);
}

// Every backend on cuda:0 (the TMA engine in the form its route tile picks: ping-pong up to ~128 rows per
// expert, else cooperative), the three engine backends once more with ping-pong switched off (cooperative
// throughout) and the epilogues' other staging schedule, grouped_mm and deepgemm once more so with f32
// second-projection rows, and grouped_mm once more with the TMA kernel switched off.
void check_problem(const ExpertsProblem& p) {
  Outcome outcome;
  check_backends_on(p, Device::cuda(0), outcome);
#ifdef MOEKIT_WITH_CUDA
  const bool saved = cuda::set_grouped_tma_enabled(false);
  check_backend(p, p.experts.to(Device::cuda(0)), "grouped_mm", "grouped_mm (no TMA)", outcome);
  cuda::set_grouped_tma_enabled(saved);
  const bool pp = cuda::kernels::set_grouped_gemm_tma_pingpong(false);
  const bool split = cuda::kernels::set_grouped_gemm_tma_split_out(false);
  const Experts on_gpu = p.experts.to(Device::cuda(0));
  for (const char* name : {"grouped_mm", "deepgemm", "sonicmoe"})
    if (ExpertsInterface::global().get(name)->supports(on_gpu, p.config.act))
      check_backend(p, on_gpu, name, std::string(name) + " (cooperative)", outcome);
  // the second projection in f32 rows (the combine over them) instead of 16-bit ones
  const bool rows16 = cuda::set_grouped_down_rows16(false);
  for (const char* name : {"grouped_mm", "deepgemm"})
    if (ExpertsInterface::global().get(name)->supports(on_gpu, p.config.act))
      check_backend(p, on_gpu, name, std::string(name) + " (cooperative, f32 rows)", outcome);
  cuda::set_grouped_down_rows16(rows16);
  cuda::kernels::set_grouped_gemm_tma_pingpong(pp);
  cuda::kernels::set_grouped_gemm_tma_split_out(split);
#endif
  EXPECT_GT(outcome.ran["grouped_mm"], 0);
  EXPECT_EQ(outcome.fail, 0);
}

#ifdef MOEKIT_WITH_CUDA
// A small case for comparing two forms of the TMA engine: hidden 264, intermediate 200 (neither a multiple of the
// tiles), sentinels every 7 rows, gated silu or act-only relu2.
ProblemConfig tma_form_case(int64_t E, int64_t T, int64_t K, bool gated, bool f16, bool bias) {
  ProblemConfig c = cuda_case();
  c.act = c.wdt = f16 ? DType::f16 : DType::bf16;
  c.E = E;
  c.H = 264;
  c.I = 200;
  c.T = T;
  c.K = K;
  c.has_gate = gated;
  c.activation = gated ? Activation::silu : Activation::relu2;
  c.has_bias = bias;
  c.sentinel_every = 7;
  return c;
}

// grouped_mm, deepgemm and sonicmoe on one problem with an engine switch (`set`, returning the previous setting) on
// and off: each output against the reference, and the two bit for bit the same.
void expect_same_bits_either_way(const ProblemConfig& c, uint64_t seed, bool (*set)(bool)) {
  const ExpertsProblem p = make_problem(c, seed);
  const Experts on_gpu = p.experts.to(Device::cuda(0));
  for (const char* name : {"grouped_mm", "deepgemm", "sonicmoe"}) {
    if (!ExpertsInterface::global().get(name)->supports(on_gpu, c.act)) continue;
    SCOPED_TRACE(::testing::Message() << name << " E " << c.E << " T " << c.T << " gated " << c.has_gate << " "
                                      << dtype_name(c.act));
    const bool was = set(true);
    const Tensor on = run_backend(on_gpu, name, p);
    set(false);
    const Tensor off = run_backend(on_gpu, name, p);
    set(was);
    EXPECT_EQ(compare_with_reference(p, on), "");
    EXPECT_EQ(compare_with_reference(p, off), "");
    EXPECT_TRUE(bitwise_equal(on, off));
  }
}
#endif

}  // namespace

TEST(CudaGroupedGemm, TmaKernelAgainstReference) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(91);
  struct Shape3 {
    int64_t E, H, I, T, K;
  };
  const Shape3 shapes[] = {
      {8, 256, 128, 700, 2}, {16, 264, 200, 900, 4}, {7, 328, 136, 613, 3}, {32, 256, 128, 1200, 4},
      {64, 264, 136, 900, 6}};  // the last: ~85 rows per expert, the engine's ping-pong form
  int n = 0;
  for (const Shape3& s : shapes)
    for (DType dt : {DType::bf16, DType::f16}) {
      ProblemConfig c = cuda_case();
      c.act = c.wdt = dt;
      c.E = s.E;
      c.H = s.H;
      c.I = s.I;
      c.T = s.T;
      c.K = s.K;
      c.has_bias = n % 2 == 1;
      c.concatenated = n % 3 != 2;
      c.gate = n % 4 == 3 ? GateKind::clamped_swiglu : GateKind::act_mul;
      c.activation = n % 5 == 4 ? Activation::gelu : Activation::silu;
      c.used = n % 2 ? s.E - 2 : s.E;  // some experts empty
      c.sentinel_every = n % 3 == 1 ? 7 : 0;
      ExpertsProblem p = make_problem(c, 1000 + n);
      if (n % 2 == 0) skew(p, rng);
      check_problem(p);
      ++n;
    }
}

// The gated epilogue's unrolled form (silu or clamped SwiGLU, biases, both layouts; hardware exp and division) and
// its generic loop, in both engine forms (ping-pong and cooperative): each against the reference, and within a few
// units of the last place of each other.
TEST(CudaGroupedGemm, TmaFastGatedEpilogueMatchesTheGenericLoop) {
  MOEKIT_SKIP_WITHOUT_CUDA();
#ifdef MOEKIT_WITH_CUDA
  int n = 0;
  for (GateKind gate : {GateKind::clamped_swiglu, GateKind::act_mul})
    for (bool concatenated : {false, true})
      for (int64_t T : {int64_t(300), int64_t(1500)}) {  // ~75 and ~375 rows per expert
        ProblemConfig c = cuda_case();
        c.act = c.wdt = n % 2 ? DType::f16 : DType::bf16;
        c.E = 8;
        c.H = 264;
        c.I = 200;  // a partial last column tile
        c.T = T;
        c.K = 2;
        c.has_bias = true;
        c.concatenated = concatenated;
        c.gate = gate;
        c.activation = Activation::silu;
        c.sentinel_every = 5;
        const ExpertsProblem p = make_problem(c, 2000 + n++);
        const Experts on_gpu = p.experts.to(Device::cuda(0));
        SCOPED_TRACE(::testing::Message() << "clamped " << (gate == GateKind::clamped_swiglu) << " concatenated "
                                          << concatenated << " T " << T << " " << dtype_name(c.act));
        const Tensor fast = run_backend(on_gpu, "grouped_mm", p);
        const bool was = cuda::kernels::set_grouped_gemm_tma_fast_gate(false);
        const Tensor generic = run_backend(on_gpu, "grouped_mm", p);
        cuda::kernels::set_grouped_gemm_tma_fast_gate(was);
        EXPECT_EQ(compare_with_reference(p, fast), "");
        EXPECT_EQ(compare_with_reference(p, generic), "");
        const Tensor f = fast.to(DType::f32), g = generic.to(DType::f32);
        double num = 0, den = 0;
        for (int64_t i = 0; i < f.numel(); ++i) {
          const double d = double(f.ptr<float>()[i]) - double(g.ptr<float>()[i]);
          num += d * d;
          den += double(g.ptr<float>()[i]) * double(g.ptr<float>()[i]);
        }
        EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 4e-3);  // bf16 / f16 rounding of a few outputs apart
      }
#endif
}

// The cooperative form's idle second warpgroup (an expert's last tile of at most 64 rows) released without MMAs,
// against the same tiles with it multiplying rows it does not store: bit for bit the same output, and each against
// the reference; grouped_mm (contiguous rows), deepgemm and sonicmoe (gathered rows), gated and act-only.
TEST(CudaGroupedGemm, TmaSkippedIdleWarpgroupIsBitIdentical) {
  MOEKIT_SKIP_WITHOUT_CUDA();
#ifdef MOEKIT_WITH_CUDA
  const bool pp = cuda::kernels::set_grouped_gemm_tma_pingpong(false);  // cooperative tiles throughout
  int n = 0;
  for (bool gated : {true, false})
    for (int64_t T : {int64_t(700), int64_t(2100)}) {  // ~175 and ~525 rows per expert: last tiles of any size
      expect_same_bits_either_way(tma_form_case(8, T, 2, gated, n % 2, !gated), 3000 + n,
                                  cuda::kernels::set_grouped_gemm_tma_skip_idle);
      ++n;
    }
  cuda::kernels::set_grouped_gemm_tma_pingpong(pp);
#endif
}

// The ping-pong form over clusters of two CTAs (route tiles of 128 rows, the weight boxes multicast) against the
// ping-pong form over route tiles of 64: bit for bit the same output, and each against the reference; grouped_mm,
// deepgemm and sonicmoe, gated with biases and act-only, odd expert counts (CTAs past an expert's end), one row per
// expert at the smallest.
TEST(CudaGroupedGemm, TmaClusterPairsAreBitIdentical) {
  MOEKIT_SKIP_WITHOUT_CUDA();
#ifdef MOEKIT_WITH_CUDA
  struct Case {
    int64_t E, T, K;
    bool gated;
  };
  // ~75, ~175 and ~6 rows per expert (the last in the gathered form's regime too: sonicmoe's limit is 128)
  const Case cases[] = {{8, 300, 2, true}, {8, 700, 2, false}, {13, 351, 2, true}, {40, 120, 2, true}};
  int n = 0;
  for (const Case& k : cases) {
    ProblemConfig c = tma_form_case(k.E, k.T, k.K, k.gated, n % 2, n % 2 == 0);
    c.used = n == 2 ? k.E - 3 : k.E;
    expect_same_bits_either_way(c, 4000 + n++, cuda::kernels::set_grouped_gemm_tma_pair);
  }
#endif
}

// The pair form's stage releases at CTA scope against those at cluster scope: the same bits, each against the
// reference (two of the cases above: gated with biases over 8 experts, act-only f16 over 13 with 3 unused).
TEST(CudaGroupedGemm, TmaClusterPairsReleasedAtCtaScopeAreBitIdentical) {
  MOEKIT_SKIP_WITHOUT_CUDA();
#ifdef MOEKIT_WITH_CUDA
  const bool was = cuda::kernels::set_grouped_gemm_tma_pair(true);
  ProblemConfig c = tma_form_case(8, 300, 2, true, false, true);
  expect_same_bits_either_way(c, 4100, cuda::kernels::set_grouped_gemm_tma_pair_cta_release);
  c = tma_form_case(13, 351, 2, false, true, false);
  c.used = 10;
  expect_same_bits_either_way(c, 4101, cuda::kernels::set_grouped_gemm_tma_pair_cta_release);
  cuda::kernels::set_grouped_gemm_tma_pair(was);
#endif
}

// No gate (act-only first projection) and a single busy expert.
TEST(CudaGroupedGemm, TmaKernelActOnlyAndOneExpert) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  ProblemConfig c = cuda_case();
  c.E = 8;
  c.H = 192;
  c.I = 96;
  c.has_gate = false;
  c.activation = Activation::relu2;
  c.has_bias = true;
  c.T = 500;
  c.K = 2;
  check_problem(make_problem(c, 92));
  c.has_gate = true;
  c.activation = Activation::silu;
  c.has_bias = false;
  c.used = 1;
  c.K = 1;
  c.T = 600;
  check_problem(make_problem(c, 93));
}

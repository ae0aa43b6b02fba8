// Timing of the CUDA backends on the qwen3-30b-a3b experts shape (H=2048, I=768, E=128, K=8, bf16)
// beside the anchors of ANCHORS.md. Disabled by default (a measurement, not a check); run with
//   test_cuda_bench --gtest_also_run_disabled_tests
// Each row: median of many calls timed with CUDA events, rotating over input sets; uncaptured
// ("plain") and, for the capturable backends, CUDA-graph replays. Every variant's output is compared
// with eager's first (and with the f64 reference at T=1) before it is timed.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>

#include "test_experts_problem.h"
#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/kernels/kernels.h"
#include "backends/cuda/policy.h"
#endif

using namespace moekit;
using namespace moekit::test;

#ifdef MOEKIT_WITH_CUDA
namespace {

// Uniform values of standard deviation `std` (not zeros: realistic data), bf16, filled in parallel.
Tensor uniform_bf16(const Shape& shape, double std, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::bf16);
  const int64_t n = t.numel();
  auto* p = t.ptr<uint16_t>();
  const float a = float(std * 1.7320508075688772);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = seed + uint64_t(i) * 0x9e3779b97f4a7c15ull;  // splitmix64
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = float(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = f32_to_bf16((2.0f * u - 1.0f) * a);
  }
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct DeviceInputs {
  Tensor x, idx, w, out;
};

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Median time of `launch` (one kernel) over 20 calls, microseconds.
double kernel_us(cudaStream_t stream, const std::function<cudaError_t()>& launch) {
  cudaEvent_t a = nullptr, b = nullptr;
  EXPECT_EQ(cudaEventCreate(&a), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&b), cudaSuccess);
  std::vector<double> t;
  for (int i = 0; i < 23; ++i) {
    EXPECT_EQ(cudaEventRecord(a, stream), cudaSuccess);
    EXPECT_EQ(launch(), cudaSuccess);
    EXPECT_EQ(cudaEventRecord(b, stream), cudaSuccess);
    EXPECT_EQ(cudaEventSynchronize(b), cudaSuccess);
    float ms = 0;
    EXPECT_EQ(cudaEventElapsedTime(&ms, a, b), cudaSuccess);
    if (i >= 3) t.push_back(ms * 1000.0);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

// The grouped_mm pipeline kernel by kernel (the arguments of src/backends/cuda/grouped_mm.cpp).
void grouped_breakdown(const Experts& experts, const DeviceInputs& in, cudaStream_t stream) {
  namespace k = cuda::kernels;
  const Device dev = experts.device();
  const int64_t T = in.x.size(0), K = in.idx.size(1), H = experts.spec().hidden, I = experts.spec().intermediate;
  const int64_t P = T * K, E = experts.spec().num_experts;
  const int tile_m = k::grouped_tile_m(P, int(E));
  auto ints = [&](int64_t n) { return Tensor::empty({n}, DType::i32, dev); };
  Tensor pair_expert = ints(P), pair_row = ints(P), sorted_pair = ints(P), hist = ints(k::route_blocks(P) * E),
         offsets = ints(E + 1), tile_offsets = ints(E + 1), err = Tensor::empty({1}, DType::i64, dev);
  Tensor act = Tensor::empty({P, I}, DType::bf16, dev), y = Tensor::empty({P, H}, DType::f32, dev);
  ASSERT_EQ(cudaMemset(err.data(), 0xff, 8), cudaSuccess);
  k::RoutingBuffers r{pair_expert.ptr<int32_t>(), pair_row.ptr<int32_t>(), sorted_pair.ptr<int32_t>(),
                      hist.ptr<int32_t>(),        offsets.ptr<int32_t>(),  tile_offsets.ptr<int32_t>(),
                      static_cast<unsigned long long*>(err.data())};
  k::GroupedGemmArgs g1;
  g1.type = k::Elem::bf16;
  g1.a = in.x.data();
  g1.lda = H;
  g1.a_rows = r.sorted_pair;
  g1.a_row_div = int(K);
  g1.b = experts.weights().gate_up_proj.data();
  g1.b_expert_stride = 2 * I * H;
  g1.b_stride_n = H;
  g1.b_stride_k = 1;
  g1.offsets = r.offsets;
  g1.tile_offsets = r.tile_offsets;
  g1.experts = int(E);
  g1.max_rows = P;
  g1.n = I;
  g1.k = H;
  g1.inter = I;
  g1.epilogue = k::kEpiGated;
  g1.out = act.data();
  g1.ldo = I;
  k::GroupedGemmArgs g2 = g1;
  g2.a = act.data();
  g2.lda = I;
  g2.a_rows = nullptr;
  g2.a_row_div = 1;
  g2.b = experts.weights().down_proj.data();
  g2.b_expert_stride = H * I;
  g2.b_stride_n = I;
  g2.n = H;
  g2.k = I;
  g2.epilogue = k::kEpiF32;
  g2.out = y.data();
  g2.ldo = H;
  const double route = kernel_us(stream, [&] {
    return k::route_sort(in.idx.data(), k::Index::i32, T, int(K), int(E), tile_m, r, stream);
  });
  const double f1 = 2.0 * P * 2 * I * H, f2 = 2.0 * P * I * H;
  std::printf("  T=%lld tile_m=%d: route_sort %.1f us", (long long)T, tile_m, route);
  struct Kernel { const char* name; int arch; bool wide; };
  for (const Kernel& kn : {Kernel{"wgmma 128x256", 90, true}, Kernel{"wgmma 128x128", 90, false},
                           Kernel{"mma.sync", 80, false}}) {
    const double t1 = kernel_us(stream, [&] { return k::grouped_gemm(g1, tile_m, kn.arch, kn.wide, stream); });
    const double t2 = kernel_us(stream, [&] { return k::grouped_gemm(g2, tile_m, kn.arch, kn.wide, stream); });
    std::printf(" | %s: gate_up %.1f us (%.0f TFLOP/s), down %.1f us (%.0f TFLOP/s)", kn.name, t1, f1 / t1 * 1e-6, t2,
                f2 / t2 * 1e-6);
  }
  const double comb = kernel_us(stream, [&] {
    return k::combine(k::Elem::bf16, k::Elem::f32, y.ptr<float>(), r.pair_row, r.pair_expert, in.w.data(), nullptr,
                      T, int(K), H, int(E), in.out.data(), stream);
  });
  std::printf(" | combine %.1f us\n", comb);
  std::fflush(stdout);
}

}  // namespace

TEST(CudaTiming, DISABLED_Qwen3Shape) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  constexpr int64_t H = 2048, I = 768, E = 128, K = 8;
  const Device dev = Device::cuda(0);
  ExpertsSpec spec;
  spec.num_experts = E;
  spec.hidden = H;
  spec.intermediate = I;
  ExpertsWeights hw;
  hw.gate_up_proj = uniform_bf16({E, 2 * I, H}, 0.02, 1);
  hw.down_proj = uniform_bf16({E, H, I}, 0.02, 2);
  const Experts host(spec, hw, "eager");
  const Experts experts = host.to(dev);

  // ANCHORS.md, qwen3-30b-a3b: floor, transformers plain best, vLLM fused_moe best.
  struct Anchor { int64_t T; double floor, hf, vllm; };
  const Anchor anchors[] = {{1, 18, 339, 42}, {8, 116, 478, 144}, {64, 283, 772, 309}, {512, 288, 819, 356},
                            {4096, 398, 2099, 860}};
  struct Variant { const char* label; const char* backend; int64_t gemv_max_pairs; bool wgmma, wide, capturable; };
  const int64_t policy = cuda::batched_gemv_max_pairs();
  const Variant variants[] = {{"eager", "eager", policy, true, false, false},
                              {"batched_mm", "batched_mm", policy, true, false, true},
                              {"grouped_mm", "grouped_mm", policy, true, false, true},
                              {"grouped_mm[wgmma 128x256]", "grouped_mm", policy, true, true, true},
                              {"grouped_mm[mma.sync]", "grouped_mm", policy, false, false, true},
                              {"batched_mm[gemv]", "batched_mm", int64_t(1) << 40, true, false, true},
                              {"batched_mm[grouped]", "batched_mm", 0, true, false, true}};

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start = nullptr, stop = nullptr;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  std::mt19937_64 rng(2026);
  std::printf("\nqwen3-30b-a3b experts, bf16, H=%lld I=%lld E=%lld K=%lld; microseconds, median\n", (long long)H,
              (long long)I, (long long)E, (long long)K);
  std::printf("%6s %-26s %10s %10s %10s | %7s %7s %7s\n", "T", "variant", "plain", "graph", "relL2", "floor",
              "hf", "vllm");
  for (const Anchor& an : anchors) {
    const int64_t T = an.T;
    constexpr int kSets = 4;
    std::vector<DeviceInputs> sets;
    std::vector<ExpertsProblem> host_sets;
    ProblemConfig routing = cuda_case();
    routing.T = T;
    routing.K = K;
    routing.E = E;
    routing.H = H;
    routing.used = E;
    routing.idt = DType::i32;
    for (int s = 0; s < kSets; ++s) {
      ExpertsProblem in;
      make_inputs(routing, rng, in);
      sets.push_back({in.hidden_states.to(dev), in.top_k_index.to(dev), in.top_k_weights.to(dev),
                      Tensor::empty({T, H}, DType::bf16, dev)});
      host_sets.push_back(std::move(in));
    }
    if (T >= 64) grouped_breakdown(experts, sets[0], stream);
    auto call_of = [&](int s) {
      return ExpertsCall{sets[s].x.view(), sets[s].idx.view(), sets[s].w.view(), sets[s].out.view(), stream};
    };
    const int iters = T <= 64 ? 300 : T <= 512 ? 100 : 30;
    Tensor eager_out;
    for (const Variant& v : variants) {
      if (T > 64 && std::string(v.label) == "batched_mm[gemv]") continue;  // thousands of GEMVs: known slow
      const int64_t saved = cuda::set_batched_gemv_max_pairs(v.gemv_max_pairs);
      const bool saved_shared = cuda::set_batched_gemv_when_shared(v.gemv_max_pairs > policy);  // forced GEMVs
      const bool saved_wgmma = cuda::set_grouped_wgmma_enabled(v.wgmma);
      const bool saved_wide = cuda::set_grouped_wgmma_wide_enabled(v.wide);
      // Check first: set 0 against eager (and the reference at T = 1).
      poison(sets[0].out);
      experts.forward_with(v.backend, call_of(0));
      CUDA_OK(cudaStreamSynchronize(stream));
      const Tensor out0 = sets[0].out.to(Device::cpu());
      double err = 0;
      if (std::string(v.label) == "eager") {
        eager_out = out0;
        if (T == 1) {
          const auto ref = reference_forward(host, host_sets[0].hidden_states, host_sets[0].top_k_index, host_sets[0].top_k_weights);
          err = relative_l2(out0.view(), ref);
        }
      } else {
        std::vector<double> e(size_t(eager_out.numel()));
        for (size_t i = 0; i < e.size(); ++i) e[i] = load_as_f64(eager_out.data(), DType::bf16, int64_t(i));
        err = relative_l2(out0.view(), e);
      }
      EXPECT_LE(err, 1e-2) << v.label << " T=" << T;

      std::vector<double> plain;
      for (int i = 0; i < iters + 5; ++i) {
        CUDA_OK(cudaEventRecord(start, stream));
        experts.forward_with(v.backend, call_of(i % kSets));
        CUDA_OK(cudaEventRecord(stop, stream));
        CUDA_OK(cudaEventSynchronize(stop));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 5) plain.push_back(ms * 1000.0);
      }
      double graph_us = 0;
      if (v.capturable) {
        std::vector<std::unique_ptr<ExpertsGraph>> graphs;
        for (int s = 0; s < kSets; ++s) {
          graphs.push_back(std::make_unique<ExpertsGraph>(
              experts, ExpertsGraphShape{.tokens = T, .top_k = K, .act_dtype = DType::bf16}, v.backend));
          graphs.back()->hidden_states().copy_from(sets[s].x.view());
          graphs.back()->top_k_index().copy_from(sets[s].idx.view());
          graphs.back()->top_k_weights().copy_from(sets[s].w.view());
        }
        std::vector<double> replays;
        for (int i = 0; i < iters + 5; ++i) {
          CUDA_OK(cudaEventRecord(start, stream));
          graphs[size_t(i % kSets)]->replay(stream);
          CUDA_OK(cudaEventRecord(stop, stream));
          CUDA_OK(cudaEventSynchronize(stop));
          float ms = 0;
          CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
          if (i >= 5) replays.push_back(ms * 1000.0);
        }
        graph_us = median(replays);
        const Tensor g0 = graphs[0]->out().to(Device::cpu());
        EXPECT_LE(relative_l2(g0.view(), [&] {
                    std::vector<double> e(size_t(eager_out.numel()));
                    for (size_t i = 0; i < e.size(); ++i) e[i] = load_as_f64(eager_out.data(), DType::bf16, int64_t(i));
                    return e;
                  }()),
                  1e-2)
            << v.label << " graph T=" << T;
      }
      cuda::set_batched_gemv_max_pairs(saved);
      cuda::set_batched_gemv_when_shared(saved_shared);
      cuda::set_grouped_wgmma_enabled(saved_wgmma);
      cuda::set_grouped_wgmma_wide_enabled(saved_wide);
      std::printf("%6lld %-26s %10.1f %10.1f %10.2e | %7.0f %7.0f %7.0f\n", (long long)T, v.label, median(plain),
                  graph_us, err, an.floor, an.hf, an.vllm);
      std::fflush(stdout);
    }
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  CUDA_OK(cudaStreamDestroy(stream));
}
#else
TEST(CudaTiming, NeedsACudaBuild) { GTEST_SKIP() << "moekit built without CUDA"; }
#endif

// Timing of the CUDA backends on the qwen3-30b-a3b experts shape (H=2048, I=768, E=128, K=8, bf16)
// beside the anchors of ANCHORS.md. Disabled by default (a measurement, not a check); run with
//   test_cuda_bench --gtest_also_run_disabled_tests
// Each row: median of many calls timed with CUDA events, rotating over input sets; uncaptured
// ("plain") and, for the capturable backends, CUDA-graph replays. Every variant's output is compared
// with eager's first (and with the f64 reference at T=1) before it is timed.
#include <gtest/gtest.h>

#include <cstdio>

#include "test_cuda_util.h"
#ifdef MOEKIT_WITH_CUDA
#include <cuda_runtime_api.h>

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
  struct Variant { const char* label; const char* backend; int64_t gemv_max_pairs; bool wgmma; bool capturable; };
  const int64_t policy = cuda::batched_gemv_max_pairs();
  const Variant variants[] = {{"eager", "eager", policy, true, false},
                              {"batched_mm", "batched_mm", policy, true, true},
                              {"grouped_mm", "grouped_mm", policy, true, true},
                              {"grouped_mm[mma.sync]", "grouped_mm", policy, false, true},
                              {"batched_mm[gemv]", "batched_mm", int64_t(1) << 40, true, true},
                              {"batched_mm[grouped]", "batched_mm", 0, true, true}};

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start = nullptr, stop = nullptr;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  std::mt19937_64 rng(2026);
  std::printf("\nqwen3-30b-a3b experts, bf16, H=%lld I=%lld E=%lld K=%lld; microseconds, median\n", (long long)H,
              (long long)I, (long long)E, (long long)K);
  std::printf("%6s %-20s %10s %10s %10s | %7s %7s %7s\n", "T", "variant", "plain", "graph", "relL2", "floor",
              "hf", "vllm");
  for (const Anchor& an : anchors) {
    const int64_t T = an.T;
    constexpr int kSets = 4;
    std::vector<DeviceInputs> sets;
    std::vector<RoutedInputs> host_sets;
    for (int s = 0; s < kSets; ++s) {
      RoutedInputs in = make_routed_inputs(T, K, E, H, E, 0, DType::bf16, DType::i32, DType::f32, rng);
      sets.push_back({in.x.to(dev), in.index.to(dev), in.weights.to(dev), Tensor::empty({T, H}, DType::bf16, dev)});
      host_sets.push_back(std::move(in));
    }
    auto call_of = [&](int s) {
      return ExpertsCall{sets[s].x.view(), sets[s].idx.view(), sets[s].w.view(), sets[s].out.view(), stream};
    };
    const int iters = T <= 64 ? 300 : T <= 512 ? 100 : 30;
    Tensor eager_out;
    for (const Variant& v : variants) {
      if (T > 64 && std::string(v.label) == "batched_mm[gemv]") continue;  // thousands of GEMVs: known slow
      const int64_t saved = cuda::set_batched_gemv_max_pairs(v.gemv_max_pairs);
      const bool saved_wgmma = cuda::set_grouped_wgmma_enabled(v.wgmma);
      // Check first: set 0 against eager (and the reference at T = 1).
      poison(sets[0].out);
      experts.forward_with(v.backend, call_of(0));
      CUDA_OK(cudaStreamSynchronize(stream));
      const Tensor out0 = sets[0].out.to(Device::cpu());
      double err = 0;
      if (std::string(v.label) == "eager") {
        eager_out = out0;
        if (T == 1) {
          const auto ref = reference_forward(host, host_sets[0].x, host_sets[0].index, host_sets[0].weights);
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
      cuda::set_grouped_wgmma_enabled(saved_wgmma);
      std::printf("%6lld %-20s %10.1f %10.1f %10.2e | %7.0f %7.0f %7.0f\n", (long long)T, v.label, median(plain),
                  graph_us, err, an.floor, an.hf, an.vllm);
      std::fflush(stdout);
    }
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  CUDA_OK(cudaStreamDestroy(stream));
}
#endif

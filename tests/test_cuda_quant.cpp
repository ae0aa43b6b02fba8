// FP8 block-scaled experts on the GPU: the activation quantisation kernel bit for bit against the host's
// quantize_activations_fp8 (every dtype, partial and all-zero groups, saturating and subnormal values, UE8M0
// scales; rows gathered through sorted pairs up to a device count, as the experts run it), and grouped_mm, batched_mm and deepgemm on FP8 experts against the f64 reference over a sweep (K not a
// multiple of 128 nor of 16, odd E, sentinels, empty experts, biases, row tiles of 32 and 128, decode sizes on the
// FP8 GEMV, which is also forced on beyond its reach and off below it), each output poisoned first; the backends
// without a quantized path refused with the reason. FP4 experts (MXFP4 with float activations, FP4 with UE8M0
// scales with FP8 activations): the device quantizer bit for bit against the host's, and the three backends against
// the f64 reference over a sweep (K a multiple of 32 but not of 128, odd E, T = 1..11 on the GEMV, hundreds of rows
// on the tiled kernel with row tiles of 32 and 128, sentinels, empty experts, biases, gpt-oss's interleaved clamped
// SwiGLU), the GEMV forced on and off. The sm90 FP8 kernel's staged-scale and bulk-store forms against its plain
// form, bit for bit; the FP8 chain with Programmatic Dependent Launch on and off, uncaptured and in graphs, bit for
// bit; CUTLASS's FP8 grouped GEMM against the reference; the decode GEMV's pair form against its sorted form, bit for
// bit. Skips without a GPU.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <random>

#include "moekit/cuda_graph.h"
#include "moekit/model.h"
#include "moekit/quant.h"
#include "moekit/safetensors.h"
#include "test_experts_problem.h"
#include "test_fp8_problem.h"
#include "test_util.h"
#ifdef MOEKIT_WITH_CUDA
#include "backends/cuda/kernels/cutlass_gemm.h"
#include "backends/cuda/kernels/kernels.h"
#include "backends/cuda/kernels/quant_fp4.h"
#include "backends/cuda/policy.h"
#include "base/cuda_pdl.cuh"
#endif

namespace moekit {
namespace {

using test::ProblemConfig;
using test::make_fp8_problem;


#ifdef MOEKIT_WITH_CUDA
TEST(CudaQuant, ActivationQuantisationIsBitwiseTheHosts) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(21);
  for (const DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const int64_t k : {int64_t(1), int64_t(77), int64_t(128), int64_t(300), int64_t(1000)})
      for (const bool pow2 : {false, true}) {
        // 9000 rows at k = 1000: the kernel over thousands of blocks, values from every part of the e4m3 range
        const int64_t rows = k == 1000 ? 9000 : 37, groups = fp8_blocks(k), ldq = groups * 128;
        Tensor x = test::randn({rows, k}, DType::f32, rng, 3.0);
        float* xp = x.ptr<float>();
        std::uniform_int_distribution<int> pick(0, 9);
        for (int64_t i = 0; i < rows * k; ++i) {  // scales from huge to subnormal, exact ties of e4m3
          const int c = pick(rng);
          if (c == 0) xp[i] *= 1e4f;
          else if (c == 1) xp[i] *= 1e-30f;
          else if (c == 2) xp[i] = 0.0f;
          else if (c == 3) xp[i] = std::ldexp(1.0625f, int(rng() % 9) - 4);
        }
        for (int64_t i = 0; i < k; ++i) xp[5 * k + i] = 0.0f;  // an all-zero row
        Tensor xd = x.to(dt);  // the values the kernel sees
        const Tensor xf = xd.to(DType::f32);
        std::vector<float> hq(size_t(rows * k)), hs(size_t(rows * groups));
        for (int64_t r = 0; r < rows; ++r)
          quantize_activations_fp8(xf.ptr<float>() + r * k, k, pow2, hq.data() + r * k, hs.data() + r * groups);
        const Tensor xg = xd.to(Device::cuda(0));
        Tensor qp = Tensor::empty({rows, ldq}, DType::f8e4m3), sp = Tensor::empty({rows, groups}, DType::f32);
        std::memset(qp.data(), 0x55, qp.nbytes());  // poisoned: every byte, the padding too, must be written
        test::poison(sp);
        Tensor q = qp.to(Device::cuda(0)), s = sp.to(Device::cuda(0));
        const auto type = dt == DType::f32 ? cuda::kernels::Elem::f32
                          : dt == DType::bf16 ? cuda::kernels::Elem::bf16 : cuda::kernels::Elem::f16;
        ASSERT_EQ(cuda::kernels::quantize_fp8_rows(type, xg.data(), k, nullptr, 1, rows, k, nullptr, pow2, q.ptr<uint8_t>(), ldq,
                                                   s.ptr<float>(), groups, nullptr),
                  cudaSuccess);
        stream_synchronize(nullptr, Device::cuda(0));
        const Tensor qh = q.to(Device::cpu()), sh = s.to(Device::cpu());
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t g = 0; g < groups; ++g)
            ASSERT_EQ(std::memcmp(&hs[size_t(r * groups + g)], sh.ptr<float>() + r * groups + g, 4), 0)
                << dtype_name(dt) << " k=" << k << " pow2=" << pow2 << " scale (" << r << ", " << g << ")";
          for (int64_t i = 0; i < ldq; ++i) {
            const uint8_t code = qh.ptr<uint8_t>()[r * ldq + i];
            if (i >= k) {
              ASSERT_EQ(code, 0) << "padding (" << r << ", " << i << ")";
              continue;
            }
            const float hv = hq[size_t(r * k + i)];
            const uint8_t expect = hv == 0.0f ? code & 0x80 : f32_to_f8e4m3(hv);  // -0 and +0 both mean zero
            ASSERT_EQ(code, expect) << dtype_name(dt) << " k=" << k << " pow2=" << pow2 << " (" << r << ", " << i
                                    << ") x=" << xf.ptr<float>()[r * k + i];
          }
        }
      }
}

// The quantisation as the experts run it on the sm90 path: rows gathered through the sorted pairs (row r reads token
// row src[r] / top_k), only the first valid_rows (a device count) written, the rest left as they were; a token row
// length whose rows allow 16-byte loads (264 bf16, 264 f32) and one whose rows do not (300 bf16).
TEST(CudaQuant, ActivationQuantisationGathersSortedRows) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(23);
  for (const auto& [dt, k] : {std::pair{DType::bf16, int64_t(264)}, std::pair{DType::f32, int64_t(264)},
                              std::pair{DType::bf16, int64_t(300)}}) {
    const int64_t T = 23, top_k = 3, rows = T * top_k, valid = 50, groups = fp8_blocks(k), ldq = groups * 128;
    const Tensor xd = test::randn({T, k}, DType::f32, rng, 2.0).to(dt);
    const Tensor xf = xd.to(DType::f32);
    Tensor src = Tensor::empty({rows}, DType::i32);
    std::uniform_int_distribution<int32_t> pick(0, int32_t(rows - 1));
    for (int64_t r = 0; r < rows; ++r) src.ptr<int32_t>()[r] = pick(rng);
    Tensor count = Tensor::empty({1}, DType::i32);
    count.ptr<int32_t>()[0] = int32_t(valid);
    Tensor qp = Tensor::empty({rows, ldq}, DType::f8e4m3), sp = Tensor::empty({rows, groups}, DType::f32);
    std::memset(qp.data(), 0x55, qp.nbytes());
    std::memset(sp.data(), 0x55, sp.nbytes());
    const Tensor xg = xd.to(Device::cuda(0)), srcg = src.to(Device::cuda(0)), countg = count.to(Device::cuda(0));
    Tensor q = qp.to(Device::cuda(0)), s = sp.to(Device::cuda(0));
    const auto type = dt == DType::f32 ? cuda::kernels::Elem::f32 : cuda::kernels::Elem::bf16;
    ASSERT_EQ(cuda::kernels::quantize_fp8_rows(type, xg.data(), k, srcg.ptr<int32_t>(), int(top_k), rows, k,
                                               countg.ptr<int32_t>(), false, q.ptr<uint8_t>(), ldq, s.ptr<float>(),
                                               groups, nullptr),
              cudaSuccess);
    stream_synchronize(nullptr, Device::cuda(0));
    const Tensor qh = q.to(Device::cpu()), sh = s.to(Device::cpu());
    std::vector<float> hq(static_cast<size_t>(k)), hs(static_cast<size_t>(groups));
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* code = qh.ptr<uint8_t>() + r * ldq;
      const uint8_t* scale = reinterpret_cast<const uint8_t*>(sh.ptr<float>() + r * groups);
      if (r >= valid) {  // past the count: untouched
        for (int64_t i = 0; i < ldq; ++i) ASSERT_EQ(code[i], 0x55) << "row " << r << " past the count, byte " << i;
        for (int64_t i = 0; i < groups * 4; ++i) ASSERT_EQ(scale[i], 0x55) << "row " << r << " past the count";
        continue;
      }
      const int64_t token = src.ptr<int32_t>()[r] / top_k;
      quantize_activations_fp8(xf.ptr<float>() + token * k, k, false, hq.data(), hs.data());
      for (int64_t g = 0; g < groups; ++g)
        ASSERT_EQ(std::memcmp(&hs[size_t(g)], sh.ptr<float>() + r * groups + g, 4), 0)
            << dtype_name(dt) << " k=" << k << " scale (" << r << ", " << g << ")";
      for (int64_t i = 0; i < ldq; ++i) {
        if (i >= k) {
          ASSERT_EQ(code[i], 0) << "padding (" << r << ", " << i << ")";
          continue;
        }
        const float hv = hq[size_t(i)];
        const uint8_t expect = hv == 0.0f ? code[i] & 0x80 : f32_to_f8e4m3(hv);
        ASSERT_EQ(code[i], expect) << dtype_name(dt) << " k=" << k << " (" << r << ", " << i << ")";
      }
    }
  }
}
#endif

std::vector<std::pair<ProblemConfig, DType>> fp8_sweep() {
  std::vector<std::pair<ProblemConfig, DType>> v = test::fp8_common_cases();
  auto add = [&](ProblemConfig c, DType s = DType::f32) { v.push_back({c, s}); };
  add({.T = 300, .E = 3, .K = 2, .H = 384, .I = 320, .has_bias = true});              // row tiles of 128
  add({.T = 200, .E = 2, .K = 1, .H = 128, .I = 136, .has_gate = false, .empty_experts = true}, DType::ue8m0);
  // 16-bit activations with row tiles of 128: the TMA / wgmma kernel on sm_90a
  add({.act = DType::bf16, .rwt = DType::bf16, .T = 260, .E = 5, .K = 2, .H = 264, .I = 200,
       .gate = GateKind::clamped_swiglu, .limit = 7.0f, .sentinels = true});
  add({.act = DType::bf16, .T = 400, .E = 3, .K = 2, .H = 512, .I = 256, .has_bias = true});
  add({.act = DType::f16, .T = 300, .E = 4, .K = 3, .H = 384, .I = 208, .has_gate = false,
       .activation = Activation::relu2, .empty_experts = true}, DType::ue8m0);
  add({.act = DType::bf16, .idt = DType::i32, .T = 520, .E = 7, .K = 2, .H = 1024, .I = 384});
  // Decode sizes (P <= 64): the FP8 GEMV (gemv_quant.cu), one row per expert pass (P <= E) and four (P > E); with
  // 16-bit activations on sm_90a and 2 P >= E or more tokens than the pair form takes, the sm90 kernel instead
  // (fp8_gemv_sparse_only)
  add({.T = 1, .E = 9, .K = 8, .H = 200, .I = 136, .sentinels = true});                // odd E, H % 16 != 0
  add({.T = 2, .E = 33, .K = 4, .H = 1100, .I = 300, .has_bias = true});  // biases, H % 128 != 0 (FP8 is [gate | up] only)
  add({.T = 32, .E = 9, .K = 2, .H = 136, .I = 72, .used = 1});      // one expert, 64 rows (repeated per token)
  add({.T = 5, .E = 3, .K = 4, .H = 96, .I = 40, .used = 2, .sentinel_every = 4});     // repeats, sentinels
  add({.act = DType::bf16, .rwt = DType::bf16, .T = 32, .E = 5, .K = 2, .H = 264, .I = 200,
       .gate = GateKind::clamped_swiglu, .limit = 7.0f, .sentinels = true});
  add({.act = DType::bf16, .T = 1, .E = 8, .K = 2, .H = 7168 / 8, .I = 2048 / 8}, DType::ue8m0);
  add({.act = DType::f16, .idt = DType::i32, .T = 16, .E = 33, .K = 4, .H = 384, .I = 208, .has_gate = false,
       .has_bias = true, .activation = Activation::relu2}, DType::ue8m0);
  add({.T = 4, .E = 5, .K = 2, .H = 64, .I = 48, .sentinel_every = 1});                // every slot a sentinel
  // 16-bit activations past the GEMV's reach with few rows per expert: 5 on average (the sm90 kernel's 128-row tiles
  // mostly padding, one consumer warpgroup's rows all padding), and fewer pairs than experts (32-row tiles)
  add({.act = DType::bf16, .T = 100, .E = 40, .K = 2, .H = 256, .I = 192, .sentinels = true});
  add({.act = DType::f16, .T = 40, .E = 100, .K = 2, .H = 136, .I = 72, .has_bias = true}, DType::ue8m0);
  return v;
}

TEST(CudaQuant, Fp8GroupedBatchedAndDeepgemmMatchTheReference) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  uint64_t seed = 500;
  int checked = 0;
  for (const auto& [c, sdt] : fp8_sweep()) {
    const test::ExpertsProblem p = make_fp8_problem(c, seed++, sdt, /*biases_in_act_dtype=*/true);
    const Experts g = p.experts.to(Device::cuda(0));
    for (const char* name : {"grouped_mm", "batched_mm", "deepgemm"}) {
      const Support s = ExpertsInterface::global().get(name)->supports(g, c.act);
      if (!s.ok) {
        std::printf("  %-10s %s: not supported here: %s\n", name, c.to_string().c_str(), s.reason.c_str());
        continue;
      }
      double err = 0;
      const Tensor out = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
      const std::string problem = test::compare_with_reference(p, out, &err);
      std::printf("  %-10s %s scales %s: rel L2 %.2e %s\n", name, c.to_string().c_str(), dtype_name(sdt), err,
                  problem.c_str());
      EXPECT_TRUE(problem.empty()) << name << " " << c.to_string() << " scales " << dtype_name(sdt) << ": " << problem;
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

#ifdef MOEKIT_WITH_CUDA
// Sets the FP8 GEMV's reach for the scope, the reach alone deciding (not the sm90 kernel's share of decode sizes).
class Fp8GemvPolicy {
 public:
  explicit Fp8GemvPolicy(int64_t max_pairs)
      : previous_(cuda::set_fp8_gemv_max_pairs(max_pairs)), sparse_(cuda::set_fp8_gemv_sparse_only(false)) {}
  ~Fp8GemvPolicy() {
    cuda::set_fp8_gemv_max_pairs(previous_);
    cuda::set_fp8_gemv_sparse_only(sparse_);
  }
  Fp8GemvPolicy(const Fp8GemvPolicy&) = delete;
  Fp8GemvPolicy& operator=(const Fp8GemvPolicy&) = delete;

 private:
  int64_t previous_;
  bool sparse_;
};

// The FP8 GEMV forced on beyond its default reach (experts of more than one row tile of 64, P > 64) and off (the
// tiled kernels at decode sizes): both against the reference, and the GEMV the same bits on a second run.
TEST(CudaQuant, Fp8GemvForcedOnAndOffMatchesTheReference) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::vector<std::pair<ProblemConfig, DType>> cases = {
      {{.T = 100, .E = 3, .K = 2, .H = 200, .I = 136, .used = 1}, DType::f32},  // 200 rows: 4 tiles of one expert
      {{.T = 70, .E = 7, .K = 2, .H = 130, .I = 72, .has_bias = true, .sentinels = true}, DType::f32},
      {{.act = DType::bf16, .rwt = DType::bf16, .T = 90, .E = 5, .K = 3, .H = 264, .I = 200}, DType::ue8m0},
      {{.T = 3, .E = 9, .K = 3, .H = 300, .I = 100, .has_gate = false, .activation = Activation::gelu}, DType::f32},
      {{.act = DType::f16, .T = 8, .E = 4, .K = 2, .H = 144, .I = 64}, DType::f32},
  };
  uint64_t seed = 900;
  for (const auto& [c, sdt] : cases) {
    const test::ExpertsProblem p = make_fp8_problem(c, seed++, sdt, /*biases_in_act_dtype=*/true);
    const Experts g = p.experts.to(Device::cuda(0));
    for (const int64_t reach : {int64_t(1) << 40, int64_t(0)}) {
      const Fp8GemvPolicy policy(reach);
      for (const char* name : {"grouped_mm", "batched_mm", "deepgemm"}) {
        if (!ExpertsInterface::global().get(name)->supports(g, c.act).ok) continue;
        double err = 0;
        const Tensor out = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        const std::string problem = test::compare_with_reference(p, out, &err);
        std::printf("  %-10s gemv %-3s %s scales %s: rel L2 %.2e %s\n", name, reach ? "on" : "off",
                    c.to_string().c_str(), dtype_name(sdt), err, problem.c_str());
        EXPECT_TRUE(problem.empty()) << name << " gemv " << (reach ? "on " : "off ") << c.to_string() << ": "
                                     << problem;
        if (reach) {  // deterministic: no atomics, a fixed order of sums
          const Tensor again = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
          const Tensor a = out.to(Device::cpu()), b = again.to(Device::cpu());
          ASSERT_EQ(a.nbytes(), b.nbytes());
          EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << name << " " << c.to_string();
        }
      }
    }
  }
}

// Sets a process-wide policy value for the scope through its setter (which returns the previous value).
template <int64_t (*Set)(int64_t)>
class ScopedPolicy {
 public:
  explicit ScopedPolicy(int64_t value) : previous_(Set(value)) {}
  ~ScopedPolicy() { Set(previous_); }
  ScopedPolicy(const ScopedPolicy&) = delete;
  ScopedPolicy& operator=(const ScopedPolicy&) = delete;

 private:
  int64_t previous_;
};

// The FP8 GEMV's pair form's reach in tokens (policy.h fp8_pair_max_tokens).
using Fp8PairTokens = ScopedPolicy<cuda::set_fp8_pair_max_tokens>;

// The GEMV's pair form (no routing sort; the activations' quantisation and the combine in the projections' last
// blocks, over arrival counters) against the sorted form, bit for bit, and both against the reference: one token
// and a few, every activation dtype, gated and act-only epilogues, biases, UE8M0 scales, sentinels, K and I not
// multiples of 128 (a last partial group of outputs), experts shared by tokens, top-k 1 (a single slot per counter);
// the pair form run twice (the counters left zero by each run), outputs poisoned before each run.
TEST(CudaQuant, Fp8PairFormIsBitwiseTheSortedForm) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const std::vector<std::pair<ProblemConfig, DType>> cases = {
      {{.act = DType::bf16, .rwt = DType::bf16, .idt = DType::i32, .T = 1, .E = 40, .K = 8, .H = 512, .I = 384},
       DType::f32},
      {{.act = DType::bf16, .T = 5, .E = 6, .K = 3, .H = 264, .I = 200, .has_bias = true, .sentinels = true},
       DType::ue8m0},
      {{.act = DType::f16, .rwt = DType::f16, .T = 8, .E = 16, .K = 4, .H = 200, .I = 136}, DType::f32},
      {{.T = 3, .E = 9, .K = 3, .H = 300, .I = 100, .has_gate = false, .activation = Activation::gelu}, DType::f32},
      {{.T = 2, .E = 5, .K = 2, .H = 144, .I = 64, .has_bias = true, .sentinels = true}, DType::f32},
      {{.act = DType::bf16, .T = 7, .E = 4, .K = 1, .H = 128, .I = 256}, DType::f32},
  };
  const Fp8GemvPolicy gemv(int64_t(1) << 40);
  uint64_t seed = 2100;
  for (const auto& [c, sdt] : cases) {
    const test::ExpertsProblem p = make_fp8_problem(c, seed++, sdt, /*biases_in_act_dtype=*/true);
    const Experts g = p.experts.to(Device::cuda(0));
    Tensor sorted;
    {
      const Fp8PairTokens off(0);
      sorted = test::run_backend(g, "batched_mm", p.hidden_states, p.top_k_index, p.top_k_weights);
    }
    EXPECT_EQ(test::compare_with_reference(p, sorted), "") << "sorted " << c.to_string();
    const Fp8PairTokens on(64);
    for (int run = 0; run < 2; ++run) {
      double err = 0;
      const Tensor pairs = test::run_backend(g, "batched_mm", p.hidden_states, p.top_k_index, p.top_k_weights);
      const std::string problem = test::compare_with_reference(p, pairs, &err);
      std::printf("  pair form run %d %s scales %s: rel L2 %.2e %s\n", run, c.to_string().c_str(), dtype_name(sdt), err,
                  problem.c_str());
      EXPECT_EQ(problem, "") << "pairs " << c.to_string();
      EXPECT_TRUE(test::bitwise_equal(pairs, sorted)) << "run " << run << " " << c.to_string();
    }
  }
}

// Sets the sm90 FP8 kernel's measurement switches (staged scales, bulk output stores, short A boxes, idle
// warpgroups, work items from the producer) and the second projection's 16-bit rows for the scope, CUTLASS's
// kernel off.
class Fp8Sm90Forms {
 public:
  Fp8Sm90Forms(bool staged, bool tma_store, bool rows16, bool short_a, bool skip_idle, bool item_ring)
      : staged_(cuda::kernels::set_fp8_sm90_staged_scales(staged)),
        tma_store_(cuda::kernels::set_fp8_sm90_tma_store(tma_store)),
        rows16_(cuda::set_grouped_down_rows16(rows16)),
        short_a_(cuda::kernels::set_fp8_sm90_short_a(short_a)),
        skip_idle_(cuda::kernels::set_fp8_sm90_skip_idle(skip_idle)),
        item_ring_(cuda::kernels::set_fp8_sm90_item_ring(item_ring)),
        cutlass_(cuda::set_fp8_cutlass(false)) {}
  ~Fp8Sm90Forms() {
    cuda::kernels::set_fp8_sm90_staged_scales(staged_);
    cuda::kernels::set_fp8_sm90_tma_store(tma_store_);
    cuda::set_grouped_down_rows16(rows16_);
    cuda::kernels::set_fp8_sm90_short_a(short_a_);
    cuda::kernels::set_fp8_sm90_skip_idle(skip_idle_);
    cuda::kernels::set_fp8_sm90_item_ring(item_ring_);
    cuda::set_fp8_cutlass(cutlass_);
  }
  Fp8Sm90Forms(const Fp8Sm90Forms&) = delete;
  Fp8Sm90Forms& operator=(const Fp8Sm90Forms&) = delete;

 private:
  bool staged_, tma_store_, rows16_, short_a_, skip_idle_, item_ring_, cutlass_;
};

// The sm90 FP8 kernel's forms (scales staged by the producer, 16-bit outputs through bulk tensor stores, short A
// boxes and idle warpgroups for tiles with few rows, the work items handed over by the producer, and their
// combinations) with the second projection in 16-bit
// rows (kEpiWeighted: bulk stores there too), and some with f32 rows: the plain form against the f64 reference,
// each other form the same bits (the same sums in the same order, the same roundings). Cases: many work items per block (the output staging reused while its stores
// are in flight) with a last column box past n; f16 outputs, biases and the act-only epilogue, hidden rows whose
// length is not a multiple of 8 (the 16-bit rows keep the direct stores); the clamped SwiGLU with biases and
// sentinels over five experts; a decode-sized call (a few rows per expert: every tile on 32-row A boxes, the second
// warpgroup idle). Experts' row counts are random, so 64-row blocks that cross an expert's end (direct stores) and
// whole ones (bulk stores) both occur, and last tiles of up to 32, up to 64 and more rows. Outputs poisoned per run; before each run the same experts run
// other token rows, so that intermediate rows a form failed to write would hold those rows' values.
TEST(CudaQuant, Fp8Sm90FormsMatchTheReferenceAndEachOther) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const std::vector<std::pair<ProblemConfig, DType>> cases = {
      {{.act = DType::bf16, .T = 640, .E = 3, .K = 2, .H = 256, .I = 1032}, DType::f32},
      {{.act = DType::f16, .T = 300, .E = 4, .K = 2, .H = 260, .I = 328, .has_gate = false, .has_bias = true,
        .activation = Activation::gelu},
       DType::ue8m0},
      {{.act = DType::bf16, .rwt = DType::bf16, .T = 260, .E = 5, .K = 2, .H = 264, .I = 200, .has_bias = true,
        .gate = GateKind::clamped_swiglu, .limit = 7.0f, .sentinels = true},
       DType::f32},
      {{.act = DType::bf16, .T = 40, .E = 12, .K = 3, .H = 256, .I = 136}, DType::f32},
  };
  // (staged scales, bulk stores, 16-bit rows, short A boxes, idle warpgroups, work items from the producer); the
  // first of each rows16 setting is the plain form
  const std::vector<std::array<bool, 6>> forms = {
      {false, false, true, false, false, false}, {true, false, true, false, false, false},
      {false, true, true, false, false, false},  {true, true, true, false, false, false},
      {false, false, true, true, false, false},  {false, false, true, false, true, false},
      {false, false, true, false, false, true},  {true, true, true, true, true, true},
      {false, false, false, false, false, false}, {true, false, false, false, false, false},
      {true, false, false, true, true, true}};
  std::mt19937_64 rng(1300);
  uint64_t seed = 1300;
  int checked = 0;
  for (const auto& [c, sdt] : cases) {
    const test::ExpertsProblem p = make_fp8_problem(c, seed++, sdt, /*biases_in_act_dtype=*/true);
    const Tensor other_x = test::randn(p.hidden_states.shape(), DType::f32, rng).to(p.hidden_states.dtype());
    const Experts g = p.experts.to(Device::cuda(0));
    Tensor first;
    for (const auto& [staged, tma_store, rows16, short_a, skip_idle, item_ring] : forms) {
      const Fp8Sm90Forms set(staged, tma_store, rows16, short_a, skip_idle, item_ring);
      (void)test::run_backend(g, "grouped_mm", other_x, p.top_k_index, p.top_k_weights);
      const Tensor out = test::run_backend(g, "grouped_mm", p.hidden_states, p.top_k_index, p.top_k_weights);
      const std::string what = std::string("staged ") + (staged ? "1" : "0") + " bulk stores " +
                               (tma_store ? "1" : "0") + " rows16 " + (rows16 ? "1" : "0") + " short A " +
                               (short_a ? "1" : "0") + " skip idle " + (skip_idle ? "1" : "0") + " item ring " +
                               (item_ring ? "1 " : "0 ") + c.to_string();
      if (!staged && !tma_store && !short_a && !skip_idle && !item_ring) {  // the plain form of this rows16 setting: against the reference
        double err = 0;
        const std::string problem = test::compare_with_reference(p, out, &err);
        std::printf("  %s scales %s: rel L2 %.2e %s\n", what.c_str(), dtype_name(sdt), err, problem.c_str());
        EXPECT_TRUE(problem.empty()) << what << ": " << problem;
        first = out;
      } else {
        EXPECT_TRUE(test::bitwise_equal(out, first)) << what << ": not the plain form's bits";
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, int(cases.size() * forms.size()));
}

// The FP8 chain's kernels (routing, quantisation, GEMV, combine) with Programmatic Dependent Launch and without, at
// decode sizes (the GEMV chain) and past them (the tiled kernels): uncaptured and replayed from a CUDA graph recorded
// under each setting, every output poisoned first, all against the reference and the same bits.
TEST(CudaQuant, Fp8ChainWithAndWithoutPdlIsBitwiseTheSame) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const std::vector<std::pair<ProblemConfig, DType>> cases = {
      {{.act = DType::bf16, .rwt = DType::bf16, .idt = DType::i32, .T = 1, .E = 40, .K = 8, .H = 512, .I = 256},
       DType::f32},
      {{.act = DType::bf16, .idt = DType::i32, .T = 6, .E = 9, .K = 2, .H = 264, .I = 200, .sentinels = true},
       DType::ue8m0},
      {{.act = DType::f16, .idt = DType::i32, .T = 150, .E = 5, .K = 2, .H = 384, .I = 136}, DType::f32},
  };
  const bool pdl_was = cuda::set_pdl_enabled(true);
  uint64_t seed = 1900;
  for (const auto& [c, sdt] : cases) {
    const test::ExpertsProblem p = make_fp8_problem(c, seed++, sdt, /*biases_in_act_dtype=*/true);
    const Experts g = p.experts.to(Device::cuda(0));
    const ExpertsGraphShape shape{.tokens = c.T, .top_k = c.K, .act_dtype = c.act, .index_dtype = c.idt,
                                  .weight_dtype = c.rwt};
    Tensor first;
    for (const bool pdl : {true, false}) {
      cuda::set_pdl_enabled(pdl);
      const std::string label = std::string("pdl ") + (pdl ? "on " : "off ") + c.to_string();
      const Tensor direct = test::run_backend(g, "grouped_mm", p.hidden_states, p.top_k_index, p.top_k_weights);
      EXPECT_EQ(test::compare_with_reference(p, direct), "") << label;
      if (!first.defined()) first = direct;
      EXPECT_TRUE(test::bitwise_equal(direct, first)) << label << ": uncaptured";
      ExpertsGraph graph(g, shape, "grouped_mm");
      graph.hidden_states().copy_from(p.hidden_states.view());
      graph.top_k_index().copy_from(p.top_k_index.view());
      graph.top_k_weights().copy_from(p.top_k_weights.view());
      Tensor o = graph.out();
      test::poison(o);
      graph.replay();
      EXPECT_TRUE(test::bitwise_equal(graph.out().to(Device::cpu()), first)) << label << ": replayed";
    }
  }
  cuda::set_pdl_enabled(pdl_was);
}

// CUTLASS's FP8 grouped GEMM (where the build has it and the device is sm_90), each of its two forms (cooperative,
// ping-pong) taken from zero rows per expert and any hidden size on, for both projections or the first alone: bf16
// experts whose sizes are multiples of 128 against the f64 reference (uneven and empty experts, sentinels, odd E,
// UE8M0 scales, i32 ids, a gelu gate), the calls counted per form to show which one served them, and a second run
// the same bits (no atomics in its sums). Neither form, the same calls on moekit's kernel within the same bound.
TEST(CudaQuant, Fp8CutlassMatchesTheReference) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  if (!cuda::kernels::grouped_gemm_fp8_cutlass_built() || major * 10 + minor != 90)
    GTEST_SKIP() << "CUTLASS's FP8 kernel is not in this build or the device is not sm_90";
  // Each form forced from zero rows per expert and any hidden size, for the scope.
  struct Policy {
    cuda::Fp8CutlassPolicy previous = cuda::fp8_cutlass_policy();
    bool on = cuda::set_fp8_cutlass(true);
    ~Policy() {
      cuda::set_fp8_cutlass_policy(previous);
      cuda::set_fp8_cutlass(on);
    }
  } restore;
  const std::vector<std::pair<ProblemConfig, DType>> cases = {
      {{.act = DType::bf16, .T = 600, .E = 5, .K = 2, .H = 512, .I = 256}, DType::f32},
      {{.act = DType::bf16, .rwt = DType::bf16, .T = 300, .E = 7, .K = 3, .H = 384, .I = 640, .empty_experts = true,
        .sentinels = true},
       DType::ue8m0},
      {{.act = DType::bf16, .idt = DType::i32, .T = 257, .E = 3, .K = 2, .H = 1024, .I = 128,
        .activation = Activation::gelu},
       DType::f32},
      {{.act = DType::bf16, .T = 40, .E = 12, .K = 3, .H = 256, .I = 384, .used = 5}, DType::f32},
      // Fewer pairs than experts (less than one row per expert on average).
      {{.act = DType::bf16, .T = 6, .E = 40, .K = 2, .H = 256, .I = 384}, DType::f32},
      // Enough rows for the gate pass's four-row items (kGateRowsItems), a ragged last item, sentinels, a gelu gate.
      {{.act = DType::bf16, .T = 2051, .E = 8, .K = 8, .H = 256, .I = 256, .activation = Activation::gelu,
        .sentinels = true},
       DType::f32},
  };
  uint64_t seed = 1700;
  for (const auto& [c, sdt] : cases) {
    const test::ExpertsProblem p = make_fp8_problem(c, seed++, sdt, /*biases_in_act_dtype=*/true);
    const Experts g = p.experts.to(Device::cuda(0));
    // Cooperative, ping-pong (both projections on CUTLASS), cooperative first projection with moekit's second, off.
    for (const int form : {0, 1, 2, 3}) {
      cuda::Fp8CutlassPolicy policy;
      policy.rows = form == 0 || form == 2 ? 0 : int64_t(1) << 40;
      policy.pairs = form == 0 || form == 2 ? 1 : int64_t(1) << 40;
      policy.pingpong_min_rows = policy.pingpong_wide_min_rows = 0;
      policy.pingpong_max_rows = form == 1 ? int64_t(1) << 40 : 0;
      policy.pingpong_hidden = int64_t(1) << 40;
      policy.second_hidden = form == 2 ? int64_t(1) << 40 : 1;
      cuda::set_fp8_cutlass_policy(policy);
      for (const char* name : {"grouped_mm", "deepgemm"}) {
        const int64_t cooperative = cuda::fp8_cutlass_calls(false), pingpong = cuda::fp8_cutlass_calls(true);
        double err = 0;
        const Tensor out = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        const std::string problem = test::compare_with_reference(p, out, &err);
        std::printf("  %-10s cutlass form %d %s scales %s: rel L2 %.2e %s\n", name, form, c.to_string().c_str(),
                    dtype_name(sdt), err, problem.c_str());
        EXPECT_TRUE(problem.empty()) << name << " cutlass form " << form << " " << c.to_string() << ": " << problem;
        EXPECT_EQ(cuda::fp8_cutlass_calls(false) - cooperative, form == 0 || form == 2 ? 1 : 0)
            << name << " " << c.to_string();
        EXPECT_EQ(cuda::fp8_cutlass_calls(true) - pingpong, form == 1 ? 1 : 0) << name << " " << c.to_string();
        if (form != 3) {
          const Tensor again = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
          EXPECT_TRUE(test::bitwise_equal(out, again)) << name << " " << c.to_string() << ": not deterministic";
        }
      }
    }
  }
}

// The launcher refuses what the kernel cannot read (unaligned or short A rows) instead of reading out of bounds.
TEST(CudaQuant, Fp8GemvRefusesWhatItCannotRead) {
  namespace k = cuda::kernels;
  k::Fp8GemmArgs a;
  a.a = reinterpret_cast<const uint8_t*>(size_t(256));
  a.b = reinterpret_cast<const uint8_t*>(size_t(512));
  a.lda = 256;
  a.b_k = 208;
  a.k = 200;
  a.b_stride_n = 208;
  a.b_expert_stride = 208 * 64;
  EXPECT_TRUE(k::fp8_gemv_ok(a));
  k::Fp8GemmArgs bad = a;
  bad.lda = 192;  // shorter than the weight rows
  EXPECT_FALSE(k::fp8_gemv_ok(bad));
  bad = a;
  bad.b = reinterpret_cast<const uint8_t*>(size_t(520));
  EXPECT_FALSE(k::fp8_gemv_ok(bad));
  bad = a;
  bad.b_k = 200;
  EXPECT_FALSE(k::fp8_gemv_ok(bad));
  bad = a;
  bad.k = 220;
  EXPECT_FALSE(k::fp8_gemv_ok(bad));
  EXPECT_EQ(k::fp8_gemv(bad, 64, 1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(k::fp8_gemv(a, 64, 3, nullptr), cudaErrorInvalidValue);
}
#endif

// Bad routing ids on an FP8 forward: the sticky error word names the first one.
TEST(CudaQuant, Fp8BadIdIsAClearError) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  test::ExpertsProblem p = make_fp8_problem({.T = 4, .E = 3, .K = 2, .H = 64, .I = 32}, 9, DType::f32);
  p.top_k_index.ptr<int64_t>()[3] = 7;
  const Experts g = p.experts.to(Device::cuda(0));
  test::run_backend(g, "grouped_mm", p.hidden_states, p.top_k_index, p.top_k_weights);
  try {
    check_experts_errors(g, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("top_k_index[1, 1] = 7"), std::string::npos) << e.what();
  }
}

TEST(CudaQuant, BackendsWithoutAnFp8PathAreRefusedWithAReason) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const test::ExpertsProblem p = make_fp8_problem({.T = 3, .E = 3, .K = 1, .H = 64, .I = 32}, 8, DType::f32);
  const Experts g = p.experts.to(Device::cuda(0));
  for (const auto& b : ExpertsInterface::global().backends()) {
    const std::string name(b->name());
    const Support s = b->supports(g, DType::bf16);
    if (name == "grouped_mm" || name == "batched_mm") {
      EXPECT_TRUE(s.ok) << name << ": " << s.reason;
    } else if (name == "eager") {  // no FP8 path: the reason says what to do
      EXPECT_FALSE(s.ok);
      EXPECT_NE(s.reason.find("dequantize"), std::string::npos) << s.reason;
    } else if (name != "deepgemm") {
      EXPECT_FALSE(s.ok) << name;
      EXPECT_FALSE(s.reason.empty()) << name;
    }
  }
}

// FP4 experts: grouped_mm, batched_mm and deepgemm take them; the backends without a quantized path refuse them with
// the way out.
TEST(CudaQuant, Fp4ExpertsRunInTheQuantizedBackendsAndTheOthersSayWhy) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  for (const bool float_acts : {false, true}) {
    const test::ExpertsProblem p = test::make_fp4_case({.T = 3, .E = 3, .K = 1, .H = 64, .I = 32}, 8, float_acts);
    const Experts g = p.experts.to(Device::cuda(0));
    for (const auto& b : ExpertsInterface::global().backends()) {
      const std::string name(b->name());
      const Support s = b->supports(g, DType::bf16);
      if (name == "grouped_mm" || name == "batched_mm" || name == "deepgemm") {
        EXPECT_TRUE(s.ok) << name << ": " << s.reason;
      } else {
        EXPECT_FALSE(s.ok) << name;
        if (name == "eager") EXPECT_NE(s.reason.find("dequantize"), std::string::npos) << s.reason;
      }
    }
  }
}

// FP4 cases: the configuration (each runs with float and with quantized activations). The GEMV serves up to
// fp4_gemv_max_pairs() = 64 pairs (f32 float activations: always), the tiled kernel beyond.
std::vector<ProblemConfig> fp4_sweep() {
  std::vector<ProblemConfig> v;
  auto add = [&](ProblemConfig c) { v.push_back(c); };
  // Decode sizes: the GEMV over FP4 bytes, one row per expert pass (P <= E) and four (P > E)
  add({.T = 5, .E = 3, .K = 2, .H = 96, .I = 64});                                    // K % 128 != 0
  add({.T = 1, .E = 9, .K = 8, .H = 160, .I = 96, .sentinels = true});                // odd E, sentinels
  add({.T = 2, .E = 33, .K = 4, .H = 544, .I = 160, .has_bias = true});               // biases, several steps
  add({.act = DType::bf16, .rwt = DType::bf16, .idt = DType::i32, .T = 11, .E = 5, .K = 2, .H = 224, .I = 96});
  add({.act = DType::bf16, .rwt = DType::bf16, .T = 7, .E = 5, .K = 2, .H = 192, .I = 96, .has_bias = true,
       .concatenated = false, .gate = GateKind::clamped_swiglu, .limit = 7.0f});     // gpt-oss's experts
  add({.T = 4, .E = 5, .K = 2, .H = 64, .I = 32, .sentinel_every = 1});                // every slot a sentinel
  add({.act = DType::f16, .T = 3, .E = 3, .K = 2, .H = 128, .I = 96, .has_gate = false, .has_bias = true,
       .activation = Activation::relu2});
  add({.T = 6, .E = 4, .K = 2, .H = 96, .I = 64, .used = 1});                          // one expert, 12 rows
  // Hundreds of rows: the tiled kernel, row tiles of 128 (P >= 64 E) and 32
  add({.act = DType::bf16, .T = 60, .E = 7, .K = 4, .H = 160, .I = 64, .sentinels = true});
  add({.T = 150, .E = 3, .K = 2, .H = 96, .I = 64, .has_bias = true});
  add({.act = DType::bf16, .rwt = DType::bf16, .T = 140, .E = 3, .K = 2, .H = 128, .I = 64, .has_bias = true,
       .concatenated = false, .gate = GateKind::clamped_swiglu, .limit = 7.0f, .sentinels = true});
  add({.act = DType::f16, .T = 200, .E = 4, .K = 3, .H = 96, .I = 64, .has_gate = false,
       .activation = Activation::relu2, .empty_experts = true});
  add({.act = DType::bf16, .idt = DType::i32, .T = 140, .E = 2, .K = 2, .H = 544, .I = 32});
  add({.act = DType::bf16, .T = 150, .E = 7, .K = 2, .H = 160, .I = 64, .has_bias = true});
  add({.act = DType::f16, .T = 90, .E = 5, .K = 3, .H = 96, .I = 128, .sentinels = true});
  add({.T = 300, .E = 2, .K = 1, .H = 128, .I = 96, .has_gate = false, .empty_experts = true});
  return v;
}

TEST(CudaQuant, Fp4GroupedBatchedAndDeepgemmMatchTheReference) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  uint64_t seed = 700;
  int checked = 0;
  for (const ProblemConfig& c : fp4_sweep())
    for (const bool float_acts : {true, false}) {
      const test::ExpertsProblem p = test::make_fp4_case(c, seed++, float_acts, /*biases_in_act_dtype=*/true);
      const Experts g = p.experts.to(Device::cuda(0));
      for (const char* name : {"grouped_mm", "batched_mm", "deepgemm"}) {
        const Support s = ExpertsInterface::global().get(name)->supports(g, c.act);
        ASSERT_TRUE(s.ok) << name << " " << c.to_string() << ": " << s.reason;
        double err = 0;
        const Tensor out = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        const std::string problem = test::compare_with_reference(p, out, &err);
        std::printf("  %-10s %s %s: rel L2 %.2e %s\n", name, float_acts ? "mxfp4" : "fp4  ", c.to_string().c_str(),
                    err, problem.c_str());
        EXPECT_TRUE(problem.empty()) << name << (float_acts ? " mxfp4 " : " fp4 ") << c.to_string() << ": " << problem;
        ++checked;
      }
    }
  EXPECT_EQ(checked, int(fp4_sweep().size()) * 2 * 3);
}

#ifdef MOEKIT_WITH_CUDA
// The FP4 GEMV's reach for the scope.
using Fp4GemvPolicy = ScopedPolicy<cuda::set_fp4_gemv_max_pairs>;

// The FP4 GEMV forced on beyond its reach (experts of several row tiles of 64) and off (the tiled kernel at decode
// sizes, the tensor-core GEMV off too), both variants; the GEMV the same bits on a second run.
TEST(CudaQuant, Fp4GemvForcedOnAndOffMatchesTheReference) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const std::vector<ProblemConfig> cases = {
      {.T = 150, .E = 3, .K = 2, .H = 160, .I = 96, .used = 1},  // 300 rows: 5 tiles of one expert
      {.act = DType::bf16, .rwt = DType::bf16, .T = 90, .E = 5, .K = 3, .H = 224, .I = 160, .has_bias = true,
       .concatenated = false, .gate = GateKind::clamped_swiglu, .limit = 7.0f},
      {.act = DType::f16, .T = 3, .E = 9, .K = 3, .H = 288, .I = 96, .has_gate = false, .activation = Activation::gelu},
      {.T = 8, .E = 4, .K = 2, .H = 96, .I = 64, .has_bias = true, .sentinels = true},
  };
  uint64_t seed = 950;
  for (const ProblemConfig& c : cases)
    for (const bool float_acts : {true, false}) {
      const test::ExpertsProblem p = test::make_fp4_case(c, seed++, float_acts, /*biases_in_act_dtype=*/true);
      const Experts g = p.experts.to(Device::cuda(0));
      for (const int64_t reach : {int64_t(1) << 40, int64_t(0)}) {
        const Fp4GemvPolicy policy(reach);
        const bool was_mma = cuda::set_fp4_mma_gemv(reach != 0);  // off: the tiled kernel for every activation type
        for (const char* name : {"grouped_mm", "batched_mm", "deepgemm"}) {
          double err = 0;
          const Tensor out = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
          const std::string problem = test::compare_with_reference(p, out, &err);
          std::printf("  %-10s %s gemv %-3s %s: rel L2 %.2e %s\n", name, float_acts ? "mxfp4" : "fp4  ",
                      reach ? "on" : "off", c.to_string().c_str(), err, problem.c_str());
          EXPECT_TRUE(problem.empty()) << name << (float_acts ? " mxfp4" : " fp4") << " gemv "
                                       << (reach ? "on " : "off ") << c.to_string() << ": " << problem;
          if (reach) {
            const Tensor again = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
            EXPECT_TRUE(test::bitwise_equal(out, again)) << name << " " << c.to_string();
          }
        }
        cuda::set_fp4_mma_gemv(was_mma);
      }
    }
}

// MXFP4 with bf16 activations on the tensor-core GEMV (policy.h fp4_mma_gemv) and on the FP32 one, the GEMV's reach
// lifted so that every case takes it: both against the f64 reference (K and I not multiples of 128, several loads
// batches of 128-input blocks, experts of 1 to 80 rows: several 8-row passes, passes of four 8-row chunks, 64-row
// tiles, interleaved clamped SwiGLU with biases, the activation-only epilogue, sentinels, one expert for all, empty
// experts), with its K slices chosen and forced to 1, 2 and 4; the tensor-core form used where it is on and not where
// it is off, and the same bits on a second run.
TEST(CudaQuant, Fp4MmaGemvMatchesTheReferenceAndTheFp32Gemv) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const std::vector<ProblemConfig> cases = {
      {.act = DType::bf16, .rwt = DType::bf16, .T = 1, .E = 9, .K = 4, .H = 160, .I = 96},
      {.act = DType::bf16, .rwt = DType::bf16, .T = 7, .E = 5, .K = 2, .H = 192, .I = 96, .has_bias = true,
       .concatenated = false, .gate = GateKind::clamped_swiglu, .limit = 7.0f},
      {.act = DType::bf16, .rwt = DType::bf16, .idt = DType::i32, .T = 11, .E = 5, .K = 2, .H = 224, .I = 96},
      {.act = DType::bf16, .T = 6, .E = 4, .K = 2, .H = 96, .I = 64, .used = 1},  // 12 rows: two 8-row passes
      {.act = DType::bf16, .T = 3, .E = 3, .K = 2, .H = 128, .I = 96, .has_gate = false, .has_bias = true,
       .activation = Activation::relu2},
      {.act = DType::bf16, .T = 4, .E = 5, .K = 2, .H = 64, .I = 32, .sentinel_every = 1},
      {.act = DType::bf16, .T = 2, .E = 33, .K = 4, .H = 1312, .I = 160, .has_bias = true, .sentinels = true},
      // More than 8 rows per expert on average: four 8-row chunks per pass over the weights
      {.act = DType::bf16, .T = 40, .E = 2, .K = 2, .H = 96, .I = 64, .used = 1},  // 80 rows: two tiles of 64
      {.act = DType::bf16, .rwt = DType::bf16, .T = 90, .E = 5, .K = 3, .H = 224, .I = 160, .has_bias = true,
       .concatenated = false, .gate = GateKind::clamped_swiglu, .limit = 7.0f, .sentinels = true},
      {.act = DType::bf16, .T = 70, .E = 4, .K = 2, .H = 288, .I = 96, .has_gate = false,
       .activation = Activation::gelu, .empty_experts = true},
  };
  const Fp4GemvPolicy reach(int64_t(1) << 40);
  uint64_t seed = 1300;
  for (const ProblemConfig& c : cases) {
    const test::ExpertsProblem p = test::make_fp4_case(c, seed++, /*float_acts=*/true, /*biases_in_act_dtype=*/true);
    const Experts g = p.experts.to(Device::cuda(0));
    // The tensor-core form with its K slices by the call's size (0) and forced to 1, 2, 4; then the FP32 GEMV.
    for (const int ks : {0, 1, 2, 4, -1}) {
      const bool mma = ks >= 0;
      const bool was = cuda::set_fp4_mma_gemv(mma);
      const int was_ks = cuda::kernels::set_fp4_mma_ksplit(mma ? ks : 0);
      for (const char* name : {"grouped_mm", "batched_mm"}) {
        const int64_t calls = cuda::fp4_mma_gemv_calls();
        double err = 0;
        const Tensor out = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        const std::string problem = test::compare_with_reference(p, out, &err);
        std::printf("  %-10s mxfp4 %s ks %d gemv %s: rel L2 %.2e %s\n", name, mma ? "mma " : "fp32", ks,
                    c.to_string().c_str(), err, problem.c_str());
        EXPECT_TRUE(problem.empty()) << name << (mma ? " mma ks " : " fp32 ") << ks << " " << c.to_string() << ": "
                                     << problem;
        EXPECT_EQ(cuda::fp4_mma_gemv_calls() - calls, mma ? 2 : 0) << name << " " << c.to_string();
        const Tensor again = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        EXPECT_TRUE(test::bitwise_equal(out, again)) << name << " " << c.to_string();
      }
      cuda::kernels::set_fp4_mma_ksplit(was_ks);
      cuda::set_fp4_mma_gemv(was);
    }
  }
}

// The tensor-core GEMV's pair form (a few tokens, no routing sort, the combine in the second projection's last
// blocks) against the reference, and bit for bit the sorted form then combine for the same K slices.
TEST(CudaQuant, Fp4MmaPairFormIsTheSortedFormBitForBit) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const std::vector<ProblemConfig> cases = {
      {.act = DType::bf16, .rwt = DType::bf16, .T = 1, .E = 9, .K = 4, .H = 160, .I = 96},
      {.act = DType::bf16, .T = 1, .E = 32, .K = 4, .H = 2880 / 9, .I = 2880 / 9, .has_bias = true,
       .concatenated = false, .gate = GateKind::clamped_swiglu, .limit = 7.0f},
      {.act = DType::bf16, .rwt = DType::bf16, .idt = DType::i32, .T = 3, .E = 5, .K = 2, .H = 224, .I = 96,
       .has_bias = true, .sentinels = true},
      {.act = DType::bf16, .T = 4, .E = 5, .K = 2, .H = 64, .I = 32, .sentinel_every = 1},
      {.act = DType::bf16, .T = 2, .E = 3, .K = 3, .H = 128, .I = 96, .has_gate = false, .has_bias = true,
       .activation = Activation::relu2},
      {.act = DType::bf16, .T = 8, .E = 33, .K = 4, .H = 1312, .I = 160, .has_bias = true, .sentinels = true},
  };
  const Fp4GemvPolicy reach(int64_t(1) << 40);
  const bool was_mma = cuda::set_fp4_mma_gemv(true);
  uint64_t seed = 1400;
  for (const ProblemConfig& c : cases) {
    const test::ExpertsProblem p = test::make_fp4_case(c, seed++, /*float_acts=*/true, /*biases_in_act_dtype=*/true);
    const Experts g = p.experts.to(Device::cuda(0));
    for (const int ks : {1, 2, 4, 0}) {
      const int was_ks = cuda::kernels::set_fp4_mma_ksplit(ks);
      for (const char* name : {"grouped_mm", "batched_mm"}) {
        const int64_t was_pair = cuda::set_fp4_pair_max_tokens(0);
        const Tensor sorted = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        cuda::set_fp4_pair_max_tokens(64);
        const int64_t calls = cuda::fp4_pair_calls();
        double err = 0;
        const Tensor out = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        const std::string problem = test::compare_with_reference(p, out, &err);
        std::printf("  %-10s mxfp4 pair ks %d %s: rel L2 %.2e %s\n", name, ks, c.to_string().c_str(), err,
                    problem.c_str());
        EXPECT_TRUE(problem.empty()) << name << " ks " << ks << " " << c.to_string() << ": " << problem;
        EXPECT_EQ(cuda::fp4_pair_calls() - calls, 1) << name << " " << c.to_string();
        if (ks != 0)  // the slice count by the call's size differs between the forms
          EXPECT_TRUE(test::bitwise_equal(out, sorted)) << name << " ks " << ks << " " << c.to_string();
        const Tensor again = test::run_backend(g, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        EXPECT_TRUE(test::bitwise_equal(out, again)) << name << " " << c.to_string();
        cuda::set_fp4_pair_max_tokens(was_pair);
      }
      cuda::kernels::set_fp4_mma_ksplit(was_ks);
    }
  }
  // Ids < 0 or > E: the pair form drops the slot and records the first bad id, as the sorted form does.
  {
    const ProblemConfig c{.act = DType::bf16, .T = 2, .E = 9, .K = 4, .H = 160, .I = 96};
    const test::ExpertsProblem p = test::make_fp4_case(c, 1499, /*float_acts=*/true, /*biases_in_act_dtype=*/true);
    const Experts g = p.experts.to(Device::cuda(0));
    Tensor bad = Tensor::copy_of(p.top_k_index.view(), Device::cpu());
    bad.ptr<int64_t>()[1] = -1;     // token 0, slot 1
    bad.ptr<int64_t>()[6] = 9 + 3;  // token 1, slot 2
    const int was_ks = cuda::kernels::set_fp4_mma_ksplit(2);
    Tensor outs[2];
    for (const int64_t tokens : {0, 64}) {
      const int64_t was_pair = cuda::set_fp4_pair_max_tokens(tokens);
      const int64_t calls = cuda::fp4_pair_calls();
      check_experts_errors(g);  // clean before
      outs[tokens ? 1 : 0] = test::run_backend(g, "grouped_mm", p.hidden_states, bad, p.top_k_weights);
      EXPECT_EQ(cuda::fp4_pair_calls() - calls, tokens ? 1 : 0);
      try {
        check_experts_errors(g);
        ADD_FAILURE() << "bad id not reported, pair tokens " << tokens;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
        EXPECT_NE(std::string(e.what()).find("top_k_index[0, 1] = -1"), std::string::npos) << e.what();
      }
      cuda::set_fp4_pair_max_tokens(was_pair);
    }
    EXPECT_TRUE(test::bitwise_equal(outs[0], outs[1])) << "bad ids: pair form against the sorted form";
    cuda::kernels::set_fp4_mma_ksplit(was_ks);
  }
  cuda::set_fp4_mma_gemv(was_mma);
}

// The device quantizer (the benchmark's FP4 experts) is the host's quantize_fp4 bit for bit: every dtype, ties of
// e2m1, saturation, all-zero and tiny groups.
TEST(CudaQuant, Fp4WeightQuantisationIsBitwiseTheHosts) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(31);
  const int64_t rows = 23, k = 160;
  for (const DType dt : {DType::f32, DType::bf16, DType::f16}) {
    Tensor x = test::randn({rows, k}, DType::f32, rng, 2.0);
    float* xp = x.ptr<float>();
    std::uniform_int_distribution<int> pick(0, 7);
    for (int64_t i = 0; i < rows * k; ++i) {
      const int c = pick(rng);
      if (c == 0) xp[i] = std::ldexp(float(1 + rng() % 12) * 0.25f, int(rng() % 5) - 2);  // e2m1 ties and values
      else if (c == 1) xp[i] *= 1e-3f;
    }
    for (int64_t i = 0; i < 32; ++i) xp[3 * k + i] = 0.0f;  // an all-zero group
    const Tensor xd = x.to(dt);
    const auto [hq, hs] = quantize_fp4(xd);
    const Tensor xg = xd.to(Device::cuda(0));
    Tensor q = Tensor::empty({rows, k / 2}, DType::u8, Device::cuda(0)),
           s = Tensor::empty({rows, k / 32}, DType::u8, Device::cuda(0));
    const auto type = dt == DType::f32 ? cuda::kernels::Elem::f32
                      : dt == DType::bf16 ? cuda::kernels::Elem::bf16 : cuda::kernels::Elem::f16;
    ASSERT_EQ(cuda::kernels::quantize_fp4_groups(type, xg.data(), rows, k, q.ptr<uint8_t>(), s.ptr<uint8_t>(), nullptr),
              cudaSuccess);
    stream_synchronize(nullptr, Device::cuda(0));
    const Tensor qh = q.to(Device::cpu()), sh = s.to(Device::cpu());
    EXPECT_EQ(std::memcmp(qh.data(), hq.data(), size_t(rows * k / 2)), 0) << dtype_name(dt);
    EXPECT_EQ(std::memcmp(sh.data(), hs.data(), size_t(rows * k / 32)), 0) << dtype_name(dt);
  }
}

// The FP4 launchers refuse what their kernels cannot read instead of reading out of bounds.
TEST(CudaQuant, Fp4KernelsRefuseWhatTheyCannotRead) {
  namespace k = cuda::kernels;
  k::Fp4GemmArgs a;
  a.type = k::Elem::bf16;
  a.a = reinterpret_cast<const uint8_t*>(size_t(256));
  a.b = reinterpret_cast<const uint8_t*>(size_t(512));
  a.b_e8 = reinterpret_cast<const uint8_t*>(size_t(1024));
  a.a_float = true;
  a.k = 96;
  a.lda = 96;
  a.b_k = 48;
  a.b_stride_n = 48;
  a.b_expert_stride = 48 * 64;
  a.b_e8_ld = 4;
  a.bs_expert_stride = 4 * 64;
  EXPECT_TRUE(k::fp4_gemv_ok(a));
  EXPECT_TRUE(k::grouped_gemm_fp4_ok(a));
  k::Fp4GemmArgs bad = a;
  bad.b_e8_ld = 3;  // the tiled kernel reads whole words of codes
  EXPECT_FALSE(k::grouped_gemm_fp4_ok(bad));
  bad = a;
  bad.k = 80, bad.lda = 80, bad.b_k = 40, bad.b_stride_n = 40;  // not a multiple of 32
  EXPECT_FALSE(k::fp4_gemv_ok(bad));
  EXPECT_FALSE(k::grouped_gemm_fp4_ok(bad));
  EXPECT_EQ(k::grouped_gemm_fp4(bad, 32, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(k::fp4_gemv(bad, 64, 1, nullptr), cudaErrorInvalidValue);
  bad = a;
  bad.type = k::Elem::f32;  // f32 float activations: the GEMV only
  EXPECT_FALSE(k::grouped_gemm_fp4_ok(bad));
  EXPECT_TRUE(k::fp4_gemv_ok(bad));
  bad = a;
  bad.a = reinterpret_cast<const uint8_t*>(size_t(264));
  EXPECT_FALSE(k::fp4_gemv_ok(bad));
  EXPECT_FALSE(k::grouped_gemm_fp4_ok(bad));
  bad = a;
  bad.a_float = false;  // quantized A needs its scales and whole 128-input rows
  EXPECT_FALSE(k::grouped_gemm_fp4_ok(bad));
  EXPECT_FALSE(k::fp4_gemv_ok(bad));
}
#endif

// gpt-oss's MXFP4 fixture (tests/fixtures/quant/gpt_oss_mxfp4, made with transformers, which dequantizes MXFP4
// where its kernels are absent) on the GPU in f32, the experts kept in FP4 with float activations: transformers'
// logits and greedy tokens on each backend with an FP4 path.
TEST(CudaQuant, GptOssMxfp4FixtureMatchesTransformersOnTheGpu) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const std::string dir = test::fixtures_dir() + "/quant/gpt_oss_mxfp4";
  const auto ref = SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = ref.get("input_ids"), gen = ref.get("generated_ids"), ref_logits = ref.get("logits.grouped_mm");
  const int64_t B = ids.size(0), L = ids.size(1);
  Model m = Model::from_pretrained(dir, {.device = Device::cuda(0), .dtype = DType::f32});
  ASSERT_FALSE(m.experts_modules().empty());
  for (const Experts* e : m.experts_modules()) EXPECT_TRUE(e->is_quantized() && e->device().is_cuda());
  const int64_t V = m.config().text.vocab_size;
  GenerationConfig gc;
  gc.max_new_tokens = gc.min_new_tokens = gen.size(1) - L;
  const std::vector<int64_t> expect(gen.ptr<int64_t>() + L, gen.ptr<int64_t>() + gen.size(1));
  for (const char* be : {"grouped_mm", "batched_mm", "deepgemm"}) {
    SCOPED_TRACE(std::string("backend ") + be);
    m.set_experts_implementation(be);
    for (int64_t r = 0; r < B; ++r) {
      const Tensor q = m.logits(test::row_ids(ids, r)).to(Device::cpu());
      const double err = test::rel_l2(q.ptr<float>(), ref_logits.ptr<float>() + r * L * V, L * V);
      std::printf("  gpt_oss_mxfp4 %-10s row %lld: logits rel L2 %.2e\n", be, static_cast<long long>(r), err);
      EXPECT_LT(err, 1e-4) << be << " row " << r;
    }
    EXPECT_EQ(m.generate(test::row_ids(ids, 0), gc).tokens, expect) << be;
  }
}

}  // namespace
}  // namespace moekit

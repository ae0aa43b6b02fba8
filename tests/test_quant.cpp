// Quantized experts (SPEC section 5): the formats' conversions, the activation quantisation, block quantize /
// dequantize with partial blocks, the FP8 GEMM tile on every ISA, and eager / batched_mm / grouped_mm on FP8 experts
// against the f64 reference (every ISA).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <cstdio>
#include <random>

#include "base/gemm.h"
#include "moekit/quant.h"
#include "test_experts_problem.h"
#include "test_fp8_problem.h"

namespace moekit {
namespace {

using test::ProblemConfig;
using test::make_fp8_problem;

TEST(QuantFormats, E4m3EveryCodeRoundTripsAndRoundsToNearestEven) {
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = f8e4m3_to_f32(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    ++finite;
    EXPECT_EQ(f32_to_f8e4m3(v), (c == 0x80 ? 0x80 : c)) << c << " " << v;
  }
  EXPECT_EQ(finite, 254);
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(f8e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(1.0625f)), 1.0f);   // tie between 1 and 1.125: even
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(1.1875f)), 1.25f);  // tie between 1.125 and 1.25: even
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(1e6f)), 448.0f);    // saturates
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(-500.0f)), -448.0f);
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(std::ldexp(1.0f, -10))), 0.0f);  // half the smallest subnormal: even (0)
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(std::ldexp(3.0f, -11))), std::ldexp(1.0f, -9));
}

TEST(QuantFormats, E2m1AndUe8m0) {
  const float table[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(f4e2m1_to_f32(uint8_t(c)), table[c]) << c;
    EXPECT_EQ(f4e2m1_to_f32(f32_to_f4e2m1(table[c])), table[c]) << c;
  }
  EXPECT_EQ(f4e2m1_to_f32(f32_to_f4e2m1(2.5f)), 2.0f);  // tie: even mantissa
  EXPECT_EQ(f4e2m1_to_f32(f32_to_f4e2m1(5.0f)), 4.0f);
  EXPECT_EQ(ue8m0_to_f32(127), 1.0f);
  EXPECT_EQ(ue8m0_to_f32(130), 8.0f);
  EXPECT_EQ(ue8m0_to_f32(f32_to_ue8m0(3.0f)), 4.0f);  // rounded up to a power of two
  EXPECT_EQ(ue8m0_to_f32(f32_to_ue8m0(0.25f)), 0.25f);
  EXPECT_TRUE(std::isnan(ue8m0_to_f32(0xff)));
}

TEST(QuantActivations, PerGroupOf128AmaxOver448) {
  std::vector<float> x(300);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (float& v : x) v = nd(rng);
  for (int i = 256; i < 300; ++i) x[size_t(i)] = 0.0f;  // an all-zero last (partial) group
  x[5] = 40.0f;                                         // amax of group 0
  std::vector<float> q(300), s(3);
  quantize_activations_fp8(x.data(), 300, false, q.data(), s.data());
  EXPECT_EQ(s[0], 40.0f / 448.0f);
  EXPECT_EQ(q[5], 448.0f);
  EXPECT_EQ(s[2], 0.0f);
  for (int i = 256; i < 300; ++i) EXPECT_EQ(q[size_t(i)], 0.0f);
  for (int i = 0; i < 256; ++i) {
    const float sc = s[size_t(i / 128)], expect = f8e4m3_to_f32(f32_to_f8e4m3(x[size_t(i)] / sc));
    EXPECT_EQ(q[size_t(i)], expect) << i;
    EXPECT_LE(std::fabs(q[size_t(i)] * sc - x[size_t(i)]), std::fabs(x[size_t(i)]) / 16 + sc * std::ldexp(1.0f, -10))
        << i;
  }
  quantize_activations_fp8(x.data(), 300, true, q.data(), s.data());  // UE8M0: scales rounded up to 2^n
  EXPECT_EQ(s[0], 0.125f);                                           // 40 / 448 = 0.089 -> 0.125
  EXPECT_EQ(q[5], 320.0f);
}

TEST(QuantWeights, BlocksOf128WithPartialLastBlocks) {
  std::mt19937_64 rng(11);
  for (const int64_t segments : {1, 2}) {
    for (const DType sdt : {DType::f32, DType::ue8m0}) {
      const int64_t N = 2 * 200, K = 130;  // 200-row halves: blocks of 128 and 72 rows each; 128 + 2 inputs
      Tensor w = test::randn({3, N, K}, DType::f32, rng, 1.0);
      w.ptr<float>()[(1 * N + 260) * K + 129] = 0.0f;
      auto [q, s] = quantize_fp8(w, sdt, segments);
      const int64_t SN = segments == 1 ? 4 : 4;  // ceil(400 / 128) = 4, 2 * ceil(200 / 128) = 4
      EXPECT_EQ(s.shape(), (Shape{3, SN, 2}));
      EXPECT_EQ(s.dtype(), sdt);
      const Tensor d = dequantize_fp8(q, s, DType::f32, segments);
      double num = 0, den = 0;
      for (int64_t i = 0; i < w.numel(); ++i) {
        const double a = w.ptr<float>()[i], b = d.ptr<float>()[i];
        num += (a - b) * (a - b);
        den += a * a;
      }
      EXPECT_LT(std::sqrt(num / den), 0.05) << "segments=" << segments << " " << dtype_name(sdt);
      // Each element is exactly its code times the scale of its own block (rows of its segment, 128 inputs).
      for (int64_t e = 0; e < 3; ++e)
        for (int64_t n = 0; n < N; n += 37)
          for (int64_t k = 0; k < K; k += 43) {
            const int64_t srow = segments == 2 ? (n / 200) * 2 + (n % 200) / 128 : n / 128;
            const float sc = sdt == DType::f32 ? s.ptr<float>()[(e * SN + srow) * 2 + k / 128]
                                               : ue8m0_to_f32(s.ptr<uint8_t>()[(e * SN + srow) * 2 + k / 128]);
            EXPECT_EQ(d.ptr<float>()[(e * N + n) * K + k], f8e4m3_to_f32(q.ptr<uint8_t>()[(e * N + n) * K + k]) * sc);
          }
    }
  }
  // A 576-row weight (DeepSeek-V3's kv_a_proj_with_mqa): 5 scale rows, the last one of 64 rows.
  Tensor w = test::randn({576, 256}, DType::f32, rng, 1.0);
  auto [q, s] = quantize_fp8(w);
  EXPECT_EQ(s.shape(), (Shape{5, 2}));
  EXPECT_THROW(dequantize_fp8(q, Tensor::zeros({4, 2}, DType::f32), DType::bf16), Error);
}

// The FP8 tile against a plain f64 loop on every ISA, with every e4m3 code in the weights; the tiles of every ISA
// give the same bits (each block's dot product is exact).
TEST(QuantGemm, Fp8TileEveryIsaMatchesDoubleAndAgreesBitwise) {
  std::mt19937_64 rng(3);
  struct Dims {
    int64_t m, n, k, seg;
    bool mostly_normal = false;  // zeros and subnormals only at a few places (real weights; the amx decode's fast path)
  };
  for (const Dims d : {Dims{1, 9, 300, 9}, Dims{5, 130, 128, 65}, Dims{13, 7, 77, 7}, Dims{3, 256, 520, 256},
                       Dims{1, 37, 1000, 37, true}, Dims{2, 24, 256, 24, true}, Dims{4, 9, 200, 9, true}}) {
    std::vector<uint8_t> w(size_t(d.n * d.k));
    for (size_t i = 0; i < w.size(); ++i) {
      uint8_t c = uint8_t((i * 131 + rng()) & 0xff);
      if ((c & 0x7f) == 0x7f) c = 0x7e;
      if (d.mostly_normal && (c & 0x78) == 0 && i % 700 != 3) c |= 0x08;
      w[i] = c;
    }
    const int64_t kb = fp8_blocks(d.k), sn = (d.n / d.seg) * fp8_blocks(d.seg);
    std::vector<float> sc(size_t(sn * kb));
    for (float& v : sc) v = std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, int(rng() % 9) - 8);
    Tensor x = test::randn({d.m, d.k}, DType::f32, rng, 2.0);
    const int64_t kp = cpu::fp8_row_k(d.k);
    std::vector<double> qa(size_t(d.m * kp));
    std::vector<float> sa(size_t(d.m * kb));
    cpu::fp8_quantize_rows(x.ptr<float>(), d.k, d.m, d.k, false, qa.data(), kp, sa.data(), kb);
    std::vector<float> first;
    for (const cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512, cpu::Isa::amx}) {
      if (!cpu::isa_supported(isa)) {
        std::printf("ISA %s: not on this CPU (not tested here)\n", cpu::isa_name(isa));
        continue;
      }
      cpu::set_isa_override(isa);
      const cpu::GemmKernels& kern = cpu::gemm_kernels();
      std::vector<float> c(size_t(d.m * d.n), NAN);
      std::vector<double> work(size_t(cpu::fp8_work_doubles(d.k)));
      const cpu::Fp8Matrix wm{w.data(), sc.data(), d.n, d.k, d.seg};
      kern.gemm_fp8_tile(qa.data(), kp, sa.data(), kb, d.m, wm, 0, d.n / 2, c.data(), d.n, work.data());
      kern.gemm_fp8_tile(qa.data(), kp, sa.data(), kb, d.m, wm, d.n / 2, d.n, c.data(), d.n, work.data());
      cpu::clear_isa_override();
      for (int64_t i = 0; i < d.m; ++i)
        for (int64_t j = 0; j < d.n; ++j) {
          double ref = 0;
          for (int64_t k = 0; k < d.k; ++k) {
            const int64_t srow = (j / d.seg) * fp8_blocks(d.seg) + (j % d.seg) / 128;
            ref += (qa[size_t(i * kp + k)] / 512.0 * sa[size_t(i * kb + k / 128)]) *
                   (double(f8e4m3_to_f32(w[size_t(j * d.k + k)])) * sc[size_t(srow * kb + k / 128)]);
          }
          const float got = c[size_t(i * d.n + j)];
          ASSERT_LE(std::fabs(double(got) - ref), 1e-6 * std::fabs(ref) + 1e-30)
              << cpu::isa_name(isa) << " m=" << d.m << " n=" << d.n << " k=" << d.k << " (" << i << ", " << j << ")";
        }
      if (first.empty())
        first = c;
      else
        EXPECT_EQ(std::memcmp(first.data(), c.data(), c.size() * 4), 0) << cpu::isa_name(isa) << ": bits differ";
      // The f32-sum tile (amx; decode-sized rows): within f32 rounding of the sums of |products|.
      cpu::set_isa_override(isa);
      const auto f32_tile = cpu::gemm_kernels().gemm_fp8_f32_tile;
      cpu::clear_isa_override();
      if (!f32_tile || d.m > cpu::kFp8F32MaxRows) continue;
      std::vector<float> c2(size_t(d.m * d.n), NAN);
      f32_tile(qa.data(), kp, sa.data(), kb, d.m, wm, 0, d.n / 2, c2.data(), d.n, work.data());
      f32_tile(qa.data(), kp, sa.data(), kb, d.m, wm, d.n / 2, d.n, c2.data(), d.n, work.data());
      for (int64_t i = 0; i < d.m; ++i)
        for (int64_t j = 0; j < d.n; ++j) {
          double ref = 0, mag = 0;
          for (int64_t k = 0; k < d.k; ++k) {
            const int64_t srow = (j / d.seg) * fp8_blocks(d.seg) + (j % d.seg) / 128;
            const double t = (qa[size_t(i * kp + k)] / 512.0 * sa[size_t(i * kb + k / 128)]) *
                             (double(f8e4m3_to_f32(w[size_t(j * d.k + k)])) * sc[size_t(srow * kb + k / 128)]);
            ref += t, mag += std::fabs(t);
          }
          const float got = c2[size_t(i * d.n + j)];
          ASSERT_LE(std::fabs(double(got) - ref), 2e-6 * mag + 1e-30)
              << cpu::isa_name(isa) << " f32 tile m=" << d.m << " n=" << d.n << " k=" << d.k << " (" << i << ", " << j << ")";
        }
    }
  }
}


std::vector<std::pair<ProblemConfig, DType>> fp8_sweep() {
  return test::fp8_common_cases();
}

TEST(QuantExperts, Fp8EveryCpuBackendAndIsaMatchesTheReference) {
  int checked = 0;
  for (const cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512, cpu::Isa::avx512bf16, cpu::Isa::amx}) {
    if (!cpu::isa_supported(isa)) {
      std::printf("ISA %s: not on this CPU (not tested here)\n", cpu::isa_name(isa));
      continue;
    }
    cpu::set_isa_override(isa);
    std::map<DType, double> worst;
    uint64_t seed = 100;
    for (const auto& [c, sdt] : fp8_sweep()) {
      const test::ExpertsProblem p = make_fp8_problem(c, seed++, sdt);
      ASSERT_TRUE(p.experts.is_quantized());
      for (const char* name : {"eager", "batched_mm", "grouped_mm"}) {
        const Tensor out = test::run_backend(p.experts, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        const double err = relative_l2(out.view(), p.reference);
        EXPECT_LT(err, experts_tolerance(c.act)) << cpu::isa_name(isa) << " " << name << " " << c.to_string() << " scales "
                                                 << dtype_name(sdt);
        worst[c.act] = std::max(worst[c.act], err);
        ++checked;
      }
    }
    cpu::clear_isa_override();
    for (const auto& [dt, err] : worst) std::printf("ISA %s: worst relative L2 with %s activations %.3g\n", cpu::isa_name(isa), dtype_name(dt), err);
  }
  EXPECT_GT(checked, 0);
}

TEST(QuantWeights, Fp4PerRowAndGroupOf32) {
  std::mt19937_64 rng(12);
  Tensor w = test::randn({2, 5, 96}, DType::f32, rng, 1.0);
  w.ptr<float>()[40] = 0.0f;
  for (int i = 64; i < 96; ++i) w.ptr<float>()[i] = 0.0f;  // an all-zero group
  auto [q, s] = quantize_fp4(w);
  EXPECT_EQ(q.dtype(), DType::f4e2m1);
  EXPECT_EQ(q.nbytes(), size_t(2 * 5 * 48));
  EXPECT_EQ(s.shape(), (Shape{2, 5, 3}));
  const Tensor d = dequantize_fp4(q, s, DType::f32);
  for (int64_t g = 0; g < 2 * 5 * 3; ++g) {
    float amax = 0;
    for (int64_t i = g * 32; i < g * 32 + 32; ++i) amax = std::max(amax, std::fabs(w.ptr<float>()[i]));
    for (int64_t i = g * 32; i < g * 32 + 32; ++i) {
      const float x = w.ptr<float>()[i], y = d.ptr<float>()[i];
      EXPECT_LE(std::fabs(x - y), amax / 4 + 1e-30f) << i;  // half a step of e2m1 at the group's scale, at most
      const uint8_t byte = q.ptr<uint8_t>()[i / 2];
      EXPECT_EQ(y, f4e2m1_to_f32((i & 1) ? byte >> 4 : byte & 15) * ue8m0_to_f32(s.ptr<uint8_t>()[g])) << i;
    }
  }
  EXPECT_THROW(quantize_fp4(test::randn({4, 40}, DType::f32, rng)), Error);  // not a multiple of 32
}

TEST(QuantGemm, Fp4TileEveryIsaMatchesDouble) {
  std::mt19937_64 rng(4);
  struct Dims {
    int64_t m, n, k;
  };
  for (const Dims d : {Dims{1, 9, 64}, Dims{6, 130, 160}, Dims{13, 7, 32}}) {
    std::vector<uint8_t> w(size_t(d.n * d.k / 2)), sc(size_t(d.n * d.k / 32));
    for (auto& b : w) b = uint8_t(rng());
    for (auto& v : sc) v = uint8_t(120 + rng() % 12);
    Tensor x = test::randn({d.m, d.k}, DType::f32, rng, 2.0);
    const int64_t kp = cpu::fp8_row_k(d.k), kb = kp / 128;
    for (const bool quantized : {true, false}) {
      std::vector<double> qa(size_t(d.m * kp));
      std::vector<float> sa(size_t(d.m * kb));
      if (quantized)
        cpu::fp8_quantize_rows(x.ptr<float>(), d.k, d.m, d.k, true, qa.data(), kp, sa.data(), kb);
      else
        cpu::plain_rows(x.ptr<float>(), d.k, d.m, d.k, qa.data(), kp, sa.data(), kb);
      for (const cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512}) {
        if (!cpu::isa_supported(isa)) continue;
        cpu::set_isa_override(isa);
        std::vector<float> c(size_t(d.m * d.n), NAN);
        std::vector<double> work(size_t(cpu::fp8_work_doubles(d.k)));
        const cpu::Fp4Matrix wm{w.data(), sc.data(), d.n, d.k, quantized ? 0x1p-9 : 1.0};
        cpu::gemm_kernels().gemm_fp4_tile(qa.data(), kp, sa.data(), kb, d.m, wm, 0, d.n, c.data(), d.n, work.data());
        cpu::clear_isa_override();
        for (int64_t i = 0; i < d.m; ++i)
          for (int64_t j = 0; j < d.n; ++j) {
            double ref = 0;
            for (int64_t k = 0; k < d.k; ++k) {
              const uint8_t byte = w[size_t((j * d.k + k) / 2)];
              const double wv = f4e2m1_to_f32(k & 1 ? byte >> 4 : byte & 15) * ue8m0_to_f32(sc[size_t((j * d.k + k) / 32)]);
              const double av = quantized ? qa[size_t(i * kp + k)] / 512.0 * sa[size_t(i * kb + k / 128)] : x.ptr<float>()[i * d.k + k];
              ref += av * wv;
            }
            ASSERT_LE(std::fabs(double(c[size_t(i * d.n + j)]) - ref), 1e-6 * std::fabs(ref) + 1e-30)
                << cpu::isa_name(isa) << " quantized=" << quantized << " (" << i << ", " << j << ")";
          }
      }
    }
  }
}

TEST(QuantExperts, Fp4EveryCpuBackendAndIsaMatchesTheReference) {
  struct Case {
    ProblemConfig c;
    bool float_acts;
  };
  const std::vector<Case> cases = {
      {{.T = 5, .E = 3, .K = 2, .H = 64, .I = 32}, false},                          // w4a8 (FP4 with UE8M0 scales)
      {{.T = 9, .E = 5, .K = 3, .H = 160, .I = 96, .sentinels = true}, false},      // partial activation groups
      {{.T = 7, .E = 5, .K = 2, .H = 96, .I = 64, .has_bias = true, .concatenated = false,
        .gate = GateKind::clamped_swiglu, .limit = 7.0f},
       true},                                                                       // MXFP4 (gpt-oss): float acts
      {{.act = DType::bf16, .rwt = DType::bf16, .T = 12, .E = 3, .K = 2, .H = 128, .I = 32, .has_bias = true,
        .concatenated = false, .gate = GateKind::clamped_swiglu, .limit = 7.0f},
       true},
      {{.T = 33, .E = 7, .K = 2, .H = 64, .I = 96, .has_gate = false, .empty_experts = true}, false},
  };
  int checked = 0;
  for (const cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512}) {
    if (!cpu::isa_supported(isa)) continue;
    cpu::set_isa_override(isa);
    uint64_t seed = 300;
    double worst = 0;
    for (const Case& cs : cases) {
      const test::ExpertsProblem p = test::make_fp4_case(cs.c, seed++, cs.float_acts);
      ASSERT_TRUE(p.experts.is_quantized());
      for (const char* name : {"eager", "batched_mm", "grouped_mm"}) {
        const Tensor out = test::run_backend(p.experts, name, p.hidden_states, p.top_k_index, p.top_k_weights);
        const double err = relative_l2(out.view(), p.reference);
        EXPECT_LT(err, experts_tolerance(cs.c.act)) << cpu::isa_name(isa) << " " << name << " " << cs.c.to_string()
                                                    << (cs.float_acts ? " float acts" : " fp8 acts");
        if (cs.c.act == DType::f32) worst = std::max(worst, err);
        ++checked;
      }
    }
    cpu::clear_isa_override();
    std::printf("ISA %s: FP4 worst relative L2 with f32 activations %.3g\n", cpu::isa_name(isa), worst);
  }
  EXPECT_GT(checked, 0);
  // Float activations are not the FP8-quantized ones: the reference tells them apart.
  test::ExpertsProblem a = test::make_fp4_case(cases[0].c, 7, false), b = test::make_fp4_case(cases[0].c, 7, true);
  EXPECT_GT(relative_l2(a.reference, b.reference), 1e-4);
  const Experts deq(b.experts.spec(), dequantize_experts(b.experts.spec(), b.experts.weights(), DType::f32), "eager");
  const Tensor out = test::run_backend(deq, "grouped_mm", b.hidden_states, b.top_k_index, b.top_k_weights);
  EXPECT_LT(relative_l2(out.view(), b.reference), 1e-5);  // MXFP4 as transformers runs it: the dequantized weights
}

// The reference is not the float experts' one: the quantisation of weights and activations shows (so a backend that
// skipped it would fail), and the dequantized float experts stay close.
TEST(QuantExperts, ReferenceQuantizesActivationsAndDequantizeRunsInFloat) {
  ProblemConfig c{.T = 6, .E = 3, .K = 2, .H = 200, .I = 136};
  const test::ExpertsProblem p = make_fp8_problem(c, 42, DType::f32);
  const Experts deq(p.experts.spec(), dequantize_experts(p.experts.spec(), p.experts.weights(), DType::f32), "eager");
  EXPECT_FALSE(deq.is_quantized());
  const std::vector<double> fref = reference_forward(deq, p.hidden_states, p.top_k_index, p.top_k_weights);
  const double gap = relative_l2(fref, p.reference);
  EXPECT_GT(gap, 1e-4);  // activation quantisation: a few percent
  EXPECT_LT(gap, 0.1);
  const Tensor out = test::run_backend(deq, "grouped_mm", p.hidden_states, p.top_k_index, p.top_k_weights);
  EXPECT_LT(relative_l2(out.view(), fref), 1e-5);
}

TEST(QuantExperts, BadFp8WeightsAreClearErrors) {
  ProblemConfig c{.T = 2, .E = 3, .K = 1, .H = 32, .I = 24};
  const test::ExpertsProblem p = make_fp8_problem(c, 5, DType::f32);
  const ExpertsSpec& s = p.experts.spec();
  auto expect_error = [&](ExpertsWeights w, const std::string& needle) {
    try {
      Experts e(s, w, "eager");
      ADD_FAILURE() << "no error; expected one naming " << needle;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
  };
  ExpertsWeights w = p.experts.weights();
  w.down_proj_scale_inv = Tensor();
  expect_error(w, "down_proj_scale_inv");
  w = p.experts.weights();
  w.gate_up_proj_scale_inv = Tensor::zeros({3, 1, 1}, DType::f32);
  expect_error(w, "gate_up_proj_scale_inv' has shape [3, 1, 1], expected [3, 2, 1]");
  w = p.experts.weights();
  w.down_proj = Tensor::copy_of(w.down_proj.view(), Device::cpu());
  w.down_proj.ptr<uint8_t>()[17] = 0xff;
  expect_error(w, "NaN at flat index 17");
  w = p.experts.weights();
  w.down_proj_scale_inv = Tensor::copy_of(w.down_proj_scale_inv.view(), Device::cpu());
  w.down_proj_scale_inv.ptr<float>()[1] = -1.0f;
  expect_error(w, "scale -1");
  ExpertsSpec ts = s;
  ts.is_transposed = true;
  EXPECT_THROW(Experts(ts, p.experts.weights(), "eager"), Error);
  ExpertsWeights f = dequantize_experts(s, p.experts.weights(), DType::f32);
  f.down_proj_scale_inv = p.experts.weights().down_proj_scale_inv;
  expect_error(f, "not FP8");
  // A backend that has no kernel for them says so (deepgemm: CUDA only, bf16 / f16).
  const Support sup = ExpertsInterface::global().get("deepgemm")->supports(p.experts, DType::bf16);
  EXPECT_FALSE(sup.ok);
}

// On a GPU the CUDA backends with a quantized path (grouped_mm, batched_mm, deepgemm) take FP4 experts; the others
// refuse them with the reason and say what to use (the CUDA FP4 tests: tests/test_cuda_quant.cpp).
TEST(QuantExperts, CudaBackendsTakeFp4ExpertsOrRefuseThemWithAReason) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const test::ExpertsProblem p = test::make_fp4_case({.T = 3, .E = 3, .K = 1, .H = 64, .I = 32}, 8, false);
  const Experts g = p.experts.to(Device::cuda(0));
  for (const auto& b : ExpertsInterface::global().backends()) {
    const std::string name(b->name());
    const Support s = b->supports(g, DType::bf16);
    EXPECT_EQ(s.ok, name == "grouped_mm" || name == "batched_mm" || name == "deepgemm") << name << ": " << s.reason;
  }
  const Support s = ExpertsInterface::global().get("eager")->supports(g, DType::bf16);
  EXPECT_NE(s.reason.find("quantized"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("dequantize"), std::string::npos) << s.reason;
}

}  // namespace
}  // namespace moekit

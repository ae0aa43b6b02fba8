// The bf16 dot-pair GEMM (AVX512-BF16 and AMX tiles over packed weights) against a double reference: odd sizes,
// k not a multiple of the 32-wide tile, both weight layouts, row counts on both sides of the AMX threshold,
// column tiles that split panels; outputs poisoned, inputs random (never zeros).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "base/gemm.h"
#include "moekit/dtype.h"

using namespace moekit;

namespace {

std::vector<cpu::Isa> bf16_isas() {
  std::vector<cpu::Isa> out;
  for (const cpu::Isa isa : {cpu::Isa::avx512bf16, cpu::Isa::amx}) {
    if (cpu::isa_supported(isa))
      out.push_back(isa);
    else
      std::printf("ISA %s: NOT SUPPORTED on this CPU (not tested here)\n", cpu::isa_name(isa));
  }
  return out;
}

struct Problem {
  int64_t m, n, k;
  bool transposed;
  std::vector<uint16_t> a, w;  // a [m, kp] (zero past k), w [n, k] or [k, n]
  std::vector<uint16_t> packed;
  int64_t kp;

  Problem(int64_t m_, int64_t n_, int64_t k_, bool tr, std::mt19937_64& rng) : m(m_), n(n_), k(k_), transposed(tr) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    kp = cpu::packed_bf16_k(k);
    a.assign(size_t(m * kp), 0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < k; ++j) a[size_t(i * kp + j)] = f32_to_bf16(dist(rng));
    w.resize(size_t(n * k));
    for (auto& v : w) v = f32_to_bf16(dist(rng));
    packed.assign(size_t(cpu::packed_bf16_elems(n, k)), 0xFFFF);  // NaN: packing must write every element
    cpu::pack_bf16(weight(), packed.data());
  }
  cpu::WeightMatrix weight() const { return {w.data(), cpu::WType::bf16, n, k, transposed}; }
  cpu::PackedBf16 pack() const { return {packed.data(), n, k, kp}; }
  float wat(int64_t j, int64_t kk) const {
    return bf16_to_f32(transposed ? w[size_t(kk * n + j)] : w[size_t(j * k + kk)]);
  }
  // Reference value and the sum of |products| (the scale of an f32 accumulation's error).
  void reference(int64_t i, int64_t j, double& value, double& scale) const {
    value = scale = 0;
    for (int64_t kk = 0; kk < k; ++kk) {
      const double p = double(bf16_to_f32(a[size_t(i * kp + kk)])) * double(wat(j, kk));
      value += p;
      scale += std::fabs(p);
    }
  }
};

struct Dims {
  int64_t m, n, k;
};
// m < 8 runs the AVX512-BF16 tile under amx too; 8..: AMX with 16-row tails; k crosses the 32 tile and the passes.
const Dims kDims[] = {{1, 1, 1},     {1, 37, 33},  {2, 16, 32},   {3, 130, 47},  {5, 33, 130},  {7, 129, 600},
                      {8, 16, 31},   {9, 50, 65},  {16, 32, 64},  {17, 17, 257}, {31, 100, 96}, {33, 45, 513},
                      {47, 161, 70}, {64, 64, 1030}, {100, 48, 300}, {130, 129, 33},
                      // k in several chunks on the amx tile (rows of A and two panel pairs over half of L2)
                      {96, 72, 4200}, {200, 40, 2100},
                      // decode sizes: 5-13 panels read in lockstep, 4-6 rows in k chunks with the stream ahead
                      {1, 120, 4100}, {2, 250, 700}, {4, 200, 300}, {6, 129, 1030}};

}  // namespace

TEST(CpuGemmBf16, PackedLayout) {
  std::mt19937_64 rng(7);
  for (const bool tr : {false, true}) {
    const Problem p(1, 19, 37, tr, rng);
    for (int64_t j = 0; j < 32; ++j)
      for (int64_t kk = 0; kk < p.kp; ++kk) {
        const uint16_t got = p.packed[size_t((j / 16) * p.kp * 16 + (kk / 2) * 32 + (j % 16) * 2 + kk % 2)];
        const uint16_t want = j < p.n && kk < p.k ? (tr ? p.w[size_t(kk * p.n + j)] : p.w[size_t(j * p.k + kk)]) : 0;
        ASSERT_EQ(got, want) << "j=" << j << " k=" << kk << (tr ? " [K,N]" : " [N,K]");
      }
  }
}

TEST(CpuGemmBf16, EveryBf16IsaMatchesDouble) {
  std::mt19937_64 rng(11);
  for (const cpu::Isa isa : bf16_isas()) {
    cpu::set_isa_override(isa);
    const cpu::GemmKernels& kern = cpu::gemm_kernels();
    ASSERT_EQ(kern.isa, isa);
    ASSERT_NE(kern.gemm_bf16_tile, nullptr);
    for (const Dims d : kDims)
      for (const bool tr : {false, true}) {
        const Problem p(d.m, d.n, d.k, tr, rng);
        const int64_t ldc = d.n + 3;  // C rows with a gap that must stay poisoned
        std::vector<float> c(size_t(d.m * ldc), NAN);
        cpu::gemm_bf16(kern, p.a.data(), p.kp, d.m, p.pack(), c.data(), ldc);
        int bad = 0;
        for (int64_t i = 0; i < d.m; ++i) {
          for (int64_t j = 0; j < d.n; ++j) {
            double ref, scale;
            p.reference(i, j, ref, scale);
            const double got = c[size_t(i * ldc + j)];
            // Products are exact in f32; the f32 sums round at most k times.
            if (!(std::fabs(got - ref) <= 1e-6 * scale * double(d.k + 1) + 1e-30) && bad++ < 3)
              ADD_FAILURE() << cpu::isa_name(isa) << " m=" << d.m << " n=" << d.n << " k=" << d.k
                            << (tr ? " [K,N]" : " [N,K]") << " C[" << i << ", " << j << "] = " << got << ", want "
                            << ref;
          }
          for (int64_t j = d.n; j < ldc; ++j) EXPECT_TRUE(std::isnan(c[size_t(i * ldc + j)])) << "wrote past n";
        }
        // Tiles on 16-column boundaries give the same bits as the whole product, and touch only their columns.
        std::vector<float> c2(size_t(d.m * ldc), NAN);
        for (int64_t n0 = 0; n0 < d.n; n0 += 48) {
          const int64_t n1 = std::min(d.n, n0 + 48);
          kern.gemm_bf16_tile(p.a.data(), p.kp, d.m, p.pack(), n0, n1, c2.data(), ldc);
          for (int64_t i = 0; i < d.m; ++i)
            for (int64_t j = n1; j < ldc; ++j) ASSERT_TRUE(std::isnan(c2[size_t(i * ldc + j)])) << "tile wrote past n1";
        }
        for (int64_t i = 0; i < d.m; ++i)
          EXPECT_EQ(std::memcmp(c.data() + i * ldc, c2.data() + i * ldc, size_t(d.n) * 4), 0)
              << cpu::isa_name(isa) << " m=" << d.m << " n=" << d.n << " k=" << d.k << ": tiling changed bits";
        // The rows of a product do not depend on the rows computed with them (m >= the AMX threshold).
        if (d.m > cpu::kAmxMinRows + 1) {
          std::vector<float> c3(size_t(d.m * ldc), NAN);
          const int64_t half = cpu::kAmxMinRows + (d.m - cpu::kAmxMinRows) / 2;
          cpu::gemm_bf16(kern, p.a.data(), p.kp, half, p.pack(), c3.data(), ldc);
          EXPECT_EQ(std::memcmp(c.data(), c3.data(), size_t(half * ldc - 3) * 4), 0)
              << cpu::isa_name(isa) << " m=" << d.m << ": rows depend on the row count";
        }
      }
    cpu::clear_isa_override();
  }
}

TEST(CpuGemmBf16, IsaWithoutBf16TileHasNone) {
  for (const cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512}) {
    if (!cpu::isa_supported(isa)) continue;
    cpu::set_isa_override(isa);
    EXPECT_EQ(cpu::gemm_kernels().gemm_bf16_tile, nullptr) << cpu::isa_name(isa);
    cpu::clear_isa_override();
  }
}

TEST(CpuGemmBf16, RowsToBf16RoundsLikeTheScalarConversionAndPads) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const int64_t m = 3, k = 45, lds = 50, kp = cpu::packed_bf16_k(k);
  std::vector<float> src(size_t(m * lds));
  for (auto& v : src) v = dist(rng);
  src[1] = NAN, src[2] = INFINITY, src[3] = -INFINITY, src[4] = bits_to_f32(0x3f808000u);  // a tie
  src[5] = bits_to_f32(0x3f818000u), src[6] = bits_to_f32(0x7f7fffffu), src[7] = -0.0f;
  std::vector<uint16_t> dst(size_t(m * kp), 0xABCD);
  cpu::rows_to_bf16(src.data(), lds, m, k, dst.data(), kp);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < kp; ++j) {
      const uint16_t want = j < k ? f32_to_bf16(src[size_t(i * lds + j)]) : 0;
      ASSERT_EQ(dst[size_t(i * kp + j)], want) << "row " << i << " col " << j;
    }
}

// A row stride past kp (the backends pad each activation row by a cache line) reads only the first kp values of
// each row: the padding holds NaNs, and the product has the bits of the dense-stride one.
TEST(CpuGemmBf16, PaddedRowStrideGivesTheSameBits) {
  std::mt19937_64 rng(23);
  for (const cpu::Isa isa : bf16_isas()) {
    cpu::set_isa_override(isa);
    const cpu::GemmKernels& kern = cpu::gemm_kernels();
    for (const Dims d : {Dims{5, 40, 70}, Dims{40, 50, 70}, Dims{70, 33, 1030}}) {
      const Problem p(d.m, d.n, d.k, false, rng);
      const int64_t lda = p.kp + 32;
      std::vector<uint16_t> padded(size_t(d.m * lda), 0x7FC0);  // bf16 NaN past kp
      for (int64_t i = 0; i < d.m; ++i) std::memcpy(&padded[size_t(i * lda)], &p.a[size_t(i * p.kp)], size_t(p.kp) * 2);
      std::vector<float> dense(size_t(d.m * d.n), NAN), strided(size_t(d.m * d.n), NAN);
      cpu::gemm_bf16(kern, p.a.data(), p.kp, d.m, p.pack(), dense.data(), d.n);
      cpu::gemm_bf16(kern, padded.data(), lda, d.m, p.pack(), strided.data(), d.n);
      for (size_t i = 0; i < dense.size(); ++i) ASSERT_FALSE(std::isnan(dense[i])) << cpu::isa_name(isa);
      EXPECT_EQ(std::memcmp(dense.data(), strided.data(), dense.size() * 4), 0)
          << cpu::isa_name(isa) << " m=" << d.m << ": the row stride changed bits";
    }
    cpu::clear_isa_override();
  }
}

// The AVX-512 SiLU gate against the scalar expression it replaces (bf16 rounding of g and u, silu in f32 with expf,
// rounded, times u, rounded): random values over many magnitudes and the special ones (0, -0, subnormals, inf, NaN,
// past the exp's ends), I not a multiple of 16, output poisoned past I. Bits equal but for rare one-step ties of
// the exp (about 2 ulp of expf), and never more than one bf16 step apart.
TEST(CpuGemmBf16, SiluGateMatchesTheScalarExpression) {
  if (!cpu::isa_supported(cpu::Isa::avx512bf16)) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-30, 30);
  const float specials[] = {0.0f, -0.0f, 1e-40f, -1e-40f, INFINITY, -INFINITY, NAN, -NAN, 88.0f, 89.5f, -88.0f,
                            -90.0f, -104.5f, 110.0f, 3e38f, -3e38f, 1e-30f, 17.0f, -17.0f};
  int64_t total = 0, differ = 0;
  for (const int64_t I : {int64_t(1), int64_t(15), int64_t(16), int64_t(77), int64_t(4096)}) {
    std::vector<float> h(size_t(2 * I));
    for (auto& v : h) v = std::ldexp(mant(rng), expo(rng) / 4);
    for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]) && i < h.size(); ++i) h[(i * 7) % h.size()] = specials[i];
    std::vector<uint16_t> out(size_t(I + 8), 0xBEEF);
    cpu::silu_mul_bf16_row_avx512(h.data(), I, out.data());
    for (int64_t j = 0; j < I; ++j) {
      const float g = bf16_to_f32(f32_to_bf16(h[size_t(j)])), u = bf16_to_f32(f32_to_bf16(h[size_t(I + j)]));
      const float s = bf16_to_f32(f32_to_bf16(g / (1.0f + std::exp(-g))));
      const uint16_t want = f32_to_bf16(s * u), got = out[size_t(j)];
      ++total;
      if (want == got) continue;
      ++differ;
      const bool both_nan = std::isnan(bf16_to_f32(want)) && std::isnan(bf16_to_f32(got));
      EXPECT_TRUE(both_nan || std::abs(int(want) - int(got)) == 1)
          << "I=" << I << " j=" << j << " g=" << g << " u=" << u << " want " << want << " got " << got;
    }
    for (int64_t j = I; j < I + 8; ++j) EXPECT_EQ(out[size_t(j)], 0xBEEF) << "written past I at " << j;
  }
  std::printf("%lld of %lld gated values one bf16 step from the scalar expression\n", (long long)differ, (long long)total);
  EXPECT_LE(differ * 1000, total) << differ << " of " << total << " differ";
}

// The AVX-512 combine step against acc += bf16(w * y) in scalar code: the same bits (NaN and inf included), nothing
// written past n.
TEST(CpuGemmBf16, Bf16ProductSumsMatchTheScalarExpression) {
  if (!cpu::isa_supported(cpu::Isa::avx512bf16)) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (const int64_t n : {int64_t(1), int64_t(17), int64_t(2048)}) {
    std::vector<float> y(static_cast<size_t>(n)), acc(static_cast<size_t>(n + 4)), want;
    for (auto& v : y) v = dist(rng);
    if (n > 1) y[0] = NAN;
    if (n > 2) y[2] = INFINITY;
    for (auto& v : acc) v = dist(rng);
    acc[size_t(n)] = 123.0f;
    want = acc;
    const float w = bf16_to_f32(f32_to_bf16(std::abs(dist(rng))));
    for (int64_t j = 0; j < n; ++j) want[size_t(j)] += bf16_to_f32(f32_to_bf16(w * y[size_t(j)]));
    cpu::add_bf16_products_avx512(acc.data(), y.data(), w, n);
    for (int64_t j = 0; j <= n; ++j) {
      if (std::isnan(want[size_t(j)])) {
        EXPECT_TRUE(std::isnan(acc[size_t(j)])) << "n=" << n << " j=" << j;
        continue;
      }
      uint32_t a, b;
      std::memcpy(&a, &acc[size_t(j)], 4);
      std::memcpy(&b, &want[size_t(j)], 4);
      EXPECT_EQ(a, b) << "n=" << n << " j=" << j;
    }
  }
}

// The in-place bf16 rounding of the down projection's rows (AVX-512) gives the scalar conversion's bits: ties to even,
// NaN quieted with its payload's top bits, infinities and the largest finite values, and the rows' tails (n % 16),
// nothing past n touched.
TEST(CpuGemmBf16, InPlaceBf16RoundingMatchesTheScalarConversion) {
  if (!cpu::isa_supported(cpu::Isa::avx512bf16)) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_int_distribution<uint32_t> bits;
  for (const int64_t n : {int64_t(1), int64_t(15), int64_t(16), int64_t(33), int64_t(2048)}) {
    std::vector<float> x(static_cast<size_t>(n + 3));
    for (auto& v : x) {
      const uint32_t b = bits(rng);
      std::memcpy(&v, &b, 4);
    }
    const uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                                 0x7f800001u, 0xffbfffffu, 0x7f7fffffu, 0x00008000u, 0x80018000u};
    for (size_t i = 0; i < std::size(specials) && i < size_t(n); ++i) std::memcpy(&x[i], &specials[i], 4);
    std::vector<uint32_t> want(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      if (int64_t(i) < n) {
        const float r = bf16_to_f32(f32_to_bf16(x[i]));
        std::memcpy(&want[i], &r, 4);
      } else {
        std::memcpy(&want[i], &x[i], 4);  // past n: unchanged
      }
    }
    cpu::round_bf16_in_place_avx512(x.data(), n);
    for (size_t i = 0; i < x.size(); ++i) {
      uint32_t got;
      std::memcpy(&got, &x[i], 4);
      EXPECT_EQ(got, want[i]) << "n=" << n << " i=" << i << " want " << std::hex << want[i];
    }
  }
}

// The model's CPU layer ops against straightforward double-precision loops, on odd shapes, strided
// inputs, low-precision weights and NaN-poisoned outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "model/ops.h"
#include "test_argmax_case.h"
#include "test_util.h"

using namespace moekit;
using model::DeviceOps;

namespace {

const DeviceOps& cpu() { return *model::cpu_ops(); }

std::vector<double> as_f64(const TensorView& v) {
  std::vector<double> out(size_t(v.numel()));
  for (int64_t i = 0; i < v.numel(); ++i) out[size_t(i)] = load_as_f64(v.data, v.dtype, i);
  return out;
}

double rel_err(const Tensor& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = load_as_f64(got.data(), got.dtype(), i);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - ref[size_t(i)]) * (g - ref[size_t(i)]);
    den += ref[size_t(i)] * ref[size_t(i)];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

TEST(ModelOps, LinearMatchesDoubleReference) {
  std::mt19937_64 rng(11);
  struct Case {
    int64_t M, K, N;
  };
  for (const Case c : {Case{1, 7, 5}, Case{3, 33, 17}, Case{4, 64, 16}, Case{9, 130, 37}, Case{70, 19, 33},
                       Case{130, 96, 160}}) {
    for (DType wt : {DType::f32, DType::bf16, DType::f16}) {
      for (bool bias : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "M=" << c.M << " K=" << c.K << " N=" << c.N << " w " << dtype_name(wt)
                                          << " bias " << bias);
        // x is a column window of a wider matrix: a row stride of K + 3.
        Tensor wide = test::randn({c.M, c.K + 3}, DType::f32, rng);
        const TensorView x = model::columns(wide.view(), 2, c.K);
        Tensor w = test::randn({c.N, c.K}, wt, rng), b = test::randn({c.N}, DType::f32, rng);
        Tensor y = Tensor::empty({c.M, c.N}, DType::f32);
        test::poison(y);
        cpu().linear(x, w.view(), bias ? b.view() : TensorView(), y.view());
        const auto wf = as_f64(w.view()), bf = as_f64(b.view()), xf = as_f64(wide.view());
        std::vector<double> ref(size_t(c.M * c.N));
        for (int64_t m = 0; m < c.M; ++m)
          for (int64_t n = 0; n < c.N; ++n) {
            double s = bias ? bf[size_t(n)] : 0.0;
            for (int64_t k = 0; k < c.K; ++k) s += xf[size_t(m * (c.K + 3) + 2 + k)] * wf[size_t(n * c.K + k)];
            ref[size_t(m * c.N + n)] = s;
          }
        EXPECT_LT(rel_err(y, ref), 1e-5);
      }
    }
  }
}

TEST(ModelOps, LinearWritesLowPrecisionOutputs) {
  std::mt19937_64 rng(12);
  Tensor x = test::randn({6, 40}, DType::bf16, rng), w = test::randn({21, 40}, DType::bf16, rng);
  Tensor y = Tensor::empty({6, 21}, DType::bf16), y32 = Tensor::empty({6, 21}, DType::f32);
  test::poison(y);
  cpu().linear(x.view(), w.view(), TensorView(), y.view());
  cpu().linear(x.view(), w.view(), TensorView(), y32.view());
  EXPECT_LT(rel_err(y, as_f64(y32.view())), 5e-3);
}

// softmax(q k^T * scale) v with a causal window and optional sinks, in double.
std::vector<double> attention_ref(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, double scale,
                                  int64_t window, const std::vector<double>& sinks) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), Dv = v.size(2);
  const auto qf = as_f64(q.view()), kf = as_f64(k.view()), vf = as_f64(v.view());
  std::vector<double> out(size_t(T * Hq * Dv), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv), pos = pos0 + t;
      std::vector<double> s;
      std::vector<int64_t> keys;
      for (int64_t j = 0; j <= pos; ++j) {
        if (window > 0 && j <= pos - window) continue;
        double d = 0;
        for (int64_t i = 0; i < D; ++i) d += qf[size_t((t * Hq + h) * D + i)] * kf[size_t((j * Hkv + g) * D + i)];
        s.push_back(d * scale);
        keys.push_back(j);
      }
      double mx = -INFINITY;
      for (double x : s) mx = std::max(mx, x);
      if (!sinks.empty()) mx = std::max(mx, sinks[size_t(h)]);
      double den = sinks.empty() ? 0.0 : std::exp(sinks[size_t(h)] - mx);
      for (double x : s) den += std::exp(x - mx);
      for (size_t a = 0; a < s.size(); ++a) {
        const double p = std::exp(s[a] - mx) / den;
        for (int64_t i = 0; i < Dv; ++i)
          out[size_t((t * Hq + h) * Dv + i)] += p * vf[size_t((keys[a] * Hkv + g) * Dv + i)];
      }
    }
  return out;
}

TEST(ModelOps, AttentionWithWindowsAndSinks) {
  std::mt19937_64 rng(13);
  const int64_t T = 5, pos0 = 4, S = pos0 + T, Hq = 6, Hkv = 2, D = 12, Dv = 7;
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t window : {0, 1, 3, 100}) {
      for (bool with_sinks : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " window " << window << " sinks " << with_sinks);
        Tensor q = test::randn({T, Hq, D}, t, rng), k = test::randn({S, Hkv, D}, t, rng);
        Tensor v = test::randn({S, Hkv, Dv}, t, rng), sinks = test::randn({Hq}, DType::f32, rng);
        Tensor out = Tensor::empty({T, Hq, Dv}, DType::f32);
        test::poison(out);
        cpu().attention(q.view(), k.view(), v.view(), out.view(), model::Position{pos0}, 0.37f, window,
                        with_sinks ? sinks.view() : TensorView());
        const auto ref = attention_ref(q, k, v, pos0, 0.37, window,
                                       with_sinks ? as_f64(sinks.view()) : std::vector<double>{});
        EXPECT_LT(rel_err(out, ref), 1e-5);
      }
    }
  }
  Tensor q = Tensor::zeros({T, Hq, D}, DType::f32), k = Tensor::zeros({S - 1, Hkv, D}, DType::f32);
  Tensor out = Tensor::empty({T, Hq, D}, DType::f32);
  EXPECT_THROW(cpu().attention(q.view(), k.view(), k.view(), out.view(), model::Position{pos0}, 1.0f, 0, TensorView()), Error);
}

TEST(ModelOps, RopeHalvesAndInterleavedPairs) {
  std::mt19937_64 rng(14);
  RopeConfig rc;
  rc.theta = 500.0;
  model::RopeSpec spec = model::make_rope(rc, 8, 256);
  ASSERT_EQ(spec.rot_dim(), 8);
  const int64_t T = 3, NH = 2, S = 11, off = 3, pos0 = 5;
  for (bool interleaved : {false, true}) {
    spec.interleaved = interleaved;
    Tensor x = test::randn({T, NH, S}, DType::f32, rng);
    const auto before = as_f64(x.view());
    cpu().rope(x.view(), off, model::Position{pos0}, spec);
    std::vector<double> ref = before;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NH; ++h) {
        const double* in = before.data() + (t * NH + h) * S + off;
        double* o = ref.data() + (t * NH + h) * S + off;
        for (int64_t i = 0; i < 4; ++i) {
          const double f = double(pos0 + t) * std::pow(500.0, -double(2 * i) / 8.0);
          const double x1 = interleaved ? in[2 * i] : in[i], x2 = interleaved ? in[2 * i + 1] : in[i + 4];
          o[i] = x1 * std::cos(f) - x2 * std::sin(f);
          o[i + 4] = x2 * std::cos(f) + x1 * std::sin(f);
        }
      }
    EXPECT_LT(rel_err(x, ref), 1e-5) << "interleaved " << interleaved;
  }
}

// The decode step's attention inputs: per-head norms, rotary on the first rot_dim dims, then the keys and values
// at cache rows [pos0, pos0 + T), against a double loop; other cache rows untouched; bad operands refused.
TEST(ModelOps, QkNormRopeCacheMatchesDoubleReference) {
  std::mt19937_64 rng(15);
  RopeConfig rc;
  rc.theta = 500.0;
  const model::RopeSpec spec = model::make_rope(rc, 8, 256);
  const int64_t T = 2, Hq = 4, Hkv = 2, D = 12, S = 7, pos0 = 3, half = 4;
  const double eps = 1e-6;
  for (bool norm : {false, true}) {
    SCOPED_TRACE(norm ? "norms" : "no norms");
    Tensor q = test::randn({T, Hq, D}, DType::f32, rng), k = test::randn({T, Hkv, D}, DType::f32, rng);
    const Tensor v = test::randn({T, Hkv, D}, DType::f32, rng);
    const Tensor qw = test::randn({D}, DType::f32, rng), kw = test::randn({D}, DType::f32, rng);
    Tensor kc = test::randn({S, Hkv, D}, DType::f32, rng), vc = test::randn({S, Hkv, D}, DType::f32, rng);
    const auto q0 = as_f64(q.view()), k0 = as_f64(k.view()), kc0 = as_f64(kc.view()), vc0 = as_f64(vc.view());
    const auto v0 = as_f64(v.view()), qw0 = as_f64(qw.view()), kw0 = as_f64(kw.view());
    cpu().qk_norm_rope_cache(q.view(), k.view(), v.view(), norm ? qw.view() : TensorView(),
                             norm ? kw.view() : TensorView(), float(eps), false, model::Position{pos0}, spec,
                             kc.view(), vc.view());
    auto head = [&](const double* in, const std::vector<double>& w, int64_t t, double* o) {
      std::vector<double> x(in, in + D);
      if (norm) {
        double ss = 0;
        for (double e : x) ss += e * e;
        const double inv = 1.0 / std::sqrt(ss / double(D) + eps);
        for (int64_t i = 0; i < D; ++i) x[size_t(i)] = w[size_t(i)] * x[size_t(i)] * inv;
      }
      std::copy(x.begin(), x.end(), o);
      for (int64_t i = 0; i < half; ++i) {
        const double f = double(pos0 + t) * std::pow(500.0, -double(2 * i) / 8.0);
        o[i] = x[size_t(i)] * std::cos(f) - x[size_t(i + half)] * std::sin(f);
        o[i + half] = x[size_t(i + half)] * std::cos(f) + x[size_t(i)] * std::sin(f);
      }
    };
    std::vector<double> rq(q0.size()), rk(k0.size()), rkc = kc0, rvc = vc0;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < Hq; ++h) head(q0.data() + (t * Hq + h) * D, qw0, t, rq.data() + (t * Hq + h) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        head(k0.data() + (t * Hkv + h) * D, kw0, t, rk.data() + (t * Hkv + h) * D);
        for (int64_t i = 0; i < D; ++i) {
          rkc[size_t(((pos0 + t) * Hkv + h) * D + i)] = rk[size_t((t * Hkv + h) * D + i)];
          rvc[size_t(((pos0 + t) * Hkv + h) * D + i)] = v0[size_t((t * Hkv + h) * D + i)];
        }
      }
    }
    EXPECT_LT(rel_err(q, rq), 1e-5);
    EXPECT_LT(rel_err(k, rk), 1e-5);
    EXPECT_LT(rel_err(kc, rkc), 1e-5);
    EXPECT_EQ(as_f64(vc.view()), rvc);
    for (int64_t i = 0; i < pos0 * Hkv * D; ++i) ASSERT_EQ(as_f64(kc.view())[size_t(i)], kc0[size_t(i)]);
  }
  Tensor q = test::randn({1, 4, 8}, DType::f32, rng), k = test::randn({1, 2, 8}, DType::f32, rng);
  Tensor kc = test::randn({4, 2, 8}, DType::f32, rng), w = test::randn({6}, DType::f32, rng);
  const model::RopeSpec wide = model::make_rope(rc, 10, 256);
  auto call = [&](const TensorView& kk, const TensorView& qn, int64_t pos, const model::RopeSpec& r) {
    cpu().qk_norm_rope_cache(q.view(), kk, kk, qn, {}, 1e-6f, false, model::Position{pos}, r, kc.view(), kc.view());
  };
  EXPECT_NE(test::error_of([&] { call(k.view(), {}, 4, spec); }).find("out of range"), std::string::npos);
  EXPECT_NE(test::error_of([&] { call(q.view(), {}, 0, spec); }).find("do not match"), std::string::npos);
  EXPECT_NE(test::error_of([&] { call(k.view(), w.view(), 0, spec); }).find("q norm weight"), std::string::npos);
  EXPECT_NE(test::error_of([&] { call(k.view(), {}, 0, wide); }).find("rotated dims"), std::string::npos);
}

TEST(ModelOps, RmsNormAndRouters) {
  std::mt19937_64 rng(15);
  Tensor x = test::randn({5, 24}, DType::f32, rng), w = test::randn({24}, DType::f32, rng);
  Tensor y = Tensor::empty({5, 24}, DType::f32);
  test::poison(y);
  cpu().rmsnorm(x.view(), w.view(), 1e-6f, false, y.view());
  const auto xf = as_f64(x.view()), wf = as_f64(w.view());
  std::vector<double> ref(xf.size());
  for (int64_t m = 0; m < 5; ++m) {
    double ss = 0;
    for (int64_t i = 0; i < 24; ++i) ss += xf[size_t(m * 24 + i)] * xf[size_t(m * 24 + i)];
    const double r = 1.0 / std::sqrt(ss / 24 + 1e-6);
    for (int64_t i = 0; i < 24; ++i) ref[size_t(m * 24 + i)] = wf[size_t(i)] * xf[size_t(m * 24 + i)] * r;
  }
  EXPECT_LT(rel_err(y, ref), 1e-6);

  // softmax top-k with renormalisation, and top-k then softmax: weights of the k best experts.
  Tensor logits = Tensor::empty({1, 4}, DType::f32);
  const float l[4] = {0.5f, 2.0f, -1.0f, 1.0f};
  std::copy(l, l + 4, logits.ptr<float>());
  Tensor idx = Tensor::empty({1, 2}, DType::i32), wts = Tensor::empty({1, 2}, DType::f32);
  model::RouterSpec rs{.kind = RouterKind::softmax_topk, .top_k = 2, .norm_topk_prob = true};
  cpu().route(logits.view(), TensorView(), rs, idx.view(), wts.view());
  EXPECT_EQ(idx.ptr<int32_t>()[0], 1);
  EXPECT_EQ(idx.ptr<int32_t>()[1], 3);
  EXPECT_NEAR(wts.ptr<float>()[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  rs.kind = RouterKind::topk_softmax;
  cpu().route(logits.view(), TensorView(), rs, idx.view(), wts.view());
  EXPECT_NEAR(wts.ptr<float>()[0] + wts.ptr<float>()[1], 1.0, 1e-6);
  EXPECT_NEAR(wts.ptr<float>()[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  // DeepSeek: only experts of the best group (by its two best biased scores) are chosen.
  Tensor l8 = Tensor::empty({1, 8}, DType::f32), bias = Tensor::zeros({8}, DType::f32);
  const float v8[8] = {3.0f, -2.0f, -2.0f, -2.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  std::copy(v8, v8 + 8, l8.ptr<float>());
  model::RouterSpec ds{.kind = RouterKind::grouped_sigmoid,
                       .top_k = 2,
                       .norm_topk_prob = true,
                       .routed_scaling_factor = 2.5f,
                       .n_group = 2,
                       .topk_group = 1};
  cpu().route(l8.view(), bias.view(), ds, idx.view(), wts.view());
  EXPECT_GE(idx.ptr<int32_t>()[0], 4);  // group 1 (1 + 1) beats group 0 (3 - 2)
  EXPECT_GE(idx.ptr<int32_t>()[1], 4);
  EXPECT_NEAR(wts.ptr<float>()[0] + wts.ptr<float>()[1], 2.5, 1e-5);
}

}  // namespace

TEST(ModelOps, ArgmaxRowsIsTheGreedySamplersChoice) {
  std::mt19937_64 rng(5);
  for (const auto& [R, V] : {std::pair<int64_t, int64_t>{1, 1}, {3, 7}, {9, 1000}, {6, 32003}}) {
    SCOPED_TRACE(::testing::Message() << "R=" << R << " V=" << V);
    const test::ArgmaxCase c = test::argmax_case(R, V, rng);
    Tensor out = Tensor::empty({R, 2}, DType::i64);
    for (int64_t i = 0; i < 2 * R; ++i) out.ptr<int64_t>()[i] = -77;
    cpu().argmax_rows(c.logits.view(), c.suppress, out.view());
    for (int64_t r = 0; r < R; ++r) {
      EXPECT_EQ(out.ptr<int64_t>()[2 * r + 1], c.expect[size_t(2 * r + 1)]) << "row " << r;
      if (c.expect[size_t(2 * r + 1)] == 1) EXPECT_EQ(out.ptr<int64_t>()[2 * r], c.expect[size_t(2 * r)]) << "row " << r;
    }
  }
  // Bad operands are refused.
  Tensor l = Tensor::empty({2, 5}, DType::f32), o = Tensor::empty({2, 2}, DType::i64), small = Tensor::empty({3}, DType::i64);
  EXPECT_THROW(cpu().argmax_rows(l.view(), {}, small.view()), Error);
  EXPECT_THROW(cpu().argmax_rows(l.view(), std::vector<int64_t>(DeviceOps::kMaxSuppress + 1, 0), o.view()), Error);
  EXPECT_THROW(cpu().argmax_rows(Tensor::empty({2, 5}, DType::bf16).view(), {}, o.view()), Error);
}

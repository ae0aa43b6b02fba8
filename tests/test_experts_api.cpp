// The Experts API around the backends: forward / forward_into / forward_with, empty input, bad ids, shape and
// dtype mismatches, non-contiguous inputs, weights the CPU backends cannot run.
#include <gtest/gtest.h>

#include <cstring>

#include "test_experts_problem.h"

using namespace moekit;
using namespace moekit::test;

namespace {

// The built-in backends that run on the CPU in this build.
std::vector<std::string> cpu_backends() {
  std::vector<std::string> out;
  for (const auto& b : backends_on(Device::cpu()))
    if (ExpertsInterface::global().is_builtin(b->name())) out.emplace_back(b->name());
  return out;
}

ExpertsProblem problem(DType act = DType::f32, int64_t T = 7, DType idt = DType::i64) {
  ProblemConfig c;
  c.act = act;
  c.wdt = DType::bf16;
  c.idt = idt;
  c.T = T;
  c.E = 8;
  c.K = 2;
  c.H = 24;
  c.I = 20;
  c.has_bias = true;
  return make_problem(c, 123);
}

void expect_error(const std::function<void()>& fn, std::initializer_list<const char*> fragments,
                  ErrorCode expected = ErrorCode::invalid_argument) {
  ErrorCode code{};
  const std::string msg = error_of(fn, &code);
  ASSERT_FALSE(msg.empty()) << "no error; expected one mentioning " << *fragments.begin();
  EXPECT_EQ(code, expected) << msg;
  for (const char* f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
}

}  // namespace

TEST(ExpertsApi, ForwardAndForwardIntoAgree) {
  for (const DType act : {DType::f32, DType::bf16, DType::f16}) {
    ExpertsProblem p = problem(act);
    for (const std::string& b : cpu_backends()) {
      p.experts.set_implementation(b);
      const Tensor out = p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights);
      EXPECT_EQ(out.shape(), p.hidden_states.shape());
      EXPECT_EQ(out.dtype(), act);
      EXPECT_LE(relative_l2(out.view(), p.reference), experts_tolerance(act)) << b;
      Tensor into = Tensor::empty(p.hidden_states.shape(), act);
      poison(into);
      p.experts.forward_into(
          ExpertsCall{p.hidden_states.view(), p.top_k_index.view(), p.top_k_weights.view(), into.view(), nullptr});
      EXPECT_EQ(std::memcmp(out.data(), into.data(), out.nbytes()), 0) << b;
    }
  }
}

TEST(ExpertsApi, ZeroTokensGiveAnEmptyOutput) {
  for (const DType idt : {DType::i32, DType::i64}) {
    ExpertsProblem p = problem(DType::bf16, 0, idt);
    for (const std::string& b : cpu_backends()) {
      p.experts.set_implementation(b);
      const Tensor out = p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights);
      EXPECT_EQ(out.shape(), (Shape{0, 24})) << b;
      EXPECT_EQ(out.dtype(), DType::bf16);
    }
  }
}

TEST(ExpertsApi, BadExpertIdsAreRejectedNamingTheValue) {
  for (const DType idt : {DType::i32, DType::i64})
    for (const int64_t bad : {int64_t(-1), int64_t(9), int64_t(1) << 40}) {
      if (idt == DType::i32 && bad > INT32_MAX) continue;
      ExpertsProblem p = problem(DType::f32, 7, idt);
      // slot [3, 1]
      if (idt == DType::i32)
        p.top_k_index.ptr<int32_t>()[7] = int32_t(bad);
      else
        p.top_k_index.ptr<int64_t>()[7] = bad;
      for (const std::string& b : cpu_backends()) {
        p.experts.set_implementation(b);
        const std::string value = "= " + std::to_string(bad);
        expect_error([&] { p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights); },
                     {"top_k_index[3, 1]", value.c_str(), "[0, 8]"});
      }
    }
  // E itself is the expert-parallel sentinel, not an error.
  ExpertsProblem p = problem();
  p.top_k_index.ptr<int64_t>()[7] = 8;
  EXPECT_NO_THROW(p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights));
}

TEST(ExpertsApi, MismatchedShapesAndDtypesAreRejectedClearly) {
  ExpertsProblem p = problem();
  const Experts& e = p.experts;
  const Tensor& x = p.hidden_states;
  const Tensor& idx = p.top_k_index;
  const Tensor& w = p.top_k_weights;
  std::mt19937_64 rng(1);
  // hidden size
  expect_error([&] { e.forward(randn({7, 25}, DType::f32, rng), idx, w); }, {"hidden size 25", "expect 24"});
  // rank
  expect_error([&] { e.forward(randn({7, 24, 1}, DType::f32, rng), idx, w); }, {"2-D", "[7, 24, 1]"});
  // index rows
  expect_error(
      [&] {
        e.forward(randn({6, 24}, DType::f32, rng), idx, w);
      },
      {"top_k_index must be [6, top_k]", "[7, 2]"});
  // routing weights shape
  expect_error([&] { e.forward(x, idx, randn({7, 3}, DType::f32, rng)); }, {"top_k_weights shape [7, 3]", "[7, 2]"});
  // dtypes
  Tensor fidx = Tensor::empty({7, 2}, DType::f32);
  fidx.fill_(1);
  expect_error([&] { e.forward(x, fidx, w); }, {"top_k_index dtype", "f32"});
  Tensor iw = Tensor::empty({7, 2}, DType::i32);
  iw.fill_(0);
  expect_error([&] { e.forward(x, idx, iw); }, {"top_k_weights dtype", "i32"});
  Tensor ix = Tensor::empty({7, 24}, DType::i32);
  ix.fill_(0);
  expect_error([&] { e.forward(ix, idx, w); }, {"hidden_states dtype", "i32"});
  // output of forward_into
  Tensor out_shape = Tensor::empty({7, 23}, DType::f32), out_dtype = Tensor::empty({7, 24}, DType::bf16);
  expect_error(
      [&] {
        e.forward_into(ExpertsCall{x.view(), idx.view(), w.view(), out_shape.view(), nullptr});
      },
      {"out shape [7, 23]"});
  expect_error(
      [&] {
        e.forward_into(ExpertsCall{x.view(), idx.view(), w.view(), out_dtype.view(), nullptr});
      },
      {"out dtype bf16", "f32"});
}

TEST(ExpertsApi, RoutingInsideTheCallIsRefusedOnTheCpuNamingTheWayOut) {
  ExpertsProblem p = problem();
  std::mt19937_64 rng(5);
  const Tensor logits = randn({7, 8}, DType::f32, rng);
  Tensor idx = Tensor::empty({7, 2}, DType::i32), w = Tensor::empty({7, 2}, DType::f32);
  Tensor out = Tensor::empty({7, 24}, DType::f32);
  const ExpertsRouting routing{logits.view(), RouterKind::softmax_topk, true};
  for (const std::string& b : cpu_backends()) {
    p.experts.set_implementation(b);
    const ExpertsCall call{p.hidden_states.view(), idx.view(), w.view(), out.view(), nullptr, &routing};
    expect_error([&] { p.experts.forward_into(call); },
                 {"routing inside the call runs on CUDA devices", "cpu", "route first"}, ErrorCode::not_supported);
  }
}

TEST(ExpertsApi, DtypeMismatchIsNotAnErrorWhereItIsDefined) {
  // Activations, weights and routing weights may differ in dtype: products accumulate in f32.
  ExpertsProblem p = problem(DType::f16);
  const Tensor w16 = p.top_k_weights.to(DType::bf16);
  const auto ref = reference_forward(p.experts, p.hidden_states, p.top_k_index, w16);
  for (const std::string& b : cpu_backends()) {
    p.experts.set_implementation(b);
    const Tensor out = p.experts.forward(p.hidden_states, p.top_k_index, w16);
    EXPECT_LE(relative_l2(out.view(), ref), experts_tolerance(DType::f16)) << b;
  }
}

TEST(ExpertsApi, NonContiguousInputsWorkInForwardAndAreRejectedByForwardInto) {
  ExpertsProblem p = problem();
  std::mt19937_64 rng(3);
  // hidden_states as every other row of a [2T, H] buffer; top_k_index / weights as column-major views.
  const int64_t T = 7, H = 24, K = 2;
  Tensor big = randn({2 * T, H}, DType::f32, rng);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(big.ptr<float>() + 2 * t * H, p.hidden_states.ptr<float>() + t * H, size_t(H) * 4);
  const TensorView xs(big.data(), DType::f32, {T, H}, Device::cpu(), {2 * H, 1});
  Tensor idx_t = Tensor::empty({K, T}, DType::i64), w_t = Tensor::empty({K, T}, DType::f32);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      idx_t.ptr<int64_t>()[k * T + t] = p.top_k_index.ptr<int64_t>()[t * K + k];
      w_t.ptr<float>()[k * T + t] = p.top_k_weights.ptr<float>()[t * K + k];
    }
  const TensorView idx_s(idx_t.data(), DType::i64, {T, K}, Device::cpu(), {1, T});
  const TensorView w_s(w_t.data(), DType::f32, {T, K}, Device::cpu(), {1, T});
  ASSERT_FALSE(xs.is_contiguous());
  ASSERT_FALSE(idx_s.is_contiguous());
  for (const std::string& b : cpu_backends()) {
    p.experts.set_implementation(b);
    const Tensor dense = p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights);
    const Tensor strided = p.experts.forward(xs, idx_s, w_s);
    EXPECT_EQ(std::memcmp(dense.data(), strided.data(), dense.nbytes()), 0) << b;
    Tensor out = Tensor::empty({T, H}, DType::f32);
    expect_error(
        [&] {
          p.experts.forward_into(ExpertsCall{xs, p.top_k_index.view(), p.top_k_weights.view(), out.view(), nullptr});
        },
        {"contiguous", "f32[7, 24]"});
    expect_error(
        [&] {
          p.experts.forward_into(
              ExpertsCall{p.hidden_states.view(), idx_s, p.top_k_weights.view(), out.view(), nullptr});
        },
        {"contiguous"});
  }
}

TEST(ExpertsApi, UnsupportedWeightsAreRefusedWithAReason) {
  ExpertsSpec s;
  s.num_experts = 2;
  s.hidden = 8;
  s.intermediate = 4;
  ExpertsWeights w;
  w.gate_up_proj = Tensor::zeros({2, 8, 8}, DType::f64);
  w.down_proj = Tensor::zeros({2, 8, 4}, DType::f64);
  const Experts e(s, w, "eager");
  for (const std::string& b : cpu_backends()) {
    const Support sup = ExpertsInterface::global().get(b)->supports(e, DType::bf16);
    EXPECT_FALSE(sup.ok) << b;
    EXPECT_NE(sup.reason.find("f64"), std::string::npos) << sup.reason;
  }
  std::mt19937_64 rng(1);
  const Tensor x = randn({3, 8}, DType::bf16, rng), idx = Tensor::zeros({3, 1}, DType::i64);
  Tensor w1 = Tensor::empty({3, 1}, DType::f32);
  w1.fill_(1);
  expect_error([&] { e.forward(x, idx, w1); }, {"eager", "f64"}, ErrorCode::not_supported);
  // FP8 weights without their block scales are refused when the module is made.
  ExpertsWeights f8;
  f8.gate_up_proj = Tensor::zeros({2, 8, 8}, DType::f8e4m3);
  f8.down_proj = Tensor::zeros({2, 8, 4}, DType::f8e4m3);
  expect_error([&] { Experts(s, f8, "eager"); }, {"gate_up_proj_scale_inv", "[2, 2, 1]"});
}

TEST(ExpertsApi, CustomGateErrorsReachTheCaller) {
  ProblemConfig c;
  c.T = 800;  // enough rows for the gate to run on several threads: the error must still come out
  c.gate = GateKind::custom;
  ExpertsProblem p = make_problem(c, 5);
  ExpertsSpec s = p.experts.spec();
  s.custom_gate = [](const float*, const float*, float*, int64_t) {
    MOEKIT_FAIL(invalid_argument, "custom gate refuses this input");
  };
  const Experts e(s, p.experts.weights(), "eager");
  for (const std::string& b : cpu_backends()) {
    Tensor out = Tensor::empty(p.hidden_states.shape(), DType::f32);
    expect_error(
        [&] {
          e.forward_with(b, ExpertsCall{p.hidden_states.view(), p.top_k_index.view(), p.top_k_weights.view(),
                                        out.view(), nullptr});
        },
        {"custom gate refuses"});
  }
}

// [E, A, B] -> [E, B, A], every dtype; twice gives the tensor back.
TEST(ExpertsApi, TransposeExpertWeight) {
  std::mt19937_64 rng(9);
  for (const DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor w = randn({3, 70, 129}, dt, rng);
    const Tensor t = transpose_expert_weight(w);
    ASSERT_EQ(t.shape(), (Shape{3, 129, 70}));
    EXPECT_EQ(t.dtype(), dt);
    for (int64_t e = 0; e < 3; ++e)
      for (int64_t a = 0; a < 70; a += 7)
        for (int64_t b = 0; b < 129; b += 5)
          ASSERT_EQ(load_as_f64(t.data(), dt, (e * 129 + b) * 70 + a), load_as_f64(w.data(), dt, (e * 70 + a) * 129 + b));
    const Tensor back = transpose_expert_weight(t);
    EXPECT_EQ(std::memcmp(back.data(), w.data(), w.nbytes()), 0) << dtype_name(dt);
  }
  EXPECT_THROW(transpose_expert_weight(Tensor::zeros({4, 4}, DType::f32)), Error);
}

// The same experts with transposed ([E, in, out]) and plain ([E, out, in]) weights give the same result
// on every backend of every device present (the CUDA backends repack the transposed ones in prepare).
TEST(ExpertsApi, TransposedAndPlainWeightsAgree) {
  const ProblemConfig c{.T = 9, .E = 4, .K = 2, .H = 40, .I = 24, .has_bias = true, .transposed = true,
                        .concatenated = false, .gate = GateKind::clamped_swiglu};
  const ExpertsProblem p = make_problem(c, 31);
  ExpertsSpec plain_spec = p.experts.spec();
  plain_spec.is_transposed = false;
  ExpertsWeights plain_w = p.experts.weights();
  plain_w.gate_up_proj = transpose_expert_weight(plain_w.gate_up_proj);
  plain_w.down_proj = transpose_expert_weight(plain_w.down_proj);
  const Experts plain(plain_spec, plain_w, "eager");
  const auto plain_ref = reference_forward(plain, p.hidden_states, p.top_k_index, p.top_k_weights);
  EXPECT_LE(relative_l2(plain_ref, p.reference), 1e-12);
  for (const Device dev : test_devices())
    for (const auto& b : backends_on(dev)) {
      if (!ExpertsInterface::global().is_builtin(b->name())) continue;
      const Tensor a = run_backend(p.experts.to(dev), b->name(), p);
      const Tensor z = run_backend(plain.to(dev), b->name(), p);
      EXPECT_LE(relative_l2(a.view(), p.reference), experts_tolerance(c.act)) << b->name() << " " << dev.to_string();
      EXPECT_LE(relative_l2(z.view(), p.reference), experts_tolerance(c.act)) << b->name() << " " << dev.to_string();
      if (dev.is_cuda())  // one kernel path for both layouts after the repack
        EXPECT_TRUE(bitwise_equal(a, z)) << b->name();
    }
}

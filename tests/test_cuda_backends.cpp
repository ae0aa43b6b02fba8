// The CUDA experts backends (eager, batched_mm, grouped_mm) against the f64 reference: a sweep of
// dtypes, token counts, experts, top-k, odd sizes, empty experts, sentinels and every flag; bad ids;
// determinism; what is rejected. Every test skips when no CUDA device is present.
#include <gtest/gtest.h>

#include <filesystem>

#include "experts_case.h"
#include "test_cuda_util.h"
#ifdef MOEKIT_WITH_CUDA
#include "backends/cuda/policy.h"
#endif

using namespace moekit;
using namespace moekit::test;

namespace {

const char* const kBackends[] = {"eager", "batched_mm", "grouped_mm"};

struct SweepCase {
  ExpertsConfig cfg;
  int64_t tokens = 0, top_k = 1, used = 0, sentinel_every = 0;
  DType index_dtype = DType::i64, weight_dtype = DType::f32;
  std::string to_string() const {
    return cfg.to_string() + " T=" + std::to_string(tokens) + " K=" + std::to_string(top_k) +
           " used=" + std::to_string(used) + " sentinel_every=" + std::to_string(sentinel_every) + " idx=" +
           dtype_name(index_dtype) + " w=" + dtype_name(weight_dtype);
  }
};

// Forces batched_mm's per-pair GEMV path (or the grouped one) for the scope.
class BatchedPolicy {
 public:
  explicit BatchedPolicy(int64_t max_pairs) {
#ifdef MOEKIT_WITH_CUDA
    previous_ = cuda::set_batched_gemv_max_pairs(max_pairs);
#else
    (void)max_pairs;
#endif
  }
  ~BatchedPolicy() {
#ifdef MOEKIT_WITH_CUDA
    cuda::set_batched_gemv_max_pairs(previous_);
#endif
  }

 private:
  int64_t previous_ = 0;
};

// Runs every backend (batched_mm with both of its paths) on one case; returns the number of failures.
int check_case(const SweepCase& c, std::mt19937_64& rng) {
  const Experts host = make_random_experts(c.cfg, rng);
  const Experts dev = host.to(Device::cuda(0));
  const RoutedInputs in = make_routed_inputs(c.tokens, c.top_k, c.cfg.experts, c.cfg.hidden, c.used, c.sentinel_every,
                                             c.cfg.dtype, c.index_dtype, c.weight_dtype, rng);
  const std::vector<double> ref = reference_forward(host, in.x, in.index, in.weights);
  const double tol = cuda_tolerance(c.cfg.dtype);
  int failures = 0;
  auto check = [&](const std::string& label, const std::string& backend) {
    const Tensor out = run_on_cuda(dev, backend, in);
    EXPECT_EQ(out.shape(), (Shape{c.tokens, c.cfg.hidden}));
    const double err = relative_l2(out.view(), ref);
    const bool ok = err <= tol;
    EXPECT_TRUE(ok) << label << ": rel L2 " << err << " > " << tol << " for " << c.to_string();
    failures += !ok;
    if (c.sentinel_every > 0 && c.tokens > 0) {  // token 0 has only sentinel slots: exactly zero
      for (int64_t h = 0; h < c.cfg.hidden; ++h) {
        const double v = load_as_f64(out.data(), out.dtype(), h);
        if (v != 0.0 || std::signbit(v)) {
          ADD_FAILURE() << label << ": all-sentinel token has out[0, " << h << "] = " << v << " for " << c.to_string();
          ++failures;
          break;
        }
      }
    }
  };
  for (const char* b : kBackends) check(b, b);
  {
    BatchedPolicy gemv(int64_t(1) << 40);
    check("batched_mm (per-pair GEMV)", "batched_mm");
  }
  {
    BatchedPolicy grouped(0);
    check("batched_mm (grouped path)", "batched_mm");
  }
  return failures;
}

const DType kDtypes[] = {DType::bf16, DType::f16, DType::f32};
const DType kWeightDtypes[] = {DType::f32, DType::bf16, DType::f16};

}  // namespace

TEST(CudaBackends, AvailableNamesTheDevice) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  for (const char* b : kBackends) {
    const Support s = ExpertsInterface::global().get(b)->available(Device::cuda(0));
    EXPECT_TRUE(s.ok) << b << ": " << s.reason;
    EXPECT_NE(s.reason.find("compute capability"), std::string::npos) << s.reason;
  }
  for (const char* b : {"deepgemm", "sonicmoe"}) {
    const Support s = ExpertsInterface::global().get(b)->available(Device::cuda(0));
    EXPECT_FALSE(s.ok);
    EXPECT_NE(s.reason.find("grouped_mm"), std::string::npos) << s.reason;
  }
  const Support missing = ExpertsInterface::global().get("grouped_mm")->available(Device::cuda(4096));
  EXPECT_FALSE(missing.ok);
  EXPECT_NE(missing.reason.find("cuda:4096"), std::string::npos) << missing.reason;
}

// Tokens x experts x top-k for every dtype, the main sizes (tensor-core path for bf16/f16).
TEST(CudaBackends, SweepTokensExpertsTopK) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(20261101);
  int n = 0, failures = 0;
  for (DType dt : kDtypes) {
    for (int64_t T : {0, 1, 5, 64, 333}) {
      for (int64_t E : {1, 8, 60, 128}) {
        for (int64_t K : {1, 2, 8}) {
          if (K > E) continue;
          SweepCase c;
          c.cfg.dtype = dt;
          c.cfg.experts = E;
          c.cfg.hidden = 64;
          c.cfg.inter = 32;
          c.cfg.has_bias = n % 3 == 0;
          c.tokens = T;
          c.top_k = K;
          c.used = (n % 4 == 1) ? std::max<int64_t>(1, E / 3) : E;  // some experts stay empty
          c.sentinel_every = (n % 4 == 2 && T > 1) ? 3 : 0;
          c.index_dtype = n % 2 ? DType::i32 : DType::i64;
          c.weight_dtype = kWeightDtypes[n % 3];
          failures += check_case(c, rng);
          ++n;
        }
      }
    }
  }
  EXPECT_EQ(failures, 0) << "of " << n << " cases";
}

// Every combination of the layout flags and gate kinds, per dtype.
TEST(CudaBackends, SweepFlags) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(7);
  int n = 0;
  for (DType dt : kDtypes) {
    for (int has_gate = 0; has_gate < 2; ++has_gate)
      for (int bias = 0; bias < 2; ++bias)
        for (int transposed = 0; transposed < 2; ++transposed)
          for (int concat = 0; concat < 2; ++concat)
            for (GateKind gk : {GateKind::act_mul, GateKind::clamped_swiglu}) {
              if (!has_gate && (!concat || gk != GateKind::act_mul)) continue;  // no gate: one layout
              SweepCase c;
              c.cfg.dtype = dt;
              c.cfg.experts = 8;
              c.cfg.hidden = 64;
              c.cfg.inter = 48;
              c.cfg.has_gate = has_gate;
              c.cfg.has_bias = bias;
              c.cfg.transposed = transposed;
              c.cfg.concatenated = concat;
              c.cfg.gate = gk;
              c.cfg.act = has_gate ? Activation::silu : Activation::gelu;
              c.tokens = 37;
              c.top_k = 2;
              c.used = 6;
              c.sentinel_every = 5;
              c.index_dtype = n % 2 ? DType::i64 : DType::i32;
              c.weight_dtype = kWeightDtypes[n % 3];
              check_case(c, rng);
              ++n;
            }
  }
}

TEST(CudaBackends, SweepActivations) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(11);
  int n = 0;
  for (DType dt : kDtypes)
    for (Activation a : {Activation::silu, Activation::gelu, Activation::gelu_tanh, Activation::relu,
                         Activation::relu2, Activation::sigmoid, Activation::identity})
      for (int has_gate = 0; has_gate < 2; ++has_gate) {
        SweepCase c;
        c.cfg.dtype = dt;
        c.cfg.act = a;
        c.cfg.has_gate = has_gate;
        c.cfg.experts = 4;
        c.cfg.hidden = 32;
        c.cfg.inter = 16;
        c.tokens = 19;
        c.top_k = 2;
        c.used = 4;
        c.weight_dtype = kWeightDtypes[n++ % 3];
        check_case(c, rng);
      }
}

// Sizes that are not multiples of 8 (CUDA-core fallback), multiples of 8 but not of the tiles, a
// reduction longer than the pipeline, and large T.
TEST(CudaBackends, SweepOddAndLargeSizes) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(13);
  struct Size { int64_t H, I, E, K, T; };
  const Size sizes[] = {{36, 20, 8, 2, 333}, {72, 40, 60, 8, 64}, {520, 200, 8, 2, 333}, {8, 8, 3, 3, 5},
                        {1, 1, 2, 1, 7},     {64, 32, 128, 8, 4096}};
  int n = 0;
  for (DType dt : kDtypes)
    for (const Size& s : sizes) {
      SweepCase c;
      c.cfg.dtype = dt;
      c.cfg.hidden = s.H;
      c.cfg.inter = s.I;
      c.cfg.experts = s.E;
      c.cfg.has_bias = n % 2;
      c.cfg.concatenated = n % 3 != 1;
      c.tokens = s.T;
      c.top_k = s.K;
      c.used = s.E;
      c.sentinel_every = n % 2 ? 7 : 0;
      c.index_dtype = n % 2 ? DType::i32 : DType::i64;
      c.weight_dtype = kWeightDtypes[n++ % 3];
      check_case(c, rng);
    }
}

// Transposed weights ([E, in, out], gpt-oss) on the tensor-core kernel: reductions over several tiles,
// partial column tiles, interleaved gated columns with bias and the clamped gate, and the plain layout.
TEST(CudaBackends, TransposedWeightsOnTensorCores) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(17);
  struct Size { int64_t H, I, E, K, T; };
  const Size sizes[] = {{520, 200, 8, 2, 333}, {136, 72, 32, 4, 64}, {64, 1000, 4, 2, 9}};
  int n = 0;
  for (DType dt : {DType::bf16, DType::f16})
    for (const Size& z : sizes)
      for (int has_gate = 0; has_gate < 2; ++has_gate) {
        SweepCase c;
        c.cfg.dtype = dt;
        c.cfg.hidden = z.H;
        c.cfg.inter = z.I;
        c.cfg.experts = z.E;
        c.cfg.transposed = true;
        c.cfg.concatenated = false;
        c.cfg.has_gate = has_gate;
        c.cfg.has_bias = true;
        c.cfg.gate = has_gate && n % 2 ? GateKind::clamped_swiglu : GateKind::act_mul;
        c.tokens = z.T;
        c.top_k = z.K;
        c.used = z.E;
        c.sentinel_every = n % 2 ? 5 : 0;
        c.weight_dtype = kWeightDtypes[n++ % 3];
        check_case(c, rng);
      }
}

// One small case per kernel path (routing over several blocks, wgmma wide and narrow with partial
// tiles, mma.sync, CUDA cores, GEMV):
// short enough for compute-sanitizer's racecheck.
TEST(CudaBackends, EveryKernelPathSmall) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(37);
  struct Path { DType dt; int64_t T; bool wgmma, wide; };
  const Path paths[] = {{DType::bf16, 200, true, true},  {DType::bf16, 200, true, false},
                        {DType::bf16, 200, false, false}, {DType::f16, 100, true, true},
                        {DType::f32, 20, true, true},     {DType::bf16, 3, true, true}};
  for (const Path& p : paths) {
#ifdef MOEKIT_WITH_CUDA
    const bool saved = cuda::set_grouped_wgmma_enabled(p.wgmma);
    const bool saved_wide = cuda::set_grouped_wgmma_wide_enabled(p.wide);
#endif
    SweepCase c;
    c.cfg.dtype = p.dt;
    c.cfg.experts = 8;
    c.cfg.hidden = 128;
    c.cfg.inter = 64;
    c.cfg.has_bias = true;
    c.tokens = p.T;
    c.top_k = 2;
    c.used = 8;
    c.sentinel_every = 5;
    EXPECT_EQ(check_case(c, rng), 0) << c.to_string();
#ifdef MOEKIT_WITH_CUDA
    cuda::set_grouped_wgmma_enabled(saved);
    cuda::set_grouped_wgmma_wide_enabled(saved_wide);
#endif
  }
}

TEST(CudaBackends, DeterministicRunToRun) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(17);
  ExpertsConfig cfg;
  cfg.experts = 60;
  cfg.hidden = 128;
  cfg.inter = 64;
  const Experts dev = make_random_experts(cfg, rng).to(Device::cuda(0));
  const RoutedInputs in =
      make_routed_inputs(1000, 8, 60, 128, 60, 0, DType::bf16, DType::i32, DType::f32, rng);
  for (const char* b : kBackends) {
    const Tensor first = run_on_cuda(dev, b, in);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(bitwise_equal(first, run_on_cuda(dev, b, in))) << b;
  }
}

// Ids < 0 or > E: eager throws at once; batched_mm and grouped_mm drop the slot (no out-of-bounds
// access) and check_experts_errors reports the first one.
TEST(CudaBackends, BadIdsAreReported) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(19);
  ExpertsConfig cfg;
  cfg.experts = 8;
  const Experts host = make_random_experts(cfg, rng);
  const Experts dev = host.to(Device::cuda(0));
  for (DType it : {DType::i32, DType::i64}) {
    RoutedInputs in = make_routed_inputs(16, 2, 8, cfg.hidden, 8, 0, cfg.dtype, it, DType::f32, rng);
    RoutedInputs dropped = in;
    dropped.index = Tensor::copy_of(in.index.view(), Device::cpu());
    auto set = [&](Tensor& t, int64_t p, int64_t v) {
      if (it == DType::i32) t.ptr<int32_t>()[p] = int32_t(v);
      else t.ptr<int64_t>()[p] = v;
    };
    set(in.index, 3 * 2 + 1, -1);  // token 3, slot 1
    set(in.index, 9 * 2 + 0, 8 + 5);
    set(dropped.index, 3 * 2 + 1, 8);
    set(dropped.index, 9 * 2 + 0, 8);
    const auto ref = reference_forward(host, dropped.x, dropped.index, dropped.weights);
    try {
      run_on_cuda(dev, "eager", in);
      ADD_FAILURE() << "eager accepted a bad id";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("top_k_index[3, 1] = -1"), std::string::npos) << e.what();
    }
    for (const char* b : {"batched_mm", "grouped_mm"}) {
      check_experts_errors(dev);  // clean before
      const Tensor out = run_on_cuda(dev, b, in);
      EXPECT_LE(relative_l2(out.view(), ref), cuda_tolerance(cfg.dtype)) << b;
      try {
        check_experts_errors(dev);
        ADD_FAILURE() << b << ": bad id not reported";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
        EXPECT_NE(std::string(e.what()).find("top_k_index[3, 1] = -1"), std::string::npos) << e.what();
      }
      EXPECT_NO_THROW(check_experts_errors(dev)) << b << ": the record must be cleared";
    }
  }
}

TEST(CudaBackends, EmptyInputGivesEmptyOutput) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(23);
  const Experts dev = make_random_experts(ExpertsConfig{}, rng).to(Device::cuda(0));
  Tensor x = Tensor::empty({0, 64}, DType::bf16, Device::cuda(0));
  Tensor idx = Tensor::empty({0, 2}, DType::i32, Device::cuda(0));
  Tensor w = Tensor::empty({0, 2}, DType::f32, Device::cuda(0));
  for (const char* b : kBackends) {
    Experts e = dev;
    e.set_implementation(b);
    const Tensor out = e.forward(x, idx, w);
    EXPECT_EQ(out.shape(), (Shape{0, 64})) << b;
  }
}

TEST(CudaBackends, RejectsWhatItCannotRun) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(29);
  ExpertsConfig cfg;
  const Experts dev = make_random_experts(cfg, rng).to(Device::cuda(0));
  for (const char* b : kBackends) {
    const Support mixed = ExpertsInterface::global().get(b)->supports(dev, DType::f32);  // bf16 weights
    EXPECT_FALSE(mixed.ok) << b;
    EXPECT_NE(mixed.reason.find("dtype"), std::string::npos) << mixed.reason;
  }
  ExpertsSpec spec = dev.spec();
  spec.gate = GateKind::custom;
  spec.custom_gate = [](const float* g, const float* u, float* o, int64_t n) {
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] * u[i];
  };
  const Experts custom(spec, dev.weights(), "eager");
  for (const char* b : kBackends) {
    const Support s = ExpertsInterface::global().get(b)->supports(custom, DType::bf16);
    EXPECT_FALSE(s.ok) << b;
    EXPECT_NE(s.reason.find("custom gate"), std::string::npos) << s.reason;
  }
  // A strided (non-contiguous) argument on the GPU is rejected, never misread.
  Tensor x = Tensor::empty({4, 64}, DType::bf16, Device::cuda(0));
  Tensor idx = Tensor::zeros({4, 2}, DType::i32, Device::cuda(0));
  Tensor w = Tensor::zeros({4, 2}, DType::f32, Device::cuda(0));
  Tensor out = Tensor::empty({4, 64}, DType::bf16, Device::cuda(0));
  TensorView strided(idx.data(), DType::i32, {4, 1}, Device::cuda(0), {2, 1});
  TensorView wv(w.data(), DType::f32, {4, 1}, Device::cuda(0), {2, 1});
  EXPECT_THROW(dev.forward_with("grouped_mm", ExpertsCall{x.view(), strided, wv, out.view(), nullptr}), Error);
}

// The committed transformers cases (f32): every backend within 1e-5 of transformers' output.
TEST(CudaBackends, MatchTheFixtures) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(fixtures_dir() + "/experts")) {
    if (entry.path().extension() != ".safetensors") continue;
    const ExpertsCase c = load_experts_case(entry.path().string());
    const Experts dev = c.experts.to(Device::cuda(0));
    const RoutedInputs in{c.hidden_states, c.top_k_index, c.top_k_weights};
    for (const char* b : kBackends) {
      const Tensor out = run_on_cuda(dev, b, in);
      const double err = relative_l2(out.view(), c.expected_values);
      EXPECT_LE(err, 1e-5) << b << " on " << entry.path() << " vs transformers out." << c.expected_name;
    }
    ++n;
  }
  EXPECT_GE(n, 3);
}

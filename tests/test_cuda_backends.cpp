// The CUDA experts backends (every registered backend available on cuda:0) against the f64 reference: a
// sweep of dtypes, token counts, experts, top-k, odd sizes, empty experts, sentinels and every flag; bad
// ids; determinism; what is rejected. Every test skips when no CUDA device is present.
#include <gtest/gtest.h>

#include <filesystem>

#include "experts_case.h"
#include "test_experts_problem.h"
#include "backends/backends.h"
#ifdef MOEKIT_WITH_CUDA
#include "backends/cuda/policy.h"
#endif

using namespace moekit;
using namespace moekit::test;

namespace {

// The registered backends that run on cuda:0.
std::vector<BackendPtr> cuda_backends() { return backends_on(Device::cuda(0)); }

// Forces batched_mm's per-pair GEMV path (or the grouped one) for the scope.
class BatchedPolicy {
 public:
  explicit BatchedPolicy(int64_t max_pairs) {
#ifdef MOEKIT_WITH_CUDA
    previous_ = cuda::set_batched_gemv_max_pairs(max_pairs);
    previous_shared_ = cuda::set_batched_gemv_when_shared(max_pairs > 0);  // also as many pairs as experts
#else
    (void)max_pairs;
#endif
  }
  ~BatchedPolicy() {
#ifdef MOEKIT_WITH_CUDA
    cuda::set_batched_gemv_max_pairs(previous_);
    cuda::set_batched_gemv_when_shared(previous_shared_);
#endif
  }

 private:
  int64_t previous_ = 0;
  bool previous_shared_ = false;
};

// Runs every backend that runs on cuda:0 on one case, batched_mm also with each of its two paths forced;
// returns the number of failures.
int check_case(const ProblemConfig& c, std::mt19937_64& rng) {
  const ExpertsProblem p = make_problem(c, rng());
  const Device dev = Device::cuda(0);
  Outcome o;
  check_backends_on(p, dev, o);
  const Experts experts = p.experts.to(dev);
  {
    BatchedPolicy gemv(int64_t(1) << 40);
    check_backend(p, experts, "batched_mm", "batched_mm (per-pair GEMV)", o);
  }
  {
    BatchedPolicy grouped(0);
    check_backend(p, experts, "batched_mm", "batched_mm (grouped path)", o);
  }
  return o.fail;
}

const DType kDtypes[] = {DType::bf16, DType::f16, DType::f32};
const DType kWeightDtypes[] = {DType::f32, DType::bf16, DType::f16};

}  // namespace

// A built-in with a CUDA implementation runs on cuda:0 and names the device; one without says why and what to
// use instead; an absent device is named.
TEST(CudaBackends, AvailableNamesTheDevice) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  auto& reg = ExpertsInterface::global();
  int runs = 0;
  for (const auto& b : reg.backends()) {
    if (!reg.is_builtin(b->name())) continue;
    const auto devices = b->devices();
    const bool has_cuda = std::find(devices.begin(), devices.end(), DeviceType::cuda) != devices.end();
    const Support s = b->available(Device::cuda(0));
    EXPECT_EQ(s.ok, has_cuda) << b->name() << ": " << s.reason;
    if (has_cuda) {
      ++runs;
      EXPECT_NE(s.reason.find("compute capability"), std::string::npos) << s.reason;
      const Support missing = b->available(Device::cuda(4096));
      EXPECT_FALSE(missing.ok) << b->name();
      EXPECT_NE(missing.reason.find("cuda:4096"), std::string::npos) << missing.reason;
    } else {
      EXPECT_NE(s.reason.find("grouped_mm"), std::string::npos) << s.reason;
    }
  }
  EXPECT_GE(runs, 1);
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
          ProblemConfig c = cuda_case();
          c.act = c.wdt = dt;
          c.E = E;
          c.H = 64;
          c.I = 32;
          c.has_bias = n % 3 == 0;
          c.T = T;
          c.K = K;
          c.used = (n % 4 == 1) ? std::max<int64_t>(1, E / 3) : E;  // some experts stay empty
          c.sentinel_every = (n % 4 == 2 && T > 1) ? 3 : 0;
          c.idt = n % 2 ? DType::i32 : DType::i64;
          c.rwt = kWeightDtypes[n % 3];
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
              ProblemConfig c = cuda_case();
              c.act = c.wdt = dt;
              c.E = 8;
              c.H = 64;
              c.I = 48;
              c.has_gate = has_gate;
              c.has_bias = bias;
              c.transposed = transposed;
              c.concatenated = concat;
              c.gate = gk;
              c.activation = has_gate ? Activation::silu : Activation::gelu;
              c.T = 37;
              c.K = 2;
              c.used = 6;
              c.sentinel_every = 5;
              c.idt = n % 2 ? DType::i64 : DType::i32;
              c.rwt = kWeightDtypes[n % 3];
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
        ProblemConfig c = cuda_case();
        c.act = c.wdt = dt;
        c.activation = a;
        c.has_gate = has_gate;
        c.E = 4;
        c.H = 32;
        c.I = 16;
        c.T = 19;
        c.K = 2;
        c.used = 4;
        c.rwt = kWeightDtypes[n++ % 3];
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
      ProblemConfig c = cuda_case();
      c.act = c.wdt = dt;
      c.H = s.H;
      c.I = s.I;
      c.E = s.E;
      c.has_bias = n % 2;
      c.concatenated = n % 3 != 1;
      c.T = s.T;
      c.K = s.K;
      c.used = s.E;
      c.sentinel_every = n % 2 ? 7 : 0;
      c.idt = n % 2 ? DType::i32 : DType::i64;
      c.rwt = kWeightDtypes[n++ % 3];
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
        ProblemConfig c = cuda_case();
        c.act = c.wdt = dt;
        c.H = z.H;
        c.I = z.I;
        c.E = z.E;
        c.transposed = true;
        c.concatenated = false;
        c.has_gate = has_gate;
        c.has_bias = true;
        c.gate = has_gate && n % 2 ? GateKind::clamped_swiglu : GateKind::act_mul;
        c.T = z.T;
        c.K = z.K;
        c.used = z.E;
        c.sentinel_every = n % 2 ? 5 : 0;
        c.rwt = kWeightDtypes[n++ % 3];
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
    ProblemConfig c = cuda_case();
    c.act = c.wdt = p.dt;
    c.E = 8;
    c.H = 128;
    c.I = 64;
    c.has_bias = true;
    c.T = p.T;
    c.K = 2;
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
  ProblemConfig c = cuda_case();
  c.idt = DType::i32;
  c.T = 1000, c.E = 60, c.K = 8, c.H = 128, c.I = 64, c.used = 60;
  const ExpertsProblem p = make_problem(c, 17);
  const Experts dev = p.experts.to(Device::cuda(0));
  for (const auto& b : cuda_backends()) {
    const Tensor first = run_backend(dev, b->name(), p);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(bitwise_equal(first, run_backend(dev, b->name(), p))) << b->name();
  }
}

// Ids < 0 or > E: a backend that synchronises with the host (eager) throws at once; the others drop the slot
// (no out-of-bounds access) and check_experts_errors reports the first one.
TEST(CudaBackends, BadIdsAreReported) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  for (DType it : {DType::i32, DType::i64}) {
    ProblemConfig c = cuda_case();
    c.T = 16, c.K = 2, c.used = 8, c.idt = it;
    const ExpertsProblem p = make_problem(c, it == DType::i32 ? 19 : 20);
    const Experts dev = p.experts.to(Device::cuda(0));
    Tensor bad = Tensor::copy_of(p.top_k_index.view(), Device::cpu());
    Tensor dropped = Tensor::copy_of(p.top_k_index.view(), Device::cpu());
    auto set = [&](Tensor& t, int64_t i, int64_t v) {
      if (it == DType::i32) t.ptr<int32_t>()[i] = int32_t(v);
      else t.ptr<int64_t>()[i] = v;
    };
    set(bad, 3 * 2 + 1, -1);  // token 3, slot 1
    set(bad, 9 * 2 + 0, 8 + 5);
    set(dropped, 3 * 2 + 1, 8);
    set(dropped, 9 * 2 + 0, 8);
    const auto ref = reference_forward(p.experts, p.hidden_states, dropped, p.top_k_weights);
    int synchronous = 0, recorded = 0;
    for (const auto& b : cuda_backends()) {
      const std::string name(b->name());
      if (b->needs_host_sync()) {
        ++synchronous;
        try {
          run_backend(dev, name, p.hidden_states, bad, p.top_k_weights);
          ADD_FAILURE() << name << " accepted a bad id";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
          EXPECT_NE(std::string(e.what()).find("top_k_index[3, 1] = -1"), std::string::npos) << e.what();
        }
        continue;
      }
      ++recorded;
      check_experts_errors(dev);  // clean before
      const Tensor out = run_backend(dev, name, p.hidden_states, bad, p.top_k_weights);
      EXPECT_LE(relative_l2(out.view(), ref), experts_tolerance(c.act)) << name;
      try {
        check_experts_errors(dev);
        ADD_FAILURE() << name << ": bad id not reported";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
        EXPECT_NE(std::string(e.what()).find("top_k_index[3, 1] = -1"), std::string::npos) << e.what();
      }
      EXPECT_NO_THROW(check_experts_errors(dev)) << name << ": the record must be cleared";
    }
    EXPECT_GE(synchronous, 1);
    EXPECT_GE(recorded, 1);
  }
}

TEST(CudaBackends, EmptyInputGivesEmptyOutput) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const Experts dev = make_problem(cuda_case(), 23).experts.to(Device::cuda(0));
  Tensor x = Tensor::empty({0, 64}, DType::bf16, Device::cuda(0));
  Tensor idx = Tensor::empty({0, 2}, DType::i32, Device::cuda(0));
  Tensor w = Tensor::empty({0, 2}, DType::f32, Device::cuda(0));
  for (const auto& b : cuda_backends()) {
    Experts e = dev;
    e.set_implementation(std::string(b->name()));
    const Tensor out = e.forward(x, idx, w);
    EXPECT_EQ(out.shape(), (Shape{0, 64})) << b->name();
  }
}

TEST(CudaBackends, RejectsWhatItCannotRun) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  const Experts dev = make_problem(cuda_case(), 29).experts.to(Device::cuda(0));
  auto& reg = ExpertsInterface::global();
  for (const auto& b : cuda_backends()) {
    if (!reg.is_builtin(b->name())) continue;
    const Support mixed = b->supports(dev, DType::f32);  // bf16 weights
    EXPECT_FALSE(mixed.ok) << b->name();
    EXPECT_NE(mixed.reason.find("dtype"), std::string::npos) << mixed.reason;
  }
  ExpertsSpec spec = dev.spec();
  spec.gate = GateKind::custom;
  spec.custom_gate = [](const float* g, const float* u, float* o, int64_t n) {
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] * u[i];
  };
  const Experts custom(spec, dev.weights(), "eager");
  for (const auto& b : cuda_backends()) {
    if (!reg.is_builtin(b->name())) continue;
    const Support s = b->supports(custom, DType::bf16);
    EXPECT_FALSE(s.ok) << b->name();
    EXPECT_NE(s.reason.find("custom gate"), std::string::npos) << s.reason;
  }
  // A strided (non-contiguous) argument on the GPU is rejected, never misread.
  Tensor x = Tensor::empty({4, 64}, DType::bf16, Device::cuda(0));
  Tensor idx = Tensor::zeros({4, 2}, DType::i32, Device::cuda(0));
  Tensor w = Tensor::zeros({4, 2}, DType::f32, Device::cuda(0));
  Tensor out = Tensor::empty({4, 64}, DType::bf16, Device::cuda(0));
  TensorView strided(idx.data(), DType::i32, {4, 1}, Device::cuda(0), {2, 1});
  TensorView wv(w.data(), DType::f32, {4, 1}, Device::cuda(0), {2, 1});
  EXPECT_THROW(dev.forward_with(default_experts_implementation(Device::cuda(0)),
                                ExpertsCall{x.view(), strided, wv, out.view(), nullptr}),
               Error);
}

// sonicmoe's requirements, checked before anything runs (transformers raises ImportError there): each refusal
// names what is missing and the backend to use instead. The experts conditions hold on every build.
TEST(CudaBackends, SonicmoeRequirementsNameTheAlternative) {
  ExpertsSpec gated;
  EXPECT_EQ(sonicmoe_experts_reason(gated, DType::bf16), "");
  EXPECT_EQ(sonicmoe_experts_reason(gated, DType::f16), "");
  ExpertsSpec clamped;
  clamped.gate = GateKind::clamped_swiglu;
  EXPECT_EQ(sonicmoe_experts_reason(clamped, DType::bf16), "");
  ExpertsSpec plain;
  plain.has_gate = false;
  plain.activation = Activation::relu2;
  std::string why = sonicmoe_experts_reason(plain, DType::bf16);
  EXPECT_NE(why.find("gated"), std::string::npos) << why;
  EXPECT_NE(why.find("relu2"), std::string::npos) << why;
  EXPECT_NE(why.find("grouped_mm"), std::string::npos) << why;
  for (DType q : {DType::f8e4m3, DType::f4e2m1}) {
    why = sonicmoe_experts_reason(gated, q);
    EXPECT_NE(why.find("quantized"), std::string::npos) << why;
    EXPECT_NE(why.find(dtype_name(q)), std::string::npos) << why;
    EXPECT_NE(why.find("grouped_mm"), std::string::npos) << why;
  }
  why = sonicmoe_experts_reason(gated, DType::f32);
  EXPECT_NE(why.find("f32"), std::string::npos) << why;
  EXPECT_NE(why.find("grouped_mm"), std::string::npos) << why;

  MOEKIT_SKIP_WITHOUT_CUDA();
  const auto sonic = ExpertsInterface::global().get("sonicmoe");
  const Device dev = Device::cuda(0);
  const Support avail = sonic->available(dev);
  if (!avail) {  // not a Hopper GPU (or no sm_90a code): says so and names grouped_mm
    EXPECT_NE(avail.reason.find("9.0"), std::string::npos) << avail.reason;
    EXPECT_NE(avail.reason.find("grouped_mm"), std::string::npos) << avail.reason;
    return;
  }
  ProblemConfig c = cuda_case();
  c.act = c.wdt = DType::bf16;
  c.has_gate = false;
  const ExpertsProblem pn = make_problem(c, 31);
  const Experts nongated = pn.experts.to(dev);
  Support s = sonic->supports(nongated, DType::bf16);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("not gated"), std::string::npos) << s.reason;
  c.has_gate = true;
  c.act = c.wdt = DType::f32;
  const Experts f32 = make_problem(c, 31).experts.to(dev);
  s = sonic->supports(f32, DType::f32);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("grouped_mm"), std::string::npos) << s.reason;
  // The forward refuses with the same reason, naming the backend, and writes nothing.
  Experts e = nongated;
  e.set_implementation("sonicmoe");
  ErrorCode code{};
  const std::string msg = error_of(
      [&] { e.forward(pn.hidden_states.to(dev), pn.top_k_index.to(dev), pn.top_k_weights.to(dev)); }, &code);
  EXPECT_EQ(code, ErrorCode::not_supported) << msg;
  EXPECT_NE(msg.find("sonicmoe"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not gated"), std::string::npos) << msg;
}

// sonicmoe over several row tiles per expert (one partial), several reduction tiles with a tail and partial
// column tiles, every gate kind, with and without biases, sentinels, odd T. (Many work items per block: the
// sweeps' 4096-token case and the TMA kernel tests.)
TEST(CudaBackends, SonicmoeManyTilesEveryGate) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  if (!ExpertsInterface::global().get("sonicmoe")->available(Device::cuda(0))) GTEST_SKIP() << "not a Hopper GPU";
  std::mt19937_64 rng(41);
  int n = 0;
  for (GateKind gk : {GateKind::act_mul, GateKind::clamped_swiglu})
    for (Activation a : {Activation::silu, Activation::gelu, Activation::relu}) {
      if (gk == GateKind::clamped_swiglu && a != Activation::silu) continue;
      ProblemConfig c = cuda_case();
      c.act = c.wdt = n % 2 ? DType::f16 : DType::bf16;
      c.gate = gk;
      c.activation = a;
      c.has_bias = n % 2 == 0 || gk == GateKind::clamped_swiglu;
      c.concatenated = n % 3 != 2;
      c.transposed = gk == GateKind::clamped_swiglu;
      c.E = 4;
      c.H = 328;  // 5 reduction tiles and a tail; two column tiles of the down projection, the last partial
      c.I = 200;  // two gated column tiles, the last partial
      c.T = 333;
      c.K = 3;
      c.used = 3;  // one expert stays empty; about 333 rows each: three row tiles, the last partial
      c.sentinel_every = n % 2 ? 0 : 9;
      c.idt = n % 2 ? DType::i32 : DType::i64;
      c.rwt = kWeightDtypes[n % 3];
      const ExpertsProblem p = make_problem(c, rng());
      Outcome o;
      check_backend(p, p.experts.to(Device::cuda(0)), "sonicmoe", "sonicmoe", o);
      EXPECT_EQ(o.ran["sonicmoe"], 1) << c.to_string();
      ++n;
    }
}

// The committed transformers cases (f32): every backend within 1e-5 of transformers' output.
TEST(CudaBackends, MatchTheFixtures) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(fixtures_dir() + "/experts")) {
    if (entry.path().extension() != ".safetensors") continue;
    const ExpertsCase c = load_experts_case(entry.path().string());
    const Experts dev = c.experts.to(Device::cuda(0));
    for (const auto& b : cuda_backends()) {
      if (!b->supports(dev, c.hidden_states.dtype())) continue;  // deepgemm: bf16 / f16 only; fixtures are f32
      const Tensor out = run_backend(dev, b->name(), c.hidden_states, c.top_k_index, c.top_k_weights);
      const double err = relative_l2(out.view(), c.expected_values);
      EXPECT_LE(err, experts_tolerance(DType::f32)) << b->name() << " on " << entry.path()
                                                    << " vs transformers out." << c.expected_name;
    }
    ++n;
  }
  EXPECT_GE(n, 3);
}

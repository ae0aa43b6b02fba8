// The differential test of every registered experts backend (after ggml's test-backend-ops): each backend that
// is available on a device runs a sweep of dtypes, token counts, experts, top-k, odd sizes, empty experts,
// sentinels, index dtypes and flag combinations, and is compared with the f64 reference by relative L2 error.
// A new backend (or a CUDA device) needs no new code here. Also: the CPU GEMM on every instruction set this CPU
// has, the routing, determinism, and that batched_mm does not copy weights per pair.
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>

#include "base/convert.h"
#include "base/gemm.h"
#include "backends/cpu/common.h"
#include "backends/reference.h"
#include "routing/routing.h"
#include "test_experts_problem.h"

using namespace moekit;
using namespace moekit::test;

// ---- allocation counting (batched_mm must not copy weights per pair) ----

namespace {
std::atomic<bool> g_count_allocations{false};
std::atomic<int64_t> g_allocated_bytes{0};
}  // namespace

void* operator new(size_t n) {
  if (g_count_allocations.load(std::memory_order_relaxed)) g_allocated_bytes += int64_t(n);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return operator new(n); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  if (g_count_allocations.load(std::memory_order_relaxed)) g_allocated_bytes += int64_t(n);
  return std::malloc(n ? n : 1);
}
void* operator new[](size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace {

// Every flag combination with one activation each (cycled), the gate kinds where they apply.
std::vector<ProblemConfig> flag_combinations() {
  std::vector<ProblemConfig> out;
  const Activation acts[] = {Activation::silu,    Activation::gelu,     Activation::gelu_tanh, Activation::relu,
                             Activation::sigmoid, Activation::identity, Activation::relu2};
  int n = 0;
  for (int has_gate = 0; has_gate < 2; ++has_gate)
    for (int bias = 0; bias < 2; ++bias)
      for (int tr = 0; tr < 2; ++tr)
        for (int concat = 0; concat < (has_gate ? 2 : 1); ++concat)
          for (int gate = 0; gate < (has_gate ? 3 : 1); ++gate) {
            ProblemConfig c;
            c.has_gate = has_gate;
            c.has_bias = bias;
            c.transposed = tr;
            c.concatenated = has_gate ? bool(concat) : true;
            c.gate = has_gate ? GateKind(gate) : GateKind::act_mul;
            c.activation = acts[n++ % 7];
            out.push_back(c);
          }
  return out;
}

const DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};

// Sanitizer builds are ~20x slower: they run every kSample-th sweep case.
#if defined(__SANITIZE_ADDRESS__)
constexpr int kSample = 6;
#else
constexpr int kSample = 1;
#endif
// Whether sweep case n runs (a hash, so the sample is not aligned with the cycled parameters).
bool sampled(uint64_t n) {
  n = (n + 0x9e3779b97f4a7c15ull) * 0xbf58476d1ce4e5b9ull;
  return (n >> 33) % kSample == 0;
}

}  // namespace

TEST(Backends, AvailabilityIsExplained) {
  for (const Device dev : test_devices())
    for (const auto& b : ExpertsInterface::global().backends()) {
      const Support s = b->available(dev);
      std::printf("  %-16s %-7s %s\n", std::string(b->name()).c_str(), dev.to_string().c_str(),
                  s ? "available" : ("NOT SUPPORTED: " + s.reason).c_str());
      if (!s) EXPECT_FALSE(s.reason.empty()) << b->name();
    }
  // Every built-in with a CPU implementation runs on the CPU, in every build; at least three do.
  int on_cpu = 0;
  for (const auto& b : ExpertsInterface::global().backends()) {
    const auto d = b->devices();
    if (!ExpertsInterface::global().is_builtin(b->name()) || std::find(d.begin(), d.end(), DeviceType::cpu) == d.end())
      continue;
    ++on_cpu;
    EXPECT_TRUE(b->available(Device::cpu())) << b->name();
  }
  EXPECT_GE(on_cpu, 3);
}

namespace {

// A backend added the way a user adds one: one class and one registration. It computes the f64 reference
// (or, broken, leaves half of each row at zero), on the CPU.
class ToyBackend final : public ExpertsBackend {
 public:
  ToyBackend(std::string name, bool broken) : name_(std::move(name)), broken_(broken) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return "f64 reference loop (test)"; }
  Support available(Device d) const override {
    return d.is_cpu() ? Support::yes() : Support::no("the toy backends run on the CPU only");
  }
  Support supports(const Experts& e, DType) const override { return available(e.device()); }
  void run(const Experts& e, const ExpertsCall& call) const override {
    std::vector<double> y = reference_forward(e, call.hidden_states, call.top_k_index, call.top_k_weights);
    const int64_t H = e.spec().hidden;
    if (broken_)
      for (size_t i = 0; i < y.size(); ++i)
        if (int64_t(i) % H < H / 2) y[i] = 0;
    convert(y.data(), DType::f64, call.out.data, call.out.dtype, int64_t(y.size()));
  }

 private:
  std::string name_;
  bool broken_;
};

struct Unregister {
  std::vector<std::string> names;
  ~Unregister() {
    for (const auto& n : names) ExpertsInterface::global().unregister_backend(n);
  }
};

}  // namespace

// The differential loop runs whatever is registered: a correct toy passes every case, a wrong one fails them,
// with no edit to the loop.
TEST(Backends, DifferentialLoopPicksUpANewBackend) {
  Unregister guard{{"test_toy_reference", "test_toy_broken"}};
  ExpertsInterface::global().register_backend(std::make_shared<ToyBackend>("test_toy_reference", false));
  std::vector<ExpertsProblem> problems;
  int n = 0;
  for (const ProblemConfig& flags : flag_combinations()) {
    ProblemConfig c = flags;
    c.act = kFloatTypes[n % 3];
    c.wdt = kFloatTypes[(n / 3) % 3];
    c.T = 1 + n % 6;
    c.E = 4;
    c.K = 2;
    c.H = 24;
    c.I = 16;
    c.idt = n % 2 ? DType::i32 : DType::i64;
    problems.push_back(make_problem(c, 700 + uint64_t(n++)));
  }
  Outcome good;
  for (const ExpertsProblem& p : problems) check_backends_on(p, Device::cpu(), good);
  EXPECT_EQ(good.ran["test_toy_reference"], n);
  EXPECT_EQ(good.failed["test_toy_reference"], 0);
  EXPECT_EQ(good.ran["grouped_mm"], n);
  // A wrong backend, registered the same way, fails every case of the same loop (counted, not reported).
  ExpertsInterface::global().register_backend(std::make_shared<ToyBackend>("test_toy_broken", true));
  Outcome bad;
  for (const ExpertsProblem& p : problems) check_backends_on(p, Device::cpu(), bad, /*report=*/false);
  EXPECT_EQ(bad.ran["test_toy_broken"], n);
  EXPECT_EQ(bad.failed["test_toy_broken"], n) << "a wrong backend must fail every case";
  EXPECT_EQ(bad.failed["test_toy_reference"] + bad.failed["grouped_mm"] + bad.failed["eager"], 0);
}

// Full product of flags x activation dtype x weight dtype on small odd shapes; tokens, experts, top-k, routing
// weight dtype, index dtype, sentinels and empty experts cycle with the case number.
TEST(Backends, SweepSmallShapesEveryFlagAndDtype) {
  const int64_t tokens[] = {0, 1, 5, 7};
  const int64_t ek[][2] = {{1, 1}, {8, 1}, {8, 2}, {8, 8}, {3, 2}};
  Outcome o;
  int n = 0;
  for (const ProblemConfig& flags : flag_combinations())
    for (const DType act : kFloatTypes)
      for (const DType wdt : kFloatTypes) {
        ProblemConfig c = flags;
        c.act = act;
        c.wdt = wdt;
        c.rwt = kFloatTypes[n % 3];
        c.idt = n % 2 ? DType::i32 : DType::i64;
        c.T = tokens[n % 4];
        c.E = ek[(n / 4) % 5][0];
        c.K = ek[(n / 4) % 5][1];
        c.H = n % 2 ? 33 : 47;
        c.I = n % 2 ? 47 : 33;
        c.sentinels = n % 3 == 0;
        c.empty_experts = n % 5 == 1;
        if (sampled(n)) run_all_backends(c, 1000 + n, o);
        ++n;
      }
  std::printf("small sweep: %d OK, %d FAIL, %d NOT SUPPORTED\n", o.ok, o.fail, o.unsupported);
  EXPECT_EQ(o.fail, 0);
  EXPECT_GT(o.ok, 0);
}

// Larger token counts, 60 experts, top-8, sizes that cross the GEMM's tiles and k blocks; flags and dtypes
// sampled with a fixed seed.
TEST(Backends, SweepLargerShapesSampled) {
  struct Shape {
    int64_t T, E, K, H, I;
  };
  const Shape shapes[] = {{64, 8, 2, 130, 47},  {333, 8, 2, 47, 130}, {333, 1, 1, 33, 47},  {64, 60, 8, 130, 33},
                          {333, 60, 2, 33, 47}, {64, 8, 8, 520, 33},  {333, 2, 2, 47, 600}, {5, 60, 8, 130, 130},
                          {64, 3, 1, 260, 130}, {333, 8, 1, 130, 47}};
  const std::vector<ProblemConfig> flags = flag_combinations();
  std::mt19937_64 rng(7);
  Outcome o;
  int n = 0;
  for (const Shape& s : shapes)
    for (int rep = 0; rep < 3; ++rep, ++n) {
      ProblemConfig c = flags[rng() % flags.size()];
      c.act = kFloatTypes[rng() % 3];
      c.wdt = kFloatTypes[rng() % 3];
      c.rwt = kFloatTypes[rng() % 3];
      c.idt = rng() % 2 ? DType::i32 : DType::i64;
      c.T = s.T;
      c.E = s.E;
      c.K = s.K;
      c.H = s.H;
      c.I = s.I;
      c.sentinels = rep == 1;
      c.empty_experts = rep == 2;
      if (sampled(n)) run_all_backends(c, 5000 + n, o);
    }
  std::printf("larger sweep: %d OK, %d FAIL, %d NOT SUPPORTED\n", o.ok, o.fail, o.unsupported);
  EXPECT_EQ(o.fail, 0);
}

// The CPU backends on every instruction set this CPU has (MOEKIT_CPU_ISA chooses one for a whole process).
TEST(Backends, CpuEveryInstructionSet) {
  const std::vector<ProblemConfig> flags = flag_combinations();
  for (const cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512, cpu::Isa::avx512bf16, cpu::Isa::amx}) {
    if (!cpu::isa_supported(isa)) {
      std::printf("ISA %s: NOT SUPPORTED on this CPU (not tested here)\n", cpu::isa_name(isa));
      continue;
    }
    cpu::set_isa_override(isa);
    Outcome o;
    for (size_t i = 0; i < flags.size(); ++i) {
      ProblemConfig c = flags[i];
      c.act = kFloatTypes[i % 3];
      c.wdt = kFloatTypes[(i / 3) % 3];
      c.rwt = kFloatTypes[(i + 1) % 3];
      c.T = i % 2 ? 70 : 3;
      c.E = 5;
      c.K = 2;
      c.H = i % 3 ? 41 : 530;
      c.I = i % 3 ? 35 : 19;
      c.sentinels = i % 4 == 0;
      if (sampled(i)) run_all_backends(c, 9000 + i, o);
    }
    cpu::clear_isa_override();
    std::printf("ISA %s: %d OK, %d FAIL\n", cpu::isa_name(isa), o.ok, o.fail);
    EXPECT_EQ(o.fail, 0) << cpu::isa_name(isa);
  }
}

// bf16 activations, weights and routing weights at prefill sizes on every ISA: the packed bf16 path with the amx
// tile's both default orders (below and from 24 rows per expert), the AVX-512 SiLU gate and combine, both weight
// layouts and [gate | up] or interleaved, against the reference.
TEST(Backends, CpuBf16PrefillEveryInstructionSet) {
  for (const cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512, cpu::Isa::avx512bf16, cpu::Isa::amx}) {
    if (!cpu::isa_supported(isa)) continue;
    cpu::set_isa_override(isa);
    Outcome o;
    for (int i = 0; i < 4; ++i) {
      ProblemConfig c;
      c.act = c.wdt = c.rwt = DType::bf16;
      c.T = i % 2 ? 180 : 37;  // about 90 or 18 rows per expert
      c.E = 4;
      c.K = 2;
      c.H = 100;
      c.I = 72;
      c.transposed = i >= 2;
      c.concatenated = i != 3;
      c.sentinels = i == 1;
      run_all_backends(c, 9700 + i, o);
    }
    cpu::clear_isa_override();
    EXPECT_EQ(o.fail, 0) << cpu::isa_name(isa);
    EXPECT_GT(o.ok, 0) << cpu::isa_name(isa);
  }
}

TEST(Backends, SentinelSlotsContributeExactlyZero) {
  ProblemConfig c;
  c.T = 9;
  c.E = 4;
  c.K = 3;
  c.H = 24;
  c.I = 16;
  c.has_bias = true;
  for (const Device dev : test_devices()) {
    ExpertsProblem p = make_problem(c, 11);
    // token 0: every slot on another rank; token 1: two of three; routing weights there are NaN.
    for (int64_t k = 0; k < 3; ++k) p.top_k_index.ptr<int64_t>()[k] = 4;
    p.top_k_index.ptr<int64_t>()[3] = 4;
    p.top_k_index.ptr<int64_t>()[5] = 4;
    for (int64_t i : {0, 1, 2, 3, 5}) p.top_k_weights.ptr<float>()[i] = NAN;
    const auto ref = reference_forward(p.experts, p.hidden_states, p.top_k_index, p.top_k_weights);
    const Experts experts = p.experts.to(dev);
    for (const auto& b : backends_on(dev)) {
      if (!b->supports(experts, DType::f32)) continue;
      const Tensor host = run_backend(experts, b->name(), p.hidden_states, p.top_k_index, p.top_k_weights);
      for (int64_t h = 0; h < c.H; ++h) EXPECT_EQ(f32_to_bits(host.ptr<float>()[h]), 0u) << b->name() << " h=" << h;
      EXPECT_LE(relative_l2(host.view(), ref), experts_tolerance(DType::f32)) << b->name();
    }
  }
}

TEST(Backends, DeterministicRunToRunAndAcrossThreadCounts) {
  ProblemConfig c;
  c.act = DType::bf16;
  c.wdt = DType::bf16;
  c.T = 97;
  c.E = 8;
  c.K = 4;
  c.H = 136;
  c.I = 72;
  c.has_bias = true;
  c.sentinels = true;
  const ExpertsProblem p = make_problem(c, 21);
  const int threads = omp_get_max_threads();
  for (const Device dev : test_devices()) {
    const Experts experts = p.experts.to(dev);
    for (const auto& b : backends_on(dev)) {
      if (!b->supports(experts, c.act)) continue;
      std::vector<Tensor> outs;
      for (int run = 0; run < 3; ++run) {
        omp_set_num_threads(run == 2 ? 1 : std::max(2, threads));
        outs.push_back(run_backend(experts, b->name(), p));
      }
      omp_set_num_threads(threads);
      for (int run = 1; run < 3; ++run)
        EXPECT_EQ(std::memcmp(outs[0].data(), outs[size_t(run)].data(), outs[0].nbytes()), 0)
            << b->name() << " on " << dev.to_string() << ": run " << run << " differs";
    }
  }
}

// Decode sizes on the packed bf16 path (every expert below the AMX rows): the projections' 128-column tasks go to
// whichever thread is free, so each thread count splits the work differently: the same bits at 1, 2 and 3 threads,
// within the tolerance of the reference; [gate | up] (the AVX-512 SiLU gate) and interleaved with biases; panel
// counts that are not a multiple of 8 (N1 = 272 and 144: 17 and 9 panels; H = 200: 13 panels, the last of 8 columns).
TEST(Backends, CpuBf16DecodeSameBitsAcrossThreadCounts) {
  const int threads = omp_get_max_threads();
  for (int i = 0; i < 4; ++i) {
    ProblemConfig c;
    c.act = c.wdt = c.rwt = DType::bf16;
    c.T = i % 2 ? 1 : 6;
    c.E = i < 2 ? 8 : 60;
    c.K = i < 2 ? 2 : 8;
    c.H = 200;
    c.I = i % 2 ? 136 : 72;
    c.concatenated = i != 2;
    c.has_bias = i == 2;
    c.sentinels = i == 3;
    const ExpertsProblem p = make_problem(c, 51 + uint64_t(i));
    const auto ref = reference_forward(p.experts, p.hidden_states, p.top_k_index, p.top_k_weights);
    for (const auto& name : {"grouped_mm", "batched_mm"}) {
      std::vector<Tensor> outs;
      for (const int n : {1, 2, 3}) {
        omp_set_num_threads(n);
        outs.push_back(run_backend(p.experts, name, p));
      }
      omp_set_num_threads(threads);
      EXPECT_LE(relative_l2(outs[0].view(), ref), experts_tolerance(DType::bf16)) << name << " case " << i;
      for (size_t run = 1; run < outs.size(); ++run)
        EXPECT_EQ(std::memcmp(outs[0].data(), outs[run].data(), outs[0].nbytes()), 0)
            << name << " case " << i << ": " << run + 1 << " threads differ from 1";
    }
  }
}

// transformers' batched_mm gathers gate_up_proj[expert_ids] (a weight copy per pair); moekit's reads in place.
TEST(Backends, BatchedMmDoesNotCopyWeightsPerPair) {
  ProblemConfig c;
  c.T = 64;
  c.E = 4;
  c.K = 4;
  c.H = 128;
  c.I = 96;
  const ExpertsProblem p = make_problem(c, 31);
  Tensor out = Tensor::empty(p.hidden_states.shape(), p.hidden_states.dtype());
  const ExpertsCall call{p.hidden_states.view(), p.top_k_index.view(), p.top_k_weights.view(), out.view(), nullptr};
  p.experts.forward_with("batched_mm", call);  // warm up per-thread scratch
  g_allocated_bytes = 0;
  g_count_allocations = true;
  p.experts.forward_with("batched_mm", call);
  g_count_allocations = false;
  const int64_t pairs = c.T * c.K;
  const int64_t per_pair_weights = (2 * c.I * c.H + c.H * c.I) * 4;           // what a per-pair copy would take
  const int64_t activations = (c.T * c.H + pairs * (2 * c.I + c.H)) * 4 * 2;  // scratch, with slack
  std::printf("batched_mm allocated %lld bytes; per-pair weight copies would take %lld\n",
              (long long)g_allocated_bytes.load(), (long long)(pairs * per_pair_weights));
  EXPECT_LT(g_allocated_bytes.load(), activations);
  EXPECT_LT(g_allocated_bytes.load(), pairs * per_pair_weights / 20);
}

// ---- routing ----

// The CPU backends' per-call scratch: a released large buffer is handed out again (no fresh pages per call), a
// larger request gets a block that holds it (written whole: ASan checks the size), and the pool's blocks are not
// shared between live buffers.
TEST(CpuScratch, LargeBuffersAreReusedAndSized) {
  const int64_t n = 777781;  // floats: about 3 MiB, a size no other test asks for
  float* first = nullptr;
  {
    cpu::FloatBuffer a = cpu::make_buffer(n);
    first = a.get();
    std::fill(a.get(), a.get() + n, 1.0f);
  }
  cpu::FloatBuffer b = cpu::make_buffer(n);
  EXPECT_EQ(b.get(), first) << "a released block of the same size was not reused";
  cpu::FloatBuffer c = cpu::make_buffer(n);  // while b lives: another block
  EXPECT_NE(c.get(), b.get());
  std::fill(c.get(), c.get() + n, 2.0f);
  cpu::FloatBuffer d = cpu::make_buffer(3 * n);
  std::fill(d.get(), d.get() + 3 * n, 3.0f);
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(c[n - 1], 2.0f);
}

TEST(Routing, StableCountingSortDropsSentinels) {
  for (const DType idt : {DType::i32, DType::i64}) {
    // [4, 2]: ids in [0, 3], 3 = sentinel
    const int64_t ids[] = {2, 0, 3, 2, 0, 2, 3, 3};
    Tensor t = Tensor::empty({4, 2}, idt);
    for (int i = 0; i < 8; ++i) {
      if (idt == DType::i32)
        t.ptr<int32_t>()[i] = int32_t(ids[i]);
      else
        t.ptr<int64_t>()[i] = ids[i];
    }
    const ExpertRouting r = route_top_k(t.data(), idt, 4, 2, 3);
    EXPECT_EQ(r.counts, (std::vector<int64_t>{2, 0, 3}));
    EXPECT_EQ(r.offsets, (std::vector<int64_t>{0, 2, 2, 5}));
    EXPECT_EQ(r.sorted_pairs, (std::vector<int64_t>{1, 4, 0, 3, 5}));
    EXPECT_EQ(r.position, (std::vector<int64_t>{2, 0, -1, 3, 1, 4, -1, -1}));
    EXPECT_EQ(r.active_experts(), (std::vector<int64_t>{0, 2}));
    EXPECT_EQ(r.routed(), 5);
  }
  const ExpertRouting empty = route_top_k(nullptr, DType::i64, 0, 4, 3);
  EXPECT_EQ(empty.routed(), 0);
  const int64_t bad[] = {0, 5};
  try {
    route_top_k(bad, DType::i64, 1, 2, 3);
    FAIL() << "id 5 accepted with 3 experts";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("= 5"), std::string::npos) << e.what();
  }
}

// ---- the CPU GEMM ----

namespace {
// C = A x W^T in double, W as stored.
std::vector<double> gemm_reference(const std::vector<float>& a, const Tensor& w, int64_t m, int64_t n, int64_t k,
                                   bool transposed) {
  std::vector<double> c(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t kk = 0; kk < k; ++kk)
        s += double(a[size_t(i * k + kk)]) * load_as_f64(w.data(), w.dtype(), transposed ? kk * n + j : j * k + kk);
      c[size_t(i * n + j)] = s;
    }
  return c;
}
}  // namespace

TEST(CpuGemm, EveryIsaLayoutAndDtypeMatchesDouble) {
  struct Dims {
    int64_t m, n, k;
  };
  // m <= 4 reads W in place; above, packed panels; k > 512 crosses k blocks, n > 128 column tiles.
  const Dims dims[] = {{1, 1, 1},    {1, 37, 33},   {2, 16, 8},      {3, 130, 47},  {4, 65, 519},
                       {5, 33, 130}, {7, 129, 600}, {13, 200, 1030}, {250, 45, 31}, {6, 17, 9}};
  std::mt19937_64 rng(3);
  for (const cpu::Isa isa : {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512, cpu::Isa::avx512bf16, cpu::Isa::amx}) {
    if (!cpu::isa_supported(isa)) continue;
    cpu::set_isa_override(isa);
    const cpu::GemmKernels& kern = cpu::gemm_kernels();
    EXPECT_EQ(kern.isa, isa);
    for (const Dims d : dims)
      for (const DType wdt : kFloatTypes)
        for (const bool tr : {false, true}) {
          const Tensor af = randn({d.m, d.k}, DType::f32, rng);
          std::vector<float> a(af.ptr<float>(), af.ptr<float>() + d.m * d.k);
          const Tensor w = randn(tr ? Shape{d.k, d.n} : Shape{d.n, d.k}, wdt, rng);
          const cpu::WeightMatrix wm{w.data(),
                                     wdt == DType::f32    ? cpu::WType::f32
                                     : wdt == DType::bf16 ? cpu::WType::bf16
                                                          : cpu::WType::f16,
                                     d.n, d.k, tr};
          std::vector<float> c(size_t(d.m * d.n), NAN);
          cpu::gemm(kern, a.data(), d.k, d.m, wm, c.data(), d.n);
          const auto ref = gemm_reference(a, w, d.m, d.n, d.k, tr);
          std::vector<double> got(c.begin(), c.end());
          const double err = relative_l2(got, ref);
          EXPECT_LT(err, 2e-6) << cpu::isa_name(isa) << " m=" << d.m << " n=" << d.n << " k=" << d.k << " "
                               << dtype_name(wdt) << (tr ? " [K,N]" : " [N,K]");
          // An element's value does not depend on how the columns are split into tiles.
          std::vector<float> c2(size_t(d.m * d.n), NAN), work(size_t(kern.work_floats));
          for (int64_t n0 = 0; n0 < d.n; n0 += 7)
            kern.gemm_tile(a.data(), d.k, d.m, wm, n0, std::min(d.n, n0 + 7), c2.data(), d.n, work.data());
          EXPECT_EQ(std::memcmp(c.data(), c2.data(), c.size() * 4), 0)
              << cpu::isa_name(isa) << " m=" << d.m << " n=" << d.n << " k=" << d.k << ": tiling changed bits";
        }
    cpu::clear_isa_override();
  }
  // Forcing an ISA the CPU lacks is an error naming it.
  if (!cpu::isa_supported(cpu::Isa::avx512)) {
    try {
      cpu::set_isa_override(cpu::Isa::avx512);
      FAIL() << "avx512 forced on a CPU without it";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("avx512"), std::string::npos);
    }
  }
}

TEST(CpuConvert, HalfConversionsAreExact) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float ref = f16_to_f32(uint16_t(h));
    const float got = cpu::half_to_float(uint16_t(h));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got)) << h;
      continue;
    }
    ASSERT_EQ(f32_to_bits(got), f32_to_bits(ref)) << h;
    ASSERT_EQ(cpu::float_to_half(ref), h) << h;
  }
  std::mt19937_64 rng(5);
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = uint32_t(rng());
    if (i % 2) bits = (bits & 0x807fffffu) | (uint32_t(100 + rng() % 50) << 23);  // around the f16 range
    const float f = bits_to_f32(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(cpu::float_to_half(f), f32_to_f16(f)) << std::hex << bits;
  }
}

// The ExpertsInterface: user backends are selectable by name and really used; names are unique; unknown names
// list the valid ones; deepgemm_megamoe is a load-time choice; GPU-only backends explain themselves on the CPU.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <sstream>

#include "test_experts_problem.h"

using namespace moekit;
using namespace moekit::test;

namespace {

ExpertsProblem small_problem() {
  ProblemConfig c;
  c.T = 6;
  c.E = 4;
  c.K = 2;
  c.H = 16;
  c.I = 8;
  return make_problem(c, 77);
}

// Removes a user backend at scope exit (also when a test fails).
struct Registered {
  std::string name;
  ~Registered() { ExpertsInterface::global().unregister_backend(name); }
};

// A backend written as a class: forwards to grouped_mm, counts its calls, refuses bf16 activations.
class CountingBackend final : public ExpertsBackend {
 public:
  mutable std::atomic<int> runs{0}, prepares{0};
  std::string_view name() const override { return "test_counting"; }
  std::string_view description() const override { return "grouped_mm, counted"; }
  Support available(Device d) const override {
    return d.is_cpu() ? Support::yes() : Support::no("test_counting runs on the CPU only");
  }
  Support supports(const Experts& e, DType act) const override {
    if (act == DType::bf16) return Support::no("test_counting refuses bf16 activations; use grouped_mm");
    return available(e.device());
  }
  void prepare(const Experts&) const override { ++prepares; }
  void run(const Experts& e, const ExpertsCall& call) const override {
    ++runs;
    ExpertsInterface::global().get("grouped_mm")->run(e, call);
  }
};

}  // namespace

TEST(Registry, UserFunctionIsSelectableByNameAndUsed) {
  ExpertsProblem p = small_problem();
  int calls = 0;
  Registered guard{"test_double_input"};
  // out = 2 * hidden_states: a transform no real backend computes.
  ExpertsInterface::global().register_backend("test_double_input", [&](const Experts&, const ExpertsCall& c) {
    ++calls;
    for (int64_t i = 0; i < c.out.numel(); ++i) c.out.ptr<float>()[i] = 2.0f * c.hidden_states.ptr<float>()[i];
  });
  EXPECT_TRUE(ExpertsInterface::global().contains("test_double_input"));
  EXPECT_FALSE(ExpertsInterface::global().is_builtin("test_double_input"));
  p.experts.set_implementation("test_double_input");
  EXPECT_EQ(p.experts.implementation(), "test_double_input");
  const Tensor out = p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights);
  EXPECT_EQ(calls, 1);
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.ptr<float>()[i], 2.0f * p.hidden_states.ptr<float>()[i]);
  // Back to a built-in: the user function is no longer called and the result is the experts' output.
  p.experts.set_implementation("grouped_mm");
  const Tensor out2 = p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights);
  EXPECT_EQ(calls, 1);
  EXPECT_LT(relative_l2(out2.view(), p.reference), 1e-5);
  // Listed after the built-ins.
  const auto names = ExpertsInterface::global().names();
  EXPECT_EQ(names.back(), "test_double_input");
}

TEST(Registry, UserClassBackendIsPreparedRunAndCanRefuse) {
  ExpertsProblem p = small_problem();
  auto backend = std::make_shared<CountingBackend>();
  ExpertsInterface::global().register_backend(backend);
  Registered guard{"test_counting"};
  p.experts.set_implementation("test_counting");
  const Tensor out = p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights);
  EXPECT_EQ(backend->runs.load(), 1);
  EXPECT_EQ(backend->prepares.load(), 1);
  EXPECT_LT(relative_l2(out.view(), p.reference), 1e-5);
  // Prepared once per module: not again on the next forward, nor on a copy (which shares the state); again
  // after clear_state() and for a module with its own weights.
  p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights);
  const Experts copy = p.experts;
  copy.forward(p.hidden_states, p.top_k_index, p.top_k_weights);
  EXPECT_EQ(backend->runs.load(), 3);
  EXPECT_EQ(backend->prepares.load(), 1);
  p.experts.clear_state();
  p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights);
  EXPECT_EQ(backend->prepares.load(), 2);
  p.experts.to(Device::cpu()).forward(p.hidden_states, p.top_k_index, p.top_k_weights);
  EXPECT_EQ(backend->prepares.load(), 3);
  // Its refusal reaches the caller with the backend's reason.
  const Tensor xb = p.hidden_states.to(DType::bf16);
  ErrorCode code{};
  const std::string msg = error_of([&] { p.experts.forward(xb, p.top_k_index, p.top_k_weights); }, &code);
  EXPECT_EQ(code, ErrorCode::not_supported);
  EXPECT_NE(msg.find("refuses bf16"), std::string::npos) << msg;
  EXPECT_NE(msg.find("test_counting"), std::string::npos) << msg;
  EXPECT_EQ(backend->runs.load(), 5);
}

TEST(Registry, DuplicateAndBuiltinNamesAreRejected) {
  auto& reg = ExpertsInterface::global();
  auto noop = [](const Experts&, const ExpertsCall&) {};
  Registered guard{"test_dup"};
  reg.register_backend("test_dup", noop);
  std::string msg = error_of([&] { reg.register_backend("test_dup", noop); });
  EXPECT_NE(msg.find("test_dup"), std::string::npos) << msg;
  EXPECT_NE(msg.find("already registered"), std::string::npos) << msg;
  EXPECT_NO_THROW(reg.register_backend("test_dup", noop, {DeviceType::cpu}, "second", /*replace=*/true));
  for (const char* builtin : {"eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe", "deepgemm_megamoe"}) {
    msg = error_of([&] { reg.register_backend(builtin, noop, {DeviceType::cpu}, "x", /*replace=*/true); });
    EXPECT_NE(msg.find("built-in"), std::string::npos) << builtin << ": " << msg;
    EXPECT_THROW(reg.unregister_backend(builtin), Error) << builtin;
  }
  EXPECT_TRUE(reg.unregister_backend("test_dup"));
  EXPECT_FALSE(reg.unregister_backend("test_dup"));
  EXPECT_THROW(reg.register_backend(nullptr), Error);
  EXPECT_THROW(reg.register_backend("test_empty_fn", ExpertsInterface::ForwardFn{}), Error);
}

TEST(Registry, UnknownNameListsValidNames) {
  ExpertsProblem p = small_problem();
  Registered guard{"test_listed"};
  ExpertsInterface::global().register_backend("test_listed", [](const Experts&, const ExpertsCall&) {});
  for (const auto& attempt : std::vector<std::function<void()>>{
           [&] { p.experts.set_implementation("grouped_mmm"); },
           [&] {
             Tensor out = Tensor::empty(p.hidden_states.shape(), DType::f32);
             p.experts.forward_with("grouped_mmm", ExpertsCall{p.hidden_states.view(), p.top_k_index.view(),
                                                               p.top_k_weights.view(), out.view(), nullptr});
           },
           [&] { Experts(p.experts.spec(), p.experts.weights(), "grouped_mmm"); }}) {
    ErrorCode code{};
    const std::string msg = error_of(attempt, &code);
    EXPECT_EQ(code, ErrorCode::not_found) << msg;
    EXPECT_NE(msg.find("'grouped_mmm'"), std::string::npos) << msg;
    for (const auto& n : ExpertsInterface::global().names()) EXPECT_NE(msg.find(n), std::string::npos) << n;
  }
  EXPECT_EQ(p.experts.implementation(), "eager");  // unchanged by the failed switch
}

TEST(Registry, DeepgemmMegamoeIsALoadTimeChoice) {
  ExpertsProblem p = small_problem();
  ErrorCode code{};
  std::string msg = error_of([&] { p.experts.set_implementation("deepgemm_megamoe"); }, &code);
  EXPECT_EQ(code, ErrorCode::not_supported);
  EXPECT_NE(msg.find("load-time"), std::string::npos) << msg;
  EXPECT_EQ(p.experts.implementation(), "eager");
  // Loaded with it: switching away is an error too, and on the CPU the forward explains what it needs.
  Experts mega(p.experts.spec(), p.experts.weights(), "deepgemm_megamoe");
  EXPECT_EQ(mega.implementation(), "deepgemm_megamoe");
  msg = error_of([&] { mega.set_implementation("grouped_mm"); }, &code);
  EXPECT_EQ(code, ErrorCode::not_supported);
  EXPECT_NE(msg.find("load-time"), std::string::npos) << msg;
  EXPECT_NO_THROW(mega.set_implementation("deepgemm_megamoe"));
  msg = error_of([&] { mega.forward(p.hidden_states, p.top_k_index, p.top_k_weights); }, &code);
  EXPECT_EQ(code, ErrorCode::not_supported);
  EXPECT_NE(msg.find("SM100"), std::string::npos) << msg;
  // Nor can a call pick another backend on a module loaded with it (or it on another).
  Tensor out = Tensor::empty(p.hidden_states.shape(), DType::f32);
  const ExpertsCall call{p.hidden_states.view(), p.top_k_index.view(), p.top_k_weights.view(), out.view(), nullptr};
  EXPECT_THROW(mega.forward_with("eager", call), Error);
  EXPECT_THROW(p.experts.forward_with("deepgemm_megamoe", call), Error);
}

TEST(Registry, GpuOnlyBackendsGiveAReasonOnTheCpu) {
  ExpertsProblem p = small_problem();
  for (const char* name : {"deepgemm", "sonicmoe", "deepgemm_megamoe"}) {
    const auto b = ExpertsInterface::global().get(name);
    const Support s = b->available(Device::cpu());
    EXPECT_FALSE(s.ok) << name;
    EXPECT_NE(s.reason.find("CUDA"), std::string::npos) << name << ": " << s.reason;
    EXPECT_FALSE(b->supports(p.experts, DType::f32).ok) << name;
    if (std::string(name) == "deepgemm_megamoe") continue;  // load-time choice: covered above
    p.experts.set_implementation(name);
    ErrorCode code{};
    const std::string msg =
        error_of([&] { p.experts.forward(p.hidden_states, p.top_k_index, p.top_k_weights); }, &code);
    EXPECT_EQ(code, ErrorCode::not_supported) << msg;
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
    EXPECT_NE(msg.find(s.reason), std::string::npos) << msg;
  }
  // A user backend registered for CUDA only says so on the CPU.
  Registered guard{"test_cuda_only"};
  ExpertsInterface::global().register_backend("test_cuda_only", [](const Experts&, const ExpertsCall&) {},
                                              {DeviceType::cuda});
  const Support s = ExpertsInterface::global().get("test_cuda_only")->available(Device::cpu());
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("cpu"), std::string::npos) << s.reason;
}

// A built-in that runs on no device in this build claims nothing: not capturable, no dtypes, the same reason
// on every device, a reason naming a backend that runs.
TEST(Registry, BackendsThatRunNowhereClaimNothing) {
  auto& reg = ExpertsInterface::global();
  int nowhere = 0;
  for (const auto& b : reg.backends()) {
    if (!reg.is_builtin(b->name()) || !b->devices().empty()) continue;
    ++nowhere;
    EXPECT_FALSE(b->graph_capturable()) << b->name();
    EXPECT_TRUE(b->weight_dtypes().empty()) << b->name();
    const Support cpu = b->available(Device::cpu()), gpu = b->available(Device::cuda(0));
    EXPECT_FALSE(cpu.ok) << b->name();
    EXPECT_FALSE(gpu.ok) << b->name();
    EXPECT_EQ(cpu.reason, gpu.reason) << b->name();
    EXPECT_NE(cpu.reason.find("grouped_mm"), std::string::npos) << cpu.reason;
    EXPECT_EQ(cpu.reason.find("dequantize"), std::string::npos) << cpu.reason;
  }
  EXPECT_GE(nowhere, 1);  // deepgemm_megamoe in this build
  // Exactly one built-in is load-time only, and it is the one SPEC section 2 names.
  for (const auto& b : reg.backends())
    EXPECT_EQ(b->load_time_only(), b->name() == "deepgemm_megamoe") << b->name();
}

TEST(Registry, DefaultIsGroupedMmOnTheCpu) {
  ExpertsProblem p = small_problem();
  const Experts e(p.experts.spec(), p.experts.weights());
  EXPECT_EQ(e.implementation(), "grouped_mm");
  EXPECT_EQ(default_experts_implementation(e, DType::bf16), "grouped_mm");
  EXPECT_EQ(default_experts_implementation(Device::cpu()), "grouped_mm");
  // SPEC section 4: the decode steps of GPU generation switch grouped_mm to batched_mm.
  EXPECT_EQ(ExpertsInterface::global().get("grouped_mm")->decode_backend(), "batched_mm");
}

// `moekit backends` says exactly what runs on this build and device: "yes" only for a backend available
// there, "capturable" only for one that runs on CUDA and can be captured, and the reason where it does not run.
TEST(Registry, BackendsCommandPrintsWhatRunsHere) {
  for (const Device dev : {Device::cpu(), Device::cuda(0)}) {
    std::string out;
    FILE* pipe = popen((std::string(MOEKIT_CLI) + " backends --device " + (dev.is_cpu() ? "cpu" : "cuda")).c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    char buf[4096];
    while (fgets(buf, sizeof buf, pipe)) out += buf;
    EXPECT_EQ(pclose(pipe), 0) << out;
    for (const auto& b : ExpertsInterface::global().backends()) {
      if (!ExpertsInterface::global().is_builtin(b->name())) continue;
      std::istringstream lines(out);
      std::string line, found;
      while (std::getline(lines, line))
        if (line.rfind(std::string(b->name()) + " ", 0) == 0) found = line;
      ASSERT_FALSE(found.empty()) << b->name() << " missing from:\n" << out;
      std::istringstream cols(found);
      std::string name, runs, graph;
      cols >> name >> runs >> graph;
      const Support s = b->available(dev);
      EXPECT_EQ(runs, s.ok ? "yes" : "no") << found;
      EXPECT_EQ(graph == "capturable", s.ok && dev.is_cuda() && b->graph_capturable()) << found;
      if (!s.ok) EXPECT_NE(found.find(s.reason), std::string::npos) << found;
    }
  }
}

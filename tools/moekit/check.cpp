// moekit check --case FILE: runs one Experts case file against its expected outputs.
#include <fmt/core.h>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "experts_case.h"
#include "moekit/interface.h"

namespace moekit::cli {
void add_check_command(CLI::App& app) {
  struct Opts {
    std::string file, backend = "all", device = "cpu";
    double tolerance = -1;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("check", "run an Experts case file with each backend and compare with its outputs");
  cmd->add_option("--case", o->file, "case file (safetensors: weights, inputs, out.*, meta)")->required();
  cmd->add_option("--backend", o->backend, "backend name or all");
  cmd->add_option("--device", o->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--tolerance", o->tolerance, "relative L2 tolerance (default: experts_tolerance of the activation dtype)");
  cmd->callback([o] {
    const Device dev = Device::parse(o->device);
    ExpertsCase c = load_experts_case(o->file);
    const Experts experts = c.experts.to(dev);
    std::vector<std::string> names;
    if (o->backend == "all") {
      for (const auto& b : ExpertsInterface::global().backends())
        if (b->available(dev)) names.emplace_back(b->name());
    } else {
      ExpertsInterface::global().get(o->backend);
      names.push_back(o->backend);
    }
    const double tol = o->tolerance > 0 ? o->tolerance : experts_tolerance(c.hidden_states.dtype());
    const auto ref = reference_output(c);
    fmt::print("case {}: T={} H={} E={} K={} {}\n", o->file, c.hidden_states.size(0), c.experts.spec().hidden,
               c.experts.spec().num_experts, c.top_k_index.size(1), c.experts.spec().to_string());
    fmt::print("  reference (f64) vs transformers out.{}: rel L2 {:.3e}\n", c.expected_name,
               relative_error(c.expected, ref));
    int failures = 0;
    for (const auto& n : names) {
      const Support s = ExpertsInterface::global().get(n)->supports(experts, c.hidden_states.dtype());
      if (!s) {
        fmt::print("  {:<18} NOT SUPPORTED  {}\n", n, s.reason);
        if (o->backend != "all") ++failures;
        continue;
      }
      Tensor x = c.hidden_states.to(dev), idx = c.top_k_index.to(dev), w = c.top_k_weights.to(dev);
      Tensor out = Tensor::empty(x.shape(), x.dtype(), dev);
      poison_tensor(out);
      experts.forward_with(n, ExpertsCall{x.view(), idx.view(), w.view(), out.view(), nullptr});
      const double err_hf = relative_error(out.view(), c.expected_values);
      const double err_ref = relative_error(out.view(), ref);
      const bool ok = err_hf <= tol;
      failures += !ok;
      fmt::print("  {:<18} {}  rel L2 vs transformers {:.3e}, vs f64 reference {:.3e} (tolerance {:.0e})\n", n,
                 ok ? "OK  " : "FAIL", err_hf, err_ref, tol);
    }
    if (failures) MOEKIT_FAIL(invalid_argument, failures, " backend(s) exceeded the tolerance on ", o->file);
  });
}
}  // namespace moekit::cli

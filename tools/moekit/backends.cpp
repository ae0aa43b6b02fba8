// moekit backends [--device cpu|cuda]: what runs here, and why not.
#include <fmt/core.h>

#include "commands.h"
#include "inspect.h"
#include "moekit/interface.h"

namespace moekit::cli {
void add_backends_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("backends", "list the experts backends, whether each runs here, and why not");
  auto device = std::make_shared<std::string>("cpu");
  cmd->add_option("--device", *device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->callback([device] {
    const Device dev = Device::parse(*device);
    fmt::print("{:<18} {:<6} {:<10} {}\n", "backend", "runs", "graphs", "notes");
    for (const auto& b : ExpertsInterface::global().backends()) {
      const Support s = b->available(dev);
      fmt::print("{:<18} {:<6} {:<10} {}\n", b->name(), s.ok ? "yes" : "no",
                 b->graph_capturable() ? "capturable" : "no", s.ok ? std::string(b->description()) : s.reason);
    }
    if (dev.is_cpu()) fmt::print("\nCPU GEMM kernels: {}\n", tools::cpu_gemm_summary());
  });
}
}  // namespace moekit::cli

// moekit backends [--device cpu|cuda]: what runs on this build and this device, and why not.
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
    fmt::print("experts backends on {} in this build:\n", dev.to_string());
    fmt::print("{:<18} {:<5} {:<11} {}\n", "backend", "runs", "CUDA graph", "what it does (or why it does not run here)");
    for (const auto& b : ExpertsInterface::global().backends()) {
      const Support s = b->available(dev);
      // Capture applies to a backend that runs on a CUDA device.
      const char* graph = !s.ok || !dev.is_cuda() ? "-" : b->graph_capturable() ? "capturable" : "no";
      std::string notes = s.ok ? std::string(b->description()) : s.reason;
      if (s.ok && dev.is_cuda() && b->needs_host_sync()) notes += "; synchronises with the host";
      if (b->load_time_only()) notes += "; load-time choice";
      fmt::print("{:<18} {:<5} {:<11} {}\n", b->name(), s.ok ? "yes" : "no", graph, notes);
    }
    if (dev.is_cpu()) fmt::print("\nCPU GEMM kernels: {}\n", tools::cpu_gemm_summary());
  });
}
}  // namespace moekit::cli

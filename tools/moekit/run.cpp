// Placeholder until the command lands.
#include "commands.h"
#include "moekit/error.h"

namespace moekit::cli {
void add_run_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "not built yet");
  cmd->allow_extras();
  cmd->callback([] { MOEKIT_FAIL(not_supported, "moekit run is not available in this build"); });
}
}  // namespace moekit::cli

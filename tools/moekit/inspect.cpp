// Placeholder until the command lands.
#include "commands.h"
#include "moekit/error.h"

namespace moekit::cli {
void add_inspect_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("inspect", "not built yet");
  cmd->allow_extras();
  cmd->callback([] { MOEKIT_FAIL(not_supported, "moekit inspect is not available in this build"); });
}
}  // namespace moekit::cli

// moekit inspect FILE|DIR: what a safetensors file or a checkpoint folder holds. Malformed files are
// errors (exit status 2, the reason on stderr).
#include "commands.h"
#include "inspect.h"

namespace moekit::cli {

void add_inspect_command(CLI::App& app) {
  struct Opts {
    std::string path;
    bool summary = false;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("inspect", "show what a safetensors file or a checkpoint folder holds, validating it");
  cmd->add_option("path", o->path, "a .safetensors file, or a checkpoint folder (or its config.json / index)")->required();
  cmd->add_flag("--summary", o->summary, "totals and config only, no tensor list");
  cmd->callback([o] {
    tools::print_inspection(o->path, !o->summary);
  });
}

}  // namespace moekit::cli

// moekit: command-line entry point.
#include <fmt/core.h>

#include "commands.h"
#include "moekit/error.h"
#include "moekit/version.h"

int main(int argc, char** argv) {
  CLI::App app{"moekit: Mixture-of-Experts experts backends, model runtime and benchmarks"};
  app.set_version_flag("--version", "moekit " MOEKIT_VERSION_STRING);
  app.require_subcommand(1);
  moekit::cli::add_backends_command(app);
  moekit::cli::add_check_command(app);
  moekit::cli::add_tiny_command(app);
  moekit::cli::add_run_command(app);
  moekit::cli::add_inspect_command(app);
  moekit::cli::add_bench_command(app);
  moekit::cli::add_tokenize_command(app);
  moekit::cli::add_quantize_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const moekit::Error& e) {
    fmt::print(stderr, "moekit: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "moekit: error: {}\n", e.what());
    return 2;
  }
  return 0;
}

// The CLI's subcommands: each file adds one to the app.
#pragma once
#include <CLI/CLI.hpp>

namespace moekit::cli {
void add_backends_command(CLI::App& app);  // backends.cpp
void add_check_command(CLI::App& app);     // check.cpp
void add_tiny_command(CLI::App& app);      // tiny.cpp
void add_run_command(CLI::App& app);       // run.cpp
void add_inspect_command(CLI::App& app);   // inspect.cpp
void add_bench_command(CLI::App& app);     // bench.cpp
void add_tokenize_command(CLI::App& app);  // tokenize.cpp
void add_quantize_command(CLI::App& app);  // quantize.cpp
}  // namespace moekit::cli

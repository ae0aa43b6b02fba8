// What the CLI shows of safetensors files, checkpoint folders and this machine's CPU kernels.
#pragma once
#include <cstdint>
#include <string>

namespace moekit::tools {

// Prints what a .safetensors file, or a checkpoint folder (or its config.json / index), holds: totals per
// dtype, the config's main fields and, when `list`, every tensor. Throws Error(io) for a malformed file.
void print_inspection(const std::string& path, bool list);

struct CheckpointTotals {
  size_t tensors = 0, files = 0;
  uint64_t bytes = 0;
};
// Opens a checkpoint folder as the model loader does (validating every file) and counts what it holds.
CheckpointTotals checkpoint_totals(const std::string& dir);

// "avx512 (this CPU runs scalar, avx2, avx512; MOEKIT_CPU_ISA=... picks one)": the CPU GEMM kernels in use.
std::string cpu_gemm_summary();

}  // namespace moekit::tools

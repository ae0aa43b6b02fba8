// libFuzzer: the CLI's parsers of --prompt-ids, --seed and --experts (NAME or KEY=NAME,... maps).
#include <cstdint>
#include <string>

#include "moekit/error.h"
#include "moekit/model.h"
#include "parse.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto ids = moekit::cli::parse_ids(text);
    if (ids.empty()) __builtin_trap();
    std::string back;
    for (int64_t v : ids) back += (back.empty() ? "" : ",") + std::to_string(v);
    if (moekit::cli::parse_ids(back) != ids) __builtin_trap();  // the canonical form reads back the same
  } catch (const moekit::Error&) {
  }
  try {
    const uint64_t s = moekit::cli::parse_seed(text);
    if (moekit::cli::parse_seed(std::to_string(s)) != s) __builtin_trap();
  } catch (const moekit::Error&) {
  }
  try {
    const auto impl = moekit::ExpertsImplementation::parse(text);
    (void)impl.to_string();
  } catch (const moekit::Error&) {
  }
  return 0;
}

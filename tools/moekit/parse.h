// The CLI's strict parsers for values given on the command line (token ids, seeds), shared by the
// subcommands and the fuzz targets. Each throws Error(invalid_argument) naming the flag and the text.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moekit/error.h"

namespace moekit::cli {

// A decimal integer: an optional '-' (when allowed) and digits only, no spaces or '+', within int64
// (or uint64). Returns false when `text` is not one.
inline bool parse_decimal(const std::string& text, bool allow_negative, uint64_t max_magnitude, bool& negative,
                          uint64_t& magnitude) {
  size_t i = 0;
  negative = false;
  if (allow_negative && !text.empty() && text[0] == '-') negative = true, i = 1;
  if (i >= text.size() || text.size() - i > 20) return false;
  magnitude = 0;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c < '0' || c > '9') return false;
    const uint64_t d = uint64_t(c - '0');
    if (magnitude > (max_magnitude - d) / 10) return false;
    magnitude = magnitude * 10 + d;
  }
  return true;
}

// "1,2,3" -> {1, 2, 3}. Every item a decimal int64; at least one.
inline std::vector<int64_t> parse_ids(const std::string& text, const char* flag = "--prompt-ids") {
  std::vector<int64_t> ids;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    bool neg = false;
    uint64_t mag = 0;
    const bool ok = parse_decimal(item, true, uint64_t(INT64_MAX), neg, mag);
    MOEKIT_CHECK(ok, flag, ": '", printable(item, 40),
                 "' is not an integer (expected a comma-separated list such as 1,2,3)");
    ids.push_back(neg ? -int64_t(mag) : int64_t(mag));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return ids;
}

// A seed: decimal digits within [0, 2^64 - 1].
inline uint64_t parse_seed(const std::string& text, const char* flag = "--seed") {
  bool neg = false;
  uint64_t v = 0;
  MOEKIT_CHECK(parse_decimal(text, false, UINT64_MAX, neg, v), flag, ": '", printable(text, 40),
               "' is not a seed (an integer in [0, 18446744073709551615])");
  return v;
}

}  // namespace moekit::cli

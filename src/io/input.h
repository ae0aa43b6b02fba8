// Internal: untrusted input files and JSON, read within fixed bounds. Regular files only (a FIFO, a
// device or a directory is a clear error, never a hang); JSON parsed in linear time with a nesting
// limit and, where asked, duplicate keys refused; values and names quoted in messages within bounds.
#pragma once
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "moekit/error.h"

namespace moekit {

// Deeper JSON is refused: no config or header nests anywhere near this.
constexpr int kMaxJsonDepth = 128;

struct JsonLimits {
  int max_depth = kMaxJsonDepth;  // objects and arrays nested deeper are refused
  size_t max_array = SIZE_MAX;    // elements in one array at most
  bool reject_duplicate_keys = false;
};

// Checks `text` against `limits` (and that it is valid JSON) without building it: one linear pass.
// Returns "" or a sentence saying what is wrong ("not valid JSON (...)", "nests deeper than ...",
// "has the key 'k' more than once").
std::string json_precheck(const char* begin, const char* end, const JsonLimits& limits);

// Parses JSON text within `limits`; throws Error(io) "SOURCE: <problem>".
nlohmann::json parse_json_bounded(const char* begin, const char* end, const std::string& source,
                                  const JsonLimits& limits = {});
inline nlohmann::json parse_json_bounded(const std::string& text, const std::string& source,
                                         const JsonLimits& limits = {}) {
  return parse_json_bounded(text.data(), text.data() + text.size(), source, limits);
}

// At most `max_chars` characters of v's JSON text ("..." when cut), without dumping all of it.
std::string json_brief(const nlohmann::json& v, size_t max_chars = 60);

// printable(s, max_chars) (a value quoted in a message) is public: moekit/error.h.

// Throws unless `path` is a regular file: Error(not_found) "PATH: no such file", Error(io) for a
// directory ("is a directory (not a regular file)") or anything else ("is a FIFO ..."). Returns its size.
uint64_t require_regular_file(const std::string& path);

// The whole of a regular file of at most `max_bytes` bytes; throws as require_regular_file, and
// Error(io) naming the size when it is larger.
std::string read_regular_file(const std::string& path, uint64_t max_bytes);

// config.json, generation_config.json and index files are small: larger ones are refused.
constexpr uint64_t kMaxJsonFileBytes = 64ull << 20;

}  // namespace moekit

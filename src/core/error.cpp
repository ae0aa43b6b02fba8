#include "moekit/error.h"

namespace moekit {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::not_supported: return "not_supported";
    case ErrorCode::not_found: return "not_found";
    case ErrorCode::io: return "io";
    case ErrorCode::runtime: return "runtime";
    case ErrorCode::internal: return "internal";
  }
  return "unknown";
}

namespace detail {
[[noreturn]] void throw_error(ErrorCode code, const std::string& message, const char* file, int line) {
  if (code == ErrorCode::internal) throw Error(code, concat(message, " (", file, ":", line, ")"));
  throw Error(code, message);
}
}  // namespace detail

}  // namespace moekit

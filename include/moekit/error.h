// moekit: errors. Public functions throw moekit::Error with a message naming the offending value.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace moekit {

enum class ErrorCode {
  invalid_argument,  // shape, dtype, value out of range
  not_supported,     // a backend or feature cannot run here
  not_found,         // unknown backend name, missing tensor or file
  io,                // file cannot be read or is malformed
  runtime,           // device or library failure (CUDA, cuBLAS)
  internal,          // broken invariant: a bug in moekit
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// `s` as quoted in a message: control characters and NUL as \xNN, cut to `max_chars` with "...".
std::string printable(std::string_view s, size_t max_chars = 200);

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
[[noreturn]] void throw_error(ErrorCode code, const std::string& message, const char* file, int line);
}  // namespace detail

}  // namespace moekit

// MOEKIT_CHECK(cond, "hidden_states must be 2-D, got ", ndim, " dimensions");
#define MOEKIT_CHECK(cond, ...)                                                                   \
  do {                                                                                            \
    if (!(cond))                                                                                  \
      ::moekit::detail::throw_error(::moekit::ErrorCode::invalid_argument,                        \
                                    ::moekit::detail::concat(__VA_ARGS__), __FILE__, __LINE__);   \
  } while (0)

// Same, with an explicit error code.
#define MOEKIT_CHECK_CODE(cond, code, ...)                                                        \
  do {                                                                                            \
    if (!(cond))                                                                                  \
      ::moekit::detail::throw_error(::moekit::ErrorCode::code,                                    \
                                    ::moekit::detail::concat(__VA_ARGS__), __FILE__, __LINE__);   \
  } while (0)

#define MOEKIT_FAIL(code, ...)                                                                    \
  ::moekit::detail::throw_error(::moekit::ErrorCode::code, ::moekit::detail::concat(__VA_ARGS__), \
                                __FILE__, __LINE__)

// Internal invariant, always on (also in release builds).
#define MOEKIT_ASSERT(cond)                                                                       \
  do {                                                                                            \
    if (!(cond))                                                                                  \
      ::moekit::detail::throw_error(::moekit::ErrorCode::internal,                                \
                                    "internal invariant failed: " #cond, __FILE__, __LINE__);     \
  } while (0)

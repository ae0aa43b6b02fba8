// Settings read from the environment: measurement switches and limits (docs and README name each one), read once
// per process, with a programmatic override for tests and benchmarks.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>

namespace moekit {

// Environment variable `name` as an integer; `fallback` when it is unset, empty or not a whole integer.
inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return end != v && *end == '\0' ? int64_t(n) : fallback;
}

// env_int within [lo, hi]; `fallback` outside that range too.
inline int64_t env_int_in(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  const int64_t v = env_int(name, fallback);
  return v >= lo && v <= hi ? v : fallback;
}

// An on/off setting: environment variable `name` (0 off, any other integer on; unset or not an integer: the
// fallback), read on first use; set() overrides it and returns the previous setting.
class EnvSwitch {
 public:
  constexpr EnvSwitch(const char* name, bool fallback) : name_(name), fallback_(fallback) {}
  EnvSwitch(const EnvSwitch&) = delete;
  EnvSwitch& operator=(const EnvSwitch&) = delete;

  bool on() {
    int v = v_.load(std::memory_order_relaxed);
    if (v < 0) {
      int expected = -1;
      v_.compare_exchange_strong(expected, env_int(name_, fallback_ ? 1 : 0) != 0 ? 1 : 0);
      v = v_.load(std::memory_order_relaxed);
    }
    return v == 1;
  }
  bool set(bool on) {
    const bool was = this->on();
    v_.store(on ? 1 : 0, std::memory_order_relaxed);
    return was;
  }

 private:
  const char* name_;
  bool fallback_;
  std::atomic<int> v_{-1};  // -1: not read yet
};

}  // namespace moekit

// libFuzzer: config.json parsing (every supported model_type, composite configs, rope parameters).
// Either a clean moekit::Error or a config whose sizes are sane.
#include <cstdint>
#include <string>

#include "moekit/config.h"
#include "moekit/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  // The first line may be a generation_config.json (split at the first NUL byte).
  const size_t nul = text.find('\0');
  const std::string config = nul == std::string::npos ? text : text.substr(0, nul);
  const std::string gen = nul == std::string::npos ? std::string() : text.substr(nul + 1);
  try {
    const moekit::ModelConfig c = moekit::ModelConfig::parse(config, "fuzz/config.json", gen);
    if (c.text.num_hidden_layers <= 0 || c.text.hidden_size <= 0 || c.text.vocab_size <= 0) __builtin_trap();
    (void)c.text.attention_scale();
  } catch (const moekit::Error&) {
  }
  return 0;
}

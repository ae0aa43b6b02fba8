// libFuzzer: SafetensorsFile::open on arbitrary bytes. Either a clean moekit::Error, or a file whose
// every tensor can be read end to end.
#include <cstdint>

#include "fuzz_util.h"
#include "moekit/error.h"
#include "moekit/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moekit::fuzz::MemFile f(data, size);
  if (!f.ok()) return 0;
  try {
    const auto st = moekit::SafetensorsFile::open(f.path());
    volatile uint8_t sink = 0;
    for (const auto& name : st.names()) {
      const moekit::Tensor t = st.get(name);
      const auto* p = static_cast<const uint8_t*>(t.data());
      for (size_t i = 0; i < t.nbytes(); ++i) sink = sink ^ p[i];
    }
  } catch (const moekit::Error&) {
  }
  return 0;
}

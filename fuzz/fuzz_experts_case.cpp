// libFuzzer: the Experts case reader (moekit check --case) on arbitrary bytes, and the f64 reference
// on every case it accepts (small ones), as `moekit check` runs it.
#include <cstdint>

#include "backends/reference.h"
#include "fuzz_util.h"
#include "experts_case.h"
#include "moekit/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moekit::fuzz::MemFile f(data, size);
  if (!f.ok()) return 0;
  try {
    const moekit::ExpertsCase c = moekit::load_experts_case(f.path());
    const auto& s = c.experts.spec();
    const double work = double(c.top_k_index.numel()) * double(s.hidden) * double(s.intermediate);
    if (work < 1e6) {
      const auto ref = moekit::reference_forward(c.experts, c.hidden_states, c.top_k_index, c.top_k_weights);
      (void)moekit::relative_l2(c.expected, ref);
    }
  } catch (const moekit::Error&) {
  }
  return 0;
}

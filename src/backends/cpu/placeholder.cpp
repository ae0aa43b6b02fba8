// Temporary: the reference loop behind all three CPU backends until the real ones land.
#include "backends/backends.h"
#include "backends/reference.h"

namespace moekit::cpu {

Support supports(const Experts& experts, DType act) {
  const DType w = experts.weight_dtype();
  if (w != DType::f32 && w != DType::bf16 && w != DType::f16)
    return Support::no(std::string("CPU backends take f32, bf16 or f16 weights, got ") + dtype_name(w));
  return Support::yes();
}

static void run_ref(const Experts& e, const ExpertsCall& c) {
  auto ref = reference_forward(e, c.hidden_states, c.top_k_index, c.top_k_weights);
  for (size_t i = 0; i < ref.size(); ++i) {
    const double v = ref[i];
    convert(&v, DType::f64, static_cast<uint8_t*>(c.out.data) + dtype_nbytes(c.out.dtype, int64_t(i)), c.out.dtype, 1);
  }
}
void eager(const Experts& e, const ExpertsCall& c) { run_ref(e, c); }
void batched_mm(const Experts& e, const ExpertsCall& c) { run_ref(e, c); }
void grouped_mm(const Experts& e, const ExpertsCall& c) { run_ref(e, c); }

}  // namespace moekit::cpu

// The order act::code_of assumes for moekit::Activation.
#include "base/activation.h"

#include "moekit/experts.h"

namespace moekit::act {
static_assert(int(Activation::silu) == 0 && int(Activation::gelu) == 1 && int(Activation::gelu_tanh) == 2 &&
                  int(Activation::relu) == 3 && int(Activation::sigmoid) == 4 && int(Activation::identity) == 5 &&
                  int(Activation::relu2) == 6,
              "act::code_of indexes its table by moekit::Activation's values");
}  // namespace moekit::act

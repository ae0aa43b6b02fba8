// Test helpers: random tensors, poisoning, fixtures.
#pragma once
#include <random>
#include <string>

#include "moekit/moekit.h"

namespace moekit::test {

std::string fixtures_dir();  // tests/fixtures
// Normal(0, std) values in `dtype` on the CPU.
Tensor randn(const Shape& shape, DType dtype, std::mt19937_64& rng, double std = 1.0);
// Fills a CPU or CUDA tensor with NaN (floating types) so unwritten outputs are caught.
void poison(Tensor& t);
// Random top-k routing: distinct experts per token, weights normalised to sum 1.
void random_routing(int64_t T, int64_t K, int64_t E, DType index_dtype, DType weight_dtype, std::mt19937_64& rng,
                    Tensor& index, Tensor& weights);

}  // namespace moekit::test

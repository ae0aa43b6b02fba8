// Test data for the greedy choice on the device (DeviceOps::argmax_rows): rows of logits and the host sampler's picks.
#pragma once
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "generate/sampling.h"
#include "moekit/moekit.h"

namespace moekit::test {

// Rows of logits for the greedy choice: values from few levels (ties), some -inf, ids to suppress (some out of
// range), a row whose every value is suppressed or -inf, and rows with a NaN or an Inf.
struct ArgmaxCase {
  Tensor logits;                  // [R, V] f32 on the CPU
  std::vector<int64_t> suppress;  // shared by the rows
  std::vector<int64_t> expect;    // [2R]: the host sampler's greedy id (finite rows), then the finite flag
};
inline ArgmaxCase argmax_case(int64_t R, int64_t V, std::mt19937_64& rng) {
  ArgmaxCase c;
  c.logits = Tensor::empty({R, V}, DType::f32);
  std::uniform_int_distribution<int> level(-3, 3), pick(0, int(V) - 1);
  float* p = c.logits.ptr<float>();
  for (int64_t i = 0; i < R * V; ++i) p[i] = 0.5f * float(level(rng));
  c.suppress = {int64_t(pick(rng)), int64_t(pick(rng)), V, -1, V + 7};
  for (int64_t r = 0; r < R; ++r) {
    float* row = p + r * V;
    if (r % 4 == 1) row[pick(rng)] = 9.0f;                   // one clear winner, sometimes suppressed below
    if (r % 4 == 2) row[c.suppress[0]] = 50.0f;              // the largest value is suppressed
    if (r % 5 == 3) row[pick(rng)] = -std::numeric_limits<float>::infinity();
    if (r == R - 1 && R > 2) {                               // every value -inf or suppressed: id 0
      for (int64_t i = 0; i < V; ++i) row[i] = -std::numeric_limits<float>::infinity();
    }
  }
  if (R > 3) p[2 * V + V / 2] = std::numeric_limits<float>::quiet_NaN();  // row 2: reported, not chosen
  if (R > 4) p[3 * V + V - 1] = std::numeric_limits<float>::infinity();   // row 3: likewise
  GenerationConfig gc;
  gc.do_sample = false;
  generate::TokenSampler sampler(gc);
  for (int64_t r = 0; r < R; ++r) {
    std::vector<float> row(p + r * V, p + (r + 1) * V);
    bool finite = true;
    for (float x : row) finite = finite && std::isfinite(x);
    c.expect.push_back(finite ? sampler.next(row, c.suppress) : -1);
    c.expect.push_back(finite ? 1 : 0);
  }
  return c;
}

}  // namespace moekit::test

#include "generate/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "moekit/error.h"

namespace moekit::generate {

TokenSampler::TokenSampler(const GenerationConfig& config) : config_(config), rng_(config.seed) {}

double TokenSampler::uniform() { return double(rng_() >> 11) * (1.0 / 9007199254740992.0); }

int64_t TokenSampler::next(std::vector<float>& logits, const std::vector<int64_t>& suppress,
                           const std::vector<int64_t>& history) {
  const int64_t V = int64_t(logits.size());
  MOEKIT_CHECK(V > 0, "cannot choose a token from empty logits");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (config_.repetition_penalty != 1.0f) {  // each distinct token of the sequence once
    seen_.assign(size_t(V), false);
    for (int64_t id : history) {
      if (id < 0 || id >= V || seen_[size_t(id)]) continue;
      seen_[size_t(id)] = true;
      float& l = logits[size_t(id)];
      l = l < 0 ? l * config_.repetition_penalty : l / config_.repetition_penalty;
    }
  }
  for (int64_t id : suppress)
    if (id >= 0 && id < V) logits[size_t(id)] = kNegInf;
  if (!config_.do_sample) {
    // torch.argmax: the first maximum; NaN counts as the largest value.
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i) {
      const float a = logits[size_t(i)], b = logits[size_t(best)];
      if (std::isnan(b)) break;
      if (std::isnan(a) || a > b) best = i;
    }
    return best;
  }
  // TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, then softmax and a multinomial draw.
  if (config_.temperature != 1.0f)
    for (auto& l : logits) l /= config_.temperature;
  if (config_.top_k > 0 && config_.top_k < V) {
    std::vector<float> sorted(logits);
    std::nth_element(sorted.begin(), sorted.begin() + (config_.top_k - 1), sorted.end(), std::greater<float>());
    const float kth = sorted[size_t(config_.top_k - 1)];
    for (auto& l : logits)
      if (l < kth) l = kNegInf;
  }
  const float mx = *std::max_element(logits.begin(), logits.end());
  MOEKIT_CHECK(std::isfinite(mx), "sampling: every token has probability 0 or the logits are not finite");
  std::vector<double> p(static_cast<size_t>(V));
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) sum += (p[size_t(i)] = std::exp(double(logits[size_t(i)]) - double(mx)));
  for (auto& x : p) x /= sum;
  if (config_.top_p < 1.0f) {
    // Drop the least likely tokens whose cumulative probability stays within 1 - top_p; keep at least one.
    order_.resize(size_t(V));
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) { return p[size_t(a)] < p[size_t(b)]; });
    double cum = 0;
    for (int64_t j = 0; j < V - 1; ++j) {
      cum += p[size_t(order_[size_t(j)])];
      if (cum > 1.0 - double(config_.top_p)) break;
      p[size_t(order_[size_t(j)])] = 0;
    }
    double s = 0;
    for (double x : p) s += x;
    for (auto& x : p) x /= s;
  }
  const double u = uniform();
  double cum = 0;
  int64_t last_nonzero = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (p[size_t(i)] <= 0) continue;
    last_nonzero = i;
    cum += p[size_t(i)];
    if (u < cum) return i;
  }
  return last_nonzero;
}

}  // namespace moekit::generate

// Model::generate: prefill then one token per step with the KV cache, EOS / min_new_tokens, sampling, and
// the decode-step switch of SPEC section 4 (restored by a guard, also when a step throws).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>

#include "core/checked.h"
#include "generate/sampling.h"
#include "model/model_impl.h"
#include "moekit/error.h"

namespace moekit {

void GenerationConfig::validate() const {
  MOEKIT_CHECK(max_new_tokens >= 0, "max_new_tokens must be >= 0, got ", max_new_tokens);
  MOEKIT_CHECK(min_new_tokens >= 0, "min_new_tokens must be >= 0, got ", min_new_tokens);
  if (do_sample) {
    MOEKIT_CHECK(temperature > 0, "temperature must be > 0 when sampling, got ", temperature);
    MOEKIT_CHECK(top_k >= 0, "top_k must be >= 0 (0 = off), got ", top_k);
    MOEKIT_CHECK(top_p > 0 && top_p <= 1, "top_p must be in (0, 1], got ", top_p);
  }
  MOEKIT_CHECK(repetition_penalty > 0, "repetition_penalty must be > 0 (1 = off), got ", repetition_penalty);
}

std::string GenerationConfig::to_string() const {
  std::ostringstream os;
  os << "GenerationConfig{.max_new_tokens=" << max_new_tokens << ", .min_new_tokens=" << min_new_tokens
     << ", .do_sample=" << (do_sample ? "true" : "false");
  if (do_sample)
    os << ", .temperature=" << temperature << ", .top_k=" << top_k << ", .top_p=" << top_p << ", .seed=" << seed;
  if (repetition_penalty != 1.0f) os << ", .repetition_penalty=" << repetition_penalty;
  if (eos_token_ids) {
    os << ", .eos_token_ids={";
    for (size_t i = 0; i < eos_token_ids->size(); ++i) os << (i ? ", " : "") << (*eos_token_ids)[i];
    os << "}";
  }
  os << ", .decode_switch="
     << (decode_switch == DecodeSwitch::automatic ? "automatic"
         : decode_switch == DecodeSwitch::always  ? "always"
                                                  : "never");
  if (decode_experts_implementation)
    os << ", .decode_experts_implementation=" << decode_experts_implementation->to_string();
  os << "}";
  return os.str();
}

double GenerationResult::tokens_per_s() const {
  return decode_ms > 0 ? double(decode_steps) * 1000.0 / decode_ms : 0.0;
}

namespace {
double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

constexpr int64_t kUpfrontTokens = 4096;

// Row r of the logits; throws naming the position when it holds NaN or Inf (weights or config values
// that make the forward non-finite would otherwise give arbitrary tokens and a successful exit).
std::vector<float> row(const Tensor& logits, int64_t r, int64_t position) {
  const int64_t V = logits.size(1);
  const float* p = logits.ptr<float>() + r * V;
  for (int64_t i = 0; i < V; ++i)
    MOEKIT_CHECK_CODE(std::isfinite(p[i]), runtime, "generate: the logits at position ", position,
                      " are not finite (token ", i, ": ", p[i],
                      "); the weights or the config (rms_norm_eps, rope theta, ...) give NaN or Inf");
  return std::vector<float>(p, p + V);
}
}  // namespace

GenerationResult Model::generate(const std::vector<int64_t>& prompt, const GenerationConfig& gc) {
  gc.validate();
  MOEKIT_CHECK(!prompt.empty(), "generate: the prompt is empty; give at least one token id");
  const std::vector<int64_t> eos = gc.eos_token_ids.value_or(impl_->config.eos_token_ids);
  GenerationResult res;

  ExpertsMapGuard guard(*this);  // restores the map however generation ends
  res.prefill_experts = guard.saved();
  res.decode_experts = gc.decode_experts_implementation
                           ? ExpertsMap()
                           : decode_experts_map(res.prefill_experts, device(), gc.decode_switch);
  if (gc.decode_experts_implementation) {
    // Validated and merged with the current map by a trial switch, then back to the prefill map.
    set_experts_implementation(*gc.decode_experts_implementation);
    res.decode_experts = get_experts_implementation();
    set_experts_implementation(res.prefill_experts);
  }
  if (gc.max_new_tokens == 0 && !gc.keep_prompt_logits) return res;
  const bool graphs = impl_->options.cuda_graph && device().is_cuda();
  if (graphs) impl_->require_capturable_experts(res.decode_experts);

  KvCache cache;
  // prompt + max_new_tokens must fit in int64 (checked); the cache is reserved for at most
  // kUpfrontTokens of it and grows (doubling) as tokens come, so a large max_new_tokens costs memory
  // only for the tokens actually generated.
  const int64_t total = checked_add(int64_t(prompt.size()), gc.max_new_tokens, "generate: prompt + max_new_tokens");
  impl_->reserve(cache, std::min(total, int64_t(prompt.size()) + kUpfrontTokens));
  generate::TokenSampler sampler(gc);
  std::vector<int64_t> history;  // for the repetition penalty
  if (gc.repetition_penalty != 1.0f) history = prompt;
  auto pick = [&](std::vector<float> logits) {
    const bool too_early = int64_t(res.tokens.size()) < gc.min_new_tokens;
    const int64_t tok = sampler.next(logits, too_early ? eos : std::vector<int64_t>{}, history);
    if (gc.repetition_penalty != 1.0f) history.push_back(tok);
    res.tokens.push_back(tok);
    if (gc.on_token) gc.on_token(tok);
    return tok;
  };
  auto done = [&](int64_t tok) {
    if (std::find(eos.begin(), eos.end(), tok) != eos.end()) {
      res.stopped_on_eos = true;
      return true;
    }
    return int64_t(res.tokens.size()) >= gc.max_new_tokens;
  };

  auto t0 = std::chrono::steady_clock::now();
  Tensor logits = impl_->forward(prompt, cache, gc.keep_prompt_logits);
  if (gc.keep_prompt_logits) res.prompt_logits = logits;
  int64_t tok = -1;
  if (gc.max_new_tokens > 0) tok = pick(row(logits, logits.size(0) - 1, int64_t(prompt.size()) - 1));
  res.prefill_ms = ms_since(t0);
  if (tok < 0 || done(tok)) return res;

  if (res.decode_experts != res.prefill_experts) set_experts_implementation(res.decode_experts);
  t0 = std::chrono::steady_clock::now();
  const int64_t replays0 = impl_->graph_replays;
  while (true) {
    logits = graphs ? impl_->decode_step_graphed(tok, cache) : impl_->forward({tok}, cache, false);
    ++res.decode_steps;
    tok = pick(row(logits, 0, cache.length() - 1));
    if (done(tok)) break;
  }
  res.decode_ms = ms_since(t0);
  res.graph_replays = impl_->graph_replays - replays0;
  return res;
}

}  // namespace moekit

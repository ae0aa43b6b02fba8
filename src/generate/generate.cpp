// Model::generate: prefill then one token per step with the KV cache, EOS / min_new_tokens, sampling, and
// the decode-step switch of SPEC section 4 (restored by a guard, also when a step throws).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>

#include "base/env.h"
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

// Row r of logits [., V] f32 on the host; throws naming the position when it holds NaN or Inf (weights or config
// values that make the forward non-finite would otherwise give arbitrary tokens and a successful exit).
std::vector<float> row(const float* logits, int64_t V, int64_t r, int64_t position) {
  const float* p = logits + r * V;
  for (int64_t i = 0; i < V; ++i)
    MOEKIT_CHECK_CODE(std::isfinite(p[i]), runtime, "generate: the logits at position ", position,
                      " are not finite (token ", i, ": ", p[i],
                      "); the weights or the config (rms_norm_eps, rope theta, ...) give NaN or Inf");
  return std::vector<float>(p, p + V);
}
std::vector<float> row(const Tensor& logits, int64_t r, int64_t position) {
  return row(logits.ptr<float>(), logits.size(1), r, position);
}

// Whether graphed decode steps pick greedy tokens on the device (only the ids come back): greedy decoding without
// a repetition penalty, at most DeviceOps::kMaxSuppress EOS ids, unless MOEKIT_DEVICE_GREEDY=0.
bool device_greedy(const GenerationConfig& gc, size_t eos_ids) {
  if (gc.do_sample || gc.repetition_penalty != 1.0f || eos_ids > model::DeviceOps::kMaxSuppress) return false;
  return env_int("MOEKIT_DEVICE_GREEDY", 1) != 0;
}
// The decode steps' map: decode_experts_implementation over the prefill map (validated by a trial switch,
// then back to the prefill map), else decode_switch's rule.
ExpertsMap decode_map(Model& model, const GenerationConfig& gc, const ExpertsMap& prefill) {
  if (!gc.decode_experts_implementation) return decode_experts_map(prefill, model.device(), gc.decode_switch);
  model.set_experts_implementation(*gc.decode_experts_implementation);
  ExpertsMap out = model.get_experts_implementation();
  model.set_experts_implementation(prefill);
  return out;
}

// The batch size bucket a graphed decode step of n sequences runs at: the next power of two.
int64_t bucket(int64_t n) {
  int64_t b = 1;
  while (b < n) b *= 2;
  return b;
}
}  // namespace

GenerationResult Model::generate(const std::vector<int64_t>& prompt, const GenerationConfig& gc) {
  gc.validate();
  MOEKIT_CHECK(!prompt.empty(), "generate: the prompt is empty; give at least one token id");
  const std::vector<int64_t> eos = gc.eos_token_ids.value_or(impl_->config.eos_token_ids);
  GenerationResult res;

  ExpertsMapGuard guard(*this);  // restores the map however generation ends
  res.prefill_experts = guard.saved();
  res.decode_experts = decode_map(*this, gc, res.prefill_experts);
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
  const bool on_device = graphs && device_greedy(gc, eos.size());
  const std::vector<int64_t> no_ids;
  // One graphed decode step: the token the device picked (EOS suppressed by `sup`), or the host's pick from the
  // logits that came back.
  auto graphed_step = [&](const std::vector<int64_t>* sup) {
    const auto out = impl_->decode_step_graphed(tok, cache, sup);
    ++res.decode_steps;
    if (out.ids.empty()) return pick(row(out.logits, out.V, 0, cache.length() - 1));
    res.tokens.push_back(out.ids[0]);
    if (gc.on_token) gc.on_token(out.ids[0]);
    return out.ids[0];
  };
  if (on_device && model::decode_ahead()) {
    // Steps run ahead: step n + 1 is queued (its token and position fed on the device) before step n's token is
    // read, so the host's part of a step overlaps the device's. A step that cannot (no recorded graph yet, the
    // cache full) and a pick that is not finite go through decode_step_graphed with nothing in flight.
    struct Drain {
      Model::Impl* impl;
      bool armed = false;
      ~Drain() {
        if (armed) try {
            impl->drain_ahead();  // the cache below must outlive the steps that write it
          } catch (...) {
          }
      }
    } drain{impl_.get()};
    int64_t pending = -1;  // the ticket of the queued step whose token is not read yet
    while (true) {
      const int64_t have = int64_t(res.tokens.size());
      const std::vector<int64_t>& sup_now = have < gc.min_new_tokens ? eos : no_ids;
      if (pending < 0) pending = impl_->enqueue_ahead(tok, cache, cache.length(), sup_now);
      if (pending < 0) {
        if (drain.armed) impl_->drain_ahead();
        drain.armed = false;
        tok = graphed_step(&sup_now);
        if (done(tok)) break;
        continue;
      }
      drain.armed = true;
      // The step after it, unless its token is the last one asked for.
      int64_t next = -1;
      if (have + 1 < gc.max_new_tokens)
        next = impl_->enqueue_ahead(-1, cache, cache.length() + 1, have + 1 < gc.min_new_tokens ? eos : no_ids);
      const auto [t, finite] = impl_->wait_ahead(pending, cache);
      pending = next;
      if (!finite) {  // the step again, the host's way: its logits come back and the sampler reports them
        impl_->drain_ahead();
        drain.armed = false;
        pending = -1;
        tok = graphed_step(&sup_now);
        if (done(tok)) break;
        continue;
      }
      ++res.decode_steps;
      tok = t;
      res.tokens.push_back(tok);
      if (gc.on_token) gc.on_token(tok);
      if (done(tok)) break;
    }
    if (drain.armed) impl_->drain_ahead();
    drain.armed = false;
    res.decode_ms = ms_since(t0);
    res.graph_replays = impl_->graph_replays - replays0;
    return res;
  }
  while (true) {
    if (graphs) {
      // Greedy: the device picks the token (EOS suppressed as the sampler would); else the logits come back.
      const bool too_early = int64_t(res.tokens.size()) < gc.min_new_tokens;
      tok = graphed_step(on_device ? (too_early ? &eos : &no_ids) : nullptr);
    } else {
      logits = impl_->forward({tok}, cache, false);
      ++res.decode_steps;
      tok = pick(row(logits, 0, cache.length() - 1));
    }
    if (done(tok)) break;
  }
  res.decode_ms = ms_since(t0);
  res.graph_replays = impl_->graph_replays - replays0;
  return res;
}

std::vector<GenerationResult> Model::generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                                   const GenerationConfig& gc) {
  gc.validate();
  MOEKIT_CHECK(!prompts.empty(), "generate_batch: no prompts; give at least one");
  MOEKIT_CHECK(!gc.keep_prompt_logits, "generate_batch: keep_prompt_logits applies to generate (one sequence)");
  for (size_t i = 0; i < prompts.size(); ++i)
    MOEKIT_CHECK(!prompts[i].empty(), "generate_batch: prompt ", i, " is empty; give at least one token id");
  const std::vector<int64_t> eos = gc.eos_token_ids.value_or(impl_->config.eos_token_ids);
  const size_t B = prompts.size();
  std::vector<GenerationResult> res(B);

  ExpertsMapGuard guard(*this);  // restores the map however generation ends
  const ExpertsMap prefill = guard.saved(), decode = decode_map(*this, gc, prefill);
  for (GenerationResult& r : res) {
    r.prefill_experts = prefill;
    r.decode_experts = decode;
    r.batch_size = int64_t(B);
  }
  if (gc.max_new_tokens == 0) return res;
  const bool graphs = impl_->options.cuda_graph && device().is_cuda();
  if (graphs) impl_->require_capturable_experts(decode);

  struct Sequence {
    KvCache cache;
    generate::TokenSampler sampler;
    std::vector<int64_t> history;  // for the repetition penalty
    int64_t last = -1;             // the last new token: the next step's input
    bool done = false;
  };
  std::vector<Sequence> seqs;
  seqs.reserve(B);
  for (size_t i = 0; i < B; ++i) {
    seqs.push_back(Sequence{KvCache(), generate::TokenSampler(gc), {}, -1, false});
    const int64_t n = int64_t(prompts[i].size());
    const int64_t total = checked_add(n, gc.max_new_tokens, "generate_batch: prompt + max_new_tokens");
    impl_->reserve(seqs[i].cache, std::min(total, n + kUpfrontTokens));
    if (gc.repetition_penalty != 1.0f) seqs[i].history = prompts[i];
  }
  // Sequence i's next token from row r of the logits [., V] on the host, or the token the device chose (picked >= 0).
  auto step_with = [&](size_t i, const float* logits, int64_t V, int64_t r, int64_t picked) {
    Sequence& q = seqs[i];
    GenerationResult& out = res[i];
    const bool too_early = int64_t(out.tokens.size()) < gc.min_new_tokens;
    int64_t tok = picked;
    if (tok < 0) {
      std::vector<float> l = row(logits, V, r, q.cache.length() - 1);
      tok = q.sampler.next(l, too_early ? eos : std::vector<int64_t>{}, q.history);
    }
    if (gc.repetition_penalty != 1.0f) q.history.push_back(tok);
    out.tokens.push_back(tok);
    q.last = tok;
    if (gc.on_sequence_token) gc.on_sequence_token(i, tok);
    if (std::find(eos.begin(), eos.end(), tok) != eos.end())
      out.stopped_on_eos = q.done = true;
    else if (int64_t(out.tokens.size()) >= gc.max_new_tokens)
      q.done = true;
  };
  auto step = [&](size_t i, const Tensor& logits, int64_t r) {
    step_with(i, logits.ptr<float>(), logits.size(1), r, -1);
  };
  const bool on_device = graphs && device_greedy(gc, eos.size());
  const std::vector<int64_t> no_ids;

  auto t0 = std::chrono::steady_clock::now();
  {
    std::vector<KvCache*> caches;
    for (Sequence& q : seqs) caches.push_back(&q.cache);
    const Tensor logits = impl_->forward_batch(prompts, caches);
    for (size_t i = 0; i < B; ++i) step(i, logits, int64_t(i));
  }
  const double prefill_ms = ms_since(t0);
  for (GenerationResult& r : res) r.prefill_ms = prefill_ms;

  if (decode != prefill) set_experts_implementation(decode);
  t0 = std::chrono::steady_clock::now();
  const int64_t replays0 = impl_->graph_replays;
  KvCache pad;                  // the cache of the slots that fill a graphed step up to its bucket
  std::vector<int64_t> slots;   // graphs: the sequence in each slot, -1 for padding
  while (true) {
    std::vector<size_t> active;
    for (size_t i = 0; i < B; ++i)
      if (!seqs[i].done) active.push_back(i);
    if (active.empty()) break;
    if (graphs) {
      // The slots change only when the unfinished sequences fit a smaller bucket (or on the first step).
      if (slots.empty() || bucket(int64_t(active.size())) < int64_t(slots.size())) {
        slots.assign(size_t(bucket(int64_t(active.size()))), -1);
        for (size_t s = 0; s < active.size(); ++s) slots[s] = int64_t(active[s]);
      }
      std::vector<int64_t> tokens;
      std::vector<KvCache*> caches;
      std::vector<bool> advance;
      for (int64_t i : slots) {
        tokens.push_back(i < 0 ? 0 : seqs[size_t(i)].last);
        caches.push_back(i < 0 ? &pad : &seqs[size_t(i)].cache);
        advance.push_back(i >= 0 && !seqs[size_t(i)].done);
      }
      // Greedy: the device picks every slot's token when the EOS suppression (min_new_tokens) is the same for all
      // the advancing sequences (it is: they have as many tokens each); else the logits come back.
      const std::vector<int64_t>* suppress = nullptr;
      if (on_device) {
        int early = -1;  // -1: none seen, 0 / 1: all the same so far, 2: mixed
        for (size_t sl = 0; sl < slots.size(); ++sl) {
          if (!advance[sl]) continue;
          const int e = int64_t(res[size_t(slots[sl])].tokens.size()) < gc.min_new_tokens ? 1 : 0;
          early = early < 0 || early == e ? e : 2;
        }
        if (early == 0 || early == 1) suppress = early == 1 ? &eos : &no_ids;
      }
      const auto out = impl_->decode_batch_graphed(tokens, caches, advance, suppress);
      for (size_t sl = 0; sl < slots.size(); ++sl)
        if (advance[sl]) {
          ++res[size_t(slots[sl])].decode_steps;
          step_with(size_t(slots[sl]), out.logits, out.V, int64_t(sl), out.ids.empty() ? -1 : out.ids[sl]);
        }
    } else {
      std::vector<std::vector<int64_t>> ids;
      std::vector<KvCache*> caches;
      for (size_t i : active) {
        ids.push_back({seqs[i].last});
        caches.push_back(&seqs[i].cache);
      }
      const Tensor logits = impl_->forward_batch(ids, caches);
      for (size_t a = 0; a < active.size(); ++a) {
        ++res[active[a]].decode_steps;
        step(active[a], logits, int64_t(a));
      }
    }
  }
  const double decode_ms = ms_since(t0);
  for (GenerationResult& r : res) {
    r.decode_ms = decode_ms;
    r.graph_replays = impl_->graph_replays - replays0;
  }
  return res;
}

}  // namespace moekit

// moekit: the model runtime: loading a checkpoint, choosing experts backends, generation
// (SPEC sections 3, 4 and 6).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/config.h"
#include "moekit/experts.h"
#include "moekit/parallel.h"
#include "moekit/tensor.h"

namespace moekit {

// experts_implementation per sub-config: "" is the top-level model, other keys are sub-config names
// (text_config, vision_config, ...).
using ExpertsMap = std::map<std::string, std::string>;

// What a caller asks for: one name for the model and every sub-model, or a map whose missing keys keep
// their value. Empty: nothing requested (defaults at load time, no change at run time).
class ExpertsImplementation {
 public:
  ExpertsImplementation() = default;
  ExpertsImplementation(std::string name);       // NOLINT: implicit on purpose, like transformers' str | dict
  ExpertsImplementation(const char* name);       // NOLINT
  ExpertsImplementation(ExpertsMap per_config);  // NOLINT

  // "grouped_mm" (every sub-model) or "=grouped_mm,text_config=eager" (a map; empty key = top level).
  static ExpertsImplementation parse(std::string_view text);

  bool empty() const { return !all_ && per_config_.empty(); }
  const std::optional<std::string>& all() const { return all_; }
  const ExpertsMap& per_config() const { return per_config_; }
  std::string to_string() const;

 private:
  std::optional<std::string> all_;
  ExpertsMap per_config_;
};

std::string experts_map_to_string(const ExpertsMap& m);  // {"": "grouped_mm", "text_config": "eager"}

// How far loading is: the decoder's tensors read so far (and their bytes as the checkpoint stores them) out
// of all it reads.
struct LoadProgress {
  int64_t tensors = 0, total_tensors = 0;
  uint64_t bytes = 0, total_bytes = 0;
};

struct ModelOptions {
  Device device = Device::cpu();
  // f32 | bf16 | f16 (weights converted at load); default: the checkpoint's dtype when it is one of them, else f32.
  std::optional<DType> dtype;
  // Default: grouped_mm where it can run, else eager.
  ExpertsImplementation experts_implementation;
  // Record one decode step in a CUDA graph and replay it for the following steps (CUDA devices only; the
  // decode experts backend must be capturable: batched_mm or grouped_mm). The first decode step of a
  // generation runs uncaptured, the second is recorded, every later one is a replay.
  bool cuda_graph = false;
  // Refuse weights holding NaN or Inf (one pass over the decoder's tensors at load). Default: on for
  // checkpoints up to 4 GiB, else off with a warning on stderr.
  std::optional<bool> check_finite;
  // Called as the weights are read (after each tensor, and once at the end with tensors == total_tensors);
  // may throw to abort the load. The CLI prints it on a terminal (`moekit run --progress` elsewhere).
  std::function<void(const LoadProgress&)> on_load_progress;
  // Expert parallelism: this rank's group (mpi_world_group(), one of nccl_local_groups()). With more than one
  // rank, each MoE layer loads and holds only this rank's slice of the experts (expert_slice) and runs them
  // through ParallelExperts in `ep_mode`; every rank runs the same calls (same prompt, same options).
  ExpertGroupPtr expert_group;
  EpMode ep_mode = EpMode::all_reduce;
  // FP8 checkpoints (quantization_config fp8, SPEC section 5): the routed experts stay FP8 (run by the CPU
  // backends) and every other quantized linear layer is dequantized at load; with dequantize, the experts are
  // dequantized to the model dtype too.
  bool dequantize = false;

  std::string to_string() const;
};

// The key/value cache of one sequence.
class KvCache {
 public:
  KvCache();
  ~KvCache();
  KvCache(KvCache&&) noexcept;
  KvCache& operator=(KvCache&&) noexcept;
  int64_t length() const;  // tokens seen
  void clear();

  struct State;
  State& state() { return *state_; }

 private:
  std::unique_ptr<State> state_;
};

// SPEC section 4: when the backends switch from the prefill to the decode steps.
enum class DecodeSwitch : uint8_t {
  automatic,  // on a GPU device grouped_mm -> batched_mm for decode steps; on the CPU nothing switches
  always,     // grouped_mm -> batched_mm on any device
  never,      // keep the map as it is
};

struct GenerationConfig {
  int64_t max_new_tokens = 20;
  int64_t min_new_tokens = 0;  // EOS is suppressed before this many new tokens
  bool do_sample = false;      // greedy when false
  float temperature = 1.0f;
  int64_t top_k = 50;  // 0: off
  float top_p = 1.0f;  // 1: off
  // Logits of tokens already in the sequence (prompt and new tokens) divided by this when positive,
  // multiplied when negative (transformers' RepetitionPenaltyLogitsProcessor); 1: off. Greedy too.
  float repetition_penalty = 1.0f;
  uint64_t seed = 0;
  // Stop tokens; default: the checkpoint's eos_token_id (generation_config.json, else config.json).
  std::optional<std::vector<int64_t>> eos_token_ids;
  DecodeSwitch decode_switch = DecodeSwitch::automatic;
  // Explicit map for the decode steps instead of decode_switch's rule (keys left out keep their value).
  std::optional<ExpertsImplementation> decode_experts_implementation;
  bool keep_prompt_logits = false;  // fills GenerationResult::prompt_logits
  // Called after each new token (also the first); may throw to abort (the map is restored).
  std::function<void(int64_t token)> on_token;
  // generate_batch: called after each new token of sequence `sequence` (its index among the prompts); may
  // throw to abort. on_token is not called there.
  std::function<void(size_t sequence, int64_t token)> on_sequence_token;

  void validate() const;
  std::string to_string() const;

  // The defaults above with DIR/generation_config.json's do_sample, temperature, top_k, top_p,
  // repetition_penalty, max_new_tokens and eos_token_id over them, as transformers' generate starts from
  // (a folder without the file gives the defaults). Throws Error (io) naming a malformed field.
  static GenerationConfig from_pretrained(const std::string& dir);
};

struct GenerationResult {
  std::vector<int64_t> tokens;  // the new tokens only
  bool stopped_on_eos = false;
  ExpertsMap prefill_experts;  // map used by the prefill
  ExpertsMap decode_experts;   // map used by the decode steps
  double prefill_ms = 0, decode_ms = 0;
  int64_t decode_steps = 0;
  int64_t graph_replays = 0;    // decode steps replayed from a CUDA graph (ModelOptions::cuda_graph)
  int64_t batch_size = 1;       // generate_batch: the sequences generated together (prefill_ms and decode_ms are theirs)
  double tokens_per_s() const;  // new tokens after the first, per second of decode
  Tensor prompt_logits;         // [prompt_len, vocab] f32 (keep_prompt_logits)
};

class Model {
 public:
  // Loads DIR (config.json, model.safetensors or sharded with model.safetensors.index.json).
  static Model from_pretrained(const std::string& dir, const ModelOptions& options = {});

  Model();
  ~Model();
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;

  const ModelConfig& config() const;
  const ModelOptions& options() const;
  Device device() const;
  DType dtype() const;

  // "" and one entry per sub-config.
  ExpertsMap get_experts_implementation() const;
  // A name applies to the model and every sub-model; a map changes only the keys it has. Unknown backend
  // names or sub-config keys throw (listing the valid ones) and leave the model unchanged.
  void set_experts_implementation(const ExpertsImplementation& impl);
  // The backend that runs the routed experts (the decoder's entry of the map).
  const std::string& experts_backend() const;
  // Every MoE layer's experts module.
  std::vector<const Experts*> experts_modules() const;

  // Runs `input_ids` (one sequence) after what the cache holds; returns logits [n, vocab] f32 on the CPU:
  // every position when all_logits, else only the last one.
  Tensor forward(const std::vector<int64_t>& input_ids, KvCache& cache, bool all_logits = false);
  // Logits of every position of one sequence: [T, vocab] f32 on the CPU.
  Tensor logits(const std::vector<int64_t>& input_ids);

  GenerationResult generate(const std::vector<int64_t>& prompt, const GenerationConfig& config = {});
  // Several prompts of any lengths at once, each with its own KV cache, sampler (seeded with config.seed)
  // and stop conditions (EOS, min/max_new_tokens): one prefill over all the prompts' tokens (the experts
  // see T = their sum), then decode steps of one token per unfinished sequence (T = those sequences). With
  // ModelOptions::cuda_graph a decode step is recorded per batch-size bucket (the next power of two; the
  // slots of finished sequences keep running, unused, until the unfinished ones fit a smaller bucket).
  // Results in the prompts' order; each gets the tokens generate(prompt) gives up to the rounding of
  // differently sized matrix products. keep_prompt_logits is refused.
  std::vector<GenerationResult> generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                               const GenerationConfig& config = {});

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// The map for the decode steps under `rule` (SPEC section 4): every entry equal to grouped_mm becomes
// batched_mm when the rule applies on `device`.
ExpertsMap decode_experts_map(const ExpertsMap& prefill, Device device, DecodeSwitch rule);

// Restores a model's experts map when it goes out of scope (also during stack unwinding).
class ExpertsMapGuard {
 public:
  explicit ExpertsMapGuard(Model& model);
  ~ExpertsMapGuard();
  ExpertsMapGuard(const ExpertsMapGuard&) = delete;
  ExpertsMapGuard& operator=(const ExpertsMapGuard&) = delete;
  const ExpertsMap& saved() const { return saved_; }

 private:
  Model& model_;
  ExpertsMap saved_;
};

}  // namespace moekit

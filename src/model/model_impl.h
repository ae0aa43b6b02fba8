// Internal: the loaded weights of a decoder, the KV cache state, and the model's implementation object.
#pragma once
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "model/ops.h"
#include "model/scratch.h"
#include "moekit/model.h"

namespace moekit::model {

struct Linear {
  Tensor w;  // [out, in]
  Tensor b;  // [out] or undefined
};

struct AttentionWeights {
  // grouped-query attention
  Linear q, k, v, o;  // q, k and v: row views of qkv when it is set
  Linear qkv;         // [q; k; v] stacked into one [(Hq + 2 Hkv) D, H] projection (one GEMM for the decode step)
  Tensor q_norm, k_norm;  // [head_dim] (per head) or [heads * head_dim] (full projection)
  Tensor sinks;           // [Hq] f32 (gpt-oss)
  // multi-head latent attention
  Linear q_a, q_b, kv_a, kv_b;
  Tensor q_a_norm, kv_a_norm;
};

struct DenseMlp {
  Linear gate_up;  // [2I, H]: gate rows then up rows
  Linear down;     // [H, I]
};

struct MoeBlock {
  Tensor router_w;         // [E, H] f32
  Tensor router_b;         // [E] f32 (gpt-oss)
  Tensor correction_bias;  // [E] f32 (DeepSeek e_score_correction_bias)
  Experts experts;  // with expert parallelism: this rank's slice of the experts
  std::shared_ptr<const ParallelExperts> ep;  // set with expert parallelism (shared by the layers)
  bool has_shared = false;
  DenseMlp shared;
  Tensor shared_gate;  // [1, H] (qwen2_moe)
};

struct Layer {
  Tensor input_norm, post_norm;  // [H]
  AttentionWeights attn;
  bool is_moe = false;
  DenseMlp mlp;
  MoeBlock moe;
  int64_t window = 0;  // sliding window, 0 = full attention
};

struct Weights {
  Tensor embed;  // [V, H]
  std::vector<Layer> layers;
  Tensor norm;     // [H]
  Tensor lm_head;  // [V, H]
};

// Reads and validates every tensor of the decoder described by `c` (names, shapes), converting to `dtype`
// on `device`; per-expert tensors are fused into the Experts layouts. Throws Error(not_found /
// invalid_argument) listing what is missing or has the wrong shape.
// First checks the config's sizes against the checkpoint's bytes and every name, shape and dtype on the
// zero-copy checkpoint tensors (nothing converted before the whole decoder is known to be there), then
// (check_finite: default on for checkpoints up to kFiniteCheckDefaultBytes, else a warning) that the
// weights read hold no NaN or Inf, then converts.
// FP8 checkpoints: `fp8` lets f8e4m3 tensors with a `_scale_inv` beside them load (dequantized at load, but the
// routed experts, which stay FP8 unless `dequantize`).
struct LoadQuant {
  bool fp8 = false;         // quantization_config fp8: f8e4m3 tensors with their weight_scale_inv
  bool fp4_experts = false;  // ... with "expert_dtype": "fp4": routed experts in I8-packed e2m1 with ue8m0 scales
  bool mxfp4 = false;        // quantization_config mxfp4 (gpt-oss): experts' _blocks / _scales
  bool dequantize = false;   // ModelOptions::dequantize
};
// What the checkpoint's quantization_config loads as (nothing set without one): fp8 / e4m3 / dynamic / [128, 128]
// (f32 or ue8m0 scales; FP4 experts with expert_dtype "fp4"), or mxfp4. Anything else (a static activation scheme,
// another method or block size) throws not_supported naming the field.
LoadQuant check_quantization(const ModelConfig& mc, const std::string& dir);
// `shard`: read only these experts of each MoE layer (expert parallelism); every expert when absent.
Weights load_weights(const Checkpoint& ckpt, TextConfig& c, DType dtype, Device device,
                     const std::string& experts_implementation, std::optional<bool> check_finite = std::nullopt,
                     const std::function<void(const LoadProgress&)>& progress = {},
                     std::optional<ExpertSlice> shard = std::nullopt, const LoadQuant& quant = {});
constexpr uint64_t kFiniteCheckDefaultBytes = 4ull << 30;
uint64_t checkpoint_bytes(const Checkpoint& ckpt);
// Throws Error(invalid_argument) naming the first tensor (and element) with a NaN or Inf.
void check_finite_weights(const Checkpoint& ckpt, const std::vector<std::string>& names);

// One sequence of a forward over several: its new tokens are rows [begin, begin + n) of the step, at
// positions pos.. of its own KV cache, whose first kv_rows rows the attention is given (>= pos + n).
struct Segment {
  KvCache::State* cache;
  int64_t begin, n;
  Position pos;
  int64_t kv_rows;
};

}  // namespace moekit::model

namespace moekit {

struct KvCache::State {
  std::vector<Tensor> k, v;  // per layer: [capacity, Hkv, Dk] and [capacity, Hkv, Dv]
  int64_t length = 0;
  int64_t capacity = 0;
};

// A stream of the model's device (none on the CPU), released with the model.
class OwnedStream {
 public:
  OwnedStream() = default;
  explicit OwnedStream(Device d) : device_(d), stream_(stream_create(d)) {}
  ~OwnedStream() { stream_destroy(stream_, device_); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  Stream get() const { return stream_; }

 private:
  Device device_ = Device::cpu();
  Stream stream_ = nullptr;
};

// One decode step recorded as a CUDA graph, and what it was recorded against: replays are valid while the
// cache's buffers, the scratch memory and the experts map stay the same.
// A step of B sequences (B slots, each with its own cache) is recorded as one graph: the key holds every
// slot's buffers in order, so a graph serves one batch size (bucket) over the same caches.
struct DecodeGraph {
  std::vector<const void*> cache;  // every slot's layers' key and value buffers, then the step's inputs
  std::vector<int64_t> capacity;   // per slot
  uint64_t scratch_epoch = 0;
  ExpertsMap experts;
  bool warmed = false;  // one uncaptured step with this key ran (sizes the workspaces)
  std::unique_ptr<model::StepGraph> graph;
  Tensor logits;  // [B, V] f32 on the device, written by each replay
  static std::vector<const void*> key(const std::vector<KvCache::State*>& slots, const void* io);
  bool matches(const std::vector<KvCache::State*>& slots, const void* io, uint64_t epoch, const ExpertsMap& m) const;
};

struct Model::Impl {
  // Declared first, destroyed last: the work of everything below runs on them. Decode graphs are recorded
  // and replayed on a stream of their own, whose workspaces (experts, layer ops) only ever serve graphed
  // decode steps: a longer prefill on `stream` cannot grow (move) a buffer that a recorded graph points to,
  // and a step of a larger batch first runs uncaptured (growing them) and then records a new graph.
  std::unique_ptr<OwnedStream> stream, graph_stream;
  ModelConfig config;
  ModelOptions options;
  DType dtype = DType::f32;
  model::Weights weights;
  model::RopeSpec rope;
  ExpertsMap experts_map;   // "" and each sub-config
  std::string decoder_key;  // the map entry that drives the decoder's experts ("" or "text_config")

  model::Scratch scratch;
  Tensor step_io;  // [2B] i64 on the device: the tokens, then the positions, of a graphed decode step
  Tensor step_pick;  // [2B] i64 on the device: a greedy step's (token, finite) per slot
  model::HostStaging step_in, step_out;  // page-locked: step_io's source; the picks or the logits coming back
  DecodeGraph decode_graph;
  int64_t graph_replays = 0;
  model::HostStaging ahead_out;  // page-locked [token, finite, seq] x 2, written by the device (greedy_feed)
  int64_t ahead_seq = 0;         // the last ticket given out

  const model::DeviceOps& ops() const { return model::ops_for(options.device); }
  Stream model_stream() const { return stream ? stream->get() : nullptr; }
  Stream decode_graph_stream() const { return graph_stream ? graph_stream->get() : nullptr; }
  void apply_experts_map();
  // The decoder forward over `ids` after the cache; logits [n, V] f32 on the CPU.
  Tensor forward(const std::vector<int64_t>& ids, KvCache& cache, bool all_logits);
  // What a graphed decode step gives back: every slot's logits on the host, or (greedy steps) every slot's token.
  struct StepOut {
    const float* logits = nullptr;  // [B, V] f32 in page-locked memory, valid until the next step
    int64_t V = 0;
    std::vector<int64_t> ids;       // [B] when the device chose the tokens
  };
  // One decode step through the CUDA graph of decode steps (recorded on first use and whenever the cache
  // buffers, scratch memory or experts map changed), as decode_batch_graphed with one slot.
  StepOut decode_step_graphed(int64_t token, KvCache& cache, const std::vector<int64_t>* greedy_suppress = nullptr);
  // One new token for each of several sequences (prefill of ragged prompts when the token lists are longer):
  // one forward whose experts call has T = all tokens; logits [sequences, V] f32 on the CPU (each one's last
  // position). Every cache's length grows by its tokens.
  Tensor forward_batch(const std::vector<std::vector<int64_t>>& ids, const std::vector<KvCache*>& caches);
  // One decode step of B slots through the CUDA graph recorded for them (as decode_step_graphed). Slots
  // whose `advance` is false (padding, finished sequences) run at their cache's length without growing it.
  // greedy_suppress set (at most DeviceOps::kMaxSuppress ids): the device picks each slot's token as the host's
  // greedy sampler would with these ids suppressed, and only the B ids come back; when an advancing slot's logits
  // are not all finite, the logits come back instead (the caller reports them).
  StepOut decode_batch_graphed(const std::vector<int64_t>& tokens, const std::vector<KvCache*>& caches,
                               const std::vector<bool>& advance, const std::vector<int64_t>* greedy_suppress = nullptr);
  // Greedy decode steps run ahead (one sequence, CUDA graphs; model::decode_ahead()). enqueue_ahead queues one
  // step on the decode stream through the recorded graph, its token and position uploaded from the host when
  // token >= 0, else those the step before left on the device (greedy_feed), then the greedy pick with
  // `suppress` and its feed; nothing waits. It returns the step's ticket, or -1 (nothing queued) when no recorded
  // one-sequence graph fits the cache as it is or row `position` is past its capacity: the caller then drains
  // and takes decode_step_graphed. wait_ahead spins until the step of `ticket` (at most two in flight) has sent
  // its pick, then returns (token, finite) and grows the cache's length by one when finite. drain_ahead waits for
  // everything queued (errors included).
  int64_t enqueue_ahead(int64_t token, KvCache& cache, int64_t position, const std::vector<int64_t>& suppress);
  std::pair<int64_t, bool> wait_ahead(int64_t ticket, KvCache& cache);
  void drain_ahead();
  void reserve(KvCache& cache, int64_t tokens) const;
  // Throws Error(not_supported) when the decoder's backend in `map` cannot be recorded in a CUDA graph.
  void require_capturable_experts(const ExpertsMap& map) const;

 private:
  void check_ids(const int64_t* ids, int64_t n) const;
  // Enqueues the decoder over `ids` ([T] i64 on the device) at position `pos` on the current stream; the
  // cache's length is left to the caller. Returns the logits [n, V] f32 in scratch memory.
  Tensor forward_device(const TensorView& ids, model::Position pos, KvCache& cache, bool all_logits);
  // The same over several sequences (rows of `ids` by `segs`); logits [n, V]: every row (all_logits, one
  // sequence) or each sequence's last row.
  Tensor forward_segments(const TensorView& ids, const std::vector<model::Segment>& segs, bool all_logits);
};

}  // namespace moekit

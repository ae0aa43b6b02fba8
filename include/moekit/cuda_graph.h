// moekit: CUDA graphs of an experts forward, and the device-side check of expert ids.
// No CUDA headers: streams are moekit::Stream (a cudaStream_t; nullptr = the legacy default stream).
#pragma once
#include <memory>
#include <string>

#include "moekit/experts.h"

namespace moekit {

// The fixed shapes of a captured forward.
struct ExpertsGraphShape {
  int64_t tokens = 0;                 // T (0 gives an empty graph)
  int64_t top_k = 1;                  // K
  DType act_dtype = DType::bf16;      // hidden_states and out; must match the experts' weights
  DType index_dtype = DType::i32;     // top_k_index: i32 | i64
  DType weight_dtype = DType::f32;    // top_k_weights: f32 | bf16 | f16
  std::string to_string() const;
};

// One forward of a capturable backend (batched_mm, grouped_mm; not eager, which synchronises with the
// host) recorded into a CUDA graph, over persistent input and output buffers on the experts' device.
//
//   ExpertsGraph g(experts, {.tokens = 8, .top_k = 8, .act_dtype = DType::bf16}, "batched_mm");
//   g.hidden_states().copy_from(x);  g.top_k_index().copy_from(idx);  g.top_k_weights().copy_from(w);
//   g.replay(stream);                // out() holds the result once `stream` reaches it
//
// Replays compute exactly what the uncaptured call computes on the buffers' contents (bit for bit).
// Construction runs one uncaptured forward first (on zeros, sizing the workspace and loading the
// kernels), then captures on a stream of its own. The graph keeps the experts' weights alive. Replays
// of one graph must not overlap (they share buffers and workspace); distinct graphs may.
class ExpertsGraph {
 public:
  // backend "" uses experts.implementation(). Throws Error(not_supported) for a backend that cannot be
  // captured or cannot run these experts, and for experts that are not on a CUDA device.
  ExpertsGraph(const Experts& experts, const ExpertsGraphShape& shape, const std::string& backend = "");
  ~ExpertsGraph();
  ExpertsGraph(ExpertsGraph&&) noexcept;
  ExpertsGraph& operator=(ExpertsGraph&&) noexcept;
  ExpertsGraph(const ExpertsGraph&) = delete;
  ExpertsGraph& operator=(const ExpertsGraph&) = delete;

  // The captured buffers (handles sharing the storage): write inputs into them, read out() after a replay.
  Tensor hidden_states() const;  // [T, H] act_dtype
  Tensor top_k_index() const;    // [T, K] index_dtype
  Tensor top_k_weights() const;  // [T, K] weight_dtype
  Tensor out() const;            // [T, H] act_dtype

  // Launches the graph on `stream` (asynchronous).
  void replay(Stream stream = nullptr) const;
  // Waits for `stream`, then throws Error(invalid_argument) naming the first out-of-range expert id that
  // any replay since the last check received (those slots contributed nothing). Clears the record.
  void check_errors(Stream stream = nullptr) const;

  const std::string& backend() const;
  const ExpertsGraphShape& shape() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Expert ids on CUDA are validated on the device. eager reports a bad id (< 0 or > E) at once (it
// synchronises anyway); batched_mm and grouped_mm drop such a slot (zero contribution, no
// out-of-bounds access) and record the first one in an error word kept per module and stream. This waits
// for `stream`, then throws Error(invalid_argument) naming the first bad id recorded for forwards of
// `experts` on `stream` since the last check, and clears the record. No-op for CPU experts (their ids
// are checked before every call).
void check_experts_errors(const Experts& experts, Stream stream = nullptr);

}  // namespace moekit

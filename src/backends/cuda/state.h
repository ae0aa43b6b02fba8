// Internal: what the CUDA backends keep per Experts module (workspaces per stream, the error word, the
// cuBLAS handle), and the validated description of one call that the three backends share.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/backends.h"
#include "backends/cuda/common.h"
#include "backends/cuda/policy.h"
#include "backends/cuda/kernels/kernels.h"
#include "moekit/experts.h"

namespace moekit::cuda {

// Device scratch for calls enqueued on one stream (calls on one stream are ordered, so they can share
// it); freed with the module. It may first be met, or have to grow, while its stream is being recorded
// into a graph (torch.cuda.graph records on a stream of its own, after a warm-up on another one): its memory
// is then allocated in relaxed capture mode, and once a graph was recorded over an arena that arena is
// never freed before the module, since each replay of the graph uses it again.
class StreamWorkspace {
 public:
  StreamWorkspace(int device, cudaStream_t stream);
  // Makes the arena at least `bytes` long. Growing waits for the stream and frees the old arena, unless a
  // graph was (or is being) recorded over it: then the old arena is kept and nothing waits.
  void reserve(size_t bytes);
  // Notes that work using this workspace is being recorded into a graph.
  void mark_captured() { captured_ = true; }
  void* arena() const { return arena_.data(); }
  // The sticky routing error word (kernels::kNoRoutingError when clean). A workspace made during capture
  // clears it in the graph's first node.
  unsigned long long* error() const { return static_cast<unsigned long long*>(error_.data()); }
  // Arrival counters for kernels whose last block to finish a part does the step after it (kernels.h
  // fp8_pair_gemv): kCounterWords words, zero between launches, each launch leaving them zero. Zeroed when the
  // workspace is made (by a node of the graph when it is made during capture) and, for a workspace made during
  // capture, again before its first use outside capture.
  uint32_t* counters();
  static constexpr int64_t kCounterWords = 16384;
  void* host();  // pinned, kHostBytes; allocated on first use (never needed during capture)
  static constexpr size_t kHostBytes = 8 * 1024;
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }

 private:
  int device_;
  cudaStream_t stream_;
  DeviceBuffer arena_, error_, counters_;
  bool counters_zeroed_ = false;  // outside capture
  std::vector<DeviceBuffer> retired_;  // arenas that recorded graphs still use
  bool captured_ = false;
  std::unique_ptr<PinnedBuffer> host_;
};

// Carves typed, 256-byte aligned sub-buffers out of an arena; with a null base it only measures.
class Carver {
 public:
  explicit Carver(void* base = nullptr) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* take(int64_t count) {
    offset_ = (offset_ + 255) / 256 * 256;
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += size_t(count) * sizeof(T);
    return p;
  }
  void* take_bytes(int64_t bytes) { return take<char>(bytes); }
  size_t size() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

// Sizes a call's buffers with `carve(Carver&)` on a measuring carver, grows `ws` to fit, then carves them
// from its arena (the same calls, so the same offsets).
template <class Carve>
void carve_workspace(StreamWorkspace& ws, Carve&& carve) {
  Carver measure;
  carve(measure);
  ws.reserve(measure.size());
  Carver w(ws.arena());
  carve(w);
}

// The routing buffers of a call of P pairs over E experts (route_sort's outputs and scratch), carved from `w`;
// the error word is the workspace's and is set by the caller.
inline void take_routing(Carver& w, kernels::RoutingBuffers& r, int64_t P, int64_t E) {
  r.pair_expert = w.take<int32_t>(P);
  r.pair_row = w.take<int32_t>(P);
  r.sorted_pair = w.take<int32_t>(P);
  r.block_hist = w.take<int32_t>(kernels::route_blocks(P) * E);
  r.offsets = w.take<int32_t>(E + 1);
  r.tile_offsets = w.take<int32_t>(E + 1);
}

class CudaState final : public BackendState {
 public:
  std::mutex mutex;  // held for a whole call: one enqueueing thread per module at a time
  // The workspace of `stream`, created on first use (also during capture; see StreamWorkspace).
  StreamWorkspace& workspace(cudaStream_t stream, int device);
  StreamWorkspace* find(cudaStream_t stream);
  void release(cudaStream_t stream);
  std::shared_ptr<CublasHandle> cublas(int device);

  // Transposed experts ([E, in, out]) repacked once by prepare() into [E, out, in] (backends.h).
  bool repacked = false;
  Tensor w1, w2;
  // FP8 experts, staged once by prepare() (dispatch.cpp): the block scales as f32 on the device, and the e4m3
  // weights copied with rows padded to 16 bytes only where K is not a multiple of 16 (else read in place).
  bool fp8_ready = false;
  Tensor q1, q2, s1, s2;
  // FP4 experts, staged once by prepare(): the packed e2m1 weights are read in place; their ue8m0 scale codes
  // copied with rows padded to whole 4-byte words (code 127) only where K / 32 is not a multiple of 4 (e1, e2).
  bool fp4_ready = false;
  Tensor e1, e2;

 private:
  std::map<cudaStream_t, std::unique_ptr<StreamWorkspace>> workspaces_;
  std::shared_ptr<CublasHandle> cublas_;
};

CudaState& cuda_state(const Experts& experts);

// Synchronises `sync_stream`, reads and clears the error word of `ws`; throws naming the first bad id.
void check_and_clear_error(StreamWorkspace& ws, cudaStream_t sync_stream, int64_t experts);

// One validated call, with everything the kernels need.
struct CallContext {
  CallContext(const Experts& e, const ExpertsCall& c) : experts(e), call(c) {}
  const Experts& experts;
  const ExpertsCall& call;
  cudaStream_t stream = nullptr;
  const DeviceInfo* device = nullptr;
  StreamWorkspace* ws = nullptr;
  kernels::Elem type = kernels::Elem::bf16;         // activations and weights
  kernels::Elem weight_type = kernels::Elem::f32;   // routing weights
  kernels::Index index_type = kernels::Index::i32;  // top_k_index
  int64_t tokens = 0, top_k = 0, pairs = 0, hidden = 0, inter = 0, n1 = 0;
  int experts_count = 0;
  kernels::GateParams gate;
  int first_epilogue = kernels::kEpiGated;
  bool transposed = false;
  // First projection: element (n, h) of expert e at w1[e * w1_expert + n * w1_n + h * w1_k]; bias [E, n1].
  const void* w1 = nullptr;
  int64_t w1_expert = 0, w1_n = 0, w1_k = 0;
  const void* b1 = nullptr;
  // Second projection: element (h, i) of expert e at w2[e * w2_expert + h * w2_n + i * w2_k]; bias [E, H].
  const void* w2 = nullptr;
  int64_t w2_expert = 0, w2_n = 0, w2_k = 0;
  const void* b2 = nullptr;
  // FP8 experts (quantized_fp8.cpp): e4m3 weights [E, n, ld] (ld bytes per row: K, or K padded to 16 with zero
  // codes), f32 block scales [E, SN, ceil(K / 128)]; activations quantized with power-of-two scales when the
  // checkpoint's scales are ue8m0.
  bool fp8 = false, fp8_pow2 = false;
  const uint8_t *q1 = nullptr, *q2 = nullptr;
  int64_t q1_ld = 0, q2_ld = 0;
  const float *s1 = nullptr, *s2 = nullptr;
  int64_t s1_rows = 0, s2_rows = 0;  // SN of each projection
  int64_t seg1 = 1;                  // the first projection's scale segments (gated: 2)
  // FP4 experts (fp8 is set too: run_fp8 runs both): q1, q2 the packed e2m1 weights [E, n, K / 2] (q*_ld = K / 2
  // bytes), e1, e2 their ue8m0 scale codes [E, n, e*_ld] (one per row and 32 inputs, e*_ld a multiple of 4);
  // activations as they are with fp4_float_activations (MXFP4), else quantized as for FP8 (fp8_pow2 set).
  bool fp4 = false, fp4_float = false;
  const uint8_t *e1 = nullptr, *e2 = nullptr;
  int64_t e1_ld = 0, e2_ld = 0;
};

// The FP8 and FP4 forward of grouped_mm, batched_mm and deepgemm (quantized_fp8.cpp).
void run_fp8(const CallContext& c);

// The two grouped projections of a forward over rows grouped by expert (grouped_mm.cpp): the first reads
// `a` (row a_rows[r] / a_row_div, or row r when a_rows is null) and writes the gated activations `act`
// [max_rows, I] in the activations' dtype; the second reads `act` and writes `y` [max_rows, H] in f32 (its
// bias is added by combine). `offsets` / `tile_offsets` [E + 1] on the device, as route_sort leaves them.
struct Projections {
  kernels::GroupedGemmArgs first, second;
};
Projections grouped_projections(const CallContext& c, const void* a, const int32_t* a_rows, int a_row_div,
                                const int32_t* offsets, const int32_t* tile_offsets, int64_t max_rows, void* act,
                                float* y);
// grouped_mm's and deepgemm's second projection on the TMA kernel in 16-bit rows (kEpiWeighted without row
// weights; the down bias and the routing weights are applied by combine_rows16).
void second_projection_rows16(kernels::GroupedGemmArgs& g2);

// Whether batched_mm runs its per-pair GEMV kernels for this call (else the grouped kernels).
bool batched_uses_gemv(const CallContext& c);

// ExpertsCall::routing on a path that does not route inside its kernels: writes top_k_index / top_k_weights from
// the logits (kernels::route_logits) before the path reads them. route_kind_code: the kernels' code of a kind.
int route_kind_code(RouterKind kind);
void route_first(const CallContext& c);

// Checks a kernel launcher's status, naming the kernel.
void check_launch(cudaError_t err, const char* what);

}  // namespace moekit::cuda

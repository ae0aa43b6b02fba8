#include "backends/cuda/state.h"

#include <atomic>

#include "base/env.h"

namespace moekit::cuda {

StreamWorkspace::StreamWorkspace(int device, cudaStream_t stream) : device_(device), stream_(stream) {
  DeviceGuard guard(device);
  {
    RelaxedCaptureMode relaxed;
    error_ = DeviceBuffer(sizeof(unsigned long long), device);
    counters_ = DeviceBuffer(size_t(kCounterWords) * sizeof(uint32_t), device);
  }
  if (stream_is_capturing(stream)) captured_ = true;
  MOEKIT_CUDA_CALL(cudaMemsetAsync(error_.data(), 0xff, sizeof(unsigned long long), stream));  // kNoRoutingError
  MOEKIT_CUDA_CALL(cudaMemsetAsync(counters_.data(), 0, counters_.size(), stream));
  counters_zeroed_ = !captured_;
}

uint32_t* StreamWorkspace::counters() {
  if (!counters_zeroed_ && !stream_is_capturing(stream_)) {
    MOEKIT_CUDA_CALL(cudaMemsetAsync(counters_.data(), 0, counters_.size(), stream_));
    counters_zeroed_ = true;
  }
  return static_cast<uint32_t*>(counters_.data());
}

void* StreamWorkspace::host() {
  if (!host_) host_ = std::make_unique<PinnedBuffer>(kHostBytes);
  return host_->data();
}

void StreamWorkspace::reserve(size_t bytes) {
  if (bytes <= arena_.size()) return;
  const size_t rounded = (bytes + (size_t(2) << 20) - 1) / (size_t(2) << 20) * (size_t(2) << 20);
  if (stream_is_capturing(stream_)) captured_ = true;
  if (captured_) {
    // Recorded graphs read and write the old arena at each replay: it stays, and nothing can wait here
    // while the stream is being recorded.
    DeviceBuffer grown;
    {
      RelaxedCaptureMode relaxed;
      grown = DeviceBuffer(rounded, device_);
    }
    if (arena_.size() > 0) retired_.push_back(std::move(arena_));
    arena_ = std::move(grown);
    return;
  }
  // Earlier calls on this stream may still use the old arena.
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(stream_));
  arena_ = DeviceBuffer();
  arena_ = DeviceBuffer(rounded, device_);
}

StreamWorkspace& CudaState::workspace(cudaStream_t stream, int device) {
  auto& slot = workspaces_[stream];
  if (!slot) {
    try {
      slot = std::make_unique<StreamWorkspace>(device, stream);
    } catch (...) {
      workspaces_.erase(stream);
      throw;
    }
  } else if (stream_is_capturing(stream)) {
    slot->mark_captured();
  }
  return *slot;
}

StreamWorkspace* CudaState::find(cudaStream_t stream) {
  auto it = workspaces_.find(stream);
  return it == workspaces_.end() ? nullptr : it->second.get();
}

void CudaState::release(cudaStream_t stream) {
  auto it = workspaces_.find(stream);
  if (it == workspaces_.end()) return;
  (void)cudaStreamSynchronize(stream);
  workspaces_.erase(it);
}

std::shared_ptr<CublasHandle> CudaState::cublas(int device) {
  if (!cublas_) cublas_ = shared_cublas_handle(device);
  return cublas_;
}

CudaState& cuda_state(const Experts& experts) {
  return experts.state<CudaState>("cuda", [] { return std::make_unique<CudaState>(); });
}

void check_and_clear_error(StreamWorkspace& ws, cudaStream_t sync_stream, int64_t experts) {
  DeviceGuard guard(ws.device());
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(sync_stream));
  auto* host = static_cast<unsigned long long*>(ws.host());
  MOEKIT_CUDA_CALL(cudaMemcpyAsync(host, ws.error(), sizeof(unsigned long long), cudaMemcpyDeviceToHost, ws.stream()));
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(ws.stream()));
  const unsigned long long word = *host;
  if (word == kernels::kNoRoutingError) return;
  MOEKIT_CUDA_CALL(cudaMemsetAsync(ws.error(), 0xff, sizeof(unsigned long long), ws.stream()));
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(ws.stream()));
  int64_t token = 0;
  int slot = 0;
  int32_t id = 0;
  kernels::decode_routing_error(word, &token, &slot, &id);
  MOEKIT_FAIL(invalid_argument, "top_k_index[", token, ", ", slot, "] = ", id, " is out of range [0, ", experts, "] (",
              experts, " experts; id ", experts,
              " marks an expert on another rank); that slot contributed nothing to the output");
}

void check_launch(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  MOEKIT_FAIL(runtime, "CUDA kernel launch '", what, "' failed: ", cudaGetErrorName(err), " (",
              cudaGetErrorString(err), ")");
}

namespace {
// T = 1..8 with K = 8 on 128 experts: per-pair GEMVs; above that the grouped kernels share each
// expert's weights between its rows.
std::atomic<int64_t> g_gemv_max_pairs{64};
std::atomic<bool> g_gemv_when_shared{false};
std::atomic<bool> g_wgmma{true};
std::atomic<bool> g_wgmma_wide{false};
std::atomic<int64_t>& one_launch_tokens() {
  static std::atomic<int64_t> v{env_int("MOEKIT_SMALLT_ONE_LAUNCH_TOKENS", 0)};
  return v;
}
}  // namespace

int64_t batched_one_launch_max_tokens() { return one_launch_tokens().load(); }
int64_t set_batched_one_launch_max_tokens(int64_t tokens) { return one_launch_tokens().exchange(tokens); }

bool grouped_wgmma_wide_enabled() { return g_wgmma_wide.load(); }
bool set_grouped_wgmma_wide_enabled(bool enabled) { return g_wgmma_wide.exchange(enabled); }
bool grouped_wgmma_enabled() { return g_wgmma.load(); }
bool set_grouped_wgmma_enabled(bool enabled) { return g_wgmma.exchange(enabled); }

int64_t batched_gemv_max_pairs() { return g_gemv_max_pairs.load(); }
int64_t set_batched_gemv_max_pairs(int64_t pairs) { return g_gemv_max_pairs.exchange(pairs); }
bool batched_gemv_when_shared() { return g_gemv_when_shared.load(); }
bool set_batched_gemv_when_shared(bool on) { return g_gemv_when_shared.exchange(on); }

}  // namespace moekit::cuda

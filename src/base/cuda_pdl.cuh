// Internal: Programmatic Dependent Launch (PDL, sm_90) for the decode step's kernels, and the L2 prefetch of
// weights that such a kernel issues while its predecessor still runs.
//
// A kernel launched with launch_pdl(..., pdl = true) may start once every block of the kernel before it on the
// stream has called pdl_trigger() (or exited). The protocol every such kernel keeps:
//   - before pdl_wait(): read only data that no earlier kernel of the stream writes (weights), or data written two
//     or more kernels back (the kernel before has passed its own pdl_wait() before triggering); write nothing;
//   - pdl_wait() in every block before anything else (it returns once the kernel before has finished and its
//     writes are visible; a no-op when the kernel was launched without the attribute), then pdl_trigger().
// Works in stream capture (the graph keeps the programmatic edges). pdl_enabled(): MOEKIT_PDL=0 in the
// environment (read once) or set_pdl_enabled(false) launches every kernel the plain way.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "base/env.h"

namespace moekit::cuda {

inline EnvSwitch g_pdl_enabled{"MOEKIT_PDL", true};
inline std::atomic<int64_t> g_pdl_prefetch_bytes{-1};  // -1: not read yet

inline bool pdl_enabled() { return g_pdl_enabled.on(); }
// Returns the previous setting.
inline bool set_pdl_enabled(bool on) { return g_pdl_enabled.set(on); }

// The most weight bytes one launch prefetches into L2 before its pdl_wait() (larger launches prefetch nothing:
// the lines would be evicted before use). MOEKIT_PDL_PREFETCH_MB in the environment (read once), 0 (never) by
// default: on the H200 a 32 MiB budget made the decode step slower (368 us against 365) and the experts at
// T = 1 no faster (qwen3-30b-a3b 29.3 against 29.2 us).
inline int64_t pdl_prefetch_bytes() {
  int64_t b = g_pdl_prefetch_bytes.load(std::memory_order_relaxed);
  if (b < 0) {
    const int64_t mb = env_int("MOEKIT_PDL_PREFETCH_MB", 0);
    const int64_t want = mb > 0 && mb < (int64_t(1) << 40) ? mb << 20 : 0;
    int64_t expected = -1;
    g_pdl_prefetch_bytes.compare_exchange_strong(expected, want);
    b = g_pdl_prefetch_bytes.load(std::memory_order_relaxed);
  }
  return b;
}
// Returns the previous setting.
inline int64_t set_pdl_prefetch_bytes(int64_t bytes) {
  const int64_t was = pdl_prefetch_bytes();
  g_pdl_prefetch_bytes.store(bytes < 0 ? 0 : bytes);
  return was;
}
// Whether a launch that reads `bytes` of weights prefetches them before its pdl_wait().
inline bool pdl_prefetch(int64_t bytes) { return pdl_enabled() && bytes <= pdl_prefetch_bytes(); }

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute when pdl.
// Returns the launch status.
template <class... Params, class... Args>
cudaError_t launch_pdl(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1]{};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

#ifdef __CUDACC__
// Waits until the kernel before on the stream has finished and its writes are visible (no-op without PDL).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel on the stream start (once every block of this one has called it or exited).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Prefetches the 128-byte lines of [p, p + bytes) into L2, `lane` of `lanes` cooperating threads taking every
// lanes-th line.
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes, int lane, int lanes) {
  if (bytes <= 0) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(127);
  const uintptr_t last = (reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes) - 1) & ~uintptr_t(127);
  for (uintptr_t a = first + uintptr_t(lane) * 128; a <= last; a += uintptr_t(lanes) * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}
#endif

}  // namespace moekit::cuda

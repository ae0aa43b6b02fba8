// Internal: the CUDA side of `moekit bench` (src/bench/cuda_bench.cu, CUDA builds only).
// Callers guard every use with MOEKIT_WITH_CUDA.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "moekit/dtype.h"
#include "moekit/tensor.h"

namespace moekit::bench::cuda {

struct CardInfo {
  std::string name;       // "NVIDIA H200"
  int64_t l2_bytes = 0;   // cudaDeviceProp::l2CacheSize
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  size_t free_bytes = 0, total_bytes = 0;
};
CardInfo card_info(int device);

// bf16 GEMM n x n x n through cuBLAS (random operands, f32 accumulate): TFLOP/s, median of timed calls.
double gemm_bf16_tflops(int device, int n);
// e4m3 GEMM n x n x n through cuBLASLt (random codes, f32 accumulate, bf16 out; A transposed, as FP8 GEMMs
// require): TFLOP/s, median of timed calls; 0 where cuBLASLt has no FP8 kernel for the device.
double gemm_fp8_tflops(int device, int n);
// Device-to-device copy of `bytes`: GB/s counting bytes read plus written, median of timed calls.
double copy_gbps(int device, size_t bytes);

// Fills device memory with normal(0, std) values of a floating dtype (f32, bf16, f16), keyed by seed.
void fill_normal(void* data, DType dtype, int64_t n, double std, uint64_t seed, Stream stream);

// cudaMemsetAsync, then a check of its status.
void memset_bytes(void* data, int value, size_t bytes, Stream stream);

Stream create_stream(int device);
void destroy_stream(Stream stream);
void synchronize(Stream stream);

// Times one call of `enqueue` (work put on `stream`) with a pair of events; waits for it to end. With
// queue_ahead_us > 0 the stream first waits that long on the device, so that the start event fires with the call
// already enqueued behind it (the host's launch latency out of the interval).
double time_call_us(Stream stream, const std::function<void()>& enqueue, double queue_ahead_us = 0);

}  // namespace moekit::bench::cuda

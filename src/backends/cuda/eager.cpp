// eager on CUDA: the reference loop. Routing on the device, one synchronisation to bring the
// per-expert offsets to the host (bad expert ids are reported there), then for each expert that got
// tokens two cuBLAS GEMMs over its gathered rows (f32 accumulation and output), the gate, and the
// weighted combine. Not capturable in a CUDA graph (the host reads the offsets).
#include <vector>

#include "backends/cuda/state.h"

namespace moekit::cuda {
namespace {

cudaDataType_t cuda_type(kernels::Elem t) {
  switch (t) {
    case kernels::Elem::f32: return CUDA_R_32F;
    case kernels::Elem::bf16: return CUDA_R_16BF;
    case kernels::Elem::f16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

// Row-major C[rows, n] (f32) = A[rows, k] . W^T, W's element (n, k) at w[n * w_n + k * w_k], where one of
// w_n, w_k is 1. cuBLAS is column-major: compute C^T[n, rows] = op(W) . A^T.
void gemm_rows(cublasHandle_t h, kernels::Elem type, const void* a, int64_t rows, int64_t k, const void* w,
               int64_t w_n, int64_t w_k, float* c, int64_t n) {
  const float one = 1.0f, zero = 0.0f;
  const bool k_contiguous = w_k == 1;  // W stored [n, k]: as column-major k x n, transpose it
  const cublasOperation_t op_w = k_contiguous ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int64_t ldw = k_contiguous ? w_n : w_k;
  MOEKIT_CUBLAS_CALL(cublasGemmEx(h, op_w, CUBLAS_OP_N, int(n), int(rows), int(k), &one, w, cuda_type(type), int(ldw),
                                  a, cuda_type(type), int(k), &zero, c, CUDA_R_32F, int(n), CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void run_eager(const CallContext& c) {
  namespace k = kernels;
  MOEKIT_CHECK_CODE(!stream_is_capturing(c.stream), not_supported,
                    "experts implementation 'eager' cannot run inside CUDA graph capture: it copies the per-expert "
                    "counts to the host; use batched_mm or grouped_mm");
  const int64_t P = c.pairs, E = c.experts_count, H = c.hidden, I = c.inter, N1 = c.n1;
  const int eb = k::elem_bytes(c.type);

  k::RoutingBuffers r;
  void *xs = nullptr, *act = nullptr;
  float *h1 = nullptr, *y = nullptr;
  carve_workspace(*c.ws, [&](Carver& w) {
    take_routing(w, r, P, E);
    xs = w.take_bytes(P * H * eb);  // [P, H] gathered rows
    h1 = w.take<float>(P * N1);     // [P, N1] first projection, f32
    act = w.take_bytes(P * I * eb);  // [P, I]
    y = w.take<float>(P * H);        // [P, H] second projection, f32
  });
  r.error = c.ws->error();

  check_launch(k::route_sort(c.call.top_k_index.data, c.index_type, c.tokens, int(c.top_k), int(E), 1, r, c.stream),
               "route_sort");
  // The one host synchronisation: offsets (and the error word) to the host.
  static_assert(StreamWorkspace::kHostBytes >= (k::kRouteMaxExperts + 1) * sizeof(int32_t) + 16, "host buffer");
  auto* host_error = static_cast<unsigned long long*>(c.ws->host());
  auto* host_offsets = reinterpret_cast<int32_t*>(host_error + 1);
  MOEKIT_CUDA_CALL(cudaMemcpyAsync(host_offsets, r.offsets, size_t(E + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                   c.stream));
  MOEKIT_CUDA_CALL(cudaStreamSynchronize(c.stream));
  check_and_clear_error(*c.ws, c.stream, E);
  const std::vector<int32_t> offsets(host_offsets, host_offsets + E + 1);
  const int64_t rows = offsets[size_t(E)];

  if (rows > 0) {
    check_launch(k::gather_rows(c.type, c.call.hidden_states.data, H, r.sorted_pair, int(c.top_k),
                                r.offsets + E, rows, xs, c.stream),
                 "gather_rows");
    auto cublas = cuda_state(c.experts).cublas(c.device->index);
    std::lock_guard<std::mutex> lock(cublas->mutex());
    cublasHandle_t h = cublas->get();
    MOEKIT_CUBLAS_CALL(cublasSetStream(h, c.stream));
    const auto* w1 = static_cast<const char*>(c.w1);
    const auto* w2 = static_cast<const char*>(c.w2);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = offsets[size_t(e)], n = offsets[size_t(e + 1)] - r0;
      if (n == 0) continue;
      gemm_rows(h, c.type, static_cast<const char*>(xs) + r0 * H * eb, n, H, w1 + e * c.w1_expert * eb, c.w1_n,
                c.w1_k, h1 + r0 * N1, N1);
    }
    check_launch(k::gate_rows(c.type, h1, N1, c.b1, r.sorted_pair, r.pair_expert, r.offsets + E, rows, I, c.gate,
                              act, c.stream),
                 "gate_rows");
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = offsets[size_t(e)], n = offsets[size_t(e + 1)] - r0;
      if (n == 0) continue;
      gemm_rows(h, c.type, static_cast<const char*>(act) + r0 * I * eb, n, I, w2 + e * c.w2_expert * eb, c.w2_n,
                c.w2_k, y + r0 * H, H);
    }
  }
  check_launch(k::combine(c.type, c.weight_type, y, r.pair_row, r.pair_expert, c.call.top_k_weights.data, c.b2,
                          c.tokens, int(c.top_k), H, int(E), c.call.out.data, c.stream),
               "combine");
}

}  // namespace moekit::cuda

// The model's elementwise layer kernels: embedding rows, bias rows and conversions for the projections, the
// activation product, the residual adds and the clamp. Grid-stride loops over the elements.
#include "base/activation.h"
#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

__global__ void embedding_kernel(const int64_t* ids, int64_t V, int64_t H, const void* table, int tt, void* out,
                                 int ot) {
  const int64_t i = blockIdx.x;
  const int64_t id = ids[i];
  const bool ok = id >= 0 && id < V;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) st(out, ot, i * H + c, ok ? ld(table, tt, id * H + c) : 0.0f);
}

// Rows of y (f32 or the GEMM's output dtype) start as the bias; the GEMM then accumulates onto them (beta 1),
// so the bias is added before the one rounding, as a fused addmm does.
__global__ void fill_bias_kernel(const void* bias, int bt, void* y, int yt, int64_t M, int64_t N) {
  const int64_t n = M * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(y, yt, i, ld(bias, bt, i % N));
}

__global__ void convert_rows_kernel(const void* x, int xt, int64_t ldx, void* y, int yt, int64_t M, int64_t K) {
  const int64_t n = M * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(y, yt, i, ld(x, xt, (i / K) * ldx + i % K));
}

__global__ void act_mul_kernel(const void* gu, int gt, int64_t ld_gu, void* out, int ot, int64_t M, int64_t I,
                               int act_code) {
  const int64_t n = M * I;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / I, c = i % I;
    st(out, ot, i, act::apply(act_code, ld(gu, gt, r * ld_gu + c)) * ld(gu, gt, r * ld_gu + I + c));
  }
}

__global__ void add_kernel(const void* a, int at, const void* b, int bt, void* out, int ot, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(out, ot, i, ld(a, at, i) + ld(b, bt, i));
}

// out[m, :] += round(sigmoid(gate[m])) * x[m, :], each product rounded to x's dtype (as transformers does).
__global__ void add_sigmoid_gated_kernel(const void* x, int xt, const void* gate, int gt, void* out, int ot, int64_t M,
                                         int64_t H) {
  const int64_t n = M * H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float s = round_as(xt, act::sigmoid(ld(gate, gt, i / H)));
    st(out, ot, i, ld(out, ot, i) + round_as(xt, s * ld(x, xt, i)));
  }
}

__global__ void clamp_kernel(void* x, int t, int64_t n, float limit) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    st(x, t, i, fminf(fmaxf(ld(x, t, i), -limit), limit));
}

}  // namespace

cudaError_t embedding(const int64_t* ids, int64_t n, int64_t V, int64_t H, const void* table, int tt, void* out, int ot,
                      cudaStream_t s) {
  embedding_kernel<<<unsigned(n), 256, 0, s>>>(ids, V, H, table, tt, out, ot);
  return cudaGetLastError();
}

cudaError_t fill_bias(const void* bias, int bt, void* y, int yt, int64_t M, int64_t N, cudaStream_t s) {
  fill_bias_kernel<<<blocks_for(M * N), 256, 0, s>>>(bias, bt, y, yt, M, N);
  return cudaGetLastError();
}

cudaError_t convert_rows(const void* x, int xt, int64_t ldx, void* y, int yt, int64_t M, int64_t K, cudaStream_t s) {
  convert_rows_kernel<<<blocks_for(M * K), 256, 0, s>>>(x, xt, ldx, y, yt, M, K);
  return cudaGetLastError();
}

cudaError_t act_mul(const void* gu, int gt, int64_t ld_gu, void* out, int ot, int64_t M, int64_t I, int act,
                    cudaStream_t s) {
  act_mul_kernel<<<blocks_for(M * I), 256, 0, s>>>(gu, gt, ld_gu, out, ot, M, I, act);
  return cudaGetLastError();
}

cudaError_t add(const void* a, int at, const void* b, int bt, void* out, int ot, int64_t n, cudaStream_t s) {
  add_kernel<<<blocks_for(n), 256, 0, s>>>(a, at, b, bt, out, ot, n);
  return cudaGetLastError();
}

cudaError_t add_sigmoid_gated(const void* x, int xt, const void* gate, int gt, void* out, int ot, int64_t M, int64_t H,
                              cudaStream_t s) {
  add_sigmoid_gated_kernel<<<blocks_for(M * H), 256, 0, s>>>(x, xt, gate, gt, out, ot, M, H);
  return cudaGetLastError();
}

cudaError_t clamp(void* x, int t, int64_t n, float limit, cudaStream_t s) {
  clamp_kernel<<<blocks_for(n), 256, 0, s>>>(x, t, n, limit);
  return cudaGetLastError();
}

}  // namespace moekit::model::kernels

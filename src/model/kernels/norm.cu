// RMSNorm kernels of the model (one block per row) and the few-row projection for operands of mixed types.
#include "base/cuda_pdl.cuh"
#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

// The most threads a norm launch has (norm_threads): the kernels are compiled for it, so that one block of 1024
// fits the register file (the register-row kernels took 72 registers without the bound, and rows of 4096 values
// and more, 1024 threads, failed to launch).
constexpr int kNormMaxThreads = 1024;

// The second pass of both norms: y = w * (x * inv), with x_hat rounded to x's dtype first unless
// weight_before_cast (see DeviceOps::rmsnorm).
__device__ __forceinline__ void store_normed(const void* x, int xt, int64_t x0, const void* w, int wt, void* y, int yt,
                                             int64_t y0, int64_t D, float inv, int weight_before_cast) {
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float h = ld(x, xt, x0 + i) * inv;
    const float wv = ld(w, wt, i);
    st(y, yt, y0 + i, weight_before_cast ? wv * h : wv * round_as(xt, h));
  }
}

__global__ void __launch_bounds__(kNormMaxThreads)
    rmsnorm_kernel(const void* x, int xt, int64_t ldx, const void* w, int wt, void* y, int yt, int64_t ldy, int64_t D,
                   float eps, int weight_before_cast) {
  __shared__ float red[32];
  cuda::pdl_wait();  // PDL: everything below reads what the kernels before wrote
  cuda::pdl_trigger();
  const int64_t r = blockIdx.x;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = ld(x, xt, r * ldx + i);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, red) / float(D) + eps);
  store_normed(x, xt, r * ldx, w, wt, y, yt, r * ldy, D, inv, weight_before_cast);
}

// h = round(h + a) in place, then y = rmsnorm(h) * w: each thread re-reads only what it wrote.
__global__ void __launch_bounds__(kNormMaxThreads)
    add_rmsnorm_kernel(void* h, int ht, const void* a, int at, const void* w, int wt, void* y, int yt, int64_t D,
                       float eps, int weight_before_cast) {
  __shared__ float red[32];
  cuda::pdl_wait();  // PDL: everything below reads what the kernels before wrote
  cuda::pdl_trigger();
  cuda::pdl_wait();  // PDL: everything below reads what the kernels before wrote
  cuda::pdl_trigger();
  const int64_t r = blockIdx.x;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = round_as(ht, ld(h, ht, r * D + i) + ld(a, at, r * D + i));
    st(h, ht, r * D + i, v);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, red) / float(D) + eps);
  store_normed(h, ht, r * D, w, wt, y, yt, r * D, D, inv, weight_before_cast);
}

// The decode step's norms with the row in registers: thread i holds elements i, i + blockDim.x, ... (at most
// kNormPer of them, so D <= kNormPer * blockDim.x), all of a row's loads issued at once; the weights are read
// before the PDL wait (they are constant), the residual sum stays in registers for the second pass. Same
// arithmetic and summation order as the kernels above (the per-thread partial sums, then block_sum).
constexpr int kNormPer = 8;

__global__ void __launch_bounds__(kNormMaxThreads)
    rmsnorm_reg_kernel(const void* x, int xt, int64_t ldx, const void* w, int wt, void* y, int yt, int64_t ldy,
                       int64_t D, float eps, int weight_before_cast) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  float wv[kNormPer], v[kNormPer];
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    wv[j] = i < D ? ld(w, wt, i) : 0.0f;
  }
  cuda::pdl_wait();  // PDL: x is written by the kernels before
  cuda::pdl_trigger();
  float ss = 0;
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    v[j] = i < D ? ld(x, xt, r * ldx + i) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) ss += v[j] * v[j];
  const float inv = rsqrtf(block_sum(ss, red) / float(D) + eps);
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    const float h = v[j] * inv;
    if (i < D) st(y, yt, r * ldy + i, weight_before_cast ? wv[j] * h : wv[j] * round_as(xt, h));
  }
}

__global__ void __launch_bounds__(kNormMaxThreads)
    add_rmsnorm_reg_kernel(void* h, int ht, const void* a, int at, const void* w, int wt, void* y, int yt, int64_t D,
                           float eps, int weight_before_cast) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  float wv[kNormPer], v[kNormPer], av[kNormPer];
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    wv[j] = i < D ? ld(w, wt, i) : 0.0f;
  }
  cuda::pdl_wait();  // PDL: h and a are written by the kernels before
  cuda::pdl_trigger();
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    v[j] = i < D ? ld(h, ht, r * D + i) : 0.0f;
    av[j] = i < D ? ld(a, at, r * D + i) : 0.0f;
  }
  float ss = 0;
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    v[j] = round_as(ht, v[j] + av[j]);
    if (i < D) st(h, ht, r * D + i, v[j]);
    ss += i < D ? v[j] * v[j] : 0.0f;
  }
  const float inv = rsqrtf(block_sum(ss, red) / float(D) + eps);
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    const float hn = v[j] * inv;
    if (i < D) st(y, yt, r * D + i, weight_before_cast ? wv[j] * hn : wv[j] * round_as(ht, hn));
  }
}

// y [M, N] = x [M, K] w [N, K]^T + bias for a few rows (M <= kSmallM) of operands of different dtypes (the
// f32 router under bf16 activations): one block per output column, the block's threads split K so that
// all of the column's loads are in flight at once; no conversion pass.
__global__ void small_m_linear_kernel(const void* x, int xt, int64_t ldx, const void* w, int wt, const void* bias,
                                      int bt, void* y, int yt, int M, int64_t N, int64_t K) {
  __shared__ float red[32];
  const int64_t n = blockIdx.x;
  float acc[kSmallM];
#pragma unroll
  for (int m = 0; m < kSmallM; ++m) acc[m] = 0.0f;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const float wv = ld(w, wt, n * K + k);
#pragma unroll
    for (int m = 0; m < kSmallM; ++m)
      if (m < M) acc[m] += wv * ld(x, xt, m * ldx + k);
  }
  for (int m = 0; m < M; ++m) {
    const float s = block_sum(acc[m], red);
    if (threadIdx.x == 0) st(y, yt, m * N + n, s + (bias ? ld(bias, bt, n) : 0.0f));
  }
}

// About four elements per thread: one row per block, so a single decode row is spread wide.
int norm_threads(int64_t D) {
  const int64_t t = (D / 4 + 31) / 32 * 32;
  return int(t < 64 ? 64 : (t > kNormMaxThreads ? kNormMaxThreads : t));
}

}  // namespace

cudaError_t rmsnorm(const void* x, int xt, int64_t ldx, const void* w, int wt, void* y, int yt, int64_t ldy, int64_t M,
                    int64_t D, float eps, bool weight_before_cast, cudaStream_t s) {
  const int threads = norm_threads(D);
  return cuda::launch_pdl(cuda::pdl_enabled(), D <= int64_t(kNormPer) * threads ? rmsnorm_reg_kernel : rmsnorm_kernel,
                          dim3(unsigned(M)), dim3(threads), 0, s, x, xt, ldx, w, wt, y, yt, ldy, D, eps,
                          weight_before_cast ? 1 : 0);
}

cudaError_t add_rmsnorm(void* h, int ht, const void* a, int at, const void* w, int wt, void* y, int yt, int64_t M,
                        int64_t D, float eps, bool weight_before_cast, cudaStream_t s) {
  const int threads = norm_threads(D);
  return cuda::launch_pdl(cuda::pdl_enabled(),
                          D <= int64_t(kNormPer) * threads ? add_rmsnorm_reg_kernel : add_rmsnorm_kernel,
                          dim3(unsigned(M)), dim3(threads), 0, s, h, ht, a, at, w, wt, y, yt, D, eps,
                          weight_before_cast ? 1 : 0);
}

cudaError_t small_m_linear(const void* x, int xt, int64_t ldx, const void* w, int wt, const void* bias, int bt, void* y,
                           int yt, int M, int64_t N, int64_t K, cudaStream_t s) {
  small_m_linear_kernel<<<unsigned(N), 256, 0, s>>>(x, xt, ldx, w, wt, bias, bt, y, yt, M, N, K);
  return cudaGetLastError();
}

}  // namespace moekit::model::kernels

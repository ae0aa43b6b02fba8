// RMSNorm kernels of the model (one block per row) and the few-row projection for operands of mixed types.
#include "base/cuda_pdl.cuh"
#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

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

__global__ void rmsnorm_kernel(const void* x, int xt, int64_t ldx, const void* w, int wt, void* y, int yt, int64_t ldy,
                               int64_t D, float eps, int weight_before_cast) {
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
__global__ void add_rmsnorm_kernel(void* h, int ht, const void* a, int at, const void* w, int wt, void* y, int yt,
                                   int64_t D, float eps, int weight_before_cast) {
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
  return int(t < 64 ? 64 : (t > 1024 ? 1024 : t));
}

}  // namespace

cudaError_t rmsnorm(const void* x, int xt, int64_t ldx, const void* w, int wt, void* y, int yt, int64_t ldy, int64_t M,
                    int64_t D, float eps, bool weight_before_cast, cudaStream_t s) {
  return cuda::launch_pdl(cuda::pdl_enabled(), rmsnorm_kernel, dim3(unsigned(M)), dim3(norm_threads(D)), 0, s, x, xt,
                          ldx, w, wt, y, yt, ldy, D, eps, weight_before_cast ? 1 : 0);
}

cudaError_t add_rmsnorm(void* h, int ht, const void* a, int at, const void* w, int wt, void* y, int yt, int64_t M,
                        int64_t D, float eps, bool weight_before_cast, cudaStream_t s) {
  return cuda::launch_pdl(cuda::pdl_enabled(), add_rmsnorm_kernel, dim3(unsigned(M)), dim3(norm_threads(D)), 0, s, h,
                          ht, a, at, w, wt, y, yt, D, eps, weight_before_cast ? 1 : 0);
}

cudaError_t small_m_linear(const void* x, int xt, int64_t ldx, const void* w, int wt, const void* bias, int bt, void* y,
                           int yt, int M, int64_t N, int64_t K, cudaStream_t s) {
  small_m_linear_kernel<<<unsigned(N), 256, 0, s>>>(x, xt, ldx, w, wt, bias, bt, y, yt, M, N, K);
  return cudaGetLastError();
}

}  // namespace moekit::model::kernels

// Grouped projection over sorted rows on the CUDA cores: the fallback of grouped_gemm for what the
// tensor-core kernel does not serve (f32, transposed weights, sizes not a multiple of 8, unaligned
// pointers, pre-sm_80 devices). f32 accumulation, any strides.
//
// Block tile: the row tile of one expert (tile_m rows, in passes of 64) x 64 "virtual" columns x 16
// of the reduction. Gated
// projections interleave virtual columns: 2c is the gate row and 2c + 1 the up row of output column c,
// so each thread holds both halves of its outputs.
#include "backends/cuda/kernels/device_math.cuh"

namespace moekit::cuda::kernels {
namespace {

constexpr int kSimtThreads = 256;
constexpr int kSimtBN = 64;  // virtual columns
constexpr int kSimtBK = 16;
constexpr int kSimtBM = 64;  // rows per pass

template <class T, int EPI>
__global__ void __launch_bounds__(kSimtThreads) grouped_gemm_simt_kernel(GroupedGemmArgs args, int tile_m) {
  constexpr int BM = kSimtBM, TM = BM / 16;  // rows per thread
  __shared__ float a_s[kSimtBK][BM + 4];
  __shared__ float b_s[kSimtBK][kSimtBN + 4];

  const int tile = blockIdx.x;
  if (tile >= __ldg(args.tile_offsets + args.experts)) return;
  const int e = tile_expert(args.tile_offsets, args.experts, tile);
  const int64_t tile_row0 = __ldg(args.offsets + e) + int64_t(tile - __ldg(args.tile_offsets + e)) * tile_m;
  const int64_t m_end = min(int64_t(__ldg(args.offsets + e + 1)), tile_row0 + tile_m);
  const int bn = blockIdx.y;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;

  const T* a = static_cast<const T*>(args.a);
  const T* b = static_cast<const T*>(args.b) + int64_t(e) * args.b_expert_stride;
  const int64_t K = args.k;

  // Weight row of virtual column v of this tile, or -1 past the end.
  auto weight_row = [&](int v) -> int64_t {
    if constexpr (EPI == kEpiGated) {
      const int64_t c = int64_t(bn) * (kSimtBN / 2) + v / 2;
      if (c >= args.n) return -1;
      return (v & 1) ? up_row(args.gate, c, args.inter) : gate_row(args.gate, c);
    } else {
      const int64_t n = int64_t(bn) * kSimtBN + v;
      return n < args.n ? n : -1;
    }
  };

  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(e) * args.bias_expert_stride : nullptr;
  const bool b_k_contiguous = args.b_stride_k == 1;
  for (int64_t m0 = tile_row0; m0 < m_end; m0 += BM) {
    float acc[TM][4];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int64_t k0 = 0; k0 < K; k0 += kSimtBK) {
      for (int i = tid; i < BM * kSimtBK; i += kSimtThreads) {
        const int r = i / kSimtBK, kk = i % kSimtBK;
        const int64_t row = m0 + r, kg = k0 + kk;
        float v = 0.0f;
        if (row < m_end && kg < K) {
          const int64_t src = args.a_rows ? int64_t(args.a_rows[row] / args.a_row_div) : row;
          v = to_f32(a[src * args.lda + kg]);
        }
        a_s[kk][r] = v;
      }
      for (int i = tid; i < kSimtBN * kSimtBK; i += kSimtThreads) {
        int v, kk;
        if (b_k_contiguous) { v = i / kSimtBK; kk = i % kSimtBK; }
        else { kk = i / kSimtBN; v = i % kSimtBN; }
        const int64_t wr = weight_row(v), kg = k0 + kk;
        b_s[kk][v] = (wr >= 0 && kg < K) ? to_f32(b[wr * args.b_stride_n + kg * args.b_stride_k]) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kSimtBK; ++kk) {
        float av[TM], bv[4];
#pragma unroll
        for (int i = 0; i < TM; ++i) av[i] = a_s[kk][ty * TM + i];
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[j] = b_s[kk][tx * 4 + j];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
      __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int64_t row = m0 + ty * TM + i;
      if (row >= m_end) continue;
      if constexpr (EPI == kEpiGated) {
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          const int64_t c = int64_t(bn) * (kSimtBN / 2) + tx * 2 + jp;
          if (c >= args.n) continue;
          float g = acc[i][2 * jp], u = acc[i][2 * jp + 1];
          if (bias) {
            g += to_f32(bias[gate_row(args.gate, c)]);
            u += to_f32(bias[up_row(args.gate, c, args.inter)]);
          }
          static_cast<T*>(args.out)[row * args.ldo + c] = from_f32<T>(gate_value(args.gate, g, u));
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t n = int64_t(bn) * kSimtBN + tx * 4 + j;
          if (n >= args.n) continue;
          if constexpr (EPI == kEpiActOnly) {
            const float v = acc[i][j] + (bias ? to_f32(bias[n]) : 0.0f);
            static_cast<T*>(args.out)[row * args.ldo + n] = from_f32<T>(activate(args.gate.activation, v));
          } else {
            static_cast<float*>(args.out)[row * args.ldo + n] = acc[i][j];
          }
        }
      }
    }
  }  // row passes
}

template <class T>
cudaError_t launch_simt(const GroupedGemmArgs& a, int tile_m, int64_t max_tiles, cudaStream_t stream) {
  const int64_t cols = a.epilogue == kEpiGated ? kSimtBN / 2 : kSimtBN;
  const dim3 grid(unsigned(max_tiles), unsigned((a.n + cols - 1) / cols));
  switch (a.epilogue) {
    case kEpiGated: grouped_gemm_simt_kernel<T, kEpiGated><<<grid, kSimtThreads, 0, stream>>>(a, tile_m); break;
    case kEpiActOnly: grouped_gemm_simt_kernel<T, kEpiActOnly><<<grid, kSimtThreads, 0, stream>>>(a, tile_m); break;
    case kEpiF32: grouped_gemm_simt_kernel<T, kEpiF32><<<grid, kSimtThreads, 0, stream>>>(a, tile_m); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t grouped_gemm_simt(const GroupedGemmArgs& a, int tile_m, cudaStream_t stream) {
  if (a.max_rows == 0 || a.n == 0) return cudaSuccess;
  const int64_t max_tiles = grouped_max_tiles(a.max_rows, a.experts, tile_m);
  if (max_tiles > INT32_MAX || (a.n + kSimtBN / 2 - 1) / (kSimtBN / 2) > 65535) return cudaErrorInvalidConfiguration;
  if (tile_m < 1) return cudaErrorInvalidValue;
  return with_elem(a.type, [&](auto tag) { return launch_simt<decltype(tag)>(a, tile_m, max_tiles, stream); });
}

}  // namespace moekit::cuda::kernels

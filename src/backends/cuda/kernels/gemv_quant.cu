// FP8 block-scaled experts at decode sizes: the grouped projection as a weight-streaming GEMV (SPEC section 5).
//
// Rows are the pairs sorted by expert (route_sort) in row tiles of `tile_m`: one block per (row tile, block of
// output columns), so each hit expert's weights are streamed once per step however many of its rows the tile
// holds. Each warp owns four weight rows (two gated columns: gate and up rows; else four columns) and reads them
// with 16-byte non-caching loads, kUnroll steps of 512 bytes in flight per lane; e4m3 codes become f32 in
// registers (e4m3x2 -> f16x2 -> f32: exact). The activation rows (e4m3 codes quantized per 128 inputs by
// quantize_fp8_rows) are read through L1, `rows_per_pass` rows at a time (1: each weight chunk converted once per
// row; 4: converted once for four rows, the activations staying in registers).
//
// Sums: a lane's 16 products are summed in f32 (exact products), scaled once by a_scale * w_scale of their
// 128-input block and added to the lane's f32 accumulator; the warp then adds its lanes' accumulators. The same
// operations as the mma.sync kernel (block partial sums of exact products, scaled per block), in a different
// order of f32 additions. The epilogues are fp8_epilogue.cuh's (the gated activations rounded as transformers'
// FP8 path materialises them), so the next quantisation sees the reference's values.
//
// FP4 weights (quant_fp4.h) run the same kernel: a lane's 16 bytes are then 32 e2m1 codes, one ue8m0 scale group
// (the chunk is converted in two halves of 16), a quarter of the bytes of bf16 per weight. A is the quantized e4m3
// rows as above (FP4 with UE8M0 scales) or the activations as they are (MXFP4: rows of the activation dtype, read
// through L1 and converted to f32; the products with e2m1 values are then f32 products, summed per group and
// scaled by the power-of-two weight scale).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "backends/cuda/kernels/fp4_convert.cuh"
#include "backends/cuda/kernels/fp8_epilogue.cuh"
#include "backends/cuda/kernels/quant_fp4.h"
#include "base/cuda_pdl.cuh"

namespace moekit::cuda::kernels {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kWRows = 4;     // weight rows per warp
constexpr int kChunk = 16;    // bytes per lane and step
constexpr int kStep = 32 * kChunk;  // bytes per warp and step (four 128-input blocks)

__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Sixteen e4m3 codes as f32 (exact: e4m3 -> f16 loses nothing).
__device__ __forceinline__ void e4m3x16_to_f32(const uint4& raw, float (&v)[16]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[i] >> (16 * h)), __NV_E4M3);
      const float2 f = __half22float2(__half2(hr));
      v[i * 4 + h * 2] = f.x;
      v[i * 4 + h * 2 + 1] = f.y;
    }
}

template <int EPI>
__device__ __forceinline__ int64_t weight_row(const Fp8GemmArgs& args, int64_t c0, int j) {
  if constexpr (EPI == kEpiGated) {
    const int64_t c = min(c0 + j / 2, args.n - 1);  // columns past n recompute the last one, never stored
    return (j & 1) ? up_row(args.gate, c, args.inter) : gate_row(args.gate, c);
  } else {
    return min(c0 + j, args.n - 1);
  }
}

// Sixteen A values from input k0 of a row (byte pointer): e4m3 codes (quantized A) or elements of T (float A).
template <class T, bool AF>
__device__ __forceinline__ void load_a16(const uint8_t* row, int64_t k0, float (&f)[16]) {
  if constexpr (!AF) {
    e4m3x16_to_f32(__ldg(reinterpret_cast<const uint4*>(row + k0)), f);
  } else if constexpr (std::is_same_v<T, float>) {
    const float4* p = reinterpret_cast<const float4*>(row) + k0 / 4;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 v = __ldg(p + q);
      f[4 * q] = v.x, f[4 * q + 1] = v.y, f[4 * q + 2] = v.z, f[4 * q + 3] = v.w;
    }
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(row + k0 * 2);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint4 v = __ldg(p + q);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const T* h = reinterpret_cast<const T*>(&w[i]);
        f[8 * q + 2 * i] = to_f32(h[0]);
        f[8 * q + 2 * i + 1] = to_f32(h[1]);
      }
    }
  }
}

// FP4: the weights are e2m1 (a 16-byte chunk: 32 inputs, one scale group); AF: A is float (see quant_fp4.h).
template <class T, int EPI, int RC, int U, bool FP4, bool AF>
__global__ void __launch_bounds__(kThreads, 2) quant_gemv_kernel(const Fp4GemmArgs args, int tile_m) {
  pdl_wait();  // launched with PDL: the routing, the quantized rows and the first projection come before
  pdl_trigger();
  const int tile = blockIdx.y;
  if (tile >= __ldg(args.tile_offsets + args.experts)) return;
  const int expert = tile_expert(args.tile_offsets, args.experts, tile);
  const int64_t m0 = __ldg(args.offsets + expert) + int64_t(tile - __ldg(args.tile_offsets + expert)) * tile_m;
  const int64_t m_end = min(int64_t(__ldg(args.offsets + expert + 1)), m0 + tile_m);
  if (m0 >= m_end) return;

  constexpr int kCols = EPI == kEpiGated ? kWRows / 2 : kWRows;
  constexpr int kHalves = FP4 ? 2 : 1;  // 16 inputs each
  constexpr int64_t kAElem = AF ? int64_t(sizeof(T)) : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c0 = (int64_t(blockIdx.x) * kWarps + warp) * kCols;
  if (c0 >= args.n) return;

  const int64_t KB = (args.k + 127) / 128, bk = args.b_k;
  const int64_t seg = args.b_scale_seg, seg_blocks = (seg + 127) / 128;
  const uint8_t* wrow[kWRows];
  const float* wsc[kWRows];    // FP8: f32 block scales of the row
  const uint8_t* wse[kWRows];  // FP4: ue8m0 codes of the row
#pragma unroll
  for (int j = 0; j < kWRows; ++j) {
    const int64_t wr = weight_row<EPI>(args, c0, j);
    wrow[j] = args.b + int64_t(expert) * args.b_expert_stride + wr * args.b_stride_n;
    if constexpr (FP4) {
      wse[j] = args.b_e8 + int64_t(expert) * args.bs_expert_stride + wr * args.b_e8_ld;
      wsc[j] = nullptr;
    } else {
      wsc[j] = args.b_scale + int64_t(expert) * args.bs_expert_stride +
               ((wr / seg) * seg_blocks + (wr % seg) / 128) * KB;
      wse[j] = nullptr;
    }
  }
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(expert) * args.bias_expert_stride : nullptr;

  for (int64_t m = m0; m < m_end; m += RC) {
    const int nr = int(min(int64_t(RC), m_end - m));
    const uint8_t* arow[RC];
    const float* asc[RC];
#pragma unroll
    for (int r = 0; r < RC; ++r) {
      const int64_t row = m + (r < nr ? r : nr - 1);
      const int64_t src = args.a_rows ? int64_t(__ldg(args.a_rows + row) / args.a_row_div) : row;
      arow[r] = args.a + src * args.lda * kAElem;
      asc[r] = AF ? nullptr : args.a_scale + src * args.lds;
    }
    float acc[kWRows][RC];
#pragma unroll
    for (int j = 0; j < kWRows; ++j)
#pragma unroll
      for (int r = 0; r < RC; ++r) acc[j][r] = 0.0f;

    for (int64_t i0 = int64_t(lane) * kChunk; i0 < bk; i0 += int64_t(kStep) * U) {
      uint4 wv[U][kWRows];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // every weight load of the U steps first
        const int64_t i = i0 + int64_t(u) * kStep;
#pragma unroll
        for (int j = 0; j < kWRows; ++j) wv[u][j] = i < bk ? load_stream(wrow[j] + i) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = i0 + int64_t(u) * kStep;
        if (i >= bk) break;
        const int64_t k0 = FP4 ? 2 * i : i;  // the chunk's first input
        float sw[kWRows];
#pragma unroll
        for (int j = 0; j < kWRows; ++j) {
          if constexpr (FP4) sw[j] = ue8m0_f32(__ldg(wse[j] + i / 16));
          else sw[j] = __ldg(wsc[j] + i / 128);  // i / 128 < KB: bk <= KB * 128
        }
        float sa[RC];
#pragma unroll
        for (int r = 0; r < RC; ++r) sa[r] = (!AF && r < nr) ? __ldg(asc[r] + k0 / 128) : 1.0f;
        float part[kWRows][RC];
#pragma unroll
        for (int j = 0; j < kWRows; ++j)
#pragma unroll
          for (int r = 0; r < RC; ++r) part[j][r] = 0.0f;
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          float af[RC][16];
#pragma unroll
          for (int r = 0; r < RC; ++r)
            if (r < nr) load_a16<T, AF>(arow[r], k0 + 16 * h, af[r]);
#pragma unroll
          for (int j = 0; j < kWRows; ++j) {
            float wf[16];
            if constexpr (FP4) {
              if (h == 0) e2m1x16_to_f32(wv[u][j].x, wv[u][j].y, wf);
              else e2m1x16_to_f32(wv[u][j].z, wv[u][j].w, wf);
            } else {
              e4m3x16_to_f32(wv[u][j], wf);
            }
#pragma unroll
            for (int r = 0; r < RC; ++r) {
              if (r < nr) {
#pragma unroll
                for (int e = 0; e < 16; ++e) part[j][r] = fmaf(af[r][e], wf[e], part[j][r]);
              }
            }
          }
        }
#pragma unroll
        for (int j = 0; j < kWRows; ++j)
#pragma unroll
          for (int r = 0; r < RC; ++r) acc[j][r] += part[j][r] * (sa[r] * sw[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kWRows; ++j)
#pragma unroll
      for (int r = 0; r < RC; ++r)
#pragma unroll
        for (int d = 16; d > 0; d /= 2) acc[j][r] += __shfl_xor_sync(0xffffffffu, acc[j][r], d);

    // Lane cc * RC + r stores column c0 + cc of row m + r.
    if (lane >= kCols * RC) continue;
    const int cc = lane / RC, r = lane % RC;
    const int64_t c = c0 + cc;
    if (r >= nr || c >= args.n) continue;
    float first = 0.0f, second = 0.0f;
#pragma unroll
    for (int jc = 0; jc < kCols; ++jc)
#pragma unroll
      for (int rr = 0; rr < RC; ++rr)
        if (jc == cc && rr == r) {
          if constexpr (EPI == kEpiGated) {
            first = acc[2 * jc][rr];
            second = acc[2 * jc + 1][rr];
          } else {
            first = acc[jc][rr];
          }
        }
    const int64_t row = m + r;
    if constexpr (EPI == kEpiGated) {
      const float bg = bias ? to_f32(bias[gate_row(args.gate, c)]) : 0.0f;
      const float bu = bias ? to_f32(bias[up_row(args.gate, c, args.inter)]) : 0.0f;
      static_cast<T*>(args.out)[row * args.ldo + c] =
          from_f32<T>(fp8_gated<T>(args.gate, first, second, bias != nullptr, bg, bu));
    } else if constexpr (EPI == kEpiActOnly) {
      const float y = fp8_act_only<T>(args.gate, first, bias != nullptr, bias ? to_f32(bias[c]) : 0.0f);
      static_cast<T*>(args.out)[row * args.ldo + c] = from_f32<T>(y);
    } else {
      static_cast<float*>(args.out)[row * args.ldo + c] = first;
    }
  }
}

template <class T, int EPI, bool FP4, bool AF>
cudaError_t launch_gemv(const Fp4GemmArgs& a, int tile_m, int rows_per_pass, cudaStream_t stream) {
  constexpr int kCols = EPI == kEpiGated ? kWRows / 2 : kWRows;
  const int64_t tiles = grouped_max_tiles(a.max_rows, a.experts, tile_m);
  const int64_t col_blocks = (a.n + kWarps * kCols - 1) / (kWarps * kCols);
  if (tiles > 65535 || col_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid{unsigned(col_blocks), unsigned(tiles)};
  if (rows_per_pass == 1)
    return launch_pdl(pdl_enabled(), quant_gemv_kernel<T, EPI, 1, 2, FP4, AF>, grid, dim3(kThreads), 0, stream, a,
                      tile_m);
  return launch_pdl(pdl_enabled(), quant_gemv_kernel<T, EPI, 4, 1, FP4, AF>, grid, dim3(kThreads), 0, stream, a,
                    tile_m);
}

template <bool FP4, bool AF>
cudaError_t launch_gemv_any(const Fp4GemmArgs& a, int tile_m, int rows_per_pass, cudaStream_t stream) {
  if (tile_m < 1 || (rows_per_pass != 1 && rows_per_pass != 4)) return cudaErrorInvalidValue;
  if (a.max_rows == 0 || a.n == 0 || a.experts == 0) return cudaSuccess;
  return with_elem(a.type, [&](auto tag) {
    using T = decltype(tag);
    switch (a.epilogue) {
      case kEpiGated: return launch_gemv<T, kEpiGated, FP4, AF>(a, tile_m, rows_per_pass, stream);
      case kEpiActOnly: return launch_gemv<T, kEpiActOnly, FP4, AF>(a, tile_m, rows_per_pass, stream);
      default: return launch_gemv<T, kEpiF32, FP4, AF>(a, tile_m, rows_per_pass, stream);
    }
  });
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

bool fp8_gemv_ok(const Fp8GemmArgs& a) {
  return a.b_k % 16 == 0 && a.b_k >= a.k && a.lda % 16 == 0 && a.lda >= a.b_k && a.b_stride_n % 16 == 0 &&
         a.b_expert_stride % 16 == 0 && a.b_scale_seg >= 1 && aligned16(a.a) && aligned16(a.b) &&
         (a.epilogue == kEpiGated || a.epilogue == kEpiActOnly || a.epilogue == kEpiF32);
}

cudaError_t fp8_gemv(const Fp8GemmArgs& a, int tile_m, int rows_per_pass, cudaStream_t stream) {
  if (!fp8_gemv_ok(a)) return cudaErrorInvalidValue;
  Fp4GemmArgs g;
  static_cast<Fp8GemmArgs&>(g) = a;
  return launch_gemv_any<false, false>(g, tile_m, rows_per_pass, stream);
}

bool fp4_gemv_ok(const Fp4GemmArgs& a) {
  const int64_t ae = a.a_float ? elem_bytes(a.type) : 1;  // bytes of an A element
  return a.k % 32 == 0 && a.b_k * 2 == a.k && a.b_k % 16 == 0 && a.lda >= a.k && (a.lda * ae) % 16 == 0 &&
         a.b_stride_n % 16 == 0 && a.b_expert_stride % 16 == 0 && a.b_e8 != nullptr && a.b_e8_ld >= a.k / 32 &&
         aligned16(a.a) && aligned16(a.b) && (a.a_float || a.a_scale != nullptr) &&
         (a.epilogue == kEpiGated || a.epilogue == kEpiActOnly || a.epilogue == kEpiF32);
}

cudaError_t fp4_gemv(const Fp4GemmArgs& a, int tile_m, int rows_per_pass, cudaStream_t stream) {
  if (!fp4_gemv_ok(a)) return cudaErrorInvalidValue;
  return a.a_float ? launch_gemv_any<true, true>(a, tile_m, rows_per_pass, stream)
                   : launch_gemv_any<true, false>(a, tile_m, rows_per_pass, stream);
}

}  // namespace moekit::cuda::kernels

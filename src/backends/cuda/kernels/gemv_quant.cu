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
// The pair form (fp8_pair_gemv, a few tokens) runs the same pass per (token, slot) pair, its expert read from
// top_k_index, with no routing sort, and fuses the step after each projection into the last block to finish its
// part (arrival counters in the stream workspace, left zero): the gated activations' quantisation after the first,
// the weighted combine after the second. Three launches (quantisation of the token rows, the two projections) where
// the sorted form takes six.
//
// FP4 weights (quant_fp4.h) run the same kernel: a lane's 16 bytes are then 32 e2m1 codes, one ue8m0 scale group
// (the chunk is converted in two halves of 16), a quarter of the bytes of bf16 per weight. A is the quantized e4m3
// rows as above (FP4 with UE8M0 scales) or the activations as they are (MXFP4: rows of the activation dtype, read
// through L1 and converted to f32; the products with e2m1 values are then f32 products, summed per group and
// scaled by the power-of-two weight scale).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "backends/cuda/kernels/fp4_convert.cuh"
#include "backends/cuda/kernels/fp8_epilogue.cuh"
#include "backends/cuda/kernels/fp8_quant.cuh"
#include "backends/cuda/kernels/quant_fp4.h"
#include "base/cuda_device.h"
#include "base/cuda_pdl.cuh"
#include "base/env.h"

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

// One pass of a warp over K: acc[j][r] += the lane's share of weight row j's dot product with A row r < nr, each
// 128-input block's (FP4: 32-input group's) products summed in f32, then scaled once by a_scale * w_scale. Every
// weight load of U steps is issued before the first conversion.
template <class T, int RC, int U, bool FP4, bool AF>
__device__ __forceinline__ void gemv_pass(const Fp4GemmArgs& args, const uint8_t* const (&wrow)[kWRows],
                                          const float* const (&wsc)[kWRows], const uint8_t* const (&wse)[kWRows],
                                          const uint8_t* const (&arow)[RC], const float* const (&asc)[RC], int nr,
                                          int lane, float (&acc)[kWRows][RC]) {
  constexpr int kHalves = FP4 ? 2 : 1;  // 16 inputs each
  const int64_t bk = args.b_k;
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
}

// The weight rows of the warp's columns from c0 (gated: gate and up rows in turn) of expert `expert`, with their
// scale rows (FP8: f32 block scales; FP4: ue8m0 codes).
template <int EPI, bool FP4>
__device__ __forceinline__ void weight_rows(const Fp4GemmArgs& args, int expert, int64_t c0,
                                            const uint8_t* (&wrow)[kWRows], const float* (&wsc)[kWRows],
                                            const uint8_t* (&wse)[kWRows]) {
  const int64_t KB = (args.k + 127) / 128;
  const int64_t seg = args.b_scale_seg, seg_blocks = (seg + 127) / 128;
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
}

template <int RC>
__device__ __forceinline__ void warp_sums(float (&acc)[kWRows][RC]) {
#pragma unroll
  for (int j = 0; j < kWRows; ++j)
#pragma unroll
    for (int r = 0; r < RC; ++r)
#pragma unroll
      for (int d = 16; d > 0; d /= 2) acc[j][r] += __shfl_xor_sync(0xffffffffu, acc[j][r], d);
}

// The epilogue of the warp's columns from c0 for rows m.. (nr of them; the sums reduced over the warp): lane
// cc * RC + r stores column c0 + cc of row m + r.
template <class T, int EPI, int RC>
__device__ __forceinline__ void store_columns(const Fp4GemmArgs& args, const float (&acc)[kWRows][RC], int expert,
                                              int64_t c0, int64_t m, int nr, int lane) {
  constexpr int kCols = EPI == kEpiGated ? kWRows / 2 : kWRows;
  if (lane >= kCols * RC) return;
  const int cc = lane / RC, r = lane % RC;
  const int64_t c = c0 + cc;
  if (r >= nr || c >= args.n) return;
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
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(expert) * args.bias_expert_stride : nullptr;
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

// The expert and the rows [m0, m_end) of this block's row tile (blockIdx.y); false where the tile holds none.
__device__ __forceinline__ bool tile_rows(const Fp8GemmArgs& args, int tile_m, int& expert, int64_t& m0,
                                          int64_t& m_end) {
  const int tile = blockIdx.y;
  if (tile >= __ldg(args.tile_offsets + args.experts)) return false;
  expert = tile_expert(args.tile_offsets, args.experts, tile);
  m0 = __ldg(args.offsets + expert) + int64_t(tile - __ldg(args.tile_offsets + expert)) * tile_m;
  m_end = min(int64_t(__ldg(args.offsets + expert + 1)), m0 + tile_m);
  return m0 < m_end;
}

// FP4: the weights are e2m1 (a 16-byte chunk: 32 inputs, one scale group); AF: A is float (see quant_fp4.h).
template <class T, int EPI, int RC, int U, bool FP4, bool AF>
__global__ void __launch_bounds__(kThreads, 2) quant_gemv_kernel(const Fp4GemmArgs args, int tile_m) {
  pdl_wait();  // launched with PDL: the routing, the quantized rows and the first projection come before
  pdl_trigger();
  int expert;
  int64_t m0, m_end;
  if (!tile_rows(args, tile_m, expert, m0, m_end)) return;

  constexpr int kCols = EPI == kEpiGated ? kWRows / 2 : kWRows;
  constexpr int64_t kAElem = AF ? int64_t(sizeof(T)) : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c0 = (int64_t(blockIdx.x) * kWarps + warp) * kCols;
  if (c0 >= args.n) return;
  const uint8_t* wrow[kWRows];
  const float* wsc[kWRows];
  const uint8_t* wse[kWRows];
  weight_rows<EPI, FP4>(args, expert, c0, wrow, wsc, wse);

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
    gemv_pass<T, RC, U, FP4, AF>(args, wrow, wsc, wse, arow, asc, nr, lane, acc);
    warp_sums(acc);
    store_columns<T, EPI, RC>(args, acc, expert, c0, m, nr, lane);
  }
}

// An element of T written by another block of this launch, read from L2 (past L1, which is not coherent).
template <class T>
__device__ __forceinline__ float load_cg(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return __ldcg(reinterpret_cast<const float*>(p));
  } else {
    const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
    T v;
    memcpy(&v, &bits, sizeof(T));
    return to_f32(v);
  }
}

// Routing weight q of an array of `type`.
__device__ __forceinline__ float routing_weight(const void* w, Elem type, int64_t q) {
  switch (type) {
    case Elem::bf16: return to_f32(static_cast<const bf16*>(w)[q]);
    case Elem::f16: return to_f32(static_cast<const f16*>(w)[q]);
    default: return static_cast<const float*>(w)[q];
  }
}

// The last-block pattern of the pair forms: this block's outputs made visible device-wide, then one arrival on
// `counter` (zero at launch); true in every thread of the block that arrives `expected`-th, which sets the counter back
// to zero (left zero for the next launch) and may then read the other blocks' outputs from L2.
__device__ __forceinline__ bool pair_arrive_last(uint32_t* counter, uint32_t expected) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1u) + 1 == expected;
    if (last) *counter = 0;  // every arrival of this launch is in
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// The pair forms' combine of token t's columns [col0, col0 + cols) (threads of the block, `threads` of them):
// out[t, c] = sum over slots s in order of w[t * K + s] * (y[t * K + s, c] + bias2[e, c]), y = args.out (f32, ldo),
// rounded once to T, exactly as combine sums them; sentinel and bad ids contribute exactly nothing.
template <class T>
__device__ __forceinline__ void pair_combine(const Fp4GemmArgs& args, const Fp8PairArgs& pa, int64_t t, int64_t col0,
                                             int cols, int threads) {
  const int K = pa.top_k;
  const T* bias2 = static_cast<const T*>(pa.bias2);
  const float* y = static_cast<const float*>(args.out);
  for (int j = threadIdx.x; j < cols; j += threads) {
    const int64_t c = col0 + j;
    if (c >= args.n) break;
    float acc = 0.0f;
    for (int s = 0; s < K; ++s) {  // slot order: deterministic
      const int64_t q = t * K + s;
      const int e = pair_expert_of(pa.index, pa.index_type, q, K, args.experts, nullptr);
      if (e >= args.experts) continue;
      const float w = routing_weight(pa.routing_weights, pa.routing_weight_type, q);
      acc += w * (__ldcg(y + q * args.ldo + c) + (bias2 ? to_f32(bias2[int64_t(e) * args.n + c]) : 0.0f));
    }
    static_cast<T*>(pa.out)[t * args.n + c] = from_f32<T>(acc);
  }
}

// ---- MXFP4 weights with bf16 activations on the tensor cores (fp4_mma_gemv) ----
//
// The same rows, tiles and epilogues as the kernel above, the products on mma.sync m16n8k16 (bf16 in, f32
// accumulation): the weight rows are the M side and up to 8 A rows of the tile the N side, so each weight is decoded
// once per 8 rows instead of once per row, and the decode is a few byte permutes per four codes. Warp: 16 weight
// rows (gated: the gate rows of 8 output columns, then their up rows, so that a thread's accumulators hold the gate
// and the up value of the same column and rows), the whole K; a thread (g = lane / 4, t = lane % 4) streams the
// 16-byte pieces t, t + 4, ... (32 inputs each: one scale group) of rows g and g + 8. The reduction is permuted the
// same way for both operands: in step s of a 128-input block, thread t's inputs 32 t + 4 s .. 32 t + 4 s + 3 stand
// for the mma's k = 2 t, 2 t + 1, 2 t + 8, 2 t + 9 (in A: its weight codes; in B: its A row's elements). Each code
// becomes the bf16 of its value times the group's power-of-two scale (exact: an e2m1 value has two significant
// bits), so the tensor cores see the dequantized weights exactly as transformers' MXFP4 dequantization makes them.
constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;

// a * b on two bf16 lanes (fma with -0: exact where the product is).
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
// 2^(c - 127) as bf16 in both lanes (c = 0: the subnormal 2^-127; 255: NaN), as ue8m0_f32.
__device__ __forceinline__ uint32_t ue8m0_bf16x2(uint32_t c) {
  const uint32_t h = c == 0 ? 0x0040u : (c == 255 ? 0x7fc0u : c << 7);
  return h | (h << 16);
}
__device__ __forceinline__ uint32_t u4_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
// fp4_convert.cuh's e2m1x4_to_16<true> (the same bits) with the four signs from one permute: in prmt's default mode
// the 4th bit of a selector nibble (the code's sign) replicates the picked byte's top bit, so with 0x80 bytes each
// output byte is 0xff for a negative code and 0x80 otherwise; its lowest bit, moved to the top, is the sign.
__device__ __forceinline__ void e2m1x4_to_bf16(uint32_t v, uint32_t& p01, uint32_t& p23) {
  const uint32_t sel = v & 0x7777u;
  uint32_t neg;
  asm("prmt.b32 %0, %1, %1, %2;\n" : "=r"(neg) : "r"(0x80808080u), "r"(v));
  const uint32_t hi = __byte_perm(0x3F3F3F00u, 0x40404040u, sel) | ((neg << 7) & 0x80808080u);
  const uint32_t lo = __byte_perm(0xC0800000u, 0xC0804000u, sel);
  p01 = __byte_perm(lo, hi, 0x5140);
  p23 = __byte_perm(lo, hi, 0x7362);
}

// RC: 8-row chunks of the tile per pass over the weights (each block of 128 inputs decoded once for all of them);
// U: blocks of 128 inputs whose weight pieces are loaded before the first is decoded; KS: K slices per warp's rows
// (the block's warps: kMmaWarps / KS groups of 16 weight rows times KS slices of the 128-input blocks, the slices'
// sums added in slice order through shared memory before the epilogue), for more warps where the tiles are few.
// PAIR: the pair form (fp4_mma_pair_gemv): block row p is pair p, one A row (p / a_row_div), its expert read from
// pa.index; the second projection's blocks sum the slots of their columns in the last one to arrive (pair_combine).
template <int EPI, int RC, int U, int KS, bool PAIR>
__global__ void __launch_bounds__(kMmaThreads, KS > 1 ? 4 : RC == 1 ? 3 : 1)
    fp4_mma_gemv_kernel(const Fp4GemmArgs args, int tile_m, const Fp8PairArgs pa) {
  static_assert(kMmaWarps % KS == 0, "slices of the block's warps");
  static_assert(!PAIR || RC == 1, "one row per pair");
  __shared__ float slice_sum[KS > 1 ? kMmaWarps : 1][RC][4][32];
  pdl_wait();  // the routing and the A rows come from the kernels before
  pdl_trigger();
  int expert;
  int64_t m0, m_end;
  if constexpr (PAIR) {
    m0 = blockIdx.y;
    expert = pair_expert_of(pa.index, pa.index_type, m0, pa.top_k, args.experts, pa.error);
    if (EPI != kEpiF32 && expert >= args.experts) return;  // a dropped pair's activations are never read
    m_end = expert < args.experts ? m0 + 1 : m0;          // the second projection's blocks arrive all the same
  } else if (!tile_rows(args, tile_m, expert, m0, m_end)) {
    return;
  }

  constexpr int kCols = EPI == kEpiGated ? 8 : 16;  // output columns per warp
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int slice = warp % KS;
  const int64_t c0 = (int64_t(blockIdx.x) * (kMmaWarps / KS) + warp / KS) * kCols;
  // With slices or arrivals every warp meets the barriers (columns past n are never stored).
  if (KS == 1 && !(PAIR && EPI == kEpiF32) && c0 >= args.n) return;
  int64_t wr[2];  // weight rows g and g + 8 of the warp's 16 (columns past n recompute the last, never stored)
  if constexpr (EPI == kEpiGated) {
    const int64_t c = min(c0 + g, args.n - 1);
    wr[0] = gate_row(args.gate, c);
    wr[1] = up_row(args.gate, c, args.inter);
  } else {
    wr[0] = min(c0 + g, args.n - 1);
    wr[1] = min(c0 + g + 8, args.n - 1);
  }
  const uint8_t* wrow[2];
  const uint8_t* wsc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    wrow[h] = args.b + int64_t(expert) * args.b_expert_stride + wr[h] * args.b_stride_n;
    wsc[h] = args.b_e8 + int64_t(expert) * args.bs_expert_stride + wr[h] * args.b_e8_ld;
  }
  const int64_t pieces = args.k / 32;       // 16-byte pieces (scale groups) per weight row
  const int64_t blocks = (pieces + 3) / 4;  // 128-input blocks
  const int64_t b_lo = blocks * slice / KS, b_hi = blocks * (slice + 1) / KS;  // this warp's slice of them
  const bf16* a_base = reinterpret_cast<const bf16*>(args.a);
  const bf16* bias =
      args.bias ? static_cast<const bf16*>(args.bias) + int64_t(expert) * args.bias_expert_stride : nullptr;

  for (int64_t m = m0; m < m_end; m += 8 * RC) {
    const int nr = int(min(int64_t(8 * RC), m_end - m));
    const int chunks = (nr + 7) / 8;
    const bf16* arow[RC];  // this thread's B column in chunk rc: A row m + 8 rc + g (null past the rows)
#pragma unroll
    for (int rc = 0; rc < RC; ++rc) {
      const int64_t row = m + 8 * rc + g;
      arow[rc] = nullptr;
      if (8 * rc + g < nr) {
        const int64_t src = PAIR         ? row / args.a_row_div
                            : args.a_rows ? int64_t(__ldg(args.a_rows + row) / args.a_row_div)
                                          : row;
        arow[rc] = a_base + src * args.lda;
      }
    }
    float acc[RC][4];
#pragma unroll
    for (int rc = 0; rc < RC; ++rc) acc[rc][0] = acc[rc][1] = acc[rc][2] = acc[rc][3] = 0.0f;
    for (int64_t b0 = b_lo; b0 < b_hi; b0 += U) {
      uint4 w[U][2];
      uint32_t sc[U][2];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // every weight load of the U blocks first
        const int64_t q = (b0 + u) * 4 + t;  // this thread's piece
        const bool in = b0 + u < b_hi && q < pieces;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          w[u][h] = in ? load_stream(wrow[h] + q * 16) : make_uint4(0, 0, 0, 0);
          sc[u][h] = in ? uint32_t(__ldg(wsc[h] + q)) : 0u;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t q = (b0 + u) * 4 + t;
        if (b0 + u >= b_hi) break;  // the whole warp is past its slice
        const bool in = q < pieces;
        const uint32_t s0 = ue8m0_bf16x2(sc[u][0]), s1 = ue8m0_bf16x2(sc[u][1]);
        // Step st's A fragment: the four codes st of rows g and g + 8, scaled.
        auto fragment = [&](int st, uint32_t (&a)[4]) {
          uint32_t p01, p23;
          e2m1x4_to_bf16(u4_word(w[u][0], st / 2) >> (16 * (st % 2)), p01, p23);
          a[0] = bf16x2_mul(p01, s0);  // row g, k 2t, 2t + 1
          a[2] = bf16x2_mul(p23, s0);  // row g, k 2t + 8, 2t + 9
          e2m1x4_to_bf16(u4_word(w[u][1], st / 2) >> (16 * (st % 2)), p01, p23);
          a[1] = bf16x2_mul(p01, s1);  // row g + 8
          a[3] = bf16x2_mul(p23, s1);
        };
        auto b_row = [&](int rc, uint4 (&av)[4]) {
          if (in && arow[rc]) {
            const uint4* p = reinterpret_cast<const uint4*>(arow[rc] + q * 32);
#pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = __ldg(p + i);
          }
        };
        if constexpr (RC == 1) {  // decode and multiply step by step
          uint4 av[4] = {};
          b_row(0, av);
#pragma unroll
          for (int st = 0; st < 8; ++st) {
            uint32_t a[4];
            fragment(st, a);
            mma_k16<true>(acc[0], a[0], a[1], a[2], a[3], u4_word(av[st / 2], 2 * (st % 2)),
                          u4_word(av[st / 2], 2 * (st % 2) + 1));
          }
        } else {  // the block decoded once, then each chunk's rows
          uint32_t a[8][4];
#pragma unroll
          for (int st = 0; st < 8; ++st) fragment(st, a[st]);
#pragma unroll
          for (int rc = 0; rc < RC; ++rc) {
            if (rc >= chunks) break;  // the same for the whole warp
            uint4 av[4] = {};
            b_row(rc, av);
#pragma unroll
            for (int st = 0; st < 8; ++st)
              mma_k16<true>(acc[rc], a[st][0], a[st][1], a[st][2], a[st][3], u4_word(av[st / 2], 2 * (st % 2)),
                            u4_word(av[st / 2], 2 * (st % 2) + 1));
          }
        }
      }
    }
    if constexpr (KS > 1) {  // the slices' sums, added in slice order by the first slice's warp
      if (slice > 0) {
#pragma unroll
        for (int rc = 0; rc < RC; ++rc)
#pragma unroll
          for (int i = 0; i < 4; ++i) slice_sum[warp][rc][i][lane] = acc[rc][i];
      }
      __syncthreads();
      if (slice == 0) {
#pragma unroll
        for (int o = 1; o < KS; ++o)
#pragma unroll
          for (int rc = 0; rc < RC; ++rc)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rc][i] += slice_sum[warp + o][rc][i][lane];
      }
      __syncthreads();  // slice_sum free for the next pass
      if (slice > 0 || c0 >= args.n) continue;
    }
    // acc[rc]: [0], [1] weight row g for A rows m + 8 rc + 2t, + 1; [2], [3] weight row g + 8 for the same.
#pragma unroll
    for (int rc = 0; rc < RC; ++rc)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (8 * rc + 2 * t + j >= nr) continue;
        const int64_t r = m + 8 * rc + 2 * t + j;
        if constexpr (EPI == kEpiGated) {
          const int64_t c = c0 + g;
          if (c >= args.n) continue;
          const float bg = bias ? to_f32(bias[gate_row(args.gate, c)]) : 0.0f;
          const float bu = bias ? to_f32(bias[up_row(args.gate, c, args.inter)]) : 0.0f;
          static_cast<bf16*>(args.out)[r * args.ldo + c] =
              from_f32<bf16>(fp8_gated<bf16>(args.gate, acc[rc][j], acc[rc][2 + j], bias != nullptr, bg, bu));
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t c = c0 + g + 8 * h;
            if (c >= args.n) continue;
            const float x = acc[rc][2 * h + j];
            if constexpr (EPI == kEpiActOnly)
              static_cast<bf16*>(args.out)[r * args.ldo + c] =
                  from_f32<bf16>(fp8_act_only<bf16>(args.gate, x, bias != nullptr, bias ? to_f32(bias[c]) : 0.0f));
            else
              static_cast<float*>(args.out)[r * args.ldo + c] = x;
          }
        }
      }
  }
  if constexpr (PAIR && EPI == kEpiF32) {
    constexpr int kBlockCols = kMmaWarps / KS * kCols;
    if (pair_arrive_last(pa.counters + (m0 / pa.top_k) * gridDim.x + blockIdx.x, uint32_t(pa.top_k)))
      pair_combine<bf16>(args, pa, m0 / pa.top_k, int64_t(blockIdx.x) * kBlockCols, kBlockCols, kMmaThreads);
  }
}

// Output columns of a block of the pair form: a divisor of 128 (16 gated, 32 otherwise).
template <int EPI>
constexpr int pair_block_cols() {
  return kWarps * (EPI == kEpiGated ? kWRows / 2 : kWRows);
}

// The pair form (fp8_pair_gemv, kernels.h): block (x, p) streams pair p's expert's weight rows of its columns
// against A row p / a_row_div (once: one row per pair), then arrives on its counter; the block that arrives last
// does the step after the projection for what the arrivals cover, reading the others' outputs from L2 after the
// fences of the usual last-block pattern, and sets the counter back to zero:
// - first projection (gated or activation epilogue): the blocks of each 128 outputs of a pair (a group) count on one
//   counter; the last quantizes the group (store_group16, as quantize_fp8_rows does) into row p of pa.q / pa.scale.
//   A dropped pair's blocks return at once (its row is never read).
// - second projection (f32 out): the K blocks of a token's columns (one per slot, dropped slots included) count on
//   one counter; the last sums w * (y + bias) over the slots in slot order and rounds once, as combine does.
template <class T, int EPI, int MINB>
__global__ void __launch_bounds__(kThreads, MINB) pair_gemv_kernel(const Fp4GemmArgs args, const Fp8PairArgs pa,
                                                                int prefetch) {
  const int64_t p = blockIdx.y;
  constexpr int kCols = EPI == kEpiGated ? kWRows / 2 : kWRows;
  constexpr int kBlockCols = pair_block_cols<EPI>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c0 = (int64_t(blockIdx.x) * kWarps + warp) * kCols;
  // Before the wait: the pair's expert id (top_k_index is written before the launch that precedes this one, which
  // lets this one start only after its own wait) and, with `prefetch`, an L2 prefetch of the first `prefetch` steps
  // of the warp's weight rows (constant).
  const int early = pair_expert_of(pa.index, pa.index_type, p, pa.top_k, args.experts, nullptr);
  const uint8_t* wrow[kWRows];
  const float* wsc[kWRows];
  const uint8_t* wse[kWRows];
  if (early < args.experts && c0 < args.n) {
    weight_rows<EPI, false>(args, early, c0, wrow, wsc, wse);
    for (int u = 0; u < prefetch; ++u) {
      const int64_t i = int64_t(lane) * kChunk + int64_t(u) * kStep;
      if (i >= args.b_k) break;
#pragma unroll
      for (int j = 0; j < kWRows; ++j) asm volatile("prefetch.global.L2 [%0];" ::"l"(wrow[j] + i));
    }
  }
  pdl_wait();  // launched with PDL: the quantized rows (and the first projection) come before
  pdl_trigger();
  const int expert =
      early < args.experts ? early : pair_expert_of(pa.index, pa.index_type, p, pa.top_k, args.experts, pa.error);
  if (EPI != kEpiF32 && expert >= args.experts) return;
  if (expert < args.experts && c0 < args.n) {
    const int64_t src = p / pa.a_row_div;
    const uint8_t* arow[1] = {args.a + src * args.lda};
    const float* asc[1] = {args.a_scale + src * args.lds};
    float acc[kWRows][1];
#pragma unroll
    for (int j = 0; j < kWRows; ++j) acc[j][0] = 0.0f;
    gemv_pass<T, 1, 2, false, false>(args, wrow, wsc, wse, arow, asc, 1, lane, acc);
    warp_sums(acc);
    store_columns<T, EPI, 1>(args, acc, expert, c0, p, 1, lane);
  }
  uint32_t* counter;
  uint32_t expected;
  if constexpr (EPI != kEpiF32) {
    constexpr int kPer = 128 / kBlockCols;  // blocks per group
    const int64_t g = blockIdx.x / kPer, groups = (args.n + 127) / 128;
    counter = pa.counters + p * groups + g;
    expected = uint32_t(min(int64_t(kPer), int64_t(gridDim.x) - g * kPer));
  } else {
    counter = pa.counters + (p / pa.top_k) * gridDim.x + blockIdx.x;
    expected = uint32_t(pa.top_k);
  }
  if (!pair_arrive_last(counter, expected)) return;
  if constexpr (EPI != kEpiF32) {
    if (warp != 0) return;
    const int64_t g = blockIdx.x / (128 / kBlockCols);
    const int l = lane % 16;
    const bool active = lane < 16;
    const int64_t k0 = g * 128 + l * 8;
    const T* row = static_cast<const T*>(args.out) + p * args.ldo;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = active && k0 + i < args.n ? load_cg(row + k0 + i) : 0.0f;
    store_group16(v, active, k0, args.n, pa.pow2 ? 1 : 0, l, pa.q, pa.ldq, pa.scale, pa.lds, p, g);
  } else {
    pair_combine<T>(args, pa, p / pa.top_k, int64_t(blockIdx.x) * kBlockCols, kBlockCols, kThreads);
  }
}

// The pair form's L2 prefetch before its PDL wait: this many 512-byte steps of each weight row a warp streams
// (MOEKIT_FP8_PAIR_PREFETCH in the environment, read once; 0: none). Launch argument of the pair kernel.
int pair_prefetch_steps() {
  static const int steps = int(env_int_in("MOEKIT_FP8_PAIR_PREFETCH", 0, 1 << 20, 2));
  return pdl_enabled() ? steps : 0;
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

// Blocks per multiprocessor the pair kernel is compiled for: 3 (80 registers, no spills; 2: 96-102 registers;
// 4: 64 registers with 60-byte spills). By default 4 where a token has 8 or more slots (deepseek-v3, qwen3-30b-a3b,
// olmoe-1b-7b at T = 1: 4-12% faster than 3 on the H200) and 3 below (qwen1.5-moe-a2.7b's 4 slots and
// mixtral-8x7b's 2 ran 10-11% slower at 4). MOEKIT_FP8_PAIR_BLOCKS in the environment (2, 3 or 4; read once) fixes it.
int pair_min_blocks(int top_k) {
  static const int forced = int(env_int_in("MOEKIT_FP8_PAIR_BLOCKS", 2, 4, 0));
  return forced != 0 ? forced : top_k >= 8 ? 4 : 3;
}

template <class T, int EPI>
cudaError_t launch_pair(const Fp4GemmArgs& a, const Fp8PairArgs& pa, cudaStream_t stream) {
  constexpr int kBlockCols = pair_block_cols<EPI>();
  const dim3 grid{unsigned((a.n + kBlockCols - 1) / kBlockCols), unsigned(a.max_rows)};
  switch (pair_min_blocks(pa.top_k)) {
    case 2:
      return launch_pdl(pdl_enabled(), pair_gemv_kernel<T, EPI, 2>, grid, dim3(kThreads), 0, stream, a, pa,
                        pair_prefetch_steps());
    case 4:
      return launch_pdl(pdl_enabled(), pair_gemv_kernel<T, EPI, 4>, grid, dim3(kThreads), 0, stream, a, pa,
                        pair_prefetch_steps());
    default:
      return launch_pdl(pdl_enabled(), pair_gemv_kernel<T, EPI, 3>, grid, dim3(kThreads), 0, stream, a, pa,
                        pair_prefetch_steps());
  }
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

int64_t fp8_pair_counters(const Fp8GemmArgs& a, int top_k) {
  if (top_k < 1) return 0;
  if (a.epilogue == kEpiF32) {
    constexpr int kBlockCols = pair_block_cols<kEpiF32>();
    return a.max_rows / top_k * ((a.n + kBlockCols - 1) / kBlockCols);
  }
  return a.max_rows * ((a.n + 127) / 128);
}

cudaError_t fp8_pair_gemv(const Fp8GemmArgs& a, const Fp8PairArgs& pa, cudaStream_t stream) {
  if (!fp8_gemv_ok(a) || pa.top_k < 1 || a.max_rows % pa.top_k != 0 || a.max_rows > 65535 || pa.a_row_div < 1 ||
      pa.index == nullptr || pa.counters == nullptr || a.a_scale == nullptr)
    return cudaErrorInvalidValue;
  const int64_t groups = (a.n + 127) / 128;
  if (a.epilogue == kEpiF32 ? pa.out == nullptr || pa.routing_weights == nullptr
                            : pa.q == nullptr || pa.scale == nullptr || pa.ldq < groups * 128 || pa.ldq % 16 != 0 ||
                                  pa.lds < groups)
    return cudaErrorInvalidValue;
  if (a.max_rows == 0 || a.n == 0) return cudaSuccess;
  Fp4GemmArgs g;
  static_cast<Fp8GemmArgs&>(g) = a;
  return with_elem(a.type, [&](auto tag) {
    using T = decltype(tag);
    switch (a.epilogue) {
      case kEpiGated: return launch_pair<T, kEpiGated>(g, pa, stream);
      case kEpiActOnly: return launch_pair<T, kEpiActOnly>(g, pa, stream);
      default: return launch_pair<T, kEpiF32>(g, pa, stream);
    }
  });
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

namespace {
std::atomic<int>& fp4_mma_ksplit_value() {
  static std::atomic<int> v{int(env_int_in("MOEKIT_FP4_MMA_KSPLIT", 0, 4, 0))};
  return v;
}
}  // namespace
int fp4_mma_ksplit() { return fp4_mma_ksplit_value().load(std::memory_order_relaxed); }
int set_fp4_mma_ksplit(int slices) {
  return fp4_mma_ksplit_value().exchange(slices == 1 || slices == 2 || slices == 4 ? slices : 0);
}

bool fp4_mma_gemv_ok(const Fp4GemmArgs& a, int arch) {
  return arch >= 80 && a.a_float && a.type == Elem::bf16 && a.k % 32 == 0 && a.b_k * 2 == a.k && a.lda >= a.k &&
         (a.lda * 2) % 16 == 0 && a.b_stride_n % 16 == 0 && a.b_expert_stride % 16 == 0 && a.b_e8 != nullptr &&
         a.b_e8_ld >= a.k / 32 && aligned16(a.a) && aligned16(a.b) &&
         (a.epilogue == kEpiGated || a.epilogue == kEpiActOnly || a.epilogue == kEpiF32);
}

namespace {
// Both forms of the tensor-core GEMV: over sorted row tiles (pa null), or over pairs (blockIdx.y a pair).
cudaError_t launch_fp4_mma(const Fp4GemmArgs& a, const Fp8PairArgs* pa, int tile_m, cudaStream_t stream) {
  if (a.max_rows == 0 || a.n == 0 || a.experts == 0) return cudaSuccess;
  const bool pair = pa != nullptr;
  const int cols = a.epilogue == kEpiGated ? 8 : 16;
  const int64_t tiles = pair ? a.max_rows : grouped_max_tiles(a.max_rows, a.experts, tile_m);
  const int64_t col_blocks = (a.n + kMmaWarps * cols - 1) / (kMmaWarps * cols);
  if (tiles > 65535 || col_blocks * 4 > 0x7fffffff) return cudaErrorInvalidValue;
  const bool pdl = pdl_enabled();
  // Four 8-row chunks per pass (each weight decoded once for 32 rows), 4 blocks of 128 inputs in flight; or one
  // chunk, 8 blocks in flight (152-161 registers, three blocks per multiprocessor), MOEKIT_FP4_MMA_CHUNKS=1. On an
  // H100, gpt-oss-20b MXFP4: four chunks 167 / 261 / 304 us at T = 8 / 32 / 64 against one chunk's 172-182 / 282 /
  // 383 (docs/perf.md, 2026-12-07). The pair form: one chunk (one row per pair), 4 blocks in flight.
  static const int chunks = int(env_int_in("MOEKIT_FP4_MMA_CHUNKS", 1, 4, 4));
  const bool many = chunks != 1;
  // K slices (fp4_mma_ksplit; 0 by default: by the call). Each warp's chain of dependent 128-input steps is what
  // bounds these calls (a few MB per launch), so slices pay even where the warps are many: on the H200, gpt-oss-20b
  // MXFP4 two slices against one 49.9 / 74.5 / 108 / 163 / 207 / 245 / 288 us against 53.5 / 76.5 / 116 / 175 / 227
  // / 268 / 316 at T = 1 / 2 / 4 / 8 / 16 / 32 / 64, four slices 51-326 (the four-chunk form's 128 registers spill
  // there); the pair form at T = 1 / 2 41.3 / 62.7 on two slices against 47.5 / 68.4 on one. By the call: 2 (the
  // one-chunk form 1). Forced: 1, 2 or 4 (the one-chunk form keeps 1).
  const int ks_forced = fp4_mma_ksplit();
  const int ks = ks_forced == 1 || ks_forced == 2 || ks_forced == 4 ? ks_forced : pair || many ? 2 : 1;
  const Fp8PairArgs none;
  auto go = [&](auto kernel, int slices) {
    const dim3 g{unsigned(col_blocks * slices), unsigned(tiles)};
    return launch_pdl(pdl, kernel, g, dim3(kMmaThreads), 0, stream, a, tile_m, pair ? *pa : none);
  };
  auto forms = [&](auto epi) -> cudaError_t {
    constexpr int E = decltype(epi)::value;
    if (pair) {
      switch (ks) {
        case 2: return go(fp4_mma_gemv_kernel<E, 1, 4, 2, true>, 2);
        case 4: return go(fp4_mma_gemv_kernel<E, 1, 4, 4, true>, 4);
        default: return go(fp4_mma_gemv_kernel<E, 1, 8, 1, true>, 1);
      }
    }
    if (!many) return go(fp4_mma_gemv_kernel<E, 1, 8, 1, false>, 1);
    switch (ks) {
      case 2: return go(fp4_mma_gemv_kernel<E, 4, 4, 2, false>, 2);
      case 4: return go(fp4_mma_gemv_kernel<E, 4, 4, 4, false>, 4);
      default: return go(fp4_mma_gemv_kernel<E, 4, 4, 1, false>, 1);
    }
  };
  switch (a.epilogue) {
    case kEpiGated: return forms(std::integral_constant<int, kEpiGated>{});
    case kEpiActOnly: return forms(std::integral_constant<int, kEpiActOnly>{});
    default: return forms(std::integral_constant<int, kEpiF32>{});
  }
}
}  // namespace

cudaError_t fp4_mma_gemv(const Fp4GemmArgs& a, int tile_m, int arch, cudaStream_t stream) {
  if (!fp4_mma_gemv_ok(a, arch) || tile_m < 1) return cudaErrorInvalidValue;
  return launch_fp4_mma(a, nullptr, tile_m, stream);
}

int64_t fp4_mma_pair_counters(const Fp4GemmArgs& a, int top_k) {
  if (top_k < 1 || a.epilogue != kEpiF32) return 0;
  // One word per token and block of columns; the most blocks: four slices of each 64 columns.
  return a.max_rows / top_k * ((a.n + kMmaWarps * 16 - 1) / (kMmaWarps * 16) * 4);
}

cudaError_t fp4_mma_pair_gemv(const Fp4GemmArgs& a, const Fp8PairArgs& pa, int arch, cudaStream_t stream) {
  if (!fp4_mma_gemv_ok(a, arch) || a.a_rows != nullptr || a.a_row_div < 1 || pa.top_k < 1 ||
      a.max_rows % pa.top_k != 0 || a.max_rows > 65535 || pa.index == nullptr)
    return cudaErrorInvalidValue;
  if (a.epilogue == kEpiF32 && (pa.counters == nullptr || pa.out == nullptr || pa.routing_weights == nullptr))
    return cudaErrorInvalidValue;
  return launch_fp4_mma(a, &pa, 1, stream);
}

}  // namespace moekit::cuda::kernels

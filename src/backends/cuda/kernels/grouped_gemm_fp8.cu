// FP8 block-scaled experts on the GPU (SPEC section 5): the dynamic activation quantisation (per row and 128
// inputs, bit for bit the host's quantize_activations_fp8) and the grouped projection over e4m3 rows and e4m3
// weights with 128 x 128 block scales, on the FP8 tensor cores (mma.sync m16n8k32 e4m3, sm_89 and later).
//
// The projection walks K one scale block (128 inputs) at a time: the tensor cores sum the block's products into
// f32 partials, which are then promoted into the f32 accumulators as acc += partial * a_scale[row] * w_scale[col]
// (the block's dot product is formed once, scaled once, as the f64 reference forms it). Tiles: BM rows x 128
// virtual columns (gated projections interleave gate and up rows, as the bf16 kernels do) x 128 inputs, three
// cp.async stages, rows of 144 bytes in shared memory so the fragment loads are free of bank conflicts.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "backends/cuda/kernels/cutlass_gemm.h"
#include "backends/cuda/kernels/fp8_epilogue.cuh"
#include "backends/cuda/kernels/fp8_quant.cuh"
#include "backends/cuda/kernels/fp8_rows.h"
#include "backends/cuda/kernels/grouped_gemm_common.cuh"
#include "base/cuda_pdl.cuh"
#include "base/env.h"

namespace moekit::cuda::kernels {

namespace {

// ---- activation quantisation: one warp per (row, group of 128 inputs), four inputs per lane ----

template <class T>
__global__ void quantize_fp8_rows_kernel(const T* __restrict__ x, int64_t ldx, const int32_t* __restrict__ src_rows,
                                         int src_div, int64_t rows, int64_t k,
                                         const int32_t* __restrict__ valid_rows, int pow2, uint8_t* __restrict__ q,
                                         int64_t ldq, float* __restrict__ scale, int64_t lds) {
  pdl_wait();
  pdl_trigger();
  const int64_t groups = (k + 127) / 128;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = warp / groups, g = warp % groups;
  if (row >= rows) return;
  if (valid_rows && row >= __ldg(valid_rows)) return;
  const int64_t k0 = g * 128 + lane * 4;
  const T* xr = x + (src_rows ? int64_t(__ldg(src_rows + row) / src_div) : row) * ldx;
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = k0 + i < k ? to_f32(xr[k0 + i]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  float s = __fdiv_rn(amax, 448.0f);
  if (pow2 && s > 0.0f) s = pow2_ceil(s);
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint8_t c = s > 0.0f && k0 + i < k ? to_e4m3(__fdiv_rn(v[i], s)) : uint8_t(0);
    word |= uint32_t(c) << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(q + row * ldq + k0) = word;  // k0 < ldq: rows padded to whole groups
  if (lane == 0) scale[row * lds + g] = s;
}

// The same quantisation with 16 lanes per (row, group of 128 inputs), eight inputs per lane (16-byte loads where
// the row allows them) and the hardware's e4m3 conversion (fp8_quant.cuh). The division by the scale
// stays correctly rounded, so the codes are the host's bit for bit. Two (row, group) items per warp: no lane
// leaves before the shuffles.
// The 16-lane kernels' item: 16 lanes per (group of 128 inputs, R consecutive rows from `row`), eight inputs per
// lane; a row is live below `rows` and *valid_rows (when set).
template <int R = 1>
struct QuantItem {
  int64_t row, g, k0, live;
  int l;
  __device__ QuantItem(int64_t rows, int64_t k, const int32_t* valid_rows) {
    const int64_t groups = (k + 127) / 128;
    const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 16;
    l = threadIdx.x % 16;
    row = item / groups * R, g = item % groups;
    live = valid_rows ? min(rows, int64_t(__ldg(valid_rows))) : rows;
    k0 = g * 128 + l * 8;
  }
  __device__ bool active(int r = 0) const { return row + r < live; }
};

template <class T>
__global__ void quantize_fp8_rows_wide_kernel(const T* __restrict__ x, int64_t ldx, const int32_t* __restrict__ src_rows,
                                              int src_div, int64_t rows, int64_t k,
                                              const int32_t* __restrict__ valid_rows, int pow2, bool vec,
                                              uint8_t* __restrict__ q, int64_t ldq, float* __restrict__ scale,
                                              int64_t lds) {
  pdl_wait();
  pdl_trigger();
  const QuantItem<> it(rows, k, valid_rows);
  float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (it.active())
    load8(x + (src_rows ? int64_t(__ldg(src_rows + it.row) / src_div) : it.row) * ldx + it.k0, vec, k - it.k0, v);
  store_group16(v, it.active(), it.k0, k, pow2, it.l, q, ldq, scale, lds, it.row, it.g);
}

// a and b rounded to T (16-bit: one packed conversion for both); f32: unchanged.
template <class T>
__device__ __forceinline__ void round2(float& a, float& b) {
  if constexpr (std::is_same_v<T, bf16>) {
    const float2 f = __bfloat1622float2(__floats2bfloat162_rn(a, b));
    a = f.x, b = f.y;
  } else if constexpr (std::is_same_v<T, f16>) {
    const float2 f = __half22float2(__floats2half2_rn(a, b));
    a = f.x, b = f.y;
  }
}

// Eight gated values of inputs whose gate g and up u are T values already (the gate pass reads them rounded, so
// fp8_gated's first rounding is the identity): for SiLU its remaining steps with the roundings to T done in pairs
// (one packed conversion for two values), else fp8_gated itself; the result rounded to T as the epilogues store it.
template <class T, int CODE>
__device__ __forceinline__ void gate8(const GateParams& gate, const float (&g)[8], const float (&u)[8],
                                      float (&v)[8]) {
  if constexpr (CODE == kActSilu) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      float s0 = silu_fast(g[i]), s1 = silu_fast(g[i + 1]);
      round2<T>(s0, s1);
      v[i] = s0 * u[i];
      v[i + 1] = s1 * u[i + 1];
      round2<T>(v[i], v[i + 1]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_f32(from_f32<T>(fp8_gated<T, CODE>(gate, g[i], u[i], false, 0.0f, 0.0f)));
  }
}

// One row's lane of a gate pass item: the eight gated values (gate8; zero past the row's `inter` inputs and for an
// inactive row) quantised with the item's other lanes (store_group16, which every lane joins).
template <class T, int CODE>
__device__ __forceinline__ void gate_store_group(const GateParams& gate, const float (&gv)[8], const float (&uv)[8],
                                                 bool active, int64_t k0, int64_t inter, int pow2, int l, uint8_t* q,
                                                 int64_t ldq, float* scale, int64_t lds, int64_t row, int64_t g) {
  float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (active) {
    gate8<T, CODE>(gate, gv, uv, v);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (k0 + i >= inter) v[i] = 0.0f;
  }
  store_group16(v, active, k0, inter, pow2, l, q, ldq, scale, lds, row, g);
}

// The gate of a gated projection from its 16-bit output [rows, 2 inter] ([gate | up], the projection rounded to T as
// the gated epilogues round it), computed as they do (fp8_gated with the gate code CODE as a constant, or
// kActRuntime: each step torch runs in T rounded to it), then quantised as the wide kernel above does. Each 16-lane
// item covers the same group of R consecutive rows, all R rows' 16-byte pieces loaded before the first is gated
// (R > 1 needs `vec`): R times the bytes in flight per lane, where one row's two loads in front of the long
// gate-and-quantise chain left the pass at half the DRAM bandwidth on large calls.
template <class T, int CODE, int R>
__global__ void gate_quantize_fp8_rows_kernel(const T* __restrict__ h1, int64_t rows, int64_t inter,
                                              const GateParams gate, const int32_t* __restrict__ valid_rows, int pow2,
                                              bool vec, uint8_t* __restrict__ q, int64_t ldq,
                                              float* __restrict__ scale, int64_t lds) {
  pdl_wait();
  pdl_trigger();
  const QuantItem<R> it(rows, inter, valid_rows);
  const int64_t row0 = it.row, g = it.g, k0 = it.k0;
  const int l = it.l;
  if constexpr (R == 1) {
    float gv[8], uv[8];
    if (it.active()) {
      const T* gr = h1 + row0 * 2 * inter + k0;
      load8(gr, vec, inter - k0, gv);
      load8(gr + inter, vec, inter - k0, uv);
    }
    gate_store_group<T, CODE>(gate, gv, uv, it.active(), k0, inter, pow2, l, q, ldq, scale, lds, row0, g);
  } else {
    // inter % 8 == 0 (vec): a lane's piece is whole or wholly past the row (k0 >= inter only in the last group).
    uint4 raw[R][2];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      raw[r][0] = raw[r][1] = make_uint4(0, 0, 0, 0);
      if (it.active(r) && k0 < inter) {
        const uint4* gr = reinterpret_cast<const uint4*>(h1 + (row0 + r) * 2 * inter + k0);
        raw[r][0] = __ldcs(gr);
        raw[r][1] = __ldcs(gr + inter / 8);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const T* gh = reinterpret_cast<const T*>(&raw[r][0]);
      const T* uh = reinterpret_cast<const T*>(&raw[r][1]);
      float gv[8], uv[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) gv[i] = to_f32(gh[i]), uv[i] = to_f32(uh[i]);
      gate_store_group<T, CODE>(gate, gv, uv, it.active(r), k0, inter, pow2, l, q, ldq, scale, lds, row0 + r, g);
    }
  }
}

// One warp per sorted row: the token row's codes in 16-byte pieces and its scales (fp8_rows.h).
__global__ void gather_fp8_rows_kernel(const uint8_t* __restrict__ q_tok, const float* __restrict__ scale_tok,
                                       int64_t ldq, int64_t lds, const int32_t* __restrict__ sorted_pair, int top_k,
                                       const int32_t* __restrict__ valid_rows, int64_t rows, uint8_t* __restrict__ q,
                                       float* __restrict__ scale) {
  pdl_wait();
  pdl_trigger();
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows || r >= __ldg(valid_rows)) return;
  const int64_t t = __ldg(sorted_pair + r) / top_k;
  const uint4* src = reinterpret_cast<const uint4*>(q_tok + t * ldq);
  uint4* dst = reinterpret_cast<uint4*>(q + r * ldq);
  for (int64_t i = lane; i < ldq / 16; i += 32) dst[i] = __ldg(src + i);
  for (int64_t i = lane; i < lds; i += 32) scale[r * lds + i] = __ldg(scale_tok + t * lds + i);
}

// ---- weight quantisation in 128 x 128 blocks (moekit/quant.h quantize_fp8 with f32 scales), one block each ----

template <class T>
__global__ void quantize_fp8_blocks_kernel(const T* __restrict__ w, int64_t n, int64_t k, int64_t segments,
                                           uint8_t* __restrict__ q, float* __restrict__ scale_inv) {
  const int64_t seg = n / segments, seg_blocks = (seg + 127) / 128, sn = segments * seg_blocks, sk = (k + 127) / 128;
  const int64_t blk = blockIdx.x, b = blk / (sn * sk), rem = blk % (sn * sk), srow = rem / sk, bk = rem % sk;
  const int64_t sg = srow / seg_blocks, bn = srow % seg_blocks;
  const int64_t n0 = sg * seg + bn * 128, n1 = min(sg * seg + seg, n0 + 128), k0 = bk * 128, k1 = min(k, k0 + 128);
  const int64_t cols = k1 - k0, count = (n1 - n0) * cols;
  const T* base = w + b * n * k;
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x)
    amax = fmaxf(amax, fabsf(to_f32(base[(n0 + i / cols) * k + k0 + i % cols])));
  __shared__ float red[32];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < int(blockDim.x / 32); ++i) amax = fmaxf(amax, red[i]);
  const float fwd = amax > 0.0f ? __fdiv_rn(448.0f, amax) : 1.0f;
  if (threadIdx.x == 0) scale_inv[blk] = __fdiv_rn(1.0f, fwd);
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t off = b * n * k + (n0 + i / cols) * k + k0 + i % cols;
    q[off] = to_e4m3(to_f32(w[off]) * fwd);
  }
}

// ---- the grouped FP8 projection ----

constexpr int kThreads = 256;  // 8 warps: 2 along the rows, 4 along the columns
constexpr int kBN = 128, kBK = 128, kLds = 144, kStages = 3;

__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

template <int BM, int EPI>
__global__ void __launch_bounds__(kThreads) grouped_gemm_fp8_kernel(const Fp8GemmArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr int WM = BM / 2, MI = WM / 16, NI = 4;
  constexpr int kRowsPerPass = kThreads / 8;  // eight 16-byte chunks per 128-byte row
  constexpr int kAIters = BM / kRowsPerPass, kBIters = kBN / kRowsPerPass;
  static_assert(MI >= 1 && kAIters >= 1, "tile shape");
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* const As = smem;
  uint8_t* const Bs = smem + kStages * BM * kLds;

  const int tile = blockIdx.y, bn = blockIdx.x;
  if (tile >= __ldg(args.tile_offsets + args.experts)) return;
  const int expert = tile_expert(args.tile_offsets, args.experts, tile);
  const int64_t m0 = __ldg(args.offsets + expert) + int64_t(tile - __ldg(args.tile_offsets + expert)) * BM;
  const int64_t m_end = __ldg(args.offsets + expert + 1);
  const int64_t KB = (args.k + kBK - 1) / kBK;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / 4, wn = warp % 4, g = lane / 4, t4 = lane % 4;

  // Loader: thread copies chunk `chunk` of rows row_base + j * 32.
  const int chunk = tid % 8, row_base = tid / 8;
  const uint8_t* a_src[kAIters];
  bool a_ok[kAIters];
#pragma unroll
  for (int j = 0; j < kAIters; ++j) {
    const int64_t row = m0 + row_base + j * kRowsPerPass;
    a_ok[j] = row < m_end;
    const int64_t src = !a_ok[j] ? 0 : (args.a_rows ? int64_t(__ldg(args.a_rows + row) / args.a_row_div) : row);
    a_src[j] = args.a + src * args.lda + chunk * 16;
  }
  const uint8_t* const b_base = args.b + int64_t(expert) * args.b_expert_stride;
  const uint8_t* b_src[kBIters];
  bool b_ok[kBIters];
#pragma unroll
  for (int j = 0; j < kBIters; ++j) {
    const int64_t wr = tile_weight_row<kBN, EPI>(args, bn, row_base + j * kRowsPerPass);
    b_ok[j] = wr >= 0;
    b_src[j] = b_base + (b_ok[j] ? wr * args.b_stride_n : 0) + chunk * 16;
  }
  auto load = [&](int kb) {
    const int s = kb % kStages;
    uint8_t* as = As + s * BM * kLds;
    uint8_t* bs = Bs + s * kBN * kLds;
    const int64_t koff = int64_t(kb) * kBK;
#pragma unroll
    for (int j = 0; j < kAIters; ++j)
      cp_async16(smem_u32(as + (row_base + j * kRowsPerPass) * kLds + chunk * 16), a_ok[j] ? a_src[j] + koff : args.a,
                 a_ok[j]);
    const bool k_ok = koff + chunk * 16 < args.b_k;
#pragma unroll
    for (int j = 0; j < kBIters; ++j) {
      const bool ok = b_ok[j] && k_ok;
      cp_async16(smem_u32(bs + (row_base + j * kRowsPerPass) * kLds + chunk * 16), ok ? b_src[j] + koff : args.b, ok);
    }
  };

  // Scale rows of this thread's rows (the activation row each reads) and columns (the weight block row).
  int sa_row[MI][2];  // element offsets: rows x groups and scale rows stay far below 2^31
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = m0 + wm * WM + mi * 16 + g + 8 * h;
      const int64_t r = row < m_end ? row : m0;
      sa_row[mi][h] = int((args.a_rows ? int64_t(__ldg(args.a_rows + r) / args.a_row_div) : r) * args.lds);
    }
  const float* const ws_base = args.b_scale + int64_t(expert) * args.bs_expert_stride;
  int sw_row[NI][2];
  const int64_t seg = args.b_scale_seg, seg_blocks = (seg + 127) / 128;
#pragma unroll
  for (int ni = 0; ni < NI; ++ni)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      int64_t wr = tile_weight_row<kBN, EPI>(args, bn, wn * 32 + ni * 8 + t4 * 2 + j);
      if (wr < 0) wr = 0;
      sw_row[ni][j] = int(((wr / seg) * seg_blocks + (wr % seg) / 128) * KB);
    }

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KB) load(s);
    cp_async_commit();
  }
  for (int64_t kb = 0; kb < KB; ++kb) {
    // This block's scales first: their loads overlap the tile's wait and products.
    float sa[MI][2], sw[NI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) sa[mi][h] = __ldg(args.a_scale + sa_row[mi][h] + kb);
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int j = 0; j < 2; ++j) sw[ni][j] = __ldg(ws_base + sw_row[ni][j] + kb);

    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (kb + kStages - 1 < KB) load(int(kb + kStages - 1));
    cp_async_commit();

    const uint8_t* as = As + (kb % kStages) * BM * kLds;
    const uint8_t* bs = Bs + (kb % kStages) * kBN * kLds;
    float part[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int c = 0; c < 4; ++c) part[mi][ni][c] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kBK / 32; ++kk) {
      uint32_t af[MI][4], bf[NI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const uint8_t* p = as + (wm * WM + mi * 16 + g) * kLds + kk * 32 + t4 * 4;
        af[mi][0] = *reinterpret_cast<const uint32_t*>(p);
        af[mi][1] = *reinterpret_cast<const uint32_t*>(p + 8 * kLds);
        af[mi][2] = *reinterpret_cast<const uint32_t*>(p + 16);
        af[mi][3] = *reinterpret_cast<const uint32_t*>(p + 8 * kLds + 16);
      }
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const uint8_t* p = bs + (wn * 32 + ni * 8 + g) * kLds + kk * 32 + t4 * 4;
        bf[ni][0] = *reinterpret_cast<const uint32_t*>(p);
        bf[ni][1] = *reinterpret_cast<const uint32_t*>(p + 16);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) mma_e4m3(part[mi][ni], af[mi], bf[ni]);
    }
    // Promotion: the block's partial sums, scaled once, into the f32 accumulators.
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mi][ni][c] += part[mi][ni][c] * (sa[mi][c / 2] * sw[ni][c % 2]);
  }
  cp_async_wait<0>();

  with_epilogue_forms<EPI>(args, [&](auto tag, auto code) {  // one switch outside the unrolled columns
    using T = decltype(tag);
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = m0 + wm * WM + mi * 16 + g + 8 * h;
        if (row >= m_end) continue;
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const int v = wn * 32 + ni * 8 + t4 * 2;
          store_fp8_pair<T, kBN, EPI, decltype(code)::value>(args, expert, bn, row, v, acc[mi][ni][2 * h],
                                                             acc[mi][ni][2 * h + 1]);
        }
      }
  });
#endif
}

template <int BM, int EPI>
cudaError_t launch_fp8(const Fp8GemmArgs& a, cudaStream_t stream) {
  const int64_t virt = a.epilogue == kEpiGated ? 2 * a.n : a.n;
  const int64_t tiles = grouped_max_tiles(a.max_rows, a.experts, BM);
  if (tiles == 0 || virt == 0) return cudaSuccess;
  if (tiles > 65535) return cudaErrorInvalidValue;
  const dim3 grid(unsigned((virt + kBN - 1) / kBN), unsigned(tiles));
  const int smem = kStages * (BM + kBN) * kLds;
  static const cudaError_t attr =
      cudaFuncSetAttribute(grouped_gemm_fp8_kernel<BM, EPI>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  grouped_gemm_fp8_kernel<BM, EPI><<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <int BM>
cudaError_t launch_fp8_epi(const Fp8GemmArgs& a, cudaStream_t stream) {
  switch (a.epilogue) {
    case kEpiGated: return launch_fp8<BM, kEpiGated>(a, stream);
    case kEpiActOnly: return launch_fp8<BM, kEpiActOnly>(a, stream);
    case kEpiF32: return launch_fp8<BM, kEpiF32>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t quantize_fp8_rows(Elem type, const void* x, int64_t ldx, const int32_t* src_rows, int src_div,
                              int64_t rows, int64_t k, const int32_t* valid_rows, bool pow2_scales, uint8_t* q,
                              int64_t ldq, float* scale, int64_t lds, cudaStream_t stream) {
  const int64_t groups = (k + 127) / 128;
  if (rows == 0 || k == 0) return cudaSuccess;
  if (ldq < groups * 128 || ldq % 4 || lds < groups || (src_rows && src_div < 1)) return cudaErrorInvalidValue;
  // MOEKIT_FP8_QUANT_NARROW=1: the one-warp-per-group kernel (for comparisons)
  static const bool wide = env_int("MOEKIT_FP8_QUANT_NARROW", 0) != 1;
  return with_elem(type, [&](auto tag) {
    using T = decltype(tag);
    if (wide) {
      const bool vec = (reinterpret_cast<uintptr_t>(x) % 16) == 0 && (ldx * int64_t(sizeof(T))) % 16 == 0;
      const unsigned blocks = unsigned((rows * groups * 16 + 255) / 256);
      return launch_pdl(pdl_enabled(), quantize_fp8_rows_wide_kernel<T>, dim3(blocks), dim3(256), 0, stream,
                        static_cast<const T*>(x), ldx, src_rows, src_div, rows, k, valid_rows, pow2_scales ? 1 : 0,
                        vec, q, ldq, scale, lds);
    }
    const unsigned blocks = unsigned((rows * groups * 32 + 255) / 256);
    return launch_pdl(pdl_enabled(), quantize_fp8_rows_kernel<T>, dim3(blocks), dim3(256), 0, stream,
                      static_cast<const T*>(x), ldx, src_rows, src_div, rows, k, valid_rows, pow2_scales ? 1 : 0, q,
                      ldq, scale, lds);
  });
}

// (rows x groups of 128) items from which gate_quantize_fp8_rows takes four rows per item.
constexpr int64_t kGateRowsItems = 16384;

cudaError_t gate_quantize_fp8_rows(Elem type, const void* h1, int64_t rows, int64_t inter, const GateParams& gate,
                                   const int32_t* valid_rows, bool pow2_scales, uint8_t* q, int64_t ldq, float* scale,
                                   int64_t lds, cudaStream_t stream) {
  const int64_t groups = (inter + 127) / 128;
  if (rows == 0 || inter == 0) return cudaSuccess;
  if (type == Elem::f32 || !gate.concatenated || gate.kind == kGateActOnly || ldq < groups * 128 || ldq % 4 ||
      lds < groups)
    return cudaErrorInvalidValue;
  return with_elem(type, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 4) {
      return cudaErrorInvalidValue;
    } else {
      const bool vec = (reinterpret_cast<uintptr_t>(h1) % 16) == 0 && inter % 8 == 0;
      // Four rows per item on large calls (kGateRowsItems items and more); one on small ones, whose few blocks
      // would otherwise run four gate chains each in a row.
      const int r = vec && rows * groups >= kGateRowsItems ? 4 : 1;
      const dim3 grid(unsigned(((rows + r - 1) / r * groups * 16 + 255) / 256));
      const bool silu = gate.kind == kGateActMul && gate.activation == kActSilu;  // the common gate as a constant
      const auto kernel = r == 4 ? (silu ? gate_quantize_fp8_rows_kernel<T, kActSilu, 4>
                                         : gate_quantize_fp8_rows_kernel<T, kActRuntime, 4>)
                                 : (silu ? gate_quantize_fp8_rows_kernel<T, kActSilu, 1>
                                         : gate_quantize_fp8_rows_kernel<T, kActRuntime, 1>);
      return launch_pdl(pdl_enabled(), kernel, grid, dim3(256), 0, stream, static_cast<const T*>(h1), rows, inter,
                        gate, valid_rows, pow2_scales ? 1 : 0, vec, q, ldq, scale, lds);
    }
  });
}

cudaError_t gather_fp8_rows(const uint8_t* q_tok, const float* scale_tok, int64_t ldq, int64_t lds,
                            const int32_t* sorted_pair, int top_k, const int32_t* valid_rows, int64_t rows, uint8_t* q,
                            float* scale, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (ldq % 16 || lds < 0 || top_k < 1 || reinterpret_cast<uintptr_t>(q_tok) % 16 ||
      reinterpret_cast<uintptr_t>(q) % 16 || rows > INT32_MAX)
    return cudaErrorInvalidValue;
  return launch_pdl(pdl_enabled(), gather_fp8_rows_kernel, dim3(unsigned((rows + 7) / 8)), dim3(256), 0, stream,
                    q_tok, scale_tok, ldq, lds, sorted_pair, top_k, valid_rows, rows, q, scale);
}

cudaError_t quantize_fp8_blocks(Elem type, const void* w, int64_t batch, int64_t n, int64_t k, int64_t segments,
                               uint8_t* q, float* scale_inv, cudaStream_t stream) {
  if (segments < 1 || n % segments) return cudaErrorInvalidValue;
  const int64_t blocks = batch * segments * ((n / segments + 127) / 128) * ((k + 127) / 128);
  if (blocks == 0) return cudaSuccess;
  return with_elem(type, [&](auto tag) {
    using T = decltype(tag);
    quantize_fp8_blocks_kernel<T><<<unsigned(blocks), 256, 0, stream>>>(static_cast<const T*>(w), n, k, segments, q,
                                                                       scale_inv);
    return cudaGetLastError();
  });
}

bool grouped_gemm_fp8_built_for(int arch) {
  if (arch < 89) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, grouped_gemm_fp8_kernel<32, kEpiF32>) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.binaryVersion >= 89;  // code compiled for sm_89 or later, not PTX of an older target
}

int fp8_tile_m(int64_t max_rows, int experts) { return max_rows >= int64_t(64) * experts ? 128 : 32; }

cudaError_t grouped_gemm_fp8(const Fp8GemmArgs& a, int tile_m, cudaStream_t stream) {
  if (a.b_k % 16 || a.lda % 16 || a.b_stride_n % 16 || a.b_expert_stride % 16 || a.b_scale_seg < 1) return cudaErrorInvalidValue;
  if (tile_m == 128) return launch_fp8_epi<128>(a, stream);
  if (tile_m == 32) return launch_fp8_epi<32>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace moekit::cuda::kernels

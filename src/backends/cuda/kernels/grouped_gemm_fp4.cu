// FP4 experts on the GPU (SPEC section 5): the grouped projection over sorted rows with e2m1 weights (one ue8m0
// scale per weight row and 32 inputs) dequantized in the kernel, on the tensor cores (quant_fp4.h).
//
// Tiles of BM rows x 128 virtual columns (gated projections interleave gate and up rows, as the FP8 and bf16
// kernels do) x 128 inputs, three cp.async stages of: the A rows, the packed weight rows (64 bytes), and the four
// scale codes of each weight row (one 4-byte word: the staged scales are padded to whole words). Per group of 32
// inputs each thread turns its weight word (eight codes) into tensor-core fragments with byte permutes:
//   quantized A (FP4 with UE8M0 scales, w4a8): e2m1 -> e4m3, mma.sync m16n8k32 e4m3 (sm_89 and later);
//   float A (MXFP4 as transformers runs it, bf16 / f16 activations): e2m1 -> bf16 / f16, two mma.sync m16n8k16.
// The 32 inputs a thread holds are 8 consecutive ones (inputs 8 t .. 8 t + 7 of the group for thread t of a quad),
// the same permutation of the reduction for A and B, so that each thread reads one word of weights and one 8- or
// 16-byte piece of each A row. Each group's sum over its 32 products (exact products: e2m1 x e4m3 or e2m1 x 16-bit
// values) comes out of the tensor cores in f32, then is scaled once, by the power-of-two weight scale (times the
// row's activation scale with quantized A), into the f32 accumulators. The epilogues are the FP8 kernel's
// (fp8_epilogue.cuh).
#include <cuda_runtime.h>

#include <cmath>

#include "backends/cuda/kernels/fp4_convert.cuh"
#include "backends/cuda/kernels/fp8_epilogue.cuh"
#include "backends/cuda/kernels/grouped_gemm_common.cuh"
#include "backends/cuda/kernels/quant_fp4.h"

namespace moekit::cuda::kernels {

namespace {

constexpr int kThreads = 256;  // 8 warps: 2 along the rows, 4 along the columns
constexpr int kBN = 128, kBK = 128, kStages = 3;
constexpr int kLdb = 80;  // bytes of a packed weight row in shared memory (64 + 16: conflict-free words)
// Bytes of an A row in shared memory: float A 256 + 64 (conflict-free 16-byte loads), e4m3 128 + 32 (8-byte loads).
template <bool AF>
constexpr int a_ld() { return AF ? 320 : 160; }
template <bool AF>
constexpr int smem_bytes(int bm) { return kStages * (bm * a_ld<AF>() + kBN * kLdb + kBN * 4); }

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  const int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_size));
}

__device__ __forceinline__ void mma_e4m3_k32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// AF: float A of T (bf16 or f16); else quantized e4m3 A (T unused: the output type is args.type).
template <class T, int BM, int EPI, bool AF>
__global__ void __launch_bounds__(kThreads) grouped_gemm_fp4_kernel(const Fp4GemmArgs args) {
// (Quantized A needs the e4m3 mma of sm_89; grouped_gemm_fp4_built_for refuses it below.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kLda = a_ld<AF>();
  constexpr int kARowBytes = AF ? kBK * 2 : kBK;  // A bytes per row and stage
  constexpr int kAChunks = kARowBytes / 16;
  constexpr int kAPer = BM * kAChunks / kThreads;   // A chunks per thread and stage
  constexpr int kBPer = kBN * (kBK / 2 / 16) / kThreads;  // weight chunks per thread and stage (2)
  constexpr int WM = BM / 2, MI = WM / 16, NI = 4;
  static_assert(MI >= 1 && kAPer >= 1 && kBPer >= 1, "tile shape");
  constexpr bool kBf16 = !std::is_same_v<T, f16>;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* const As = smem;
  uint8_t* const Bs = As + kStages * BM * kLda;
  uint32_t* const Ss = reinterpret_cast<uint32_t*>(Bs + kStages * kBN * kLdb);

  const int tile = blockIdx.y, bn = blockIdx.x;
  if (tile >= __ldg(args.tile_offsets + args.experts)) return;
  const int expert = tile_expert(args.tile_offsets, args.experts, tile);
  const int64_t m0 = __ldg(args.offsets + expert) + int64_t(tile - __ldg(args.tile_offsets + expert)) * BM;
  const int64_t m_end = __ldg(args.offsets + expert + 1);
  const int64_t KB = (args.k + kBK - 1) / kBK;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / 4, wn = warp % 4, g = lane / 4, t4 = lane % 4;

  // Loaders: A chunk (row, chunk) = index tid + j * kThreads; weight chunk likewise over 128 rows x 4 chunks;
  // scale word of weight row tid (tid < 128).
  const uint8_t* a_src[kAPer];
  bool a_ok[kAPer];
  int a_dst[kAPer], a_chunk[kAPer];
#pragma unroll
  for (int j = 0; j < kAPer; ++j) {
    const int idx = tid + j * kThreads, r = idx / kAChunks;
    a_chunk[j] = idx % kAChunks;
    const int64_t row = m0 + r;
    a_ok[j] = row < m_end;
    const int64_t src = !a_ok[j] ? 0 : (args.a_rows ? int64_t(__ldg(args.a_rows + row) / args.a_row_div) : row);
    a_src[j] = args.a + src * args.lda * (AF ? 2 : 1) + a_chunk[j] * 16;
    a_dst[j] = r * kLda + a_chunk[j] * 16;
  }
  const uint8_t* const b_base = args.b + int64_t(expert) * args.b_expert_stride;
  const uint8_t* b_src[kBPer];
  bool b_ok[kBPer];
  int b_dst[kBPer], b_chunk[kBPer];
#pragma unroll
  for (int j = 0; j < kBPer; ++j) {
    const int idx = tid + j * kThreads, v = idx / 4;
    b_chunk[j] = idx % 4;
    const int64_t wr = tile_weight_row<kBN, EPI>(args, bn, v);
    b_ok[j] = wr >= 0;
    b_src[j] = b_base + (b_ok[j] ? wr * args.b_stride_n : 0) + b_chunk[j] * 16;
    b_dst[j] = v * kLdb + b_chunk[j] * 16;
  }
  const uint8_t* s_src = nullptr;
  bool s_ok = false;
  if (tid < kBN) {
    const int64_t wr = tile_weight_row<kBN, EPI>(args, bn, tid);
    s_ok = wr >= 0;
    s_src = args.b_e8 + int64_t(expert) * args.bs_expert_stride + (s_ok ? wr * args.b_e8_ld : 0);
  }
  auto load = [&](int64_t kb) {
    const int s = int(kb % kStages);
    uint8_t* as = As + s * BM * kLda;
    uint8_t* bs = Bs + s * kBN * kLdb;
    const int64_t k0 = kb * kBK;  // first input of the step
#pragma unroll
    for (int j = 0; j < kAPer; ++j) {
      // float A: inputs past k are zero-filled (k % 32 == 0: a chunk of 8 lies wholly before or past k); quantized
      // A rows are padded with zero codes to whole steps.
      const bool ok = a_ok[j] && (!AF || k0 + a_chunk[j] * 8 < args.k);
      cp_async16(smem_u32(as + a_dst[j]), ok ? a_src[j] + k0 * (AF ? 2 : 1) : args.a, ok);
    }
#pragma unroll
    for (int j = 0; j < kBPer; ++j) {
      const bool ok = b_ok[j] && k0 / 2 + b_chunk[j] * 16 < args.b_k;
      cp_async16(smem_u32(bs + b_dst[j]), ok ? b_src[j] + k0 / 2 : args.b, ok);
    }
    if (tid < kBN) cp_async4(smem_u32(Ss + s * kBN + tid), s_ok ? s_src + kb * 4 : args.b_e8, s_ok);
  };

  // Activation scales (quantized A): the scale row of each of this thread's rows.
  int sa_row[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = m0 + wm * WM + mi * 16 + g + 8 * h;
      const int64_t r = row < m_end ? row : m0;
      sa_row[mi][h] = AF ? 0 : int((args.a_rows ? int64_t(__ldg(args.a_rows + r) / args.a_row_div) : r) * args.lds);
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
    float sa[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) sa[mi][h] = AF ? 1.0f : __ldg(args.a_scale + sa_row[mi][h] + kb);

    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (kb + kStages - 1 < KB) load(kb + kStages - 1);
    cp_async_commit();

    const int s = int(kb % kStages);
    const uint8_t* as = As + s * BM * kLda;
    const uint8_t* bs = Bs + s * kBN * kLdb;
    const uint32_t* ss = Ss + s * kBN;
    uint32_t sw_codes[NI][2];  // the four scale codes of each of this thread's output columns
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int j = 0; j < 2; ++j) sw_codes[ni][j] = ss[wn * 32 + ni * 8 + t4 * 2 + j];

#pragma unroll
    for (int kk = 0; kk < kBK / 32; ++kk) {
      float part[MI][NI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
          for (int c = 0; c < 4; ++c) part[mi][ni][c] = 0.0f;
      uint32_t bw[NI];
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
        bw[ni] = *reinterpret_cast<const uint32_t*>(bs + (wn * 32 + ni * 8 + g) * kLdb + kk * 16 + t4 * 4);
      if constexpr (AF) {
        uint32_t bf[NI][4];
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          e2m1x4_to_16<kBf16>(bw[ni] & 0xffffu, bf[ni][0], bf[ni][1]);
          e2m1x4_to_16<kBf16>(bw[ni] >> 16, bf[ni][2], bf[ni][3]);
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          const uint8_t* p = as + (wm * WM + mi * 16 + g) * kLda + kk * 64 + t4 * 16;
          const uint4 r0 = *reinterpret_cast<const uint4*>(p);
          const uint4 r8 = *reinterpret_cast<const uint4*>(p + 8 * kLda);
#pragma unroll
          for (int ni = 0; ni < NI; ++ni) {
            mma_k16<kBf16>(part[mi][ni], r0.x, r8.x, r0.y, r8.y, bf[ni][0], bf[ni][1]);
            mma_k16<kBf16>(part[mi][ni], r0.z, r8.z, r0.w, r8.w, bf[ni][2], bf[ni][3]);
          }
        }
      } else {
        uint32_t bf[NI][2];
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          bf[ni][0] = e2m1x4_to_e4m3x4(bw[ni] & 0xffffu);
          bf[ni][1] = e2m1x4_to_e4m3x4(bw[ni] >> 16);
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          const uint8_t* p = as + (wm * WM + mi * 16 + g) * kLda + kk * 32 + t4 * 8;
          const uint2 r0 = *reinterpret_cast<const uint2*>(p);
          const uint2 r8 = *reinterpret_cast<const uint2*>(p + 8 * kLda);
          const uint32_t af[4] = {r0.x, r8.x, r0.y, r8.y};
#pragma unroll
          for (int ni = 0; ni < NI; ++ni) mma_e4m3_k32(part[mi][ni], af, bf[ni][0], bf[ni][1]);
        }
      }
      // The group's sums, scaled once, into the accumulators.
      float sw[NI][2];
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int j = 0; j < 2; ++j) sw[ni][j] = ue8m0_f32((sw_codes[ni][j] >> (8 * kk)) & 0xffu);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[mi][ni][c] += part[mi][ni][c] * (sa[mi][c / 2] * sw[ni][c % 2]);
    }
  }
  cp_async_wait<0>();

  with_epilogue_forms<EPI>(args, [&](auto tag, auto code) {  // one switch outside the unrolled columns
    using Out = decltype(tag);  // the output's element type for this form
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = m0 + wm * WM + mi * 16 + g + 8 * h;
        if (row >= m_end) continue;
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const int v = wn * 32 + ni * 8 + t4 * 2;
          store_fp8_pair<Out, kBN, EPI, decltype(code)::value>(args, expert, bn, row, v, acc[mi][ni][2 * h],
                                                             acc[mi][ni][2 * h + 1]);
        }
      }
  });
#endif
}

template <class T, int BM, int EPI, bool AF>
cudaError_t launch_fp4(const Fp4GemmArgs& a, cudaStream_t stream) {
  const int64_t virt = a.epilogue == kEpiGated ? 2 * a.n : a.n;
  const int64_t tiles = grouped_max_tiles(a.max_rows, a.experts, BM);
  if (tiles == 0 || virt == 0) return cudaSuccess;
  if (tiles > 65535) return cudaErrorInvalidValue;
  const dim3 grid(unsigned((virt + kBN - 1) / kBN), unsigned(tiles));
  constexpr int smem = smem_bytes<AF>(BM);
  static const cudaError_t attr = cudaFuncSetAttribute(grouped_gemm_fp4_kernel<T, BM, EPI, AF>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  grouped_gemm_fp4_kernel<T, BM, EPI, AF><<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <class T, int BM, bool AF>
cudaError_t launch_fp4_epi(const Fp4GemmArgs& a, cudaStream_t stream) {
  switch (a.epilogue) {
    case kEpiGated: return launch_fp4<T, BM, kEpiGated, AF>(a, stream);
    case kEpiActOnly: return launch_fp4<T, BM, kEpiActOnly, AF>(a, stream);
    case kEpiF32: return launch_fp4<T, BM, kEpiF32, AF>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <class T, bool AF>
cudaError_t launch_fp4_tile(const Fp4GemmArgs& a, int tile_m, cudaStream_t stream) {
  if (tile_m == 128) return launch_fp4_epi<T, 128, AF>(a, stream);
  if (tile_m == 32) return launch_fp4_epi<T, 32, AF>(a, stream);
  return cudaErrorInvalidValue;
}

// ---- weight quantisation (moekit/quant.h quantize_fp4), one thread per group of 32 ----

// Round-to-nearest-even e2m1 code of f, saturated to +-6 (src/core/dtype.cpp f32_to_f4e2m1).
__device__ __forceinline__ uint32_t to_e2m1(float f) {
  const uint32_t sign = signbit(f) ? 0x8u : 0u;
  const float a = fabsf(f);
  if (isnan(f)) return 0x7u;
  if (a >= 6.0f) return sign | 0x7u;
  // Representable magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7): steps of 0.5 below 2, 1 below 4, 2 above.
  uint32_t code;
  if (a < 2.0f) code = uint32_t(__float2int_rn(a * 2.0f));            // 0..4 (4: 2.0)
  else if (a < 4.0f) code = 2u + uint32_t(__float2int_rn(a));          // 4..6
  else code = 4u + uint32_t(__float2int_rn(a * 0.5f));                 // 6..7
  return sign | (code > 7u ? 7u : code);
}

template <class T>
__global__ void quantize_fp4_groups_kernel(const T* __restrict__ w, int64_t groups, uint8_t* __restrict__ q,
                                           uint8_t* __restrict__ scales) {
  const int64_t gi = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gi >= groups) return;
  const T* x = w + gi * 32;
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(to_f32(x[i])));
  int e = 127;
  if (amax > 0.0f) {
    int ex;
    frexpf(amax, &ex);
    e = min(max(ex - 1 - 2 + 127, 0), 254);
  }
  scales[gi] = uint8_t(e);
  const float inv = __fdiv_rn(1.0f, ue8m0_f32(uint32_t(e)));
  for (int i = 0; i < 16; ++i) {
    const uint32_t lo = to_e2m1(to_f32(x[2 * i]) * inv), hi = to_e2m1(to_f32(x[2 * i + 1]) * inv);
    q[gi * 16 + i] = uint8_t(lo | (hi << 4));
  }
}

}  // namespace

bool grouped_gemm_fp4_built_for(int arch, bool float_acts) {
  if (arch < (float_acts ? 80 : 89)) return false;
  cudaFuncAttributes attr{};
  const cudaError_t err =
      float_acts ? cudaFuncGetAttributes(&attr, grouped_gemm_fp4_kernel<bf16, 32, kEpiF32, true>)
                 : cudaFuncGetAttributes(&attr, grouped_gemm_fp4_kernel<uint8_t, 32, kEpiF32, false>);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.binaryVersion >= (float_acts ? 80 : 89);
}

bool grouped_gemm_fp4_ok(const Fp4GemmArgs& a) {
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  const int64_t ae = a.a_float ? elem_bytes(a.type) : 1;
  return a.k % 32 == 0 && a.b_k * 2 == a.k && a.b_stride_n % 16 == 0 && a.b_expert_stride % 16 == 0 &&
         a.b_e8 != nullptr && a.b_e8_ld >= (a.k + 127) / 128 * 4 && a.b_e8_ld % 4 == 0 &&
         a.bs_expert_stride % 4 == 0 && (reinterpret_cast<uintptr_t>(a.b_e8) & 3) == 0 && (a.lda * ae) % 16 == 0 &&
         aligned(a.a) && aligned(a.b) &&
         (a.a_float ? a.type != Elem::f32 && a.lda >= a.k : a.a_scale != nullptr && a.lda >= (a.k + 127) / 128 * 128);
}

cudaError_t grouped_gemm_fp4(const Fp4GemmArgs& a, int tile_m, cudaStream_t stream) {
  if (!grouped_gemm_fp4_ok(a)) return cudaErrorInvalidValue;
  if (!a.a_float) return launch_fp4_tile<uint8_t, false>(a, tile_m, stream);
  if (a.type == Elem::bf16) return launch_fp4_tile<bf16, true>(a, tile_m, stream);
  return launch_fp4_tile<f16, true>(a, tile_m, stream);
}

cudaError_t quantize_fp4_groups(Elem type, const void* w, int64_t rows, int64_t k, uint8_t* q, uint8_t* scales,
                                cudaStream_t stream) {
  if (k % 32) return cudaErrorInvalidValue;
  const int64_t groups = rows * (k / 32);
  if (groups == 0) return cudaSuccess;
  return with_elem(type, [&](auto tag) {
    using T = decltype(tag);
    quantize_fp4_groups_kernel<T><<<unsigned((groups + 255) / 256), 256, 0, stream>>>(static_cast<const T*>(w), groups,
                                                                                     q, scales);
    return cudaGetLastError();
  });
}

}  // namespace moekit::cuda::kernels

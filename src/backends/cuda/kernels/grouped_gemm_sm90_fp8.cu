// FP8 grouped projection on Hopper (sm_90a): warp-specialised, persistent, fed by the copy engine (TMA).
//
// One block per multiprocessor walks work items (expert, column tile, row tile), the row tile fastest within an
// expert so the blocks in flight share the expert's weights in L2; the list comes from the device offsets (no host
// synchronisation). Each reduction step is one 128-input scale block: warpgroup 0 (the producer, registers lowered)
// has one thread issue the bulk tensor copies of the A tile (128 quantized rows x 128 bytes) and the B tile (128
// weight rows x 128 bytes; gated projections: 64 gate rows and the 64 matching up rows, concatenated halves) into
// a ring of shared-memory stages (128-byte swizzle) guarded by mbarriers. Warpgroups 1 and 2 (registers raised)
// each take 64 rows: four e4m3 wgmma m64n128k32 form the block's partial sums in f32 (the first one overwriting
// the previous block's), the stage is released, and the partials are promoted into the f32 accumulators as
//   acc += partial * a_scale[row, block] * w_scale[block row of the box, block]
// (the FP8 tensor cores' own accumulation never spans more than one block). The epilogue applies the gate (and
// bias) or writes f32, rows past the expert's end masked.
//
// Two forms, both on by default (switches for measurement; the sums and outputs are the same bits either way):
// - staged scales (MOEKIT_FP8_SM90_STAGED_SCALES): the producer warp's 32 lanes copy each block's 128 activation
//   scales and the box's weight scale(s) into shared memory beside the stage (cp.async, counted by the stage's full
//   barrier), and the consumers read them there after the stage wait, in place of the global loads one block ahead;
// - bulk output stores (MOEKIT_FP8_SM90_TMA_STORE, 16-bit outputs: the gated and act-only epilogues and the 16-bit
//   rows of kEpiWeighted): each consumer warpgroup stages its 64 rows as 64 x 64 boxes (128-byte swizzle) and one
//   thread issues bulk tensor stores, so that the next item's main loop starts while the copy engine writes (the
//   staging is reused once the previous stores have read it); 64-row blocks that cross the expert's end, and
//   outputs whose rows are not 16-byte aligned, keep the direct stores.
// And the work items handed over by the producer (MOEKIT_FP8_SM90_ITEM_RING, on by default): the producer, which runs
// stages ahead, writes each item (expert, column tile, first and end rows) beside the stage that holds its first
// block, and the consumers read it there after that stage's wait, instead of each warp searching the tile offsets and
// loading the expert's row offsets from global memory at the start of every item, on its critical path.
// And two forms for tiles with few rows (MOEKIT_FP8_SM90_SHORT_A, MOEKIT_FP8_SM90_SKIP_IDLE; same bits either way):
// - short A boxes: a tile whose expert has at most 32 (64) rows left loads A boxes of 32 (64) rows instead of 128,
//   so that decode-sized calls (a few rows per expert) do not bring 128 rows of other experts' activations from L2
//   for every weight box; the stage's rows past the box keep older values, which reach only output rows past the
//   expert's end (masked);
// - idle warpgroups: a consumer warpgroup whose 64 rows all lie past the expert's end only waits for each stage and
//   releases it, without MMAs or promotions.
//
// Serves: A contiguous sorted rows (lda a multiple of 16, rows padded to whole blocks), weights [E, N, ld] with
// ld a multiple of 16, 16-byte aligned; epilogues kEpiF32, kEpiActOnly, kEpiGated with concatenated halves and
// kEpiWeighted without weights (16-bit rows of the output type, for combine_rows16);
// sm_90a devices with this build's code. Elsewhere grouped_gemm_fp8 (grouped_gemm_fp8.cu) serves.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <utility>
#include <type_traits>

#include "backends/cuda/kernels/fp8_epilogue.cuh"
#include "backends/cuda/kernels/grouped_gemm_sm90.cuh"
#include "base/env.h"

namespace moekit::cuda::kernels {
namespace {
using sm90::fence_operands;
using sm90::smem_desc;
using sm90::cp_async_arrive_noinc;
using sm90::mbar_arrive;
using sm90::mbar_expect_tx;
using sm90::mbar_init;
using sm90::mbar_wait;
using sm90::tma_load_2d;
using sm90::tma_load_3d;

constexpr int kBM = 128, kBN = 128, kBK = 128, kStages = 5, kThreads = 384;
constexpr int kABytes = kBM * kBK, kBBytes = kBN * kBK, kStageBytes = kABytes + kBBytes;
// Staged scales: kBM activation scales and two weight scales per stage. Output staging: per consumer warpgroup up
// to two 64 x 64 16-bit boxes of 8 KB.
constexpr int kScaleFloats = kBM + 2, kScaleStride = 528;  // bytes per stage (16-byte multiple)
constexpr int kBoxBytes = 64 * 128, kOutBytes = 2 * kBoxBytes;
static_assert(kScaleFloats * 4 <= kScaleStride, "staged scales");

// Offsets from the 1024-aligned base of the dynamic shared memory: the stages, the barriers (2 kStages), the work
// items (kStages x 16 bytes: the item whose first block a stage holds), the copy of tile_offsets[0, E]; with the forms on, the staged scales (kStages x kScaleStride bytes, 16-byte aligned) and
// the output staging (two consumers x kOutBytes, 1024-byte aligned). end: the bytes used past the base.
struct SmemLayout {
  uint32_t bars, items, tiles, scales, out, end;
};
__host__ __device__ constexpr SmemLayout smem_layout(int experts, bool staged, bool bulk) {
  SmemLayout l{};
  l.bars = uint32_t(kStages) * kStageBytes;
  l.items = l.bars + 2 * kStages * 8;
  l.tiles = l.items + kStages * 16;
  const uint32_t tiles_end = l.tiles + (uint32_t(experts) + 1) * 4;
  l.scales = (tiles_end + 15) & ~15u;
  const uint32_t scales_end = staged ? l.scales + kStages * kScaleStride : tiles_end;
  l.out = (scales_end + 1023) & ~1023u;
  l.end = bulk ? l.out + 2 * kOutBytes : scales_end;
  return l;
}
// Dynamic shared memory of a launch over `experts` experts: the layout above and the alignment slack (both forms
// off: the stages, the barriers and the tile offsets alone).
size_t smem_bytes(int experts, bool staged, bool bulk) { return smem_layout(experts, staged, bulk).end + 1024; }
static_assert(smem_layout(4096, true, true).end + 1024 <= 227 * 1024, "shared memory layout");

// 4-byte asynchronous copy global -> shared (the stage's arrival: sm90::cp_async_arrive_noinc).
[[maybe_unused]] __device__ __forceinline__ void cp_async_4(uint32_t dst, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// d[64 x 128] (=|+=) A[64 x 32] . B[128 x 32]^T, e4m3 operands from shared memory (K-major), f32 accumulators;
// accumulate = 0 overwrites d.
__device__ __forceinline__ void wgmma_e4m3_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                      int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#endif
}

// Output columns of one work item: gated tiles give 64 (gate and up rows side by side), the others 128.
template <int EPI>
__device__ __forceinline__ int tile_cols() {
  return EPI == kEpiGated ? kBN / 2 : kBN;
}

struct Work {
  int expert, n_tile;
  int64_t m0, m_end;
};
// Work item w: expert, column tile and row tile (row tiles fastest within the expert). tiles_s: the block's copy of
// tile_offsets[0, E] in shared memory (the search runs once per item in every consumer warp and the producer).
[[maybe_unused]] __device__ __forceinline__ void work_item(const Fp8GemmArgs& args, const int* tiles_s, int w,
                                                           int n_tiles, Work& t) {
  const int e = tile_expert<true>(tiles_s, args.experts, w / n_tiles), first_tile = tiles_s[e];
  const int m_tiles = tiles_s[e + 1] - first_tile;
  const int local = w - first_tile * n_tiles;
  t.expert = e;
  t.n_tile = local / m_tiles;
  t.m0 = __ldg(args.offsets + e) + int64_t(local % m_tiles) * kBM;
  t.m_end = __ldg(args.offsets + e + 1);
}

// Block row of the weight scales that covers weight rows [r, r + 64) (or [r, r + 128) for 128-aligned r).
__device__ __forceinline__ int64_t scale_row(const Fp8GemmArgs& args, int64_t r) {
  const int64_t seg = args.b_scale_seg;
  return (r / seg) * ((seg + 127) / 128) + (r % seg) / 128;
}

template <class T, int EPI, int CODE>
__device__ __forceinline__ void store_value(const Fp8GemmArgs& args, const T* bias, int64_t row, int64_t col, float x,
                                            float up) {
  if constexpr (EPI == kEpiGated) {
    const float bg = bias ? to_f32(bias[col]) : 0.0f, bu = bias ? to_f32(bias[args.inter + col]) : 0.0f;
    static_cast<T*>(args.out)[row * args.ldo + col] = from_f32<T>(fp8_gated<T, CODE>(args.gate, x, up, bias != nullptr, bg, bu));
  } else if constexpr (EPI == kEpiActOnly) {
    const float y = fp8_act_only<T, CODE>(args.gate, x, bias != nullptr, bias ? to_f32(bias[col]) : 0.0f);
    static_cast<T*>(args.out)[row * args.ldo + col] = from_f32<T>(y);
  } else {
    static_cast<float*>(args.out)[row * args.ldo + col] = x;
  }
}

// Two adjacent 16-bit outputs (4-byte aligned) in one store.
template <class T>
__device__ __forceinline__ void store_pair(T* out, float x0, float x1) {
  if constexpr (std::is_same_v<T, bf16>) *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(x0, x1);
  else *reinterpret_cast<__half2*>(out) = __floats2half2_rn(x0, x1);
}

// CODE: the gate as a constant (fp8_epilogue.cuh), so that the unrolled columns carry one activation's code.
template <class T, int EPI, int CODE>
__device__ __forceinline__ void epilogue_k(const Fp8GemmArgs& args, const Work& t, int c, int warp, int lane,
                                           const float (&acc)[64]) {
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(t.expert) * args.bias_expert_stride : nullptr;
  const int64_t col0 = int64_t(t.n_tile) * tile_cols<EPI>();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = t.m0 + c * 64 + warp * 16 + (lane >> 2) + half * 8;
    if (row >= t.m_end) continue;
    if constexpr (EPI == kEpiGated) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t col = col0 + 8 * j + 2 * (lane & 3);
        if constexpr (!std::is_same_v<T, float>) {
          if (col + 1 < args.n && (args.ldo & 1) == 0) {  // both columns: one 4-byte store
            float v[2];
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              const float bg = bias ? to_f32(bias[col + q]) : 0.0f, bu = bias ? to_f32(bias[args.inter + col + q]) : 0.0f;
              v[q] = fp8_gated<T, CODE>(args.gate, acc[4 * j + 2 * half + q], acc[4 * (j + 8) + 2 * half + q],
                                  bias != nullptr, bg, bu);
            }
            store_pair(static_cast<T*>(args.out) + row * args.ldo + col, v[0], v[1]);
            continue;
          }
        }
#pragma unroll
        for (int q = 0; q < 2; ++q)
          if (col + q < args.n)
            store_value<T, EPI, CODE>(args, bias, row, col + q, acc[4 * j + 2 * half + q],
                                      acc[4 * (j + 8) + 2 * half + q]);
      }
    } else if constexpr (EPI == kEpiWeighted) {  // 16-bit rows: the accumulators rounded once to T
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int64_t col = col0 + 8 * j + 2 * (lane & 3);
        T* out = static_cast<T*>(args.out) + row * args.ldo + col;
        if (col + 1 < args.n && (args.ldo & 1) == 0) {
          store_pair(out, acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
        } else {
          if (col < args.n) out[0] = from_f32<T>(acc[4 * j + 2 * half]);
          if (col + 1 < args.n) out[1] = from_f32<T>(acc[4 * j + 2 * half + 1]);
        }
      }
    } else if constexpr (EPI == kEpiF32) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int64_t col = col0 + 8 * j + 2 * (lane & 3);
        float* out = static_cast<float*>(args.out) + row * args.ldo + col;
        if (col + 1 < args.n && (args.ldo & 1) == 0) {
          *reinterpret_cast<float2*>(out) = make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
        } else {
          if (col < args.n) out[0] = acc[4 * j + 2 * half];
          if (col + 1 < args.n) out[1] = acc[4 * j + 2 * half + 1];
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int64_t col = col0 + 8 * j + 2 * (lane & 3) + q;
          if (col < args.n) store_value<T, EPI, CODE>(args, bias, row, col, acc[4 * j + 2 * half + q], 0.0f);
        }
    }
  }
}

// The epilogue of a tile: one switch onto the output type and the gate's constant form (f32 outputs take neither).
template <int EPI>
__device__ __forceinline__ void epilogue(const Fp8GemmArgs& args, const Work& t, int c, int warp, int lane,
                                         const float (&acc)[64]) {
  if constexpr (EPI == kEpiWeighted) {
    if (args.type == Elem::f16) epilogue_k<f16, EPI, kActRuntime>(args, t, c, warp, lane, acc);
    else epilogue_k<bf16, EPI, kActRuntime>(args, t, c, warp, lane, acc);
  } else {
    with_epilogue_forms<EPI>(args, [&](auto tag, auto code) {
      epilogue_k<decltype(tag), EPI, decltype(code)::value>(args, t, c, warp, lane, acc);
    });
  }
}

// The 16-bit epilogues through shared memory: consumer c's 64 rows (all inside the expert) staged as 64 x 64 boxes
// (128-byte swizzle: 16-byte chunk ch of row r at chunk ch ^ (r % 8)), then bulk tensor stores issued by the
// warpgroup's first thread (columns past n clipped by the copy engine). The values are those of epilogue_k above,
// bit for bit; CODE: the gate as a constant, as there.
template <class T, int EPI, int CODE>
__device__ __forceinline__ void epilogue_bulk_k(const Fp8GemmArgs& args, const Work& t, int c, int warp, int lane,
                                                const float (&acc)[64], unsigned char* stage, uint32_t stage_u32,
                                                const CUtensorMap* map_out) {
  static_assert(EPI != kEpiF32 && !std::is_same_v<T, float>, "16-bit epilogues only");
  constexpr int kCols = EPI == kEpiGated ? kBN / 2 : kBN, kBoxes = kCols / 64;
  using T2 = std::conditional_t<std::is_same_v<T, bf16>, __nv_bfloat162, __half2>;
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(t.expert) * args.bias_expert_stride : nullptr;
  const int64_t col0 = int64_t(t.n_tile) * kCols;
  const int tl = threadIdx.x % 128;
  if (tl == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // the previous item's stores read
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * 16 + (lane >> 2) + half * 8;
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
      const int64_t col = col0 + 8 * j + 2 * (lane & 3);
      float y[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const bool in = col + q < args.n;
        if constexpr (EPI == kEpiGated) {
          const float bg = bias && in ? to_f32(bias[col + q]) : 0.0f;
          const float bu = bias && in ? to_f32(bias[args.inter + col + q]) : 0.0f;
          y[q] = fp8_gated<T, CODE>(args.gate, acc[4 * j + 2 * half + q], acc[4 * (j + 8) + 2 * half + q],
                                    bias != nullptr, bg, bu);
        } else if constexpr (EPI == kEpiActOnly) {
          y[q] = fp8_act_only<T, CODE>(args.gate, acc[4 * j + 2 * half + q], bias != nullptr,
                                       bias && in ? to_f32(bias[col + q]) : 0.0f);
        } else {  // kEpiWeighted without weights: the accumulators rounded once to T
          y[q] = acc[4 * j + 2 * half + q];
        }
      }
      T2 v;
      v.x = from_f32<T>(y[0]);
      v.y = from_f32<T>(y[1]);
      const int off = (j >> 3) * kBoxBytes + r * 128 + (((j & 7) ^ (r & 7)) << 4) + (lane & 3) * 4;
      *reinterpret_cast<T2*>(stage + off) = v;
    }
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the staging visible to the copy engine
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
  if (tl == 0) {
    const int r0 = int(t.m0) + c * 64;
#pragma unroll
    for (int b = 0; b < kBoxes; ++b)
      if (col0 + 64 * b < args.n)
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(map_out),
                     "r"(int(col0) + 64 * b), "r"(r0), "r"(stage_u32 + b * kBoxBytes)
                     : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  }
}

// The bulk-store epilogue of a tile: one switch onto the output type and the gate's constant form, as epilogue().
template <int EPI>
__device__ __forceinline__ void epilogue_bulk(const Fp8GemmArgs& args, const Work& t, int c, int warp, int lane,
                                              const float (&acc)[64], unsigned char* stage, uint32_t stage_u32,
                                              const CUtensorMap* map_out) {
  if constexpr (EPI == kEpiWeighted) {
    if (args.type == Elem::f16)
      epilogue_bulk_k<f16, EPI, kActRuntime>(args, t, c, warp, lane, acc, stage, stage_u32, map_out);
    else
      epilogue_bulk_k<bf16, EPI, kActRuntime>(args, t, c, warp, lane, acc, stage, stage_u32, map_out);
  } else {
    with_epilogue_forms<EPI>(args, [&](auto tag, auto code) {
      using T = decltype(tag);
      if constexpr (std::is_same_v<T, float>) {  // not launched so (the launcher's condition): the direct stores
        epilogue_k<T, EPI, decltype(code)::value>(args, t, c, warp, lane, acc);
      } else {
        epilogue_bulk_k<T, EPI, decltype(code)::value>(args, t, c, warp, lane, acc, stage, stage_u32, map_out);
      }
    });
  }
}

// STAGED, BULK: the forms of the header comment (BULK only for 16-bit epilogues).
// map_a32 / map_a64: A in boxes of 32 / 64 rows (used when short_a is set); skip_idle: the idle warpgroups' form;
// item_ring: the consumers read the work items the producer wrote.
template <int EPI, bool STAGED, bool BULK>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_fp8_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_a32,
                                 const __grid_constant__ CUtensorMap map_a64, const __grid_constant__ CUtensorMap map_b,
                                 const __grid_constant__ CUtensorMap map_out, const Fp8GemmArgs args, const int short_a,
                                 const int skip_idle, const int item_ring) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!BULK || EPI != kEpiF32, "bulk stores: 16-bit epilogues");
  extern __shared__ __align__(1024) unsigned char fp8_smem[];
  const uint32_t base = (smem_u32(fp8_smem) + 1023) & ~1023u;  // swizzled tiles: 1024-byte aligned
  const SmemLayout lay = smem_layout(args.experts, STAGED, BULK);
  const uint32_t bars = base + lay.bars;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kStages + s); };
  auto scales = [&](int s) { return base + lay.scales + s * kScaleStride; };  // STAGED: kScaleFloats f32
  auto item_at = [&](int s) { return reinterpret_cast<int4*>(fp8_smem + (base + lay.items + 16 * s - smem_u32(fp8_smem))); };
  const int tid = threadIdx.x, wg = tid / 128;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), STAGED ? 1 + 32 : 1);  // the copy engine's bytes (+ each producer lane's scale copies)
      mbar_init(empty(s), 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  int* tiles_s = reinterpret_cast<int*>(fp8_smem + (base + lay.tiles - smem_u32(fp8_smem)));
  for (int e = tid; e <= args.experts; e += kThreads) tiles_s[e] = __ldg(args.tile_offsets + e);
  __syncthreads();

  const int n_tiles = int((args.n + tile_cols<EPI>() - 1) / tile_cols<EPI>());
  const int total = tiles_s[args.experts] * n_tiles;
  const int kblocks = int((args.k + kBK - 1) / kBK);

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid >= (STAGED ? 32 : 1)) return;  // one thread issues the copies (STAGED: its warp copies the scales)
    if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(&map_a) : "memory");
      if (short_a) {
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(&map_a32) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(&map_a64) : "memory");
      }
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(&map_b) : "memory");
    }
    int s = 0;
    uint32_t phase = 0;
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
      Work t;
      work_item(args, tiles_s, w, n_tiles, t);
      const int row0 = t.n_tile * tile_cols<EPI>();
      // short_a: the A box of 32 or 64 rows where the expert has no more rows left in this tile
      const CUtensorMap* ma = &map_a;
      int a_bytes = kABytes;
      if (short_a && t.m_end - t.m0 <= 64) {
        const bool b32 = t.m_end - t.m0 <= 32;
        ma = b32 ? &map_a32 : &map_a64;
        a_bytes = (b32 ? 32 : 64) * kBK;
      }
      // STAGED: lane l copies the scales of tile rows l + 32 i (rows past the expert: its last row's, as the
      // consumers' clamped loads) and lanes 0 / 1 the weight scales of the box's first / second half.
      [[maybe_unused]] const float* sw =
          args.b_scale + int64_t(t.expert) * args.bs_expert_stride +
          scale_row(args, (EPI == kEpiGated && tid == 1 ? args.inter : 0) + row0) * kblocks;
      for (int kb = 0; kb < kblocks; ++kb) {
        mbar_wait(empty(s), phase ^ 1);
        const uint32_t st = base + s * kStageBytes;
        if (tid == 0) {
          // the item beside its first stage (visible to the consumers through the full barrier's arrival below)
          if (kb == 0) *item_at(s) = make_int4(t.expert, t.n_tile, int(t.m0), int(t.m_end));
          mbar_expect_tx(full(s), a_bytes + kBBytes);
          tma_load_2d(st, ma, full(s), kb * kBK, int(t.m0));
          if constexpr (EPI == kEpiGated) {  // 64 gate rows, then the 64 matching up rows
            tma_load_3d(st + kABytes, &map_b, full(s), kb * kBK, row0, t.expert);
            tma_load_3d(st + kABytes + kBBytes / 2, &map_b, full(s), kb * kBK, int(args.inter) + row0, t.expert);
          } else {
            tma_load_3d(st + kABytes, &map_b, full(s), kb * kBK, row0, t.expert);
          }
        }
        if constexpr (STAGED) {
#pragma unroll
          for (int i = 0; i < kBM / 32; ++i) {
            const int64_t r = std::min<int64_t>(t.m0 + tid + 32 * i, t.m_end - 1);
            cp_async_4(scales(s) + 4 * (tid + 32 * i), args.a_scale + r * args.lds + kb);
          }
          if (tid < 2) cp_async_4(scales(s) + 4 * (kBM + tid), sw + kb);
          cp_async_arrive_noinc(full(s));
        }
        if (++s == kStages) {
          s = 0;
          phase ^= 1;
        }
      }
    }
    if constexpr (STAGED) asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
    return;
  }

  // consumers: warpgroup c = wg - 1 takes rows 64 c .. 64 c + 63 of each tile
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1, lane = tid % 32, warp = (tid % 128) / 32;
  int s = 0;
  uint32_t phase = 0;
  float acc[64], part[64];
  for (int w = blockIdx.x; w < total; w += gridDim.x) {
    Work t;
    if (item_ring) {  // the item the producer wrote beside its first stage (waited for again in the loop below)
      mbar_wait(full(s), phase);
      const int4 v = *item_at(s);
      t.expert = v.x;
      t.n_tile = v.y;
      t.m0 = v.z;
      t.m_end = v.w;
    } else {
      work_item(args, tiles_s, w, n_tiles, t);
    }
    const int64_t r0 = t.m0 + c * 64 + warp * 16 + (lane >> 2);
    if (skip_idle && t.m0 + c * 64 >= t.m_end) {  // no row of this warpgroup in the expert: release the stages
      for (int kb = 0; kb < kblocks; ++kb) {
        mbar_wait(full(s), phase);
        if (lane == 0) mbar_arrive(empty(s));
        if (++s == kStages) {
          s = 0;
          phase ^= 1;
        }
      }
      continue;
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    // Each block's scales are loaded one block ahead, so that their latency passes under the previous block's MMAs
    // (STAGED: read from the stage's copy after its wait instead).
    [[maybe_unused]] const float *sa0 = nullptr, *sa1 = nullptr, *sw0 = nullptr, *sw1 = nullptr;
    [[maybe_unused]] float a0n = 0.0f, a1n = 0.0f, w0n = 0.0f, w1n = 0.0f;
    if constexpr (!STAGED) {
      sa0 = args.a_scale + std::min<int64_t>(r0, t.m_end - 1) * args.lds;
      sa1 = args.a_scale + std::min<int64_t>(r0 + 8, t.m_end - 1) * args.lds;
      const int64_t wrow0 = int64_t(t.n_tile) * tile_cols<EPI>();
      const float* ws_base = args.b_scale + int64_t(t.expert) * args.bs_expert_stride;
      sw0 = ws_base + scale_row(args, wrow0) * kblocks;
      sw1 = EPI == kEpiGated ? ws_base + scale_row(args, args.inter + wrow0) * kblocks : sw0;
      a0n = __ldg(sa0);
      a1n = __ldg(sa1);
      w0n = __ldg(sw0);
      w1n = __ldg(sw1);
    }
    for (int kb = 0; kb < kblocks; ++kb) {
      float a0 = a0n, a1 = a1n, w0 = w0n, w1 = w1n;
      if constexpr (!STAGED) {
        if (kb + 1 < kblocks) {
          a0n = __ldg(sa0 + kb + 1);
          a1n = __ldg(sa1 + kb + 1);
          w0n = __ldg(sw0 + kb + 1);
          w1n = __ldg(sw1 + kb + 1);
        }
      }
      mbar_wait(full(s), phase);
      if constexpr (STAGED) {  // the producer's copies, complete with the stage
        const float* sc = reinterpret_cast<const float*>(fp8_smem + (scales(s) - smem_u32(fp8_smem)));
        const int r = c * 64 + warp * 16 + (lane >> 2);
        a0 = sc[r];
        a1 = sc[r + 8];
        w0 = sc[kBM];
        w1 = EPI == kEpiGated ? sc[kBM + 1] : w0;
      }
      const uint32_t st = base + s * kStageBytes;
      const uint64_t desc_a = smem_desc(st + c * 64 * kBK);
      const uint64_t desc_b = smem_desc(st + kABytes);
      fence_operands(part);
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < kBK / 32; ++kk) wgmma_e4m3_m64n128k32(part, desc_a + 2 * kk, desc_b + 2 * kk, kk);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      fence_operands(part);
      if constexpr (STAGED) __syncwarp();  // the warp's scale reads before the stage is released
      if (lane == 0) mbar_arrive(empty(s));
      if (++s == kStages) {
        s = 0;
        phase ^= 1;
      }
      // Accumulator 4j + q: row 16 warp + lane / 4 (+8 for q >= 2), column 8j + 2 (lane % 4) (+1 for odd q);
      // gated tiles: columns 64.. are the up rows.
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float wsc = (EPI == kEpiGated && j >= 8) ? w1 : w0;
        const float s0 = a0 * wsc, s1 = a1 * wsc;
        acc[4 * j + 0] += part[4 * j + 0] * s0;
        acc[4 * j + 1] += part[4 * j + 1] * s0;
        acc[4 * j + 2] += part[4 * j + 2] * s1;
        acc[4 * j + 3] += part[4 * j + 3] * s1;
      }
    }
    if (t.m0 + c * 64 >= t.m_end) continue;
    if constexpr (BULK) {
      if (t.m0 + c * 64 + 64 <= t.m_end) {  // the warpgroup's 64 rows inside the expert
        const uint32_t stage_u32 = base + lay.out + c * kOutBytes;
        epilogue_bulk<EPI>(args, t, c, warp, lane, acc, fp8_smem + (stage_u32 - smem_u32(fp8_smem)), stage_u32,
                           &map_out);
        continue;
      }
    }
    epilogue<EPI>(args, t, c, warp, lane, acc);
  }
  if constexpr (BULK) {
    if (tid % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the stores complete
  }
#endif
}

bool compiled_for(int arch) {
  if (arch != 90) return false;
  static PerDeviceValue known;  // 1 yes, 0 no
  return known.get(
             [](int) {
               cudaFuncAttributes attr{};
               const bool ok = cudaFuncGetAttributes(&attr, grouped_gemm_sm90_fp8_kernel<kEpiF32, false, false>) ==
                                   cudaSuccess &&
                               attr.binaryVersion == 90 && sm90::encode_fn() != nullptr;
               (void)cudaGetLastError();
               return ok ? 1 : 0;
             },
             0) == 1;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The switches of the header comment (on: the default form; off: the plain form).
EnvSwitch g_staged_scales{"MOEKIT_FP8_SM90_STAGED_SCALES", true}, g_tma_store{"MOEKIT_FP8_SM90_TMA_STORE", true};
EnvSwitch g_short_a{"MOEKIT_FP8_SM90_SHORT_A", true}, g_skip_idle{"MOEKIT_FP8_SM90_SKIP_IDLE", true};
EnvSwitch g_item_ring{"MOEKIT_FP8_SM90_ITEM_RING", true};

using KernelFn = void (*)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, Fp8GemmArgs, int, int, int);
template <int EPI>
KernelFn kernel_for(bool staged, bool bulk) {
  if constexpr (EPI == kEpiF32) {
    return staged ? grouped_gemm_sm90_fp8_kernel<EPI, true, false> : grouped_gemm_sm90_fp8_kernel<EPI, false, false>;
  } else {
    if (bulk)
      return staged ? grouped_gemm_sm90_fp8_kernel<EPI, true, true> : grouped_gemm_sm90_fp8_kernel<EPI, false, true>;
    return staged ? grouped_gemm_sm90_fp8_kernel<EPI, true, false> : grouped_gemm_sm90_fp8_kernel<EPI, false, false>;
  }
}

template <int EPI>
cudaError_t launch(const Fp8GemmArgs& a, cudaStream_t stream) {
  const auto encode = sm90::encode_fn();
  if (!encode) return cudaErrorNotSupported;
  const int64_t kb = (a.k + kBK - 1) / kBK;
  CUtensorMap map_a{}, map_a32{}, map_a64{}, map_b{};
  const bool short_a = g_short_a.on();
  for (const auto& [map, rows] : {std::pair{&map_a, kBM}, std::pair{&map_a32, 32}, std::pair{&map_a64, 64}}) {
    if (rows != kBM && !short_a) continue;
    const cuuint64_t dims[2] = {cuuint64_t(kb * kBK), cuuint64_t(a.max_rows)};
    const cuuint64_t strides[1] = {cuuint64_t(a.lda)};
    const cuuint32_t box[2] = {kBK, cuuint32_t(rows)}, estr[2] = {1, 1};
    if (encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(a.a), dims, strides, box, estr,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return cudaErrorInvalidValue;
  }
  {
    const int64_t rows = EPI == kEpiGated ? 2 * a.inter : a.n;
    const cuuint64_t dims[3] = {cuuint64_t(a.k), cuuint64_t(rows), cuuint64_t(a.experts)};
    const cuuint64_t strides[2] = {cuuint64_t(a.b_stride_n), cuuint64_t(a.b_expert_stride)};
    const cuuint32_t box[3] = {kBK, EPI == kEpiGated ? kBN / 2 : kBN, 1}, estr[3] = {1, 1, 1};
    if (encode(&map_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<uint8_t*>(a.b), dims, strides, box, estr,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return cudaErrorInvalidValue;
  }
  // 16-bit outputs through shared memory and bulk tensor stores (switch on, rows 16-byte aligned): 64 x 64 boxes
  CUtensorMap map_out{};
  bool bulk = false;
  if (EPI != kEpiF32 && g_tma_store.on() && (a.type == Elem::bf16 || a.type == Elem::f16) && a.ldo % 8 == 0 &&
      a.ldo >= a.n && aligned16(a.out)) {
    const cuuint64_t dims[2] = {cuuint64_t(a.n), cuuint64_t(a.max_rows)};
    const cuuint64_t strides[1] = {cuuint64_t(a.ldo) * 2};
    const cuuint32_t box[2] = {64, 64}, estr[2] = {1, 1};
    const auto dt = a.type == Elem::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    bulk = encode(&map_out, dt, 2, a.out, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  }
  const bool staged = g_staged_scales.on();
  const KernelFn kernel = kernel_for<EPI>(staged, bulk);
  const size_t smem = smem_bytes(a.experts, staged, bulk);
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  const int64_t cols = EPI == kEpiGated ? kBN / 2 : kBN;
  const int64_t work = grouped_max_tiles(a.max_rows, a.experts, kBM) * ((a.n + cols - 1) / cols);
  const int grid = int(std::min<int64_t>(work, sm90::sm_count()));
  if (grid == 0) return cudaSuccess;
  kernel<<<grid, kThreads, smem, stream>>>(map_a, map_a32, map_a64, map_b, map_out, a, short_a ? 1 : 0,
                                           g_skip_idle.on() ? 1 : 0,
                                           g_item_ring.on() && a.k > 0 ? 1 : 0);  // k = 0: no stage carries an item
  return cudaGetLastError();
}

}  // namespace

bool grouped_gemm_fp8_sm90_ok(const Fp8GemmArgs& a, int arch) {
  if (a.a_rows || a.lda % 16 || a.b_stride_n % 16 || a.b_expert_stride % 16) return false;
  if (a.lda < (a.k + kBK - 1) / kBK * kBK || a.b_stride_n < a.k) return false;
  if (a.epilogue != kEpiF32 && a.epilogue != kEpiActOnly && a.epilogue != kEpiGated && a.epilogue != kEpiWeighted)
    return false;
  if (a.epilogue == kEpiWeighted && a.type != Elem::bf16 && a.type != Elem::f16) return false;
  if (a.epilogue == kEpiGated && !a.gate.concatenated) return false;
  if (!aligned16(a.a) || !aligned16(a.b)) return false;
  if (a.experts <= 0 || a.experts > 4096 || a.max_rows >= (int64_t(1) << 31) || a.n >= (int64_t(1) << 30)) return false;
  return compiled_for(arch);
}

bool set_fp8_sm90_staged_scales(bool on) { return g_staged_scales.set(on); }
bool set_fp8_sm90_tma_store(bool on) { return g_tma_store.set(on); }
bool set_fp8_sm90_short_a(bool on) { return g_short_a.set(on); }
bool set_fp8_sm90_skip_idle(bool on) { return g_skip_idle.set(on); }
bool set_fp8_sm90_item_ring(bool on) { return g_item_ring.set(on); }

cudaError_t grouped_gemm_fp8_sm90(const Fp8GemmArgs& a, cudaStream_t stream) {
  if (a.max_rows == 0 || a.n == 0) return cudaSuccess;
  switch (a.epilogue) {
    case kEpiGated: return launch<kEpiGated>(a, stream);
    case kEpiActOnly: return launch<kEpiActOnly>(a, stream);
    case kEpiF32: return launch<kEpiF32>(a, stream);
    case kEpiWeighted: return launch<kEpiWeighted>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace moekit::cuda::kernels

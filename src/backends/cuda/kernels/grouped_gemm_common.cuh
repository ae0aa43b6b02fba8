// Shared by the tensor-core grouped kernels (sm80 mma.sync, sm90a wgmma): the row-tile lookup, the
// cp.async tile loader and the epilogue.
//
// Shared-memory tiles are [rows][64] of 16-bit elements: 128-byte rows of eight 16-byte chunks, chunk c
// of row r stored at chunk c ^ (r % 8). That is the 128-byte swizzle of wgmma's K-major layout (with
// 1024-byte aligned tiles) and keeps ldmatrix free of bank conflicts.
#pragma once
#include <type_traits>

#include "backends/cuda/kernels/device_math.cuh"

namespace moekit::cuda::kernels {

constexpr int kTileK = 64;   // reduction elements per shared-memory tile row
constexpr int kTileN = 128;  // virtual columns per block (the wide wgmma kernel takes 256)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int src_size = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Element offset of 16-byte chunk `chunk` of tile row `row`.
__device__ __forceinline__ int swizzled(int row, int chunk) { return row * kTileK + ((chunk ^ (row & 7)) * 8); }

// The row tile of this block: expert, first row, end of the expert's rows. False past the last tile.
struct RowTile {
  int expert;
  int64_t m0, m_end;
};
__device__ __forceinline__ bool row_tile(const GroupedGemmArgs& args, int tile, int tile_m, RowTile& t) {
  if (tile >= __ldg(args.tile_offsets + args.experts)) return false;
  t.expert = tile_expert(args.tile_offsets, args.experts, tile);
  t.m0 = __ldg(args.offsets + t.expert) + int64_t(tile - __ldg(args.tile_offsets + t.expert)) * tile_m;
  t.m_end = __ldg(args.offsets + t.expert + 1);
  return true;
}

// Copies the BM x 64 A tile and the BN x 64 B tile of reduction step kt into shared memory with
// cp.async; rows past the ends and columns past k are zero-filled. Gated projections interleave the B
// rows: virtual row 2c is the gate row, 2c + 1 the up row of output column c.
template <class T, int BM, int BN, int THREADS, int EPI>
struct TileLoader {
  static constexpr int kChunks = kTileK / 8;
  static constexpr int kRowsPerPass = THREADS / kChunks;
  static constexpr int kAIters = BM / kRowsPerPass, kBIters = BN / kRowsPerPass;
  static_assert(kAIters >= 1 && kBIters >= 1 && BM % kRowsPerPass == 0, "loader shape");

  const T* a_src[kAIters];
  bool a_ok[kAIters];
  const T* b_src[kBIters];
  bool b_ok[kBIters];
  const T* a_base;
  const T* b_base;
  int chunk, row_base;
  int64_t k;

  __device__ __forceinline__ TileLoader(const GroupedGemmArgs& args, const RowTile& t, int bn, int tid) {
    chunk = tid % kChunks;
    row_base = tid / kChunks;
    k = args.k;
    a_base = static_cast<const T*>(args.a);
    b_base = static_cast<const T*>(args.b) + int64_t(t.expert) * args.b_expert_stride;
#pragma unroll
    for (int j = 0; j < kAIters; ++j) {
      const int64_t row = t.m0 + row_base + j * kRowsPerPass;
      a_ok[j] = row < t.m_end;
      const int64_t src = !a_ok[j] ? 0 : (args.a_rows ? int64_t(args.a_rows[row] / args.a_row_div) : row);
      a_src[j] = a_base + src * args.lda + chunk * 8;
    }
#pragma unroll
    for (int j = 0; j < kBIters; ++j) {
      const int v = row_base + j * kRowsPerPass;
      int64_t wr;
      if constexpr (EPI == kEpiGated) {
        const int64_t c = int64_t(bn) * (BN / 2) + v / 2;
        wr = c >= args.n ? -1 : ((v & 1) ? up_row(args.gate, c, args.inter) : gate_row(args.gate, c));
      } else {
        const int64_t n = int64_t(bn) * BN + v;
        wr = n < args.n ? n : -1;
      }
      b_ok[j] = wr >= 0;
      b_src[j] = b_base + (b_ok[j] ? wr * args.b_stride_n : 0) + chunk * 8;
    }
  }

  __device__ __forceinline__ void load(T* as, T* bs, int kt) const {
    load_a(as, kt);
    load_b(bs, kt);
  }
  __device__ __forceinline__ void load_a(T* as, int kt) const {
    const bool k_ok = int64_t(kt) * kTileK + chunk * 8 < k;
#pragma unroll
    for (int j = 0; j < kAIters; ++j) {
      const bool ok = a_ok[j] && k_ok;
      cp_async16(smem_u32(as + swizzled(row_base + j * kRowsPerPass, chunk)), ok ? a_src[j] + int64_t(kt) * kTileK : a_base,
                 ok);
    }
  }
  __device__ __forceinline__ void load_b(T* bs, int kt) const {
    const bool k_ok = int64_t(kt) * kTileK + chunk * 8 < k;
#pragma unroll
    for (int j = 0; j < kBIters; ++j) {
      const bool ok = b_ok[j] && k_ok;
      cp_async16(smem_u32(bs + swizzled(row_base + j * kRowsPerPass, chunk)), ok ? b_src[j] + int64_t(kt) * kTileK : b_base,
                 ok);
    }
  }
};

// Stores the accumulator pair (x0, x1) of sorted row `row` at virtual columns v, v + 1 (v even).
template <class T, int EPI, int BN = kTileN>
__device__ __forceinline__ void store_pair(const GroupedGemmArgs& args, const T* bias, int bn, int64_t row, int v,
                                           float x0, float x1) {
  if constexpr (EPI == kEpiGated) {
    const int64_t c = int64_t(bn) * (BN / 2) + v / 2;
    if (c >= args.n) return;
    if (bias) {
      x0 += to_f32(bias[gate_row(args.gate, c)]);
      x1 += to_f32(bias[up_row(args.gate, c, args.inter)]);
    }
    static_cast<T*>(args.out)[row * args.ldo + c] = from_f32<T>(gate_value(args.gate, x0, x1));
  } else {
    const int64_t n = int64_t(bn) * BN + v;
    if constexpr (EPI == kEpiF32) {
      if (n + 1 < args.n && args.ldo % 2 == 0) {  // 8-byte store
        *reinterpret_cast<float2*>(static_cast<float*>(args.out) + row * args.ldo + n) = make_float2(x0, x1);
        return;
      }
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if (n + q >= args.n) continue;
      const float x = q ? x1 : x0;
      if constexpr (EPI == kEpiActOnly) {
        const float y = x + (bias ? to_f32(bias[n + q]) : 0.0f);
        static_cast<T*>(args.out)[row * args.ldo + n + q] = from_f32<T>(activate(args.gate.activation, y));
      } else {
        static_cast<float*>(args.out)[row * args.ldo + n + q] = x;
      }
    }
  }
}

}  // namespace moekit::cuda::kernels

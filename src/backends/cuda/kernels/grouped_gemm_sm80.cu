// Grouped projection over sorted rows on the tensor cores (mma.sync m16n8k16, sm_80 and newer), bf16
// and f16 with f32 accumulation. Each block computes one row tile of one expert (offsets read on the
// device: no host synchronisation) against 128 virtual columns of that expert's weights, read in place.
//
// Weights are [n, k] with k contiguous (the default layout), or [k, n] with n contiguous (transposed,
// TRANS_B: gpt-oss stores [E, in, out]). A rows are gathered on the fly (first projection: A row = token
// of the sorted pair). Shared memory: STAGES of [BM | BN] x 64 tiles filled by cp.async
// (grouped_gemm_common.cuh); a transposed B tile is 64 rows of k by BN columns instead, read with
// ldmatrix.trans. Gated projections interleave virtual columns (2c: gate, 2c + 1: up of output column c),
// so a thread's accumulator pair is one gate/up pair; with transposed weights that needs the gate and up
// columns interleaved in memory too (gpt-oss), so that 8 virtual columns are 8 adjacent weight columns.
#include "backends/cuda/kernels/grouped_gemm_common.cuh"

namespace moekit::cuda::kernels {
namespace {

template <int BM_, int WARPS_M_>
struct MmaTile {
  static constexpr int BM = BM_, BN = kTileN, BK = kTileK, STAGES = 3;
  static constexpr int WARPS_M = WARPS_M_, WARPS_N = 4;
  static constexpr int kThreads = WARPS_M * WARPS_N * 32;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
  static constexpr int MF = WM / 16, NF = WN / 8;
  static constexpr int kStageElems = (BM + BN) * BK;
  static constexpr size_t kSmemBytes = size_t(STAGES) * kStageElems * 2;
  static_assert(MF >= 1 && NF % 2 == 0, "tile shape");
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Element offset of 16-byte chunk `chunk` of row `row` of a [64][BN] transposed B tile: the chunk index's
// low three bits are XORed with the row's, so the eight rows one ldmatrix reads hit distinct banks.
template <int BN>
__device__ __forceinline__ int swizzled_t(int row, int chunk) {
  return row * BN + ((chunk ^ (row & 7)) * 8);
}

// Copies the 64 x BN tile of transposed weights (k rows, n contiguous) of reduction step kt: virtual
// column v of block column bn is weight column bn * BN + v (plain, or gated with interleaved gate / up
// columns). Rows past k and columns past the weights' are zero-filled.
template <class T, int BN, int THREADS, int EPI>
struct TransposedBLoader {
  static constexpr int kChunksPerRow = BN / 8;
  static constexpr int kRowsPerPass = THREADS / kChunksPerRow;
  static constexpr int kIters = kTileK / kRowsPerPass;
  static_assert(THREADS % kChunksPerRow == 0 && kIters >= 1 && kTileK % kRowsPerPass == 0, "loader shape");

  const T* src;
  const T* base;
  bool col_ok;
  int chunk, row_base;
  int64_t k, stride_k;

  __device__ __forceinline__ TransposedBLoader(const GroupedGemmArgs& args, const RowTile& t, int bn, int tid) {
    chunk = tid % kChunksPerRow;
    row_base = tid / kChunksPerRow;
    k = args.k;
    stride_k = args.b_stride_k;
    base = static_cast<const T*>(args.b) + int64_t(t.expert) * args.b_expert_stride;
    const int64_t cols = EPI == kEpiGated ? 2 * args.n : args.n;
    const int64_t col = int64_t(bn) * BN + chunk * 8;
    col_ok = col < cols;
    src = base + (col_ok ? col : 0);
  }
  __device__ __forceinline__ void load(T* bs, int kt) const {
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int r = row_base + j * kRowsPerPass;
      const int64_t kk = int64_t(kt) * kTileK + r;
      const bool ok = col_ok && kk < k;
      cp_async16(smem_u32(bs + swizzled_t<BN>(r, chunk)), ok ? src + kk * stride_k : base, ok);
    }
  }
};

template <class T, int BM, int WARPS_M, int EPI, bool TRANS_B>
__global__ void __launch_bounds__(MmaTile<BM, WARPS_M>::kThreads) grouped_gemm_mma_kernel(GroupedGemmArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using C = MmaTile<BM, WARPS_M>;
  constexpr int BK = C::BK, STAGES = C::STAGES;
  extern __shared__ __align__(128) unsigned char mma_smem[];
  T* smem = reinterpret_cast<T*>(mma_smem);

  RowTile t;
  if (!row_tile(args, blockIdx.x, BM, t)) return;
  const int bn = blockIdx.y;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_m = warp / C::WARPS_N, warp_n = warp % C::WARPS_N;
  const int ktiles = int((args.k + BK - 1) / BK);
  const TileLoader<T, BM, C::BN, C::kThreads, EPI> loader(args, t, bn, tid);
  const TransposedBLoader<T, C::BN, C::kThreads, EPI> loader_t(args, t, bn, tid);
  auto load_stage = [&](int stage, int kt) {
    T* as = smem + stage * C::kStageElems;
    loader.load_a(as, kt);
    if constexpr (TRANS_B)
      loader_t.load(as + BM * BK, kt);
    else
      loader.load_b(as + BM * BK, kt);
  };

  float acc[C::MF][C::NF][4];
#pragma unroll
  for (int i = 0; i < C::MF; ++i)
#pragma unroll
    for (int j = 0; j < C::NF; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile kt landed for all threads; stage (kt - 1) % STAGES is free
    const int next = kt + STAGES - 1;
    if (next < ktiles) load_stage(next % STAGES, next);
    cp_async_commit();

    const T* as = smem + (kt % STAGES) * C::kStageElems;
    const T* bs = as + BM * BK;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t af[C::MF][4];
      uint32_t bf[C::NF][2];
#pragma unroll
      for (int i = 0; i < C::MF; ++i) {
        const int r = warp_m * C::WM + i * 16 + (lane & 15);
        ldmatrix_x4(af[i], smem_u32(as + swizzled(r, kk * 2 + (lane >> 4))));
      }
#pragma unroll
      for (int j = 0; j < C::NF / 2; ++j) {
        uint32_t q[4];
        if constexpr (TRANS_B) {
          // Matrix lane / 8: k half (bit 0) and n half (bit 1) of the 16 x 16 block, as below.
          const int mi = lane >> 3;
          const int krow = kk * 16 + (mi & 1) * 8 + (lane & 7);
          const int ncol = warp_n * C::WN + j * 16 + (mi >> 1) * 8;
          ldmatrix_x4_trans(q, smem_u32(bs + swizzled_t<C::BN>(krow, ncol / 8)));
        } else {
          const int r = warp_n * C::WN + j * 16 + (lane & 7) + ((lane >> 4) << 3);
          ldmatrix_x4(q, smem_u32(bs + swizzled(r, kk * 2 + ((lane >> 3) & 1))));
        }
        bf[2 * j][0] = q[0];
        bf[2 * j][1] = q[1];
        bf[2 * j + 1][0] = q[2];
        bf[2 * j + 1][1] = q[3];
      }
#pragma unroll
      for (int i = 0; i < C::MF; ++i)
#pragma unroll
        for (int j = 0; j < C::NF; ++j) mma_16816<T>(acc[i][j], af[i], bf[j][0], bf[j][1]);
    }
  }
  cp_async_wait<0>();

  // Epilogue. Accumulator q of fragment (i, j): row i*16 + lane/4 (+8 for q >= 2), virtual column
  // j*8 + (lane%4)*2 (+1 for odd q).
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(t.expert) * args.bias_expert_stride : nullptr;
#pragma unroll
  for (int i = 0; i < C::MF; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = t.m0 + warp_m * C::WM + i * 16 + (lane >> 2) + half * 8;
      if (row >= t.m_end) continue;
#pragma unroll
      for (int j = 0; j < C::NF; ++j)
        store_pair<T, EPI>(args, bias, bn, row, warp_n * C::WN + j * 8 + (lane & 3) * 2, acc[i][j][half * 2],
                           acc[i][j][half * 2 + 1]);
    }
  }
#endif
}

template <class T, int BM, int WARPS_M, int EPI>
cudaError_t launch_mma_epi(const GroupedGemmArgs& a, cudaStream_t stream) {
  using C = MmaTile<BM, WARPS_M>;
  auto kernel = a.b_stride_k == 1 ? grouped_gemm_mma_kernel<T, BM, WARPS_M, EPI, false>
                                  : grouped_gemm_mma_kernel<T, BM, WARPS_M, EPI, true>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::kSmemBytes));
  if (err != cudaSuccess) return err;
  const int64_t cols = EPI == kEpiGated ? C::BN / 2 : C::BN;
  const dim3 grid(unsigned(grouped_max_tiles(a.max_rows, a.experts, BM)), unsigned((a.n + cols - 1) / cols));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

template <class T, int BM, int WARPS_M>
cudaError_t launch_mma(const GroupedGemmArgs& a, cudaStream_t stream) {
  switch (a.epilogue) {
    case kEpiGated: return launch_mma_epi<T, BM, WARPS_M, kEpiGated>(a, stream);
    case kEpiActOnly: return launch_mma_epi<T, BM, WARPS_M, kEpiActOnly>(a, stream);
    case kEpiF32: return launch_mma_epi<T, BM, WARPS_M, kEpiF32>(a, stream);
  }
  return cudaErrorInvalidValue;
}

template <class T>
cudaError_t launch_mma_tile(const GroupedGemmArgs& a, int tile_m, cudaStream_t stream) {
  switch (tile_m) {
    case 16: return launch_mma<T, 16, 1>(a, stream);
    case 32: return launch_mma<T, 32, 1>(a, stream);
    case 64: return launch_mma<T, 64, 2>(a, stream);
    case 128: return launch_mma<T, 128, 2>(a, stream);
  }
  return cudaErrorInvalidValue;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int grouped_tile_m(int64_t max_rows, int experts) {
  const int64_t busy = max_rows < experts ? max_rows : experts;
  const int64_t avg = busy > 0 ? (max_rows + busy - 1) / busy : 1;
  // Each row tile streams its expert's weights once: leave headroom over the mean so that most experts
  // fit in one tile where the weights dominate.
  const int64_t want = avg + avg / 2;
  if (want <= 16) return 16;
  if (want <= 32) return 32;
  if (want <= 64) return 64;
  return 128;
}

bool grouped_gemm_mma_ok(const GroupedGemmArgs& a, int arch) {
  const bool k_major = a.b_stride_k == 1 && a.b_stride_n % 8 == 0;
  // Transposed weights: 16-byte chunks of 8 adjacent columns, and gate / up columns interleaved.
  const int64_t cols = a.epilogue == kEpiGated ? 2 * a.n : a.n;
  const bool n_major = a.b_stride_n == 1 && a.b_stride_k % 8 == 0 && cols % 8 == 0 &&
                       (a.epilogue != kEpiGated || (!a.gate.concatenated && a.inter == a.n));
  return arch >= 80 && (a.type == Elem::bf16 || a.type == Elem::f16) && (k_major || n_major) && a.k % 8 == 0 &&
         a.lda % 8 == 0 && a.b_expert_stride % 8 == 0 && aligned16(a.a) && aligned16(a.b) &&
         (a.n + 63) / 64 <= 65535 && grouped_max_tiles(a.max_rows, a.experts, 16) <= INT32_MAX;
}

cudaError_t grouped_gemm_mma(const GroupedGemmArgs& a, int tile_m, cudaStream_t stream) {
  if (a.max_rows == 0 || a.n == 0) return cudaSuccess;
  if (a.type == Elem::bf16) return launch_mma_tile<bf16>(a, tile_m, stream);
  if (a.type == Elem::f16) return launch_mma_tile<f16>(a, tile_m, stream);
  return cudaErrorInvalidValue;
}

cudaError_t grouped_gemm(const GroupedGemmArgs& a, int tile_m, int arch, bool wide, cudaStream_t stream) {
  if (a.epilogue == kEpiWeighted) return cudaErrorInvalidValue;  // the TMA kernel's alone
  if ((tile_m == 64 || tile_m == 128) && grouped_gemm_wgmma_ok(a, arch))
    return grouped_gemm_wgmma(a, tile_m, wide, stream);
  if (grouped_gemm_mma_ok(a, arch)) return grouped_gemm_mma(a, tile_m, stream);
  return grouped_gemm_simt(a, tile_m, stream);
}

}  // namespace moekit::cuda::kernels

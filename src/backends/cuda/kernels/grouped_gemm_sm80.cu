// Grouped projection over sorted rows on the tensor cores (mma.sync m16n8k16, sm_80 and newer), bf16
// and f16 with f32 accumulation. Each block computes one row tile of one expert (offsets read on the
// device: no host synchronisation) against 128 virtual columns of that expert's weights, read in place.
//
// Weights are [n, k] with k contiguous (the default, non-transposed layout). A rows are gathered on
// the fly (first projection: A row = token of the sorted pair). Shared memory: STAGES of [BM | BN] x
// BK tiles filled by cp.async (zero-filled past the edges), 16-byte chunks XOR-swizzled by row so that
// ldmatrix reads are free of bank conflicts. Gated projections interleave virtual columns (2c: gate,
// 2c + 1: up of output column c), so a thread's accumulator pair (c0, c1) is one gate/up pair.
#include <type_traits>

#include "backends/cuda/kernels/device_math.cuh"

namespace moekit::cuda::kernels {
namespace {

template <int BM_, int WARPS_M_>
struct MmaTile {
  static constexpr int BM = BM_, BN = 128, BK = 64, STAGES = 3;
  static constexpr int WARPS_M = WARPS_M_, WARPS_N = 4;
  static constexpr int kThreads = WARPS_M * WARPS_N * 32;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
  static constexpr int MF = WM / 16, NF = WN / 8;
  static constexpr int kChunks = BK / 8;  // 16-byte chunks per tile row
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kAIters = BM / kRowsPerPass, kBIters = BN / kRowsPerPass;
  static constexpr int kStageElems = (BM + BN) * BK;
  static constexpr size_t kSmemBytes = size_t(STAGES) * kStageElems * 2;
  static_assert(MF >= 1 && NF % 2 == 0 && kAIters >= 1 && kBIters >= 1, "tile shape");
  static_assert(BM % kRowsPerPass == 0 && BN % kRowsPerPass == 0, "loader shape");
};

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

// Element offset of 16-byte chunk `chunk` of tile row `row` (swizzled).
template <int BK>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * BK + ((chunk ^ (row & 7)) * 8);
}

template <class T, int BM, int WARPS_M, int EPI>
__global__ void __launch_bounds__(MmaTile<BM, WARPS_M>::kThreads) grouped_gemm_mma_kernel(GroupedGemmArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using C = MmaTile<BM, WARPS_M>;
  constexpr int BN = C::BN, BK = C::BK, STAGES = C::STAGES;
  extern __shared__ __align__(128) unsigned char mma_smem[];
  T* smem = reinterpret_cast<T*>(mma_smem);

  const int tile = blockIdx.x;
  if (tile >= __ldg(args.tile_offsets + args.experts)) return;
  const int e = tile_expert(args.tile_offsets, args.experts, tile);
  const int64_t m0 = __ldg(args.offsets + e) + int64_t(tile - __ldg(args.tile_offsets + e)) * BM;
  const int64_t m_end = __ldg(args.offsets + e + 1);
  const int bn = blockIdx.y;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_m = warp / C::WARPS_N, warp_n = warp % C::WARPS_N;
  const int64_t K = args.k;
  const int ktiles = int((K + BK - 1) / BK);

  // Loader: thread copies chunk `chunk` of rows tid / kChunks + j * kRowsPerPass.
  const int chunk = tid % C::kChunks, row_base = tid / C::kChunks;
  const T* a = static_cast<const T*>(args.a);
  const T* b = static_cast<const T*>(args.b) + int64_t(e) * args.b_expert_stride;
  const T* a_src[C::kAIters];
  bool a_ok[C::kAIters];
#pragma unroll
  for (int j = 0; j < C::kAIters; ++j) {
    const int64_t row = m0 + row_base + j * C::kRowsPerPass;
    a_ok[j] = row < m_end;
    const int64_t src = !a_ok[j] ? 0 : (args.a_rows ? int64_t(args.a_rows[row] / args.a_row_div) : row);
    a_src[j] = a + src * args.lda + chunk * 8;
  }
  const T* b_src[C::kBIters];
  bool b_ok[C::kBIters];
#pragma unroll
  for (int j = 0; j < C::kBIters; ++j) {
    const int v = row_base + j * C::kRowsPerPass;
    int64_t wr;
    if constexpr (EPI == kEpiGated) {
      const int64_t c = int64_t(bn) * (BN / 2) + v / 2;
      wr = c >= args.n ? -1 : ((v & 1) ? up_row(args.gate, c, args.inter) : gate_row(args.gate, c));
    } else {
      const int64_t n = int64_t(bn) * BN + v;
      wr = n < args.n ? n : -1;
    }
    b_ok[j] = wr >= 0;
    b_src[j] = b + (b_ok[j] ? wr * args.b_stride_n : 0) + chunk * 8;
  }

  auto load_stage = [&](int stage, int kt) {
    T* as = smem + stage * C::kStageElems;
    T* bs = as + BM * BK;
    const bool k_ok = int64_t(kt) * BK + chunk * 8 < K;
#pragma unroll
    for (int j = 0; j < C::kAIters; ++j) {
      const int r = row_base + j * C::kRowsPerPass;
      const bool ok = a_ok[j] && k_ok;
      cp_async16(smem_u32(as + swizzled<BK>(r, chunk)), ok ? a_src[j] + int64_t(kt) * BK : a, ok);
    }
#pragma unroll
    for (int j = 0; j < C::kBIters; ++j) {
      const int r = row_base + j * C::kRowsPerPass;
      const bool ok = b_ok[j] && k_ok;
      cp_async16(smem_u32(bs + swizzled<BK>(r, chunk)), ok ? b_src[j] + int64_t(kt) * BK : b, ok);
    }
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
        ldmatrix_x4(af[i], smem_u32(as + swizzled<BK>(r, kk * 2 + (lane >> 4))));
      }
#pragma unroll
      for (int j = 0; j < C::NF / 2; ++j) {
        const int r = warp_n * C::WN + j * 16 + (lane & 7) + ((lane >> 4) << 3);
        uint32_t q[4];
        ldmatrix_x4(q, smem_u32(bs + swizzled<BK>(r, kk * 2 + ((lane >> 3) & 1))));
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
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(e) * args.bias_expert_stride : nullptr;
#pragma unroll
  for (int i = 0; i < C::MF; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = m0 + warp_m * C::WM + i * 16 + (lane >> 2) + half * 8;
      if (row >= m_end) continue;
#pragma unroll
      for (int j = 0; j < C::NF; ++j) {
        const int v = warp_n * C::WN + j * 8 + (lane & 3) * 2;
        const float x0 = acc[i][j][half * 2], x1 = acc[i][j][half * 2 + 1];
        if constexpr (EPI == kEpiGated) {
          const int64_t c = int64_t(bn) * (BN / 2) + v / 2;
          if (c >= args.n) continue;
          float g = x0, u = x1;
          if (bias) {
            g += to_f32(bias[gate_row(args.gate, c)]);
            u += to_f32(bias[up_row(args.gate, c, args.inter)]);
          }
          static_cast<T*>(args.out)[row * args.ldo + c] = from_f32<T>(gate_value(args.gate, g, u));
        } else {
          const int64_t n = int64_t(bn) * BN + v;
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
    }
  }
#endif
}

template <class T, int BM, int WARPS_M, int EPI>
cudaError_t launch_mma_epi(const GroupedGemmArgs& a, cudaStream_t stream) {
  using C = MmaTile<BM, WARPS_M>;
  auto kernel = grouped_gemm_mma_kernel<T, BM, WARPS_M, EPI>;
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
  if (avg <= 16) return 16;
  if (avg <= 32) return 32;
  if (avg <= 96) return 64;
  return 128;
}

bool grouped_gemm_mma_ok(const GroupedGemmArgs& a, int arch) {
  return arch >= 80 && (a.type == Elem::bf16 || a.type == Elem::f16) && a.b_stride_k == 1 && a.k % 8 == 0 &&
         a.lda % 8 == 0 && a.b_stride_n % 8 == 0 && a.b_expert_stride % 8 == 0 && aligned16(a.a) &&
         aligned16(a.b) && (a.n + 63) / 64 <= 65535 && grouped_max_tiles(a.max_rows, a.experts, 16) <= INT32_MAX;
}

cudaError_t grouped_gemm_mma(const GroupedGemmArgs& a, int tile_m, cudaStream_t stream) {
  if (a.max_rows == 0 || a.n == 0) return cudaSuccess;
  if (a.type == Elem::bf16) return launch_mma_tile<bf16>(a, tile_m, stream);
  if (a.type == Elem::f16) return launch_mma_tile<f16>(a, tile_m, stream);
  return cudaErrorInvalidValue;
}

cudaError_t grouped_gemm(const GroupedGemmArgs& a, int tile_m, int arch, cudaStream_t stream) {
  return grouped_gemm_mma_ok(a, arch) ? grouped_gemm_mma(a, tile_m, stream) : grouped_gemm_simt(a, tile_m, stream);
}

}  // namespace moekit::cuda::kernels

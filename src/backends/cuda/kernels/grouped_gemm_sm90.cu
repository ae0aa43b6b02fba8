// Grouped projection over sorted rows with Hopper's warpgroup MMA (wgmma, sm_90a): row tiles of 64
// or 128 rows (one warpgroup of 128 threads per 64 rows) x 128 or 256 virtual columns, bf16/f16
// operands read from shared memory through matrix descriptors, f32 accumulators in registers. Same
// tiles (cp.async, 128-byte swizzle), row-tile scheduling and epilogue as the mma.sync kernel
// (grouped_gemm_common.cuh); the driver only picks it on compute capability 9.0 when this build
// carries sm_90a code for it. The wide tile (128 x 256, one block per multiprocessor, four stages)
// moves a quarter fewer bytes from L2 per FLOP than 128 x 128 but measured slower on the gated
// projection (see policy.h); it is kept behind a switch for tuning.

#include "backends/cuda/kernels/grouped_gemm_sm90.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "build compute capability 9.0 as sm_90a (CMAKE_CUDA_ARCHITECTURES 90a): the wgmma kernels need it"
#endif

namespace moekit::cuda::kernels {
namespace {
using namespace sm90;

template <int BM, int BN, int STAGES>
constexpr size_t wgmma_smem_bytes() {
  return size_t(STAGES) * (BM + BN) * kTileK * 2 + 1024;  // + alignment slack
}

template <class T, int BM, int BN, int STAGES, int EPI>
__global__ void __launch_bounds__(BM * 2, BN == 256 ? 1 : 2) grouped_gemm_wgmma_kernel(GroupedGemmArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kThreads = BM * 2, kStageElems = (BM + BN) * kTileK, kAcc = BN / 2;
  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  // Tiles 1024-byte aligned: the swizzle pattern comes from address bits 7-9.
  T* smem = reinterpret_cast<T*>(wgmma_smem + ((1024 - (smem_u32(wgmma_smem) & 1023)) & 1023));

  RowTile t;
  if (!row_tile(args, blockIdx.x, BM, t)) return;
  const int bn = blockIdx.y;
  const int tid = threadIdx.x, lane = tid % 32, wg = tid / 128, warp_in_wg = (tid % 128) / 32;
  const bool wg_has_rows = t.m0 + wg * 64 < t.m_end;  // a partial tile's idle warpgroup only loads
  const int ktiles = int((args.k + kTileK - 1) / kTileK);
  const TileLoader<T, BM, BN, kThreads, EPI> loader(args, t, bn, tid);
  auto load_stage = [&](int stage, int kt) {
    T* as = smem + stage * kStageElems;
    loader.load(as, as + BM * kTileK, kt);
  };

  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async data -> tensor cores
    __syncthreads();  // tile kt landed for all threads; stage (kt - 1) % STAGES is no longer read
    const int next = kt + STAGES - 1;
    if (next < ktiles) load_stage(next % STAGES, next);
    cp_async_commit();

    if (wg_has_rows) {
      const T* as = smem + (kt % STAGES) * kStageElems;
      const uint64_t desc_a = smem_desc(smem_u32(as) + wg * 64 * kTileK * 2);
      const uint64_t desc_b = smem_desc(smem_u32(as + BM * kTileK));
      fence_operands(acc);
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk)  // 16 elements = 32 bytes = 2 in the address field
        wgmma_k16<T, BN>(acc, desc_a + 2 * kk, desc_b + 2 * kk);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      fence_operands(acc);
    }
  }
  cp_async_wait<0>();
  if (!wg_has_rows) return;

  // Accumulator 4j + q: row 16 * warp + lane / 4 (+8 for q >= 2), virtual column 8j + (lane % 4) * 2
  // (+1 for odd q).
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(t.expert) * args.bias_expert_stride : nullptr;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = t.m0 + wg * 64 + warp_in_wg * 16 + (lane >> 2) + half * 8;
    if (row >= t.m_end) continue;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
      store_pair<T, EPI, BN>(args, bias, bn, row, j * 8 + (lane & 3) * 2, acc[4 * j + 2 * half],
                             acc[4 * j + 2 * half + 1]);
  }
#endif
}

template <class T, int BM, int BN, int STAGES, int EPI>
cudaError_t launch_wgmma_epi(const GroupedGemmArgs& a, cudaStream_t stream) {
  auto kernel = grouped_gemm_wgmma_kernel<T, BM, BN, STAGES, EPI>;
  constexpr size_t smem = wgmma_smem_bytes<BM, BN, STAGES>();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  const int64_t cols = EPI == kEpiGated ? BN / 2 : BN;
  const dim3 grid(unsigned(grouped_max_tiles(a.max_rows, a.experts, BM)), unsigned((a.n + cols - 1) / cols));
  kernel<<<grid, BM * 2, smem, stream>>>(a);
  return cudaGetLastError();
}

template <class T, int BM, int BN, int STAGES>
cudaError_t launch_wgmma(const GroupedGemmArgs& a, cudaStream_t stream) {
  switch (a.epilogue) {
    case kEpiGated: return launch_wgmma_epi<T, BM, BN, STAGES, kEpiGated>(a, stream);
    case kEpiActOnly: return launch_wgmma_epi<T, BM, BN, STAGES, kEpiActOnly>(a, stream);
    case kEpiF32: return launch_wgmma_epi<T, BM, BN, STAGES, kEpiF32>(a, stream);
  }
  return cudaErrorInvalidValue;
}

template <class T>
cudaError_t launch_wgmma_tile(const GroupedGemmArgs& a, int tile_m, bool wide, cudaStream_t stream) {
  if (tile_m == 64) return launch_wgmma<T, 64, 128, 3>(a, stream);
  if (tile_m == 128) return wide ? launch_wgmma<T, 128, 256, 4>(a, stream) : launch_wgmma<T, 128, 128, 3>(a, stream);
  return cudaErrorInvalidValue;
}

// Whether the loaded module carries this build's sm_90a code for the device (not PTX of an older
// target compiled at load time): read once per device from the kernel's attributes.
bool wgmma_compiled_for(int arch) {
  if (arch != 90) return false;
  static PerDeviceValue known;  // 1 yes, 0 no
  return known.get(
             [](int) {
               cudaFuncAttributes attr{};
               const bool ok =
                   cudaFuncGetAttributes(&attr, grouped_gemm_wgmma_kernel<bf16, 128, 128, 3, kEpiF32>) == cudaSuccess &&
                   attr.binaryVersion == 90 && attr.ptxVersion >= 90;
               (void)cudaGetLastError();
               return ok ? 1 : 0;
             },
             0) == 1;
}

}  // namespace

bool grouped_gemm_wgmma_ok(const GroupedGemmArgs& a, int arch) {
  return grouped_gemm_mma_ok(a, arch) && a.b_stride_k == 1 && wgmma_compiled_for(arch);  // K-major weights only
}

cudaError_t grouped_gemm_wgmma(const GroupedGemmArgs& a, int tile_m, bool wide, cudaStream_t stream) {
  if (a.max_rows == 0 || a.n == 0) return cudaSuccess;
  if (a.type == Elem::bf16) return launch_wgmma_tile<bf16>(a, tile_m, wide, stream);
  if (a.type == Elem::f16) return launch_wgmma_tile<f16>(a, tile_m, wide, stream);
  return cudaErrorInvalidValue;
}

}  // namespace moekit::cuda::kernels

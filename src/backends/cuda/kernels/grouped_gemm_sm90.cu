// Grouped projection over sorted rows with Hopper's warpgroup MMA (wgmma, sm_90a): row tiles of 64
// or 128 rows (one warpgroup of 128 threads per 64 rows) x 128 or 256 virtual columns, bf16/f16
// operands read from shared memory through matrix descriptors, f32 accumulators in registers. Same
// tiles (cp.async, 128-byte swizzle), row-tile scheduling and epilogue as the mma.sync kernel
// (grouped_gemm_common.cuh); the driver only picks it on compute capability 9.0 when this build
// carries sm_90a code for it. The wide tile (128 x 256, one block per multiprocessor, four stages)
// moves a quarter fewer bytes from L2 per FLOP than 128 x 128 but measured slower on the gated
// projection (see policy.h); it is kept behind a switch for tuning.
#include <atomic>

#include "backends/cuda/kernels/grouped_gemm_common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "build compute capability 9.0 as sm_90a (CMAKE_CUDA_ARCHITECTURES 90a): the wgmma kernels need it"
#endif

namespace moekit::cuda::kernels {
namespace {

template <int BM, int BN, int STAGES>
constexpr size_t wgmma_smem_bytes() {
  return size_t(STAGES) * (BM + BN) * kTileK * 2 + 1024;  // + alignment slack
}

// Shared-memory matrix descriptor: K-major tile of 128-byte rows, 128-byte swizzle, 8-row groups
// 1024 bytes apart.
[[maybe_unused]] __device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d[64 x 128 per warpgroup] += A[64 x 16] . B[128 x 16]^T
template <class T>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(1));
  }
#endif
}

// d[64 x 256 per warpgroup] += A[64 x 16] . B[256 x 16]^T
template <class T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(1));
  }
#endif
}

template <class T, int BN>
__device__ __forceinline__ void wgmma_k16(float (&d)[BN / 2], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (BN == 128) wgmma_m64n128k16<T>(d, desc_a, desc_b);
  else wgmma_m64n256k16<T>(d, desc_a, desc_b);
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
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  static std::atomic<int> known[64];  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= 64) return false;
  int v = known[device].load();
  if (v == 0) {
    cudaFuncAttributes attr{};
    const bool ok =
        cudaFuncGetAttributes(&attr, grouped_gemm_wgmma_kernel<bf16, 128, 128, 3, kEpiF32>) == cudaSuccess &&
        attr.binaryVersion == 90 && attr.ptxVersion >= 90;
    (void)cudaGetLastError();
    v = ok ? 1 : 2;
    known[device].store(v);
  }
  return v == 1;
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

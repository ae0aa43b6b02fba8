// batched_mm's projections: one small GEMV per (token, slot) pair, reading the expert's weight rows in
// place (no copy of the weights). Memory-bound: each warp streams kColsPerWarp output columns (two
// weight rows each when gated) with 16-byte loads, several rows in flight, and reduces with shuffles.
#include "backends/cuda/kernels/device_math.cuh"

namespace moekit::cuda::kernels {
namespace {

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kColsPerWarp = 4;
constexpr int kColsPerBlock = kGemvWarps * kColsPerWarp;
constexpr size_t kGemvMaxSmem = 48 * 1024;

// VEC elements of T starting at p (16-byte aligned when VEC > 1) as floats.
template <class T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[VEC]) {
  if constexpr (VEC == 1) {
    v[0] = to_f32(p[0]);
  } else {
    static_assert(VEC * sizeof(T) == 16, "16-byte vectors");
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = to_f32(e[i]);
  }
}

template <class T, int VEC, int EPI>
__global__ void __launch_bounds__(kGemvThreads) pair_gemv_kernel(PairGemvArgs args) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  T* a_s = reinterpret_cast<T*>(gemv_smem);  // [k]
  const int64_t p = blockIdx.x;
  const int e = args.pair_expert[p];
  if (e >= args.experts) return;  // sentinel or bad id: the row is never read
  const int64_t k = args.k;
  const T* a_row = static_cast<const T*>(args.a) + (p / args.a_row_div) * args.lda;
  if constexpr (VEC > 1) {
    for (int64_t i = threadIdx.x; i < k / VEC; i += kGemvThreads)
      reinterpret_cast<uint4*>(a_s)[i] = reinterpret_cast<const uint4*>(a_row)[i];
  } else {
    for (int64_t i = threadIdx.x; i < k; i += kGemvThreads) a_s[i] = a_row[i];
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t col0 = (int64_t(blockIdx.y) * kGemvWarps + warp) * kColsPerWarp;
  if (col0 >= args.n) return;
  constexpr int kRows = EPI == kEpiGated ? 2 * kColsPerWarp : kColsPerWarp;
  const T* w_expert = static_cast<const T*>(args.b) + int64_t(e) * args.b_expert_stride;
  const T* rows[kRows];
  int64_t row_index[kRows];
#pragma unroll
  for (int j = 0; j < kColsPerWarp; ++j) {
    const int64_t c = min(col0 + j, args.n - 1);  // columns past n recompute the last one, never stored
    if constexpr (EPI == kEpiGated) {
      row_index[2 * j] = gate_row(args.gate, c);
      row_index[2 * j + 1] = up_row(args.gate, c, args.inter);
    } else {
      row_index[j] = c;
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) rows[r] = w_expert + row_index[r] * k;

  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
  for (int64_t i = int64_t(lane) * VEC; i < k; i += 32 * VEC) {
    float av[VEC];
    load_vec<T, VEC>(a_s + i, av);
    float wv[kRows][VEC];
#pragma unroll
    for (int r = 0; r < kRows; ++r) load_vec<T, VEC>(rows[r] + i, wv[r]);  // all loads before the math
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[r] = fmaf(av[v], wv[r][v], acc[r]);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int d = 16; d > 0; d /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], d);

  if (lane >= kColsPerWarp) return;
  const int64_t c = col0 + lane;
  if (c >= args.n) return;
  float val[kRows];  // pick this lane's column from the unrolled accumulators
#pragma unroll
  for (int r = 0; r < kRows; ++r) val[r] = acc[r];
  float first = 0.0f, second = 0.0f;
#pragma unroll
  for (int j = 0; j < kColsPerWarp; ++j) {
    if (j == lane) {
      if constexpr (EPI == kEpiGated) {
        first = val[2 * j];
        second = val[2 * j + 1];
      } else {
        first = val[j];
      }
    }
  }
  const T* bias = args.bias ? static_cast<const T*>(args.bias) + int64_t(e) * args.bias_expert_stride : nullptr;
  if constexpr (EPI == kEpiGated) {
    const int64_t gr = gate_row(args.gate, c), ur = up_row(args.gate, c, args.inter);
    if (bias) {
      first += to_f32(bias[gr]);
      second += to_f32(bias[ur]);
    }
    static_cast<T*>(args.out)[p * args.ldo + c] = from_f32<T>(gate_value(args.gate, first, second));
  } else if constexpr (EPI == kEpiActOnly) {
    if (bias) first += to_f32(bias[c]);
    static_cast<T*>(args.out)[p * args.ldo + c] = from_f32<T>(activate(args.gate.activation, first));
  } else {
    static_cast<float*>(args.out)[p * args.ldo + c] = first;
  }
}

template <class T, int VEC>
cudaError_t launch_gemv(const PairGemvArgs& a, cudaStream_t stream) {
  const dim3 grid(unsigned(a.pairs), unsigned((a.n + kColsPerBlock - 1) / kColsPerBlock));
  const size_t smem = size_t(a.k) * sizeof(T);
  switch (a.epilogue) {
    case kEpiGated: pair_gemv_kernel<T, VEC, kEpiGated><<<grid, kGemvThreads, smem, stream>>>(a); break;
    case kEpiActOnly: pair_gemv_kernel<T, VEC, kEpiActOnly><<<grid, kGemvThreads, smem, stream>>>(a); break;
    case kEpiF32: pair_gemv_kernel<T, VEC, kEpiF32><<<grid, kGemvThreads, smem, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

bool pair_gemv_ok(Elem type, int64_t k) { return k > 0 && size_t(k) * elem_bytes(type) <= kGemvMaxSmem; }

cudaError_t pair_gemv(const PairGemvArgs& a, cudaStream_t stream) {
  if (a.pairs == 0 || a.n == 0) return cudaSuccess;
  if (!pair_gemv_ok(a.type, a.k) || (a.n + kColsPerBlock - 1) / kColsPerBlock > 65535) return cudaErrorInvalidValue;
  const int64_t vec = 16 / elem_bytes(a.type);
  const bool aligned = a.k % vec == 0 && a.lda % vec == 0 && a.b_expert_stride % vec == 0 &&
                       reinterpret_cast<uintptr_t>(a.a) % 16 == 0 && reinterpret_cast<uintptr_t>(a.b) % 16 == 0;
  return with_elem(a.type, [&](auto tag) {
    using T = decltype(tag);
    return aligned ? launch_gemv<T, 16 / sizeof(T)>(a, stream) : launch_gemv<T, 1>(a, stream);
  });
}

}  // namespace moekit::cuda::kernels

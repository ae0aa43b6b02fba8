// Gather of routed rows, the gate over a f32 first projection (eager), and the weighted combine.
#include "backends/cuda/kernels/device_math.cuh"
#include "base/cuda_pdl.cuh"

namespace moekit::cuda::kernels {
namespace {

template <class T>
__global__ void gather_rows_kernel(const T* x, int64_t hidden, const int32_t* sorted_pair, int top_k,
                                   const int32_t* valid_rows, T* xs, bool vec16) {
  const int64_t r = blockIdx.x;
  if (r >= *valid_rows) return;
  const T* src = x + int64_t(sorted_pair[r] / top_k) * hidden;
  T* dst = xs + r * hidden;
  if (vec16) {
    constexpr int kVec = 16 / sizeof(T);
    const int64_t nv = hidden / kVec;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
  }
}

template <class T>
__global__ void gate_rows_kernel(const float* h1, int64_t n1, const T* bias, const int32_t* sorted_pair,
                                 const int32_t* pair_expert, const int32_t* valid_rows, int64_t inter,
                                 GateParams gate, T* act) {
  const int64_t r = blockIdx.x;
  if (r >= *valid_rows) return;
  const int e = pair_expert[sorted_pair[r]];
  const float* row = h1 + r * n1;
  const T* b = bias ? bias + int64_t(e) * n1 : nullptr;
  for (int64_t c = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; c < inter; c += int64_t(gridDim.y) * blockDim.x) {
    float v;
    if (gate.kind == kGateActOnly) {
      v = activate(gate.activation, row[c] + (b ? to_f32(b[c]) : 0.0f));
    } else {
      const int64_t gr = gate_row(gate, c), ur = up_row(gate, c, inter);
      v = gate_value(gate, row[gr] + (b ? to_f32(b[gr]) : 0.0f), row[ur] + (b ? to_f32(b[ur]) : 0.0f));
    }
    act[r * inter + c] = from_f32<T>(v);
  }
}

constexpr int kCombineThreads = 256;
constexpr int kCombinePerThread = 4;

template <class T, class W>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const float* y, const int32_t* pair_row, const int32_t* pair_expert, const W* weights,
                   const T* bias2, int top_k, int64_t hidden, int experts, T* out) {
  pdl_wait();  // launched with PDL: the second projection's rows come before
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const int64_t h0 = blockIdx.y * int64_t(kCombineThreads * kCombinePerThread) + threadIdx.x;
  float acc[kCombinePerThread];
#pragma unroll
  for (int j = 0; j < kCombinePerThread; ++j) acc[j] = 0.0f;
  for (int k = 0; k < top_k; ++k) {  // slot order: deterministic
    const int64_t p = t * top_k + k;
    const int e = pair_expert[p];
    if (e >= experts) continue;  // sentinel or bad id: exactly zero contribution
    const float w = to_f32(weights[p]);
    const float* yr = y + int64_t(pair_row ? pair_row[p] : p) * hidden;
    const T* br = bias2 ? bias2 + int64_t(e) * hidden : nullptr;
#pragma unroll
    for (int j = 0; j < kCombinePerThread; ++j) {
      const int64_t h = h0 + j * kCombineThreads;
      if (h < hidden) acc[j] += w * (yr[h] + (br ? to_f32(br[h]) : 0.0f));
    }
  }
#pragma unroll
  for (int j = 0; j < kCombinePerThread; ++j) {
    const int64_t h = h0 + j * kCombineThreads;
    if (h < hidden) out[t * hidden + h] = from_f32<T>(acc[j]);
  }
}

template <class T, class W>
cudaError_t combine_typed(const float* y, const int32_t* pair_row, const int32_t* pair_expert, const void* weights,
                          const void* bias2, int64_t tokens, int top_k, int64_t hidden, int experts, void* out,
                          cudaStream_t stream) {
  const dim3 grid(unsigned(tokens), unsigned((hidden + kCombineThreads * kCombinePerThread - 1) /
                                             (kCombineThreads * kCombinePerThread)));
  return launch_pdl(pdl_enabled(), combine_kernel<T, W>, grid, dim3(kCombineThreads), 0, stream, y, pair_row,
                    pair_expert, static_cast<const W*>(weights), static_cast<const T*>(bias2), top_k, hidden, experts,
                    static_cast<T*>(out));
}

// One thread per 8 columns (16-byte pieces when `vec`) of one token: the K weighted rows of the token summed
// in f32 in slot order, rounded once.
// 8 columns of a 16-bit row (fewer where `left` < 8, the rest zero) as floats; STREAM: read once (evict first),
// otherwise through the read-only cache (bias rows, read by every token).
template <bool STREAM, class T>
__device__ __forceinline__ void load_piece(const T* row, float (&v)[8], int64_t left, bool vec) {
  if (vec) {
    alignas(16) T r[8];
    const uint4* q = reinterpret_cast<const uint4*>(row);
    *reinterpret_cast<uint4*>(r) = STREAM ? __ldcs(q) : __ldg(q);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_f32(r[j]);
  } else {
    for (int j = 0; j < 8; ++j) v[j] = j < left ? to_f32(row[j]) : 0.0f;
  }
}
// acc rounded to T into the 8 columns at o (fewer where `left` < 8).
template <class T>
__device__ __forceinline__ void store_piece(T* o, const float (&acc)[8], int64_t left, bool vec) {
  if (vec) {
    alignas(16) T v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = from_f32<T>(acc[j]);
    *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(v);
  } else {
    for (int j = 0; j < 8 && j < left; ++j) o[j] = from_f32<T>(acc[j]);
  }
}

constexpr int kSumThreads = 256;
template <class T>
__global__ void __launch_bounds__(kSumThreads)
    sum_slots_kernel(const T* yw, const int32_t* pair_row, const int32_t* pair_expert, int top_k, int64_t hidden,
                     int experts, T* out, bool vec) {
  const int64_t t = blockIdx.x;
  const int64_t h0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (h0 >= hidden) return;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  for (int k = 0; k < top_k; ++k) {  // slot order: deterministic
    const int64_t p = t * top_k + k;
    if (pair_expert[p] >= experts) continue;  // sentinel or bad id: exactly zero contribution
    float v[8];
    load_piece<true>(yw + int64_t(pair_row ? pair_row[p] : p) * hidden + h0, v, hidden - h0, vec);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += v[j];
  }
  store_piece(out + t * hidden + h0, acc, hidden - h0, vec);
}

// combine over 16-bit rows: one thread per 8 columns (16-byte pieces when `vec`) of one token, the K slots'
// w * (y + bias) summed in f32 in slot order and rounded once (combine_kernel's arithmetic on rounded rows). The
// slots are read S at a time, every row piece of a batch loaded before the first is summed: one memory round trip per
// batch rather than per slot (a token's K rows are independent reads; at decode sizes the chain of K dependent loads
// was the kernel's time). S is sized to K (2, 4 or 8): a batch wider than K holds registers for nothing (eight
// slots' 56 registers halved the occupancy at K = 2: mixtral-8x7b T = 4096's combine 29.9 -> 37.0 us alone).
// Launched with PDL behind the second projection.
template <class T, class W, int S>
__global__ void __launch_bounds__(kSumThreads)
    combine_rows16_kernel(const T* y, const int32_t* pair_row, const int32_t* pair_expert, const W* weights,
                          const T* bias2, int top_k, int64_t hidden, int experts, T* out, bool vec) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const int64_t h0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (h0 >= hidden) return;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  if (vec) {
    for (int k0 = 0; k0 < top_k; k0 += S) {
      int e[S];
      uint4 raw[S];
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const int64_t p = t * top_k + k0 + s;
        e[s] = k0 + s < top_k ? pair_expert[p] : experts;
        raw[s] = make_uint4(0, 0, 0, 0);
        if (e[s] < experts)  // sentinel or bad id: exactly zero contribution
          raw[s] = __ldcs(reinterpret_cast<const uint4*>(y + int64_t(pair_row ? pair_row[p] : p) * hidden + h0));
      }
#pragma unroll
      for (int s = 0; s < S; ++s) {  // slot order: deterministic
        if (e[s] >= experts) continue;
        const float w = to_f32(weights[t * top_k + k0 + s]);
        const T* r = reinterpret_cast<const T*>(&raw[s]);
        float b[8] = {};
        if (bias2) load_piece<false>(bias2 + int64_t(e[s]) * hidden + h0, b, 8, true);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += w * (to_f32(r[j]) + b[j]);
      }
    }
  } else {
    for (int k = 0; k < top_k; ++k) {  // slot order: deterministic
      const int64_t p = t * top_k + k;
      const int e = pair_expert[p];
      if (e >= experts) continue;  // sentinel or bad id: exactly zero contribution
      const float w = to_f32(weights[p]);
      float v[8], b[8] = {};
      load_piece<true>(y + int64_t(pair_row ? pair_row[p] : p) * hidden + h0, v, hidden - h0, false);
      if (bias2) load_piece<false>(bias2 + int64_t(e) * hidden + h0, b, hidden - h0, false);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += w * (v[j] + b[j]);
    }
  }
  store_piece(out + t * hidden + h0, acc, hidden - h0, vec);
}

}  // namespace

cudaError_t combine_rows16(Elem type, Elem weight_type, const void* y, const int32_t* pair_row,
                           const int32_t* pair_expert, const void* weights, const void* bias2, int64_t tokens,
                           int top_k, int64_t hidden, int experts, void* out, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return cudaSuccess;
  if (type == Elem::f32) return cudaErrorInvalidValue;  // 16-bit rows only
  const bool vec = hidden % 8 == 0 && (reinterpret_cast<uintptr_t>(y) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(out) & 15) == 0 && (reinterpret_cast<uintptr_t>(bias2) & 15) == 0;
  const int64_t pieces = (hidden + 7) / 8;
  const int threads = int(pieces >= kSumThreads ? kSumThreads : (pieces + 31) / 32 * 32);
  const dim3 grid(unsigned(tokens), unsigned((pieces + threads - 1) / threads));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    return with_elem(weight_type, [&](auto wtag) {
      using W = decltype(wtag);
      auto run = [&](auto kernel) {
        return launch_pdl(pdl_enabled(), kernel, grid, dim3(threads), 0, stream, static_cast<const T*>(y), pair_row,
                          pair_expert, static_cast<const W*>(weights), static_cast<const T*>(bias2), top_k, hidden,
                          experts, static_cast<T*>(out), vec);
      };
      if (top_k <= 2) return run(combine_rows16_kernel<T, W, 2>);
      if (top_k <= 4) return run(combine_rows16_kernel<T, W, 4>);
      return run(combine_rows16_kernel<T, W, 8>);
    });
  };
  return type == Elem::bf16 ? launch(bf16{}) : launch(f16{});
}

cudaError_t sum_slots(Elem type, const void* yw, const int32_t* pair_row, const int32_t* pair_expert,
                      int64_t tokens, int top_k, int64_t hidden, int experts, void* out, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return cudaSuccess;
  if (type == Elem::f32) return cudaErrorInvalidValue;  // 16-bit rows only
  const bool vec = hidden % 8 == 0 && (reinterpret_cast<uintptr_t>(yw) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  const int64_t pieces = (hidden + 7) / 8;
  const int threads = int(pieces >= kSumThreads ? kSumThreads : (pieces + 31) / 32 * 32);
  const dim3 grid(unsigned(tokens), unsigned((pieces + threads - 1) / threads));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    sum_slots_kernel<T><<<grid, threads, 0, stream>>>(static_cast<const T*>(yw), pair_row, pair_expert, top_k,
                                                          hidden, experts, static_cast<T*>(out), vec);
    return cudaGetLastError();
  };
  return type == Elem::bf16 ? launch(bf16{}) : launch(f16{});
}

cudaError_t gather_rows(Elem type, const void* x, int64_t hidden, const int32_t* sorted_pair, int top_k,
                        const int32_t* valid_rows, int64_t max_rows, void* xs, cudaStream_t stream) {
  if (max_rows == 0) return cudaSuccess;
  const bool vec16 = (hidden * elem_bytes(type)) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(xs) % 16 == 0;
  return with_elem(type, [&](auto tag) {
    using T = decltype(tag);
    gather_rows_kernel<T><<<unsigned(max_rows), 128, 0, stream>>>(static_cast<const T*>(x), hidden, sorted_pair,
                                                                  top_k, valid_rows, static_cast<T*>(xs), vec16);
    return cudaGetLastError();
  });
}

cudaError_t gate_rows(Elem type, const float* h1, int64_t n1, const void* bias, const int32_t* sorted_pair,
                      const int32_t* pair_expert, const int32_t* valid_rows, int64_t max_rows, int64_t inter,
                      const GateParams& gate, void* act, cudaStream_t stream) {
  if (max_rows == 0) return cudaSuccess;
  const dim3 grid(unsigned(max_rows), unsigned((inter + 255) / 256 < 8 ? (inter + 255) / 256 : 8));
  return with_elem(type, [&](auto tag) {
    using T = decltype(tag);
    gate_rows_kernel<T><<<grid, 256, 0, stream>>>(h1, n1, static_cast<const T*>(bias), sorted_pair, pair_expert,
                                                  valid_rows, inter, gate, static_cast<T*>(act));
    return cudaGetLastError();
  });
}

cudaError_t combine(Elem type, Elem weight_type, const float* y, const int32_t* pair_row, const int32_t* pair_expert,
                    const void* weights, const void* bias2, int64_t tokens, int top_k, int64_t hidden, int experts,
                    void* out, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return cudaSuccess;
  return with_elem(type, [&](auto tag) {
    using T = decltype(tag);
    return with_elem(weight_type, [&](auto wtag) {
      using W = decltype(wtag);
      return combine_typed<T, W>(y, pair_row, pair_expert, weights, bias2, tokens, top_k, hidden, experts, out,
                                 stream);
    });
  });
}

}  // namespace moekit::cuda::kernels

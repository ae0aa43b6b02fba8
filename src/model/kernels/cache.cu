// KV-cache writes of the model: rows copied at a position read on the device, and MLA's expansion of the
// compressed projection into key and value rows.
#include "model/kernels/layer_device.cuh"

namespace moekit::model::kernels {
namespace {

// Rows [row0, row0 + n) of dst = src, in 16-, 4- or 1-byte words (`Word`), row0 read on the device.
template <class Word>
__global__ void write_rows_kernel(const Word* src, Word* dst, int64_t words, int64_t row_words, int64_t row0_value,
                                  const int64_t* row0_device) {
  Word* d = dst + position(row0_value, row0_device) * row_words;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words; i += int64_t(gridDim.x) * blockDim.x)
    d[i] = src[i];
}

// One block per (token, head): k = [k_nope | k_rot], v, written at cache rows row0 + token.
__global__ void mla_expand_kernel(const void* kvb, const void* k_rot, int64_t ld_rot, int in_t, void* k, void* v,
                                  int out_t, int64_t H, int64_t nope, int64_t rope, int64_t dv, int64_t row0_value,
                                  const int64_t* row0_device) {
  const int64_t t = blockIdx.x / H, h = blockIdx.x % H;
  const int64_t row = position(row0_value, row0_device) + t;
  const int64_t dk = nope + rope;
  const int64_t src = (t * H + h) * (nope + dv);
  const int64_t kd = (row * H + h) * dk, vd = (row * H + h) * dv;
  for (int64_t i = threadIdx.x; i < nope; i += blockDim.x) st(k, out_t, kd + i, ld(kvb, in_t, src + i));
  for (int64_t i = threadIdx.x; i < rope; i += blockDim.x) st(k, out_t, kd + nope + i, ld(k_rot, in_t, t * ld_rot + i));
  for (int64_t i = threadIdx.x; i < dv; i += blockDim.x) st(v, out_t, vd + i, ld(kvb, in_t, src + nope + i));
}

}  // namespace

cudaError_t write_rows(const void* src, void* dst, int64_t bytes, int64_t row_bytes, int64_t row0_value,
                       const int64_t* row0_device, cudaStream_t s) {
  const auto aligned = [&](int64_t a) {
    return row_bytes % a == 0 && reinterpret_cast<uintptr_t>(src) % a == 0 && reinterpret_cast<uintptr_t>(dst) % a == 0;
  };
  if (aligned(16))
    write_rows_kernel<<<blocks_for(bytes / 16), 256, 0, s>>>(static_cast<const int4*>(src), static_cast<int4*>(dst),
                                                             bytes / 16, row_bytes / 16, row0_value, row0_device);
  else if (aligned(4))
    write_rows_kernel<<<blocks_for(bytes / 4), 256, 0, s>>>(static_cast<const int32_t*>(src),
                                                            static_cast<int32_t*>(dst), bytes / 4, row_bytes / 4,
                                                            row0_value, row0_device);
  else
    write_rows_kernel<<<blocks_for(bytes), 256, 0, s>>>(static_cast<const char*>(src), static_cast<char*>(dst), bytes,
                                                        row_bytes, row0_value, row0_device);
  return cudaGetLastError();
}

cudaError_t mla_expand(const void* kvb, const void* k_rot, int64_t ld_rot, int in_t, void* k, void* v, int out_t,
                       int64_t T, int64_t H, int64_t nope, int64_t rope, int64_t dv, int64_t row0_value,
                       const int64_t* row0_device, cudaStream_t s) {
  mla_expand_kernel<<<unsigned(T * H), 64, 0, s>>>(kvb, k_rot, ld_rot, in_t, k, v, out_t, H, nope, rope, dv, row0_value,
                                                   row0_device);
  return cudaGetLastError();
}

}  // namespace moekit::model::kernels

// Moving quantized FP8 activation rows (grouped_gemm_fp8.cu): the token rows' e4m3 codes and scales into the sorted
// order of the pairs the grouped kernels read.
#pragma once

#include "backends/cuda/kernels/kernels.h"

namespace moekit::cuda::kernels {

// Row r < min(rows, *valid_rows) of q / scale is token row sorted_pair[r] / top_k of q_tok / scale_tok: ldq bytes of
// codes (a multiple of 16, both 16-byte aligned) and lds f32 scales per row. One launch for both.
cudaError_t gather_fp8_rows(const uint8_t* q_tok, const float* scale_tok, int64_t ldq, int64_t lds,
                            const int32_t* sorted_pair, int top_k, const int32_t* valid_rows, int64_t rows, uint8_t* q,
                            float* scale, cudaStream_t stream);

}  // namespace moekit::cuda::kernels

// Internal: the device side of expert parallelism: id remapping, row gathers, the fixed-order combine and
// copies, on the CPU or on a CUDA device (ep_cuda.cu). Sizes in elements unless named bytes.
#pragma once
#include <cstdint>

#include "moekit/tensor.h"

namespace moekit::ep {

// out[i] = id - start when start <= id < end, else `sentinel` (the local E), for n ids (i32 or i64) of rows of
// K. Bad ids (< 0 or > E) are an error on the CPU (naming the slot and value); on a GPU they stay out of the
// local range (negative, or above the sentinel), so that the local experts' own device check reports them.
void remap_ids(Device d, const void* ids, DType id_dtype, int64_t n, int64_t K, int64_t start, int64_t end, int64_t E,
               int32_t sentinel, int32_t* out, Stream stream);
// dst row i (pitch dst_pitch bytes) = src row rows[i] (pitch src_pitch bytes), row_bytes bytes each.
void gather_rows(Device d, const void* src, int64_t src_pitch, const int32_t* rows, int64_t n, int64_t row_bytes,
                 void* dst, int64_t dst_pitch, Stream stream);
// out[t] = sum over r = 0..N-1 of rows[map[t * N + r]] (skipped when map < 0), in f32 in that order, rounded
// once to `dtype` (f32 | bf16 | f16); [T, H] rows.
void combine_rows(Device d, const void* rows, DType dtype, int64_t H, const int32_t* map, int64_t T, int N, void* out,
                  Stream stream);
// bytes between host and device memory (or within one); `to_host` copies wait for the stream.
void copy(Device d, void* dst, const void* src, int64_t bytes, Stream stream);
void copy_2d(Device d, void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, int64_t width, int64_t rows,
             Stream stream);
void upload(Device d, void* dst, const void* host_src, int64_t bytes, Stream stream);
void download(Device d, void* host_dst, const void* src, int64_t bytes, Stream stream);  // synchronous
void zero(Device d, void* dst, int64_t bytes, Stream stream);
void sync(Device d, Stream stream);  // waits for the stream's work (no-op on the CPU)

// The all-to-all plan on a GPU (at most kMaxPlanRanks ranks). Rank r holds experts [start[r], end[r]).
constexpr int kMaxPlanRanks = 32;
struct PlanRanks {
  int n = 0;
  int64_t start[kMaxPlanRanks] = {}, end[kMaxPlanRanks] = {};
  int64_t offset[kMaxPlanRanks] = {};  // plan_fill: where rank r's rows start in the send order
};
// pos[t * N + r] = the place of token t among the tokens sent to rank r (token order), -1 when none of its
// slots is on r; counts[r] = tokens sent to r; counts[N] = the first bad slot t * K + k (id < 0 or > E), or
// INT32_MAX.
void plan_count(Device d, const void* ids, DType id_dtype, int64_t T, int64_t K, int64_t E, const PlanRanks& ranks,
                int32_t* pos, int32_t* counts, Stream stream);
// rows[p] = token of send slot p; map[t * N + r] = its slot or -1; meta[p] = K ids in the receiver's numbering,
// then K f32 weights.
void plan_fill(Device d, const void* ids, DType id_dtype, const void* weights, DType w_dtype, int64_t T, int64_t K,
               const PlanRanks& ranks, const int32_t* pos, int32_t* rows, int32_t* map, int32_t* meta, Stream stream);
// Work enqueued on `to` after this call waits for the work enqueued on `from` before it (CUDA; no-op on the CPU).
void order(Device d, Stream from, Stream to);

}  // namespace moekit::ep

#if defined(MOEKIT_WITH_CUDA)
namespace moekit::ep::cuda {
void remap_ids(const void* ids, bool i64, int64_t n, int64_t start, int64_t end, int64_t E, int32_t sentinel,
               int32_t* out, void* stream);
void gather_rows(const void* src, int64_t src_pitch, const int32_t* rows, int64_t n, int64_t row_bytes, void* dst,
                 int64_t dst_pitch, void* stream);
void combine_rows(const void* rows, int dtype_code, int64_t H, const int32_t* map, int64_t T, int N, void* out,
                  void* stream);  // dtype_code 0 f32, 1 bf16, 2 f16
void plan_count(const void* ids, bool i64, int64_t T, int64_t K, int64_t E, const PlanRanks& ranks, int32_t* pos,
                int32_t* counts, void* stream);
void plan_fill(const void* ids, bool i64, const void* weights, int w_code, int64_t T, int64_t K,
               const PlanRanks& ranks, const int32_t* pos, int32_t* rows, int32_t* map, int32_t* meta, void* stream);
}  // namespace moekit::ep::cuda
#endif

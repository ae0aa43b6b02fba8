// Internal: what the three CPU backends share: the per-call plan, token chunks, row gathers, the epilogues of
// the two projections and the final combine.
//
// Numerics (the same in eager, batched_mm and grouped_mm): activations and weights are converted to f32 and the
// matrix products accumulate in f32. With f32 activations nothing else is rounded. With bf16 / f16 activations,
// values are rounded to that dtype wherever transformers' batched_mm / grouped_mm, running the module in that
// dtype, materialise a tensor: each projection's output, then again after its bias is added; each step of the
// gate (act(gate), act(gate) * up; for gpt-oss's clamped SwiGLU gate * alpha, the sigmoid, gate * sigmoid,
// up + 1 and the product); and the routing-weighted product when the routing weights have
// the activation dtype (torch's type promotion). The sum over the K slots runs in f32 in slot order and is
// rounded once to the output dtype. Sentinel slots (id == E) are skipped entirely, whatever their weight.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "base/gemm.h"
#include "moekit/experts.h"
#include "routing/routing.h"

namespace moekit::cpu {

// Memory for the packed experts: 2 MiB-aligned and in transparent huge pages where the kernel gives them
// (madvise(MADV_HUGEPAGE): one TLB entry per 2 MiB of the weights' stream instead of per 4 KiB; the machine's
// mode is "madvise" on common distributions, so plain allocations get none). MOEKIT_CPU_HUGEPAGES=0: plain pages
// (A/B runs). Blocks below 2 MiB are plain.
void* huge_page_alloc(size_t bytes);
void huge_page_free(void* p) noexcept;
template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(huge_page_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t) noexcept { huge_page_free(p); }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const noexcept { return true; }
};

// The experts' bf16 weights packed once for the dot-pair kernels (base/gemm.h PackedBf16), one copy per module
// shared by the three CPU backends (state "cpu_packed"); made by prepare() where the CPU has a bf16 tile.
struct PackedExperts : BackendState {
  std::vector<uint16_t, HugePageAllocator<uint16_t>> w1, w2;  // expert e at e * per1 / e * per2
  int64_t per1 = 0, per2 = 0, kp1 = 0, kp2 = 0;
};

// Packs bf16 experts when this CPU has a bf16 tile (AVX512-BF16 or AMX); nothing otherwise. Idempotent.
void prepare(const Experts& experts);

struct Plan {
  const ExpertsSpec* spec = nullptr;
  int64_t E = 0, H = 0, I = 0, N1 = 0;  // N1: width of the first projection (2I gated, I otherwise)
  const void* w1 = nullptr;             // [E, N1, H] (transposed: [E, H, N1])
  const void* w2 = nullptr;             // [E, H, I]  (transposed: [E, I, H])
  WType wtype = WType::f32;
  size_t welem = 4;            // bytes per weight element
  const Tensor* b1 = nullptr;  // [E, N1] or null
  const Tensor* b2 = nullptr;  // [E, H] or null
  DType act = DType::f32;      // activation dtype: intermediates are rounded to it
  const GemmKernels* kernels = nullptr;
  // Set when the products run on the bf16 tile: bf16 weights and activations (every GEMM input is then exactly a
  // bf16 value), a packed copy, and kernels with a bf16 tile.
  const PackedExperts* packed = nullptr;

  // Set for FP8 experts: e4m3 weights and their block scales as f32 (the module's own when f32, a converted copy
  // when ue8m0), pow2_scales for ue8m0 (activation scales are then rounded up to powers of two as well).
  const uint8_t* q1 = nullptr;
  const uint8_t* q2 = nullptr;
  const float* s1 = nullptr;
  const float* s2 = nullptr;
  int64_t sper1 = 0, sper2 = 0;  // scales per expert
  bool pow2_scales = false;
  // FP4 experts: q1 / q2 hold packed e2m1, u1 / u2 their ue8m0 scales per row and 32 inputs; activations quantized
  // to FP8 unless fp4_float_acts.
  bool fp4 = false, fp4_float_acts = false;
  const uint8_t* u1 = nullptr;
  const uint8_t* u2 = nullptr;
  // Quantized experts (FP8 or FP4): the products run on the quantized tiles (quant_tile).
  bool quantized() const { return q1 != nullptr; }
  Fp4Matrix first_fp4(int64_t e) const {
    return {q1 + e * N1 * H / 2, u1 + e * N1 * (H / 32), N1, H, fp4_float_acts ? 1.0 : 0x1p-9};
  }
  Fp4Matrix down_fp4(int64_t e) const { return {q2 + e * H * I / 2, u2 + e * H * (I / 32), H, I, fp4_float_acts ? 1.0 : 0x1p-9}; }
  Fp8Matrix first_fp8(int64_t e) const {
    return {q1 + e * N1 * H, s1 + e * sper1, N1, H, spec->has_gate ? I : N1};
  }
  Fp8Matrix down_fp8(int64_t e) const { return {q2 + e * H * I, s2 + e * sper2, H, I, H}; }

  PackedBf16 first_packed(int64_t e) const { return {packed->w1.data() + e * packed->per1, N1, H, packed->kp1}; }
  PackedBf16 down_packed(int64_t e) const { return {packed->w2.data() + e * packed->per2, H, I, packed->kp2}; }

  WeightMatrix first(int64_t e) const {
    return {static_cast<const uint8_t*>(w1) + size_t(e * N1 * H) * welem, wtype, N1, H, spec->is_transposed};
  }
  WeightMatrix down(int64_t e) const {
    return {static_cast<const uint8_t*>(w2) + size_t(e * H * I) * welem, wtype, H, I, spec->is_transposed};
  }
};

Plan make_plan(const Experts& experts, const ExpertsCall& call);

// Cost of the gate per element of the first projection, relative to a multiply-add (for parallel_for).
constexpr int64_t kGateCost = 8;

// Splits the call into chunks of whole tokens whose scratch (about floats_per_pair floats per (token, slot)
// pair) stays bounded, and calls fn on each chunk's views.
void for_each_token_chunk(const ExpertsCall& call, int64_t floats_per_pair,
                          const std::function<void(const ExpertsCall&)>& fn);

// Per-call scratch: buffers of 1 MiB and more go back to a process-wide pool when released and are handed out again
// by later calls (best fit, at most twice the size asked), so that a call does not fault in fresh pages for its hundreds of MiB of intermediates
// every time (the kernel's page clearing cost as much as the products at prefill sizes). The pool keeps at most
// kScratchPoolBytes; contents are uninitialised.
constexpr size_t kScratchPoolBytes = size_t(2) << 30;  // a whole 1 GiB chunk (f32) and its bf16 rows
struct ScratchDeleter {
  size_t bytes = 0;
  void operator()(void* p) const;
};
// At least `bytes` bytes, 64-byte aligned; `bytes` becomes the block's size (give it to the ScratchDeleter).
void* scratch_alloc(size_t& bytes);

// dst[i, 0:kp) = bf16(src[i, 0:k)), zero past k (all threads).
using Bf16Buffer = std::unique_ptr<uint16_t[], ScratchDeleter>;
Bf16Buffer bf16_rows(const float* src, int64_t lds, int64_t rows, int64_t k, int64_t kp);

// Row stride of bf16 activation rows of kp (packed_bf16_k) values for the bf16 tiles: kp plus one cache line, so
// that the 16 rows of an AMX tile load fall in different L1 sets (kp is often a multiple of 4 KiB / 2).
inline int64_t bf16_row_ld(int64_t kp) { return kp + 32; }

// Bf16 activations (Plan::packed): dst[i, 0:H) = hidden_states[token(i), :], zero to ld, token(i) =
// row_pairs[i] / K (or i when row_pairs is null). No conversion: the inputs are bf16 already (all threads).
Bf16Buffer gather_bf16_rows(const Plan& p, const ExpertsCall& call, const int64_t* row_pairs, int64_t rows,
                            int64_t ld);

// The first epilogue (first_epilogue_row) of each row of h [rows, N1] (row i of expert row_expert[i]), its I
// gated values written as bf16 rows of stride ld, zero past I (exact: the epilogue rounds them to bf16) (all threads).
// h is left in an unspecified state (the SiLU [gate | up] case reads it without writing it).
Bf16Buffer gated_bf16_rows(const Plan& p, float* h, int64_t rows, const int64_t* row_expert, int64_t ld);

// Rows for the quantized tiles: quantized to FP8 (base/gemm.h fp8_quantize_rows), or plain values for FP4 weights
// with float activations (plain_rows): q [rows, ld] and scales s [rows, lds].
struct Fp8Rows {
  std::unique_ptr<double[]> q;
  std::unique_ptr<float[]> s;
  int64_t ld = 0, lds = 0;
};
// The first k values of `rows` rows of src (row stride lds), quantized per 128 inputs (all threads).
Fp8Rows fp8_rows(const Plan& p, const float* src, int64_t lds, int64_t rows, int64_t k);
// Per-thread scratch (floats) of one FP8 tile over weights with k inputs.
inline int64_t fp8_work_floats(int64_t k) { return 2 * fp8_work_doubles(k); }
// c[m, n0:n1) = rows r0 .. r0 + m of a times the first (down: the down) projection of expert e on quantized weights
// (FP8 or FP4 tile). `work`: fp8_work_floats(k) floats. Single-threaded.
void quant_tile(const Plan& p, bool down, int64_t e, const Fp8Rows& a, int64_t r0, int64_t m, int64_t n0, int64_t n1,
                float* c, int64_t ldc, float* work);
// The same over all columns (all threads over column tiles).
void quant_gemm(const Plan& p, bool down, int64_t e, const Fp8Rows& a, int64_t r0, int64_t m, float* c, int64_t ldc);

// Uninitialised float buffer (from the scratch pool).
using FloatBuffer = std::unique_ptr<float[], ScratchDeleter>;
FloatBuffer make_buffer(int64_t n);

// dst[i, :] = f32(hidden_states[token(i), :]) for i in [0, rows), token(i) = rows_pairs[i] / K (all threads).
void gather_rows(const Plan& p, const ExpertsCall& call, const int64_t* row_pairs, int64_t rows, float* dst);

// First projection's output row h [N1] of expert e: + bias, round, gate (or activation); the I results are
// written in place at the start of the row.
void first_epilogue_row(const Plan& p, int64_t e, float* h);

// Down projection's output y[rows, n0:n1) of expert e: + bias, round (single-threaded).
void down_epilogue(const Plan& p, int64_t e, float* y, int64_t ldy, int64_t rows, int64_t n0, int64_t n1);

// out[t, :] = round(sum over k of w[t, k] * y[row(t, k), :]) with row = row_of_pair[t * K + k], skipping -1
// (all threads over tokens).
void combine(const Plan& p, const ExpertsCall& call, const float* y, int64_t ldy, const int64_t* row_of_pair);

}  // namespace moekit::cpu

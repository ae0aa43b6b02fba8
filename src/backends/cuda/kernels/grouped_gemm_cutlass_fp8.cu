// The FP8 block-scaled grouped projection on CUTLASS's Hopper kernels (KernelPtrArrayTmaWarpSpecialized{Cooperative,
// Pingpong}FP8Blockwise): one GEMM per expert over its sorted rows, e4m3 operands fed by TMA (A multicast over a
// cluster of two column tiles), activation scales per row and 128 inputs, weight scales per 128 x 128 block, promoted
// into f32 accumulators once per 128 inputs, and a bf16 output stored through TMA. The per-expert problem sizes and
// pointers are written on the device from the routing offsets by a small kernel ahead of it, so the call needs no
// host synchronisation and can be captured in a CUDA graph.
//
// Built only where CUTLASS's headers were found (MOEKIT_HAVE_CUTLASS, see CMakeLists.txt); elsewhere the entry points
// say that it is absent and the callers keep moekit's own sm90 kernel.
#include "backends/cuda/kernels/cutlass_gemm.h"

#if MOEKIT_HAVE_CUTLASS
#include "backends/cuda/kernels/cutlass_grouped.cuh"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include <algorithm>
#include <type_traits>

namespace moekit::cuda::kernels {
namespace {
using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per expert
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using LayoutA = cutlass::layout::RowMajor;     // activations [rows, k]
using LayoutB = cutlass::layout::ColumnMajor;  // weights [n, k]: k contiguous
using LayoutD = cutlass::layout::RowMajor;     // out [rows, n]
constexpr int kAlignA = 16, kAlignB = 16;

// Scales: per row (granularity 1) and 128 inputs for A, per 128 x 128 for B, both with k the contiguous index (the
// layouts moekit's quantisation writes: scale[row, block] and scale_inv[block row, block]).
using Scales = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
using LayoutSFA = decltype(Scales::deduce_layoutSFA());
using LayoutSFB = decltype(Scales::deduce_layoutSFB());

// The GEMM with a bf16 output (the first projection's rows, whose gate follows, and the second one's) on a tile shape,
// cluster shape and schedule: cooperative (two consumer warpgroups on one tile) or ping-pong (each on its own tile,
// one's epilogue under the other's main loop).
template <class TileShape, class ClusterShape, bool kPingpong>
struct Fp8Gemm {
  using ElementD = cutlass::bfloat16_t;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using KernelSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignA,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
// Cooperative 128 x 128 tiles for many rows per expert; ping-pong 64 x 128 tiles for few (docs/perf.md, 2026-12-02).
using GemmCooperative = Fp8Gemm<Shape<_128, _128, _128>, Shape<_1, _2, _1>, false>::Gemm;
using GemmPingpong = Fp8Gemm<Shape<_64, _128, _128>, Shape<_1, _2, _1>, true>::Gemm;

cutlass_grouped::Problem problem(const CutlassFp8Args& a) {
  cutlass_grouped::Problem p;
  p.a = a.a;
  p.a_scale = a.a_scale;
  p.b = a.b;
  p.b_expert_stride = a.b_expert_stride;
  p.b_ld = a.b_ld;
  p.b_scale = a.b_scale;
  p.bs_expert_stride = a.bs_expert_stride;
  p.offsets = a.offsets;
  p.experts = a.experts;
  p.n = a.n;
  p.k = a.k;
  p.out = a.out;
  return p;
}

}  // namespace

bool grouped_gemm_fp8_cutlass_built() { return true; }

bool grouped_gemm_fp8_cutlass_ok(const CutlassFp8Args& a, int arch) {
  const auto a16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  return arch == 90 && a.experts > 0 && a.n > 0 && a.k > 0 && a.n % 128 == 0 && a.k % 128 == 0 && a.b_ld >= a.k &&
         a.b_ld % 16 == 0 && a.b_expert_stride % 16 == 0 &&
         a.n < (int64_t(1) << 30) && a.k < (int64_t(1) << 30) && a.bs_expert_stride >= (a.n / 128) * (a.k / 128) && a16(a.a) && a16(a.b) && a16(a.out);
}

size_t grouped_gemm_fp8_cutlass_workspace(int experts) {
  return std::max(cutlass_grouped::workspace_bytes<GemmCooperative, Scales>(experts),
                  cutlass_grouped::workspace_bytes<GemmPingpong, Scales>(experts));
}

cudaError_t grouped_gemm_fp8_cutlass(const CutlassFp8Args& a, void* workspace, cudaStream_t stream) {
  return a.pingpong ? cutlass_grouped::run<GemmPingpong, Scales>(problem(a), workspace, stream)
                    : cutlass_grouped::run<GemmCooperative, Scales>(problem(a), workspace, stream);
}

}  // namespace moekit::cuda::kernels

#else  // no CUTLASS headers in this build

namespace moekit::cuda::kernels {
bool grouped_gemm_fp8_cutlass_built() { return false; }
bool grouped_gemm_fp8_cutlass_ok(const CutlassFp8Args&, int) { return false; }
size_t grouped_gemm_fp8_cutlass_workspace(int) { return 0; }
cudaError_t grouped_gemm_fp8_cutlass(const CutlassFp8Args&, void*, cudaStream_t) { return cudaErrorNotSupported; }
}  // namespace moekit::cuda::kernels

#endif

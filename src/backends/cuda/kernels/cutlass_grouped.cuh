// What moekit's CUTLASS grouped GEMMs share (grouped_gemm_cutlass_*.cu, built with CUTLASS's headers): one GEMM per
// expert over its sorted rows, D = A x B^T with A [rows, k] row-major, B [n, k] per expert (k contiguous, rows b_ld
// elements apart) and D [rows, n] row-major, the per-expert problem sizes, pointers and strides written on the device
// from the routing offsets by a small kernel ahead of the GEMM (no host synchronisation: capturable), CUTLASS's
// ptr-array kernel then reading them with the problem sizes known on the device only.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "base/cuda_device.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"

namespace moekit::cuda::kernels::cutlass_grouped {

// One grouped projection in elements of the GEMM's operand types (scales null where the GEMM has none).
struct Problem {
  const void* a = nullptr;  // [rows, k], k elements apart
  const float* a_scale = nullptr;
  const void* b = nullptr;
  int64_t b_expert_stride = 0, b_ld = 0;  // elements
  const float* b_scale = nullptr;
  int64_t bs_expert_stride = 0;
  const int32_t* offsets = nullptr;  // [E + 1] device
  int experts = 0;
  int64_t n = 0, k = 0;
  void* out = nullptr;  // [rows, n]
};

// The per-expert arrays of `Gemm` (a GemmUniversalAdapter over a ptr-array grouped kernel); Scales: the block-scale
// configuration (cutlass::detail::Sm90BlockwiseScaleConfig) or void.
template <class Gemm, class Scales>
struct Groups {
  static constexpr bool kScaled = !std::is_void_v<Scales>;
  using Kernel = typename Gemm::GemmKernel;
  using ProblemShape = typename Kernel::ProblemShape;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using ElementD = typename Kernel::ElementD;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  struct NoLayout {};
  template <class S, bool = kScaled>
  struct Layouts {
    using A = NoLayout;
    using B = NoLayout;
  };
  template <class S>
  struct Layouts<S, true> {
    using A = decltype(S::deduce_layoutSFA());
    using B = decltype(S::deduce_layoutSFB());
  };
  using LayoutSFA = typename Layouts<Scales>::A;
  using LayoutSFB = typename Layouts<Scales>::B;

  Shape3* shapes = nullptr;
  const ElementA** a = nullptr;
  const ElementB** b = nullptr;
  ElementD** d = nullptr;
  const float** sfa = nullptr;
  const float** sfb = nullptr;
  StrideA* sa = nullptr;
  StrideB* sb = nullptr;
  StrideD* sd = nullptr;
  LayoutSFA* lsfa = nullptr;
  LayoutSFB* lsfb = nullptr;
  void* cutlass_ws = nullptr;  // CUTLASS's own workspace, after the arrays

  static size_t align256(size_t b) { return (b + 255) & ~size_t(255); }

  // Carves the arrays for `experts` from `ws` (256-byte aligned; null: only measures). Returns the bytes they take.
  size_t carve(void* ws, int experts) {
    auto* base = static_cast<unsigned char*>(ws);
    size_t off = 0;
    const size_t e = size_t(experts);
    auto take = [&](auto*& p, size_t bytes) {
      p = base ? reinterpret_cast<std::remove_reference_t<decltype(p)>>(base + off) : nullptr;
      off += align256(bytes);
    };
    take(shapes, e * sizeof(Shape3));
    take(a, e * sizeof(void*));
    take(b, e * sizeof(void*));
    take(d, e * sizeof(void*));
    take(sa, e * sizeof(StrideA));
    take(sb, e * sizeof(StrideB));
    take(sd, e * sizeof(StrideD));
    if constexpr (kScaled) {
      take(sfa, e * sizeof(void*));
      take(sfb, e * sizeof(void*));
      take(lsfa, e * sizeof(LayoutSFA));
      take(lsfb, e * sizeof(LayoutSFB));
    }
    cutlass_ws = base ? base + off : nullptr;
    return off;
  }

  // Expert e's entries (one thread each).
  __device__ void fill(const Problem& p, int e) const {
    const int r0 = p.offsets[e], m = p.offsets[e + 1] - r0;
    const int n = int(p.n), k = int(p.k);
    shapes[e] = Shape3{m, n, k};
    a[e] = static_cast<const ElementA*>(p.a) + int64_t(r0) * k;
    b[e] = static_cast<const ElementB*>(p.b) + int64_t(e) * p.b_expert_stride;
    d[e] = static_cast<ElementD*>(p.out) + int64_t(r0) * p.n;
    sa[e] = cutlass::make_cute_packed_stride(StrideA{}, {m, k, 1});
    sb[e] = cutlass::make_cute_packed_stride(StrideB{}, {n, int(p.b_ld), 1});  // weight rows b_ld elements apart
    sd[e] = cutlass::make_cute_packed_stride(StrideD{}, {m, n, 1});
    if constexpr (kScaled) {
      sfa[e] = p.a_scale + int64_t(r0) * (k / 128);
      sfb[e] = p.b_scale + int64_t(e) * p.bs_expert_stride;
      lsfa[e] = Scales::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
      lsfb[e] = Scales::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
    }
  }

  typename Gemm::Arguments arguments(int experts) const {
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = current_multiprocessors();  // the current device's (cached per device)
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {experts, shapes, nullptr};
    if constexpr (kScaled)
      args.mainloop = {a, sa, b, sb, sfa, lsfa, sfb, lsfb};
    else
      args.mainloop = {a, sa, b, sb};
    args.epilogue = {{}, nullptr, nullptr, d, sd};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.hw_info = hw;
    return args;
  }
};

template <class G>
__global__ void fill_groups_kernel(const Problem p, const G g) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < p.experts) g.fill(p, e);
}

// Workspace bytes for `experts` (the arrays and CUTLASS's own).
template <class Gemm, class Scales>
size_t workspace_bytes(int experts) {
  Groups<Gemm, Scales> g;
  const size_t arrays = g.carve(nullptr, experts);
  return arrays + Groups<Gemm, Scales>::align256(Gemm::get_workspace_size(g.arguments(experts)));
}

template <class Gemm, class Scales>
cudaError_t run(const Problem& p, void* workspace, cudaStream_t stream) {
  if (p.experts <= 0 || p.n == 0) return cudaSuccess;
  if ((reinterpret_cast<uintptr_t>(workspace) & 255) != 0) return cudaErrorInvalidValue;
  Groups<Gemm, Scales> g;
  g.carve(workspace, p.experts);
  fill_groups_kernel<<<(p.experts + 127) / 128, 128, 0, stream>>>(p, g);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  Gemm gemm;
  const typename Gemm::Arguments args = g.arguments(p.experts);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
  if (gemm.initialize(args, g.cutlass_ws, stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

}  // namespace moekit::cuda::kernels::cutlass_grouped

// Grouped projection over contiguous sorted rows on Hopper (sm_90a): warp-specialised and persistent.
//
// One block per multiprocessor walks work items (expert, n tile, m tile) of 128 rows x 256 virtual
// columns, the m tile fastest within an expert so that the blocks in flight share one expert's weights
// (and its rows) in L2. Warpgroup 0 is the producer (registers lowered with setmaxnreg): one thread
// issues bulk tensor copies (TMA, 128-byte swizzle) of the A tile (128 x 64, 2-D map over the sorted
// rows) and two B boxes (2 x 128 x 64, 3-D map over the [E, N, K] weights) into a ring of shared-memory
// stages guarded by mbarriers ("full": bytes landed, "empty": both consumers done). Warpgroups 1 and 2
// (registers raised) each multiply 64 rows by the 256 columns with wgmma m64n256k16, release a stage as
// soon as the MMAs that read it retire, and write their tile through a per-warpgroup shared-memory
// staging buffer (rows past the expert's end masked), the gate fused. That is the cooperative form (route
// tiles of 128 rows). The ping-pong form (route tiles of 64, where the experts hold few rows) makes work
// items of 64 rows: each consumer warpgroup takes every other item of its block whole, so one runs its
// main loop while the other runs its epilogue; the stages come in item order, and a "turn" barrier lets a
// warpgroup start its item's main loop only after the other has waited for the previous item's stages
// (so no consumer waits on a stage barrier two phases ahead). The epilogues:
//   - f32 (second projection) and gated silu * up with concatenated halves and no bias (the common
//     first projection): staged in 128-byte swizzled boxes and written by bulk tensor stores for 64-row
//     blocks inside the expert (the copy engine writes while the warpgroup starts its next tile), masked
//     16-byte stores for a block crossing the expert's end;
//   - any other gate / activation / bias: f32 staged in four rounds, one compact loop applies it, 16-byte
//     stores. (Unrolling the generic gate per fragment made the kernel ten times larger, with an indirect
//     branch per value, and ran the projection at a third of the speed.) Silu * up with biases and gpt-oss's
//     clamped SwiGLU take the same rounds with the loop unrolled over 8 outputs, their 16 biases loaded first
//     and the gate's exp and division in hardware approximations (as the silu path above): gpt-oss-20b's
//     first projection 6-9% faster end to end at T >= 4096 on an H100; unrolled with the accurate expf it was
//     25% slower (docs/perf.md, 2026-12-06).
//   - kEpiWeighted (sonicmoe's second projection): w[row_pair[r]] * (acc + bias) rounded to 16 bits in
//     registers, staged in two rounds of 128 columns as 64 x 64 boxes and written like the gated path
//     (bulk tensor stores for 64-row blocks inside the expert, masked 16-byte stores otherwise), sorted rows.
//     Without row weights (w = 1): grouped_mm's and deepgemm's second projection in 16-bit rows.
// The work list comes from the device offsets (no host synchronisation; capturable in a CUDA graph).
//
// Gathered A (a_rows set, sonicmoe's first projection): sm_90's copy engine has no row gather, so the
// whole producer warpgroup loads A: row r of the tile is token row a_rows[m0 + r] / a_row_div, eight lanes
// per 128-byte row piece, eight 16-byte cp.async per thread and stage straight into the 128-byte swizzled layout the TMA box would have produced
// (rows past the expert's end and columns past k zero-filled), then `cp.async.mbarrier.arrive.noinc` on the
// stage's "full" barrier (128 arrivals besides the B boxes' transaction count). The consumers fence the
// generic-proxy writes against wgmma's async-proxy reads after the wait. The permuted [pairs, H] copy of
// the hidden states is never written.
//
// B boxes per work item: gated with concatenated [gate | up] rows: gate rows c0.. and up rows I + c0..
// (128 output columns); gated interleaved: rows 2 c0 .. 2 c0 + 255 (gate and up adjacent, 128 output
// columns); otherwise rows n0 .. n0 + 255. Boxes past the weight rows are zero-filled by the copy engine.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "backends/cuda/kernels/grouped_gemm_sm90.cuh"
#include "base/env.h"

namespace moekit::cuda::kernels {
namespace {
using namespace sm90;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4, kThreads = 384;
constexpr int kABytes = kBM * kBK * 2, kBBoxBytes = 128 * kBK * 2, kStageBytes = kABytes + 2 * kBBoxBytes;
constexpr int kOutBytes = 64 * 128 * 2;  // staging of 16-bit outputs, per consumer warpgroup
constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 2 * kOutBytes + (2 * kStages + 2) * 8 + 1024;
static_assert((kStages & (kStages - 1)) == 0, "the consumers find an item's first stage by masking");
constexpr int kGatherThreads = 128;  // producer warpgroup threads loading gathered A rows
static_assert(kGatherThreads == 128 && kBM == 128 && kBK == 64, "gathered A: 16 rows x 8 chunks per pass");

// Arrival on the barrier at the same shared-memory offset in cluster CTA `cta` (this CTA included). kClusterScope:
// released at cluster scope (the pair form's default arrival, the one measured: its warps stall on membar,
// docs/perf.md); else at CTA scope (mbarrier.arrive's default semantics), what a consumer's release of a stage needs
// once wgmma.wait_group has seen the MMAs' reads of it complete; the peer's producer orders its multicast after the
// barrier's phase completes.
template <bool kClusterScope>
[[maybe_unused]] __device__ __forceinline__ void mbar_arrive_in(uint32_t bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(cta));
  if constexpr (kClusterScope)
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
  else
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
// The kernel's `pair` argument: no CTA pairs, or pairs whose consumers release each stage in both CTAs at cluster
// scope or at CTA scope (mbar_arrive_in).
constexpr int kPairOff = 0, kPairClusterRelease = 1, kPairCtaRelease = 2;
[[maybe_unused]] __device__ __forceinline__ void cluster_sync_all() {  // every thread of both CTAs, any order
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// The same box into this CTA and its cluster peer (CTA mask 0b11), at the same shared-memory offset, each
// CTA's barrier at `bar`'s offset receiving the bytes.
[[maybe_unused]] __device__ __forceinline__ void tma_load_3d_pair(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                                                  int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4, %5}], [%2], %6;\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(uint16_t(3))
      : "memory");
}

// Work item w: its expert, column tile and first row (items of `rows` rows: route tiles of tile_m rows
// split into tile_m / rows blocks, `sub` of them; m fastest within an expert). Empty (m0 >= m_end) for
// the blocks past the end of an expert's last route tile: producer and consumers skip those alike.
struct Work {
  int expert, n_tile;
  int64_t m0, m_end;
};
[[maybe_unused]] __device__ __forceinline__ void work_item(const GroupedGemmArgs& args, int w, int n_tiles, int rows,
                                                           int sub, Work& t) {
  const int e = tile_expert(args.tile_offsets, args.experts, w / (n_tiles * sub));
  const int first_tile = __ldg(args.tile_offsets + e);
  const int m_blocks = (__ldg(args.tile_offsets + e + 1) - first_tile) * sub;
  const int local = w - first_tile * n_tiles * sub;
  t.expert = e;
  t.n_tile = local / m_blocks;
  t.m0 = __ldg(args.offsets + e) + int64_t(local % m_blocks) * rows;
  t.m_end = __ldg(args.offsets + e + 1);
}

[[maybe_unused]] __device__ __forceinline__ float load_weight(const void* w, Elem type, int64_t i) {
  if (type == Elem::bf16) return to_f32(static_cast<const bf16*>(w)[i]);
  if (type == Elem::f16) return to_f32(static_cast<const f16*>(w)[i]);
  return static_cast<const float*>(w)[i];
}

template <int EPI>
__device__ __forceinline__ int n_tiles_of(const GroupedGemmArgs& args) {
  const int64_t cols = EPI == kEpiGated ? kBN / 2 : kBN;
  return int((args.n + cols - 1) / cols);
}

template <class T, int EPI>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_tma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                            const __grid_constant__ CUtensorMap map_out, const bool use_tma_store,
                            const bool pingpong, const bool split_out, const bool fast_gate,
                            const bool skip_idle, const int pair, const GroupedGemmArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char tma_smem[];
  const uint32_t base = (smem_u32(tma_smem) + 1023) & ~1023u;          // swizzled tiles: 1024-byte aligned
  const uint32_t bars = base + kStages * kStageBytes + 2 * kOutBytes;  // full[s] at bars + 8 s, empty[s] after
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kStages + s); };
  auto turn = [&](int c) { return bars + 8 * (2 * kStages + c); };  // ping-pong: consumer c may start its main loop
  const int tid = threadIdx.x, wg = tid / 128;
  const bool gather = args.a_rows != nullptr;
  uint32_t rank = 0;  // pair: this CTA's rank in its cluster of two (blocks 2 i and 2 i + 1)
  if (pair) asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), gather ? 1 + kGatherThreads : 1);
      mbar_init(empty(s), pingpong && !pair ? 4 : 8);  // one arrival per warp of the consumer(s) reading the stage
    }
    mbar_init(turn(0), 1);
    mbar_init(turn(1), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (pair) cluster_sync_all();  // the peer's barriers initialised before any arrival or multicast reaches them
  else __syncthreads();

  const int n_tiles = n_tiles_of<EPI>(args);
  const int rows = pingpong ? 64 : kBM, sub = args.tile_m / rows;  // rows per work item, items per route tile
  const int total = __ldg(args.tile_offsets + args.experts) * n_tiles * sub;
  const int a_bytes = rows * kBK * 2;
  const int ktiles = int((args.k + kBK - 1) / kBK);
  const bool concat_gate = EPI == kEpiGated && args.gate.concatenated;

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (gather) {
      // Thread tid loads 16-byte chunk tid % 8 of rows tid / 8 + 16 i (i < 8) of every A tile (cp.async: a
      // warp reads four whole 128-byte rows per instruction), thread 0 the B boxes too (TMA). The rows'
      // swizzled chunk is the same for all eight (16 i leaves row % 8 unchanged).
      const int chunk = tid & 7, r16 = tid >> 3;
      const uint32_t dst_off = uint32_t(r16) * (kBK * 2) + uint32_t((chunk ^ (r16 & 7)) << 4);
      const T* a = static_cast<const T*>(args.a);
      int s = 0;
      uint32_t phase = 0;
      for (int w = blockIdx.x; w < total; w += gridDim.x) {
        Work t;
        work_item(args, w, n_tiles, rows, sub, t);
        if (t.m0 >= t.m_end && !pair) continue;
        const int row0 = concat_gate ? t.n_tile * (kBN / 2) : t.n_tile * kBN;
        const int row1 = concat_gate ? int(args.inter) + row0 : row0 + 128;
        int src_row[kBM / 16];  // A row of each of this thread's eight tile rows; -1 past the expert's end
#pragma unroll
        for (int i = 0; i < kBM / 16; ++i) {
          const int64_t row = t.m0 + r16 + 16 * i;
          src_row[i] = 16 * i < rows && row < t.m_end ? __ldg(args.a_rows + row) / args.a_row_div : -1;
        }
        for (int kt = 0; kt < ktiles; ++kt) {
          mbar_wait(empty(s), phase ^ 1);
          const uint32_t st = base + s * kStageBytes;
          if (tid == 0) {
            mbar_expect_tx(full(s), 2 * kBBoxBytes);
            if (pair) {
              tma_load_3d_pair(st + kABytes + rank * kBBoxBytes, &map_b, full(s), kt * kBK, rank ? row1 : row0,
                               t.expert);
            } else {
              tma_load_3d(st + kABytes, &map_b, full(s), kt * kBK, row0, t.expert);
              tma_load_3d(st + kABytes + kBBoxBytes, &map_b, full(s), kt * kBK, row1, t.expert);
            }
          }
          const int64_t col = int64_t(kt) * kBK + chunk * 8;
#pragma unroll
          for (int i = 0; i < kBM / 16; ++i) {
            if (16 * i >= rows) break;  // the MMAs read the first `rows` rows of the A slot only
            const bool ok = src_row[i] >= 0 && col < args.k;
            cp_async16(st + dst_off + uint32_t(16 * i) * (kBK * 2), ok ? a + int64_t(src_row[i]) * args.lda + col : a,
                       ok);
          }
          cp_async_arrive_noinc(full(s));
          if (++s == kStages) {
            s = 0;
            phase ^= 1;
          }
        }
      }
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      if (pair) cluster_sync_all();
      return;
    }
    if (tid != 0) {
      if (pair) cluster_sync_all();
      return;
    }
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(&map_a) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(&map_b) : "memory");
    int s = 0;
    uint32_t phase = 0;
    for (int w = blockIdx.x; w < total; w += gridDim.x) {
      Work t;
      work_item(args, w, n_tiles, rows, sub, t);
      const bool load_a = t.m0 < t.m_end;
      if (!load_a && !pair) continue;
      const int row0 = concat_gate ? t.n_tile * (kBN / 2) : t.n_tile * kBN;
      const int row1 = concat_gate ? int(args.inter) + row0 : row0 + 128;
      for (int kt = 0; kt < ktiles; ++kt) {
        mbar_wait(empty(s), phase ^ 1);
        const uint32_t st = base + s * kStageBytes;
        mbar_expect_tx(full(s), (load_a ? a_bytes : 0) + 2 * kBBoxBytes);
        if (load_a) tma_load_2d(st, &map_a, full(s), kt * kBK, int(t.m0));
        if (pair) {  // this CTA's box of the weights into both CTAs; the peer's box arrives likewise
          tma_load_3d_pair(st + kABytes + rank * kBBoxBytes, &map_b, full(s), kt * kBK, rank ? row1 : row0, t.expert);
        } else {
          tma_load_3d(st + kABytes, &map_b, full(s), kt * kBK, row0, t.expert);
          tma_load_3d(st + kABytes + kBBoxBytes, &map_b, full(s), kt * kBK, row1, t.expert);
        }
        if (++s == kStages) {
          s = 0;
          phase ^= 1;
        }
      }
    }
    if (pair) cluster_sync_all();
    return;
  }

  // consumers. Cooperative (tiles of 128 rows): warpgroup c = wg - 1 takes rows 64 c .. 64 c + 63 of each
  // tile. Ping-pong (items of 64 rows): warpgroup c takes every other item of the block, whole; the
  // stages come in item order, so one warpgroup's main loop runs while the other's epilogue does.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1, lane = tid % 32, warp = (tid % 128) / 32;
  float acc[kBN / 2];
  int seq = -1;  // this block's non-empty items so far (the producer's order; pair: all its items)
  // A stage read: released in this CTA, and with pair also in the peer (whose producer multicast half of it).
  auto release = [&](int st) {
    if (pair == kPairCtaRelease) {
      mbar_arrive_in<false>(empty(st), 0);
      mbar_arrive_in<false>(empty(st), 1);
    } else if (pair) {  // kPairClusterRelease
      mbar_arrive_in<true>(empty(st), 0);
      mbar_arrive_in<true>(empty(st), 1);
    } else {
      mbar_arrive(empty(st));
    }
  };
  uint32_t turns = 0;  // ping-pong: waits on turn(c) so far
  // Ping-pong order: warpgroup c starts the main loop of item seq only once the other warpgroup has
  // finished waiting for the stages of item seq - 1 (it arrives on turn(c) after its main loop). Then
  // every earlier fill of the ring has been observed complete, so the parity this warpgroup waits for is
  // never two phases ahead of a stage's barrier (a consumer skipping the other's k blocks could be).
  for (int w = blockIdx.x; w < total; w += gridDim.x) {
    Work t;
    work_item(args, w, n_tiles, rows, sub, t);
    if (t.m0 >= t.m_end && !pair) continue;
    ++seq;
    if (pingpong && (seq & 1) != c) continue;
    const int64_t r0 = pingpong ? t.m0 : t.m0 + c * 64;  // first row of this warpgroup's 64
    const bool has_rows = r0 < t.m_end;
    // this item's first stage and phase in the ring (kStages is a power of two)
    const uint32_t g0 = uint32_t(seq) * uint32_t(ktiles);
    int s = int(g0 % kStages);
    uint32_t phase = (g0 / kStages) & 1;
    if (pingpong && seq > 0) {
      mbar_wait(turn(c), turns & 1);
      ++turns;
    }
    if ((skip_idle || pair) && !has_rows) {  // no row of this warpgroup in the item: release the stages only
      for (int kt = 0; kt < ktiles; ++kt) {
        mbar_wait(full(s), phase);
        if (lane == 0) release(s);
        if (++s == kStages) {
          s = 0;
          phase ^= 1;
        }
      }
      if (pingpong && tid % 128 == 0) mbar_arrive(turn(1 - c));
      continue;
    }
    // kEpiWeighted: routing weights of this thread's two rows, loaded under the MMAs (1 without row_weights:
    // plain 16-bit rows, grouped_mm's and deepgemm's second projection)
    float wr[2] = {1.0f, 1.0f};
    if (EPI == kEpiWeighted && args.row_weights) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = r0 + warp * 16 + (lane >> 2) + half * 8;
        if (row < t.m_end) wr[half] = load_weight(args.row_weights, args.weight_type, __ldg(args.row_pair + row));
      }
    }
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.0f;
    int prev = -1;
    for (int kt = 0; kt < ktiles; ++kt) {
      mbar_wait(full(s), phase);
      if (gather) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async rows -> wgmma
      // Unconditional within the loop (wgmma under a branch is serialised by the compiler); a warpgroup with
      // no row of the tile took the loop without MMAs above, unless skip_idle is off.
      const uint32_t st = base + s * kStageBytes;
      const uint64_t desc_a = smem_desc(st + (pingpong ? 0 : c * 64 * kBK * 2));
      const uint64_t desc_b = smem_desc(st + kABytes);
      fence_operands(acc);
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) wgmma_m64n256k16<T>(acc, desc_a + 2 * kk, desc_b + 2 * kk);
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // the previous stage's MMAs retired
      fence_operands(acc);
      if (prev >= 0 && lane == 0) release(prev);
      prev = s;
      if (++s == kStages) {
        s = 0;
        phase ^= 1;
      }
    }
    if (pingpong && tid % 128 == 0) mbar_arrive(turn(1 - c));  // the other warpgroup's item may start
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fence_operands(acc);
    if (prev >= 0 && lane == 0) release(prev);
    if (!has_rows) continue;

    // Accumulator 4j + q: row 16 warp + lane / 4 (+8 for q >= 2), virtual column 8j + 2 (lane % 4) (+1 for odd q).
    const T* bias =
        args.bias ? static_cast<const T*>(args.bias) + int64_t(t.expert) * args.bias_expert_stride : nullptr;
    if constexpr (EPI == kEpiWeighted || EPI == kEpiF32) {
      // Staged through this warpgroup's 16 KB buffer as 8 KB boxes (64 rows x 128 bytes, 128-byte swizzle:
      // 64 16-bit or 32 f32 columns), then written by bulk tensor stores for a block of 64 rows inside the
      // expert (the copy engine writes while the warpgroup goes on) or by masked 16-byte stores for a block
      // crossing the expert's end. kEpiWeighted: w[p] * (acc + bias) rounded to 16 bits (4 boxes);
      // kEpiF32: the accumulators (8 boxes). Two schedules (split_out): rounds of two boxes that wait for
      // the previous round's stores to have read the buffer, or rounds of one box alternating between the
      // buffer's halves, each waiting only for the stores of the round before last (the staging of one
      // round overlaps the copy engine's reading of the previous one).
      unsigned char* stage = tma_smem + (base - smem_u32(tma_smem)) + kStages * kStageBytes + c * kOutBytes;
      const uint32_t stage_u32 = smem_u32(stage);
      const int tl = tid % 128;
      const bool whole = use_tma_store && r0 + 64 <= t.m_end;
      constexpr bool kF32 = EPI == kEpiF32;
      constexpr int kBoxCols = kF32 ? 32 : 64, kBoxes = kBN / kBoxCols;
      using OutT = std::conditional_t<kF32, float, T>;
      OutT* out = static_cast<OutT*>(args.out);
      const bool vec = (args.ldo & (kF32 ? 3 : 7)) == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
      auto rounds = [&](auto boxes_per_round) {
        constexpr int BPR = decltype(boxes_per_round)::value;
        constexpr int kJ = kBoxCols * BPR / 8;  // 8-column accumulator groups per round
#pragma unroll
        for (int round = 0; round < kBoxes / BPR; ++round) {
          auto box = [&](int b) { return (BPR == 1 ? (round & 1) : b) * 8192; };
          if (tl == 0) {  // the buffer (half) this round writes has been read by the copy engine
            if constexpr (BPR == 1) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
            else asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
          }
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = warp * 16 + (lane >> 2) + half * 8;
#pragma unroll
            for (int jj = 0; jj < kJ; ++jj) {
              const int j = kJ * round + jj;
              const float a0 = acc[4 * j + 2 * half], a1 = acc[4 * j + 2 * half + 1];
              if constexpr (kF32) {
                const int l = jj * 8 + (lane & 3) * 2, b = l >> 5, lb = l & 31;
                const int off = box(b) + r * 128 + (((lb >> 2) ^ (r & 7)) << 4) + (lb & 3) * 4;
                *reinterpret_cast<float2*>(stage + off) = make_float2(a0, a1);
              } else {
                using T2 = std::conditional_t<std::is_same_v<T, bf16>, __nv_bfloat162, __half2>;
                float b0 = 0.0f, b1 = 0.0f;
                if (bias) {
                  const int64_t col = int64_t(t.n_tile) * kBN + 8 * j + 2 * (lane & 3);
                  if (col < args.n) b0 = to_f32(bias[col]);
                  if (col + 1 < args.n) b1 = to_f32(bias[col + 1]);
                }
                T2 v;
                v.x = from_f32<T>(wr[half] * (a0 + b0));
                v.y = from_f32<T>(wr[half] * (a1 + b1));
                const int off = box(jj >> 3) + r * 128 + (((jj & 7) ^ (r & 7)) << 4) + (lane & 3) * 4;
                *reinterpret_cast<T2*>(stage + off) = v;
              }
            }
          }
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
          const int64_t col0 = int64_t(t.n_tile) * kBN + kBoxCols * BPR * round;
          if (whole) {
            if (tl == 0) {
#pragma unroll
              for (int b = 0; b < BPR; ++b)
                asm volatile(
                    "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(&map_out),
                    "r"(int(col0) + kBoxCols * b), "r"(int(r0)), "r"(stage_u32 + box(b))
                    : "memory");
              asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
            }
            continue;
          }
          constexpr int kChunks = 8 * BPR, kPer = kF32 ? 4 : 8;  // 16-byte pieces per row and round, values each
#pragma unroll
          for (int i = 0; i < 64 * kChunks / 128; ++i) {
            const int idx = i * 128 + tl, r = idx / kChunks, ch = idx % kChunks;
            const int64_t row = r0 + r, col = col0 + ch * kPer;
            if (row >= t.m_end || col >= args.n) continue;
            OutT* dst = out + row * args.ldo + col;
            const unsigned char* src = stage + box(ch >> 3) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
            if (vec && col + kPer <= args.n) {
              *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
            } else {
              for (int e = 0; e < kPer && col + e < args.n; ++e) dst[e] = reinterpret_cast<const OutT*>(src)[e];
            }
          }
        }
      };
      if (split_out) rounds(std::integral_constant<int, 1>{});
      else rounds(std::integral_constant<int, 2>{});
    } else {
      bool direct = false;
      if constexpr (EPI == kEpiGated)
        direct = concat_gate && !bias && args.gate.kind == kGateActMul && args.gate.activation == kActSilu;
      if (direct) {
        // silu(gate) * up, concatenated halves, no bias: computed in registers (gate and up of a column sit
        // in the same thread), staged as 16-bit pairs in two 64 x 64 boxes (128-byte swizzle) and written
        // by bulk tensor stores for 64-row blocks inside the expert, masked 16-byte stores otherwise.
        unsigned char* stage = tma_smem + (base - smem_u32(tma_smem)) + kStages * kStageBytes + c * kOutBytes;
        const int tl = tid % 128;
        if (tl == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // staging free again
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
        using T2 = std::conditional_t<std::is_same_v<T, bf16>, __nv_bfloat162, __half2>;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = warp * 16 + (lane >> 2) + half * 8;
#pragma unroll
          for (int j = 0; j < kBN / 16; ++j) {
            float y[2];
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              const float g = acc[4 * j + 2 * half + q], u = acc[4 * (j + kBN / 16) + 2 * half + q];
              y[q] = silu_fast(g) * u;
            }
            T2 v;
            v.x = from_f32<T>(y[0]);
            v.y = from_f32<T>(y[1]);
            const int off = (j >> 3) * 8192 + r * 128 + (((j & 7) ^ (r & 7)) << 4) + (lane & 3) * 4;
            *reinterpret_cast<T2*>(stage + off) = v;
          }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
        const int col0 = t.n_tile * (kBN / 2);
        if (use_tma_store && r0 + 64 <= t.m_end) {
          if (tl == 0) {
            const uint32_t stage_u32 = smem_u32(stage);
#pragma unroll
            for (int b = 0; b < 2; ++b)
              asm volatile(
                  "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(&map_out),
                  "r"(col0 + 64 * b), "r"(int(r0)), "r"(stage_u32 + b * 8192)
                  : "memory");
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
          }
        } else {
          T* out = static_cast<T*>(args.out);
          const bool vec = (args.ldo & 7) == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int idx = i * 128 + tl, r = idx >> 4, ch = idx & 15;
            const int64_t row = r0 + r, col = col0 + ch * 8;
            if (row >= t.m_end || col >= args.n) continue;
            const unsigned char* src = stage + (ch >> 3) * 8192 + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
            if (vec && col + 8 <= args.n) {
              *reinterpret_cast<uint4*>(out + row * args.ldo + col) = *reinterpret_cast<const uint4*>(src);
            } else {
              for (int e = 0; e < 8 && col + e < args.n; ++e)
                out[row * args.ldo + col + e] = reinterpret_cast<const T*>(src)[e];
            }
          }
        }
      } else {
        // 16-bit outputs: four rounds through this warpgroup's staging buffer (64 rows x 64 f32, float2
        // slots swizzled by row). Each round stages 64 virtual columns of the accumulators (plain moves),
        // then one compact loop applies bias and gate / activation and writes whole 16-byte row pieces.
        // (Unrolled per-fragment gate code and scattered 2-byte stores made the kernel several times
        // larger and ran the projection at a third of the speed.)
        unsigned char* stage = tma_smem + (base - smem_u32(tma_smem)) + kStages * kStageBytes + c * kOutBytes;
        auto slot = [](int r, int l) { return r * 256 + ((((l >> 1) ^ ((r & 7) << 2))) << 3) + (l & 1) * 4; };
        bool concat = false;
        if constexpr (EPI == kEpiGated) concat = concat_gate;
        const int out_per_round = EPI == kEpiActOnly ? 64 : 32, tl = tid % 128, r_out = tl >> 1;
        const int cnt = out_per_round / 2, o0 = (tl & 1) * cnt;
        T* out = static_cast<T*>(args.out);
        const bool vec = (args.ldo & 7) == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
        const int64_t row_g = r0 + r_out;
        const bool fast_silu =
            EPI == kEpiGated && !bias && args.gate.kind == kGateActMul && args.gate.activation == kActSilu;
        const bool fast_gated = EPI == kEpiGated && fast_gate &&
                                (args.gate.kind == kGateClampedSwiglu ||
                                 (args.gate.kind == kGateActMul && args.gate.activation == kActSilu));
#pragma unroll
        for (int round = 0; round < 4; ++round) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = warp * 16 + (lane >> 2) + half * 8;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
              const int l = jj * 8 + (lane & 3) * 2;
              const int j_concat = jj < 4 ? 4 * round + jj : kBN / 16 + 4 * round + jj - 4, j_plain = 8 * round + jj;
              float2 v;
              if (concat)
                v = make_float2(acc[4 * j_concat + 2 * half], acc[4 * j_concat + 2 * half + 1]);
              else
                v = make_float2(acc[4 * j_plain + 2 * half], acc[4 * j_plain + 2 * half + 1]);
              *reinterpret_cast<float2*>(stage + slot(r, l)) = v;
            }
          }
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
          const int64_t col0 =
              EPI == kEpiActOnly ? int64_t(t.n_tile) * kBN + 64 * round : int64_t(t.n_tile) * (kBN / 2) + 32 * round;
          if (fast_silu && row_g < t.m_end) {
            // silu(gate) * up without bias, unrolled for instruction-level parallelism
#pragma unroll
            for (int g8 = 0; g8 < out_per_round / 2; g8 += 8) {
              alignas(16) T y[8];
#pragma unroll
              for (int e = 0; e < 8; ++e) {
                const int o = o0 + g8 + e;
                const float g = *reinterpret_cast<const float*>(stage + slot(r_out, concat ? o : 2 * o));
                const float u = *reinterpret_cast<const float*>(stage + slot(r_out, concat ? 32 + o : 2 * o + 1));
                y[e] = from_f32<T>(silu_fast(g) * u);
              }
              const int64_t col = col0 + o0 + g8;
              if (vec && col + 8 <= args.n) {
                *reinterpret_cast<uint4*>(out + row_g * args.ldo + col) = *reinterpret_cast<const uint4*>(y);
              } else {
#pragma unroll
                for (int e = 0; e < 8; ++e)
                  if (col + e < args.n) out[row_g * args.ldo + col + e] = y[e];
              }
            }
          } else if (fast_gated && row_g < t.m_end) {
            // silu(gate) * up or gpt-oss's clamped SwiGLU, with biases, in the hardware approximations of the
            // fast silu path above (silu_fast; __expf and __fdividef for the clamped gate's sigmoid), unrolled over
            // 8 outputs with the 16 biases loaded first, 16 bytes at a time where aligned.
            const bool clamped = args.gate.kind == kGateClampedSwiglu;
            const float limit = args.gate.limit, alpha = args.gate.alpha;
#pragma unroll 1
            for (int g8 = 0; g8 < out_per_round / 2; g8 += 8) {
              const int64_t col = col0 + o0 + g8;
              float bg[8], bu[8];
#pragma unroll
              for (int e = 0; e < 8; ++e) bg[e] = bu[e] = 0.0f;
              if (bias) {
                const T* pg = bias + gate_row(args.gate, col);
                const T* pu = bias + up_row(args.gate, col, args.inter);
                const bool al_g = (reinterpret_cast<uintptr_t>(pg) & 15) == 0;
                const bool al_u = (reinterpret_cast<uintptr_t>(pu) & 15) == 0;
                if (col + 8 <= args.n && concat && al_g && al_u) {
                  alignas(16) T vg[8], vu[8];
                  *reinterpret_cast<uint4*>(vg) = *reinterpret_cast<const uint4*>(pg);
                  *reinterpret_cast<uint4*>(vu) = *reinterpret_cast<const uint4*>(pu);
#pragma unroll
                  for (int e = 0; e < 8; ++e) bg[e] = to_f32(vg[e]), bu[e] = to_f32(vu[e]);
                } else if (col + 8 <= args.n && !concat && al_g) {  // g0 u0 g1 u1 ...: 16 in a row
                  alignas(16) T v[16];
                  *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(pg);
                  *reinterpret_cast<uint4*>(v + 8) = *reinterpret_cast<const uint4*>(pg + 8);
#pragma unroll
                  for (int e = 0; e < 8; ++e) bg[e] = to_f32(v[2 * e]), bu[e] = to_f32(v[2 * e + 1]);
                } else {
#pragma unroll
                  for (int e = 0; e < 8; ++e)
                    if (col + e < args.n)
                      bg[e] = to_f32(bias[gate_row(args.gate, col + e)]),
                      bu[e] = to_f32(bias[up_row(args.gate, col + e, args.inter)]);
                }
              }
              alignas(16) T y[8];
#pragma unroll
              for (int e = 0; e < 8; ++e) {
                const int o = o0 + g8 + e;
                float g = *reinterpret_cast<const float*>(stage + slot(r_out, concat ? o : 2 * o));
                float u = *reinterpret_cast<const float*>(stage + slot(r_out, concat ? 32 + o : 2 * o + 1));
                if (bias && col + e < args.n) g += bg[e], u += bu[e];
                float v;
                if (clamped) {  // act::clamped_swiglu's clamps; its sigmoid by the approximations
                  g = g < limit ? g : limit;
                  u = u < -limit ? -limit : (u > limit ? limit : u);
                  v = (u + 1.0f) * g * __fdividef(1.0f, 1.0f + __expf(-alpha * g));
                } else {
                  v = silu_fast(g) * u;
                }
                y[e] = from_f32<T>(v);
              }
              if (vec && col + 8 <= args.n) {
                *reinterpret_cast<uint4*>(out + row_g * args.ldo + col) = *reinterpret_cast<const uint4*>(y);
              } else {
#pragma unroll
                for (int e = 0; e < 8; ++e)
                  if (col + e < args.n) out[row_g * args.ldo + col + e] = y[e];
              }
            }
          } else if (row_g < t.m_end) {
#pragma unroll 1
            for (int g8 = 0; g8 < cnt; g8 += 8) {
              alignas(16) T y[8];
#pragma unroll 1
              for (int e = 0; e < 8; ++e) {
                const int o = o0 + g8 + e;
                const int64_t col = col0 + o;
                float v;
                if constexpr (EPI == kEpiGated) {
                  float g = *reinterpret_cast<const float*>(stage + slot(r_out, concat ? o : 2 * o));
                  float u = *reinterpret_cast<const float*>(stage + slot(r_out, concat ? 32 + o : 2 * o + 1));
                  if (bias && col < args.n) {
                    g += to_f32(bias[gate_row(args.gate, col)]);
                    u += to_f32(bias[up_row(args.gate, col, args.inter)]);
                  }
                  v = gate_value(args.gate, g, u);
                } else {
                  v = *reinterpret_cast<const float*>(stage + slot(r_out, o));
                  if (bias && col < args.n) v += to_f32(bias[col]);
                  v = activate(args.gate.activation, v);
                }
                y[e] = from_f32<T>(v);
              }
              const int64_t col = col0 + o0 + g8;
              if (vec && col + 8 <= args.n) {
                *reinterpret_cast<uint4*>(out + row_g * args.ldo + col) = *reinterpret_cast<const uint4*>(y);
              } else {
                for (int e = 0; e < 8 && col + e < args.n; ++e) out[row_g * args.ldo + col + e] = y[e];
              }
            }
          }
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
        }
      }
    }
  }
  if (tid % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // bulk stores read out
  if (pair) cluster_sync_all();  // no arrival from the peer still on its way to this CTA's barriers
#endif
}

bool tma_compiled_for(int arch) {
  if (arch != 90) return false;
  static PerDeviceValue known;  // 1 yes, 0 no
  return known.get(
             [](int) {
               cudaFuncAttributes attr{};
               const bool ok = cudaFuncGetAttributes(&attr, grouped_gemm_tma_kernel<bf16, kEpiF32>) == cudaSuccess &&
                               attr.binaryVersion == 90 && attr.ptxVersion >= 90 && sm90::encode_fn() != nullptr;
               (void)cudaGetLastError();
               return ok ? 1 : 0;
             },
             0) == 1;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Weight rows per expert that the B boxes may address.
int64_t weight_rows(const GroupedGemmArgs& a) { return a.epilogue == kEpiGated ? 2 * a.inter : a.n; }

// The form follows the route tile: ping-pong (items of 64 rows, one warpgroup each) for route tiles of 64,
// cooperative (tiles of 128 rows, both warpgroups) for 128. Measured on the H200 (docs/perf.md): ping-pong
// over 128-row route tiles ran the many-tile projections 5-20% slower (each stage feeds half the MMAs, so
// the 4-stage ring hides half the latency and the weights are fetched twice per 128 rows), and 10% faster
// where the experts hold few rows. grouped_tma_tile_m picks 64 up to 384 rows per busy expert on average
// for contiguous A rows and up to 128 for gathered ones (sonicmoe: at 256-512 rows ping-pong ran it 1-3%
// slower end to end, deepgemm and grouped_mm 0-6% faster; at 1024 and more rows all slower; 512 rows was
// measured on one preset only, so the limit stays under it),
// while ping-pong is allowed: on unless set_grouped_gemm_tma_pingpong(false) or MOEKIT_TMA_PINGPONG=0.
// MOEKIT_TMA_PINGPONG=N (N >= 2) sets the limit to N rows for both (a measurement knob).
std::atomic<int> g_pingpong{-1};  // 0: off; 1: the limits above; N >= 2: limit N; -1: not read yet
int pingpong_setting() {
  int v = g_pingpong.load();
  if (v < 0) {
    const int64_t n = env_int("MOEKIT_TMA_PINGPONG", 1);
    v = n == 0 ? 0 : (n >= 2 && n < (int64_t(1) << 30) ? int(n) : 1);
    int expected = -1;
    if (!g_pingpong.compare_exchange_strong(expected, v)) v = expected;
  }
  return v;
}
bool pingpong_on() { return pingpong_setting() > 0; }

// The weighted and f32 epilogues' staging schedule (see the kernel): rounds of one box alternating between
// the buffer's halves (default), or rounds of two boxes (set_grouped_gemm_tma_split_out(false), or
// MOEKIT_TMA_SPLIT_OUT=0 in the environment).
EnvSwitch g_split_out{"MOEKIT_TMA_SPLIT_OUT", true};
bool split_out_on() { return g_split_out.on(); }
// The gated 16-bit epilogue with biases or gpt-oss's clamped SwiGLU: unrolled with its biases loaded first, in
// hardware approximations (default), or the generic per-value loop (MOEKIT_TMA_FAST_GATE=0 in the environment, read
// once, or set_grouped_gemm_tma_fast_gate(false)).
EnvSwitch g_fast_gate{"MOEKIT_TMA_FAST_GATE", true};
// A cooperative tile whose rows all fall in its first warpgroup's 64 (an expert's last tile): the second warpgroup
// waits for each stage and releases it without multiplying (MOEKIT_TMA_SKIP_IDLE=1, or
// set_grouped_gemm_tma_skip_idle(true); the first runs its MMAs alone), or multiplies rows it will not store
// (default: skipping measured no faster, sonicmoe 3-5% slower on the fine-grained shapes at T = 4096). Same bits
// either way.
EnvSwitch g_skip_idle{"MOEKIT_TMA_SKIP_IDLE", false};
// Ping-pong over pairs of CTAs (MOEKIT_TMA_PAIR=1, or set_grouped_gemm_tma_pair(true)): where ping-pong is picked, the
// route tiles are of 128 rows and a cluster of two CTAs takes each, one 64-row item per CTA; each CTA's producer
// loads its own A rows and one of the two weight boxes, multicast into both CTAs, so each weight byte leaves L2
// once per 128 rows instead of once per 64. A CTA whose 64 rows lie past the expert's end still loads its box and
// releases the stages without MMAs (the padding of the cooperative form's tiles; the peer needs the box).
// Off: measured 2.6-2.9x slower with cluster-scope releases (qwen3-30b-a3b T = 4096, H200 and H100), its warps
// stalled on the release of each remote arrival and on barriers, and still 1.08-1.17x slower than the forms it would replace with
// CTA-scope releases (H100; docs/perf.md, 2026-12-07).
EnvSwitch g_pair{"MOEKIT_TMA_PAIR", false};
// The pair form's consumers release each stage in both CTAs with arrivals released at CTA scope (default, as
// CUTLASS's cluster barrier arrives: the first projection 1203 -> 463 us, membar stalls 9.5 -> 0.05 cycles per
// instruction) or at cluster scope (MOEKIT_TMA_PAIR_CTA_RELEASE=0, or set_grouped_gemm_tma_pair_cta_release(false)).
// Same bits.
EnvSwitch g_pair_cta_release{"MOEKIT_TMA_PAIR_CTA_RELEASE", true};

// The engine's form for these sizes: 0 cooperative, 1 ping-pong (route tiles of 64), 2 ping-pong over CTA pairs
// (route tiles of 128).
int tma_form(int64_t pairs, int experts, bool gathered_a) {
  const int v = pingpong_setting();
  if (v == 0) return 0;
  const int64_t limit = v == 1 ? (gathered_a ? 128 : 384) : v;
  const int64_t busy = std::min<int64_t>(pairs, experts);
  const int64_t avg = busy > 0 ? (pairs + busy - 1) / busy : 1;
  if (avg > limit) return 0;
  return g_pair.on() ? 2 : 1;
}

// A launch of `grid` CTAs of the kernel in clusters of two (`attr`: the storage of its one attribute).
cudaLaunchConfig_t pair_launch(unsigned grid, cudaStream_t stream, cudaLaunchAttribute& attr) {
  attr = cudaLaunchAttribute{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 2;
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters of two of this kernel that fit on the device at once (cached per device; 0 if the query fails). One cache
// for every instantiation: they share the block size, the shared memory and one CTA per multiprocessor.
int pair_clusters(const void* kernel) {
  static PerDeviceValue known;
  return known.get(
      [kernel](int) {
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg = pair_launch(unsigned(2 * sm90::sm_count()), nullptr, attr);
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) clusters = 0;
        (void)cudaGetLastError();
        return clusters;  // a failed query is kept as none: the pair form is then never taken
      },
      0);
}

template <class T, int EPI>
cudaError_t launch_tma(const GroupedGemmArgs& a, cudaStream_t stream) {
  const auto encode = sm90::encode_fn();
  if (!encode) return cudaErrorNotSupported;
  const bool pair = a.tile_m == 128 && tma_form(a.max_rows, a.experts, a.a_rows != nullptr) == 2;
  const bool pp = a.tile_m == 64 || pair;
  const int rows = pp ? 64 : kBM;
  const CUtensorMapDataType dt =
      std::is_same_v<T, bf16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap map_a{}, map_b{}, map_out{};
  if (!a.a_rows) {  // contiguous A rows (gathered rows are loaded by the producer warpgroup)
    const cuuint64_t dims[2] = {cuuint64_t(a.k), cuuint64_t(a.max_rows)};
    const cuuint64_t strides[1] = {cuuint64_t(a.lda) * 2};
    const cuuint32_t box[2] = {kBK, cuuint32_t(rows)}, estr[2] = {1, 1};
    if (encode(&map_a, dt, 2, const_cast<void*>(a.a), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return cudaErrorInvalidValue;
  }
  {
    const cuuint64_t dims[3] = {cuuint64_t(a.k), cuuint64_t(weight_rows(a)), cuuint64_t(a.experts)};
    const cuuint64_t strides[2] = {cuuint64_t(a.b_stride_n) * 2, cuuint64_t(a.b_expert_stride) * 2};
    const cuuint32_t box[3] = {kBK, 128, 1}, estr[3] = {1, 1, 1};
    if (encode(&map_b, dt, 3, const_cast<void*>(a.b), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return cudaErrorInvalidValue;
  }
  // f32 and gated 16-bit outputs: bulk tensor stores where the row stride and address allow (else masked stores)
  bool tma_store = false;
  if ((EPI == kEpiGated || EPI == kEpiWeighted) && a.ldo % 8 == 0 && aligned16(a.out)) {  // 16-bit: 64 x 64 boxes
    const cuuint64_t dims[2] = {cuuint64_t(a.n), cuuint64_t(a.max_rows)};
    const cuuint64_t strides[1] = {cuuint64_t(a.ldo) * 2};
    const cuuint32_t box[2] = {64, 64}, estr[2] = {1, 1};
    tma_store = encode(&map_out, dt, 2, a.out, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                       CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  }
  if (EPI == kEpiF32 && a.ldo % 4 == 0 && aligned16(a.out)) {
    const cuuint64_t dims[2] = {cuuint64_t(a.n), cuuint64_t(a.max_rows)};
    const cuuint64_t strides[1] = {cuuint64_t(a.ldo) * 4};
    const cuuint32_t box[2] = {32, 64}, estr[2] = {1, 1};
    tma_store = encode(&map_out, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, a.out, dims, strides, box, estr,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  }
  auto kernel = grouped_gemm_tma_kernel<T, EPI>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes));
  if (err != cudaSuccess) return err;
  const int64_t cols = EPI == kEpiGated ? kBN / 2 : kBN;
  if (pair) {  // clusters of two CTAs, one per route tile of 128 rows at a time
    // MOEKIT_TMA_PAIR_CLUSTERS=N: N clusters at most instead of the occupancy query's (a measurement knob)
    static const int forced = int(env_int_in("MOEKIT_TMA_PAIR_CLUSTERS", 0, 1 << 16, 0));
    const int fit = forced > 0 ? forced : pair_clusters(reinterpret_cast<const void*>(kernel));
    if (fit <= 0) return cudaErrorNotSupported;
    const int64_t work = grouped_max_tiles(a.max_rows, a.experts, a.tile_m) * ((a.n + cols - 1) / cols);
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = pair_launch(unsigned(2 * std::min<int64_t>(work, fit)), stream, attr);
    return cudaLaunchKernelEx(&cfg, kernel, map_a, map_b, map_out, tma_store, pp, split_out_on(), g_fast_gate.on(),
                              g_skip_idle.on(), g_pair_cta_release.on() ? kPairCtaRelease : kPairClusterRelease, a);
  }
  const int64_t work = grouped_max_tiles(a.max_rows, a.experts, rows) * ((a.n + cols - 1) / cols);
  const int grid = int(std::min<int64_t>(work, sm90::sm_count()));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(map_a, map_b, map_out, tma_store, pp, split_out_on(), g_fast_gate.on(),
                                                 g_skip_idle.on(), kPairOff, a);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_tma_epi(const GroupedGemmArgs& a, cudaStream_t stream) {
  switch (a.epilogue) {
    case kEpiWeighted:
      return launch_tma<T, kEpiWeighted>(a, stream);
    case kEpiGated:
      return launch_tma<T, kEpiGated>(a, stream);
    case kEpiActOnly:
      return launch_tma<T, kEpiActOnly>(a, stream);
    case kEpiF32:
      return launch_tma<T, kEpiF32>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool grouped_gemm_tma_ok(const GroupedGemmArgs& a, int arch) {
  if (a.type != Elem::bf16 && a.type != Elem::f16) return false;
  if (a.b_stride_k != 1 || (a.a_rows && a.a_row_div < 1)) return false;
  if (a.tile_m != 128 && a.tile_m != 64) return false;
  if (a.epilogue == kEpiWeighted && !a.row_pair != !a.row_weights) return false;
  if (a.k % 8 || a.lda % 8 || a.b_stride_n % 8 || a.b_expert_stride % 8 || a.k > a.b_stride_n) return false;
  if (!aligned16(a.a) || !aligned16(a.b)) return false;
  if (a.experts <= 0 || a.max_rows >= (int64_t(1) << 31) || weight_rows(a) >= (int64_t(1) << 31)) return false;
  return tma_compiled_for(arch);
}

bool grouped_gemm_tma_built_for(int arch) { return tma_compiled_for(arch); }

bool grouped_gemm_tma_pingpong() { return pingpong_on(); }
bool set_grouped_gemm_tma_split_out(bool on) { return g_split_out.set(on); }
bool set_grouped_gemm_tma_fast_gate(bool on) { return g_fast_gate.set(on); }
bool set_grouped_gemm_tma_skip_idle(bool on) { return g_skip_idle.set(on); }
bool set_grouped_gemm_tma_pair(bool on) { return g_pair.set(on); }
bool set_grouped_gemm_tma_pair_cta_release(bool on) { return g_pair_cta_release.set(on); }
int grouped_tma_tile_m(int64_t pairs, int experts, bool gathered_a) {
  return tma_form(pairs, experts, gathered_a) == 1 ? 64 : 128;
}
bool set_grouped_gemm_tma_pingpong(bool on) {
  const int v = pingpong_setting();
  g_pingpong.store(on ? (v > 0 ? v : 1) : 0);
  return v > 0;
}

cudaError_t grouped_gemm_tma(const GroupedGemmArgs& a, cudaStream_t stream) {
  if (a.max_rows == 0 || a.n == 0) return cudaSuccess;
  if (a.type == Elem::bf16) return launch_tma_epi<bf16>(a, stream);
  if (a.type == Elem::f16) return launch_tma_epi<f16>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace moekit::cuda::kernels

// grouped_mm on the CPU: pairs sorted by expert (routing/), one grouped GEMM per projection over the sorted rows
// (every (expert, column tile) is one task, all experts at once), then unsort and combine (common.h).
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "backends/backends.h"
#include "backends/cpu/common.h"
#include "base/env.h"
#include "base/parallel.h"

namespace moekit::cpu {
namespace {
// MOEKIT_CPU_PHASES (any value): the mean wall time per call of each phase of the bf16 path, per row count, printed
// to stderr at exit (a diagnostic for the benchmarks; calls from several threads at once are serialised while it is on).
struct PhaseClock {
  bool on = std::getenv("MOEKIT_CPU_PHASES") != nullptr;
  std::mutex mutex;
  std::map<long, std::array<double, 7>> t;  // rows -> 6 phases, calls
  std::chrono::steady_clock::time_point last;
  void mark(int i, long rows) {  // phase i of a call ends (under the PhaseScope of the call)
    if (!on) return;
    auto now = std::chrono::steady_clock::now();
    auto& v = t[rows];
    v[size_t(i)] += std::chrono::duration<double>(now - last).count() * 1e3;
    if (i == 5) v[6] += 1;
    last = now;
  }
  ~PhaseClock() {
    if (!on) return;
    static const char* names[6] = {"route+alloc", "gather", "up", "gate", "down", "combine"};
    for (auto& [rows, v] : t) {
      std::fprintf(stderr, "phases rows %ld calls %.0f, ms per call:", rows, v[6]);
      for (int i = 0; i < 6; ++i) std::fprintf(stderr, " %s %.2f", names[i], v[6] > 0 ? v[size_t(i)] / v[6] : 0.0);
      std::fprintf(stderr, "\n");
    }
  }
};
PhaseClock& phase_clock() { static PhaseClock c; return c; }
// Holds the clock for one bf16 call (when on): its phases are timed from here, calls from other threads wait.
class PhaseScope {
 public:
  explicit PhaseScope(bool bf16) : c_(phase_clock()), on_(c_.on && bf16) {
    if (!on_) return;
    c_.mutex.lock();
    c_.last = std::chrono::steady_clock::now();
  }
  ~PhaseScope() {
    if (on_) c_.mutex.unlock();
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  PhaseClock& c_;
  bool on_;
};

struct Tile {
  int64_t expert, n0, n1;
  int64_t m0 = 0, m1 = 0;  // rows of the expert (bf16 tiles only; the f32 tiles take all rows)
};

// Column tiles of every active expert, largest experts first (they take longest).
std::vector<Tile> grouped_tiles(const ExpertRouting& r, int64_t n, int64_t tile_n) {
  std::vector<int64_t> experts = r.active_experts();
  std::stable_sort(experts.begin(), experts.end(),
                   [&](int64_t a, int64_t b) { return r.counts[size_t(a)] > r.counts[size_t(b)]; });
  std::vector<Tile> tiles;
  for (const int64_t e : experts)
    for (int64_t n0 = 0; n0 < n; n0 += tile_n) tiles.push_back({e, n0, std::min(n, n0 + tile_n)});
  return tiles;
}

// MOEKIT_BF16_TAIL=N (0 to 16; default 0, for A/B runs): the last N x threads tasks of decode-sized experts (below
// the AMX rows, 128 columns each) are cut into quarters of 32 columns. A phase ends when the last thread's last task
// does; on the 16-core host a fixed even split ran 1.36-1.51x slower than these tasks handed out as threads come
// free (its threads, it seems, stream at unequal rates), and a whole 128-column task is 75 us of qwen3-30b-a3b's
// 440 us first projection at T = 1; quarters at the end of the list cut that wait (each reads 2 panels in lockstep
// instead of 8).
const int64_t kTailTasksPerThread = env_int_in("MOEKIT_BF16_TAIL", 1, 16, 0);

// bf16 tiles: (expert, row block, column range), largest experts first. Row blocks (bf16_tile_m) split the
// experts that got many rows, so one popular expert does not leave the other threads idle at the end; column ranges
// as wide as bf16_task_cols allows keep the expert's rows in the core's L2 over many weight panels.
std::vector<Tile> bf16_tiles(const ExpertRouting& r, int64_t n) {
  std::vector<int64_t> experts = r.active_experts();
  std::stable_sort(experts.begin(), experts.end(),
                   [&](int64_t a, int64_t b) { return r.counts[size_t(a)] > r.counts[size_t(b)]; });
  int64_t row_tasks = 0;
  for (const int64_t e : experts) {
    const int64_t m = r.counts[size_t(e)];
    row_tasks += (m + bf16_tile_m(m) - 1) / bf16_tile_m(m);
  }
  const int64_t width = bf16_task_cols(n, row_tasks);
  std::vector<Tile> tiles;
  for (const int64_t e : experts) {
    // Decode-sized experts (below the AMX rows) share nothing across columns: narrow tasks, spread over more threads.
    const int64_t m = r.counts[size_t(e)], tm = bf16_tile_m(m), w = m < kAmxMinRows ? kBf16TileN : width;
    for (int64_t m0 = 0; m0 < m; m0 += tm)
      for (int64_t n0 = 0; n0 < n; n0 += w) tiles.push_back({e, n0, std::min(n, n0 + w), m0, std::min(m, m0 + tm)});
  }
  const int64_t tail = kTailTasksPerThread * omp_get_max_threads();
  if (tail > 0 && int64_t(tiles.size()) > 1) {  // the list ends with the smallest experts: those are decode-sized
    const size_t first = size_t(std::max<int64_t>(0, int64_t(tiles.size()) - tail));
    std::vector<Tile> cut(tiles.begin(), tiles.begin() + std::ptrdiff_t(first));
    for (size_t i = first; i < tiles.size(); ++i) {
      const Tile& t = tiles[i];
      if (t.m1 - t.m0 >= kAmxMinRows) {
        cut.push_back(t);
        continue;
      }
      for (int64_t n0 = t.n0; n0 < t.n1; n0 += kBf16TileN / 4)
        cut.push_back({t.expert, n0, std::min(t.n1, n0 + kBf16TileN / 4), t.m0, t.m1});
    }
    tiles = std::move(cut);
  }
  return tiles;
}

// The two projections on the bf16 tile over packed weights (Plan::packed): bf16 input rows gathered as they are,
// the gate's bf16 results written straight into the down projection's rows.
void grouped_bf16(const Plan& p, const ExpertsCall& call, const ExpertRouting& r, float* y, float* h1,
                  const int64_t* row_expert) {
  const int64_t rows = r.routed(), H = p.H, N1 = p.N1;
  const GemmKernels& k = *p.kernels;
  const int64_t ld1 = bf16_row_ld(p.packed->kp1), ld2 = bf16_row_ld(p.packed->kp2);
  PhaseClock& pc = phase_clock();
  pc.mark(0, rows);
  const Bf16Buffer xa = gather_bf16_rows(p, call, r.sorted_pairs.data(), rows, ld1);
  pc.mark(1, rows);
  const std::vector<Tile> up = bf16_tiles(r, N1);
  parallel_tasks(int64_t(up.size()), 0, rows * N1 * H, [&](int64_t i, float*) {
    const Tile& t = up[size_t(i)];
    const int64_t r0 = r.offsets[size_t(t.expert)] + t.m0;
    k.gemm_bf16_tile(xa.get() + r0 * ld1, ld1, t.m1 - t.m0, p.first_packed(t.expert), t.n0, t.n1, h1 + r0 * N1, N1);
  });
  pc.mark(2, rows);
  const Bf16Buffer ha = gated_bf16_rows(p, h1, rows, row_expert, ld2);
  pc.mark(3, rows);
  const std::vector<Tile> down = bf16_tiles(r, H);
  parallel_tasks(int64_t(down.size()), 0, rows * H * p.I, [&](int64_t i, float*) {
    const Tile& t = down[size_t(i)];
    const int64_t r0 = r.offsets[size_t(t.expert)] + t.m0, m = t.m1 - t.m0;
    k.gemm_bf16_tile(ha.get() + r0 * ld2, ld2, m, p.down_packed(t.expert), t.n0, t.n1, y + r0 * H, H);
    down_epilogue(p, t.expert, y + r0 * H, H, m, t.n0, t.n1);
  });
  pc.mark(4, rows);
}

// The two projections on quantized (FP8 / FP4) weights: activations quantized per row and 128 inputs, (expert, column tile) tasks
// over all rows of the expert, weights decoded in the tile.
void grouped_fp8(const Plan& p, const ExpertRouting& r, float* xy, float* h1, const int64_t* row_expert) {
  const int64_t rows = r.routed(), H = p.H, N1 = p.N1;
  const Fp8Rows xa = fp8_rows(p, xy, H, rows, H);
  const std::vector<Tile> up = grouped_tiles(r, N1, kFp8TileN);
  parallel_tasks(int64_t(up.size()), fp8_work_floats(H), rows * N1 * H, [&](int64_t i, float* work) {
    const Tile& t = up[size_t(i)];
    const int64_t r0 = r.offsets[size_t(t.expert)];
    quant_tile(p, false, t.expert, xa, r0, r.counts[size_t(t.expert)], t.n0, t.n1, h1 + r0 * N1, N1, work);
  });
  parallel_for(rows, 8, rows * N1 * kGateCost, [&](int64_t i) { first_epilogue_row(p, row_expert[i], h1 + i * N1); });
  const Fp8Rows ha = fp8_rows(p, h1, N1, rows, p.I);
  const std::vector<Tile> down = grouped_tiles(r, H, kFp8TileN);
  parallel_tasks(int64_t(down.size()), fp8_work_floats(p.I), rows * H * p.I, [&](int64_t i, float* work) {
    const Tile& t = down[size_t(i)];
    const int64_t r0 = r.offsets[size_t(t.expert)], m = r.counts[size_t(t.expert)];
    quant_tile(p, true, t.expert, ha, r0, m, t.n0, t.n1, xy + r0 * H, H, work);
    down_epilogue(p, t.expert, xy + r0 * H, H, m, t.n0, t.n1);
  });
}

void grouped_chunk(const Plan& p, const ExpertsCall& call) {
  const PhaseScope phases(p.packed != nullptr);
  const ExpertRouting r = route_top_k(call.top_k_index.data, call.top_k_index.dtype, call.tokens(), call.top_k(), p.E);
  const int64_t rows = r.routed(), H = p.H, N1 = p.N1;
  const GemmKernels& k = *p.kernels;
  FloatBuffer xy = make_buffer(rows * H);   // [rows, H] gathered inputs, then down outputs (sorted by expert)
  FloatBuffer h1 = make_buffer(rows * N1);  // [rows, N1] first projection; gated activations in [:, :I]
  std::vector<int64_t> row_expert(static_cast<size_t>(rows));  // [rows]
  for (int64_t e = 0; e < p.E; ++e)
    for (int64_t i = r.offsets[size_t(e)]; i < r.offsets[size_t(e + 1)]; ++i) row_expert[size_t(i)] = e;

  if (p.packed) {
    grouped_bf16(p, call, r, xy.get(), h1.get(), row_expert.data());
    combine(p, call, xy.get(), H, r.position.data());
    phase_clock().mark(5, rows);
    return;
  }
  gather_rows(p, call, r.sorted_pairs.data(), rows, xy.get());
  if (p.quantized()) {
    grouped_fp8(p, r, xy.get(), h1.get(), row_expert.data());
    combine(p, call, xy.get(), H, r.position.data());
    return;
  }
  const std::vector<Tile> up = grouped_tiles(r, N1, k.max_tile_n);
  parallel_tasks(int64_t(up.size()), k.work_floats, rows * N1 * H, [&](int64_t i, float* work) {
    const Tile& t = up[size_t(i)];
    const int64_t r0 = r.offsets[size_t(t.expert)];
    k.gemm_tile(xy.get() + r0 * H, H, r.counts[size_t(t.expert)], p.first(t.expert), t.n0, t.n1, h1.get() + r0 * N1, N1,
                work);
  });
  parallel_for(rows, 8, rows * N1 * kGateCost,
               [&](int64_t i) { first_epilogue_row(p, row_expert[size_t(i)], h1.get() + i * N1); });

  const std::vector<Tile> down = grouped_tiles(r, H, k.max_tile_n);
  parallel_tasks(int64_t(down.size()), k.work_floats, rows * H * p.I, [&](int64_t i, float* work) {
    const Tile& t = down[size_t(i)];
    const int64_t r0 = r.offsets[size_t(t.expert)], m = r.counts[size_t(t.expert)];
    k.gemm_tile(h1.get() + r0 * N1, N1, m, p.down(t.expert), t.n0, t.n1, xy.get() + r0 * H, H, work);
    down_epilogue(p, t.expert, xy.get() + r0 * H, H, m, t.n0, t.n1);
  });

  combine(p, call, xy.get(), H, r.position.data());
}

}  // namespace

void grouped_mm(const Experts& experts, const ExpertsCall& call) {
  const Plan p = make_plan(experts, call);
  for_each_token_chunk(call, p.H + p.N1, [&](const ExpertsCall& c) { grouped_chunk(p, c); });
}

}  // namespace moekit::cpu

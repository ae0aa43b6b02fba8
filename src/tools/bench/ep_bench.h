// Internal: `moekit bench --ep N`: one layer's experts over an expert-parallel group, both modes, against the
// whole layer on one device, with the all-to-all volume and the time of each stage beside the experts' time.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "bench/presets.h"
#include "moekit/parallel.h"

namespace moekit::bench {

struct EpBenchOptions {
  std::vector<ShapePreset> shapes;
  std::vector<int64_t> tokens = {1, 16, 256, 4096};  // T: the layer's tokens (replicated on every rank)
  std::string backend = "grouped_mm";                // the experts backend of every rank (and of the reference)
  DType dtype = DType::bf16;
  int warmup = 2, iters = 10;
  uint64_t seed = 1;
  bool reference = true;  // also time the whole layer on rank 0's device alone (all E experts)
};

// Times (medians, milliseconds; each the slowest rank's) and volumes (bytes over all ranks) of one case.
struct EpBenchRecord {
  std::string shape;
  int64_t tokens = 0;
  int ranks = 0;
  double one_device_ms = -1;  // the whole layer on one device (-1: not measured)
  // all_reduce (transformers): local experts over every token, then one all-reduce of [T, H]
  double ar_total_ms = 0, ar_experts_ms = 0, ar_allreduce_ms = 0;
  int64_t ar_bytes = 0;  // per rank: T * H elements
  double ar2_total_ms = 0, ar4_total_ms = 0;  // all_reduce in 2 / 4 chunks, all-reduces overlapping the experts
  double ar4_rel_err = -1;
  // all_to_all: each rank dispatches its T / N tokens; stages timed with a synchronisation each
  double a2a_total_ms = 0, a2a_plan_ms = 0, a2a_dispatch_ms = 0, a2a_experts_ms = 0, a2a_combine_ms = 0;
  int64_t a2a_dispatch_bytes = 0, a2a_combine_bytes = 0;  // between distinct ranks, summed over ranks
  double ar_rel_err = -1, a2a_rel_err = -1;               // vs the one-device output (rank 0)
};

// Runs every case on this rank of `group` (every rank calls it with the same options); the records are
// complete on rank 0.
std::vector<EpBenchRecord> run_ep_bench(const EpBenchOptions& o, const ExpertGroupPtr& group);
std::string format_ep_table(const std::vector<EpBenchRecord>& records, const std::string& card);
std::string ep_records_to_json(const std::vector<EpBenchRecord>& records, const std::string& card,
                               const std::string& command);

}  // namespace moekit::bench

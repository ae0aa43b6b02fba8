// Internal: top-k routing on the CPU. Groups the (token, slot) pairs by expert with a stable counting sort:
// within an expert, pairs keep their order p = t * K + k. Pairs whose id is the expert-parallel sentinel (E) are
// dropped: they are neither counted nor placed, and contribute exactly zero.
#pragma once
#include <cstdint>
#include <vector>

#include "moekit/dtype.h"

namespace moekit {

struct ExpertRouting {
  int64_t tokens = 0, top_k = 0, num_experts = 0;
  std::vector<int64_t> counts;        // [E] routed pairs per expert
  std::vector<int64_t> offsets;       // [E + 1] exclusive prefix sum of counts; offsets[E] = routed pairs
  std::vector<int64_t> sorted_pairs;  // [routed] pair p = t * K + k, by expert, then by p
  std::vector<int64_t> position;      // [T * K] row of pair p in sorted_pairs; -1 for a sentinel
  int64_t routed() const { return offsets.empty() ? 0 : offsets.back(); }
  std::vector<int64_t> active_experts() const;  // experts with count > 0, ascending
};

// top_k_index: [tokens, top_k] int32 or int64, contiguous, ids in [0, E] (E = sentinel). Throws naming the first
// id out of range.
ExpertRouting route_top_k(const void* top_k_index, DType index_dtype, int64_t tokens, int64_t top_k,
                          int64_t num_experts);

}  // namespace moekit

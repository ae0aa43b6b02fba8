#include "routing/routing.h"

#include "moekit/error.h"

namespace moekit {
namespace {

template <class I>
void route_typed(const I* ids, ExpertRouting& r) {
  const int64_t n = r.tokens * r.top_k, E = r.num_experts;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t e = int64_t(ids[p]);
    MOEKIT_CHECK(e >= 0 && e <= E, "top_k_index[", p / r.top_k, ", ", p % r.top_k, "] = ", e, " is out of range [0, ",
                 E, "] (", E, " experts; id ", E, " marks an expert on another rank)");
    if (e < E) ++r.counts[size_t(e)];
  }
  for (int64_t e = 0; e < E; ++e) r.offsets[size_t(e + 1)] = r.offsets[size_t(e)] + r.counts[size_t(e)];
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  r.sorted_pairs.resize(size_t(r.offsets[size_t(E)]));
  for (int64_t p = 0; p < n; ++p) {
    const int64_t e = int64_t(ids[p]);
    if (e == E) {
      r.position[size_t(p)] = -1;
      continue;
    }
    const int64_t row = next[size_t(e)]++;
    r.sorted_pairs[size_t(row)] = p;
    r.position[size_t(p)] = row;
  }
}

}  // namespace

std::vector<int64_t> ExpertRouting::active_experts() const {
  std::vector<int64_t> out;
  for (int64_t e = 0; e < num_experts; ++e)
    if (counts[size_t(e)] > 0) out.push_back(e);
  return out;
}

ExpertRouting route_top_k(const void* top_k_index, DType index_dtype, int64_t tokens, int64_t top_k,
                          int64_t num_experts) {
  MOEKIT_CHECK(tokens >= 0 && top_k >= 0, "route_top_k: bad shape [", tokens, ", ", top_k, "]");
  MOEKIT_CHECK(num_experts > 0, "route_top_k: num_experts must be > 0, got ", num_experts);
  MOEKIT_CHECK(index_dtype == DType::i32 || index_dtype == DType::i64,
               "route_top_k: top_k_index dtype must be i32 or i64, got ", dtype_name(index_dtype));
  ExpertRouting r;
  r.tokens = tokens;
  r.top_k = top_k;
  r.num_experts = num_experts;
  r.counts.assign(size_t(num_experts), 0);
  r.offsets.assign(size_t(num_experts + 1), 0);
  r.position.assign(size_t(tokens * top_k), -1);
  if (tokens * top_k == 0) return r;
  MOEKIT_CHECK(top_k_index != nullptr, "route_top_k: top_k_index is null");
  if (index_dtype == DType::i32)
    route_typed(static_cast<const int32_t*>(top_k_index), r);
  else
    route_typed(static_cast<const int64_t*>(top_k_index), r);
  return r;
}

}  // namespace moekit

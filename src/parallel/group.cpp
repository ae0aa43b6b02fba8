// The single-rank group, expert slices, mode names.
#include <cstring>

#include "moekit/error.h"
#include "moekit/parallel.h"
#include "parallel/ep_ops.h"

namespace moekit {

namespace {

class SingleGroup final : public ExpertGroup {
 public:
  explicit SingleGroup(Device d) : device_(d) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return device_; }
  std::string_view engine() const override { return "single"; }
  void all_reduce_sum(void*, int64_t, DType, Stream) override {}
  void all_to_all_v(const void* send, const std::vector<int64_t>& so, const std::vector<int64_t>& sb, void* recv,
                    const std::vector<int64_t>& ro, const std::vector<int64_t>& rb, Stream stream) override {
    MOEKIT_CHECK(sb.size() == 1 && rb.size() == 1 && so.size() == 1 && ro.size() == 1 && sb[0] == rb[0],
                 "all_to_all_v: one rank sends ", sb.empty() ? -1 : sb[0], " bytes to itself but expects ",
                 rb.empty() ? -1 : rb[0]);
    ep::copy(device_, static_cast<char*>(recv) + ro[0], static_cast<const char*>(send) + so[0], sb[0], stream);
  }
  std::vector<int64_t> exchange(const std::vector<int64_t>& send, Stream stream) override {
    MOEKIT_CHECK(send.size() == 1, "exchange: ", send.size(), " values for a group of 1");
    return send;
  }
  void synchronize(Stream stream) override {
    ep::sync(device_, stream);
  }

 private:
  Device device_;
};

}  // namespace

ExpertGroupPtr single_group(Device device) { return std::make_shared<SingleGroup>(device); }

ExpertSlice expert_slice(int64_t num_experts, int rank, int size) {
  MOEKIT_CHECK(size >= 1, "expert parallel: group size ", size, " must be >= 1");
  MOEKIT_CHECK(rank >= 0 && rank < size, "expert parallel: rank ", rank, " is out of range [0, ", size, ")");
  MOEKIT_CHECK(num_experts >= size, "expert parallel: ", num_experts, " experts cannot be sharded over ", size,
               " ranks (every rank needs at least one expert); use ep_size <= ", num_experts);
  const int64_t base = num_experts / size, rem = num_experts % size;
  ExpertSlice s;
  s.start = rank * base + std::min<int64_t>(rank, rem);
  s.end = s.start + base + (rank < rem ? 1 : 0);
  return s;
}

EpMode parse_ep_mode(std::string_view name) {
  if (name == "all_reduce" || name == "allreduce") return EpMode::all_reduce;
  if (name == "all_to_all" || name == "alltoall") return EpMode::all_to_all;
  MOEKIT_FAIL(invalid_argument, "unknown expert-parallel mode '", name, "'; valid modes: all_reduce, all_to_all");
}

const char* ep_mode_name(EpMode m) { return m == EpMode::all_reduce ? "all_reduce" : "all_to_all"; }

}  // namespace moekit

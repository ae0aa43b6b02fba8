// moekit: expert parallelism. The routed experts of a layer sharded over a group of ranks (CPU processes
// through MPI, GPUs through NCCL): each rank holds a contiguous slice of the experts, and one layer's call
// runs either with transformers' semantics (tokens replicated, local experts with sentinels, one all-reduce)
// or as an all-to-all dispatch and combine.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moekit/experts.h"
#include "moekit/tensor.h"

namespace moekit {

// The communicator of an expert-parallel group: the few collectives the experts layer needs, on an existing
// engine (MPI on CPU processes, NCCL on GPUs). Every member must call each collective in the same order.
class ExpertGroup {
 public:
  virtual ~ExpertGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;           // where this rank's buffers live
  virtual std::string_view engine() const = 0;  // "mpi", "nccl", "single"

  // In place: buf[i] = sum over ranks of buf[i]. dtype f32, bf16 or f16; buf on device(). The result is the
  // same on every rank.
  virtual void all_reduce_sum(void* buf, int64_t count, DType dtype, Stream stream) = 0;
  // Blocks of bytes: send_bytes[r] bytes from send + send_offsets[r] go to rank r; recv_bytes[r] bytes from
  // rank r land at recv + recv_offsets[r]. Buffers on device(); sizes as agreed beforehand (exchange()).
  virtual void all_to_all_v(const void* send, const std::vector<int64_t>& send_offsets,
                            const std::vector<int64_t>& send_bytes, void* recv, const std::vector<int64_t>& recv_offsets,
                            const std::vector<int64_t>& recv_bytes, Stream stream) = 0;
  // Host values: value r of `send` goes to rank r; returns value r received from rank r. Synchronous.
  virtual std::vector<int64_t> exchange(const std::vector<int64_t>& send, Stream stream = nullptr) = 0;
  // Waits for the stream's work (a no-op on the CPU).
  virtual void synchronize(Stream stream) = 0;
};

using ExpertGroupPtr = std::shared_ptr<ExpertGroup>;

// The group of one rank (size 1): collectives are copies.
ExpertGroupPtr single_group(Device device = Device::cpu());

// MPI_COMM_WORLD (MPI initialised on first use and finalised at exit): one CPU rank per process, under
// `mpirun -np N`. Throws Error(not_supported) in builds without MPI.
ExpertGroupPtr mpi_world_group();
bool mpi_built();
// The process' rank and size under MPI (0 and 1 without MPI or outside mpirun), without initialising
// MPI when the process was not started by mpirun.
int mpi_launch_rank();
int mpi_launch_size();

// One NCCL communicator per GPU of `devices`, all driven by this process (ncclCommInitAll): member i is
// rank i on cuda:devices[i]. Each member's collectives must be called from its own thread. Throws
// Error(not_supported) in builds without NCCL or with fewer GPUs.
std::vector<ExpertGroupPtr> nccl_local_groups(const std::vector<int>& devices);
bool nccl_built();

// Makes `device` the calling thread's current CUDA device (a no-op on the CPU): a thread that drives one rank
// of nccl_local_groups() calls it first, so that work without a device of its own lands on its GPU.
void use_device(Device device);

// Experts [start, end) of E held by `rank` of `size`: contiguous, the first E % size ranks one more.
struct ExpertSlice {
  int64_t start = 0, end = 0;
  int64_t count() const { return end - start; }
};
ExpertSlice expert_slice(int64_t num_experts, int rank, int size);

enum class EpMode : uint8_t {
  all_reduce,  // transformers: tokens replicated, local experts with sentinels, partial outputs all-reduced
  all_to_all,  // each token's row sent to the ranks that own its experts, results combined in rank order
};
EpMode parse_ep_mode(std::string_view name);  // "all_reduce" | "all_to_all"; throws listing the names
const char* ep_mode_name(EpMode m);

// What one all-to-all call moved and how long its stages took (milliseconds; filled when asked for, at the
// cost of a synchronisation per stage).
struct EpStats {
  int64_t tokens_sent = 0, tokens_received = 0;  // rows dispatched to other ranks / received from them
  int64_t dispatch_bytes = 0, combine_bytes = 0;  // bytes this rank sent to other ranks
  double plan_ms = 0, dispatch_ms = 0, experts_ms = 0, combine_ms = 0;
};

// The expert-parallel side of one layer: the group, the global expert count, this rank's slice, the mode.
// The experts themselves are this rank's module (`local`: the slice's experts, E = slice().count(), on the
// group's device), passed to each call, so that its backend can be switched as any module's.
class ParallelExperts {
 public:
  ParallelExperts() = default;
  ParallelExperts(ExpertGroupPtr group, int64_t num_experts, EpMode mode = EpMode::all_reduce);

  const ExpertGroupPtr& group() const { return group_; }
  ExpertSlice slice() const { return slice_; }
  int64_t num_experts() const { return num_experts_; }
  EpMode mode() const { return mode_; }
  void set_mode(EpMode m) { mode_ = m; }
  // all_reduce on a GPU: the tokens in `n` chunks, each chunk's all-reduce (on a second stream) overlapping
  // the next chunk's experts. 1 (the default): one experts call, then one all-reduce.
  void set_overlap_chunks(int n);
  int overlap_chunks() const { return chunks_; }

  // The same tokens on every rank (ids in [0, E] of the global experts, E = sentinel): the full output
  // [T, H], identical on every rank. all_to_all mode splits the tokens into contiguous slices, dispatches
  // each rank's slice, and gathers the outputs.
  void forward_into(const Experts& local, const ExpertsCall& call) const;
  Tensor forward(const Experts& local, const TensorView& hidden_states, const TensorView& top_k_index,
                 const TensorView& top_k_weights, Stream stream = nullptr) const;
  // all_to_all with each rank's own tokens (T may differ between ranks, 0 included): out [T, H] for this
  // rank's tokens. `stats` (optional) receives the volume and, timed with a synchronisation per stage, the
  // time of each stage.
  void dispatch_combine(const Experts& local, const ExpertsCall& call, EpStats* stats = nullptr) const;

  struct Workspace;

 private:
  void check_local(const Experts& local, const ExpertsCall& call) const;
  ExpertGroupPtr group_;
  int64_t num_experts_ = 0;
  ExpertSlice slice_;
  std::vector<ExpertSlice> slices_;  // every rank's
  EpMode mode_ = EpMode::all_reduce;
  int chunks_ = 1;
  std::shared_ptr<Workspace> ws_;
};

// The slice of a stacked expert tensor [E, ...] held by one rank (rows [start, end) of the first dimension),
// a copy on `device`.
Tensor slice_experts(const Tensor& stacked, ExpertSlice s, Device device);
// The local experts of a full module: the same spec with E = s.count() and the sliced weights.
Experts slice_experts(const Experts& full, ExpertSlice s, const std::string& implementation = "");

}  // namespace moekit

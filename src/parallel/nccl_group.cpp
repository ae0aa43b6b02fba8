// The NCCL group: one communicator per GPU, all created by this process (ncclCommInitAll); each member is
// driven by its own thread.
#include <string>
#include <vector>

#include "moekit/error.h"
#include "moekit/parallel.h"

#if defined(MOEKIT_WITH_NCCL)
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "base/cuda_check.h"
#include "base/cuda_device.h"
#endif

namespace moekit {

#if defined(MOEKIT_WITH_NCCL)

bool nccl_built() { return true; }

namespace {

void nccl_check(ncclResult_t rc, const char* call) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  MOEKIT_FAIL(runtime, call, " failed: ", ncclGetErrorString(rc));
}
#define MOEKIT_NCCL_CALL(expr) nccl_check((expr), #expr)

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    default: MOEKIT_FAIL(invalid_argument, "NCCL all_reduce: dtype ", dtype_name(t), " is not f32, bf16 or f16");
  }
}

class NcclGroup final : public ExpertGroup {
 public:
  NcclGroup(ncclComm_t comm, int rank, int size, int device) : comm_(comm), rank_(rank), size_(size), dev_(device) {
    cuda::DeviceGuard g(dev_);
    MOEKIT_CUDA_CALL(cudaMalloc(&counts_, 2 * size_t(size_) * sizeof(int64_t)));
  }
  ~NcclGroup() override {
    cuda::DeviceGuard g(dev_);
    (void)cudaFree(counts_);
    (void)ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda(dev_); }
  std::string_view engine() const override { return "nccl"; }

  void all_reduce_sum(void* buf, int64_t count, DType dtype, Stream stream) override {
    if (count == 0) return;
    cuda::DeviceGuard g(dev_);
    MOEKIT_NCCL_CALL(ncclAllReduce(buf, buf, size_t(count), nccl_type(dtype), ncclSum, comm_, cs(stream)));
  }

  void all_to_all_v(const void* send, const std::vector<int64_t>& so, const std::vector<int64_t>& sb, void* recv,
                    const std::vector<int64_t>& ro, const std::vector<int64_t>& rb, Stream stream) override {
    const size_t n = size_t(size_);
    MOEKIT_CHECK(so.size() == n && sb.size() == n && ro.size() == n && rb.size() == n, "all_to_all_v: ", n,
                 " ranks need ", n, " offsets and sizes each");
    cuda::DeviceGuard g(dev_);
    MOEKIT_NCCL_CALL(ncclGroupStart());
    for (size_t r = 0; r < n; ++r) {
      if (sb[r] > 0)
        MOEKIT_NCCL_CALL(ncclSend(static_cast<const char*>(send) + so[r], size_t(sb[r]), ncclInt8, int(r), comm_,
                                  cs(stream)));
      if (rb[r] > 0)
        MOEKIT_NCCL_CALL(
            ncclRecv(static_cast<char*>(recv) + ro[r], size_t(rb[r]), ncclInt8, int(r), comm_, cs(stream)));
    }
    MOEKIT_NCCL_CALL(ncclGroupEnd());
  }

  std::vector<int64_t> exchange(const std::vector<int64_t>& send, Stream stream) override {
    MOEKIT_CHECK(send.size() == size_t(size_), "exchange: ", send.size(), " values for a group of ", size_);
    cuda::DeviceGuard g(dev_);
    cudaStream_t s = cs(stream);
    auto* dsend = static_cast<int64_t*>(counts_);
    int64_t* drecv = dsend + size_;
    MOEKIT_CUDA_CALL(cudaMemcpyAsync(dsend, send.data(), send.size() * sizeof(int64_t), cudaMemcpyHostToDevice, s));
    MOEKIT_NCCL_CALL(ncclGroupStart());
    for (int r = 0; r < size_; ++r) {
      MOEKIT_NCCL_CALL(ncclSend(dsend + r, 1, ncclInt64, r, comm_, s));
      MOEKIT_NCCL_CALL(ncclRecv(drecv + r, 1, ncclInt64, r, comm_, s));
    }
    MOEKIT_NCCL_CALL(ncclGroupEnd());
    std::vector<int64_t> recv(send.size());
    MOEKIT_CUDA_CALL(cudaMemcpyAsync(recv.data(), drecv, recv.size() * sizeof(int64_t), cudaMemcpyDeviceToHost, s));
    MOEKIT_CUDA_CALL(cudaStreamSynchronize(s));
    return recv;
  }

  void synchronize(Stream stream) override {
    cuda::DeviceGuard g(dev_);
    MOEKIT_CUDA_CALL(cudaStreamSynchronize(cs(stream)));
  }

 private:
  static cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }
  ncclComm_t comm_;
  int rank_, size_, dev_;
  void* counts_ = nullptr;
};

}  // namespace

std::vector<ExpertGroupPtr> nccl_local_groups(const std::vector<int>& devices) {
  MOEKIT_CHECK(!devices.empty(), "nccl_local_groups: no devices given");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  for (int d : devices)
    MOEKIT_CHECK_CODE(d >= 0 && d < count, not_supported, "expert parallelism over NCCL: device cuda:", d,
                      " is not present (", count, " CUDA device(s) here)");
  std::vector<ncclComm_t> comms(devices.size());
  MOEKIT_NCCL_CALL(ncclCommInitAll(comms.data(), int(devices.size()), devices.data()));
  std::vector<ExpertGroupPtr> groups;
  for (size_t i = 0; i < devices.size(); ++i)
    groups.push_back(std::make_shared<NcclGroup>(comms[i], int(i), int(devices.size()), devices[i]));
  return groups;
}

#else

bool nccl_built() { return false; }

std::vector<ExpertGroupPtr> nccl_local_groups(const std::vector<int>&) {
  MOEKIT_FAIL(not_supported,
              "expert parallelism over GPUs needs NCCL, and this build has none (a CUDA build finds NCCL's nccl.h "
              "and libnccl under the CUDA toolkit, or configure with -DMOEKIT_NCCL=ON)");
}

#endif

}  // namespace moekit

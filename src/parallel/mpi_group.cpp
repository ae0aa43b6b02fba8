// The MPI group: MPI_COMM_WORLD, one CPU rank per process (Open MPI, `mpirun -np N`).
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "base/convert.h"
#include "moekit/error.h"
#include "moekit/parallel.h"

#if defined(MOEKIT_WITH_MPI)
#include <mpi.h>
#endif

namespace moekit {

namespace {

int env_int(std::initializer_list<const char*> names, int fallback) {
  for (const char* n : names)
    if (const char* v = std::getenv(n); v && *v) return std::atoi(v);
  return fallback;
}

}  // namespace

int mpi_launch_rank() { return env_int({"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}, 0); }
int mpi_launch_size() { return env_int({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1); }

#if defined(MOEKIT_WITH_MPI)

bool mpi_built() { return true; }

namespace {

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  MOEKIT_FAIL(runtime, call, " failed: ", std::string(msg, size_t(len)));
}
#define MOEKIT_MPI_CALL(expr) mpi_check((expr), #expr)

int checked_int(int64_t v, const char* what) {
  MOEKIT_CHECK_CODE(v >= 0 && v <= std::numeric_limits<int>::max(), not_supported, "MPI all_to_all_v: ", what, " ",
                    v, " bytes exceeds MPI's int counts (2^31 - 1)");
  return int(v);
}

class MpiGroup final : public ExpertGroup {
 public:
  MpiGroup() {
    MOEKIT_MPI_CALL(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    MOEKIT_MPI_CALL(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu(); }
  std::string_view engine() const override { return "mpi"; }

  void all_reduce_sum(void* buf, int64_t count, DType dtype, Stream) override {
    if (count == 0) return;
    MOEKIT_CHECK(count <= std::numeric_limits<int>::max(), "MPI all_reduce: ", count, " elements exceed 2^31 - 1");
    if (dtype == DType::f32) {
      MOEKIT_MPI_CALL(MPI_Allreduce(MPI_IN_PLACE, buf, int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD));
      return;
    }
    MOEKIT_CHECK(dtype == DType::bf16 || dtype == DType::f16, "MPI all_reduce: dtype ", dtype_name(dtype),
                 " is not f32, bf16 or f16");
    // MPI has no 16-bit floating types: summed in f32, rounded once.
    std::vector<float> f(static_cast<size_t>(count));
    cpu::load_f32(buf, dtype, 0, count, f.data());
    MOEKIT_MPI_CALL(MPI_Allreduce(MPI_IN_PLACE, f.data(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD));
    cpu::store_f32(f.data(), buf, dtype, 0, count);
  }

  void all_to_all_v(const void* send, const std::vector<int64_t>& so, const std::vector<int64_t>& sb, void* recv,
                    const std::vector<int64_t>& ro, const std::vector<int64_t>& rb, Stream) override {
    const size_t n = size_t(size_);
    MOEKIT_CHECK(so.size() == n && sb.size() == n && ro.size() == n && rb.size() == n, "all_to_all_v: ", n,
                 " ranks need ", n, " offsets and sizes each");
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    for (size_t r = 0; r < n; ++r) {
      sc[r] = checked_int(sb[r], "send");
      sd[r] = checked_int(so[r], "send offset");
      rc[r] = checked_int(rb[r], "receive");
      rd[r] = checked_int(ro[r], "receive offset");
    }
    // MPI reads no byte of a zero-length block, but the pointers must be valid ones.
    static char dummy[16];
    MOEKIT_MPI_CALL(MPI_Alltoallv(send ? send : dummy, sc.data(), sd.data(), MPI_BYTE, recv ? recv : dummy + 8,
                                  rc.data(), rd.data(), MPI_BYTE, MPI_COMM_WORLD));
  }

  std::vector<int64_t> exchange(const std::vector<int64_t>& send, Stream stream) override {
    MOEKIT_CHECK(send.size() == size_t(size_), "exchange: ", send.size(), " values for a group of ", size_);
    std::vector<int64_t> recv(send.size());
    MOEKIT_MPI_CALL(MPI_Alltoall(send.data(), 1, MPI_INT64_T, recv.data(), 1, MPI_INT64_T, MPI_COMM_WORLD));
    return recv;
  }
  void synchronize(Stream) override {}

 private:
  int rank_ = 0, size_ = 1;
};

void finalize_mpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

ExpertGroupPtr mpi_world_group() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MOEKIT_MPI_CALL(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
      std::atexit(finalize_mpi);
    }
    // Errors come back as return codes, turned into moekit::Error, instead of aborting the job.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  });
  static ExpertGroupPtr group = std::make_shared<MpiGroup>();
  return group;
}

#else

bool mpi_built() { return false; }

ExpertGroupPtr mpi_world_group() {
  MOEKIT_FAIL(not_supported,
              "expert parallelism over CPU processes needs MPI, and this build has none (install Open MPI, "
              "libopenmpi-dev, and configure with -DMOEKIT_MPI=ON)");
}

#endif

}  // namespace moekit

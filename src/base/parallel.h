// Internal: OpenMP loops over independent tasks for the CPU code (backends, model ops, GEMM). Each task writes
// its own outputs, so results do not depend on the number of threads. An exception thrown by a task (e.g. a user
// gate function) is carried out of the parallel region and rethrown on the calling thread. Loops whose total cost (about one unit
// per multiply-add or element touched) is below kMinParallelCost run on the calling thread: waking the team
// costs more than it saves there, and much more when the cores are shared.
#pragma once
#include <omp.h>

#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

namespace moekit::cpu {

constexpr int64_t kMinParallelCost = int64_t(1) << 18;

// fn(task, work) for task in [0, n); `work` is per-thread scratch of `work_floats` floats (kept between calls).
template <class Fn>
void parallel_tasks(int64_t n, int64_t work_floats, int64_t cost, Fn&& fn) {
  if (n <= 0) return;
  std::exception_ptr error;
  std::mutex error_mutex;
  auto run = [&](int64_t t) {
    thread_local std::vector<float> scratch;
    if (int64_t(scratch.size()) < work_floats) scratch.resize(size_t(work_floats));
    try {
      fn(t, scratch.data());
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  if (n == 1 || cost < kMinParallelCost || omp_get_max_threads() == 1 || omp_in_parallel()) {
    for (int64_t t = 0; t < n; ++t) run(t);
  } else {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < n; ++t) run(t);
  }
  if (error) std::rethrow_exception(error);
}

// fn(i) for i in [0, n), in chunks of `grain` per task.
template <class Fn>
void parallel_for(int64_t n, int64_t grain, int64_t cost, Fn&& fn) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  const int64_t tasks = (n + grain - 1) / grain;
  parallel_tasks(tasks, 0, cost, [&](int64_t t, float*) {
    const int64_t end = (t + 1) * grain < n ? (t + 1) * grain : n;
    for (int64_t i = t * grain; i < end; ++i) fn(i);
  });
}

}  // namespace moekit::cpu

// kernel_trace: a CUPTI activity tracer loaded by the CUDA driver into any program (no change to the program), for
// a timeline of its kernels where Nsight Systems is not installed. Each kernel execution, graph replays included,
// becomes one line of a CSV file: start and end (ns, GPU clock), stream, graph and graph node, grid, block,
// registers, shared memory and the demangled name. With Programmatic Dependent Launch a kernel's start is when its
// first blocks run (before their griddepcontrol.wait), so the lines of a chain overlap; bench/kernel_trace.py reads
// the file (per graph replay: each kernel's duration and how far it moves the chain's end).
//
// Build (standalone, not part of the CMake build; one command):
//   g++ -O2 -std=c++17 -shared -fPIC bench/kernel_trace.cpp -I/usr/local/cuda/include
//       -L/usr/local/cuda/lib64 -lcupti -o libkernel_trace.so
// Use: CUDA_INJECTION64_PATH=$PWD/libkernel_trace.so MOEKIT_TRACE_OUT=trace.csv <program> ...
// (LD_LIBRARY_PATH must find libcupti.so). CONCURRENT_KERNEL records keep kernels concurrent; the tracer adds a
// small cost per kernel, so compare timings only between traced runs.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Row {
  uint64_t start, end;
  uint32_t stream, graph;
  uint64_t node;
  int32_t grid[3], block[3];
  uint16_t regs;
  int32_t smem;
  std::string name;
};

std::mutex g_mutex;
std::vector<Row> g_rows;
bool g_failed = false;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, s ? s : "?");
  g_failed = true;
}

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : name;
  std::free(d);
  for (char& c : s)
    if (c == ',' || c == '\n') c = ';';  // one CSV field
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = size_t(16) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buffer ? kBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::vector<Row> rows;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    rows.push_back({k->start, k->end, k->streamId, k->graphId, k->graphNodeId, {k->gridX, k->gridY, k->gridZ},
                    {k->blockX, k->blockY, k->blockZ}, k->registersPerThread,
                    k->staticSharedMemory + k->dynamicSharedMemory, demangle(k->name)});
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& r : rows) g_rows.push_back(std::move(r));
}

void finish() {
  cuptiActivityFlushAll(1);
  const char* path = std::getenv("MOEKIT_TRACE_OUT");
  std::FILE* f = std::fopen(path && *path ? path : "kernel_trace.csv", "w");
  if (!f) {
    std::perror("kernel_trace: cannot write the trace");
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(f, "start_ns,end_ns,stream,graph,node,grid_x,grid_y,grid_z,block_x,block_y,block_z,regs,smem,name\n");
  for (const Row& r : g_rows)
    std::fprintf(f, "%llu,%llu,%u,%u,%llu,%d,%d,%d,%d,%d,%d,%u,%d,%s\n", (unsigned long long)r.start,
                 (unsigned long long)r.end, r.stream, r.graph, (unsigned long long)r.node, r.grid[0], r.grid[1],
                 r.grid[2], r.block[0], r.block[1], r.block[2], unsigned(r.regs), r.smem, r.name.c_str());
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu kernels%s\n", g_rows.size(), g_failed ? " (CUPTI reported errors)" : "");
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection(void) {
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable(CONCURRENT_KERNEL)");
  std::atexit(finish);
  return 1;
}

// The streaming ceiling of a small-T experts call: how long a CUDA-graph replay takes to read B bytes of
// weights once, as one kernel, split over two kernels (plainly, or with programmatic dependent launch as
// batched_mm's two launches are), as one kernel with a grid barrier where the split is, or as two co-resident
// kernels whose second stages its share in shared memory by bulk copies before its PDL wait, timed the way
// `moekit bench --graph` times a call (events around each replay on an idle stream, median of many). Standalone:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/stream_probe.cu -o stream_probe
//   ./stream_probe [blocks_per_sm] [MB...]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace {

__device__ __forceinline__ uint4 load_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Reads n 16-byte words, four in flight per thread per step; the xor of everything goes to `sink` only when it
// equals a value it cannot take in practice (keeps the loads live). `pdl`: 1 = trigger the dependent launch at the
// start, 2 = wait for the previous launch after the loads (the loads overlap its tail, as pair_gemv_combine's do).
// CARVE: the same kernel, set up (in main) to prefer the largest shared-memory carveout, so that a block of the
// co-resident form can join it on a multiprocessor without the L1 / shared split changing.
template <int U, bool CARVE = false>
__global__ void stream_kernel(const uint4* __restrict__ p, size_t n, unsigned* sink, int pdl) {
  if (pdl == 1) asm volatile("griddepcontrol.launch_dependents;");
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load_nc(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = load_nc(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (pdl == 2) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (acc == 0x9e3779b9u) *sink = acc;
}

// One launch that reads [0, n1) and then, after a barrier of the whole grid (every block resident: one wave),
// [n1, n): the cost of a grid barrier between two streams. `ctr` only grows (each launch adds gridDim.x).
__global__ void barrier_kernel(const uint4* __restrict__ p, size_t n1, size_t n, unsigned* ctr, unsigned* sink) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  unsigned acc = 0;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n1; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = load_nc(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n1; i += stride) acc ^= load_nc(p + i).x;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned old = atomicAdd(ctr, 1u);
    const unsigned target = (old / gridDim.x + 1) * gridDim.x;
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(ctr) : "memory");
    } while (int(seen - target) < 0);
  }
  __syncthreads();
  for (i = n1 + size_t(blockIdx.x) * blockDim.x + threadIdx.x; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = load_nc(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) acc ^= load_nc(p + i).x;
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The second kernel of the co-resident form: one block per multiprocessor whose slice of the bytes (`per_block`
// words) goes into shared memory by bulk copies issued before the PDL wait, so that, with the first kernel leaving
// room on every multiprocessor (fewer than 8 blocks of 256 threads), they stream while the first kernel still runs;
// after the wait the block reads its slice back from shared memory.
__global__ void co_bulk_kernel(const uint4* __restrict__ p, size_t per_block, unsigned* sink) {
  extern __shared__ uint4 staged[];
  __shared__ __align__(8) unsigned long long bar;
  const unsigned bar_s = unsigned(__cvta_generic_to_shared(&bar));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar_s));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const uint4* src = p + size_t(blockIdx.x) * per_block;
  if (threadIdx.x == 0) {
    const unsigned bytes = unsigned(per_block * 16);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar_s), "r"(bytes) : "memory");
    const unsigned chunk = 16384;
    for (unsigned off = 0; off < bytes; off += chunk) {
      const unsigned n = bytes - off < chunk ? bytes - off : chunk;
      const unsigned dst = unsigned(__cvta_generic_to_shared(staged)) + off;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
          "l"(reinterpret_cast<const char*>(src) + off), "r"(n), "r"(bar_s)
          : "memory");
    }
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  unsigned done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar_s)
        : "memory");
  unsigned acc = 0;
  for (size_t i = threadIdx.x; i < per_block; i += blockDim.x) {
    const uint4 v = staged[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

struct Launch {
  size_t offset_words, words;
  int pdl;
};

// Captures the launches into a graph, replays it warmup + iters times with events around each replay, and returns
// the median microseconds.
float time_graph(const uint4* buf, unsigned* sink, const std::vector<Launch>& launches, int blocks, int threads,
                 cudaStream_t s, int iters) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (const Launch& l : launches) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.stream = s;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = l.pdl == 2 ? 1 : 0;
    if (l.pdl == 3) {  // the barrier form: offset_words is where the second stream starts
      CK(cudaLaunchKernelEx(&cfg, barrier_kernel, buf, l.offset_words, l.words, sink + 1, sink));
    } else if (l.pdl == 4) {  // the co-resident bulk form: one block per multiprocessor, words split evenly (the
                              // remainder, fewer words than multiprocessors, is not read)
      int sms = 0;
      CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      const size_t per_block = l.words / size_t(sms);
      cfg.gridDim = dim3(unsigned(sms));
      cfg.dynamicSmemBytes = per_block * 16;
      cfg.numAttrs = 1;
      CK(cudaFuncSetAttribute(co_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(per_block * 16)));
      CK(cudaLaunchKernelEx(&cfg, co_bulk_kernel, static_cast<const uint4*>(buf + l.offset_words), per_block, sink));
    } else if (l.pdl == 5) {  // the first kernel of the co-resident form
      CK(cudaLaunchKernelEx(&cfg, stream_kernel<4, true>, buf + l.offset_words, l.words, sink, 1));
    } else {
      CK(cudaLaunchKernelEx(&cfg, stream_kernel<4>, buf + l.offset_words, l.words, sink, l.pdl));
    }
  }
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int it = 0; it < iters + 5; ++it) {
    CK(cudaStreamSynchronize(s));
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (it >= 5) ts.push_back(ms * 1000.f);
  }
  std::sort(ts.begin(), ts.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return ts[ts.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int per_sm = argc > 1 ? std::atoi(argv[1]) : 8;
  std::vector<double> mbs;
  for (int i = 2; i < argc; ++i) mbs.push_back(std::atof(argv[i]));
  if (mbs.empty()) mbs = {12.5, 25, 37.7, 50, 69.2, 75.5, 100.7, 151, 302, 604};
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int blocks = prop.multiProcessorCount * per_sm, threads = 256;
  const double max_mb = *std::max_element(mbs.begin(), mbs.end());
  const size_t bytes = size_t(max_mb * 1e6) + (1 << 20);
  uint4* buf;
  unsigned* sink;
  CK(cudaMalloc(&buf, bytes));
  CK(cudaMalloc(&sink, 8));
  CK(cudaMemset(sink, 0, 8));
  // Not zeros: a fixed pseudo-random pattern.
  std::vector<unsigned> host(bytes / 4);
  unsigned x = 12345u;
  for (auto& v : host) v = (x = x * 1664525u + 1013904223u);
  CK(cudaMemcpy(buf, host.data(), bytes, cudaMemcpyHostToDevice));
  CK(cudaFuncSetAttribute(stream_kernel<4, true>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("device %s, %d SMs, %d blocks x %d threads\n", prop.name, prop.multiProcessorCount, blocks, threads);
  std::printf("%8s %10s %10s %10s %10s %10s %10s %8s %10s\n", "MB", "empty", "one", "two", "two_pdl", "barrier",
              "one_TB/s", "pdl-one", "co_bulk");
  // Columns: an empty graph (one launch of zero words: the fixed cost of a replay); one kernel reading it all; two
  // kernels reading 2/3 then 1/3, plainly and with PDL; one kernel with a grid barrier after the first 2/3; two
  // kernels whose second (one block per multiprocessor) stages its third in shared memory while the first runs.
  for (double mb : mbs) {
    const size_t w = size_t(mb * 1e6) / 16, w1 = w * 2 / 3;
    const int iters = 200;
    const float empty = time_graph(buf, sink, {{0, 0, 0}}, blocks, threads, s, iters);
    const float one = time_graph(buf, sink, {{0, w, 0}}, blocks, threads, s, iters);
    const float two = time_graph(buf, sink, {{0, w1, 0}, {w1, w - w1, 0}}, blocks, threads, s, iters);
    const float pdl = time_graph(buf, sink, {{0, w1, 1}, {w1, w - w1, 2}}, blocks, threads, s, iters);
    const float bar = time_graph(buf, sink, {{w1, w, 3}}, blocks, threads, s, iters);
    // The co-resident form: the last third staged in shared memory by one block per multiprocessor, when it fits.
    const size_t w2 = w - w1;
    const float co = w2 / size_t(prop.multiProcessorCount) * 16 <= 220 * 1024
                         ? time_graph(buf, sink, {{0, w1, 5}, {w1, w2, 4}}, blocks, threads, s, iters)
                         : -1.f;
    std::printf("%8.1f %10.2f %10.2f %10.2f %10.2f %10.2f %10.2f %8.2f %10.2f\n", mb, empty, one, two, pdl, bar,
                w * 16 / (one * 1e6), pdl - one, co);
  }
  CK(cudaFree(buf));
  CK(cudaFree(sink));
  return 0;
}

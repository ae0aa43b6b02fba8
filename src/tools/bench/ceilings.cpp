// The two ceilings of the roofline, measured at the start of a run (on the CPU again at its end, the better kept:
// tools/moekit/bench.cpp, best_ceilings).
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <fstream>
#include <memory>
#include <vector>

#include <fmt/core.h>

#include "base/gemm.h"
#include "bench/bench.h"
#include "bench/random.h"
#include "bench/workload.h"
#include "moekit/dtype.h"
#include "moekit/interface.h"
#ifdef MOEKIT_WITH_CUDA
#include "bench/cuda_bench.h"
#endif

namespace moekit::bench {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) break;
    std::string name = line.substr(colon + 1);
    name.erase(0, name.find_first_not_of(" \t"));
    return name;
  }
  return "unknown CPU";
}

// Largest data cache the CPU reports (L3 where there is one).
int64_t cpu_cache_bytes() {
  int64_t best = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream in(fmt::format("/sys/devices/system/cpu/cpu0/cache/index{}/size", index));
    std::string s;
    if (!(in >> s) || s.empty()) continue;
    int64_t v = std::atoll(s.c_str());
    if (s.back() == 'K') v *= 1024;
    if (s.back() == 'M') v *= 1024 * 1024;
    best = std::max(best, v);
  }
#ifdef _SC_LEVEL3_CACHE_SIZE
  if (best == 0) best = std::max<int64_t>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
#endif
  return best > 0 ? best : 32ll << 20;
}

// Best GFLOP/s of the library's CPU GEMM (base/gemm.h: c[n, n] = a[n, n] b[n, n], b read as a transposed
// f32 weight) at a size that runs at least ~0.2 s in all.
double cpu_blocked_gemm_gflops() {
  double best = 0;
  for (int64_t n = 256; n <= 2048; n *= 2) {
    std::vector<float> a(size_t(n * n)), b(size_t(n * n)), c(size_t(n * n));
    for (size_t i = 0; i < a.size(); ++i) a[i] = normal_at(21, i), b[i] = normal_at(22, i);
    double spent = 0;
    const cpu::WeightMatrix w{b.data(), cpu::WType::f32, n, n, /*transposed=*/true};  // b [k, n]
    cpu::gemm(cpu::gemm_kernels(), a.data(), n, n, w, c.data(), n);  // warm-up (pages, threads), not timed
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = Clock::now();
      cpu::gemm(cpu::gemm_kernels(), a.data(), n, n, w, c.data(), n);
      const double s = seconds_since(t0);
      spent += s;
      best = std::max(best, 2.0 * double(n) * n * n / s / 1e9);
    }
    if (spent > 0.6) break;  // large enough to be past the cache effects that matter
  }
  return best;
}

// Best GFLOP/s of the library's bf16 GEMM (base/gemm.h gemm_bf16 over packed weights, AMX where the CPU has it:
// the best kernels this CPU runs; on AMX the best of the tile's three orders, set_amx_overlap: on the 16-core host
// this peak read 6.45 TFLOP/s with the single pass and 5.11 with the overlapped order the default takes at these
// sizes, in two calls) on square problems from 512^3 up to 4096^3 (until they run ~1.2 s in all); 0 where
// the CPU has no bf16 tile. (torch's oneDNN GEMM on the same host is timed by scripts/hf_cpu_bench.py --peak.)
double cpu_bf16_gemm_gflops() {
  const cpu::GemmKernels* kern = nullptr;
  for (const cpu::Isa isa : {cpu::Isa::amx, cpu::Isa::avx512bf16}) {
    if (!cpu::isa_supported(isa)) continue;
    cpu::set_isa_override(isa);
    kern = &cpu::gemm_kernels();
    cpu::clear_isa_override();
    break;
  }
  if (!kern) return 0;
  double best = 0;
  for (int64_t n = 512; n <= 4096; n *= 2) {
    const int64_t kp = cpu::packed_bf16_k(n);
    std::vector<uint16_t> a(size_t(n * kp)), b(size_t(n * n)), packed(size_t(cpu::packed_bf16_elems(n, n)));
    std::vector<float> c(size_t(n * n));
    for (size_t i = 0; i < a.size(); ++i) a[i] = f32_to_bf16(normal_at(23, i));
    for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(normal_at(24, i));
    cpu::pack_bf16({b.data(), cpu::WType::bf16, n, n, false}, packed.data());
    const cpu::PackedBf16 w{packed.data(), n, n, kp};
    cpu::gemm_bf16(*kern, a.data(), kp, n, w, c.data(), n);  // warm-up (pages, tile state, threads), not timed
    double spent = 0;
    for (const int order : {0, 1, 2}) {  // the amx tile's orders (the default takes one by rows): the best of them
      if (kern->isa == cpu::Isa::amx) cpu::set_amx_overlap(order);
      for (int rep = 0; rep < 4; ++rep) {
        const auto t0 = Clock::now();
        cpu::gemm_bf16(*kern, a.data(), kp, n, w, c.data(), n);
        const double s = seconds_since(t0);
        spent += s;
        best = std::max(best, 2.0 * double(n) * n * n / s / 1e9);
      }
      if (kern->isa != cpu::Isa::amx) break;
    }
    cpu::set_amx_overlap(-1);
    if (spent > 1.2) break;
  }
  return best;
}

// GFLOP/s of moekit's grouped_mm, best of a few calls: `E` experts of H x I and T tokens routed to one expert each,
// token t to expert t % E (the same rows for every expert), made by the benchmark's own workload
// (make_random_experts, make_input_set) in `dtype`. 0 when it cannot run here.
double cpu_grouped_mm_gflops(int64_t T, int64_t H, int64_t I, int64_t E, DType dtype, int reps) {
  const ShapePreset shape{.name = "dense", .hidden = H, .intermediate = I, .num_experts = E, .top_k = 1};
  try {
    const Experts experts = make_random_experts(shape, dtype, Device::cpu(), 31);
    const InputSet set = make_input_set(shape, T, dtype, DType::i32, Routing::uniform, {}, Device::cpu(), 33, false);
    for (int64_t t = 0; t < T; ++t) set.top_k_index.ptr<int32_t>()[t] = int32_t(t % E);  // K = 1: weights are 1
    const ExpertsCall call = set.call(nullptr);
    experts.forward_with("grouped_mm", call);  // warm-up (packing, scratch), not timed
    double best = 0;
    for (int rep = 0; rep < reps; ++rep) {
      const auto t0 = Clock::now();
      experts.forward_with("grouped_mm", call);
      best = std::max(best, forward_flops(shape, T) / seconds_since(t0) / 1e9);
    }
    return best;
  } catch (const Error&) {
    return 0;
  }
}

// The best of grouped_mm on one dense f32 expert and, where the CPU has a bf16 tile (AMX, AVX512-BF16), on 16
// bf16 experts of 128 rows each at H = 2048, I = 768 (the compute-bound prefill of fine-grained experts: the
// 16-core host ran qwen3-30b-a3b's T = 2048 at 6.9 TFLOP/s where the square GEMM above read 6.5). Each case is
// run only when a small probe says it takes well under a second.
double cpu_grouped_mm_gflops() {
  auto flops = [](int64_t T, int64_t H, int64_t I) {
    return forward_flops({.name = "dense", .hidden = H, .intermediate = I, .num_experts = 1, .top_k = 1}, T);
  };
  double best = 0;
  const double probe = cpu_grouped_mm_gflops(32, 256, 256, 1, DType::f32, 2);
  best = probe;
  if (probe > 0 && flops(512, 1024, 1024) / (probe * 1e9) < 1.0)
    best = std::max(best, cpu_grouped_mm_gflops(512, 1024, 1024, 1, DType::f32, 3));
  if (cpu::isa_supported(cpu::Isa::amx) || cpu::isa_supported(cpu::Isa::avx512bf16)) {
    const double probe16 = cpu_grouped_mm_gflops(256, 512, 512, 2, DType::bf16, 2);
    best = std::max(best, probe16);
    if (probe16 > 0 && flops(2048, 2048, 768) / (probe16 * 1e9) < 0.25)
      best = std::max(best, cpu_grouped_mm_gflops(2048, 2048, 768, 16, DType::bf16, 5));
  }
  return best;
}

// Multi-threaded memcpy of buffers far beyond the cache; GB/s counting bytes read plus written.
double cpu_copy_gbps(int64_t cache_bytes) {
  const size_t bytes = size_t(std::max<int64_t>(256ll << 20, 8 * cache_bytes));
  std::unique_ptr<char[]> src(new char[bytes]), dst(new char[bytes]);
  const int threads = omp_get_max_threads();
  const size_t chunk = (bytes + size_t(threads) - 1) / size_t(threads);
  auto copy = [&] {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; ++t) {
      const size_t begin = size_t(t) * chunk, end = std::min(bytes, begin + chunk);
      if (begin < end) std::memcpy(dst.get() + begin, src.get() + begin, end - begin);
    }
  };
  std::memset(src.get(), 1, bytes);  // touch every page before timing
  copy();
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    copy();
    best = std::max(best, 2.0 * double(bytes) / seconds_since(t0) / 1e9);
  }
  return best;
}

// One thread's read of `len` bytes at p (64-byte aligned, a multiple of 64 * S): S streams (the region in S equal
// parts, read in lockstep, 64 bytes each per step, summed into their own accumulators), each line prefetched `dist`
// bytes ahead (0: none). The vector type is 64 bytes: one AVX-512 load where the CPU has it (read_avx512).
typedef unsigned long long ReadVec __attribute__((vector_size(64)));  // unsigned: sums wrap
template <int S>
__attribute__((always_inline)) inline uint64_t read_streams(const char* p, size_t len, size_t dist) {
  const size_t part = len / S;
  ReadVec acc[S] = {};
  for (size_t off = 0; off < part; off += 64) {
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const char* q = p + size_t(s) * part + off;
      if (dist && off + dist < part) __builtin_prefetch(q + dist, 0, 3);
      acc[s] += *reinterpret_cast<const ReadVec*>(q);
    }
  }
  uint64_t total = 0;
  for (int s = 0; s < S; ++s)
    for (int l = 0; l < 8; ++l) total += uint64_t(acc[s][l]);
  return total;
}
template <int S>
__attribute__((target("avx512f"))) uint64_t read_avx512(const char* p, size_t len, size_t dist) {
  return read_streams<S>(p, len, dist);
}
template <int S>
uint64_t read_generic(const char* p, size_t len, size_t dist) {
  return read_streams<S>(p, len, dist);
}

// The transparent huge page mode of this machine ("always", "madvise", "never"; "" where it cannot be read).
std::string thp_mode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(in, line);
  const size_t a = line.find('['), b = line.find(']');
  return a != std::string::npos && b > a ? line.substr(a + 1, b - a - 1) : std::string();
}

// Read bandwidth: the best of several ways to read a buffer well beyond the cache with every thread (each on its own
// region, whose pages it placed), so that no kernel reads faster than the ceiling:
// - 1 to 16 streams per thread, prefetch 0 to 4 KiB ahead, 64-byte (AVX-512) loads;
// - the experts' own decode pattern (one activation row times packed bf16 weight panels, base/gemm.h's bf16 tile,
//   the thread's share of the panels);
// - on two buffers: one in transparent huge pages (madvise, as the packed experts are: backends/cpu/common.h
//   huge_page_alloc) and one in plain pages (as tensors are); the plain one with the 4- and 8-stream ways and the
//   decode pattern only.
// A first pass over each buffer is not timed; then rounds over all variants (so that a noisy moment of the machine
// costs one pass of each variant, not one variant), at least 3 and until ~1.5 s, each variant's best kept. `detail`
// receives the best variant and the runners-up.
double cpu_read_gbps(int64_t cache_bytes, std::string& detail) {
  constexpr int64_t kK = 4096;                      // the decode pattern's k: one panel = 16 columns x 4096 = 128 KiB
  constexpr size_t kPanel = size_t(kK) * 16 * sizeof(uint16_t);
  const int threads = omp_get_max_threads();
  const size_t want = size_t(std::max<int64_t>(512ll << 20, 4 * cache_bytes));
  const size_t panels = std::max<size_t>(size_t(threads), (want + kPanel - 1) / kPanel), bytes = panels * kPanel;
  struct Free {
    void operator()(void* q) const { std::free(q); }
  };
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t alloc = (bytes + kHuge - 1) / kHuge * kHuge;
  auto make = [&](bool huge) {
    std::unique_ptr<char, Free> buf(static_cast<char*>(std::aligned_alloc(kHuge, alloc)));
    MOEKIT_CHECK(buf, "bench: cannot allocate ", alloc, " bytes for the read test");
#ifdef MADV_HUGEPAGE
    madvise(buf.get(), alloc, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
    return buf;
  };
  std::unique_ptr<char, Free> bufs[2] = {make(true), make(false)};  // huge pages, plain pages
  auto share = [&](int t, size_t& begin, size_t& len) {  // thread t's panels, as bytes
    const size_t p0 = panels * size_t(t) / size_t(threads), p1 = panels * size_t(t + 1) / size_t(threads);
    begin = p0 * kPanel, len = (p1 - p0) * kPanel;
  };
  for (auto& buf : bufs) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; ++t) {  // each thread first touches (places) the pages it reads: small bf16 values
      size_t begin, len;
      share(t, begin, len);
      auto* w = reinterpret_cast<uint16_t*>(buf.get() + begin);
      for (size_t i = 0; i < len / 2; ++i) w[i] = uint16_t(0x3c00 + (i * 0x9E37u >> 7 & 0x3ff));
    }
  }
  const bool avx512 = __builtin_cpu_supports("avx512f");
  volatile uint64_t sink = 0;
  auto stream = [&](const char* base, int streams, size_t dist) {
    uint64_t total = 0;
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(+ : total)
    for (int t = 0; t < threads; ++t) {
      size_t begin, len;
      share(t, begin, len);
      const char* p = base + begin;
      switch (streams) {
        case 1: total += avx512 ? read_avx512<1>(p, len, dist) : read_generic<1>(p, len, dist); break;
        case 2: total += avx512 ? read_avx512<2>(p, len, dist) : read_generic<2>(p, len, dist); break;
        case 4: total += avx512 ? read_avx512<4>(p, len, dist) : read_generic<4>(p, len, dist); break;
        case 8: total += avx512 ? read_avx512<8>(p, len, dist) : read_generic<8>(p, len, dist); break;
        default: total += avx512 ? read_avx512<16>(p, len, dist) : read_generic<16>(p, len, dist); break;
      }
    }
    sink = sink + total;
  };
  // The decode pattern: y[1, n] = x[1, 4096] W^T over packed panels, each thread its own panels.
  const cpu::GemmKernels& kern = cpu::gemm_kernels();
  const std::vector<uint16_t> x(size_t(kK) + 32, uint16_t(0x3c00));
  std::vector<float> y(panels * 16);
  auto decode = [&](const char* base) {
    const cpu::PackedBf16 w{reinterpret_cast<const uint16_t*>(base), int64_t(panels * 16), kK, kK};
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; ++t) {
      const int64_t c0 = int64_t(panels * size_t(t) / size_t(threads)) * 16;
      const int64_t c1 = int64_t(panels * size_t(t + 1) / size_t(threads)) * 16;
      if (c0 < c1) kern.gemm_bf16_tile(x.data(), kK, 1, w, c0, c1, y.data(), int64_t(y.size()));
    }
  };
  struct Variant {
    int streams;  // 0: the decode pattern
    size_t dist;
    int buf;  // 0: huge pages, 1: plain pages
    double best = 0;
  };
  std::vector<Variant> variants;
  for (int b = 0; b < 2; ++b) {
    const std::pair<int, size_t> ways[] = {{1, 0}, {2, 1024}, {4, 0}, {4, 2048}, {8, 0}, {8, 2048}, {8, 4096}, {16, 4096}};
    for (const auto& [streams, dist] : ways)
      if (b == 0 || (streams == 8 && dist > 0) || streams == 4) variants.push_back({streams, dist, b});
    if (kern.gemm_bf16_tile) variants.push_back({0, 0, b});
  }
  for (auto& buf : bufs) stream(buf.get(), 8, 4096);  // warm: the first pass after the fill is not timed
  const auto t_start = Clock::now();
  for (int round = 0; round < 8 && (round < 3 || seconds_since(t_start) < 1.5); ++round)
    for (auto& v : variants) {
      const auto t0 = Clock::now();
      if (v.streams) stream(bufs[v.buf].get(), v.streams, v.dist);
      else decode(bufs[v.buf].get());
      v.best = std::max(v.best, double(bytes) / seconds_since(t0) / 1e9);
    }
  std::sort(variants.begin(), variants.end(), [](const Variant& a, const Variant& b) { return a.best > b.best; });
  auto name = [&](const Variant& v) {
    const std::string what =
        v.streams ? fmt::format("{} stream{} per thread, prefetch {} B ahead", v.streams, v.streams > 1 ? "s" : "", v.dist)
                  : fmt::format("the experts' decode pattern ({} bf16 tile, one row)", cpu::isa_name(kern.isa));
    return fmt::format("{}, {} pages", what, v.buf == 0 ? "huge" : "plain");
  };
  detail = name(variants[0]);
  const std::string thp = thp_mode();
  detail += fmt::format("; next {:.1f} ({}), {:.1f} ({}); {:.2f} GB buffers, THP {}", variants[1].best,
                        name(variants[1]), variants[2].best, name(variants[2]), double(bytes) / 1e9,
                        thp.empty() ? "unknown" : thp);
  return variants[0].best;
}

#ifdef MOEKIT_WITH_CUDA
void require_cuda_device(Device device) {
  MOEKIT_CHECK_CODE(device.index < cuda_device_count(), not_supported, "device ", device.to_string(),
                    " is not available: ", cuda_device_count(),
                    " CUDA devices found (none, or the driver cannot be loaded); use --device cpu");
}
#endif

// The card's name and its last-level cache (CPU: model and threads, L3; CUDA: the device, L2).
void describe_device(Device device, Ceilings& c) {
  if (device.is_cpu()) {
    c.card = fmt::format("{} ({} threads)", cpu_model_name(), omp_get_max_threads());
    c.cache_bytes = cpu_cache_bytes();
    return;
  }
#ifdef MOEKIT_WITH_CUDA
  require_cuda_device(device);
  const cuda::CardInfo info = cuda::card_info(device.index);
  c.card = info.name;
  c.cache_bytes = info.l2_bytes;
#else
  MOEKIT_FAIL(not_supported, "device ", device.to_string(), ": moekit was built without CUDA");
#endif
}

}  // namespace

Ceilings given_ceilings(Device device, double peak_tflops, double bandwidth_gbps) {
  MOEKIT_CHECK(peak_tflops > 0 && bandwidth_gbps > 0, "given ceilings must be > 0, got ", peak_tflops,
               " TFLOP/s and ", bandwidth_gbps, " GB/s");
  Ceilings c;
  c.peak_tflops = peak_tflops;
  c.bandwidth_gbps = bandwidth_gbps;
  c.method = "given on the command line";
  describe_device(device, c);
  return c;
}

Ceilings measure_ceilings(Device device, const std::string& quant) {
  Ceilings c;
  describe_device(device, c);
  if (device.is_cpu()) {
    const double bf16 = cpu_bf16_gemm_gflops();
    const double blocked = cpu_blocked_gemm_gflops();
    const double grouped = cpu_grouped_mm_gflops();
    c.peak_tflops = std::max({bf16, blocked, grouped}) / 1e3;
    std::string read_how;
    const double copy = cpu_copy_gbps(c.cache_bytes), read = cpu_read_gbps(c.cache_bytes, read_how);
    c.bandwidth_gbps = std::max(copy, read);
    c.method = fmt::format("peak: best of the bf16 GEMM on packed weights ({}: {:.1f} GFLOP/s), a blocked f32 GEMM "
                           "({:.1f} GFLOP/s) and grouped_mm (one dense f32 expert; 16 bf16 experts of 128 rows: {:.1f} GFLOP/s); bandwidth: "
                           "the better of a multi-threaded read ({:.1f} GB/s, best variant: {}) and memcpy, read + write ({:.1f} GB/s)",
                           cpu::isa_supported(cpu::Isa::amx)          ? "amx"
                           : cpu::isa_supported(cpu::Isa::avx512bf16) ? "avx512bf16"
                                                                      : "none here",
                           bf16, blocked, grouped, read, read_how, copy);
    return c;
  }
#ifdef MOEKIT_WITH_CUDA
  c.peak_tflops = cuda::gemm_bf16_tflops(device.index, 8192);
  c.bandwidth_gbps = cuda::copy_gbps(device.index, size_t(2) << 30);
  c.method = "peak: cuBLAS bf16 GEMM 8192^3 on random data; bandwidth: 2 GiB device-to-device copy, read + write";
  if (quant == "fp8" || quant == "fp4") {  // experts on the FP8 tensor cores: their own peak
    c.fp8_peak_tflops = cuda::gemm_fp8_tflops(device.index, 8192);
    c.method += c.fp8_peak_tflops > 0
                    ? "; FP8 peak (the floor of FP8 experts): cuBLASLt e4m3 GEMM 8192^3 (bf16 out, f32 accumulate)"
                    : "; no cuBLASLt e4m3 GEMM on this device: the FP8 floor uses the bf16 peak";
  }
  return c;
#else
  MOEKIT_FAIL(not_supported, "device ", device.to_string(), ": moekit was built without CUDA");
#endif
}

}  // namespace moekit::bench

// Internal: `moekit bench`, the experts benchmark with method (DESIGN habit 8).
//
// For each shape, token count and backend: random weights normal(0, 0.02) and inputs normal(0, 1),
// top-k routing (uniform or skewed); the output is checked against the f64 reference on a subsample
// of rows before timing; warm-up; the median of many calls, each call on the next of several input
// sets whose total exceeds the last-level cache; time, TFLOP/s, GB/s and the ratio to the roofline
// floor max(FLOPs / peak, bytes / bandwidth), with both ceilings measured on the machine at start (the CPU ones again
// at the end of the run, the better of each kept; records above a ceiling get a warning).
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "bench/presets.h"
#include "moekit/tensor.h"

namespace moekit::bench {

enum class Routing : uint8_t {
  uniform,  // K distinct experts per token, uniformly at random
  skewed,   // K distinct experts per token, drawn from a Zipf(1) popularity over a random expert order
};
Routing parse_routing(std::string_view name);  // "uniform" | "skewed"; throws
const char* routing_name(Routing r);

// The machine's two ceilings, measured once.
struct Ceilings {
  std::string card;           // "NVIDIA H200", "AMD EPYC (2 threads)"
  double peak_tflops = 0;     // dense matrix rate (bf16 on the GPU)
  double fp8_peak_tflops = 0; // dense e4m3 rate (GPU, measured for --quant fp8 / fp4), 0 where not measured
  double bandwidth_gbps = 0;  // copy bandwidth, bytes read plus bytes written
  int64_t cache_bytes = 0;    // L2 (GPU) or last-level cache (CPU)
  std::string method;         // how each number was obtained
};
// GPU: cuBLAS bf16 GEMM 8192^3 and a ~2 GiB device copy; with `quant` fp8 or fp4 (FP8 tensor-core experts) also a
// cuBLASLt e4m3 GEMM 8192^3 (fp8_peak_tflops). CPU: the best of moekit's bf16 GEMM on packed weights, a blocked f32
// GEMM and grouped_mm (one dense f32 expert; 16 bf16 experts of 128 rows), each after a warm-up call; and the better of
// a multi-threaded memcpy and a read test (several ways over huge and plain pages, 4x the cache) (ceilings.cpp).
Ceilings measure_ceilings(Device device, const std::string& quant = "");
// The matrix rate that bounds experts of `quant` (BenchOptions::quant): the FP8 one for fp8 and fp4 (activations
// quantized to FP8: the FP8 tensor cores) where it was measured, else peak_tflops (bf16, mxfp4).
double matrix_peak_tflops(const Ceilings& c, const std::string& quant);
// Reads only the card name and cache size; `peak_tflops` and `bandwidth_gbps` are taken as given.
Ceilings given_ceilings(Device device, double peak_tflops, double bandwidth_gbps);
// Two measurements of one machine's ceilings (e.g. at the start and at the end of a run) as one: each number the
// higher of the two (a ceiling is the most the machine did; a lower reading is a busy moment), the method naming both.
Ceilings best_ceilings(const Ceilings& first, const Ceilings& again);

// ---- the roofline of one forward ----
// 2 * T * K * (H * N1 + I * H), N1 = 2I for gated experts, I otherwise.
double forward_flops(const ShapePreset& shape, int64_t tokens);
// Bytes of one expert's weights and biases; with `quant` (fp8, fp4, mxfp4: BenchOptions::quant) the quantized
// weights' bytes and their scales'.
double expert_bytes(const ShapePreset& shape, DType weight_dtype, const std::string& quant = "");
// Expected number of distinct experts hit by T tokens under uniform routing: E (1 - (1 - K/E)^T).
double expected_experts_touched(const ShapePreset& shape, int64_t tokens);
// Distinct experts' weights plus the activations read and written (hidden_states, out, routing).
double forward_bytes(const ShapePreset& shape, int64_t tokens, double experts_touched, DType dtype,
                     DType index_dtype, const std::string& quant = "");
// max(flops / peak, bytes / bandwidth), in microseconds; the peak is matrix_peak_tflops(c, quant).
double floor_us(double flops, double bytes, const Ceilings& c, const std::string& quant = "");

// ---- a run ----
struct BenchOptions {
  std::vector<ShapePreset> shapes;
  std::vector<int64_t> tokens = {1, 8, 64, 512};
  std::vector<std::string> backends;  // empty: every registered backend
  Device device = Device::cpu();
  DType dtype = DType::bf16;          // weights and activations
  // "" or a quantized format of the experts (made from the random weights; CPU backends): fp8 (e4m3, 128 x 128
  // f32 block scales, activations quantized per token and 128), fp4 (e2m1 with a ue8m0 scale per row and 32,
  // activations in FP8), mxfp4 (the same weights, activations as they are). The floor counts their bytes.
  std::string quant;
  DType index_dtype = DType::i64;     // top_k_index, as transformers passes it
  bool graph = false;                 // also time CUDA-graph replays of capturable backends
  int64_t graph_max_tokens = std::numeric_limits<int64_t>::max();
  Routing routing = Routing::uniform;
  int warmup = 3;
  int iters = 50;         // at most this many timed calls
  int min_iters = 5;      // at least this many
  double min_time_s = 0.2;     // time calls until this much has passed (within iters)
  double max_seconds = 30;     // per case: skip it when its estimated run would take longer
  // CUDA: hold the stream this many microseconds (a device-side wait) before each timed call's start event, so that
  // the call is already enqueued when its clock starts: device time alone, as a decode loop that runs ahead of the
  // GPU sees it. 0: the stream is idle at the start event, and the host's launch of the call is timed with it.
  double queue_ahead_us = 0;
  // Calls per clock reading: R consecutive calls (the input sets in turn) timed together, their time over R recorded
  // as one sample: the cost of a call in a stream of calls, as a model's layers make them (each launch overlapping
  // the call before). 1: each call timed alone.
  int calls_per_sample = 1;
  double tolerance = -1;       // relative L2 vs the f64 reference; <= 0: 1e-5 for f32, 1e-2 otherwise
  int64_t check_macs = 300'000'000;  // reference work per check (rows are subsampled to fit; 0: no reference rows)
  uint64_t seed = 1;

  std::string to_string() const;
};

// One timed case.
struct BenchRecord {
  std::string shape, backend, device, dtype, routing;
  int64_t tokens = 0;
  bool graph = false;
  double median_us = 0, min_us = 0, tflops = 0, gbps = 0, floor_us = 0, floor_ratio = 0;
  double flops = 0, bytes = 0, experts_touched = 0;
  double moved_bytes = 0;  // the backend's own plan (ExpertsBackend::bytes_moved); 0 when it does not say
  double rel_err = 0;      // vs the f64 reference on the checked rows (-1: none checked, --check-macs 0)
  int64_t check_rows = 0;  // rows compared with the reference
  int iters = 0;
  int buffer_sets = 0;
  int calls_per_sample = 1;
};

// A case that did not run, and why (NOT AVAILABLE, NOT SUPPORTED, FAILED CHECK, too slow, ...).
struct BenchSkip {
  std::string shape, backend;
  int64_t tokens = 0;  // 0: every token count
  bool graph = false;
  std::string reason;
};

struct BenchReport {
  Ceilings ceilings;
  std::vector<BenchRecord> records;
  std::vector<BenchSkip> skipped;
  std::vector<std::string> warnings;  // ceiling_warnings
};

// One line per record that ran faster than a ceiling allows: more GB/s than the bandwidth or more TFLOP/s than the
// peak (its floor ratio below 1: the ceiling was measured too low, or its experts were partly in the cache between
// calls, which the line says when all the shape's experts fit in 4x the cache).
std::vector<std::string> ceiling_warnings(const BenchReport& report, const BenchOptions& options);
// Sets report.ceilings, recomputes every record's floor and ratio from them, then report.warnings.
void set_ceilings(BenchReport& report, const Ceilings& c, const BenchOptions& options);

struct BenchProgress {
  int done = 0, total = 0;
  std::string label;  // the case that just finished
};
using ProgressFn = std::function<void(const BenchProgress&)>;
using ReportFn = std::function<void(const BenchReport&)>;

// Runs every case; `progress` after each, `shape_done` after each shape (for incremental output).
// Throws only for bad options; cases that cannot run are listed in `skipped`.
BenchReport run_bench(const BenchOptions& options, const Ceilings& ceilings, const ProgressFn& progress = {},
                      const ReportFn& shape_done = {});

// Parses "1,8,64" (positive integers); throws naming the bad item.
std::vector<int64_t> parse_token_list(std::string_view list);

}  // namespace moekit::bench

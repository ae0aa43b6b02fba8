// moekit bench: times the experts backends on real models' shapes against the machine's roofline.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/core.h>

#include "bench/bench.h"
#include "bench/ep_bench.h"
#include "bench/report.h"
#include "commands.h"
#include "moekit/interface.h"

namespace moekit::cli {
namespace {

struct BenchArgs {
  std::string shapes, dims, tokens = "1,8,64,512", backends = "all", device = "cpu", dtype = "bf16",
                              index_dtype = "i64", routing = "uniform", json, plot, quant;
  bool graph = false, quiet = false;
  int64_t graph_max_tokens = -1;
  int64_t ep = 1;
  int warmup = 3, iters = 50, min_iters = 5, calls_per_sample = 1;
  double min_time = 0.2, max_seconds = 30, tolerance = -1, peak_tflops = 0, bandwidth_gbps = 0, queue_ahead_us = 0;
  int64_t check_macs = 300'000'000;
  uint64_t seed = 1;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    if (comma > pos) out.push_back(s.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return out;
}

bench::BenchOptions to_options(const BenchArgs& a) {
  bench::BenchOptions o;
  if (!a.dims.empty()) {
    o.shapes.push_back(bench::parse_dims(a.dims));
  } else if (a.shapes == "all") {
    o.shapes = bench::shape_presets();
  } else {
    for (const auto& name : split(a.shapes.empty() ? "qwen3-30b-a3b" : a.shapes))
      o.shapes.push_back(bench::find_shape_preset(name));
  }
  MOEKIT_CHECK(!o.shapes.empty(), "--shape '", a.shapes, "' names no shape");
  o.tokens = bench::parse_token_list(a.tokens);
  if (a.backends != "all") {
    o.backends = split(a.backends);
    MOEKIT_CHECK(!o.backends.empty(), "--backends '", a.backends, "' names no backend");
    for (const auto& b : o.backends) ExpertsInterface::global().get(b);  // unknown: lists the valid names
  }
  o.device = Device::parse(a.device);
  o.dtype = parse_dtype(a.dtype);
  o.quant = a.quant;
  o.index_dtype = parse_dtype(a.index_dtype);
  o.graph = a.graph;
  if (a.graph_max_tokens > 0) o.graph_max_tokens = a.graph_max_tokens;
  o.routing = bench::parse_routing(a.routing);
  o.warmup = a.warmup;
  o.iters = a.iters;
  o.min_iters = std::min(a.min_iters, a.iters);
  o.min_time_s = a.min_time;
  o.max_seconds = a.max_seconds;
  o.queue_ahead_us = a.queue_ahead_us;
  o.calls_per_sample = a.calls_per_sample;
  o.tolerance = a.tolerance;
  o.check_macs = a.check_macs;
  o.seed = a.seed;
  MOEKIT_CHECK(!o.graph || o.device.is_cuda(), "--graph needs --device cuda (CUDA graphs), got --device ", a.device);
  MOEKIT_CHECK(a.queue_ahead_us == 0 || o.device.is_cuda(), "--queue-ahead-us needs --device cuda (it holds a CUDA "
               "stream), got --device ", a.device);
  MOEKIT_CHECK((a.peak_tflops > 0) == (a.bandwidth_gbps > 0),
               "give both --peak-tflops and --bandwidth-gbps, or neither (then both are measured)");
  return o;
}

// The command that reproduces the run (configs are values: DESIGN habit 7).
std::string command_line(const BenchArgs& a, const bench::BenchOptions& o) {
  std::string s = "moekit bench";
  if (!a.dims.empty()) s += " --dims " + a.dims;
  else s += " --shape " + (a.shapes.empty() ? std::string("qwen3-30b-a3b") : a.shapes);
  s += fmt::format(" --tokens {} --backends {} --device {} --dtype {} --routing {}", a.tokens, a.backends, a.device,
                   a.dtype, a.routing);
  if (a.index_dtype != "i64") s += " --index-dtype " + a.index_dtype;
  if (!a.quant.empty()) s += " --quant " + a.quant;
  if (o.graph) s += a.graph_max_tokens > 0 ? fmt::format(" --graph --graph-max-tokens {}", a.graph_max_tokens) : " --graph";
  s += fmt::format(" --warmup {} --iters {} --min-iters {} --min-time {} --max-seconds {}", a.warmup, a.iters,
                   a.min_iters, a.min_time, a.max_seconds);
  if (a.peak_tflops > 0) s += fmt::format(" --peak-tflops {} --bandwidth-gbps {}", a.peak_tflops, a.bandwidth_gbps);
  if (a.tolerance >= 0) s += fmt::format(" --tolerance {}", a.tolerance);
  if (a.queue_ahead_us > 0) s += fmt::format(" --queue-ahead-us {}", a.queue_ahead_us);
  if (a.calls_per_sample != 1) s += fmt::format(" --calls-per-sample {}", a.calls_per_sample);
  if (a.check_macs != bench::BenchOptions{}.check_macs) s += fmt::format(" --check-macs {}", a.check_macs);
  if (a.seed != 1) s += fmt::format(" --seed {}", a.seed);
  return s;
}

// `--json -`: standard output. A path that exists and is not a regular file (/dev/stdout, a FIFO, a
// device) is written in place; only a regular file is replaced atomically through a temporary file in
// its folder, so a reader never sees half a report and a special file is never renamed over.
// Whether `path` exists and is something other than a regular file or a folder (a FIFO, a device).
bool is_special_file(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  return !ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st) &&
         !std::filesystem::is_directory(st);
}

void write_json(const std::string& path, const nlohmann::json& j) {
  const std::string text = j.dump(1) + "\n";
  if (path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return;
  }
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st)) {
    MOEKIT_CHECK_CODE(!std::filesystem::is_directory(st), io, "--json: '", path, "' is a directory");
    std::ofstream f(path);
    f << text;
    f.flush();
    MOEKIT_CHECK_CODE(f.good(), io, "--json: cannot write '", path, "'");
    return;
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    MOEKIT_CHECK_CODE(f.good(), io, "--json: cannot write '", path, "'");
    f << text;
    f.flush();
    MOEKIT_CHECK_CODE(f.good(), io, "--json: cannot write '", path, "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    MOEKIT_FAIL(io, "--json: cannot write '", path, "'");
  }
}

// On a terminal: a bar redrawn in place; elsewhere (logs): one line per case. Shown once the run
// has taken over a second.
class ProgressBar {
 public:
  explicit ProgressBar(bool enabled) : enabled_(enabled), tty_(isatty(2)), t0_(std::chrono::steady_clock::now()) {}
  void operator()(const bench::BenchProgress& p) {
    if (!enabled_) return;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    if (s < 1.0 && p.done < p.total) return;
    if (!tty_) {
      fmt::print(stderr, "[{}/{}] {:.0f} s  {}\n", p.done, p.total, s, p.label);
      return;
    }
    const int width = 30, filled = p.total ? width * p.done / p.total : width;
    fmt::print(stderr, "\r[{}{}] {}/{} {:.0f} s  {:<48.48}", std::string(size_t(filled), '#'),
               std::string(size_t(width - filled), '.'), p.done, p.total, s, p.label);
    if (p.done == p.total) fmt::print(stderr, "\n");
  }

 private:
  bool enabled_, tty_;
  std::chrono::steady_clock::time_point t0_;
};

// --ep N: one layer over an expert-parallel group (CPU: this process is one rank of `mpirun -np N`; CUDA: N
// GPUs of this process over NCCL, one thread each); rank 0 prints.
void run_ep_bench_command(const BenchArgs& a) {
  const bench::BenchOptions base = to_options(a);
  MOEKIT_CHECK(!a.graph && a.plot.empty() && a.routing == "uniform",
               "--ep: --graph, --plot and --routing skewed do not apply to the expert-parallel benchmark");
  bench::EpBenchOptions o;
  o.shapes = base.shapes;
  o.tokens = base.tokens;
  o.dtype = base.dtype;
  o.seed = base.seed;
  o.warmup = a.warmup;
  o.iters = std::min(a.iters, 20);
  if (!base.backends.empty()) o.backend = base.backends.front();
  const std::string shape_arg = !a.dims.empty() ? " --dims " + a.dims
                                                 : " --shape " + (a.shapes.empty() ? std::string("qwen3-30b-a3b") : a.shapes);
  const std::string command = fmt::format("moekit bench --ep {}{} --tokens {} --backends {} --device {} --dtype {}", a.ep,
                                          shape_arg, a.tokens, o.backend, a.device, a.dtype);
  auto report = [&](const std::vector<bench::EpBenchRecord>& records, const std::string& card) {
    fmt::print("{}", bench::format_ep_table(records, card));
    fmt::print("\ncommand: {}\n", command);
    if (!a.json.empty()) {
      write_json(a.json, nlohmann::json::parse(bench::ep_records_to_json(records, card, command)));
      fmt::print("json: {}\n", a.json);
    }
    std::fflush(stdout);
  };
  if (base.device.is_cpu()) {
    const ExpertGroupPtr g = mpi_world_group();
    MOEKIT_CHECK(g->size() == a.ep, "--ep ", a.ep, ": this MPI job has ", g->size(),
                 " process(es); start it with mpirun -np ", a.ep);
    const auto records = bench::run_ep_bench(o, g);
    if (g->rank() == 0) report(records, fmt::format("{} CPU processes over MPI", a.ep));
    return;
  }
  std::vector<int> devices;
  for (int64_t i = 0; i < a.ep; ++i) devices.push_back(base.device.index + int(i));
  const auto groups = nccl_local_groups(devices);
  std::vector<std::vector<bench::EpBenchRecord>> results(groups.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < groups.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        results[r] = bench::run_ep_bench(o, groups[r]);
      } catch (const std::exception& e) {  // the other ranks would wait forever in a collective
        fmt::print(stderr, "moekit: error: rank {}: {}\n", r, e.what());
        std::fflush(stderr);
        std::_Exit(2);
      }
    });
  for (auto& t : threads) t.join();
  report(results[0], fmt::format("{} GPUs ({}) over NCCL", a.ep, bench::given_ceilings(base.device, 1, 1).card));
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  auto* cmd = app.add_subcommand(
      "bench", "time the experts backends on real models' shapes: checked against the f64 reference, median of many "
               "calls, TFLOP/s, GB/s and the ratio to the roofline floor");
  auto* shape = cmd->add_option("--shape", a->shapes,
                                "preset(s), comma-separated, or all: qwen3-30b-a3b (default), qwen1.5-moe-a2.7b, "
                                "mixtral-8x7b, gpt-oss-20b, deepseek-v3, olmoe-1b-7b");
  cmd->add_option("--dims", a->dims, "a gated silu shape H,I,E,K instead of a preset")->excludes(shape);
  cmd->add_option("--tokens", a->tokens, "token counts, comma-separated")->capture_default_str();
  cmd->add_option("--backends", a->backends, "backend names, comma-separated, or all")->capture_default_str();
  cmd->add_option("--device", a->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "weights and activations")->check(CLI::IsMember({"bf16", "f16", "f32"}))->capture_default_str();
  cmd->add_option("--quant", a->quant,
                  "quantized experts made from the random weights: fp8 (128 x 128 blocks), fp4 (UE8M0 per 32, FP8 "
                  "activations), mxfp4 (float activations); the floor counts their bytes (CPU backends)")
      ->check(CLI::IsMember({"fp8", "fp4", "mxfp4"}));
  cmd->add_option("--index-dtype", a->index_dtype, "top_k_index dtype")->check(CLI::IsMember({"i32", "i64"}))->capture_default_str();
  cmd->add_flag("--graph", a->graph, "also time CUDA-graph replays of the capturable backends (CUDA)");
  cmd->add_option("--graph-max-tokens", a->graph_max_tokens, "graph replays only up to this many tokens");
  cmd->add_option("--routing", a->routing, "uniform or skewed (Zipf-like) top-k routing")
      ->check(CLI::IsMember({"uniform", "skewed"}))->capture_default_str();
  cmd->add_option("--json", a->json, "write the records as JSON (a regular file: rewritten after each shape); - for standard output");
  cmd->add_option("--plot", a->plot, "write a PNG plot of time vs tokens (gnuplot); one per shape");
  cmd->add_option("--warmup", a->warmup, "warm-up calls")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--iters", a->iters, "at most this many timed calls")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--min-iters", a->min_iters, "at least this many timed calls")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--min-time", a->min_time, "time calls for at least this many seconds (within --iters)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--max-seconds", a->max_seconds, "skip a case whose run would take longer than this")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--tolerance", a->tolerance, "relative L2 error allowed vs the f64 reference (default 1e-5 f32, 1e-2 bf16/f16)");
  cmd->add_option("--check-macs", a->check_macs,
                  "reference work per check; rows are subsampled to fit (0: no reference rows, outputs still checked "
                  "for unwritten or non-finite values; rel_err -1)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--queue-ahead-us", a->queue_ahead_us,
                  "CUDA: hold the stream this long on the device before each timed call, so that its clock starts with "
                  "the call already enqueued (device time without the host's launch latency); 0: idle stream")
      ->check(CLI::Range(0.0, 1e6))->capture_default_str();
  cmd->add_option("--calls-per-sample", a->calls_per_sample,
                  "time this many consecutive calls (the input sets in turn) per clock reading and record their time "
                  "over that many: a call's cost in a stream of calls, as a model's layers make them; 1: each call alone")
      ->check(CLI::Range(1, 1024))->capture_default_str();
  cmd->add_option("--peak-tflops", a->peak_tflops, "use this matrix rate instead of measuring it")->check(CLI::PositiveNumber);
  cmd->add_option("--bandwidth-gbps", a->bandwidth_gbps, "use this copy bandwidth instead of measuring it")->check(CLI::PositiveNumber);
  cmd->add_option("--seed", a->seed, "random seed")->capture_default_str();
  cmd->add_flag("--quiet", a->quiet, "no progress on stderr");
  cmd->add_option("--ep", a->ep,
                  "expert parallelism over N ranks (CPU: under mpirun -np N; CUDA: N GPUs over NCCL): both modes "
                  "against the whole layer on one device, with the all-to-all volume and stage times")
      ->check(CLI::PositiveNumber);

  cmd->callback([a] {
    if (a->ep > 1) return run_ep_bench_command(*a);
    const bench::BenchOptions o = to_options(*a);
    const std::string command = command_line(*a, o);
    if (!a->quiet) fmt::print(stderr, "moekit bench: measuring the ceilings of {}...\n", o.device.to_string());
    const bench::Ceilings ceilings = a->peak_tflops > 0 ? bench::given_ceilings(o.device, a->peak_tflops, a->bandwidth_gbps)
                                                        : bench::measure_ceilings(o.device, o.quant);
    ProgressBar bar(!a->quiet);
    // `--json -` keeps standard output for the JSON alone: the table goes to stderr. A stream (standard
    // output, a FIFO, a device) gets the report once, at the end; a regular file is rewritten after each shape.
    const bool json_stdout = a->json == "-";
    const bool json_once = json_stdout || is_special_file(a->json);
    FILE* text_out = json_stdout ? stderr : stdout;
    auto on_shape = [&](const bench::BenchReport& partial) {
      if (!a->json.empty() && !json_once) write_json(a->json, bench::report_to_json(partial, o, command));
    };
    bench::BenchReport report = bench::run_bench(o, ceilings, std::ref(bar), on_shape);
    if (a->peak_tflops <= 0 && o.device.is_cpu()) {
      // CPU ceilings measured here are measured again after the run and the better of the two kept: a host's
      // bandwidth varies with its other tenants, and one reading at the start was seen below what the experts
      // streamed later in the same run.
      if (!a->quiet) fmt::print(stderr, "moekit bench: measuring the ceilings of {} again...\n", o.device.to_string());
      bench::set_ceilings(report, bench::best_ceilings(ceilings, bench::measure_ceilings(o.device, o.quant)), o);
    }
    fmt::print(text_out, "{}", bench::format_table(report, o));
    fmt::print(text_out, "\ncommand: {}\n", command);
    if (!a->json.empty()) {
      write_json(a->json, bench::report_to_json(report, o, command));
      if (!json_stdout) fmt::print("json: {}\n", a->json);
    }
    if (!a->plot.empty()) {
      for (const auto& s : o.shapes) {
        const std::string path = bench::plot_path_for(a->plot, s, o.shapes.size());
        try {
          bench::write_plot(report, o, s, path);
          fmt::print(text_out, "plot: {}\n", path);
        } catch (const Error& e) {
          // One shape with nothing to plot should not hide the others' plots.
          if (e.code() != ErrorCode::not_supported || o.shapes.size() == 1) throw;
          fmt::print(text_out, "plot: {} skipped: {}\n", path, e.what());
        }
      }
    }
    std::fflush(stdout);
  });
}

}  // namespace moekit::cli

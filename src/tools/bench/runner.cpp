// The benchmark loop: shapes x backends x token counts (x graph replay), each checked, then timed.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>

#include <fmt/core.h>

#include "bench/bench.h"
#include "bench/workload.h"
#include "moekit/quant.h"
#include "moekit/interface.h"
#ifdef MOEKIT_WITH_CUDA
#include "bench/cuda_bench.h"
#include "moekit/cuda_graph.h"
#endif

namespace moekit::bench {

Routing parse_routing(std::string_view name) {
  if (name == "uniform") return Routing::uniform;
  if (name == "skewed") return Routing::skewed;
  MOEKIT_FAIL(invalid_argument, "unknown routing '", name, "'; expected uniform or skewed");
}

const char* routing_name(Routing r) { return r == Routing::uniform ? "uniform" : "skewed"; }

std::vector<int64_t> parse_token_list(std::string_view list) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= list.size()) {
    const size_t comma = std::min(list.find(',', pos), list.size());
    const std::string_view item = list.substr(pos, comma - pos);
    int64_t v = 0;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    MOEKIT_CHECK(!item.empty() && ec == std::errc() && end == item.data() + item.size() && v > 0, "token list '", list,
                 "': '", item, "' is not a positive integer");
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

std::string BenchOptions::to_string() const {
  std::string shape_names, backend_names, token_list;
  for (const auto& s : shapes) shape_names += (shape_names.empty() ? "" : ",") + s.name;
  for (const auto& b : backends) backend_names += (backend_names.empty() ? "" : ",") + b;
  for (int64_t t : tokens) token_list += (token_list.empty() ? "" : ",") + std::to_string(t);
  return fmt::format(
      "BenchOptions{{.shapes={}, .tokens={}, .backends={}, .device={}, .dtype={}, .index_dtype={}, .graph={}, "
      ".graph_max_tokens={}, .routing={}, .warmup={}, .iters={}, .min_iters={}, .min_time_s={}, .max_seconds={}, "
      ".tolerance={}, .check_macs={}, .seed={}, .quant={}, .queue_ahead_us={}, .calls_per_sample={}}}",
      shape_names, token_list, backend_names.empty() ? "all" : backend_names, device.to_string(), dtype_name(dtype),
      dtype_name(index_dtype), graph, graph_max_tokens, routing_name(routing), warmup, iters, min_iters, min_time_s,
      max_seconds, tolerance, check_macs, seed, quant.empty() ? "none" : quant, queue_ahead_us,
      calls_per_sample);
}

// ---- roofline ----
double forward_flops(const ShapePreset& s, int64_t T) {
  const double n1 = double(s.intermediate) * 2;  // the presets are gated
  return 2.0 * double(T) * double(s.top_k) * (double(s.hidden) * n1 + double(s.intermediate) * double(s.hidden));
}

double expert_bytes(const ShapePreset& s, DType wt, const std::string& quant) {
  const double H = double(s.hidden), I = double(s.intermediate);
  const double weights = H * 2 * I + I * H, biases = s.has_bias ? 2 * I + H : 0;
  if (quant == "fp8")  // e4m3, one f32 scale per 128 x 128 block
    return weights + 4.0 * (double(2 * fp8_blocks(s.intermediate) * fp8_blocks(s.hidden)) +
                            double(fp8_blocks(s.hidden) * fp8_blocks(s.intermediate))) +
           biases * double(dtype_nbytes(wt, 1));
  if (quant == "fp4" || quant == "mxfp4")  // e2m1, one ue8m0 scale per row and 32 inputs
    return weights * (0.5 + 1.0 / 32) + biases * double(dtype_nbytes(wt, 1));
  return (weights + biases) * double(dtype_nbytes(wt, 1));
}

double expected_experts_touched(const ShapePreset& s, int64_t T) {
  const double E = double(s.num_experts), K = double(s.top_k);
  return E * (1.0 - std::pow(1.0 - K / E, double(T)));
}

double forward_bytes(const ShapePreset& s, int64_t T, double touched, DType dtype, DType index_dtype,
                     const std::string& quant) {
  const double act = 2.0 * double(T) * double(s.hidden) * double(dtype_nbytes(dtype, 1));
  const double routing = double(T) * double(s.top_k) * double(dtype_nbytes(index_dtype, 1) + dtype_nbytes(dtype, 1));
  return touched * expert_bytes(s, dtype, quant) + act + routing;
}

double matrix_peak_tflops(const Ceilings& c, const std::string& quant) {
  return (quant == "fp8" || quant == "fp4") && c.fp8_peak_tflops > 0 ? c.fp8_peak_tflops : c.peak_tflops;
}

double floor_us(double flops, double bytes, const Ceilings& c, const std::string& quant) {
  const double peak = matrix_peak_tflops(c, quant);
  MOEKIT_CHECK(peak > 0 && c.bandwidth_gbps > 0, "ceilings must be > 0, got ", peak, " TFLOP/s and ",
               c.bandwidth_gbps, " GB/s");
  return std::max(flops / (peak * 1e12), bytes / (c.bandwidth_gbps * 1e9)) * 1e6;
}

Ceilings best_ceilings(const Ceilings& first, const Ceilings& again) {
  Ceilings c = first;
  c.peak_tflops = std::max(first.peak_tflops, again.peak_tflops);
  c.fp8_peak_tflops = std::max(first.fp8_peak_tflops, again.fp8_peak_tflops);
  c.bandwidth_gbps = std::max(first.bandwidth_gbps, again.bandwidth_gbps);
  c.method = fmt::format("the better of two measurements: first {:.3g} TFLOP/s, {:.1f} GB/s; again at the end {:.3g} "
                         "TFLOP/s, {:.1f} GB/s. First: {}. Again: {}",
                         first.peak_tflops, first.bandwidth_gbps, again.peak_tflops, again.bandwidth_gbps,
                         first.method, again.method);
  return c;
}

std::vector<std::string> ceiling_warnings(const BenchReport& report, const BenchOptions& o) {
  std::vector<std::string> out;
  const Ceilings& c = report.ceilings;
  for (const auto& r : report.records) {
    const double peak = matrix_peak_tflops(c, o.quant);
    const bool bw = r.gbps > c.bandwidth_gbps, fl = r.tflops > peak;
    if (!bw && !fl) continue;
    std::string line = fmt::format("warning: {} {} T={}{}: ", r.shape, r.backend, r.tokens, r.graph ? " (graph)" : "");
    if (bw) line += fmt::format("{:.1f} GB/s, above the bandwidth ceiling {:.1f}", r.gbps, c.bandwidth_gbps);
    if (bw && fl) line += "; ";
    if (fl) line += fmt::format("{:.3g} TFLOP/s, above the peak {:.3g}", r.tflops, peak);
    for (const auto& s : o.shapes) {
      if (s.name != r.shape || !bw) continue;
      const double all = double(s.num_experts) * expert_bytes(s, o.dtype, o.quant);
      if (c.cache_bytes > 0 && all < 4.0 * double(c.cache_bytes))
        line += fmt::format(" (its {:.2f} GB of experts may be partly in the {:.0f} MiB cache between calls)", all / 1e9,
                            double(c.cache_bytes) / (1 << 20));
      break;
    }
    out.push_back(line);
  }
  return out;
}

void set_ceilings(BenchReport& report, const Ceilings& c, const BenchOptions& o) {
  report.ceilings = c;
  for (auto& r : report.records) {
    r.floor_us = floor_us(r.flops, r.bytes, c, o.quant);
    r.floor_ratio = r.median_us / r.floor_us;
  }
  report.warnings = ceiling_warnings(report, o);
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Bytes of memory the machine can give this run, with room left for the rest of the process.
double usable_memory_bytes(Device device) {
  if (device.is_cpu()) {
    std::ifstream in("/proc/meminfo");
    std::string key;
    int64_t kb = 0;
    std::string unit;
    while (in >> key >> kb >> unit)
      if (key == "MemAvailable:") return 0.8 * double(kb) * 1024;
    return 8e9;
  }
#ifdef MOEKIT_WITH_CUDA
  return 0.9 * double(cuda::card_info(device.index).free_bytes);
#else
  return 0;
#endif
}

// The device-specific part of timing: one call on the CPU clock or between CUDA events.
class Timer {
 public:
  Timer(Device device, double queue_ahead_us) : device_(device), queue_ahead_us_(queue_ahead_us) {
#ifdef MOEKIT_WITH_CUDA
    if (device.is_cuda()) stream_ = cuda::create_stream(device.index);
#endif
  }
  ~Timer() {
#ifdef MOEKIT_WITH_CUDA
    if (stream_) cuda::destroy_stream(stream_);
#endif
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  Stream stream() const { return stream_; }
  void synchronize() const {
#ifdef MOEKIT_WITH_CUDA
    if (stream_) cuda::synchronize(stream_);
#endif
  }
  // Microseconds of one call (its work finished when this returns).
  double time_us(const std::function<void()>& fn) const {
#ifdef MOEKIT_WITH_CUDA
    if (device_.is_cuda()) return cuda::time_call_us(stream_, fn, queue_ahead_us_);
#endif
    const auto t0 = Clock::now();
    fn();
    return seconds_since(t0) * 1e6;
  }

 private:
  Device device_;
  double queue_ahead_us_ = 0;
  Stream stream_ = nullptr;
};

struct Case {
  std::string backend;
  bool graph = false;
  std::string label(const ShapePreset& s, int64_t T) const {
    return fmt::format("{} {} T={}{}", s.name, backend, T, graph ? " graph" : "");
  }
};

class ShapeRunner {
 public:
  ShapeRunner(const BenchOptions& o, const Ceilings& c, const ShapePreset& s, BenchReport& r, const Timer& timer)
      : opt_(o), ceil_(c), shape_(s), report_(r), timer_(timer) {}

  void skip(const Case& c, int64_t T, std::string reason) {
    report_.skipped.push_back({shape_.name, c.backend, T, c.graph, std::move(reason)});
  }

  // Runs every case of this shape; `cases` are the (backend, graph) pairs that can run at all.
  void run(const std::vector<Case>& cases, const std::function<void(const std::string&)>& step) {
    const Experts experts = make_random_experts(shape_, opt_.dtype, opt_.device, opt_.seed, opt_.quant);
    std::vector<Case> runnable;
    for (const auto& c : cases) {
      const Support s = ExpertsInterface::global().get(c.backend)->supports(experts, opt_.dtype);
      if (s) {
        runnable.push_back(c);
        continue;
      }
      skip(c, 0, "NOT SUPPORTED: " + s.reason);
      for (int64_t T : opt_.tokens)
        if (!c.graph || T <= opt_.graph_max_tokens) step(c.label(shape_, T));
    }
    std::vector<int64_t> popularity(static_cast<size_t>(shape_.num_experts));
    std::iota(popularity.begin(), popularity.end(), 0);
    std::shuffle(popularity.begin(), popularity.end(), std::mt19937_64(opt_.seed * 7 + 5));
    const double tol = opt_.tolerance > 0 ? opt_.tolerance : experts_tolerance(opt_.dtype);

    // Inputs and reference rows per token count, made on first use and shared by every backend.
    std::map<int64_t, TokenData> data;
    auto data_for = [&](int64_t T) -> TokenData& {
      auto it = data.find(T);
      if (it != data.end()) return it->second;
      TokenData& d = data[T];
      // Input sets: together beyond the cache (activations and the experts each set hits).
      const double per_set =
          forward_bytes(shape_, T, expected_experts_touched(shape_, T), opt_.dtype, opt_.index_dtype, opt_.quant);
      const double act_per_set = 2.0 * double(T) * double(shape_.hidden) * double(dtype_nbytes(opt_.dtype, 1));
      const double act_budget = opt_.device.is_cpu() ? 1e9 : 4e9;
      int n_sets = int(std::clamp(std::ceil(3.0 * double(ceil_.cache_bytes) / per_set), 3.0, 64.0));
      n_sets = std::max(2, std::min(n_sets, int(act_budget / std::max(1.0, act_per_set))));
      try {
        for (int i = 0; i < n_sets; ++i)
          d.sets.push_back(make_input_set(shape_, T, opt_.dtype, opt_.index_dtype, opt_.routing, popularity,
                                          opt_.device, opt_.seed * 1000003 + uint64_t(T) * 131 + uint64_t(i), i == 0));
        for (const auto& s : d.sets) d.touched += double(s.experts_touched);
        d.touched /= double(d.sets.size());
        d.ref = reference_rows(experts, shape_, d.sets[0], opt_.check_macs);
      } catch (const Error& e) {
        d.sets.clear();
        d.failure = std::string("inputs could not be made: ") + e.what();
      }
      return d;
    };

    // Backend by backend (plain, then graph replay), so that only one backend's state is alive.
    for (size_t i = 0; i < runnable.size();) {
      size_t j = i;
      while (j < runnable.size() && runnable[j].backend == runnable[i].backend) ++j;
      // Per case: the last token count timed and its median, to predict the next one's cost.
      std::map<bool, std::pair<int64_t, double>> last;
      for (int64_t T : opt_.tokens) {
        for (size_t ci = i; ci < j; ++ci) {
          const Case& c = runnable[ci];
          if (c.graph && T > opt_.graph_max_tokens) continue;
          run_case(experts, c, T, data_for, last, tol);
          step(c.label(shape_, T));
        }
      }
      experts.clear_state();
      i = j;
    }
  }

 private:
  struct TokenData {
    std::vector<InputSet> sets;
    ReferenceRows ref;
    double touched = 0;
    std::string failure;
  };

  void run_case(const Experts& experts, const Case& c, int64_t T, const std::function<TokenData&(int64_t)>& data_for,
                std::map<bool, std::pair<int64_t, double>>& last, double tol) {
    try {
      // Predicted seconds per call, scaled from the last token count (never below it).
      if (auto it = last.find(c.graph); it != last.end()) {
        const double predicted = it->second.second * 1e-6 * std::max(1.0, double(T) / double(it->second.first));
        if (predicted * (1 + opt_.min_iters) > opt_.max_seconds) {
          skip(c, T, it->second.second >= 1e29
                         ? fmt::format("too slow: T={} was already too slow or failed (--max-seconds {})",
                                       it->second.first, opt_.max_seconds)
                         : fmt::format("too slow: about {:.2g} s per call predicted from T={} (--max-seconds {})",
                                       predicted, it->second.first, opt_.max_seconds));
          return;
        }
      }
      TokenData& d = data_for(T);
      if (!d.failure.empty()) {
        skip(c, T, d.failure);
        return;
      }
      BenchRecord rec = time_case(experts, c, T, d.sets, d.ref, tol);
      rec.experts_touched = d.touched;
      rec.flops = forward_flops(shape_, T);
      rec.bytes = forward_bytes(shape_, T, d.touched, opt_.dtype, opt_.index_dtype, opt_.quant);
      // The backends' model of the bytes they move counts float weights: not given for quantized experts.
      rec.moved_bytes = opt_.quant.empty() ? ExpertsInterface::global().get(c.backend)->bytes_moved(
                                                 shape_.spec(), T, shape_.top_k, d.touched, opt_.dtype)
                                           : 0;
      rec.floor_us = floor_us(rec.flops, rec.bytes, ceil_, opt_.quant);
      rec.floor_ratio = rec.median_us / rec.floor_us;
      rec.tflops = rec.flops / rec.median_us / 1e6;
      rec.gbps = rec.bytes / rec.median_us / 1e3;
      rec.buffer_sets = int(d.sets.size());
      rec.check_rows = int64_t(d.ref.rows.size());
      last[c.graph] = {T, rec.median_us};
      report_.records.push_back(std::move(rec));
    } catch (const Error& e) {
      skip(c, T, e.what());
      // A device failure, or a call over the time budget: don't try larger T.
      if (e.code() == ErrorCode::runtime || std::string_view(e.what()).find("too slow") != std::string_view::npos)
        last[c.graph] = {T, 1e30};
    }
  }

  BenchRecord time_case(const Experts& experts, const Case& c, int64_t T, std::vector<InputSet>& sets,
                        const ReferenceRows& ref, double tol) {
    const Stream stream = timer_.stream();
    const size_t n_sets = sets.size();
    auto forward = [&](size_t i) { experts.forward_with(c.backend, sets[i].call(stream)); };

    // Check first: poison, one call (it also creates the backend's state), compare with the reference.
    poison_output(sets[0].out, stream);
    const auto t0 = Clock::now();
    forward(0);
    timer_.synchronize();
    double per_call = seconds_since(t0);
#ifdef MOEKIT_WITH_CUDA
    if (opt_.device.is_cuda()) check_experts_errors(experts, stream);  // ids rejected on the device, if any
#endif
    std::string problem;
    double err = check_output(ref, sets[0].out, problem);
    if (ref.rows.empty() && std::isfinite(err)) err = -1;  // --check-macs 0: every output finite, no reference rows
    MOEKIT_CHECK_CODE(err <= tol, internal, "FAILED CHECK: relative L2 error ", fmt::format("{:.3e}", err),
                      " vs the f64 reference on ", ref.rows.size(), " rows exceeds ", tol,
                      problem.empty() ? "" : " (" + problem + ")");

    std::function<void(size_t)> call = forward;
#ifdef MOEKIT_WITH_CUDA
    // Graph replays through the public API: one ExpertsGraph per input set, its buffers loaded once.
    std::vector<ExpertsGraph> graphs;
    if (c.graph) {
      const ExpertsGraphShape gs{.tokens = T, .top_k = shape_.top_k, .act_dtype = opt_.dtype,
                                 .index_dtype = opt_.index_dtype, .weight_dtype = opt_.dtype};
      for (size_t i = 0; i < n_sets; ++i) {
        graphs.emplace_back(experts, gs, c.backend);
        graphs.back().hidden_states().copy_from(sets[i].hidden_states.view());
        graphs.back().top_k_index().copy_from(sets[i].top_k_index.view());
        graphs.back().top_k_weights().copy_from(sets[i].top_k_weights.view());
      }
      call = [&](size_t i) { graphs[i].replay(stream); };
      // The replay must compute the same function: check it too.
      Tensor out0 = graphs[0].out();
      poison_output(out0, stream);
      call(0);
      timer_.synchronize();
      graphs[0].check_errors(stream);
      err = check_output(ref, out0, problem);
      MOEKIT_CHECK_CODE(err <= tol, internal, "FAILED CHECK (graph replay): relative L2 error ",
                        fmt::format("{:.3e}", err), " exceeds ", tol, problem.empty() ? "" : " (" + problem + ")");
    }
#else
    MOEKIT_CHECK_CODE(!c.graph, not_supported, "CUDA graphs need a CUDA build");
#endif
    const int R = opt_.calls_per_sample;
    const double planned_calls = 1.0 + double(opt_.min_iters) * R;
    if (per_call * planned_calls > opt_.max_seconds) {
      // The first call also ran the backend's one-time work (prepare: weight repacks, workspaces): time a
      // second one before calling the case too slow.
      const auto t1 = Clock::now();
      call(1 % n_sets);
      timer_.synchronize();
      per_call = seconds_since(t1);
    }
    MOEKIT_CHECK_CODE(per_call * planned_calls <= opt_.max_seconds, not_supported,
                      fmt::format("too slow: one call took {:.2f} s (--max-seconds {})", per_call, opt_.max_seconds));

    // Warm-up, rotating through the sets; stops early once it has taken min_time.
    size_t next = 1 % n_sets;
    const auto w0 = Clock::now();
    for (int i = 0; i < opt_.warmup; ++i) {
      call(next);
      next = (next + 1) % n_sets;
      if (seconds_since(w0) > opt_.min_time_s) break;
    }
    timer_.synchronize();
    std::vector<double> us;
    const auto m0 = Clock::now();
    while (int(us.size()) < opt_.iters) {
      us.push_back(timer_.time_us([&] {
                     for (int i = 0; i < R; ++i) {
                       call(next);
                       next = (next + 1) % n_sets;
                     }
                   }) /
                   R);
      const double spent = seconds_since(m0);
      if (int(us.size()) >= opt_.min_iters && (spent >= opt_.min_time_s || spent >= opt_.max_seconds)) break;
    }
    BenchRecord r;
    r.shape = shape_.name;
    r.backend = c.backend;
    r.device = opt_.device.to_string();
    r.dtype = dtype_name(opt_.dtype);
    if (!opt_.quant.empty()) r.dtype += "+" + opt_.quant;  // activations + quantized weights
    r.routing = routing_name(opt_.routing);
    r.tokens = T;
    r.graph = c.graph;
    r.median_us = median(us);
    r.min_us = *std::min_element(us.begin(), us.end());
    r.iters = int(us.size());
    r.calls_per_sample = R;
    r.rel_err = err;
    return r;
  }

  const BenchOptions& opt_;
  const Ceilings& ceil_;
  const ShapePreset& shape_;
  BenchReport& report_;
  const Timer& timer_;
};

}  // namespace

BenchReport run_bench(const BenchOptions& opt, const Ceilings& ceilings, const ProgressFn& progress,
                      const ReportFn& shape_done) {
  MOEKIT_CHECK(!opt.shapes.empty(), "bench: no shapes given");
  MOEKIT_CHECK(!opt.tokens.empty(), "bench: no token counts given");
  for (int64_t t : opt.tokens) MOEKIT_CHECK(t > 0, "bench: token counts must be > 0, got ", t);
  MOEKIT_CHECK(opt.dtype == DType::f32 || opt.dtype == DType::bf16 || opt.dtype == DType::f16,
               "bench: dtype must be f32, bf16 or f16, got ", dtype_name(opt.dtype));
  MOEKIT_CHECK(opt.index_dtype == DType::i32 || opt.index_dtype == DType::i64, "bench: index dtype must be i32 or i64, got ",
               dtype_name(opt.index_dtype));
  MOEKIT_CHECK(opt.iters >= 1 && opt.min_iters >= 1 && opt.warmup >= 0, "bench: need iters >= 1, min_iters >= 1, warmup >= 0; got ",
               opt.iters, ", ", opt.min_iters, ", ", opt.warmup);
  MOEKIT_CHECK(opt.max_seconds > 0, "bench: max_seconds must be > 0, got ", opt.max_seconds);
  MOEKIT_CHECK(opt.calls_per_sample >= 1 && opt.calls_per_sample <= 1024,
               "bench: calls_per_sample must be in [1, 1024], got ", opt.calls_per_sample);
  MOEKIT_CHECK(opt.queue_ahead_us >= 0 && opt.queue_ahead_us <= 1e6, "bench: queue_ahead_us must be in [0, 1e6], got ",
               opt.queue_ahead_us);
  MOEKIT_CHECK(!opt.graph || opt.device.is_cuda(), "bench: CUDA graphs (--graph) need --device cuda");
  MOEKIT_CHECK_CODE(opt.device.is_cpu() || cuda_available(), not_supported, "bench: device ", opt.device.to_string(),
                    " is not available (", cuda_device_count(), " CUDA devices in this build and machine)");
  for (const auto& s : opt.shapes) s.spec().validate();

  auto& registry = ExpertsInterface::global();
  std::vector<std::string> names = opt.backends;
  if (names.empty()) names = registry.names();
  for (const auto& n : names) registry.get(n);  // unknown names throw with the valid list

  BenchReport report;
  report.ceilings = ceilings;
  int total = 0, done = 0;
  for (size_t i = 0; i < opt.shapes.size(); ++i)
    for (const auto& n : names)
      for (int64_t T : opt.tokens) total += 1 + int(opt.graph && T <= opt.graph_max_tokens && registry.get(n)->graph_capturable());
  auto step = [&](const std::string& label) {
    ++done;
    if (progress) progress({done, total, label});
  };

  const Timer timer(opt.device, opt.queue_ahead_us);
  for (const auto& shape : opt.shapes) {
    std::vector<Case> cases;
    auto skip_all = [&](const Case& c, const std::string& why) {
      report.skipped.push_back({shape.name, c.backend, 0, c.graph, why});
      for (int64_t T : opt.tokens)
        if (!c.graph || T <= opt.graph_max_tokens) step(fmt::format("{} {} T={}{}", shape.name, c.backend, T, c.graph ? " graph" : ""));
    };
    const double weights = double(shape.num_experts) * expert_bytes(shape, opt.dtype, opt.quant);
    const double room = usable_memory_bytes(opt.device);
    for (const auto& n : names) {
      const auto backend = registry.get(n);
      Case plain{n, false};
      const bool graph = opt.graph && backend->graph_capturable();
      const Support av = backend->available(opt.device);
      std::string why;
      if (!av) why = "NOT AVAILABLE: " + av.reason;
      else if (weights > room) why = fmt::format("weights of {:.1f} GB do not fit in the {:.1f} GB available on {}", weights / 1e9, room / 1e9, opt.device.to_string());
      if (!why.empty()) {
        skip_all(plain, why);
        if (graph) skip_all({n, true}, why);
        continue;
      }
      cases.push_back(plain);
      if (graph) cases.push_back({n, true});
    }
    if (cases.empty()) {
      if (shape_done) shape_done(report);
      continue;
    }
    const int done_after_shape = done + [&] {
      int n = 0;
      for (const auto& c : cases)
        for (int64_t T : opt.tokens) n += !c.graph || T <= opt.graph_max_tokens;
      return n;
    }();
    try {
      ShapeRunner runner(opt, ceilings, shape, report, timer);
      runner.run(cases, step);
    } catch (const Error& e) {
      report.skipped.push_back({shape.name, "", 0, false, std::string("shape failed: ") + e.what()});
    }
    while (done < done_after_shape) step(shape.name);
    report.warnings = ceiling_warnings(report, opt);
    if (shape_done) shape_done(report);
  }
  return report;
}

}  // namespace moekit::bench

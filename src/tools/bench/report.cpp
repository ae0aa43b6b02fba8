#include "bench/report.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <set>

#include <fmt/core.h>

namespace moekit::bench {
namespace {

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string case_name(const std::string& backend, bool graph) { return graph ? backend + " (graph)" : backend; }

// A string inside single quotes in a gnuplot script ('' is a quote).
std::string gp_quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("''") : std::string(1, ch);
  return out + "'";
}

}  // namespace

nlohmann::json record_to_json(const BenchRecord& r) {
  return {{"shape", r.shape},         {"tokens", r.tokens},
          {"backend", r.backend},     {"device", r.device},
          {"dtype", r.dtype},         {"graph", r.graph},
          {"routing", r.routing},     {"median_us", r.median_us},
          {"min_us", r.min_us},       {"tflops", r.tflops},
          {"gbps", r.gbps},           {"floor_us", r.floor_us},
          {"floor_ratio", r.floor_ratio}, {"flops", r.flops},
          {"bytes", r.bytes},         {"moved_bytes", r.moved_bytes},
          {"experts_touched", r.experts_touched},
          {"rel_err", r.rel_err},     {"check_rows", r.check_rows},
          {"iters", r.iters},         {"buffer_sets", r.buffer_sets},
          {"calls_per_sample", r.calls_per_sample}};
}

nlohmann::json report_to_json(const BenchReport& report, const BenchOptions& options, const std::string& command) {
  nlohmann::json j;
  j["card"] = report.ceilings.card;
  j["peak_tflops"] = report.ceilings.peak_tflops;
  if (report.ceilings.fp8_peak_tflops > 0) j["fp8_peak_tflops"] = report.ceilings.fp8_peak_tflops;
  j["copy_tbps"] = report.ceilings.bandwidth_gbps / 1e3;
  j["cache_bytes"] = report.ceilings.cache_bytes;
  j["ceilings_method"] = report.ceilings.method;
  j["date"] = utc_now();
  j["command"] = command;
  j["options"] = options.to_string();
  j["records"] = nlohmann::json::array();
  for (const auto& r : report.records) j["records"].push_back(record_to_json(r));
  j["warnings"] = report.warnings;
  j["skipped"] = nlohmann::json::array();
  for (const auto& s : report.skipped)
    j["skipped"].push_back(
        {{"shape", s.shape}, {"backend", s.backend}, {"tokens", s.tokens}, {"graph", s.graph}, {"reason", s.reason}});
  return j;
}

std::string format_table(const BenchReport& report, const BenchOptions& options) {
  const Ceilings& c = report.ceilings;
  std::string out = fmt::format("moekit bench on {} ({}): {}, {} routing\n", c.card, options.device.to_string(),
                                dtype_name(options.dtype), routing_name(options.routing));
  const std::string fp8_peak = c.fp8_peak_tflops > 0 ? fmt::format(" ({:.3g} FP8)", c.fp8_peak_tflops) : "";
  out += fmt::format("ceilings: {:.3g} TFLOP/s{}, {:.1f} GB/s copy, cache {:.0f} MiB ({})\n", c.peak_tflops, fp8_peak,
                     c.bandwidth_gbps, double(c.cache_bytes) / (1 << 20), c.method);
  for (const auto& shape : options.shapes) {
    out += fmt::format("\n{}\n", shape.to_string());
    out += fmt::format("{:<20} {:>6} {:>11} {:>11} {:>9} {:>8} {:>8} {:>11} {:>8} {:>9} {:>6}\n", "backend", "T",
                       "median_us", "min_us", "MB moved", "TFLOP/s", "GB/s", "floor_us", "x floor", "rel_err", "iters");
    for (int64_t T : options.tokens)
      for (const auto& r : report.records) {
        if (r.shape != shape.name || r.tokens != T) continue;
        const std::string moved = r.moved_bytes > 0 ? fmt::format("{:.1f}", r.moved_bytes / 1e6) : "-";
        const std::string err = r.rel_err >= 0 ? fmt::format("{:.1e}", r.rel_err) : "-";
        out += fmt::format("{:<20} {:>6} {:>11.1f} {:>11.1f} {:>9} {:>8.3f} {:>8.1f} {:>11.1f} {:>8.2f} {:>9} {:>6}\n",
                           case_name(r.backend, r.graph), r.tokens, r.median_us, r.min_us, moved, r.tflops, r.gbps,
                           r.floor_us, r.floor_ratio, err, r.iters);
      }
    bool header = false;
    for (const auto& s : report.skipped) {
      if (s.shape != shape.name) continue;
      if (!header) out += "skipped:\n", header = true;
      out += fmt::format("  {:<20} {:<8} {}\n", case_name(s.backend.empty() ? "(all)" : s.backend, s.graph),
                         s.tokens ? "T=" + std::to_string(s.tokens) : "all T", s.reason);
    }
  }
  if (!report.warnings.empty()) out += "\n";
  for (const auto& w : report.warnings) out += w + "\n";
  return out;
}

bool gnuplot_available() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

std::string plot_path_for(const std::string& path, const ShapePreset& shape, size_t n_shapes) {
  if (n_shapes <= 1) return path;
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  return has_ext ? path.substr(0, dot) + "-" + shape.name + path.substr(dot) : path + "-" + shape.name;
}

void write_plot(const BenchReport& report, const BenchOptions& options, const ShapePreset& shape,
                const std::string& path) {
  MOEKIT_CHECK_CODE(gnuplot_available(), not_supported, "--plot needs gnuplot (Debian: apt-get install gnuplot-nox)");
  // One series per (backend, graph), points sorted by T; the floor per T.
  std::map<std::string, std::map<int64_t, double>> series;
  std::map<int64_t, double> floor;
  for (const auto& r : report.records) {
    if (r.shape != shape.name) continue;
    series[case_name(r.backend, r.graph)][r.tokens] = r.median_us;
    floor[r.tokens] = r.floor_us;
  }
  MOEKIT_CHECK_CODE(!series.empty(), not_supported, "--plot: no timed cases for ", shape.name, " to plot");

  std::string gp;
  gp += "set terminal pngcairo size 1100,700 enhanced font 'DejaVu Sans,11'\n";
  gp += "set output " + gp_quote(path) + "\n";
  gp += "set logscale xy\nset grid xtics ytics mxtics mytics lc rgb '#dddddd'\n";
  gp += "set xlabel 'tokens T'\nset ylabel 'time per forward (microseconds, median)'\n";
  gp += "set key outside right top box\nset format y '10^{%L}'\n";
  std::string xtics;
  for (int64_t t : options.tokens) xtics += (xtics.empty() ? "" : ", ") + std::to_string(t);
  gp += "set xtics (" + xtics + ")\n";
  const auto [tmin, tmax] = std::minmax_element(options.tokens.begin(), options.tokens.end());
  gp += fmt::format("set xrange [{}:{}]\n", double(*tmin) / 1.3, double(*tmax) * 1.3);
  gp += "set title " +
        gp_quote(fmt::format("{}: {} on {} ({}), {} routing", shape.to_string(), dtype_name(options.dtype),
                             report.ceilings.card, options.device.to_string(), routing_name(options.routing))) +
        " noenhanced\n";
  std::string plot = "plot ";
  int i = 0;
  // Distinct colours that read on white (gnuplot's default fifth colour is a pale yellow).
  static const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b",
                                  "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
  for (const auto& [name, pts] : series) {
    plot += fmt::format("'-' using 1:2 with linespoints lw 2 pt {} ps 1.2 lc rgb '{}' title {} noenhanced, ", 5 + (i % 8),
                        kColors[i % 9], gp_quote(name));
    ++i;
  }
  plot += "'-' using 1:2 with lines dt 2 lw 2 lc rgb 'black' title 'roofline floor'\n";
  gp += plot;
  for (const auto& [name, pts] : series) {
    for (const auto& [t, us] : pts) gp += fmt::format("{} {:.6g}\n", t, us);
    gp += "e\n";
  }
  for (const auto& [t, us] : floor) gp += fmt::format("{} {:.6g}\n", t, us);
  gp += "e\n";

  char script[] = "/tmp/moekit-plot-XXXXXX";
  const int fd = mkstemp(script);
  MOEKIT_CHECK_CODE(fd >= 0, io, "--plot: cannot create a temporary file in /tmp");
  close(fd);
  {
    std::ofstream f(script);
    f << gp;
  }
  const std::string err_file = std::string(script) + ".err";
  const int rc = std::system(fmt::format("gnuplot {} 2>{}", script, err_file).c_str());
  std::string err;
  {
    std::ifstream e(err_file);
    err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  }
  std::remove(script);
  std::remove(err_file.c_str());
  MOEKIT_CHECK_CODE(rc == 0, io, "--plot: gnuplot failed writing '", path, "': ", err);
  std::ifstream check(path);
  MOEKIT_CHECK_CODE(check.good(), io, "--plot: gnuplot ran but '", path, "' was not written: ", err);
}

}  // namespace moekit::bench

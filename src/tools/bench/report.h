// Internal: what `moekit bench` writes: the JSON report, the table, the gnuplot plot.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "bench/bench.h"

namespace moekit::bench {

// {"card", "peak_tflops", "copy_tbps", "cache_bytes", "ceilings_method", "date", "command", "options",
//  "records": [...], "skipped": [...]}
nlohmann::json report_to_json(const BenchReport& report, const BenchOptions& options, const std::string& command);
nlohmann::json record_to_json(const BenchRecord& r);

// A readable table: ceilings, then per shape one row per timed case, then the cases skipped and why.
std::string format_table(const BenchReport& report, const BenchOptions& options);

bool gnuplot_available();
// The plot file of one shape: `path` itself when the run has one shape, else "<stem>-<shape><ext>".
std::string plot_path_for(const std::string& path, const ShapePreset& shape, size_t n_shapes);
// Time per forward vs tokens (log-log), one line per backend (and graph replay), the roofline floor
// dashed; a PNG through gnuplot. Throws Error(not_supported) without gnuplot, Error(io) when it fails.
void write_plot(const BenchReport& report, const BenchOptions& options, const ShapePreset& shape,
                const std::string& path);

}  // namespace moekit::bench

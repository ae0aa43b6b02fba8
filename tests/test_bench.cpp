// moekit bench: presets, the roofline floor, the ceilings' GEMM, the check that gates timing, and the CLI.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "backends/reference.h"
#include "bench/bench.h"
#include "base/gemm.h"
#include "bench/report.h"
#include "test_experts_problem.h"
#include "test_util.h"
#ifdef MOEKIT_WITH_CUDA
#include "bench/cuda_bench.h"
#endif

using namespace moekit;
using namespace moekit::bench;
using moekit::test::CliResult;
using moekit::test::run_cli;

namespace {

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "moekit_bench_" + std::to_string(::getpid()) + "_" + name;
}

}  // namespace

TEST(BenchPresets, KnownShapesAndDims) {
  const ShapePreset q = find_shape_preset("qwen3-30b-a3b");
  EXPECT_EQ(q.hidden, 2048);
  EXPECT_EQ(q.intermediate, 768);
  EXPECT_EQ(q.num_experts, 128);
  EXPECT_EQ(q.top_k, 8);
  const ShapePreset g = find_shape_preset("gpt-oss-20b");
  EXPECT_TRUE(g.has_bias && g.is_transposed && !g.is_concatenated);
  EXPECT_EQ(g.gate, GateKind::clamped_swiglu);
  EXPECT_EQ(shape_presets().size(), 6u);
  for (const auto& p : shape_presets()) EXPECT_NO_THROW(p.spec().validate()) << p.name;
  EXPECT_THROW(find_shape_preset("qwen4"), Error);

  const ShapePreset d = parse_dims("64,32,8,2");
  EXPECT_EQ(d.hidden, 64);
  EXPECT_EQ(d.intermediate, 32);
  EXPECT_EQ(d.num_experts, 8);
  EXPECT_EQ(d.top_k, 2);
  for (const char* bad : {"64,32,8", "64,32,8,2,1", "a,32,8,2", "64,32,8,9", "0,32,8,2", "64,-1,8,2", ""})
    EXPECT_THROW(parse_dims(bad), Error) << bad;
  EXPECT_EQ(parse_token_list("1,8,64"), (std::vector<int64_t>{1, 8, 64}));
  for (const char* bad : {"", "1,,2", "0", "x", "1,2,"}) EXPECT_THROW(parse_token_list(bad), Error) << bad;
}

TEST(BenchRoofline, FloorOfAKnownCase) {
  const ShapePreset s{.name = "t", .hidden = 2, .intermediate = 3, .num_experts = 4, .top_k = 2};
  // 2 * T * K * (H * 2I + I * H) = 2 * 5 * 2 * (12 + 6)
  EXPECT_DOUBLE_EQ(forward_flops(s, 5), 360.0);
  // (H * 2I + I * H) elements of 2 bytes
  EXPECT_DOUBLE_EQ(expert_bytes(s, DType::bf16), 36.0);
  ShapePreset b = s;
  b.has_bias = true;  // + 2I + H
  EXPECT_DOUBLE_EQ(expert_bytes(b, DType::f32), 4.0 * (18 + 6 + 2));
  EXPECT_DOUBLE_EQ(expected_experts_touched(s, 1), 2.0);  // E (1 - (1 - K/E)^T) = 4 * 0.5
  EXPECT_NEAR(expected_experts_touched(s, 1000), 4.0, 1e-12);
  // 3 experts touched: 3 * 36 bytes + x and out (2 * 5 * 2 * 2) + routing (5 * 2 * (8 + 2))
  const double bytes = forward_bytes(s, 5, 3.0, DType::bf16, DType::i64);
  EXPECT_DOUBLE_EQ(bytes, 108.0 + 40.0 + 100.0);
  Ceilings c;
  c.peak_tflops = 1e-9;   // 1000 FLOP/s: 360 FLOPs take 0.36 s
  c.bandwidth_gbps = 1e-6;  // 1000 B/s: 248 bytes take 0.248 s
  EXPECT_DOUBLE_EQ(floor_us(360.0, bytes, c), 0.36e6);
  c.bandwidth_gbps = 1e-7;  // now the bytes bound: 2.48 s
  EXPECT_DOUBLE_EQ(floor_us(360.0, bytes, c), 2.48e6);
  c.peak_tflops = 0;
  EXPECT_THROW(floor_us(1, 1, c), Error);
}

// Two readings of the ceilings keep the higher of each; a record that ran above a ceiling is named by a warning (and
// whether its experts fit in the cache); set_ceilings recomputes the floors.
TEST(BenchCeilings, BestOfTwoReadingsAndRecordsAboveThem) {
  Ceilings a, b;
  a.peak_tflops = 2, a.bandwidth_gbps = 100, a.cache_bytes = 1 << 20, a.method = "A";
  b.peak_tflops = 3, b.bandwidth_gbps = 80, b.cache_bytes = 1 << 20, b.method = "B";
  const Ceilings c = best_ceilings(a, b);
  EXPECT_DOUBLE_EQ(c.peak_tflops, 3);
  EXPECT_DOUBLE_EQ(c.bandwidth_gbps, 100);
  EXPECT_NE(c.method.find("A"), std::string::npos);
  EXPECT_NE(c.method.find("B"), std::string::npos);

  BenchOptions o;
  o.shapes = {parse_dims("64,32,8,2"), find_shape_preset("mixtral-8x7b")};  // 24 KiB of bf16 experts; 2.8 GB
  BenchReport r;
  auto rec = [](const std::string& shape, int64_t T, double gbps, double tflops) {
    BenchRecord x;
    x.shape = shape, x.backend = "grouped_mm", x.tokens = T, x.median_us = 1000;
    x.bytes = gbps * 1e6, x.flops = tflops * 1e9, x.gbps = gbps, x.tflops = tflops;
    return x;
  };
  r.records = {rec("mixtral-8x7b", 1, 99, 0.1), rec("mixtral-8x7b", 8, 120, 0.2), rec("dims-64x32x8x2", 1, 101, 0.01),
               rec("mixtral-8x7b", 2048, 50, 3.5)};
  set_ceilings(r, c, o);
  ASSERT_EQ(r.warnings.size(), 3u) << ::testing::PrintToString(r.warnings);
  EXPECT_NE(r.warnings[0].find("mixtral-8x7b grouped_mm T=8: 120.0 GB/s, above the bandwidth ceiling 100.0"),
            std::string::npos) << r.warnings[0];
  EXPECT_EQ(r.warnings[0].find("cache"), std::string::npos) << r.warnings[0];  // 2.8 GB: not in a 1 MiB cache
  EXPECT_NE(r.warnings[1].find("dims-64x32x8x2"), std::string::npos) << r.warnings[1];
  EXPECT_NE(r.warnings[1].find("may be partly in the 1 MiB cache"), std::string::npos) << r.warnings[1];
  EXPECT_NE(r.warnings[2].find("T=2048: 3.5 TFLOP/s, above the peak 3"), std::string::npos) << r.warnings[2];
  // Floors from the new ceilings: 99 MB at 100 GB/s = 990 us; 3.5 GFLOP at 3 TFLOP/s = 1167 us.
  EXPECT_NEAR(r.records[0].floor_us, 990.0, 1e-9);
  EXPECT_NEAR(r.records[0].floor_ratio, 1000.0 / 990.0, 1e-12);
  EXPECT_NEAR(r.records[3].floor_us, 3.5e9 / 3e12 * 1e6, 1e-6);
  EXPECT_LT(r.records[3].floor_ratio, 1.0);
}

TEST(BenchCeilings, BlockedGemmMatchesNaive) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> d;
  for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 19, 300}, {101, 1030, 517}}) {
    std::vector<float> a(size_t(M * K)), b(size_t(K * N)), c(size_t(M * N), NAN);
    for (auto& v : a) v = d(rng);
    for (auto& v : b) v = d(rng);
    const cpu::WeightMatrix w{b.data(), cpu::WType::f32, N, K, /*transposed=*/true};  // b [K, N]
    cpu::gemm(cpu::gemm_kernels(), a.data(), K, M, w, c.data(), N);
    double num = 0, den = 0;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double ref = 0;
        for (int64_t p = 0; p < K; ++p) ref += double(a[size_t(i * K + p)]) * b[size_t(p * N + j)];
        const double got = c[size_t(i * N + j)];
        ASSERT_TRUE(std::isfinite(got)) << M << "x" << N << "x" << K << " at " << i << "," << j;
        num += (got - ref) * (got - ref);
        den += ref * ref;
      }
    EXPECT_LT(std::sqrt(num / den), 1e-5) << M << "x" << N << "x" << K;
  }
}

TEST(BenchCeilings, CpuMeasuresBoth) {
  const Ceilings c = measure_ceilings(Device::cpu());
  EXPECT_GT(c.peak_tflops, 1e-4);  // > 0.1 GFLOP/s even in a debug build
  EXPECT_LT(c.peak_tflops, 1e3);
  EXPECT_GT(c.bandwidth_gbps, 0.1);
  EXPECT_LT(c.bandwidth_gbps, 1e5);
  EXPECT_GT(c.cache_bytes, 0);
  EXPECT_FALSE(c.card.empty());
}

// The check before timing must be able to fail: a backend that is wrong is not timed.
TEST(BenchRun, WrongBackendsAreNotTimed) {
  auto& reg = ExpertsInterface::global();
  auto exact = [](const Experts& e, const ExpertsCall& c) {
    const std::vector<double> ref = reference_forward(e, c.hidden_states, c.top_k_index, c.top_k_weights);
    for (size_t i = 0; i < ref.size(); ++i) c.out.ptr<float>()[i] = float(ref[i]);
  };
  reg.register_backend("bench_test_exact", exact, {DeviceType::cpu}, "test", true);
  reg.register_backend("bench_test_scaled", [exact](const Experts& e, const ExpertsCall& c) {
    exact(e, c);
    for (int64_t i = 0; i < c.out.numel(); ++i) c.out.ptr<float>()[i] *= 1.01f;
  }, {DeviceType::cpu}, "test", true);
  reg.register_backend("bench_test_last_row_unwritten", [exact](const Experts& e, const ExpertsCall& c) {
    const int64_t T = c.tokens(), H = c.out.shape[1];
    std::vector<float> keep(c.out.ptr<float>() + (T - 1) * H, c.out.ptr<float>() + T * H);
    exact(e, c);
    std::copy(keep.begin(), keep.end(), c.out.ptr<float>() + (T - 1) * H);
  }, {DeviceType::cpu}, "test", true);

  BenchOptions o;
  o.shapes = {parse_dims("48,40,6,2")};
  o.tokens = {3, 9};
  o.backends = {"bench_test_exact", "bench_test_scaled", "bench_test_last_row_unwritten", "deepgemm"};
  o.dtype = DType::f32;
  o.iters = 3;
  o.min_iters = 2;
  o.min_time_s = 0;
  const Ceilings c = given_ceilings(Device::cpu(), 0.01, 5.0);
  int last_done = 0, total = 0;
  const BenchReport r = run_bench(o, c, [&](const BenchProgress& p) {
    EXPECT_EQ(p.done, last_done + 1);
    last_done = p.done;
    total = p.total;
  });
  EXPECT_EQ(total, 8);
  EXPECT_EQ(last_done, total);
  ASSERT_EQ(r.records.size(), 2u);
  for (const auto& rec : r.records) {
    EXPECT_EQ(rec.backend, "bench_test_exact");
    EXPECT_LT(rec.rel_err, 1e-6);
    EXPECT_GT(rec.median_us, 0);
    EXPECT_LE(rec.min_us, rec.median_us);
    EXPECT_GE(rec.iters, 2);
    EXPECT_LE(rec.iters, 3);
    EXPECT_EQ(rec.check_rows, std::min<int64_t>(rec.tokens, 8));
    EXPECT_EQ(rec.moved_bytes, 0.0);  // a user backend that does not say what it moves
  }
  int scaled = 0, unwritten = 0, unavailable = 0;
  for (const auto& s : r.skipped) {
    if (s.backend == "bench_test_scaled") scaled += s.reason.find("FAILED CHECK") != std::string::npos;
    if (s.backend == "bench_test_last_row_unwritten")
      unwritten += s.reason.find("NaN") != std::string::npos && s.reason.find("FAILED CHECK") != std::string::npos;
    if (s.backend == "deepgemm") unavailable += s.reason.find("NOT AVAILABLE") != std::string::npos;
  }
  EXPECT_EQ(scaled, 2);
  EXPECT_EQ(unwritten, 2);
  EXPECT_EQ(unavailable, 1);
  for (const char* n : {"bench_test_exact", "bench_test_scaled", "bench_test_last_row_unwritten"}) reg.unregister_backend(n);
}

// --calls-per-sample R: each sample times R consecutive calls and records their time over R.
TEST(BenchRun, CallsPerSampleTimesThatManyCallsPerReading) {
  auto& reg = ExpertsInterface::global();
  int calls = 0;
  reg.register_backend("bench_test_slow_exact", [&calls](const Experts& e, const ExpertsCall& c) {
    ++calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    const std::vector<double> ref = reference_forward(e, c.hidden_states, c.top_k_index, c.top_k_weights);
    for (size_t i = 0; i < ref.size(); ++i) c.out.ptr<float>()[i] = float(ref[i]);
  }, {DeviceType::cpu}, "test", true);
  BenchOptions o;
  o.shapes = {parse_dims("48,40,6,2")};
  o.tokens = {3};
  o.backends = {"bench_test_slow_exact"};
  o.dtype = DType::f32;
  o.warmup = 0;
  o.iters = 3;
  o.min_iters = 3;
  o.min_time_s = 0;
  o.calls_per_sample = 4;
  const BenchReport r = run_bench(o, given_ceilings(Device::cpu(), 0.01, 5.0));
  reg.unregister_backend("bench_test_slow_exact");
  ASSERT_EQ(r.records.size(), 1u);
  const BenchRecord& rec = r.records[0];
  EXPECT_EQ(rec.calls_per_sample, 4);
  EXPECT_EQ(rec.iters, 3);
  EXPECT_EQ(calls, 1 + 3 * 4);  // the checked call, then three samples of four
  // Per call, not per sample: about 3 ms each (a sample of four takes 12 ms or more).
  EXPECT_GE(rec.min_us, 2900.0);
  EXPECT_LT(rec.median_us, 9000.0);
  o.calls_per_sample = 0;
  EXPECT_THROW(run_bench(o, given_ceilings(Device::cpu(), 0.01, 5.0)), Error);
}

TEST(BenchCli, TinyCpuRunWritesJsonAndPlot) {
  const std::string json_path = temp_path("tiny.json"), png_path = temp_path("tiny.png");
  std::remove(json_path.c_str());
  std::remove(png_path.c_str());
  // Without gnuplot --plot is refused, so the plot is asked for only where it can be drawn.
  const std::string plot_arg = gnuplot_available() ? " --plot " + png_path : std::string();
  const CliResult r = run_cli("bench --dims 64,32,8,2 --tokens 1,5 --backends all --device cpu --dtype bf16 "
                              "--peak-tflops 0.05 --bandwidth-gbps 10 --iters 3 --min-iters 2 --min-time 0 --quiet "
                              "--json " + json_path + plot_arg);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("median_us"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("deepgemm"), std::string::npos) << "skipped backends are listed: " << r.out;

  std::ifstream in(json_path);
  ASSERT_TRUE(in.good()) << r.out;
  const nlohmann::json j = nlohmann::json::parse(in);
  for (const char* k : {"card", "peak_tflops", "copy_tbps", "records", "skipped", "command", "date"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_DOUBLE_EQ(j["peak_tflops"].get<double>(), 0.05);
  EXPECT_DOUBLE_EQ(j["copy_tbps"].get<double>(), 0.01);
  // eager, batched_mm, grouped_mm on the CPU, two token counts each.
  ASSERT_EQ(j["records"].size(), 6u) << j.dump(1);
  const ShapePreset s = parse_dims("64,32,8,2");
  Ceilings c;
  c.peak_tflops = 0.05;
  c.bandwidth_gbps = 10;
  for (const auto& rec : j["records"]) {
    for (const char* k : {"shape", "tokens", "backend", "device", "dtype", "graph", "median_us", "min_us", "tflops",
                          "gbps", "floor_us", "floor_ratio", "rel_err", "experts_touched", "iters", "moved_bytes"})
      ASSERT_TRUE(rec.contains(k)) << k << " missing in " << rec.dump();
    EXPECT_EQ(rec["device"], "cpu");
    EXPECT_EQ(rec["dtype"], "bf16");
    EXPECT_EQ(rec["graph"], false);
    EXPECT_LE(rec["rel_err"].get<double>(), 1e-2);
    const int64_t T = rec["tokens"];
    const double touched = rec["experts_touched"];
    EXPECT_GE(touched, 1.0);
    EXPECT_LE(touched, std::min(8.0, 2.0 * double(T)));
    const double floor = floor_us(forward_flops(s, T), forward_bytes(s, T, touched, DType::bf16, DType::i64), c);
    EXPECT_NEAR(rec["floor_us"].get<double>(), floor, 1e-9 * floor);
    const double median = rec["median_us"];
    EXPECT_NEAR(rec["floor_ratio"].get<double>(), median / floor, 1e-9 * median / floor);
    EXPECT_NEAR(rec["tflops"].get<double>(), forward_flops(s, T) / median / 1e6, 1e-9);
    // grouped_mm says what its plan moves: at least the weights hit and the activations in and out.
    const double moved = rec["moved_bytes"];
    if (rec["backend"] == "grouped_mm") EXPECT_GE(moved, forward_bytes(s, T, touched, DType::bf16, DType::i64) * 0.9);
  }
  EXPECT_NE(r.out.find("MB moved"), std::string::npos) << r.out;
  if (gnuplot_available()) {
    std::ifstream png(png_path, std::ios::binary);
    ASSERT_TRUE(png.good()) << r.out;
    char magic[4] = {};
    png.read(magic, 4);
    EXPECT_EQ(std::string(magic + 1, 3), "PNG");
  }
  std::remove(json_path.c_str());
  std::remove(png_path.c_str());
}

TEST(BenchCli, BadArgumentsAreRejectedClearly) {
  struct Bad {
    std::string args, expect;
  };
  const Bad cases[] = {
      {"--dims 64,32,8", "--dims"},
      {"--dims 64,32,2,4", "exceeds the number of experts"},
      {"--shape qwen9", "unknown shape preset 'qwen9'"},
      {"--dims 64,32,8,2 --backends eager,nosuch", "nosuch"},
      {"--dims 64,32,8,2 --tokens 1,0", "'0' is not a positive integer"},
      {"--dims 64,32,8,2 --graph", "--graph needs --device cuda"},
      {"--dims 64,32,8,2 --queue-ahead-us 50", "--queue-ahead-us needs --device cuda"},
      {"--dims 64,32,8,2 --device cuda --queue-ahead-us -3", "--queue-ahead-us"},
      {"--dims 64,32,8,2 --calls-per-sample 0", "--calls-per-sample"},
      {"--dims 64,32,8,2 --dtype f8", "--dtype"},
      {"--dims 64,32,8,2 --peak-tflops 1", "--bandwidth-gbps"},
      {"--dims 64,32,8,2 --routing zipf", "--routing"},
      {"--shape qwen3-30b-a3b --dims 64,32,8,2", "excludes"},
  };
  for (const auto& b : cases) {
    const CliResult r = run_cli("bench " + b.args + " --quiet");
    EXPECT_NE(r.code, 0) << b.args;
    EXPECT_NE(r.out.find(b.expect), std::string::npos) << b.args << " -> " << r.out;
  }
}

#ifdef MOEKIT_WITH_CUDA
// --queue-ahead-us: the device-side hold before the start event stays out of the timed interval.
TEST(BenchCuda, QueueAheadKeepsTheHoldOutOfTheTimedInterval) {
  MOEKIT_SKIP_WITHOUT_CUDA();
  namespace bc = moekit::bench::cuda;
  const Stream s = bc::create_stream(0);
  const double held = bc::time_call_us(s, [] {}, 5000.0);  // 5 ms held, nothing enqueued to time
  const double idle = bc::time_call_us(s, [] {}, 0.0);
  bc::destroy_stream(s);
  EXPECT_GE(held, 0.0);
  EXPECT_LT(held, 1000.0) << "the hold was inside the interval";
  EXPECT_GE(idle, 0.0);
  EXPECT_LT(idle, 1000.0);
}
#endif

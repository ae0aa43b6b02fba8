// moekit bench --ep N: ParallelExperts in both modes against the whole layer on one device.
#include "bench/ep_bench.h"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>

#include "bench/workload.h"
#include "moekit/error.h"

namespace moekit::bench {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median wall time of `fn` in ms, the device synchronised before and after each call.
template <class Fn>
double time_ms(const ExpertGroupPtr& g, int warmup, int iters, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  g->synchronize(nullptr);
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    fn();
    g->synchronize(nullptr);
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return median(t);
}

// The largest value over the ranks (times: the slowest rank), or the sum (volumes).
double max_over_ranks(const ExpertGroupPtr& g, double v) {
  const std::vector<int64_t> all = g->exchange(std::vector<int64_t>(size_t(g->size()), int64_t(std::llround(v * 1e6))));
  return double(*std::max_element(all.begin(), all.end())) / 1e6;
}
int64_t sum_over_ranks(const ExpertGroupPtr& g, int64_t v) {
  const std::vector<int64_t> all = g->exchange(std::vector<int64_t>(size_t(g->size()), v));
  int64_t s = 0;
  for (int64_t x : all) s += x;
  return s;
}

double rel_err(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()).to(DType::f32), y = b.to(Device::cpu()).to(DType::f32);
  double num = 0, den = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double d = double(x.ptr<float>()[i]) - double(y.ptr<float>()[i]);
    num += d * d;
    den += double(y.ptr<float>()[i]) * double(y.ptr<float>()[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

std::vector<EpBenchRecord> run_ep_bench(const EpBenchOptions& o, const ExpertGroupPtr& g) {
  std::vector<EpBenchRecord> out;
  const Device d = g->device();
  use_device(d);
  const int N = g->size(), me = g->rank();
  for (const ShapePreset& shape : o.shapes) {
    const int64_t E = shape.num_experts, H = shape.hidden, K = shape.top_k;
    const ExpertSlice sl = expert_slice(E, me, N);
    // Every rank makes the same layer (one seed) and keeps its slice; rank 0 keeps the whole layer too.
    Experts local;
    Experts full;
    {
      Experts all = make_random_experts(shape, o.dtype, d, o.seed);
      local = slice_experts(all, sl, o.backend);
      if (me == 0 && o.reference) {
        all.set_implementation(o.backend);
        full = all;
      }
    }
    const ParallelExperts ar(g, E, EpMode::all_reduce), a2a(g, E, EpMode::all_to_all);
    ParallelExperts ar2(g, E, EpMode::all_reduce), ar4(g, E, EpMode::all_reduce);
    ar2.set_overlap_chunks(2);
    ar4.set_overlap_chunks(4);
    for (int64_t T : o.tokens) {
      EpBenchRecord r;
      r.shape = shape.name;
      r.tokens = T;
      r.ranks = N;
      const InputSet in = make_input_set(shape, T, o.dtype, DType::i64, Routing::uniform, {}, d, o.seed + uint64_t(T),
                                         /*keep_host=*/true);
      const ExpertsCall call = in.call(nullptr);
      Tensor ref;
      if (me == 0 && o.reference) {
        ref = Tensor::empty({T, H}, o.dtype, d);
        r.one_device_ms = time_ms(g, o.warmup, o.iters, [&] {
          full.forward_into(ExpertsCall{call.hidden_states, call.top_k_index, call.top_k_weights, ref.view(), nullptr});
        });
      }
      // all_reduce: the whole call, then its two stages alone.
      Tensor y = Tensor::empty({T, H}, o.dtype, d);
      const ExpertsCall yc{call.hidden_states, call.top_k_index, call.top_k_weights, y.view(), nullptr};
      r.ar_total_ms = max_over_ranks(g, time_ms(g, o.warmup, o.iters, [&] { ar.forward_into(local, yc); }));
      if (me == 0 && o.reference) r.ar_rel_err = rel_err(y, ref);
      r.ar2_total_ms = max_over_ranks(g, time_ms(g, o.warmup, o.iters, [&] { ar2.forward_into(local, yc); }));
      r.ar4_total_ms = max_over_ranks(g, time_ms(g, o.warmup, o.iters, [&] { ar4.forward_into(local, yc); }));
      if (me == 0 && o.reference) r.ar4_rel_err = rel_err(y, ref);
      {
        Tensor lid = Tensor::empty({T, K}, DType::i32);
        const int64_t* gid = in.host_top_k_index.ptr<int64_t>();
        for (int64_t i = 0; i < T * K; ++i)
          lid.ptr<int32_t>()[i] = gid[i] >= sl.start && gid[i] < sl.end ? int32_t(gid[i] - sl.start) : int32_t(sl.count());
        const Tensor lidd = lid.to(d);
        Tensor z = Tensor::empty({T, H}, o.dtype, d);
        const ExpertsCall lc{call.hidden_states, lidd.view(), call.top_k_weights, z.view(), nullptr};
        r.ar_experts_ms = max_over_ranks(g, time_ms(g, o.warmup, o.iters, [&] { local.forward_into(lc); }));
        r.ar_allreduce_ms =
            max_over_ranks(g, time_ms(g, o.warmup, o.iters, [&] { g->all_reduce_sum(z.data(), T * H, o.dtype, nullptr); }));
        r.ar_bytes = int64_t(z.nbytes());
      }
      // all_to_all: the whole call (dispatch, experts, combine of each rank's T / N tokens, then the outputs
      // gathered), then the stages of the dispatch and combine, each synchronised.
      r.a2a_total_ms = max_over_ranks(g, time_ms(g, o.warmup, o.iters, [&] { a2a.forward_into(local, yc); }));
      if (me == 0 && o.reference) r.a2a_rel_err = rel_err(y, ref);
      {
        const int64_t t0 = T / N * me + std::min<int64_t>(me, T % N), t1 = T / N * (me + 1) + std::min<int64_t>(me + 1, T % N);
        auto rows = [&](const TensorView& v) {
          TensorView s = v;
          s.data = static_cast<char*>(v.data) + dtype_nbytes(v.dtype, t0 * v.shape[1]);
          s.shape[0] = t1 - t0;
          return s;
        };
        Tensor part = Tensor::empty({t1 - t0, H}, o.dtype, d);
        const ExpertsCall pc{rows(call.hidden_states), rows(call.top_k_index), rows(call.top_k_weights), part.view(),
                             nullptr};
        std::vector<double> plan, disp, exp, comb;
        EpStats st;
        for (int i = 0; i < o.warmup + o.iters; ++i) {
          st = EpStats{};
          a2a.dispatch_combine(local, pc, &st);
          if (i < o.warmup) continue;
          plan.push_back(st.plan_ms);
          disp.push_back(st.dispatch_ms);
          exp.push_back(st.experts_ms);
          comb.push_back(st.combine_ms);
        }
        r.a2a_plan_ms = max_over_ranks(g, median(plan));
        r.a2a_dispatch_ms = max_over_ranks(g, median(disp));
        r.a2a_experts_ms = max_over_ranks(g, median(exp));
        r.a2a_combine_ms = max_over_ranks(g, median(comb));
        r.a2a_dispatch_bytes = sum_over_ranks(g, st.dispatch_bytes);
        r.a2a_combine_bytes = sum_over_ranks(g, st.combine_bytes);
      }
      out.push_back(r);
    }
  }
  return out;
}

std::string format_ep_table(const std::vector<EpBenchRecord>& records, const std::string& card) {
  std::string s = fmt::format(
      "expert parallelism on {}: times in ms (median; the slowest rank), volumes in MB between distinct ranks\n"
      "{:<15} {:>6} {:>8} | {:>8} {:>8} {:>8} {:>7} {:>8} {:>8} | {:>8} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} | "
      "{:>8} {:>8}\n",
      card, "shape", "T", "1 dev", "ar", "experts", "allred", "MB", "ar/2", "ar/4", "a2a", "plan", "dispatch", "experts", "combine",
      "disp MB", "comb MB", "GB/s", "ar err", "a2a err");
  for (const auto& r : records) {
    const double comm_ms = r.a2a_dispatch_ms + r.a2a_combine_ms;
    const double gbps = comm_ms > 0 ? double(r.a2a_dispatch_bytes + r.a2a_combine_bytes) / (comm_ms * 1e6) : 0;
    s += fmt::format(
        "{:<15} {:>6} {:>8} | {:>8.3f} {:>8.3f} {:>8.3f} {:>7.2f} {:>8.3f} {:>8.3f} | {:>8.3f} {:>7.3f} {:>8.3f} {:>8.3f} {:>8.3f} "
        "{:>8.2f} {:>8.2f} {:>7.1f} | {:>8.1e} {:>8.1e}\n",
        r.shape, r.tokens, r.one_device_ms < 0 ? std::string("-") : fmt::format("{:.3f}", r.one_device_ms),
        r.ar_total_ms, r.ar_experts_ms, r.ar_allreduce_ms, double(r.ar_bytes) / 1e6, r.ar2_total_ms, r.ar4_total_ms,
        r.a2a_total_ms, r.a2a_plan_ms,
        r.a2a_dispatch_ms, r.a2a_experts_ms, r.a2a_combine_ms, double(r.a2a_dispatch_bytes) / 1e6,
        double(r.a2a_combine_bytes) / 1e6, gbps, r.ar_rel_err, r.a2a_rel_err);
  }
  return s;
}

std::string ep_records_to_json(const std::vector<EpBenchRecord>& records, const std::string& card,
                               const std::string& command) {
  nlohmann::json j;
  j["card"] = card;
  j["command"] = command;
  j["records"] = nlohmann::json::array();
  for (const auto& r : records)
    j["records"].push_back({{"shape", r.shape},
                            {"tokens", r.tokens},
                            {"ranks", r.ranks},
                            {"one_device_ms", r.one_device_ms},
                            {"all_reduce", {{"total_ms", r.ar_total_ms}, {"experts_ms", r.ar_experts_ms},
                                            {"allreduce_ms", r.ar_allreduce_ms}, {"bytes", r.ar_bytes},
                                            {"rel_err", r.ar_rel_err}, {"overlap2_total_ms", r.ar2_total_ms},
                                            {"overlap4_total_ms", r.ar4_total_ms},
                                            {"overlap4_rel_err", r.ar4_rel_err}}},
                            {"all_to_all", {{"total_ms", r.a2a_total_ms}, {"plan_ms", r.a2a_plan_ms},
                                            {"dispatch_ms", r.a2a_dispatch_ms}, {"experts_ms", r.a2a_experts_ms},
                                            {"combine_ms", r.a2a_combine_ms}, {"dispatch_bytes", r.a2a_dispatch_bytes},
                                            {"combine_bytes", r.a2a_combine_bytes}, {"rel_err", r.a2a_rel_err}}}});
  return j.dump(2);
}

}  // namespace moekit::bench

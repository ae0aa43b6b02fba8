// ParallelExperts: one layer's experts over an expert-parallel group, with transformers' semantics
// (all_reduce) or as an all-to-all dispatch and combine (all_to_all).
#include <chrono>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backends/megamoe.h"
#include "base/convert.h"
#include "moekit/error.h"
#include "moekit/parallel.h"
#include "parallel/ep_ops.h"

namespace moekit {

namespace {
// A second stream of the group's device, released with the workspace.
struct OwnedSideStream {
  explicit OwnedSideStream(Device d) : device(d), stream(stream_create(d)) {}
  ~OwnedSideStream() { stream_destroy(stream, device); }
  OwnedSideStream(const OwnedSideStream&) = delete;
  OwnedSideStream& operator=(const OwnedSideStream&) = delete;
  Device device;
  Stream stream;
};
}  // namespace

// Grow-only buffers of one layer's calls, by name, on the group's device.
struct ParallelExperts::Workspace {
  std::mutex mutex;
  std::map<std::string, Tensor> buffers;
  std::unique_ptr<OwnedSideStream> side;  // the all-reduces of overlapped chunks
  void* get(const std::string& name, int64_t bytes, Device d) {
    Tensor& t = buffers[name];
    const int64_t want = std::max<int64_t>(bytes, 16);
    if (!t.defined() || t.numel() < want) {
      t = Tensor();
      t = Tensor::empty({want + want / 4}, DType::u8, d);  // headroom: fewer reallocations as T varies
    }
    return t.data();
  }
};

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

TensorView rows_of(const TensorView& v, int64_t begin, int64_t end) {
  TensorView r = v;
  const int64_t row = v.shape.size() > 1 ? v.shape[1] : 1;
  if (v.data) r.data = static_cast<char*>(v.data) + dtype_nbytes(v.dtype, begin * row);
  r.shape[0] = end - begin;
  r.strides = {};
  return r;
}

int64_t split_begin(int64_t T, int r, int N) { return T / N * r + std::min<int64_t>(r, T % N); }

}  // namespace

ParallelExperts::ParallelExperts(ExpertGroupPtr group, int64_t num_experts, EpMode mode)
    : group_(std::move(group)), num_experts_(num_experts), mode_(mode), ws_(std::make_shared<Workspace>()) {
  MOEKIT_CHECK(group_ != nullptr, "ParallelExperts: no expert-parallel group given");
  for (int r = 0; r < group_->size(); ++r) slices_.push_back(expert_slice(num_experts, r, group_->size()));
  slice_ = slices_[size_t(group_->rank())];
}

void ParallelExperts::set_overlap_chunks(int n) {
  MOEKIT_CHECK(n >= 1, "ParallelExperts: overlap chunks must be >= 1, got ", n);
  chunks_ = n;
}

void ParallelExperts::check_local(const Experts& local, const ExpertsCall& call) const {
  MOEKIT_CHECK(group_ != nullptr, "ParallelExperts: default-constructed (no group)");
  MOEKIT_CHECK(local.spec().num_experts == slice_.count(), "expert parallel: rank ", group_->rank(), " of ",
               group_->size(), " holds experts [", slice_.start, ", ", slice_.end, ") of ", num_experts_,
               " (", slice_.count(), ") but its module has ", local.spec().num_experts);
  MOEKIT_CHECK(local.device() == group_->device(), "expert parallel: the local experts are on ",
               local.device().to_string(), " but the ", group_->engine(), " group's rank ", group_->rank(),
               " is on ", group_->device().to_string());
  const TensorView& x = call.hidden_states;
  MOEKIT_CHECK(x.dim() == 2 && call.top_k_index.dim() == 2 && call.top_k_weights.dim() == 2 && call.out.dim() == 2,
               "expert parallel: hidden_states, top_k_index, top_k_weights and out must be 2-D, got ",
               x.to_string(), ", ", call.top_k_index.to_string(), ", ", call.top_k_weights.to_string(), ", ",
               call.out.to_string());
  const int64_t T = x.shape[0];
  MOEKIT_CHECK(call.top_k_index.shape[0] == T && call.top_k_weights.shape == call.top_k_index.shape &&
                   call.out.shape == x.shape && call.out.dtype == x.dtype,
               "expert parallel: shapes do not agree: hidden_states ", x.to_string(), ", top_k_index ",
               call.top_k_index.to_string(), ", top_k_weights ", call.top_k_weights.to_string(), ", out ",
               call.out.to_string());
  MOEKIT_CHECK(call.top_k_index.dtype == DType::i32 || call.top_k_index.dtype == DType::i64,
               "expert parallel: top_k_index must be i32 or i64, got ", dtype_name(call.top_k_index.dtype));
  for (const TensorView* v : {&x, &call.top_k_index, &call.top_k_weights, &call.out}) {
    MOEKIT_CHECK(v->is_contiguous(), "expert parallel: ", v->to_string(), " must be contiguous");
    MOEKIT_CHECK(v->device == group_->device(), "expert parallel: ", v->to_string(), " is not on the group's device ",
                 group_->device().to_string());
  }
}

void ParallelExperts::forward_into(const Experts& local, const ExpertsCall& call) const {
  MOEKIT_CHECK_CODE(!call.routing, not_supported,
                    "expert parallel: routing inside the call is not supported; route first and pass top_k_index");
  check_local(local, call);
  expert_parallel_state(local).ep_size = group_->size();  // what backends that need a group (megamoe) read
  const Device d = group_->device();
  const int64_t T = call.tokens(), K = call.top_k(), H = call.hidden_states.shape[1];
  if (mode_ == EpMode::all_reduce) {
    // transformers: ids outside this rank's slice become the local sentinel, partial outputs summed.
    std::lock_guard<std::mutex> lock(ws_->mutex);
    auto* ids = static_cast<int32_t*>(ws_->get("ids", T * K * 4, d));
    ep::remap_ids(d, call.top_k_index.data, call.top_k_index.dtype, T * K, K, slice_.start, slice_.end, num_experts_,
                  int32_t(slice_.count()), ids, call.stream);
    const TensorView local_ids(ids, DType::i32, {T, K}, d);
    const int chunks = d.is_cuda() ? int(std::min<int64_t>(chunks_, T)) : 1;
    if (chunks <= 1) {
      ExpertsCall c = call;
      c.top_k_index = local_ids;
      local.forward_into(c);
      group_->all_reduce_sum(call.out.data, T * H, call.out.dtype, call.stream);
      return;
    }
    // Chunk i's all-reduce runs on the side stream while chunk i + 1's experts run on the call's stream.
    if (!ws_->side) ws_->side = std::make_unique<OwnedSideStream>(d);
    const Stream side = ws_->side->stream;
    ep::order(d, call.stream, side);  // the side stream's earlier work (a previous call) stays before
    for (int i = 0; i < chunks; ++i) {
      const int64_t t0 = split_begin(T, i, chunks), t1 = split_begin(T, i + 1, chunks);
      local.forward_into(ExpertsCall{rows_of(call.hidden_states, t0, t1), rows_of(local_ids, t0, t1),
                                     rows_of(call.top_k_weights, t0, t1), rows_of(call.out, t0, t1), call.stream});
      ep::order(d, call.stream, side);
      group_->all_reduce_sum(rows_of(call.out, t0, t1).data, (t1 - t0) * H, call.out.dtype, side);
    }
    ep::order(d, side, call.stream);
    return;
  }
  // all_to_all on replicated tokens: each rank dispatches a contiguous slice of them, then the slices'
  // outputs are gathered on every rank.
  const int N = group_->size(), me = group_->rank();
  const int64_t t0 = split_begin(T, me, N), t1 = split_begin(T, me + 1, N);
  const int64_t row = dtype_nbytes(call.out.dtype, H);
  void* mine = nullptr;
  {
    std::lock_guard<std::mutex> lock(ws_->mutex);
    mine = ws_->get("slice_out", (t1 - t0) * row, d);
  }
  ExpertsCall part{rows_of(call.hidden_states, t0, t1), rows_of(call.top_k_index, t0, t1),
                   rows_of(call.top_k_weights, t0, t1), TensorView(mine, call.out.dtype, {t1 - t0, H}, d),
                   call.stream};
  dispatch_combine(local, part);
  std::vector<int64_t> so(size_t(N), 0), sb(size_t(N), (t1 - t0) * row), ro(static_cast<size_t>(N)), rb(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    ro[size_t(r)] = split_begin(T, r, N) * row;
    rb[size_t(r)] = (split_begin(T, r + 1, N) - split_begin(T, r, N)) * row;
  }
  group_->all_to_all_v(mine, so, sb, call.out.data, ro, rb, call.stream);
}

Tensor ParallelExperts::forward(const Experts& local, const TensorView& hidden_states, const TensorView& top_k_index,
                                const TensorView& top_k_weights, Stream stream) const {
  MOEKIT_CHECK(hidden_states.dim() == 2, "expert parallel: hidden_states must be 2-D, got ",
               hidden_states.to_string());
  Tensor out = Tensor::empty(hidden_states.shape, hidden_states.dtype, hidden_states.device);
  forward_into(local, ExpertsCall{hidden_states, top_k_index, top_k_weights, out.view(), stream});
  return out;
}

void ParallelExperts::dispatch_combine(const Experts& local, const ExpertsCall& call, EpStats* stats) const {
  check_local(local, call);
  expert_parallel_state(local).ep_size = group_->size();
  const Device d = group_->device();
  const int N = group_->size(), me = group_->rank();
  const int64_t T = call.tokens(), K = call.top_k(), H = call.hidden_states.shape[1], E = num_experts_;
  const DType xt = call.hidden_states.dtype;
  const int64_t row = dtype_nbytes(xt, H);
  Stream s = call.stream;
  std::lock_guard<std::mutex> lock(ws_->mutex);
  auto t_plan = Clock::now();

  // The plan: which tokens go to which rank (in token order), with their slots in the receiver's numbering.
  // On a GPU it is made there (two kernels; the per-rank counts come to the host); on the CPU, in two passes
  // over the ids.
  std::vector<int64_t> send_n(static_cast<size_t>(N), 0), send_off(size_t(N) + 1, 0);
  std::string bad;  // the first bad id: every rank learns of it through the count exchange, none waits forever
  auto bad_id = [&](int64_t i, int64_t e) {
    bad = "top_k_index[" + std::to_string(i / K) + ", " + std::to_string(i % K) + "] = " + std::to_string(e) +
          " is out of range [0, " + std::to_string(E) + "]";
  };
  const bool gpu_plan = d.is_cuda() && N <= ep::kMaxPlanRanks;
  ep::PlanRanks ranks;
  ranks.n = N;
  for (int r = 0; r < N && r < ep::kMaxPlanRanks; ++r) {
    ranks.start[r] = slices_[size_t(r)].start;
    ranks.end[r] = slices_[size_t(r)].end;
  }
  int32_t* d_pos = nullptr;
  std::vector<int32_t> plan;  // the host plan: rows to send, combine map [T, N], meta
  std::vector<uint8_t> hit;
  std::vector<int64_t> ids;
  std::vector<float> wts;
  if (gpu_plan) {
    d_pos = static_cast<int32_t*>(ws_->get("pos", T * N * 4, d));
    auto* d_counts = static_cast<int32_t*>(ws_->get("counts", (N + 1) * 4, d));
    std::vector<int32_t> c(size_t(N) + 1, 0);
    c[size_t(N)] = INT32_MAX;
    if (T > 0) {
      ep::plan_count(d, call.top_k_index.data, call.top_k_index.dtype, T, K, E, ranks, d_pos, d_counts, s);
      ep::download(d, c.data(), d_counts, (N + 1) * 4, s);
    }
    for (int r = 0; r < N; ++r) send_n[size_t(r)] = c[size_t(r)];
    if (c[size_t(N)] != INT32_MAX) {
      const int64_t i = c[size_t(N)];
      int64_t e = 0;
      const size_t es = dtype_nbytes(call.top_k_index.dtype, 1);
      ep::download(d, &e, static_cast<const char*>(call.top_k_index.data) + size_t(i) * es, int64_t(es), s);
      if (es == 4) e = int64_t(int32_t(uint32_t(uint64_t(e))));
      bad_id(i, e);
    }
  } else {
    ids.resize(size_t(T * K));
    wts.resize(size_t(T * K));
    if (T * K > 0) {
      std::vector<char> raw(size_t(T * K) * 8);
      ep::download(d, raw.data(), call.top_k_index.data, int64_t(call.top_k_index.nbytes()), s);
      for (int64_t i = 0; i < T * K; ++i)
        ids[size_t(i)] = call.top_k_index.dtype == DType::i64 ? reinterpret_cast<const int64_t*>(raw.data())[i]
                                                              : reinterpret_cast<const int32_t*>(raw.data())[i];
      ep::download(d, raw.data(), call.top_k_weights.data, int64_t(call.top_k_weights.nbytes()), s);
      cpu::load_f32(raw.data(), call.top_k_weights.dtype, 0, T * K, wts.data());
    }
    std::vector<int> owner(static_cast<size_t>(E));
    for (int r = 0; r < N; ++r)
      for (int64_t e = slices_[size_t(r)].start; e < slices_[size_t(r)].end; ++e) owner[size_t(e)] = r;
    // Pass 1: check the ids, mark the ranks each token goes to, count per rank.
    hit.assign(size_t(T * N), 0);
    for (int64_t t = 0; t < T && bad.empty(); ++t) {
      uint8_t* h = &hit[size_t(t * N)];
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = ids[size_t(t * K + k)];
        if (e < 0 || e > E) {
          bad_id(t * K + k, e);
          break;
        }
        if (e < E) h[owner[size_t(e)]] = 1;
      }
      for (int r = 0; r < N; ++r) send_n[size_t(r)] += h[r];
    }
  }
  for (int r = 0; r < N; ++r) send_off[size_t(r) + 1] = send_off[size_t(r)] + send_n[size_t(r)];
  const int64_t S = send_off[size_t(N)];
  if (!gpu_plan) {
    // Pass 2: one host block, uploaded at once: the rows to send (by rank, in token order), the combine map
    // [T, N] (-1: not sent), and per sent row its K ids in the receiver's numbering then its K f32 weights.
    plan.resize(size_t(S + T * N + S * 2 * K));
    int32_t* send_rows = plan.data();
    int32_t* map = send_rows + S;
    int32_t* send_meta = map + T * N;
    std::fill(map, map + T * N, -1);
    if (bad.empty()) {
      std::vector<int64_t> next(send_off.begin(), send_off.end() - 1);
      for (int64_t t = 0; t < T; ++t)
        for (int r = 0; r < N; ++r) {
          if (!hit[size_t(t * N + r)]) continue;
          const int64_t p = next[size_t(r)]++;
          send_rows[p] = int32_t(t);
          map[t * N + r] = int32_t(p);
          const ExpertSlice sl = slices_[size_t(r)];
          int32_t* m = send_meta + p * 2 * K;
          for (int64_t k = 0; k < K; ++k) {
            const int64_t e = ids[size_t(t * K + k)];
            m[k] = e >= sl.start && e < sl.end ? int32_t(e - sl.start) : int32_t(sl.count());
          }
          std::memcpy(m + K, &wts[size_t(t * K)], size_t(K) * 4);
        }
    }
  }
  if (!bad.empty()) std::fill(send_n.begin(), send_n.end(), -1);
  const std::vector<int64_t> recv_n = group_->exchange(send_n, s);
  MOEKIT_CHECK(bad.empty(), "expert parallel (rank ", me, "): ", bad);
  for (int r = 0; r < N; ++r)
    MOEKIT_CHECK(recv_n[size_t(r)] >= 0, "expert parallel: rank ", r, " of ", N,
                 " was given a top_k_index out of range; no rank ran its experts");
  std::vector<int64_t> recv_off(size_t(N) + 1, 0);
  for (int r = 0; r < N; ++r) recv_off[size_t(r) + 1] = recv_off[size_t(r)] + recv_n[size_t(r)];
  const int64_t R = recv_off[size_t(N)];

  const int64_t plan_words = S + T * N + S * 2 * K;
  auto* d_plan = static_cast<int32_t*>(ws_->get("plan", plan_words * 4, d));
  int32_t* d_rows = d_plan;
  int32_t* d_map = d_plan + S;
  int32_t* send_m = d_map + T * N;
  void* send_x = ws_->get("send_x", S * row, d);
  void* recv_x = ws_->get("recv_x", R * row, d);
  auto* recv_m = static_cast<int32_t*>(ws_->get("recv_meta", R * 2 * K * 4, d));
  auto* recv_ids = static_cast<int32_t*>(ws_->get("recv_ids", R * K * 4, d));
  auto* recv_w = static_cast<float*>(ws_->get("recv_w", R * K * 4, d));
  void* recv_y = ws_->get("recv_y", R * row, d);
  void* back_y = ws_->get("back_y", S * row, d);
  if (gpu_plan) {
    for (int r = 0; r < N; ++r) ranks.offset[r] = send_off[size_t(r)];
    ep::plan_fill(d, call.top_k_index.data, call.top_k_index.dtype, call.top_k_weights.data,
                  call.top_k_weights.dtype, T, K, ranks, d_pos, d_rows, d_map, send_m, s);
  } else {
    ep::upload(d, d_plan, plan.data(), plan_words * 4, s);
  }
  ep::gather_rows(d, call.hidden_states.data, row, d_rows, S, row, send_x, row, s);
  auto stage_done = [&](double* field, Clock::time_point& t) {
    if (!stats) return;
    group_->synchronize(s);
    *field = ms_since(t);
    t = Clock::now();
  };
  stage_done(stats ? &stats->plan_ms : nullptr, t_plan);

  // Dispatch: rows and their slots.
  auto scaled = [&](const std::vector<int64_t>& v, int64_t unit) {
    std::vector<int64_t> o(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) o[size_t(r)] = v[size_t(r)] * unit;
    return o;
  };
  const std::vector<int64_t> so(send_off.begin(), send_off.end() - 1), ro(recv_off.begin(), recv_off.end() - 1);
  group_->all_to_all_v(send_x, scaled(so, row), scaled(send_n, row), recv_x, scaled(ro, row), scaled(recv_n, row), s);
  group_->all_to_all_v(send_m, scaled(so, 8 * K), scaled(send_n, 8 * K), recv_m, scaled(ro, 8 * K),
                       scaled(recv_n, 8 * K), s);
  ep::copy_2d(d, recv_ids, K * 4, recv_m, 2 * K * 4, K * 4, R, s);
  ep::copy_2d(d, recv_w, K * 4, recv_m + K, 2 * K * 4, K * 4, R, s);
  stage_done(stats ? &stats->dispatch_ms : nullptr, t_plan);

  // This rank's experts over what it received.
  local.forward_into(ExpertsCall{TensorView(recv_x, xt, {R, H}, d), TensorView(recv_ids, DType::i32, {R, K}, d),
                                 TensorView(recv_w, DType::f32, {R, K}, d), TensorView(recv_y, xt, {R, H}, d), s});
  stage_done(stats ? &stats->experts_ms : nullptr, t_plan);

  // Combine: results back to their tokens' ranks, summed in rank order.
  group_->all_to_all_v(recv_y, scaled(ro, row), scaled(recv_n, row), back_y, scaled(so, row), scaled(send_n, row), s);
  ep::combine_rows(d, back_y, xt, H, d_map, T, N, call.out.data, s);
  stage_done(stats ? &stats->combine_ms : nullptr, t_plan);

  if (stats) {
    stats->tokens_sent = S - send_n[size_t(me)];
    stats->tokens_received = R - recv_n[size_t(me)];
    stats->dispatch_bytes = stats->tokens_sent * (row + 8 * K);
    stats->combine_bytes = stats->tokens_received * row;
  }
}

Tensor slice_experts(const Tensor& stacked, ExpertSlice s, Device device) {
  if (!stacked.defined()) return {};
  MOEKIT_CHECK(stacked.dim() >= 1 && s.start >= 0 && s.end <= stacked.size(0) && s.start <= s.end,
               "slice_experts: experts [", s.start, ", ", s.end, ") of ", stacked.view().to_string());
  const Tensor c = stacked.contiguous();
  TensorView v = c.view();
  const int64_t per = v.shape[0] ? v.numel() / v.shape[0] : 0;
  v.data = static_cast<char*>(v.data) + dtype_nbytes(v.dtype, s.start * per);
  v.shape[0] = s.count();
  v.strides = {};
  return Tensor::copy_of(v, device);
}

Experts slice_experts(const Experts& full, ExpertSlice s, const std::string& implementation) {
  ExpertsSpec spec = full.spec();
  MOEKIT_CHECK(s.start >= 0 && s.end <= spec.num_experts && s.count() > 0, "slice_experts: experts [", s.start,
               ", ", s.end, ") of ", spec.num_experts);
  spec.num_experts = s.count();
  const ExpertsWeights& w = full.weights();
  ExpertsWeights out;
  const Device d = full.device();
  out.gate_up_proj = slice_experts(w.gate_up_proj, s, d);
  out.up_proj = slice_experts(w.up_proj, s, d);
  out.down_proj = slice_experts(w.down_proj, s, d);
  out.gate_up_proj_bias = slice_experts(w.gate_up_proj_bias, s, d);
  out.up_proj_bias = slice_experts(w.up_proj_bias, s, d);
  out.down_proj_bias = slice_experts(w.down_proj_bias, s, d);
  return Experts(spec, std::move(out), implementation.empty() ? full.implementation() : implementation);
}

}  // namespace moekit

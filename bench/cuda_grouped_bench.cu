// Grouped-projection kernels on one GPU: correctness of the sm_90a TMA kernel against the SIMT kernel
// (random sizes, odd shapes, empty experts, skewed routing, every epilogue, poisoned outputs), then
// timings of the projections of an MoE shape against the cp.async wgmma kernel and cuBLAS (one GEMM
// over all routed rows, same FLOPs).
//
//   cuda_grouped_bench [check] [time] [--reps N]
//   cuda_grouped_bench profile [--tokens T]   (one launch of each TMA projection per form: for ncu)
//   cuda_grouped_bench time --quick [--reps N] [--runs T:tile,...]  (the TMA projections only)
//
// Build (sm_90a): see bench/README.md. Timing: CUDA events around each launch, median of N after
// warm-up; inputs are random (never zero); the weights of every shape timed exceed L2 by far.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/kernels/kernels.h"

namespace k = moekit::cuda::kernels;

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__global__ void fill_kernel(uint16_t* p, int64_t n, uint64_t seed, float scale, int is_bf16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = seed + uint64_t(i) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = (float(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale;
    if (is_bf16) {
      __nv_bfloat16 b = __float2bfloat16_rn(u);
      p[i] = *reinterpret_cast<uint16_t*>(&b);
    } else {
      __half h = __float2half_rn(u);
      p[i] = *reinterpret_cast<uint16_t*>(&h);
    }
  }
}

template <class T>
__global__ void rel_err_kernel(const T* out, const T* ref, int64_t rows, int64_t cols, int64_t ld, double* acc) {
  double d = 0, r = 0, nan = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / cols, col = i % cols;
    const float a = float(out[row * ld + col]), b = float(ref[row * ld + col]);
    if (!(a == a) || !(b == b) || std::isinf(a))
      nan += 1;
    else {
      d += double(a - b) * (a - b);
      r += double(b) * b;
    }
  }
  atomicAdd(acc, d);
  atomicAdd(acc + 1, r);
  atomicAdd(acc + 2, nan);
}

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) { CK(cudaMalloc(&p, std::max<size_t>(bytes, 256))); }
  ~Dev() { cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

void fill(void* p, int64_t n, uint64_t seed, float scale, bool bf) {
  fill_kernel<<<1024, 256>>>(static_cast<uint16_t*>(p), n, seed, scale, bf);
  CK(cudaGetLastError());
}

// Routing: distinct experts per token; skewed = Zipf-like expert popularity; some experts left empty.
std::vector<int32_t> make_routing(int64_t T, int K, int E, bool skewed, int empty_every, std::mt19937_64& rng) {
  std::vector<double> w(E);
  for (int e = 0; e < E; ++e) w[e] = skewed ? 1.0 / std::pow(e + 1.0, 1.2) : 1.0;
  if (empty_every > 0)
    for (int e = 0; e < E; e += empty_every) w[e] = 0;
  std::vector<int32_t> idx(T * K);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> ww = w;
    for (int k2 = 0; k2 < K; ++k2) {
      std::discrete_distribution<int> d(ww.begin(), ww.end());
      const int e = d(rng);
      idx[t * K + k2] = e;
      ww[e] = 0;
    }
  }
  return idx;
}

int g_tile = 128;      // route tile of the TMA kernel (128, or 64 for its ping-pong form)
bool g_quick = false;  // time: the TMA projections only
std::string g_runs;    // time --quick / profile: the cases (T:tile,...)
const char* form_name() { return g_tile == 64 ? "ping-pong" : "cooperative"; }

struct Routed {
  int64_t P;
  Dev idx, pe, pr, sp, hist, off, toff, err;
  Routed(const std::vector<int32_t>& h, int64_t T, int K, int E)
      : P(T * K),
        idx(h.size() * 4),
        pe(P * 4),
        pr(P * 4),
        sp(P * 4),
        hist(k::route_blocks(P) * E * 4),
        off((E + 1) * 4),
        toff((E + 1) * 4),
        err(8) {
    CK(cudaMemcpy(idx.p, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(err.p, 0xff, 8));
    k::RoutingBuffers b;
    b.pair_expert = pe.as<int32_t>();
    b.pair_row = pr.as<int32_t>();
    b.sorted_pair = sp.as<int32_t>();
    b.block_hist = hist.as<int32_t>();
    b.offsets = off.as<int32_t>();
    b.tile_offsets = toff.as<int32_t>();
    b.error = err.as<unsigned long long>();
    CK(k::route_sort(idx.p, k::Index::i32, T, K, E, g_tile, b, nullptr));
    CK(cudaDeviceSynchronize());
  }
  int32_t valid(int E) const {
    int32_t v;
    CK(cudaMemcpy(&v, off.as<int32_t>() + E, 4, cudaMemcpyDeviceToHost));
    return v;
  }
};

double rel_err(k::Elem t, const void* out, const void* ref, int64_t rows, int64_t cols, int64_t ld, double* nan_out) {
  Dev acc(24);
  CK(cudaMemset(acc.p, 0, 24));
  if (t == k::Elem::f32)
    rel_err_kernel<<<512, 256>>>(static_cast<const float*>(out), static_cast<const float*>(ref), rows, cols, ld,
                                 acc.as<double>());
  else if (t == k::Elem::bf16)
    rel_err_kernel<<<512, 256>>>(static_cast<const __nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(ref), rows,
                                 cols, ld, acc.as<double>());
  else
    rel_err_kernel<<<512, 256>>>(static_cast<const __half*>(out), static_cast<const __half*>(ref), rows, cols, ld,
                                 acc.as<double>());
  CK(cudaGetLastError());
  double h[3];
  CK(cudaMemcpy(h, acc.p, 24, cudaMemcpyDeviceToHost));
  *nan_out = h[2];
  return std::sqrt(h[0] / std::max(h[1], 1e-300));
}

int g_fail = 0;

// One correctness case: both projections (gated / act-only first, f32 second) through the TMA kernel on
// gathered rows against the SIMT kernel on indexed rows.
void check_case(int64_t T, int K, int E, int64_t H, int64_t I, k::Elem type, bool gated, bool concat, bool bias,
                bool skewed, int empty_every, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const bool bf = type == k::Elem::bf16;
  const auto idx = make_routing(T, K, E, skewed, empty_every, rng);
  Routed r(idx, T, K, E);
  const int64_t P = r.P, N1 = gated ? 2 * I : I;
  Dev x(T * H * 2), w1(E * N1 * H * 2), w2(E * H * I * 2), b1(E * N1 * 2), xs(P * H * 2);
  fill(x.p, T * H, seed + 1, 1.0f, bf);
  fill(w1.p, E * N1 * H, seed + 2, 1.7f / std::sqrt(float(H)), bf);
  fill(w2.p, E * H * I, seed + 3, 1.7f / std::sqrt(float(I)), bf);
  fill(b1.p, E * N1, seed + 4, 0.5f, bf);
  CK(k::gather_rows(type, x.p, H, r.sp.as<int32_t>(), K, r.off.as<int32_t>() + E, P, xs.p, nullptr));

  k::GroupedGemmArgs g;
  g.type = type;
  g.a = x.p;
  g.lda = H;
  g.a_rows = r.sp.as<int32_t>();
  g.a_row_div = K;
  g.b = w1.p;
  g.b_expert_stride = N1 * H;
  g.b_stride_n = H;
  g.b_stride_k = 1;
  g.bias = bias ? b1.p : nullptr;
  g.bias_expert_stride = N1;
  g.offsets = r.off.as<int32_t>();
  g.tile_offsets = r.toff.as<int32_t>();
  g.tile_m = g_tile;
  g.experts = E;
  g.max_rows = P;
  g.n = I;
  g.k = H;
  g.inter = I;
  g.epilogue = gated ? k::kEpiGated : k::kEpiActOnly;
  g.gate.kind = gated ? k::kGateActMul : k::kGateActOnly;
  g.gate.activation = k::kActSilu;
  g.gate.concatenated = concat;
  Dev act_ref(P * I * 2), act(P * I * 2);
  CK(cudaMemset(act_ref.p, 0xff, P * I * 2));
  CK(cudaMemset(act.p, 0xff, P * I * 2));
  g.out = act_ref.p;
  g.ldo = I;
  CK(k::grouped_gemm_simt(g, g_tile, nullptr));
  k::GroupedGemmArgs t1 = g;
  t1.a = xs.p;
  t1.a_rows = nullptr;
  t1.a_row_div = 1;
  t1.out = act.p;
  const bool ok1 = k::grouped_gemm_tma_ok(t1, 90);
  if (ok1) CK(k::grouped_gemm_tma(t1, nullptr));
  CK(cudaDeviceSynchronize());
  const int32_t valid = r.valid(E);
  double nan1 = 0, nan2 = 0;
  const double e1 = ok1 ? rel_err(type, act.p, act_ref.p, valid, I, I, &nan1) : -1;

  k::GroupedGemmArgs g2 = g;
  g2.a = act_ref.p;
  g2.lda = I;
  g2.a_rows = nullptr;
  g2.a_row_div = 1;
  g2.b = w2.p;
  g2.b_expert_stride = H * I;
  g2.b_stride_n = I;
  g2.bias = nullptr;
  g2.n = H;
  g2.k = I;
  g2.epilogue = k::kEpiF32;
  Dev y_ref(P * H * 4), y(P * H * 4);
  CK(cudaMemset(y_ref.p, 0xff, P * H * 4));
  CK(cudaMemset(y.p, 0xff, P * H * 4));
  g2.out = y_ref.p;
  g2.ldo = H;
  CK(k::grouped_gemm_simt(g2, g_tile, nullptr));
  k::GroupedGemmArgs t2 = g2;
  t2.out = y.p;
  const bool ok2 = k::grouped_gemm_tma_ok(t2, 90);
  if (ok2) CK(k::grouped_gemm_tma(t2, nullptr));
  CK(cudaDeviceSynchronize());
  const double e2 = ok2 ? rel_err(k::Elem::f32, y.p, y_ref.p, valid, H, H, &nan2) : -1;
  const double tol = bf ? 1e-2 : 5e-3;
  const bool pass = ok1 && ok2 && e1 < tol && e2 < 1e-3 && nan1 == 0 && nan2 == 0;
  if (!pass) ++g_fail;
  std::printf("%s %s tile %d T=%ld K=%d E=%d H=%ld I=%ld %s %s%s%s%s rows=%d: first %.2e (nan %g)  second %.2e "
              "(nan %g)\n",
              pass ? "ok  " : "FAIL", form_name(), g_tile, long(T), K, E, long(H), long(I), bf ? "bf16" : "f16",
              gated ? (concat ? "gated-concat" : "gated-interleaved") : "act-only", bias ? " bias" : "",
              skewed ? " skewed" : "", empty_every ? " empty-experts" : "", valid, e1, nan1, e2, nan2);
}

template <class F>
double median_us(F&& f, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CK(f());
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    CK(f());
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1000);
  }
  std::sort(ts.begin(), ts.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ts[ts.size() / 2];
}

void time_shape(const char* name, int64_t T, int K, int E, int64_t H, int64_t I, bool skewed, int reps,
                cublasHandle_t blas, bool profile_only = false) {
  std::mt19937_64 rng(42 + T);
  const auto idx = make_routing(T, K, E, skewed, 0, rng);
  Routed r(idx, T, K, E);
  const int64_t P = r.P, N1 = 2 * I;
  const k::Elem type = k::Elem::bf16;
  Dev x(T * H * 2), w1(E * N1 * H * 2), w2(E * H * I * 2), xs(P * H * 2), act(P * I * 2), act2(P * I * 2), y(P * H * 4),
      y2(P * H * 4), cb(P * std::max(N1, H) * 2);
  fill(x.p, T * H, 11, 1.0f, true);
  fill(w1.p, E * N1 * H, 12, 1.7f / std::sqrt(float(H)), true);
  fill(w2.p, E * H * I, 13, 1.7f / std::sqrt(float(I)), true);
  k::GroupedGemmArgs g;
  g.type = type;
  g.a = x.p;
  g.lda = H;
  g.a_rows = r.sp.as<int32_t>();
  g.a_row_div = K;
  g.b = w1.p;
  g.b_expert_stride = N1 * H;
  g.b_stride_n = H;
  g.b_stride_k = 1;
  g.offsets = r.off.as<int32_t>();
  g.tile_offsets = r.toff.as<int32_t>();
  g.tile_m = g_tile;
  g.experts = E;
  g.max_rows = P;
  g.n = I;
  g.k = H;
  g.inter = I;
  g.epilogue = k::kEpiGated;
  g.gate.kind = k::kGateActMul;
  g.gate.activation = k::kActSilu;
  g.gate.concatenated = 1;
  g.out = act2.p;
  g.ldo = I;
  k::GroupedGemmArgs t1 = g;
  t1.a = xs.p;
  t1.a_rows = nullptr;
  t1.a_row_div = 1;
  t1.out = act.p;
  k::GroupedGemmArgs g2 = g;
  g2.a = act.p;
  g2.lda = I;
  g2.a_rows = nullptr;
  g2.a_row_div = 1;
  g2.b = w2.p;
  g2.b_expert_stride = H * I;
  g2.b_stride_n = I;
  g2.n = H;
  g2.k = I;
  g2.epilogue = k::kEpiF32;
  g2.out = y2.p;
  g2.ldo = H;
  k::GroupedGemmArgs t2 = g2;
  t2.out = y.p;
  if (!k::grouped_gemm_tma_ok(t1, 90) || !k::grouped_gemm_tma_ok(t2, 90)) {
    std::printf("%s: TMA kernel does not serve\n", name);
    ++g_fail;
    return;
  }
  if (profile_only) {
    // one launch of each TMA projection (for a profiler: gathered gate/up, contiguous gate/up, f32 down)
    CK(k::gather_rows(type, x.p, H, r.sp.as<int32_t>(), K, r.off.as<int32_t>() + E, P, xs.p, nullptr));
    CK(cudaDeviceSynchronize());
    k::GroupedGemmArgs tg = g;
    tg.out = act2.p;
    const char* what[3] = {"gate/up gathered", "gate/up", "down f32"};
    const k::GroupedGemmArgs* calls[3] = {&tg, &t1, &t2};
    for (int i = 0; i < 3; ++i) {
      if (!k::grouped_gemm_tma_ok(*calls[i], 90)) continue;
      std::printf("profile %s tile %d %s T=%ld: %s\n", form_name(), g_tile, name, long(T), what[i]);
      std::fflush(stdout);
      CK(k::grouped_gemm_tma(*calls[i], nullptr));
      CK(cudaDeviceSynchronize());
    }
    return;
  }
  // correctness of this shape against the cp.async wgmma kernel first
  CK(cudaMemset(act.p, 0xff, P * I * 2));
  CK(cudaMemset(y.p, 0xff, P * H * 4));
  CK(k::gather_rows(type, x.p, H, r.sp.as<int32_t>(), K, r.off.as<int32_t>() + E, P, xs.p, nullptr));
  CK(k::grouped_gemm_tma(t1, nullptr));
  CK(k::grouped_gemm_wgmma(g, g_tile, false, nullptr));
  CK(k::grouped_gemm_tma(t2, nullptr));
  CK(k::grouped_gemm_wgmma(g2, g_tile, false, nullptr));
  CK(cudaDeviceSynchronize());
  double n1, n2;
  const double e1 = rel_err(type, act.p, act2.p, P, I, I, &n1), e2 = rel_err(k::Elem::f32, y.p, y2.p, P, H, H, &n2);
  const bool pass = e1 < 1e-2 && e2 < 1e-3 && n1 == 0 && n2 == 0;
  if (!pass) ++g_fail;

  const double f1 = 2.0 * P * H * N1, f2 = 2.0 * P * I * H;
  auto tf = [](double f, double us) { return f / us * 1e-6; };
  if (g_quick) {  // the three TMA projections of the backends: gathered gate/up, gate/up, f32 down
    k::GroupedGemmArgs tg = g;
    tg.out = act2.p;
    const double tgu = median_us([&] { return k::grouped_gemm_tma(tg, nullptr); }, reps);
    const double t1u = median_us([&] { return k::grouped_gemm_tma(t1, nullptr); }, reps);
    const double t2u = median_us([&] { return k::grouped_gemm_tma(t2, nullptr); }, reps);
    k::GroupedGemmArgs t16 = t2;  // down in 16-bit rows (kEpiWeighted without weights: grouped_mm / deepgemm)
    t16.epilogue = k::kEpiWeighted;
    t16.out = cb.p;
    const double t16u = median_us([&] { return k::grouped_gemm_tma(t16, nullptr); }, reps);
    std::printf("%-11s %3d %-14s T=%-6ld %-7s check %s (%.1e %.1e) | gate/up gathered %7.0f us %4.0f TF/s | gate/up "
                "%7.0f us %4.0f | down %7.0f us %4.0f | down 16-bit %7.0f us %4.0f\n",
                form_name(), g_tile, name, long(T), skewed ? "skewed" : "uniform", pass ? "ok" : "FAIL", e1, e2, tgu,
                tf(f1, tgu), t1u, tf(f1, t1u), t2u, tf(f2, t2u), t16u, tf(f2, t16u));
    std::fflush(stdout);
    return;
  }
  const double t_gather = median_us(
      [&] { return k::gather_rows(type, x.p, H, r.sp.as<int32_t>(), K, r.off.as<int32_t>() + E, P, xs.p, nullptr); },
      reps);
  const double t_tma1 = median_us([&] { return k::grouped_gemm_tma(t1, nullptr); }, reps);
  // the same FLOPs through the other epilogues: interleaved gate / up, and no gate (2I columns, bf16 out)
  k::GroupedGemmArgs t1i = t1, t1a = t1;
  t1i.gate.concatenated = 0;
  t1a.epilogue = k::kEpiActOnly;
  t1a.gate.kind = k::kGateActOnly;
  t1a.n = N1;
  t1a.out = cb.p;
  t1a.ldo = N1;
  const double t_tma1i = median_us([&] { return k::grouped_gemm_tma(t1i, nullptr); }, reps);
  const double t_tma1a = median_us([&] { return k::grouped_gemm_tma(t1a, nullptr); }, reps);
  // diagnostics: f32 epilogue on the first projection's operands, bf16 act-only epilogue on the second's
  double t_x1 = 0, t_x2 = 0;
  {
    Dev yf(P * N1 * 4);
    k::GroupedGemmArgs x1 = t1a;
    x1.epilogue = k::kEpiF32;
    x1.out = yf.p;
    t_x1 = median_us([&] { return k::grouped_gemm_tma(x1, nullptr); }, reps);
    k::GroupedGemmArgs x2 = t2;
    x2.epilogue = k::kEpiActOnly;
    x2.gate.kind = k::kGateActOnly;
    x2.out = cb.p;
    t_x2 = median_us([&] { return k::grouped_gemm_tma(x2, nullptr); }, reps);
  }
  const double t_old1 = median_us([&] { return k::grouped_gemm_wgmma(g, g_tile, false, nullptr); }, reps);
  const double t_tma2 = median_us([&] { return k::grouped_gemm_tma(t2, nullptr); }, reps);
  const double t_old2 = median_us([&] { return k::grouped_gemm_wgmma(g2, g_tile, false, nullptr); }, reps);
  // cuBLAS: one GEMM over all P rows with one expert's weights (same FLOPs, no grouping), bf16 out.
  const float one = 1, zero = 0;
  auto blas1 = [&] {
    return cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(N1), int(P), int(H), &one, w1.p, CUDA_R_16BF, int(H), xs.p,
                        CUDA_R_16BF, int(H), &zero, cb.p, CUDA_R_16BF, int(N1), CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS
               ? cudaSuccess
               : cudaErrorUnknown;
  };
  auto blas2 = [&] {
    return cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(H), int(P), int(I), &one, w2.p, CUDA_R_16BF, int(I), act.p,
                        CUDA_R_16BF, int(I), &zero, cb.p, CUDA_R_16BF, int(H), CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS
               ? cudaSuccess
               : cudaErrorUnknown;
  };
  const double t_b1 = median_us(blas1, reps), t_b2 = median_us(blas2, reps);
  std::printf(
      "%-11s %3d %-14s T=%-6ld %-7s check %s (%.1e %.1e) | gate/up: tma %7.0f us %4.0f TF/s  old %7.0f us %4.0f  "
      "cublas %7.0f us "
      "%4.0f  gather %5.0f us  [tma interleaved %4.0f, act-only %4.0f, f32-out %4.0f TF/s] | down: tma %7.0f us %4.0f  "
      "old %7.0f us %4.0f  cublas %7.0f us %4.0f [bf16-out %4.0f]\n",
      form_name(), g_tile, name, long(T), skewed ? "skewed" : "uniform",
      pass ? "ok" : "FAIL", e1, e2, t_tma1, tf(f1, t_tma1), t_old1,
      tf(f1, t_old1), t_b1, tf(f1, t_b1), t_gather, tf(f1, t_tma1i), tf(f1, t_tma1a), tf(f1, t_x1), t_tma2,
      tf(f2, t_tma2), t_old2, tf(f2, t_old2), t_b2, tf(f2, t_b2), tf(f2, t_x2));
  std::fflush(stdout);
}

// --runs T:tile,... (time --quick and profile)
struct Run {
  int64_t T;
  int tile;
};
std::vector<Run> parse_runs(const std::string& text) {
  std::vector<Run> runs;
  for (const char* p = text.c_str(); *p;) {
    Run r{};
    if (std::sscanf(p, "%ld:%d", &r.T, &r.tile) != 2) break;
    runs.push_back(r);
    p = std::strchr(p, ',');
    if (!p) break;
    ++p;
  }
  return runs;
}

int main(int argc, char** argv) {
  bool check = false, timing = false, profile = false;
  int reps = 30;
  int64_t profile_tokens = 4096;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "check"))
      check = true;
    else if (!std::strcmp(argv[i], "time"))
      timing = true;
    else if (!std::strcmp(argv[i], "profile"))
      profile = true;
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc)
      profile_tokens = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick"))
      g_quick = true;
    else if (!std::strcmp(argv[i], "--runs") && i + 1 < argc)
      g_runs = argv[++i];
  }
  if (!check && !timing && !profile) check = timing = true;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  // the engine's forms: ping-pong (route tiles of 64) and cooperative (128)
  if (check) {
    for (int split : {1, 0})
    for (int tile : {64, 128}) {
    k::set_grouped_gemm_tma_split_out(split != 0);
    g_tile = tile;
    std::printf("-- %s, route tile %d, %s epilogue staging\n", form_name(), g_tile, split ? "split" : "paired");
    uint64_t seed = 1;
    for (k::Elem t : {k::Elem::bf16, k::Elem::f16}) {
      check_case(300, 4, 8, 256, 128, t, true, true, false, false, 0, seed++);
      check_case(517, 2, 16, 264, 200, t, true, true, true, true, 3, seed++);
      check_case(517, 3, 16, 328, 136, t, true, false, true, false, 5, seed++);
      check_case(211, 2, 7, 200, 96, t, false, true, true, true, 0, seed++);
      check_case(1000, 8, 64, 512, 384, t, true, true, false, true, 7, seed++);
      check_case(5, 2, 8, 64, 64, t, true, true, false, false, 0, seed++);
      check_case(517, 2, 16, 264, 200, t, true, true, false, true, 3, seed++);  // n not a multiple of the tile
      check_case(3000, 4, 8, 128, 64, t, true, true, false, false, 0, seed++);  // many whole 64-row blocks
      check_case(77, 8, 64, 256, 192, t, true, true, false, false, 9, seed++);  // ~10 rows per expert
    }
    }
  }
  if (profile) {
    std::vector<Run> runs = {{profile_tokens, 64}, {profile_tokens, 128}};
    if (!g_runs.empty()) runs = parse_runs(g_runs);
    for (const Run& r : runs) {
      g_tile = r.tile;
      time_shape("qwen3-30b-a3b", r.T, 8, 128, 2048, 768, false, 1, nullptr, true);
      time_shape("mixtral-8x7b", r.T, 2, 8, 4096, 14336, false, 1, nullptr, true);
    }
  }
  if (timing && g_quick) {
    // the engine's forms where each is a candidate
    std::vector<Run> runs = {{512, 64}, {4096, 64}, {4096, 128}, {16384, 128}};
    if (!g_runs.empty()) runs = parse_runs(g_runs);
    for (const Run& r : runs) {
      g_tile = r.tile;
      time_shape("qwen3-30b-a3b", r.T, 8, 128, 2048, 768, false, reps, nullptr);
      time_shape("mixtral-8x7b", r.T, 2, 8, 4096, 14336, false, reps, nullptr);
    }
  } else if (timing) {
    cublasHandle_t blas;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) return 1;
    for (int split : {1, 0})
      for (int tile : {64, 128}) {
        k::set_grouped_gemm_tma_split_out(split != 0);
        std::printf("-- route tile %d, %s epilogue staging\n", tile, split ? "split" : "paired");
        g_tile = tile;
        for (bool skewed : {false, true})
          for (int64_t T : {512, 4096, 16384}) {
            if ((tile == 64 && T == 16384) || (skewed && (T == 512 || !split))) continue;
            time_shape("qwen3-30b-a3b", T, 8, 128, 2048, 768, skewed, reps, blas);
            time_shape("mixtral-8x7b", T, 2, 8, 4096, 14336, skewed, reps, blas);
          }
      }
    k::set_grouped_gemm_tma_split_out(true);
    cublasDestroy(blas);
  }
  std::printf("%s (%d failures)\n", g_fail ? "FAILED" : "PASSED", g_fail);
  return g_fail ? 1 : 0;
}

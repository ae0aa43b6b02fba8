#include "bench/workload.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "backends/reference.h"
#include "moekit/quant.h"
#ifdef MOEKIT_WITH_CUDA
#include "backends/cuda/kernels/kernels.h"
#include "backends/cuda/kernels/quant_fp4.h"
#endif
#include "bench/random.h"
#ifdef MOEKIT_WITH_CUDA
#include "bench/cuda_bench.h"
#endif

namespace moekit::bench {
namespace {

// normal(0, std) into a CPU tensor. Values come from a 64 Ki-entry table of normals picked by a hash
// of the seed and position: the distribution of normal data at a few ns per element (weights are gigabytes).
void fill_normal_host(Tensor& t, double std, uint64_t seed) {
  constexpr uint64_t kTable = 1 << 16;
  static const std::vector<float> normals = [] {
    std::vector<float> v(kTable);
    for (uint64_t i = 0; i < kTable; ++i) v[i] = normal_at(0x6a09e667f3bcc908ull, i);
    return v;
  }();
  const float* table = normals.data();
  const float scale = float(std);
  const int64_t n = t.numel();
  const DType dtype = t.dtype();
  const uint64_t key = splitmix64(seed ^ 0x5851f42d4c957f2dull);
#pragma omp parallel for schedule(static) if (n > (1 << 18))
  for (int64_t i = 0; i < n; ++i) {
    const float v = scale * table[splitmix64(key + uint64_t(i)) & (kTable - 1)];
    switch (dtype) {
      case DType::f32: t.ptr<float>()[i] = v; break;
      case DType::bf16: t.ptr<uint16_t>()[i] = f32_to_bf16(v); break;
      case DType::f16: t.ptr<uint16_t>()[i] = f32_to_f16(v); break;
      default: break;
    }
  }
}

Tensor random_tensor(const Shape& shape, DType dtype, Device device, double std, uint64_t seed) {
  MOEKIT_CHECK(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16, "benchmark dtype must be f32, bf16 or f16, got ",
               dtype_name(dtype));
  Tensor t = Tensor::empty(shape, dtype, device);
  if (device.is_cpu()) {
    fill_normal_host(t, std, seed);
    return t;
  }
#ifdef MOEKIT_WITH_CUDA
  cuda::fill_normal(t.data(), dtype, t.numel(), std, seed, nullptr);
  cuda::synchronize(nullptr);
  return t;
#else
  MOEKIT_FAIL(not_supported, "device ", device.to_string(), ": moekit was built without CUDA");
#endif
}

// K distinct experts for each of T tokens, [T, K] i64.
std::vector<int64_t> route(int64_t T, int64_t K, int64_t E, Routing routing, const std::vector<int64_t>& popularity,
                           std::mt19937_64& rng) {
  std::vector<int64_t> idx(size_t(T * K));
  if (routing == Routing::uniform) {
    std::vector<int64_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {  // partial Fisher-Yates: the first K of a fresh shuffle
        std::uniform_int_distribution<int64_t> pick(k, E - 1);
        std::swap(perm[size_t(k)], perm[size_t(pick(rng))]);
        idx[size_t(t * K + k)] = perm[size_t(k)];
      }
    return idx;
  }
  // Zipf(1): the expert of popularity rank r is drawn with probability proportional to 1 / (r + 1).
  std::vector<double> cdf(static_cast<size_t>(E));
  double s = 0;
  for (int64_t r = 0; r < E; ++r) cdf[size_t(r)] = (s += 1.0 / double(r + 1));
  std::uniform_real_distribution<double> u(0.0, s);
  std::vector<char> taken(size_t(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    int64_t k = 0;
    for (int attempt = 0; k < K && attempt < 64 * K; ++attempt) {
      const int64_t r = std::min<int64_t>(E - 1, std::upper_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
      const int64_t e = popularity[size_t(r)];
      if (taken[size_t(e)]) continue;
      taken[size_t(e)] = 1;
      idx[size_t(t * K + k++)] = e;
    }
    for (int64_t r = 0; k < K; ++r)  // rejection ran long: the most popular free experts
      if (!taken[size_t(popularity[size_t(r)])]) taken[size_t(popularity[size_t(r)])] = 1, idx[size_t(t * K + k++)] = popularity[size_t(r)];
    for (int64_t j = 0; j < K; ++j) taken[size_t(idx[size_t(t * K + j)])] = 0;
  }
  return idx;
}

}  // namespace

Experts quantize_random_experts(ExpertsSpec spec, ExpertsWeights w, const std::string& quant);

namespace {
// quantize_fp8 (f32 scales) of a contiguous [E, N, K] weight on its CUDA device: the e4m3 weights, `scale` set.
Tensor quantize_fp8_on_device(const Tensor& w, int64_t segments, Tensor& scale) {
#ifdef MOEKIT_WITH_CUDA
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  MOEKIT_CHECK(w.dtype() == DType::f32 || w.dtype() == DType::bf16 || w.dtype() == DType::f16,
               "bench: FP8 experts are made from f32, bf16 or f16 weights, got ", dtype_name(w.dtype()));
  Tensor q = Tensor::empty(w.shape(), DType::f8e4m3, w.device());
  scale = Tensor::empty({E, segments * fp8_blocks(N / segments), fp8_blocks(K)}, DType::f32, w.device());
  const auto type = w.dtype() == DType::f32    ? ::moekit::cuda::kernels::Elem::f32
                    : w.dtype() == DType::bf16 ? ::moekit::cuda::kernels::Elem::bf16
                                               : ::moekit::cuda::kernels::Elem::f16;
  const cudaError_t err = ::moekit::cuda::kernels::quantize_fp8_blocks(type, w.data(), E, N, K, segments, q.ptr<uint8_t>(),
                                                             scale.ptr<float>(), nullptr);
  MOEKIT_CHECK(err == cudaSuccess, "bench: FP8 quantisation on the device failed: ", cudaGetErrorString(err));
  stream_synchronize(nullptr, w.device());
  return q;
#else
  auto [q, s] = quantize_fp8(w, DType::f32, segments);
  scale = s.to(w.device());
  return q.to(w.device());
#endif
}
// quantize_fp4 of a contiguous [E, N, K] weight on its CUDA device: the packed e2m1 weights, `scale` set (ue8m0).
Tensor quantize_fp4_on_device(const Tensor& w, Tensor& scale) {
#ifdef MOEKIT_WITH_CUDA
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  MOEKIT_CHECK(w.dtype() == DType::f32 || w.dtype() == DType::bf16 || w.dtype() == DType::f16,
               "bench: FP4 experts are made from f32, bf16 or f16 weights, got ", dtype_name(w.dtype()));
  MOEKIT_CHECK(K % kFp4Group == 0, "bench: FP4 experts need a multiple of 32 inputs per weight row, got ", K);
  Tensor q = Tensor::empty(w.shape(), DType::f4e2m1, w.device());
  scale = Tensor::empty({E, N, K / kFp4Group}, DType::ue8m0, w.device());
  const auto type = w.dtype() == DType::f32    ? ::moekit::cuda::kernels::Elem::f32
                    : w.dtype() == DType::bf16 ? ::moekit::cuda::kernels::Elem::bf16
                                               : ::moekit::cuda::kernels::Elem::f16;
  const cudaError_t err = ::moekit::cuda::kernels::quantize_fp4_groups(type, w.data(), E * N, K, q.ptr<uint8_t>(),
                                                                      scale.ptr<uint8_t>(), nullptr);
  MOEKIT_CHECK(err == cudaSuccess, "bench: FP4 quantisation on the device failed: ", cudaGetErrorString(err));
  stream_synchronize(nullptr, w.device());
  return q;
#else
  auto [q, s] = quantize_fp4(w);
  scale = s.to(w.device());
  return q.to(w.device());
#endif
}
}  // namespace

Experts make_random_experts(const ShapePreset& shape, DType dtype, Device device, uint64_t seed,
                            const std::string& quant) {
  const ExpertsSpec spec = shape.spec();
  const int64_t E = shape.num_experts, H = shape.hidden, I = shape.intermediate;
  ExpertsWeights w;
  w.gate_up_proj = random_tensor(spec.is_transposed ? Shape{E, H, 2 * I} : Shape{E, 2 * I, H}, dtype, device, 0.02,
                                 seed * 8 + 1);
  w.down_proj = random_tensor(spec.is_transposed ? Shape{E, I, H} : Shape{E, H, I}, dtype, device, 0.02, seed * 8 + 2);
  if (spec.has_bias) {
    w.gate_up_proj_bias = random_tensor({E, 2 * I}, dtype, device, 0.02, seed * 8 + 3);
    w.down_proj_bias = random_tensor({E, H}, dtype, device, 0.02, seed * 8 + 4);
  }
  if (!quant.empty()) return quantize_random_experts(spec, std::move(w), quant);
  return Experts(spec, std::move(w), "eager");
}

// The weights of make_random_experts in a quantized format, [E, out, in], on their device.
Experts quantize_random_experts(ExpertsSpec spec, ExpertsWeights w, const std::string& quant) {
  MOEKIT_CHECK(quant == "fp8" || quant == "fp4" || quant == "mxfp4", "bench: --quant takes fp8, fp4 or mxfp4, got '",
               quant, "'");
  const Device dev = w.down_proj.device();
  Tensor& first = spec.has_gate ? w.gate_up_proj : w.up_proj;
  Tensor& first_scale = spec.has_gate ? w.gate_up_proj_scale_inv : w.up_proj_scale_inv;
  if (spec.is_transposed) {
    first = transpose_expert_weight(first);
    w.down_proj = transpose_expert_weight(w.down_proj);
    spec.is_transposed = false;
  }
  if (quant == "fp8") {
    MOEKIT_CHECK(!spec.has_gate || spec.is_concatenated, "bench --quant fp8: interleaved gate/up experts (",
                 "this shape) have no FP8 layout; use fp4 or mxfp4");
    if (dev.is_cuda()) {  // on the device: the host loop takes minutes on the large shapes
      const Tensor f = first, d = w.down_proj;
      first = quantize_fp8_on_device(f, spec.has_gate ? 2 : 1, first_scale);
      w.down_proj = quantize_fp8_on_device(d, 1, w.down_proj_scale_inv);
    } else {
      auto [q1, s1] = quantize_fp8(first, DType::f32, spec.has_gate ? 2 : 1);
      auto [q2, s2] = quantize_fp8(w.down_proj);
      first = q1.to(dev), first_scale = s1.to(dev), w.down_proj = q2.to(dev), w.down_proj_scale_inv = s2.to(dev);
    }
  } else {
    if (dev.is_cuda()) {  // on the device, as for FP8
      const Tensor f = first, d = w.down_proj;
      first = quantize_fp4_on_device(f, first_scale);
      w.down_proj = quantize_fp4_on_device(d, w.down_proj_scale_inv);
    } else {
      auto [q1, s1] = quantize_fp4(first);
      auto [q2, s2] = quantize_fp4(w.down_proj);
      first = q1.to(dev), first_scale = s1.to(dev), w.down_proj = q2.to(dev), w.down_proj_scale_inv = s2.to(dev);
    }
    w.fp4_float_activations = quant == "mxfp4";
  }
  return Experts(spec, std::move(w), "eager");
}

InputSet make_input_set(const ShapePreset& shape, int64_t T, DType dtype, DType index_dtype, Routing routing,
                        const std::vector<int64_t>& popularity, Device device, uint64_t seed, bool keep_host) {
  const int64_t H = shape.hidden, K = shape.top_k, E = shape.num_experts;
  std::mt19937_64 rng(splitmix64(seed));
  InputSet s;
  Tensor x = random_tensor({T, H}, dtype, Device::cpu(), 1.0, seed);
  const std::vector<int64_t> ids = route(T, K, E, routing, popularity, rng);
  Tensor idx = Tensor::empty({T, K}, index_dtype);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (index_dtype == DType::i32) idx.ptr<int32_t>()[i] = int32_t(ids[i]);
    else idx.ptr<int64_t>()[i] = ids[i];
  }
  Tensor w = Tensor::empty({T, K}, DType::f32);
  std::normal_distribution<float> logit(0.0f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    float* row = w.ptr<float>() + t * K;
    float mx = -INFINITY, sum = 0;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, row[k] = logit(rng));
    for (int64_t k = 0; k < K; ++k) sum += (row[k] = std::exp(row[k] - mx));
    for (int64_t k = 0; k < K; ++k) row[k] /= sum;
  }
  if (dtype != DType::f32) w = w.to(dtype);
  std::vector<char> hit(size_t(E), 0);
  for (int64_t e : ids) hit[size_t(e)] = 1;
  s.experts_touched = std::count(hit.begin(), hit.end(), 1);
  s.hidden_states = x.to(device);
  s.top_k_index = idx.to(device);
  s.top_k_weights = w.to(device);
  s.out = Tensor::empty({T, H}, dtype, device);
  if (keep_host) {
    s.host_hidden_states = x;
    s.host_top_k_index = idx;
    s.host_top_k_weights = w;
  }
  return s;
}

void poison_output(Tensor& out, Stream stream) {
  if (out.device().is_cpu()) {
    std::memset(out.data(), 0xff, out.nbytes());
    return;
  }
#ifdef MOEKIT_WITH_CUDA
  cuda::memset_bytes(out.data(), 0xff, out.nbytes(), stream);
#else
  (void)stream;
  MOEKIT_FAIL(not_supported, "device ", out.device().to_string(), ": moekit was built without CUDA");
#endif
}

ReferenceRows reference_rows(const Experts& experts, const ShapePreset& shape, const InputSet& set, int64_t max_macs) {
  const Tensor& x = set.host_hidden_states;
  const Tensor& idx = set.host_top_k_index;
  const Tensor& w = set.host_top_k_weights;
  MOEKIT_ASSERT(x.defined() && idx.defined() && w.defined());
  const int64_t T = x.size(0), H = shape.hidden, K = shape.top_k, I = shape.intermediate;
  const int64_t macs_per_row = K * 3 * H * I;
  if (max_macs <= 0) return {};  // no reference rows: the outputs are still checked for unwritten values
  const int64_t n = std::clamp<int64_t>(max_macs / std::max<int64_t>(1, macs_per_row), 1, std::min<int64_t>(T, 8));
  ReferenceRows ref;
  for (int64_t j = 0; j < n; ++j) ref.rows.push_back(n == 1 ? 0 : j * (T - 1) / (n - 1));

  // The experts these rows hit, copied to the host under compact ids 0..E'-1.
  std::vector<int64_t> compact(size_t(shape.num_experts), -1), used;
  for (int64_t r : ref.rows)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = int64_t(load_as_f64(idx.data(), idx.dtype(), r * K + k));
      if (compact[size_t(e)] < 0) compact[size_t(e)] = int64_t(used.size()), used.push_back(e);
    }
  const int64_t En = int64_t(used.size());
  auto gather = [&](const Tensor& t) -> Tensor {
    if (!t.defined()) return Tensor();
    Shape s = t.shape();
    const size_t per_expert = t.nbytes() / size_t(s[0]);
    s[0] = En;
    Tensor h = Tensor::empty(s, t.dtype());
    for (int64_t j = 0; j < En; ++j)
      memcpy_any(static_cast<char*>(h.data()) + size_t(j) * per_expert, Device::cpu(),
                 static_cast<const char*>(t.data()) + size_t(used[size_t(j)]) * per_expert, t.device(), per_expert);
    return h;
  };
  const ExpertsWeights& W = experts.weights();
  ExpertsWeights cw;
  cw.gate_up_proj = gather(W.gate_up_proj);
  cw.up_proj = gather(W.up_proj);
  cw.down_proj = gather(W.down_proj);
  cw.gate_up_proj_bias = gather(W.gate_up_proj_bias);
  cw.up_proj_bias = gather(W.up_proj_bias);
  cw.down_proj_bias = gather(W.down_proj_bias);
  cw.gate_up_proj_scale_inv = gather(W.gate_up_proj_scale_inv);
  cw.up_proj_scale_inv = gather(W.up_proj_scale_inv);
  cw.down_proj_scale_inv = gather(W.down_proj_scale_inv);
  cw.fp4_float_activations = W.fp4_float_activations;
  ExpertsSpec spec = experts.spec();
  spec.num_experts = En;
  const Experts host(spec, std::move(cw), "eager");

  ref.values.assign(size_t(n * H), 0.0);
  std::vector<std::string> errors(static_cast<size_t>(n));
#pragma omp parallel for schedule(dynamic, 1) if (n > 1 && macs_per_row > (1 << 20))
  for (int64_t j = 0; j < n; ++j) {
    try {
      const int64_t r = ref.rows[size_t(j)];
      const size_t xb = dtype_nbytes(x.dtype(), H), wb = dtype_nbytes(w.dtype(), K);
      TensorView xr(static_cast<char*>(x.data()) + size_t(r) * xb, x.dtype(), {1, H});
      TensorView wr(static_cast<char*>(w.data()) + size_t(r) * wb, w.dtype(), {1, K});
      std::vector<int64_t> ids(static_cast<size_t>(K));
      for (int64_t k = 0; k < K; ++k) ids[size_t(k)] = compact[size_t(load_as_f64(idx.data(), idx.dtype(), r * K + k))];
      TensorView ir(ids.data(), DType::i64, {1, K});
      const std::vector<double> row = reference_forward(host, xr, ir, wr);
      std::copy(row.begin(), row.end(), ref.values.begin() + j * H);
    } catch (const std::exception& e) {
      errors[size_t(j)] = e.what();
    }
  }
  for (const auto& e : errors) MOEKIT_CHECK_CODE(e.empty(), internal, "reference: ", e);
  return ref;
}

double check_output(const ReferenceRows& ref, const Tensor& out, std::string& problem) {
  const Tensor host = out.device().is_cpu() ? out : out.to(Device::cpu());
  const int64_t T = host.size(0), H = host.size(1);
  const DType dt = host.dtype();
  // Every element must have been written (the poison is NaN) and be finite.
  int64_t bad = -1;
#pragma omp parallel for reduction(max : bad) if (T * H > (1 << 18))
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      if (!std::isfinite(load_as_f64(host.data(), dt, t * H + h))) {
        bad = std::max(bad, t);
        break;
      }
  if (bad >= 0) {
    problem = "output row " + std::to_string(bad) + " has NaN or Inf (unwritten or overflowed)";
    return INFINITY;
  }
  std::vector<double> got;
  got.reserve(ref.values.size());
  for (int64_t r : ref.rows)
    for (int64_t h = 0; h < H; ++h) got.push_back(load_as_f64(host.data(), dt, r * H + h));
  return relative_l2(got, ref.values);
}

}  // namespace moekit::bench

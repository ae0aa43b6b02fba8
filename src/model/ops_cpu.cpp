// CPU layer ops: OpenMP over rows / heads / output tiles, f32 accumulation, any float storage dtype.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "base/activation.h"
#include "base/convert.h"
#include "base/gemm.h"
#include "model/ops.h"
#include "moekit/error.h"

namespace moekit::model {
namespace {

// Below these sizes a fork/join costs more than it saves (much more on a busy machine).
constexpr int64_t kParallelWork = int64_t(1) << 18;      // multiply-adds
constexpr int64_t kParallelElements = int64_t(1) << 16;  // elements of an elementwise op

size_t esize(DType t) { return dtype_nbytes(t, 1); }

void check_float(const TensorView& v, const char* what) {
  MOEKIT_CHECK(v.dtype == DType::f32 || v.dtype == DType::bf16 || v.dtype == DType::f16, what,
               " must be f32, bf16 or f16, got ", v.to_string());
  MOEKIT_CHECK(v.device.is_cpu(), what, " must be on the CPU, got ", v.to_string());
}


const char* row_ptr(const TensorView& v, int64_t r, int64_t ld) {
  return static_cast<const char*>(v.data) + size_t(r * ld) * esize(v.dtype);
}
char* row_ptr_mut(const TensorView& v, int64_t r, int64_t ld) {
  return static_cast<char*>(v.data) + size_t(r * ld) * esize(v.dtype);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// A 2-D view's rows as f32: the view itself when it already is f32, else a converted copy in `buf`.
const float* rows_f32(const TensorView& v, int64_t ld, std::vector<float>& buf, int64_t& out_ld) {
  const int64_t M = v.shape[0], K = v.shape[1];
  if (v.dtype == DType::f32) {
    out_ld = ld;
    return static_cast<const float*>(v.data);
  }
  buf.resize(size_t(M * K));
#pragma omp parallel for schedule(static) if (M * K > kParallelElements)
  for (int64_t m = 0; m < M; ++m) cpu::load_f32(row_ptr(v, m, ld), v.dtype, 0, K, buf.data() + m * K);
  out_ld = K;
  return buf.data();
}

class CpuOps final : public DeviceOps {
 public:
  void embedding(const TensorView& ids_v, const TensorView& table, const TensorView& out) const override {
    check_float(table, "embedding table");
    check_float(out, "embedding output");
    MOEKIT_CHECK(ids_v.dtype == DType::i64 && ids_v.device.is_cpu() && ids_v.is_contiguous(),
                 "embedding ids must be contiguous i64 on the CPU, got ", ids_v.to_string());
    const int64_t* ids = ids_v.ptr<int64_t>();
    const int64_t n = ids_v.numel();
    MOEKIT_CHECK(table.dim() == 2 && table.is_contiguous(), "embedding table must be a contiguous [V, H] tensor");
    const int64_t V = table.shape[0], H = table.shape[1];
    MOEKIT_CHECK(out.is_contiguous() && out.numel() == n * H, "embedding output must hold [", n, ", ", H, "]");
    for (int64_t i = 0; i < n; ++i)
      MOEKIT_CHECK(ids[i] >= 0 && ids[i] < V, "token id ", ids[i], " at position ", i, " is out of range [0, ", V,
                   ") (vocab_size ", V, ")");
    std::vector<float> row(static_cast<size_t>(H));
    for (int64_t i = 0; i < n; ++i) {
      const char* src = row_ptr(table, ids[i], H);
      char* dst = static_cast<char*>(out.data) + size_t(i * H) * esize(out.dtype);
      if (table.dtype == out.dtype)
        std::memcpy(dst, src, size_t(H) * esize(out.dtype));
      else {
        cpu::load_f32(src, table.dtype, 0, H, row.data());
        cpu::store_f32(row.data(), dst, out.dtype, 0, H);
      }
    }
  }

  void linear(const TensorView& x, const TensorView& w, const TensorView& bias, const TensorView& y) const override {
    check_float(x, "linear input");
    check_float(w, "linear weight");
    check_float(y, "linear output");
    const LinearDims dims = check_linear(x, w, bias, y);
    const int64_t M = dims.M, K = dims.K, N = dims.N, ldx = dims.ldx;  // plain names: OpenMP regions capture them
    if (M == 0 || N == 0) return;
    std::vector<float> bias_f;
    if (bias.data) {
      bias_f.resize(size_t(N));
      cpu::load_f32(bias.data, bias.dtype, 0, N, bias_f.data());
    }
    std::vector<float> xbuf;
    int64_t lx = 0;
    const float* xf = rows_f32(x, ldx, xbuf, lx);
    std::vector<float> ybuf;
    float* yf = y.dtype == DType::f32 ? static_cast<float*>(y.data) : (ybuf.resize(size_t(M * N)), ybuf.data());
    const cpu::WeightMatrix wm{w.data, cpu::weight_type(w.dtype), N, K, false};
    cpu::gemm(cpu::gemm_kernels(), xf, lx, M, wm, yf, N);
    if (!bias_f.empty()) {
#pragma omp parallel for schedule(static) if (M * N > kParallelElements)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < N; ++j) yf[m * N + j] += bias_f[size_t(j)];
    }
    if (y.dtype != DType::f32) {
#pragma omp parallel for schedule(static) if (M * N > kParallelElements)
      for (int64_t m = 0; m < M; ++m) cpu::store_f32(yf + m * N, row_ptr_mut(y, m, N), y.dtype, 0, N);
    }
  }

  void rmsnorm(const TensorView& x, const TensorView& w, float eps, bool weight_before_cast,
               const TensorView& y) const override {
    check_float(x, "rmsnorm input");
    check_float(w, "rmsnorm weight");
    check_float(y, "rmsnorm output");
    const NormDims dims = check_rmsnorm(x, w, y);
    const int64_t M = dims.M, D = dims.D, ldx = dims.ldx, ldy = dims.ldy;
    std::vector<float> wf(static_cast<size_t>(D));
    cpu::load_f32(w.data, w.dtype, 0, D, wf.data());
    const DType in_t = x.dtype;
#pragma omp parallel if (M * D > kParallelElements)
    {
      std::vector<float> row(static_cast<size_t>(D));
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) {
        cpu::load_f32(row_ptr(x, m, ldx), x.dtype, 0, D, row.data());
        double ss = 0;
        for (int64_t i = 0; i < D; ++i) ss += double(row[size_t(i)]) * row[size_t(i)];
        const float variance = float(ss / double(D));
        const float r = 1.0f / std::sqrt(variance + eps);
        for (int64_t i = 0; i < D; ++i) {
          const float h = row[size_t(i)] * r;
          row[size_t(i)] = weight_before_cast ? wf[size_t(i)] * h : wf[size_t(i)] * cpu::round_to(h, in_t);
        }
        cpu::store_f32(row.data(), row_ptr_mut(y, m, ldy), y.dtype, 0, D);
      }
    }
  }

  void add_rmsnorm(const TensorView& h, const TensorView& a, const TensorView& w, float eps, bool weight_before_cast,
                   const TensorView& y) const override {
    add(h, a, h);
    rmsnorm(h, w, eps, weight_before_cast, y);
  }

  void rope(const TensorView& x, int64_t offset, Position position, const RopeSpec& rope) const override {
    check_float(x, "rope input");
    const int64_t pos0 = host_position(position);
    MOEKIT_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope input must be [T, heads, S] with unit inner stride, got ",
                 x.to_string());
    const int64_t T = x.shape[0], NH = x.shape[1], S = x.shape[2], half = int64_t(rope.inv_freq.size());
    const int64_t rd = 2 * half;
    MOEKIT_CHECK(offset >= 0 && offset + rd <= S, "rope: dims [", offset, ", ", offset + rd,
                 ") do not fit heads of size ", S);
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    const DType t = x.dtype;
#pragma omp parallel if (T * NH * rd > kParallelElements)
    {
      std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
      std::vector<float> v(static_cast<size_t>(rd)), o(static_cast<size_t>(rd));
#pragma omp for schedule(static)
      for (int64_t ti = 0; ti < T; ++ti) {
        const float pos = float(pos0 + ti);
        for (int64_t i = 0; i < half; ++i) {
          const float f = pos * rope.inv_freq[size_t(i)];
          // transformers casts cos/sin to the activation dtype before using them.
          c[size_t(i)] = cpu::round_to(std::cos(f) * rope.attention_scaling, t);
          s[size_t(i)] = cpu::round_to(std::sin(f) * rope.attention_scaling, t);
        }
        for (int64_t h = 0; h < NH; ++h) {
          char* p = static_cast<char*>(x.data) + size_t(ti * s0 + h * s1 + offset) * esize(t);
          cpu::load_f32(p, t, 0, rd, v.data());
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = rope.interleaved ? v[size_t(2 * i)] : v[size_t(i)];
            const float x2 = rope.interleaved ? v[size_t(2 * i + 1)] : v[size_t(i + half)];
            o[size_t(i)] = x1 * c[size_t(i)] - x2 * s[size_t(i)];
            o[size_t(i + half)] = x2 * c[size_t(i)] + x1 * s[size_t(i)];
          }
          cpu::store_f32(o.data(), p, t, 0, rd);
        }
      }
    }
  }

  void attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                 Position position, float scale, int64_t window, const TensorView& sinks) const override {
    check_float(q, "attention q");
    const int64_t pos0 = host_position(position);
    check_float(k, "attention k");
    check_float(v, "attention v");
    check_float(out, "attention output");
    const AttentionDims dims = check_attention(q, k, v, out, pos0, sinks);
    const int64_t T = dims.T, Hq = dims.Hq, Dk = dims.Dk, Hkv = dims.Hkv, Dv = dims.Dv;
    std::vector<float> sink_f;
    if (sinks.data) {
      sink_f.resize(size_t(Hq));
      cpu::load_f32(sinks.data, sinks.dtype, 0, Hq, sink_f.data());
    }
    std::vector<float> qbuf, kbuf, vbuf;
    int64_t ld = 0;
    const int64_t keys = pos0 + T;  // rows past the last key are not read
    const float* qf = rows_f32(reshaped(q, {T, Hq * Dk}), Hq * Dk, qbuf, ld);
    const float* kf = rows_f32(reshaped(rows(k, 0, keys), {keys, Hkv * Dk}), Hkv * Dk, kbuf, ld);
    const float* vf = rows_f32(reshaped(rows(v, 0, keys), {keys, Hkv * Dv}), Hkv * Dv, vbuf, ld);
    std::vector<float> obuf;
    float* of =
        out.dtype == DType::f32 ? static_cast<float*>(out.data) : (obuf.resize(size_t(T * Hq * Dv)), obuf.data());
    const int64_t group = Hq / Hkv;
#pragma omp parallel if (T * Hq * keys * (Dk + Dv) > kParallelWork)
    {
      std::vector<float> p(static_cast<size_t>(keys)), acc(static_cast<size_t>(Dv));
#pragma omp for collapse(2) schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < Hq; ++h) {
          const int64_t pos = pos0 + t, g = h / group;
          const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
          const float* qr = qf + (t * Hq + h) * Dk;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t j = lo; j <= pos; ++j) {
            const float sc = dot(qr, kf + (j * Hkv + g) * Dk, Dk) * scale;
            p[size_t(j - lo)] = sc;
            mx = std::max(mx, sc);
          }
          const bool has_sink = !sink_f.empty();
          if (has_sink) mx = std::max(mx, sink_f[size_t(h)]);
          float sum = 0;
          for (int64_t j = lo; j <= pos; ++j) {
            const float e = std::exp(p[size_t(j - lo)] - mx);
            p[size_t(j - lo)] = e;
            sum += e;
          }
          if (has_sink) sum += std::exp(sink_f[size_t(h)] - mx);
          const float inv = 1.0f / sum;
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t j = lo; j <= pos; ++j) {
            const float pj = p[size_t(j - lo)] * inv;
            const float* vr = vf + (j * Hkv + g) * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) acc[size_t(d)] += pj * vr[d];
          }
          std::memcpy(of + (t * Hq + h) * Dv, acc.data(), size_t(Dv) * 4);
        }
      }
    }
    if (out.dtype != DType::f32) cpu::store_f32(of, out.data, out.dtype, 0, T * Hq * Dv);
  }

  void act_mul(const TensorView& gu, Activation act, const TensorView& out) const override {
    check_float(gu, "act_mul input");
    check_float(out, "act_mul output");
    const int64_t ld = row_stride(gu, "act_mul input");
    const int64_t M = gu.shape[0], I = gu.shape[1] / 2;
    MOEKIT_CHECK(
        gu.shape[1] % 2 == 0 && out.dim() == 2 && out.shape[0] == M && out.shape[1] == I && out.is_contiguous(),
        "act_mul: input ", gu.to_string(), " and output ", out.to_string(), " do not match");
    const int act_code = act::code_of(act);
#pragma omp parallel if (M * I > kParallelElements)
    {
      std::vector<float> row(static_cast<size_t>(2 * I)), o(static_cast<size_t>(I));
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) {
        cpu::load_f32(row_ptr(gu, m, ld), gu.dtype, 0, 2 * I, row.data());
        for (int64_t i = 0; i < I; ++i) o[size_t(i)] = act::apply(act_code, row[size_t(i)]) * row[size_t(I + i)];
        cpu::store_f32(o.data(), row_ptr_mut(out, m, I), out.dtype, 0, I);
      }
    }
  }

  void add(const TensorView& a, const TensorView& b, const TensorView& out) const override {
    check_float(a, "add input");
    check_float(b, "add input");
    check_float(out, "add output");
    MOEKIT_CHECK(
        a.shape == b.shape && a.shape == out.shape && a.is_contiguous() && b.is_contiguous() && out.is_contiguous(),
        "add: shapes ", a.to_string(), ", ", b.to_string(), ", ", out.to_string(), " must match");
    const int64_t n = a.numel();
    if (a.dtype == DType::f32 && b.dtype == DType::f32 && out.dtype == DType::f32) {
      const float *pa = a.ptr<float>(), *pb = b.ptr<float>();
      float* po = out.ptr<float>();
#pragma omp parallel for simd schedule(static) if (n > kParallelElements)
      for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
      return;
    }
    constexpr int64_t kChunk = 4096;
#pragma omp parallel if (n > kParallelElements)
    {
      std::vector<float> fa(static_cast<size_t>(kChunk)), fb(static_cast<size_t>(kChunk));
#pragma omp for schedule(static)
      for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c) {
        const int64_t i0 = c * kChunk, len = std::min(kChunk, n - i0);
        cpu::load_f32(static_cast<const char*>(a.data) + size_t(i0) * esize(a.dtype), a.dtype, 0, len, fa.data());
        cpu::load_f32(static_cast<const char*>(b.data) + size_t(i0) * esize(b.dtype), b.dtype, 0, len, fb.data());
        for (int64_t i = 0; i < len; ++i) fa[size_t(i)] += fb[size_t(i)];
        cpu::store_f32(fa.data(), static_cast<char*>(out.data) + size_t(i0) * esize(out.dtype), out.dtype, 0, len);
      }
    }
  }

  void add_sigmoid_gated(const TensorView& x, const TensorView& gate, const TensorView& out) const override {
    check_float(x, "gated add input");
    check_float(gate, "gated add gate");
    check_float(out, "gated add output");
    MOEKIT_CHECK(x.dim() == 2 && x.shape == out.shape && x.is_contiguous() && out.is_contiguous() &&
                     gate.numel() == x.shape[0] && gate.is_contiguous(),
                 "gated add: x ", x.to_string(), ", gate ", gate.to_string(), ", out ", out.to_string());
    const int64_t M = x.shape[0], H = x.shape[1];
    std::vector<float> g(static_cast<size_t>(M));
    cpu::load_f32(gate.data, gate.dtype, 0, M, g.data());
#pragma omp parallel if (M * H > kParallelElements)
    {
      std::vector<float> xr(static_cast<size_t>(H)), orow(static_cast<size_t>(H));
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) {
        // transformers rounds sigmoid(gate) and the product to the activation dtype.
        const float s = cpu::round_to(act::sigmoid(g[size_t(m)]), x.dtype);
        cpu::load_f32(row_ptr(x, m, H), x.dtype, 0, H, xr.data());
        cpu::load_f32(row_ptr(out, m, H), out.dtype, 0, H, orow.data());
        for (int64_t i = 0; i < H; ++i) orow[size_t(i)] += cpu::round_to(s * xr[size_t(i)], x.dtype);
        cpu::store_f32(orow.data(), row_ptr_mut(out, m, H), out.dtype, 0, H);
      }
    }
  }

  void clamp(const TensorView& x, float limit) const override {
    check_float(x, "clamp input");
    MOEKIT_CHECK(x.is_contiguous(), "clamp input must be contiguous, got ", x.to_string());
    const int64_t n = x.numel();
    std::vector<float> f(static_cast<size_t>(n));
    cpu::load_f32(x.data, x.dtype, 0, n, f.data());
    for (auto& v : f) v = std::min(std::max(v, -limit), limit);
    cpu::store_f32(f.data(), x.data, x.dtype, 0, n);
  }

  void route(const TensorView& logits, const TensorView& correction_bias, const RouterSpec& spec,
             const TensorView& index, const TensorView& weights) const override;

  void write_rows(const TensorView& src, const TensorView& dst, Position position) const override {
    const int64_t row0 = host_position(position);
    MOEKIT_CHECK(src.dtype == dst.dtype && src.is_contiguous() && dst.is_contiguous() && src.dim() >= 1 &&
                     dst.dim() == src.dim() && src.device.is_cpu() && dst.device.is_cpu(),
                 "write_rows: source ", src.to_string(), " and destination ", dst.to_string(),
                 " must be contiguous CPU tensors of one dtype and rank");
    const TensorView d = rows(dst, row0, src.shape[0]);
    MOEKIT_CHECK(d.numel() == src.numel(), "write_rows: rows of ", src.to_string(), " do not match ", dst.to_string());
    std::memcpy(d.data, src.data, size_t(src.numel()) * esize(src.dtype));
  }

  void mla_expand(const TensorView& kvb, const TensorView& k_rot, int64_t nope, const TensorView& k_cache,
                  const TensorView& v_cache, Position position) const override {
    check_float(kvb, "mla kv_b output");
    check_float(k_rot, "mla k_rot");
    const int64_t T = k_rot.dim() == 2 ? k_rot.shape[0] : 0;
    const TensorView k = rows(k_cache, host_position(position), T), v = rows(v_cache, host_position(position), T);
    MOEKIT_CHECK(k.dim() == 3 && v.dim() == 3 && k.is_contiguous() && v.is_contiguous() && kvb.is_contiguous(),
                 "mla_expand: k ", k.to_string(), " and v ", v.to_string(), " must be contiguous 3-D");
    const int64_t H = k.shape[1], dk = k.shape[2], dv = v.shape[2], rope = dk - nope;
    const int64_t ldr = row_stride(k_rot, "mla k_rot");
    MOEKIT_CHECK(kvb.numel() == T * H * (nope + dv) && k_rot.shape[1] == rope && v.shape[1] == H,
                 "mla_expand: kvb ", kvb.to_string(), ", k_rot ", k_rot.to_string(), ", k ", k.to_string(), ", v ",
                 v.to_string(), " do not match");
    std::vector<float> row(static_cast<size_t>(H * (nope + dv))), kr(static_cast<size_t>(rope));
    std::vector<float> ko(static_cast<size_t>(H * dk)), vo(static_cast<size_t>(H * dv));
    for (int64_t t = 0; t < T; ++t) {
      cpu::load_f32(row_ptr(kvb, t, H * (nope + dv)), kvb.dtype, 0, H * (nope + dv), row.data());
      cpu::load_f32(row_ptr(k_rot, t, ldr), k_rot.dtype, 0, rope, kr.data());
      for (int64_t h = 0; h < H; ++h) {
        const float* src = row.data() + h * (nope + dv);
        std::copy(src, src + nope, ko.data() + h * dk);
        std::copy(kr.begin(), kr.end(), ko.data() + h * dk + nope);
        std::copy(src + nope, src + nope + dv, vo.data() + h * dv);
      }
      cpu::store_f32(ko.data(), row_ptr_mut(k, t, H * dk), k.dtype, 0, H * dk);
      cpu::store_f32(vo.data(), row_ptr_mut(v, t, H * dv), v.dtype, 0, H * dv);
    }
  }

  void argmax_rows(const TensorView& logits, const std::vector<int64_t>& suppress,
                   const TensorView& out) const override {
    const ArgmaxDims dims = check_argmax_rows(logits, suppress, out);
    const int64_t R = dims.R, V = dims.V;
    MOEKIT_CHECK(logits.device.is_cpu() && out.device.is_cpu(), "argmax_rows: operands must be on the CPU, got ",
                 logits.to_string(), " and ", out.to_string());
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < R; ++r) {
      const float* p = logits.ptr<float>() + r * V;
      int64_t best = 0, finite = 1;
      float bv = kNegInf;
      for (int64_t i = 0; i < V; ++i) {
        float x = p[i];
        if (!std::isfinite(x)) finite = 0;
        if (std::find(suppress.begin(), suppress.end(), i) != suppress.end()) x = kNegInf;
        if (x > bv) bv = x, best = i;
      }
      out.ptr<int64_t>()[2 * r] = best;
      out.ptr<int64_t>()[2 * r + 1] = finite;
    }
  }

  std::unique_ptr<StepGraph> capture(const std::function<void()>&) const override {
    MOEKIT_FAIL(not_supported, "graphs of layer ops need a CUDA device; the CPU runs ops as they come");
  }

 private:
  static int64_t host_position(const Position& p) {
    MOEKIT_CHECK(p.device == nullptr, "a position in device memory needs a CUDA device; the CPU ops take it by value");
    return p.value;
  }
};

// Indices of the k largest values (ties: lower index first), largest first.
void top_k_desc(const float* v, int64_t n, int64_t k, std::vector<int32_t>& order) {
  order.resize(size_t(n));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  order.resize(size_t(k));
}

void CpuOps::route(const TensorView& logits, const TensorView& correction_bias, const RouterSpec& spec,
                   const TensorView& index, const TensorView& weights) const {
  MOEKIT_CHECK(logits.device.is_cpu(), "router logits must be on the CPU, got ", logits.to_string());
  const RouteDims dims = check_route(logits, correction_bias, spec, index, weights);
  const int64_t T = dims.T, E = dims.E, K = dims.K;
  const float* bias = correction_bias.data ? correction_bias.ptr<float>() : nullptr;
  const float* lg = logits.ptr<float>();
  int32_t* out_idx = index.ptr<int32_t>();
  float* out_w = weights.ptr<float>();
#pragma omp parallel if (T * E > kParallelElements)
  {
    std::vector<float> p(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
    std::vector<float> gscore(static_cast<size_t>(spec.n_group));
    std::vector<int32_t> order, gorder;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* l = lg + t * E;
      int32_t* oi = out_idx + t * K;
      float* ow = out_w + t * K;
      switch (spec.kind) {
        case RouterKind::softmax_topk: {
          const float mx = *std::max_element(l, l + E);
          float sum = 0;
          for (int64_t e = 0; e < E; ++e) sum += (p[size_t(e)] = std::exp(l[e] - mx));
          for (auto& x : p) x /= sum;
          top_k_desc(p.data(), E, K, order);
          float s = 0;
          for (int64_t j = 0; j < K; ++j) s += p[size_t(order[size_t(j)])];
          for (int64_t j = 0; j < K; ++j) {
            oi[j] = order[size_t(j)];
            ow[j] = spec.norm_topk_prob ? p[size_t(order[size_t(j)])] / s : p[size_t(order[size_t(j)])];
          }
          break;
        }
        case RouterKind::topk_softmax: {
          top_k_desc(l, E, K, order);
          const float mx = l[order[0]];
          float sum = 0;
          for (int64_t j = 0; j < K; ++j) sum += (ow[j] = std::exp(l[order[size_t(j)]] - mx));
          for (int64_t j = 0; j < K; ++j) {
            oi[j] = order[size_t(j)];
            ow[j] /= sum;
          }
          break;
        }
        case RouterKind::grouped_sigmoid: {
          const int64_t G = spec.n_group, per = E / G;
          for (int64_t e = 0; e < E; ++e) {
            p[size_t(e)] = act::sigmoid(l[e]);
            choice[size_t(e)] = p[size_t(e)] + (bias ? bias[e] : 0.0f);
          }
          // A group's score: the sum of its two best choice scores.
          for (int64_t g = 0; g < G; ++g) {
            top_k_desc(choice.data() + g * per, per, std::min<int64_t>(2, per), gorder);
            float s = 0;
            for (int32_t i : gorder) s += choice[size_t(g * per + i)];
            gscore[size_t(g)] = s;
          }
          top_k_desc(gscore.data(), G, spec.topk_group, gorder);
          std::vector<bool> keep(static_cast<size_t>(G), false);
          for (int32_t g : gorder) keep[size_t(g)] = true;
          for (int64_t e = 0; e < E; ++e)
            if (!keep[size_t(e / per)]) choice[size_t(e)] = -std::numeric_limits<float>::infinity();
          top_k_desc(choice.data(), E, K, order);
          float s = 0;
          for (int64_t j = 0; j < K; ++j) s += p[size_t(order[size_t(j)])];
          for (int64_t j = 0; j < K; ++j) {
            oi[j] = order[size_t(j)];
            float wv = p[size_t(order[size_t(j)])];
            if (spec.norm_topk_prob) wv /= (s + 1e-20f);
            ow[j] = wv * spec.routed_scaling_factor;
          }
          break;
        }
      }
    }
  }
}

}  // namespace

const DeviceOps* cpu_ops() {
  static const CpuOps ops;
  return &ops;
}

}  // namespace moekit::model

#include "backends/cpu/common.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <new>

#include "backends/backends.h"
#include "base/convert.h"
#include "base/env.h"
#include "base/parallel.h"
#include "backends/gate.h"

namespace moekit::cpu {

namespace {
// round_row with a bf16 loop the compiler vectorises (no branch per element; the same bits as f32_to_bf16).
void round_in_place(float* x, int64_t n, DType t) {
  if (t != DType::bf16) {
    round_row(x, n, t);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    __builtin_memcpy(&b, x + i, 4);
    const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u, quiet = (b | 0x00400000u) & 0xffff0000u;
    const uint32_t r = (b & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
    __builtin_memcpy(x + i, &r, 4);
  }
}

// x[0, n) += bias[e, n0 : n0 + n]
void add_bias(float* x, const Tensor& bias, int64_t e, int64_t n0, int64_t n) {
  const int64_t off = e * bias.size(1) + n0;
  switch (bias.dtype()) {
    case DType::f32: {
      const float* b = bias.ptr<float>() + off;
      for (int64_t i = 0; i < n; ++i) x[i] += b[i];
      return;
    }
    case DType::bf16: {
      const uint16_t* b = bias.ptr<uint16_t>() + off;
      for (int64_t i = 0; i < n; ++i) x[i] += bf16_to_f32(b[i]);
      return;
    }
    case DType::f16: {
      const uint16_t* b = bias.ptr<uint16_t>() + off;
      for (int64_t i = 0; i < n; ++i) x[i] += half_to_float(b[i]);
      return;
    }
    default:
      for (int64_t i = 0; i < n; ++i) x[i] += float(load_as_f64(bias.data(), bias.dtype(), off + i));
  }
}

}  // namespace

// ---- plan ----

namespace {
// ue8m0 block scales as f32, once per module (state "cpu_fp8_scales").
struct Fp8Scales : BackendState {
  std::vector<float> s1, s2;
};
}  // namespace

Plan make_plan(const Experts& experts, const ExpertsCall& call) {
  const ExpertsSpec& s = experts.spec();
  const ExpertsWeights& w = experts.weights();
  Plan p;
  p.spec = &s;
  p.E = s.num_experts;
  p.H = s.hidden;
  p.I = s.intermediate;
  p.N1 = s.has_gate ? 2 * s.intermediate : s.intermediate;
  p.w1 = w.first().data();
  p.w2 = w.down_proj.data();
  p.wtype = w.is_quantized() ? WType::f32 : weight_type(w.first().dtype());  // quantized: Plan::q1 / q2 instead
  p.welem = dtype_nbytes(w.first().dtype(), 1);
  MOEKIT_CHECK(w.first().device().is_cpu() && w.down_proj.device().is_cpu(), "CPU backends need CPU weights, got ",
               w.first().device().to_string());
  if (s.has_bias) {
    p.b1 = &w.first_bias();
    p.b2 = &w.down_proj_bias;
  }
  p.act = call.hidden_states.dtype;
  p.kernels = &gemm_kernels();
  if (w.is_fp4()) {
    p.fp4 = true;
    p.fp4_float_acts = w.fp4_float_activations;
    p.pow2_scales = true;  // w4a8: the activations' FP8 scales rounded up to powers of two, as the weights' are
    p.q1 = static_cast<const uint8_t*>(w.first().data());
    p.q2 = static_cast<const uint8_t*>(w.down_proj.data());
    p.u1 = w.first_scale_inv().ptr<uint8_t>();
    p.u2 = w.down_proj_scale_inv.ptr<uint8_t>();
    return p;
  }
  if (w.is_fp8()) {
    p.q1 = static_cast<const uint8_t*>(w.first().data());
    p.q2 = static_cast<const uint8_t*>(w.down_proj.data());
    p.sper1 = w.first_scale_inv().numel() / p.E;
    p.sper2 = w.down_proj_scale_inv.numel() / p.E;
    p.pow2_scales = w.first_scale_inv().dtype() == DType::ue8m0;
    if (p.pow2_scales) {
      const Fp8Scales& sc = experts.state<Fp8Scales>("cpu_fp8_scales", [&] {
        auto r = std::make_unique<Fp8Scales>();
        for (const Tensor* t : {&w.first_scale_inv(), &w.down_proj_scale_inv}) {
          std::vector<float>& dst = t == &w.down_proj_scale_inv ? r->s2 : r->s1;
          dst.resize(size_t(t->numel()));
          for (int64_t i = 0; i < t->numel(); ++i) dst[size_t(i)] = ue8m0_to_f32(t->ptr<uint8_t>()[i]);
        }
        return r;
      });
      p.s1 = sc.s1.data();
      p.s2 = sc.s2.data();
    } else {
      p.s1 = w.first_scale_inv().ptr<float>();
      p.s2 = w.down_proj_scale_inv.ptr<float>();
    }
    return p;
  }
  if (p.act == DType::bf16 && p.wtype == WType::bf16 && p.kernels->gemm_bf16_tile) {
    prepare(experts);
    p.packed = &experts.state<PackedExperts>("cpu_packed", [] { return std::make_unique<PackedExperts>(); });
    if (p.packed->w1.empty()) p.packed = nullptr;
  }
  return p;
}

void prepare(const Experts& experts) {
  const ExpertsWeights& w = experts.weights();
  if (!experts.device().is_cpu() || w.first().dtype() != DType::bf16 || w.down_proj.dtype() != DType::bf16 ||
      !isa_supported(Isa::avx512bf16))
    return;
  experts.state<PackedExperts>("cpu_packed", [&] {
    const ExpertsSpec& s = experts.spec();
    auto packed = std::make_unique<PackedExperts>();
    const int64_t E = s.num_experts, H = s.hidden, I = s.intermediate, N1 = s.has_gate ? 2 * I : I;
    packed->kp1 = packed_bf16_k(H);
    packed->kp2 = packed_bf16_k(I);
    packed->per1 = packed_bf16_elems(N1, H);
    packed->per2 = packed_bf16_elems(H, I);
    packed->w1.resize(size_t(E * packed->per1));
    packed->w2.resize(size_t(E * packed->per2));
    const auto* w1 = static_cast<const uint16_t*>(w.first().data());
    const auto* w2 = static_cast<const uint16_t*>(w.down_proj.data());
    parallel_for(2 * E, 1, 2 * E * N1 * H, [&](int64_t t) {
      const int64_t e = t / 2;
      if (t % 2 == 0)
        pack_bf16({w1 + e * N1 * H, WType::bf16, N1, H, s.is_transposed}, packed->w1.data() + e * packed->per1);
      else
        pack_bf16({w2 + e * H * I, WType::bf16, H, I, s.is_transposed}, packed->w2.data() + e * packed->per2);
    });
    return packed;
  });
}

void* huge_page_alloc(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  static const bool huge = env_int("MOEKIT_CPU_HUGEPAGES", 1) != 0;
  if (bytes < kHuge || !huge) {
    void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
    MOEKIT_CHECK_CODE(p != nullptr, runtime, "out of host memory allocating ", bytes, " bytes");
    return p;
  }
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, rounded);
  MOEKIT_CHECK_CODE(p != nullptr, runtime, "out of host memory allocating ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
  madvise(p, rounded, MADV_HUGEPAGE);  // advice only: without THP the pages stay plain
#endif
  return p;
}

void huge_page_free(void* p) noexcept { std::free(p); }

// ---- scratch ----

namespace {
constexpr size_t kScratchMinBytes = size_t(1) << 20;
constexpr size_t kScratchAlign = 64;
struct ScratchPool {
  std::mutex mutex;
  std::vector<std::pair<size_t, void*>> blocks;  // (bytes, block)
  size_t bytes = 0;
};
ScratchPool& scratch_pool() {
  static ScratchPool* pool = new ScratchPool;  // never destroyed: buffers may be released during exit
  return *pool;
}
// MOEKIT_CPU_SCRATCH_HUGE=0: pooled scratch (1 MiB and more) in plain pages (measurement switch).
const bool g_scratch_huge = env_int("MOEKIT_CPU_SCRATCH_HUGE", 1) != 0;
// Frees a pooled-size block (kScratchMinBytes and more) as it was allocated.
void scratch_release(void* p) {
  if (g_scratch_huge) huge_page_free(p);
  else ::operator delete(p, std::align_val_t(kScratchAlign));
}
}  // namespace

void* scratch_alloc(size_t& bytes) {
  if (bytes >= kScratchMinBytes) {
    ScratchPool& pool = scratch_pool();
    std::lock_guard<std::mutex> lock(pool.mutex);
    size_t best = pool.blocks.size();
    for (size_t i = 0; i < pool.blocks.size(); ++i)
      if (pool.blocks[i].first >= bytes && pool.blocks[i].first / 2 <= bytes &&
          (best == pool.blocks.size() || pool.blocks[best].first > pool.blocks[i].first))
        best = i;
    if (best < pool.blocks.size()) {
      void* p = pool.blocks[best].second;
      bytes = pool.blocks[best].first;
      pool.bytes -= pool.blocks[best].first;
      pool.blocks.erase(pool.blocks.begin() + std::ptrdiff_t(best));
      return p;
    }
    // Pooled sizes in huge pages where the host allows them: the GEMMs write their f32 rows with strides of
    // kilobytes, one page per row on plain pages.
    if (g_scratch_huge) return huge_page_alloc(bytes);
  }
  return ::operator new(std::max<size_t>(bytes, 1), std::align_val_t(kScratchAlign));
}

void ScratchDeleter::operator()(void* p) const {
  if (!p) return;
  if (bytes >= kScratchMinBytes) {
    ScratchPool& pool = scratch_pool();
    std::lock_guard<std::mutex> lock(pool.mutex);
    // Make room by dropping the oldest blocks; a block larger than the whole pool is not kept.
    while (!pool.blocks.empty() && pool.bytes + bytes > kScratchPoolBytes) {
      scratch_release(pool.blocks.front().second);
      pool.bytes -= pool.blocks.front().first;
      pool.blocks.erase(pool.blocks.begin());
    }
    if (pool.bytes + bytes <= kScratchPoolBytes) {
      pool.blocks.emplace_back(bytes, p);
      pool.bytes += bytes;
      return;
    }
    scratch_release(p);
    return;
  }
  ::operator delete(p, std::align_val_t(kScratchAlign));
}

Bf16Buffer bf16_rows(const float* src, int64_t lds, int64_t rows, int64_t k, int64_t kp) {
  size_t bytes = size_t(std::max<int64_t>(rows * kp, 1)) * sizeof(uint16_t);
  Bf16Buffer out(static_cast<uint16_t*>(scratch_alloc(bytes)), ScratchDeleter{bytes});
  parallel_for(rows, 16, rows * k, [&](int64_t i) { rows_to_bf16(src + i * lds, lds, 1, k, out.get() + i * kp, kp); });
  return out;
}

Bf16Buffer gather_bf16_rows(const Plan& p, const ExpertsCall& call, const int64_t* row_pairs, int64_t rows,
                            int64_t ld) {
  MOEKIT_CHECK(call.hidden_states.dtype == DType::bf16, "gather_bf16_rows takes bf16 hidden states, got ",
               dtype_name(call.hidden_states.dtype));
  const int64_t K = call.top_k(), H = p.H;
  size_t bytes = size_t(std::max<int64_t>(rows * ld, 1)) * sizeof(uint16_t);
  Bf16Buffer out(static_cast<uint16_t*>(scratch_alloc(bytes)), ScratchDeleter{bytes});
  const auto* src = static_cast<const uint16_t*>(call.hidden_states.data);
  parallel_for(rows, 16, rows * H, [&](int64_t i) {
    const int64_t t = row_pairs ? row_pairs[i] / K : i;
    uint16_t* d = out.get() + i * ld;
    std::copy(src + t * H, src + t * H + H, d);
    std::fill(d + H, d + ld, uint16_t(0));
  });
  return out;
}

Bf16Buffer gated_bf16_rows(const Plan& p, float* h, int64_t rows, const int64_t* row_expert, int64_t ld) {
  MOEKIT_CHECK(p.act == DType::bf16, "gated_bf16_rows takes bf16 activations, got ", dtype_name(p.act));
  const int64_t I = p.I, N1 = p.N1;
  size_t bytes = size_t(std::max<int64_t>(rows * ld, 1)) * sizeof(uint16_t);
  Bf16Buffer out(static_cast<uint16_t*>(scratch_alloc(bytes)), ScratchDeleter{bytes});
  // The common case (SiLU times up over [gate | up], no bias) in AVX-512, where the ISA has the bf16 tile.
  const ExpertsSpec& s = *p.spec;
  const bool fast = p.kernels->gemm_bf16_tile && !p.b1 && s.has_gate && s.is_concatenated &&
                    s.gate == GateKind::act_mul && s.activation == Activation::silu;
  parallel_for(rows, 8, rows * N1 * kGateCost, [&](int64_t i) {
    float* row = h + i * N1;
    uint16_t* d = out.get() + i * ld;
    if (fast) {
      silu_mul_bf16_row_avx512(row, I, d);
      std::fill(d + I, d + ld, uint16_t(0));
      return;
    }
    first_epilogue_row(p, row_expert[i], row);
    for (int64_t j = 0; j < I; ++j) {  // the values are bf16 already: keep the top half (NaN made quiet)
      uint32_t b;
      __builtin_memcpy(&b, row + j, 4);
      d[j] = uint16_t((b & 0x7fffffffu) > 0x7f800000u ? (b >> 16) | 0x40u : b >> 16);
    }
    std::fill(d + I, d + ld, uint16_t(0));
  });
  return out;
}

void for_each_token_chunk(const ExpertsCall& call, int64_t floats_per_pair,
                          const std::function<void(const ExpertsCall&)>& fn) {
  // 1 GiB of f32 per chunk: every chunk reads all the weights it routes to once more, so a chunk must hold the
  // prefill sizes whole (deepseek-v3 at 2048 tokens: 0.74 GB; 256 MiB chunks made it three passes over 22.5 GB).
  constexpr int64_t kChunkBytes = int64_t(1) << 30;
  const int64_t T = call.tokens(), K = std::max<int64_t>(1, call.top_k());
  const int64_t per_token = std::max<int64_t>(1, K * floats_per_pair * 4);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / per_token);
  if (T <= chunk) {
    fn(call);
    return;
  }
  const int64_t H = call.hidden_states.shape[1];
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    auto rows = [&](const TensorView& v, int64_t width) {
      TensorView r = v;
      r.data = static_cast<uint8_t*>(v.data) + dtype_nbytes(v.dtype, t0 * width);
      r.shape = {n, width};
      r.strides.clear();
      return r;
    };
    ExpertsCall c{rows(call.hidden_states, H), rows(call.top_k_index, K), rows(call.top_k_weights, K),
                  rows(call.out, H), call.stream};
    fn(c);
  }
}

Fp8Rows fp8_rows(const Plan& p, const float* src, int64_t lds, int64_t rows, int64_t k) {
  Fp8Rows r;
  r.ld = fp8_row_k(k);
  r.lds = r.ld / kFp8K;
  r.q.reset(new double[size_t(std::max<int64_t>(rows * r.ld, 1))]);
  r.s.reset(new float[size_t(std::max<int64_t>(rows * r.lds, 1))]);
  parallel_for(rows, 8, rows * k * 4, [&](int64_t i) {
    if (p.fp4 && p.fp4_float_acts)
      plain_rows(src + i * lds, lds, 1, k, r.q.get() + i * r.ld, r.ld, r.s.get() + i * r.lds, r.lds);
    else
      fp8_quantize_rows(src + i * lds, lds, 1, k, p.pow2_scales, r.q.get() + i * r.ld, r.ld, r.s.get() + i * r.lds,
                        r.lds);
  });
  return r;
}

void quant_tile(const Plan& p, bool down, int64_t e, const Fp8Rows& a, int64_t r0, int64_t m, int64_t n0, int64_t n1,
                float* c, int64_t ldc, float* work) {
  const double* q = a.q.get() + r0 * a.ld;
  const float* s = a.s.get() + r0 * a.lds;
  double* wk = reinterpret_cast<double*>(work);
  if (p.fp4)
    p.kernels->gemm_fp4_tile(q, a.ld, s, a.lds, m, down ? p.down_fp4(e) : p.first_fp4(e), n0, n1, c, ldc, wk);
  else if (down && m <= kFp8F32MaxRows && p.kernels->gemm_fp8_f32_tile)  // output not quantized again: f32 sums
    p.kernels->gemm_fp8_f32_tile(q, a.ld, s, a.lds, m, p.down_fp8(e), n0, n1, c, ldc, wk);
  else
    p.kernels->gemm_fp8_tile(q, a.ld, s, a.lds, m, down ? p.down_fp8(e) : p.first_fp8(e), n0, n1, c, ldc, wk);
}

void quant_gemm(const Plan& p, bool down, int64_t e, const Fp8Rows& a, int64_t r0, int64_t m, float* c, int64_t ldc) {
  const int64_t n = down ? p.H : p.N1, k = down ? p.I : p.H;
  if (m <= 0) return;
  const int64_t tiles = (n + kFp8TileN - 1) / kFp8TileN;
  parallel_tasks(tiles, fp8_work_floats(k), m * n * k, [&](int64_t t, float* work) {
    const int64_t n0 = t * kFp8TileN;
    quant_tile(p, down, e, a, r0, m, n0, std::min(n, n0 + kFp8TileN), c, ldc, work);
  });
}

FloatBuffer make_buffer(int64_t n) {
  size_t bytes = size_t(std::max<int64_t>(n, 1)) * sizeof(float);
  return FloatBuffer(static_cast<float*>(scratch_alloc(bytes)), ScratchDeleter{bytes});
}

// ---- rows ----

void gather_rows(const Plan& p, const ExpertsCall& call, const int64_t* row_pairs, int64_t rows, float* dst) {
  const int64_t K = call.top_k(), H = p.H;
  parallel_for(rows, 16, rows * H, [&](int64_t i) {
    const int64_t t = row_pairs ? row_pairs[i] / K : i;
    load_f32(call.hidden_states.data, call.hidden_states.dtype, t * H, H, dst + i * H);
  });
}

namespace {
// The gate in a low-precision activation dtype, rounding after each operation torch runs in that dtype (the
// activation function itself computes in f32 and rounds once, as torch's kernels do). In place: out[i] is written
// after gate and up of index i were read, and they sit at or after i.
void gate_row_rounded(const ExpertsSpec& s, DType t, float* h) {
  const int64_t I = s.intermediate;
  auto r = [t](float v) { return round_to(v, t); };
  if (!s.has_gate) {
    for (int64_t i = 0; i < I; ++i) h[i] = r(activate(s.activation, h[i]));
    return;
  }
  const int64_t gs = s.is_concatenated ? 1 : 2, uo = s.is_concatenated ? I : 1;
  switch (s.gate) {
    case GateKind::act_mul:  // act(gate) * up
      for (int64_t i = 0; i < I; ++i) {
        const float g = h[i * gs], u = h[i * gs + uo];
        h[i] = r(r(activate(s.activation, g)) * u);
      }
      return;
    case GateKind::clamped_swiglu: {  // gpt-oss: (clamp(up) + 1) * (g * sigmoid(g * alpha)), g = min(gate, limit)
      for (int64_t i = 0; i < I; ++i) {
        float g = h[i * gs], u = h[i * gs + uo];
        g = g < s.limit ? g : s.limit;  // NaN propagates, as in torch.clamp
        u = u < -s.limit ? -s.limit : (u > s.limit ? s.limit : u);
        const float sig = r(1.0f / (1.0f + std::exp(-r(g * s.alpha))));
        h[i] = r(r(u + 1.0f) * r(g * sig));
      }
      return;
    }
    case GateKind::custom:
      apply_gate_row<float>(s, h, h);
      round_row(h, I, t);
      return;
  }
}
}  // namespace

void first_epilogue_row(const Plan& p, int64_t e, float* h) {
  if (p.act == DType::f32) {
    if (p.b1) add_bias(h, *p.b1, e, 0, p.N1);
    apply_gate_row<float>(*p.spec, h, h);  // reads gate/up at or after the position it writes
    return;
  }
  round_in_place(h, p.N1, p.act);  // the product, then the bias added to it, each in the activation dtype
  if (p.b1) {
    add_bias(h, *p.b1, e, 0, p.N1);
    round_in_place(h, p.N1, p.act);
  }
  gate_row_rounded(*p.spec, p.act, h);
}

void down_epilogue(const Plan& p, int64_t e, float* y, int64_t ldy, int64_t rows, int64_t n0, int64_t n1) {
  // bf16 where the ISA has the bf16 tile: the same rounding in AVX-512 (the rows were just written: a pass in cache)
  const bool vec = p.act == DType::bf16 && p.kernels->gemm_bf16_tile;
  auto round = [&](float* row) {
    if (vec) round_bf16_in_place_avx512(row, n1 - n0);
    else round_in_place(row, n1 - n0, p.act);
  };
  for (int64_t r = 0; r < rows; ++r) {
    float* row = y + r * ldy + n0;
    round(row);
    if (p.b2) {
      add_bias(row, *p.b2, e, n0, n1 - n0);
      round(row);
    }
  }
}

// MOEKIT_CPU_COMBINE_PREFETCH=0: combine without prefetching the next slot's row (measurement switch).
static const bool g_combine_prefetch = env_int("MOEKIT_CPU_COMBINE_PREFETCH", 1) != 0;

void combine(const Plan& p, const ExpertsCall& call, const float* y, int64_t ldy, const int64_t* row_of_pair) {
  const int64_t T = call.tokens(), K = call.top_k(), H = p.H;
  const TensorView& wv = call.top_k_weights;
  // torch multiplies y (activation dtype) by the routing weight in the promoted dtype: the activation dtype
  // itself when both match (bf16 x bf16), f32 otherwise.
  const bool round_products = p.act != DType::f32 && wv.dtype == p.act;
  parallel_tasks((T + 7) / 8, H, T * K * H, [&](int64_t task, float* acc) {
    const int64_t t_end = std::min(T, task * 8 + 8);
    for (int64_t t = task * 8; t < t_end; ++t) {
      std::fill(acc, acc + H, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t row = row_of_pair[t * K + k];
        if (row < 0) continue;  // expert on another rank
        if (g_combine_prefetch) {  // the next slot's row (rows sit apart, in expert order): its lines into L2
          const int64_t nk = t * K + k + 1, next = nk < t_end * K ? row_of_pair[nk] : -1;
          if (next >= 0) {
            const char* q = reinterpret_cast<const char*>(y + next * ldy);
            for (int64_t b = 0; b < H * int64_t(sizeof(float)); b += 64) __builtin_prefetch(q + b, 0, 2);
          }
        }
        float w;
        load_f32(wv.data, wv.dtype, t * K + k, 1, &w);
        const float* yr = y + row * ldy;
        if (round_products && p.act == DType::bf16 && p.kernels->gemm_bf16_tile) {
          add_bf16_products_avx512(acc, yr, w, H);
        } else if (round_products) {
          for (int64_t h = 0; h < H; ++h) acc[h] += round_to(w * yr[h], p.act);
        } else {
          for (int64_t h = 0; h < H; ++h) acc[h] += w * yr[h];
        }
      }
      store_f32(acc, call.out.data, call.out.dtype, t * H, H);
    }
  });
}

// ---- the backends' common support rule (backends.h) ----

Support supports(const Experts& experts, DType act) {
  if (!experts.device().is_cpu())
    return Support::no("the CPU backends need experts on the CPU, got " + experts.device().to_string());
  const DType w = experts.weight_dtype();
  if (experts.is_quantized()) {
    if (act != DType::f32 && act != DType::bf16 && act != DType::f16)
      return Support::no(std::string("CPU backends take f32, bf16 or f16 activations, got ") + dtype_name(act));
    return Support::yes();
  }
  if (w != DType::f32 && w != DType::bf16 && w != DType::f16)
    return Support::no(std::string("CPU backends take f32, bf16, f16 or FP8 (f8e4m3 with block scales) weights, got ") +
                       dtype_name(w));
  if (act != DType::f32 && act != DType::bf16 && act != DType::f16)
    return Support::no(std::string("CPU backends take f32, bf16 or f16 activations, got ") + dtype_name(act));
  return Support::yes();
}

}  // namespace moekit::cpu

#include "moekit/quant.h"

#include <algorithm>
#include <cmath>

#include "moekit/error.h"

namespace moekit {

namespace {
float scale_at(const Tensor& s, int64_t i) {
  return s.dtype() == DType::ue8m0 ? ue8m0_to_f32(s.ptr<uint8_t>()[i]) : s.ptr<float>()[i];
}

void store_as(void* dst, DType t, int64_t i, float v) {
  switch (t) {
    case DType::f32: static_cast<float*>(dst)[i] = v; return;
    case DType::bf16: static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v); return;
    case DType::f16: static_cast<uint16_t*>(dst)[i] = f32_to_f16(v); return;
    default: MOEKIT_FAIL(invalid_argument, "dequantize_fp8: output dtype must be f32, bf16 or f16, got ", dtype_name(t));
  }
}
}  // namespace

Tensor dequantize_fp8(const Tensor& w, const Tensor& scale_inv, DType out, int64_t segments, const std::string& name) {
  MOEKIT_CHECK(w.defined() && w.dtype() == DType::f8e4m3 && w.dim() >= 2, "'", name,
               "': FP8 weights must be f8e4m3 with at least 2 dimensions, got ",
               w.defined() ? w.view().to_string() : std::string("none"));
  MOEKIT_CHECK(out == DType::f32 || out == DType::bf16 || out == DType::f16, "'", name,
               "': dequantize to f32, bf16 or f16, got ", dtype_name(out));
  const Tensor q = w.to(Device::cpu()).contiguous();
  MOEKIT_CHECK(scale_inv.defined(), "'", name, "' is FP8 but has no scale_inv tensor beside it");
  const Tensor s = scale_inv.to(Device::cpu()).contiguous();
  const int64_t N = w.size(-2), K = w.size(-1);
  MOEKIT_CHECK(segments >= 1 && N % segments == 0, "'", name, "': ", N, " rows do not split into ", segments,
               " segments");
  const int64_t SN = segments * fp8_blocks(N / segments), SK = fp8_blocks(K), batch = w.numel() / std::max<int64_t>(1, N * K);
  Shape expect(w.shape().begin(), w.shape().end() - 2);
  expect.push_back(SN);
  expect.push_back(SK);
  MOEKIT_CHECK(s.dtype() == DType::f32 || s.dtype() == DType::ue8m0, "'", name,
               "_scale_inv' must be f32 or ue8m0 (F8_E8M0), got ", dtype_name(s.dtype()));
  MOEKIT_CHECK(s.shape() == expect, "'", name, "_scale_inv' has shape ", shape_to_string(s.shape()), ", expected ",
               shape_to_string(expect), " (128 x 128 blocks of ", name, " ", shape_to_string(w.shape()), ")");
  Tensor r = Tensor::empty(w.shape(), out);
  const uint8_t* qp = q.ptr<uint8_t>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t srow = (b * SN + fp8_scale_row(n, N, segments)) * SK;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = (b * N + n) * K + k;
        store_as(r.data(), out, i, f8e4m3_to_f32(qp[i]) * scale_at(s, srow + k / kFp8Block));
      }
    }
  return r;
}

std::pair<Tensor, Tensor> quantize_fp8(const Tensor& w, DType scale_dtype, int64_t segments) {
  MOEKIT_CHECK(w.defined() && w.dim() >= 2 && (w.dtype() == DType::f32 || w.dtype() == DType::bf16 ||
                                               w.dtype() == DType::f16),
               "quantize_fp8: expected a float weight with at least 2 dimensions, got ",
               w.defined() ? w.view().to_string() : std::string("none"));
  MOEKIT_CHECK(scale_dtype == DType::f32 || scale_dtype == DType::ue8m0, "quantize_fp8: scales are f32 or ue8m0, got ",
               dtype_name(scale_dtype));
  const Tensor src = w.to(Device::cpu()).contiguous().to(DType::f32);
  const int64_t N = w.size(-2), K = w.size(-1);
  MOEKIT_CHECK(segments >= 1 && N % segments == 0, "quantize_fp8: ", N, " rows do not split into ", segments,
               " segments");
  const int64_t seg = N / segments, SN = segments * fp8_blocks(seg), SK = fp8_blocks(K),
                batch = w.numel() / std::max<int64_t>(1, N * K);
  Shape sshape(w.shape().begin(), w.shape().end() - 2);
  sshape.push_back(SN);
  sshape.push_back(SK);
  Tensor q = Tensor::empty(w.shape(), DType::f8e4m3), s = Tensor::empty(sshape, scale_dtype);
  const float* x = src.ptr<float>();
  uint8_t* qp = q.ptr<uint8_t>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t sg = 0; sg < segments; ++sg)
      for (int64_t bn = 0; bn < fp8_blocks(seg); ++bn)
        for (int64_t bk = 0; bk < SK; ++bk) {
          const int64_t n0 = sg * seg + bn * kFp8Block, n1 = std::min(sg * seg + seg, n0 + kFp8Block);
          const int64_t k0 = bk * kFp8Block, k1 = std::min(K, k0 + kFp8Block);
          float amax = 0.0f;
          for (int64_t n = n0; n < n1; ++n)
            for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(x[(b * N + n) * K + k]));
          // transformers: scales = 448 / amax (1 where amax is 0); scale_inv = 1 / scales; the weight times scales.
          const float fwd = amax > 0.0f ? kFp8Max / amax : 1.0f;
          float inv = 1.0f / fwd, mul = fwd;
          const int64_t si = (b * SN + sg * fp8_blocks(seg) + bn) * SK + bk;
          if (scale_dtype == DType::ue8m0) {
            const uint8_t code = f32_to_ue8m0(inv);
            inv = ue8m0_to_f32(code);
            mul = 1.0f / inv;
            s.ptr<uint8_t>()[si] = code;
          } else {
            s.ptr<float>()[si] = inv;
          }
          for (int64_t n = n0; n < n1; ++n)
            for (int64_t k = k0; k < k1; ++k) {
              const int64_t i = (b * N + n) * K + k;
              qp[i] = f32_to_f8e4m3(x[i] * mul);
            }
        }
  return {q, s};
}

Tensor dequantize_fp4(const Tensor& w, const Tensor& scales, DType out, const std::string& name) {
  MOEKIT_CHECK(w.defined() && w.dtype() == DType::f4e2m1 && w.dim() >= 2, "'", name,
               "': FP4 weights must be f4e2m1 with at least 2 dimensions, got ",
               w.defined() ? w.view().to_string() : std::string("none"));
  MOEKIT_CHECK(out == DType::f32 || out == DType::bf16 || out == DType::f16, "'", name,
               "': dequantize to f32, bf16 or f16, got ", dtype_name(out));
  const int64_t K = w.size(-1);
  MOEKIT_CHECK(K % kFp4Group == 0, "'", name, "': FP4 weights need a multiple of 32 inputs, got ", K);
  Shape expect = w.shape();
  expect.back() = K / kFp4Group;
  MOEKIT_CHECK(scales.defined() && scales.dtype() == DType::ue8m0 && scales.shape() == expect, "'", name,
               "' scales must be ue8m0 ", shape_to_string(expect), ", got ",
               scales.defined() ? scales.view().to_string() : std::string("none"));
  const Tensor q = w.to(Device::cpu()).contiguous(), s = scales.to(Device::cpu()).contiguous();
  Tensor r = Tensor::empty(w.shape(), out);
  const uint8_t* qp = q.ptr<uint8_t>();
  const uint8_t* sp = s.ptr<uint8_t>();
  const int64_t n = w.numel();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t nib = (i & 1) ? uint8_t(qp[i / 2] >> 4) : uint8_t(qp[i / 2] & 0xf);
    store_as(r.data(), out, i, f4e2m1_to_f32(nib) * ue8m0_to_f32(sp[i / kFp4Group]));
  }
  return r;
}

std::pair<Tensor, Tensor> quantize_fp4(const Tensor& w) {
  MOEKIT_CHECK(w.defined() && w.dim() >= 2 && (w.dtype() == DType::f32 || w.dtype() == DType::bf16 ||
                                               w.dtype() == DType::f16),
               "quantize_fp4: expected a float weight with at least 2 dimensions, got ",
               w.defined() ? w.view().to_string() : std::string("none"));
  const int64_t K = w.size(-1);
  MOEKIT_CHECK(K % kFp4Group == 0, "quantize_fp4: the last dimension must be a multiple of 32, got ", K);
  const Tensor src = w.to(Device::cpu()).contiguous().to(DType::f32);
  Shape sshape = w.shape();
  sshape.back() = K / kFp4Group;
  Tensor q = Tensor::zeros(w.shape(), DType::f4e2m1), s = Tensor::empty(sshape, DType::ue8m0);
  const float* x = src.ptr<float>();
  uint8_t* qp = q.ptr<uint8_t>();
  const int64_t groups = w.numel() / kFp4Group;
  for (int64_t g = 0; g < groups; ++g) {
    float amax = 0.0f;
    for (int64_t i = g * kFp4Group; i < (g + 1) * kFp4Group; ++i) amax = std::max(amax, std::fabs(x[i]));
    int e = 127;
    if (amax > 0.0f) {
      int ex;
      std::frexp(amax, &ex);              // amax = f * 2^ex, f in [0.5, 1): floor(log2 amax) = ex - 1
      e = std::clamp(ex - 1 - 2 + 127, 0, 254);
    }
    s.ptr<uint8_t>()[g] = uint8_t(e);
    const float inv = 1.0f / ue8m0_to_f32(uint8_t(e));
    for (int64_t i = g * kFp4Group; i < (g + 1) * kFp4Group; ++i) {
      const uint8_t c = f32_to_f4e2m1(x[i] * inv);
      qp[i / 2] = uint8_t(qp[i / 2] | ((i & 1) ? c << 4 : c));
    }
  }
  return {q, s};
}

void quantize_activations_fp8(const float* x, int64_t k, bool pow2_scales, float* q, float* scale) {
  for (int64_t g = 0; g * kFp8Block < k; ++g) {
    const int64_t k0 = g * kFp8Block, k1 = std::min(k, k0 + kFp8Block);
    float amax = 0.0f;
    for (int64_t i = k0; i < k1; ++i) amax = std::max(amax, std::fabs(x[i]));
    float s = amax / kFp8Max;
    if (pow2_scales && s > 0.0f) s = ue8m0_to_f32(f32_to_ue8m0(s));
    scale[g] = s;
    for (int64_t i = k0; i < k1; ++i) q[i] = s > 0.0f ? f8e4m3_to_f32(f32_to_f8e4m3(x[i] / s)) : 0.0f;
  }
}

}  // namespace moekit

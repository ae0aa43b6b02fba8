// Device dispatch of the layer ops, view helpers and rotary frequency tables.
#include "model/ops.h"

#include <algorithm>
#include <cmath>

#include "moekit/error.h"

namespace moekit::model {

#ifndef MOEKIT_WITH_CUDA
const DeviceOps* cuda_ops() { return nullptr; }
#endif

namespace {
thread_local Stream t_stream = nullptr;
}
Stream current_stream() { return t_stream; }
StreamScope::StreamScope(Stream s) : saved_(t_stream) { t_stream = s; }
StreamScope::~StreamScope() { t_stream = saved_; }

bool has_ops(Device device) { return device.is_cpu() ? true : cuda_ops() != nullptr; }

const DeviceOps& ops_for(Device device) {
  if (device.is_cpu()) return *cpu_ops();
  const DeviceOps* ops = cuda_ops();
  MOEKIT_CHECK_CODE(ops != nullptr, not_supported, "the model runtime has no layer ops for device ", device.to_string(),
                    " in this build; run the model on the CPU (device cpu)");
  return *ops;
}

TensorView rows(const TensorView& t, int64_t begin, int64_t count) {
  MOEKIT_CHECK(t.dim() >= 1 && begin >= 0 && count >= 0 && begin + count <= t.shape[0], "rows [", begin, ", ",
               begin + count, ") out of range for ", t.to_string());
  TensorView v = t;
  const int64_t stride0 = t.stride(0);
  v.data = static_cast<char*>(t.data) + size_t(begin * stride0) * dtype_nbytes(t.dtype, 1);
  v.shape[0] = count;
  if (!t.strides.empty()) v.strides = t.strides;
  return v;
}

TensorView columns(const TensorView& t, int64_t begin, int64_t count) {
  MOEKIT_CHECK(t.dim() == 2 && begin >= 0 && count >= 0 && begin + count <= t.shape[1], "columns [", begin, ", ",
               begin + count, ") out of range for ", t.to_string());
  MOEKIT_CHECK(t.stride(1) == 1, "columns: the innermost stride must be 1, got ", t.stride(1));
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + size_t(begin) * dtype_nbytes(t.dtype, 1);
  v.strides = {t.stride(0), 1};
  v.shape = {t.shape[0], count};
  return v;
}

TensorView reshaped(const TensorView& t, const Shape& shape) {
  MOEKIT_CHECK(t.is_contiguous(), "reshaped: needs a contiguous view, got ", t.to_string());
  TensorView v = t;
  v.shape = shape;
  v.strides.clear();
  MOEKIT_CHECK(v.numel() == t.numel(), "cannot view ", shape_to_string(t.shape), " as ", shape_to_string(shape));
  return v;
}

RopeSpec make_rope(const RopeConfig& rc, int64_t head_dim, int64_t max_position_embeddings) {
  RopeSpec r;
  const int64_t dim = int64_t(double(head_dim) * rc.partial_rotary_factor);
  MOEKIT_CHECK(dim > 0 && dim % 2 == 0 && dim <= head_dim, "rotary dimension ", dim, " (head_dim ", head_dim,
               " x partial_rotary_factor ", rc.partial_rotary_factor, ") must be even and in (0, head_dim]");
  const int64_t half = dim / 2;
  const double base = rc.theta;
  // transformers computes the exponents and powers in float32.
  std::vector<float> pos_freqs(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float e = float(2 * i) / float(dim);
    pos_freqs[size_t(i)] = std::pow(float(base), e);
  }
  r.inv_freq.resize(size_t(half));
  for (int64_t i = 0; i < half; ++i) r.inv_freq[size_t(i)] = 1.0f / pos_freqs[size_t(i)];

  if (rc.type == "default") return r;
  if (rc.type == "linear") {
    for (auto& f : r.inv_freq) f = float(f / rc.factor);
    return r;
  }
  if (rc.type == "yarn") {
    const double factor = rc.factor;
    auto get_mscale = [](double scale, double mscale) {
      return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
    };
    double attention_factor;
    if (rc.attention_factor)
      attention_factor = *rc.attention_factor;
    else if (rc.mscale && rc.mscale_all_dim && *rc.mscale != 0 && *rc.mscale_all_dim != 0)
      attention_factor = get_mscale(factor, *rc.mscale) / get_mscale(factor, *rc.mscale_all_dim);
    else
      attention_factor = get_mscale(factor, 1.0);
    const double orig =
        double(rc.original_max_position_embeddings > 0 ? rc.original_max_position_embeddings : max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return (double(dim) * std::log(orig / (rotations * 2 * M_PI))) / (2 * std::log(base));
    };
    double low = correction_dim(rc.beta_fast), high = correction_dim(rc.beta_slow);
    if (rc.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, double(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < half; ++i) {
      const float ramp = std::clamp(float((float(i) - float(low)) / float(high - low)), 0.0f, 1.0f);
      const float extrapolation_factor = 1.0f - ramp;
      const float extra = 1.0f / pos_freqs[size_t(i)];
      const float inter = 1.0f / (float(factor) * pos_freqs[size_t(i)]);
      r.inv_freq[size_t(i)] = inter * (1.0f - extrapolation_factor) + extra * extrapolation_factor;
    }
    r.attention_scaling = float(attention_factor);
    return r;
  }
  if (rc.type == "llama3") {
    const double factor = rc.factor, lo = rc.low_freq_factor, hi = rc.high_freq_factor;
    const double old_ctx =
        double(rc.original_max_position_embeddings > 0 ? rc.original_max_position_embeddings : max_position_embeddings);
    const double low_wavelen = old_ctx / lo, high_wavelen = old_ctx / hi;
    for (auto& f : r.inv_freq) {
      const double wavelen = 2 * M_PI / double(f);
      double v = wavelen > low_wavelen ? double(f) / factor : double(f);
      const double smooth = (old_ctx / wavelen - lo) / (hi - lo);
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      if (medium) v = (1 - smooth) * v / factor + smooth * v;
      f = float(v);
    }
    return r;
  }
  MOEKIT_FAIL(not_supported, "rope_type '", rc.type, "' is not supported; supported: default, linear, yarn, llama3");
}

}  // namespace moekit::model

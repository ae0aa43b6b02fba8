// Checkpoint tensors -> the decoder's weights: name and shape checks, dtype conversion, experts fusion.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>

#include "io/input.h"
#include "model/model_impl.h"
#include "moekit/error.h"
#include "moekit/quant.h"

namespace moekit::model {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// Reads tensors by name, remembering every problem so that one error can list them all.
class TensorReader {
 public:
  // A dry reader checks names, shapes and dtypes against the zero-copy checkpoint tensors and converts
  // nothing: get() returns undefined tensors. The load runs dry first, so that a missing lm_head is
  // reported before gigabytes of embeddings are converted.
  TensorReader(const Checkpoint& ckpt, DType dtype, Device device, bool dry = false,
               std::optional<ExpertSlice> shard = std::nullopt)
      : ck_(ckpt), dtype_(dtype), device_(device), dry_(dry), shard_(shard) {}

  // The experts of each MoE layer this reader reads: every one, or this rank's slice (expert parallelism).
  ExpertSlice shard(int64_t num_experts) const { return shard_.value_or(ExpertSlice{0, num_experts}); }
  // Experts rows [s.start, s.end) of a stacked tensor `shape` [E, ...], converted (as get()).
  Tensor get_experts(const std::string& name, const Shape& shape, ExpertSlice s) {
    Tensor t = host(name, shape);
    if (!t.defined() || dry_) return {};
    if (s.start == 0 && s.end == shape[0]) return get(name, shape);
    Tensor out = slice_experts(t, s, Device::cpu()).to(dtype_).to(device_);
    release(name);
    return out;
  }

  // Reports each tensor read (not in a dry reader) to `fn`, out of what the dry reader `plan` read.
  void report_to(const std::function<void(const LoadProgress&)>& fn, const TensorReader& plan) {
    fn_ = fn;
    progress_ = LoadProgress{};
    for (const std::string& name : plan.read_) {
      ++progress_.total_tensors;
      progress_.total_bytes += ck_.get(name).nbytes();
    }
  }
  void finish() const {
    if (!fn_) return;
    LoadProgress p = progress_;
    p.tensors = p.total_tensors;
    p.bytes = p.total_bytes;
    fn_(p);
  }

  bool dry() const { return dry_; }
  // FP8 checkpoints: f8e4m3 tensors load with their `_scale_inv` (dequantized by host() and get()).
  void set_quant(const LoadQuant& q) { quant_ = q; }
  const LoadQuant& quant() const { return quant_; }
  // The name of the block scales beside an FP8 tensor: X.weight -> X.weight_scale_inv, X -> X_scale_inv.
  static std::string scale_name(const std::string& name) {
    const std::string w = ".weight";
    if (name.size() > w.size() && name.compare(name.size() - w.size(), w.size(), w) == 0)
      return name.substr(0, name.size() - w.size()) + ".weight_scale_inv";
    return name + "_scale_inv";
  }
  // Whether the checkpoint stores `name` in FP8.
  bool is_fp8(const std::string& name) const { return ck_.contains(name) && ck_.get(name).dtype() == DType::f8e4m3; }
  const std::vector<std::string>& read() const { return read_; }

  bool has(const std::string& name) const { return ck_.contains(name); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  // The tensor converted to `as` (default: the model dtype) on the model's device, or an undefined tensor
  // (problem recorded) when missing or of another shape.
  Tensor get(const std::string& name, const Shape& shape, std::optional<DType> as = std::nullopt) {
    Tensor t = host(name, shape);
    if (!t.defined() || dry_) return {};
    Tensor out = t.to(as.value_or(dtype_)).to(device_);
    if (out.data() != t.data()) release(name);  // converted: the mapped bytes are no longer needed
    return out;
  }
  // The checkpoint tensor as stored (CPU, zero-copy), after the same checks; an FP8 tensor comes dequantized to f32
  // (a new tensor) with its block scales, unless `raw`.
  Tensor host(const std::string& name, const Shape& shape, bool raw = false) {
    if (!ck_.contains(name)) {
      missing(name + " " + shape_to_string(shape));
      return {};
    }
    Tensor t = ck_.get(name);
    if (t.shape() != shape) {
      wrong(name + " is " + shape_to_string(t.shape()) + ", expected " + shape_to_string(shape));
      return {};
    }
    if (!is_floating(t.dtype()) || t.dtype() == DType::f4e2m1 || t.dtype() == DType::ue8m0) {
      wrong(name + " has dtype " + dtype_name(t.dtype()) + ", expected a floating type");
      return {};
    }
    if (dry_) read_.push_back(name);
    if (fn_ && !dry_) {
      progress_.tensors = std::min(progress_.tensors + 1, progress_.total_tensors);
      progress_.bytes = std::min(progress_.bytes + t.nbytes(), progress_.total_bytes);
      fn_(progress_);
    }
    if (t.dtype() == DType::f8e4m3) {
      if (!quant_.fp8) {
        wrong(name + " is f8e4m3 but config.json has no FP8 quantization_config");
        return {};
      }
      if (shape.size() < 2) {
        wrong(name + " is f8e4m3 but not a matrix (block-scaled FP8 holds linear layers' weights)");
        return {};
      }
      const std::string sn = scale_name(name);
      Shape expect = shape;
      expect[expect.size() - 2] = fp8_blocks(shape[shape.size() - 2]);
      expect.back() = fp8_blocks(shape.back());
      if (!raw && !scale(sn, expect).defined()) return {};
      if (raw || dry_) return t;
      Tensor d = dequantize_fp8(t, ck_.get(sn), DType::f32, 1, name);
      release(name);
      release(sn);
      return d;
    }
    return t;
  }
  // A checkpoint tensor of one of `dtypes` as stored (no conversion: packed weights and scale bytes).
  Tensor bytes(const std::string& name, const Shape& shape, std::initializer_list<DType> dtypes) {
    if (!ck_.contains(name)) {
      missing(name + " " + shape_to_string(shape));
      return {};
    }
    Tensor t = ck_.get(name);
    bool ok = false;
    for (DType d : dtypes) ok = ok || t.dtype() == d;
    if (t.shape() != shape || !ok) {
      wrong(name + " is " + dtype_name(t.dtype()) + shape_to_string(t.shape()) + ", expected " +
            dtype_name(*dtypes.begin()) + shape_to_string(shape));
      return {};
    }
    return t;
  }
  // The block scales `name` (f32 or ue8m0) of an FP8 tensor, checked against `shape`.
  Tensor scale(const std::string& name, const Shape& shape) {
    if (!ck_.contains(name)) {
      missing(name + " " + shape_to_string(shape) + " (the block scales of an f8e4m3 weight)");
      return {};
    }
    Tensor t = ck_.get(name);
    if (t.shape() != shape || (t.dtype() != DType::f32 && t.dtype() != DType::ue8m0)) {
      wrong(name + " is " + dtype_name(t.dtype()) + shape_to_string(t.shape()) + ", expected f32 or ue8m0 " +
            shape_to_string(shape) + " (128 x 128 blocks)");
      return {};
    }
    if (dry_ && t.dtype() == DType::f32) read_.push_back(name);
    return t;
  }
  // Peak memory stays near the checkpoint's size: once a tensor is copied, its mapped pages go.
  void release(const std::string& name) const {
    if (!dry_) ck_.release(name);
  }
  // The first few problems are kept as text, the rest only counted (a config may claim many tensors).
  void missing(const std::string& what) { note(missing_, missing_count_, what); }
  void wrong(const std::string& what) { note(wrong_, wrong_count_, what); }

  void throw_if_problems(const std::string& model_type) const {
    if (missing_count_ == 0 && wrong_count_ == 0) return;
    std::ostringstream os;
    os << ck_.dir() << ": checkpoint does not match model_type " << model_type << ":";
    auto list = [&](const char* what, const std::vector<std::string>& v, size_t count) {
      if (count == 0) return;
      os << " " << count << " tensor(s) " << what << ":";
      for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : " ") << v[i];
      if (count > v.size()) os << ", ... (" << count - v.size() << " more)";
      os << ".";
    };
    list("missing", missing_, missing_count_);
    list("with a wrong shape or dtype", wrong_, wrong_count_);
    MOEKIT_FAIL(not_found, os.str());
  }

 private:
  static void note(std::vector<std::string>& v, size_t& count, const std::string& what) {
    if (v.size() < 12) v.push_back(printable(what));
    ++count;
  }
  const Checkpoint& ck_;
  DType dtype_;
  Device device_;
  bool dry_ = false;
  std::optional<ExpertSlice> shard_;
  LoadQuant quant_;
  std::vector<std::string> missing_, wrong_, read_;
  std::function<void(const LoadProgress&)> fn_;
  LoadProgress progress_;
  size_t missing_count_ = 0, wrong_count_ = 0;
};

// Rows of several checkpoint tensors stacked into one new tensor of the model dtype.
// `release` (optional, one per part) drops each part's mapped pages once copied, so that stacking costs
// the output's memory and not the output's plus the inputs'.
Tensor stack_rows(const std::vector<Tensor>& parts, const Shape& shape, DType dtype, Device device,
                  const std::function<void(size_t)>& release = {}) {
  Tensor out = Tensor::empty(shape, dtype, Device::cpu());
  std::vector<int64_t> offset(parts.size() + 1, 0);
  for (size_t i = 0; i < parts.size(); ++i) offset[i + 1] = offset[i] + parts[i].numel();
  MOEKIT_ASSERT(offset.back() == out.numel());
  char* base = static_cast<char*>(out.data());
  const size_t es = dtype_nbytes(dtype, 1);
#pragma omp parallel for schedule(dynamic) if (out.numel() > (int64_t(1) << 20))
  for (int64_t i = 0; i < int64_t(parts.size()); ++i) {
    const Tensor c = parts[size_t(i)].contiguous();
    convert(c.data(), c.dtype(), base + size_t(offset[size_t(i)]) * es, dtype, c.numel());
    if (release) release(size_t(i));
  }
  return out.to(device);
}

// A checkpoint tensor [E, A, B] as [E, B, A] (transpose_expert_weight) in the model dtype on the model's
// device (undefined when missing or misshapen, as TensorReader::get).
Tensor transposed_experts(TensorReader& r, const std::string& name, const Shape& stored) {
  Tensor t = r.host(name, stored);
  if (!t.defined() || r.dry()) return {};
  const ExpertSlice s = r.shard(stored[0]);
  if (s.count() != stored[0]) t = slice_experts(t, s, Device::cpu());
  Tensor out = transpose_expert_weight(t.to(r.dtype()));
  t = Tensor();
  r.release(name);
  return out.to(r.device());
}

Linear linear(TensorReader& r, const std::string& name, int64_t out, int64_t in, bool bias) {
  Linear l;
  l.w = r.get(name + ".weight", {out, in});
  if (bias) l.b = r.get(name + ".bias", {out});
  return l;
}

// gate_proj / up_proj / down_proj of a dense MLP, gate and up stacked into one [2I, H] projection.
DenseMlp dense_mlp(TensorReader& r, const std::string& p, int64_t H, int64_t I, const std::string& gate = "gate_proj",
                   const std::string& up = "up_proj", const std::string& down = "down_proj") {
  DenseMlp m;
  Tensor g = r.host(p + gate + ".weight", {I, H}), u = r.host(p + up + ".weight", {I, H});
  if (g.defined() && u.defined() && !r.dry()) {
    m.gate_up.w = stack_rows({g, u}, {2 * I, H}, r.dtype(), r.device());
    r.release(p + gate + ".weight");
    r.release(p + up + ".weight");
  }
  m.down.w = r.get(p + down + ".weight", {H, I});
  return m;
}

void load_attention(TensorReader& r, const std::string& p, const TextConfig& c, AttentionWeights& a) {
  const int64_t H = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.head_dim;
  if (c.mla) {
    const int64_t dqk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    if (c.q_lora_rank > 0) {
      a.q_a = linear(r, p + "q_a_proj", c.q_lora_rank, H, c.qkv_bias);
      a.q_a_norm = r.get(p + "q_a_layernorm.weight", {c.q_lora_rank});
      a.q_b = linear(r, p + "q_b_proj", Hq * dqk, c.q_lora_rank, false);
    } else {
      a.q = linear(r, p + "q_proj", Hq * dqk, H, false);
    }
    a.kv_a = linear(r, p + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, H, c.qkv_bias);
    a.kv_a_norm = r.get(p + "kv_a_layernorm.weight", {c.kv_lora_rank});
    a.kv_b = linear(r, p + "kv_b_proj", Hq * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, false);
    a.o = linear(r, p + "o_proj", H, Hq * c.v_head_dim, c.o_bias);
    return;
  }
  {
    // q, k and v stacked into one projection; q, k and v stay as row views of it (no extra memory).
    const int64_t Nq = Hq * D, Nk = Hkv * D, N = Nq + 2 * Nk;
    const std::string names[3] = {p + "q_proj", p + "k_proj", p + "v_proj"};
    const int64_t outs[3] = {Nq, Nk, Nk};
    std::vector<Tensor> w, b;
    bool ok = true;
    for (int i = 0; i < 3; ++i) {
      w.push_back(r.host(names[i] + ".weight", {outs[i], H}));
      ok = ok && w.back().defined();
      if (c.qkv_bias) {
        b.push_back(r.host(names[i] + ".bias", {outs[i]}));
        ok = ok && b.back().defined();
      }
    }
    if (ok && !r.dry()) {
      a.qkv.w = stack_rows(w, {N, H}, r.dtype(), r.device());
      if (c.qkv_bias) a.qkv.b = stack_rows(b, {N}, r.dtype(), r.device());
      w.clear();
      b.clear();
      for (int i = 0; i < 3; ++i) {
        r.release(names[i] + ".weight");
        if (c.qkv_bias) r.release(names[i] + ".bias");
      }
      const auto keep_w = std::make_shared<Tensor>(a.qkv.w), keep_b = std::make_shared<Tensor>(a.qkv.b);
      Linear* parts[3] = {&a.q, &a.k, &a.v};
      int64_t begin = 0;
      for (int i = 0; i < 3; ++i) {
        parts[i]->w = Tensor::wrap(model::rows(a.qkv.w.view(), begin, outs[i]), keep_w);
        if (c.qkv_bias) parts[i]->b = Tensor::wrap(model::rows(a.qkv.b.view(), begin, outs[i]), keep_b);
        begin += outs[i];
      }
    }
  }
  a.o = linear(r, p + "o_proj", H, Hq * D, c.o_bias);
  if (c.qk_norm == QkNorm::per_head) {
    a.q_norm = r.get(p + "q_norm.weight", {D});
    a.k_norm = r.get(p + "k_norm.weight", {D});
  } else if (c.qk_norm == QkNorm::full) {
    a.q_norm = r.get(p + "q_norm.weight", {Hq * D});
    a.k_norm = r.get(p + "k_norm.weight", {Hkv * D});
  }
  if (c.attention_sinks) a.sinks = r.get(p + "sinks", {Hq}, DType::f32);
}

// Tensors stacked along their first dimension into a new tensor of `dtype` on `device`, as bytes (packed FP4 parts
// stored as I8 / U8 become f4e2m1); each part released once copied.
Tensor stack_bytes(const std::vector<Tensor>& parts, const Shape& shape, DType dtype, Device device,
                   const std::function<void(size_t)>& release) {
  Tensor out = Tensor::empty(shape, dtype, Device::cpu());
  size_t off = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    MOEKIT_ASSERT(off + parts[i].nbytes() <= out.nbytes());
    std::memcpy(static_cast<char*>(out.data()) + off, parts[i].contiguous().data(), parts[i].nbytes());
    off += parts[i].nbytes();
    release(i);
  }
  MOEKIT_ASSERT(off == out.nbytes());
  return out.to(device);
}

// Per-expert quantized tensors gathered for one module: gate and up rows (gate first) and down, with their scales.
struct PerExpertQuant {
  std::vector<Tensor> gu, d, gus, ds;
  std::vector<std::string> gu_names, d_names;
  void add(const std::string& gn, const std::string& un, const std::string& dn, const Tensor& g, const Tensor& u,
           const Tensor& dd, const Tensor& gs, const Tensor& us, const Tensor& dsc) {
    gu.insert(gu.end(), {g, u});
    d.push_back(dd);
    gus.insert(gus.end(), {gs, us});
    ds.push_back(dsc);
    gu_names.insert(gu_names.end(), {gn, un});
    d_names.push_back(dn);
  }
  // The module's stacked weights (`wdt`) and scales (`sdt`); each weight's mapped pages go once copied.
  ExpertsWeights stack(TensorReader& r, DType wdt, DType sdt, const Shape& gu_shape, const Shape& d_shape,
                       const Shape& gus_shape, const Shape& ds_shape) const {
    ExpertsWeights w;
    const Device dev = r.device();
    w.gate_up_proj = stack_bytes(gu, gu_shape, wdt, dev, [&](size_t i) { r.release(gu_names[i]); });
    w.down_proj = stack_bytes(d, d_shape, wdt, dev, [&](size_t i) { r.release(d_names[i]); });
    w.gate_up_proj_scale_inv = stack_bytes(gus, gus_shape, sdt, dev, [](size_t) {});
    w.down_proj_scale_inv = stack_bytes(ds, ds_shape, sdt, dev, [](size_t) {});
    return w;
  }
};

// FP8 experts as published (SPEC section 5), kept in FP8: per-expert `{gate,up,down}_proj.weight` f8e4m3 [N, K]
// with `weight_scale_inv` [ceil(N/128), ceil(K/128)] beside each (gate and up stacked into gate_up_proj with
// their own blocks), or fused `gate_up_proj` / `down_proj` with `_scale_inv`.
ExpertsWeights load_fp8_experts(TensorReader& r, const Checkpoint& ck, const std::string& p, const ExpertsSpec& spec,
                                const MoeNaming& n) {
  const int64_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  const int64_t bi = fp8_blocks(I), bh = fp8_blocks(H);
  ExpertsWeights w;
  if (ck.contains(p + "gate_up_proj")) {
    Tensor gu = r.host(p + "gate_up_proj", {E, 2 * I, H}, true), d = r.host(p + "down_proj", {E, H, I}, true);
    Tensor gs = r.scale(p + "gate_up_proj_scale_inv", {E, 2 * bi, bh}),
           ds = r.scale(p + "down_proj_scale_inv", {E, bh, bi});
    if (r.dry() || !gu.defined() || !d.defined() || !gs.defined() || !ds.defined()) return w;
    const Device dev = r.device();
    w.gate_up_proj = gu.contiguous().to(dev);
    w.down_proj = d.contiguous().to(dev);
    w.gate_up_proj_scale_inv = gs.contiguous().to(dev);
    w.down_proj_scale_inv = ds.contiguous().to(dev);
    return w;
  }
  PerExpertQuant parts;
  for (int64_t e = 0; e < E; ++e) {
    const std::string q = p + std::to_string(e) + ".";
    const std::string gn = q + n.gate_proj + ".weight", un = q + n.up_proj + ".weight", dn = q + n.down_proj + ".weight";
    Tensor g = r.host(gn, {I, H}, true), u = r.host(un, {I, H}, true), dd = r.host(dn, {H, I}, true);
    Tensor gs = r.scale(TensorReader::scale_name(gn), {bi, bh}), us = r.scale(TensorReader::scale_name(un), {bi, bh}),
           dsc = r.scale(TensorReader::scale_name(dn), {bh, bi});
    for (const Tensor* t : {&g, &u, &dd})
      if (t->defined() && t->dtype() != DType::f8e4m3) r.wrong(q + " experts mix f8e4m3 and " + dtype_name(t->dtype()));
    if (!g.defined() || !u.defined() || !dd.defined() || !gs.defined() || !us.defined() || !dsc.defined()) return w;
    parts.add(gn, un, dn, g, u, dd, gs, us, dsc);
  }
  if (r.dry()) return w;
  const DType sdt = parts.gus[0].dtype();
  for (const auto* v : {&parts.gus, &parts.ds})
    for (const Tensor& t : *v) MOEKIT_CHECK(t.dtype() == sdt, p, ": expert block scales mix f32 and ue8m0");
  return parts.stack(r, DType::f8e4m3, sdt, {E, 2 * I, H}, {E, H, I}, {E, 2 * bi, bh}, {E, bh, bi});
}

// FP4 experts as published: per-expert I8 `.weight` [N, K/2] (two e2m1 per byte, low nibble first) with F8_E8M0
// `.weight_scale_inv` [N, K/32] (expert_dtype "fp4"), or gpt-oss's MXFP4 `gate_up_proj_blocks` U8 [E, 2I, H/32, 16]
// with `gate_up_proj_scales` U8 [E, 2I, H/32] (and down_proj's), both [E, out, in]; the module's f4e2m1 weights hold
// the same bytes.
ExpertsWeights load_fp4_experts(TensorReader& r, const Checkpoint& ck, const std::string& p, const ExpertsSpec& spec,
                                const MoeNaming& n) {
  const int64_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate, N1 = spec.has_gate ? 2 * I : I;
  ExpertsWeights w;
  const Device dev = r.device();
  if (r.quant().mxfp4) {
    const std::string gu = spec.has_gate ? "gate_up_proj" : "up_proj";
    if (H % 32 != 0 || I % 32 != 0) {
      r.wrong(p + gu + "_blocks: MXFP4 needs hidden and intermediate sizes in multiples of 32, got " + str(H) + " and " +
              str(I));
      return w;
    }
    Tensor b1 = r.bytes(p + gu + "_blocks", {E, N1, H / 32, 16}, {DType::u8, DType::i8}),
           s1 = r.bytes(p + gu + "_scales", {E, N1, H / 32}, {DType::u8, DType::ue8m0}),
           b2 = r.bytes(p + "down_proj_blocks", {E, H, I / 32, 16}, {DType::u8, DType::i8}),
           s2 = r.bytes(p + "down_proj_scales", {E, H, I / 32}, {DType::u8, DType::ue8m0});
    if (spec.has_bias) {
      (spec.has_gate ? w.gate_up_proj_bias : w.up_proj_bias) = r.get(p + gu + "_bias", {E, N1});
      w.down_proj_bias = r.get(p + "down_proj_bias", {E, H});
    }
    if (r.dry() || !b1.defined() || !s1.defined() || !b2.defined() || !s2.defined()) return w;
    auto keep = [](size_t) {};
    (spec.has_gate ? w.gate_up_proj : w.up_proj) = stack_bytes({b1}, {E, N1, H}, DType::f4e2m1, dev, keep);
    (spec.has_gate ? w.gate_up_proj_scale_inv : w.up_proj_scale_inv) =
        stack_bytes({s1}, {E, N1, H / 32}, DType::ue8m0, dev, keep);
    w.down_proj = stack_bytes({b2}, {E, H, I}, DType::f4e2m1, dev, keep);
    w.down_proj_scale_inv = stack_bytes({s2}, {E, H, I / 32}, DType::ue8m0, dev, keep);
    w.fp4_float_activations = true;  // as transformers runs MXFP4 where its kernels are absent
    return w;
  }
  PerExpertQuant parts;
  for (int64_t e = 0; e < E; ++e) {
    const std::string q = p + std::to_string(e) + ".";
    const std::string gn = q + n.gate_proj + ".weight", un = q + n.up_proj + ".weight", dn = q + n.down_proj + ".weight";
    Tensor g = r.bytes(gn, {I, H / 2}, {DType::i8, DType::u8}), u = r.bytes(un, {I, H / 2}, {DType::i8, DType::u8}),
           dd = r.bytes(dn, {H, I / 2}, {DType::i8, DType::u8});
    Tensor gs = r.bytes(TensorReader::scale_name(gn), {I, H / 32}, {DType::ue8m0}),
           us = r.bytes(TensorReader::scale_name(un), {I, H / 32}, {DType::ue8m0}),
           dsc = r.bytes(TensorReader::scale_name(dn), {H, I / 32}, {DType::ue8m0});
    if (!g.defined() || !u.defined() || !dd.defined() || !gs.defined() || !us.defined() || !dsc.defined()) return w;
    parts.add(gn, un, dn, g, u, dd, gs, us, dsc);
  }
  if (r.dry()) return w;
  return parts.stack(r, DType::f4e2m1, DType::ue8m0, {E, 2 * I, H}, {E, H, I}, {E, 2 * I, H / 32}, {E, H, I / 32});
}

// Already-fused experts (gpt-oss, qwen3_vl_moe, or checkpoints saved fused) load as they are; the layout
// follows the shapes as transformers' loading does ([E, 2I, H] as is, [E, H, 2I] transposed).
// Per-expert tensors are fused into gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I].
// `stored_transposed` receives the checkpoint's layout (the module's is always [E, out, in]).
ExpertsWeights load_experts(TensorReader& r, const Checkpoint& ck, const std::string& p, ExpertsSpec& spec,
                            const MoeNaming& n, bool& stored_transposed) {
  const int64_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  const ExpertSlice sh = r.shard(E);  // the experts read: all, or this rank's slice
  const int64_t El = sh.count();
  ExpertsWeights w;
  const std::string gu_name = p + "gate_up_proj";
  const bool quantized = r.quant().mxfp4 || r.quant().fp4_experts || r.quant().fp8;
  if (quantized && El != E)
    MOEKIT_FAIL(not_supported, p, ": expert parallelism (", El, " of ", E,
                " experts on this rank) does not take quantized (FP8 / FP4) checkpoints yet; run them on one rank");
  if (r.quant().mxfp4 || r.quant().fp4_experts) {  // stored [E, out, in]
    stored_transposed = false;
    spec.is_transposed = false;
    w = load_fp4_experts(r, ck, p, spec, n);
    if (r.quant().dequantize && w.is_quantized()) w = dequantize_experts(spec, w, r.dtype());
    return w;
  }
  if (r.quant().fp8 && spec.has_gate && !spec.is_transposed &&
      (r.is_fp8(gu_name) || r.is_fp8(p + "0." + n.gate_proj + ".weight"))) {
    stored_transposed = false;
    w = load_fp8_experts(r, ck, p, spec, n);
    if (r.quant().dequantize && w.is_fp8()) w = dequantize_experts(spec, w, r.dtype());
    return w;
  }
  if (ck.contains(gu_name) || spec.is_transposed) {
    const Shape plain{E, 2 * I, H}, transposed{E, H, 2 * I};
    Shape gu_shape = spec.is_transposed ? transposed : plain;
    if (ck.contains(gu_name)) {
      const Shape got = ck.get(gu_name).shape();
      if (got == plain && got != transposed)
        spec.is_transposed = false;
      else if (got == transposed && got != plain)
        spec.is_transposed = true;
      gu_shape = spec.is_transposed ? transposed : plain;
    }
    stored_transposed = spec.is_transposed;
    if (spec.is_transposed) {
      // Stored [E, in, out] (gpt-oss): transposed once here into [E, out, in], the layout the CUDA backends'
      // prepare would otherwise repack into beside the stored copy; same values, one copy in memory.
      w.gate_up_proj = transposed_experts(r, gu_name, gu_shape);
      w.down_proj = transposed_experts(r, p + "down_proj", {E, I, H});
      spec.is_transposed = false;
    } else {
      w.gate_up_proj = r.get_experts(gu_name, gu_shape, sh);
      w.down_proj = r.get_experts(p + "down_proj", {E, H, I}, sh);
    }
    if (spec.has_bias) {
      w.gate_up_proj_bias = r.get_experts(p + "gate_up_proj_bias", {E, 2 * I}, sh);
      w.down_proj_bias = r.get_experts(p + "down_proj_bias", {E, H}, sh);
    }
    spec.num_experts = El;
    return w;
  }
  std::vector<Tensor> gu_parts, down_parts;
  std::vector<std::string> gu_names, down_names;
  bool complete = true;
  for (int64_t e = sh.start; e < sh.end; ++e) {
    const std::string q = p + std::to_string(e) + ".";
    Tensor g = r.host(q + n.gate_proj + ".weight", {I, H});
    Tensor u = r.host(q + n.up_proj + ".weight", {I, H});
    Tensor d = r.host(q + n.down_proj + ".weight", {H, I});
    complete = complete && g.defined() && u.defined() && d.defined();
    if (!complete) break;  // reported; the other experts add nothing
    gu_parts.push_back(g);
    gu_parts.push_back(u);
    down_parts.push_back(d);
    gu_names.push_back(q + n.gate_proj + ".weight");
    gu_names.push_back(q + n.up_proj + ".weight");
    down_names.push_back(q + n.down_proj + ".weight");
  }
  spec.num_experts = El;
  if (!complete || r.dry()) return w;
  w.gate_up_proj =
      stack_rows(gu_parts, {El, 2 * I, H}, r.dtype(), r.device(), [&](size_t i) { r.release(gu_names[i]); });
  w.down_proj = stack_rows(down_parts, {El, H, I}, r.dtype(), r.device(), [&](size_t i) { r.release(down_names[i]); });
  return w;
}

void load_moe(TensorReader& r, const Checkpoint& ck, const std::string& lp, TextConfig& c, MoeBlock& m,
              const std::string& experts_implementation) {
  const MoeNaming& n = c.naming;
  const int64_t E = c.num_experts, H = c.hidden_size;
  // Mixtral's block is "block_sparse_moe" in published checkpoints and "mlp" once renamed.
  std::string block = n.block;
  if (!ck.contains(lp + block + "." + n.router + ".weight") && ck.contains(lp + "mlp." + n.router + ".weight"))
    block = "mlp";
  const std::string p = lp + block + ".";
  m.router_w = r.get(p + n.router + ".weight", {E, H}, DType::f32);  // routing in f32
  if (c.router_bias) m.router_b = r.get(p + n.router + ".bias", {E}, DType::f32);
  if (c.router == RouterKind::grouped_sigmoid) {
    const std::string bias_name = p + n.router + ".e_score_correction_bias";
    m.correction_bias = r.get(bias_name, {E}, DType::f32);
  }
  ExpertsSpec spec = c.experts;
  bool stored_transposed = spec.is_transposed;
  ExpertsWeights w = load_experts(r, ck, p + "experts.", spec, n, stored_transposed);
  if (w.gate_up_proj.defined() && w.down_proj.defined() &&
      (!spec.has_bias || (w.gate_up_proj_bias.defined() && w.down_proj_bias.defined()))) {
    c.experts.is_transposed = stored_transposed;
    m.experts = Experts(spec, std::move(w), experts_implementation);
  }
  if (c.shared_expert_intermediate_size > 0 && !n.shared.empty()) {
    m.has_shared = true;
    m.shared = dense_mlp(r, p + n.shared + ".", H, c.shared_expert_intermediate_size);
    if (!n.shared_gate.empty()) m.shared_gate = r.get(p + n.shared_gate + ".weight", {1, H});
  }
}

Weights read_weights(TensorReader& r, const Checkpoint& ck, TextConfig& c, const std::string& experts_implementation);

std::string find_prefix(const Checkpoint& ck) {
  static const char* kCandidates[] = {
      "model.", "model.language_model.", "language_model.model.", "model.text_model.", "language_model.", ""};
  for (const char* p : kCandidates)
    if (ck.contains(std::string(p) + "embed_tokens.weight")) return p;
  std::string looked;
  for (const char* p : kCandidates) looked += (looked.empty() ? "" : ", ") + std::string(p) + "embed_tokens.weight";
  MOEKIT_FAIL(not_found, ck.dir(), ": no token embedding found (looked for ", looked, ")");
}

}  // namespace

namespace {

// The config's claims against what the checkpoint holds, before anything is read: a config cannot
// describe more layers than the checkpoint has tensors, nor a tensor with more elements than the
// checkpoint has bytes (two elements per byte for 4-bit types). All products checked.
void check_config_against_checkpoint(const Checkpoint& ck, const TextConfig& c) {
  uint64_t bytes = 0, tensors = 0;
  for (const auto& f : ck.files()) {
    tensors += f.entries().size();
    for (const auto& e : f.entries()) bytes += e.nbytes();
  }
  const int64_t cap = bytes > uint64_t(INT64_MAX / 2) ? INT64_MAX : int64_t(2 * bytes);
  auto fail = [&](const std::string& what) {
    MOEKIT_FAIL(invalid_argument, ck.dir(), ": config.json ", what, ", more than the checkpoint holds (", tensors,
                " tensors, ", bytes, " bytes)");
  };
  if (uint64_t(c.num_hidden_layers) > tensors)
    fail("has num_hidden_layers " + std::to_string(c.num_hidden_layers) + " (each layer needs tensors)");
  struct Claim {
    const char* what;
    std::initializer_list<int64_t> dims;
  };
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t E = c.num_experts > 0 ? c.num_experts : 0;
  const Claim claims[] = {
      {"vocab_size x hidden_size (the embedding)", {c.vocab_size, H}},
      {"num_attention_heads x head_dim x hidden_size (q_proj)", {c.mla ? 0 : c.num_attention_heads, D, H}},
      {"num_key_value_heads x head_dim x hidden_size (k_proj)", {c.mla ? 0 : c.num_key_value_heads, D, H}},
      {"num_experts x hidden_size (the router)", {E, H}},
      {"num_experts x moe_intermediate_size x hidden_size (the experts)", {E, c.moe_intermediate_size, H}},
      {"intermediate_size x hidden_size (a dense MLP)", {c.intermediate_size, H}},
  };
  for (const Claim& cl : claims) {
    int64_t n = 1;
    bool over = false;
    for (int64_t d : cl.dims) over = over || d < 0 || __builtin_mul_overflow(n, d, &n);
    if (over || n > cap) {
      std::string dims;
      for (int64_t d : cl.dims) dims += (dims.empty() ? "" : " x ") + std::to_string(d);
      fail("claims " + std::string(cl.what) + " = " + dims + (over ? " (overflows)" : " elements"));
    }
  }
}

bool all_finite(const Tensor& t) {
  const int64_t n = t.numel();
  bool ok = true;
  switch (t.dtype()) {
    case DType::f32: {
      const uint32_t* p = static_cast<const uint32_t*>(t.data());
#pragma omp parallel for reduction(&& : ok) if (n > (int64_t(1) << 20))
      for (int64_t i = 0; i < n; ++i) ok = ok && (p[i] & 0x7f800000u) != 0x7f800000u;
      return ok;
    }
    case DType::bf16: {
      const uint16_t* p = static_cast<const uint16_t*>(t.data());
#pragma omp parallel for reduction(&& : ok) if (n > (int64_t(1) << 20))
      for (int64_t i = 0; i < n; ++i) ok = ok && (p[i] & 0x7f80u) != 0x7f80u;
      return ok;
    }
    case DType::f16: {
      const uint16_t* p = static_cast<const uint16_t*>(t.data());
#pragma omp parallel for reduction(&& : ok) if (n > (int64_t(1) << 20))
      for (int64_t i = 0; i < n; ++i) ok = ok && (p[i] & 0x7c00u) != 0x7c00u;
      return ok;
    }
    case DType::f8e4m3: {
      const uint8_t* p = static_cast<const uint8_t*>(t.data());
      for (int64_t i = 0; i < n; ++i) ok = ok && (p[i] & 0x7fu) != 0x7fu;  // no infinities; NaN is S.1111.111
      return ok;
    }
    case DType::f64: {
      const uint64_t* p = static_cast<const uint64_t*>(t.data());
      for (int64_t i = 0; i < n; ++i) ok = ok && (p[i] & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
      return ok;
    }
    default:
      return true;
  }
}

}  // namespace

uint64_t checkpoint_bytes(const Checkpoint& ck) {
  uint64_t bytes = 0;
  for (const auto& f : ck.files()) bytes += f.file_size();
  return bytes;
}

void check_finite_weights(const Checkpoint& ck, const std::vector<std::string>& names) {
  for (const auto& name : names) {
    const Tensor t = ck.get(name);
    const bool finite = all_finite(t);
    if (finite) {
      ck.release(name);  // scanned: the pages are read again when (and if) the load needs them
      continue;
    }
    {
      const int64_t n = t.numel();
      int64_t first = 0;
      double v = 0;
      for (; first < n; ++first) {
        v = load_as_f64(t.data(), t.dtype(), first);
        if (!std::isfinite(v)) break;
      }
      MOEKIT_FAIL(invalid_argument, ck.dir(), ": tensor '", printable(name), "' ", shape_to_string(t.shape()), " ",
                  dtype_name(t.dtype()), " holds a non-finite value (", v, " at element ", first,
                  "); the model would compute NaN (the finite check can be turned off)");
    }
  }
}

Weights load_weights(const Checkpoint& ck, TextConfig& c, DType dtype, Device device,
                     const std::string& experts_implementation, std::optional<bool> check_finite,
                     const std::function<void(const LoadProgress&)>& progress,
                     std::optional<ExpertSlice> shard, const LoadQuant& quant) {
  check_config_against_checkpoint(ck, c);
  // Everything checked on the zero-copy checkpoint tensors before anything is converted or allocated.
  TensorReader dry(ck, dtype, device, /*dry=*/true, shard);
  dry.set_quant(quant);
  read_weights(dry, ck, c, experts_implementation);
  const bool small = checkpoint_bytes(ck) <= kFiniteCheckDefaultBytes;
  if (check_finite.value_or(small)) {
    check_finite_weights(ck, dry.read());
  } else if (!check_finite) {
    std::fprintf(stderr,
                 "moekit: warning: %s: weights not checked for NaN/Inf (%.1f GB; pass check_finite / "
                 "--check-finite to check them)\n",
                 printable(ck.dir()).c_str(), double(checkpoint_bytes(ck)) / 1e9);
  }
  TensorReader r(ck, dtype, device, /*dry=*/false, shard);
  r.set_quant(quant);
  if (progress) r.report_to(progress, dry);
  Weights w = read_weights(r, ck, c, experts_implementation);
  r.finish();
  return w;
}

namespace {
Weights read_weights(TensorReader& r, const Checkpoint& ck, TextConfig& c, const std::string& experts_implementation) {
  Weights w;
  const std::string prefix = find_prefix(ck);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  // gpt-oss keeps its norms in f32 (transformers' _keep_in_fp32_modules).
  const DType norm_dtype = c.norm_weight_before_cast ? DType::f32 : r.dtype();
  w.embed = r.get(prefix + "embed_tokens.weight", {V, H});
  w.layers.resize(size_t(c.num_hidden_layers));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    Layer& L = w.layers[size_t(i)];
    const std::string lp = prefix + "layers." + str(i) + ".";
    L.input_norm = r.get(lp + "input_layernorm.weight", {H}, norm_dtype);
    L.post_norm = r.get(lp + "post_attention_layernorm.weight", {H}, norm_dtype);
    L.window = c.sliding_window[size_t(i)];
    load_attention(r, lp + "self_attn.", c, L.attn);
    L.is_moe = c.moe_layer[size_t(i)];
    if (L.is_moe)
      load_moe(r, ck, lp, c, L.moe, experts_implementation);
    else
      L.mlp = dense_mlp(r, lp + "mlp.", H, c.intermediate_size);
  }
  w.norm = r.get(prefix + "norm.weight", {H}, norm_dtype);
  if (c.tie_word_embeddings) {
    w.lm_head = w.embed;
  } else {
    std::string head = "lm_head.weight";
    for (const char* cand : {"lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight"})
      if (ck.contains(cand)) {
        head = cand;
        break;
      }
    w.lm_head = r.get(head, {V, H});
  }
  r.throw_if_problems(c.model_type);
  return w;
}

}  // namespace

LoadQuant check_quantization(const ModelConfig& mc, const std::string& dir) {
  LoadQuant r;
  if (!mc.has_quantization_config) return r;
  MOEKIT_CHECK_CODE(mc.quantization.has_value(), not_supported, dir,
                    ": config.json's quantization_config is not an object");
  const QuantizationConfig& q = *mc.quantization;
  if (q.quant_method == "mxfp4") {
    r.mxfp4 = true;
    return r;
  }
  MOEKIT_CHECK_CODE(q.quant_method == "fp8", not_supported, dir, ": quantization_config.quant_method '",
                    printable(q.quant_method), "' is not loaded by this build (it loads \"fp8\" and \"mxfp4\")");
  MOEKIT_CHECK_CODE(q.expert_dtype.empty() || q.expert_dtype == "fp8" || q.expert_dtype == "fp4", not_supported, dir,
                    ": expert_dtype '", printable(q.expert_dtype), "' is not \"fp8\" or \"fp4\"");
  MOEKIT_CHECK_CODE(q.fmt.empty() || q.fmt == "e4m3", not_supported, dir, ": quantization_config.fmt '",
                    printable(q.fmt), "' is not loaded; FP8 checkpoints are \"e4m3\"");
  MOEKIT_CHECK_CODE(q.activation_scheme.empty() || q.activation_scheme == "dynamic", not_supported, dir,
                    ": quantization_config.activation_scheme '", printable(q.activation_scheme),
                    "' is not supported: moekit quantizes activations dynamically (per token and 128 inputs); a "
                    "static scheme's activation scales are not used");
  MOEKIT_CHECK_CODE(q.weight_block_size == std::vector<int64_t>({128, 128}), not_supported, dir,
                    ": quantization_config.weight_block_size must be [128, 128] (block-scaled FP8)");
  MOEKIT_CHECK_CODE(q.scale_fmt.empty() || q.scale_fmt == "float" || q.scale_fmt == "ue8m0", not_supported, dir,
                    ": quantization_config.scale_fmt '", printable(q.scale_fmt), "' is not \"ue8m0\" or float");
  r.fp8 = true;
  r.fp4_experts = q.expert_dtype == "fp4";
  return r;
}

}  // namespace moekit::model

#include "experts_case.h"

#include "backends/reference.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "io/input.h"
#include "moekit/interface.h"
#include "moekit/safetensors.h"

namespace moekit {

ExpertsCase load_experts_case(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  auto it = f.metadata().find("meta");
  MOEKIT_CHECK_CODE(it != f.metadata().end(), io, path, ": no 'meta' metadata entry (not an Experts case file)");
  const nlohmann::json meta = parse_json_bounded(it->second, path + " ('meta' metadata)");
  MOEKIT_CHECK_CODE(meta.is_object(), io, path, ": 'meta' is not a JSON object (", json_brief(meta), ")");
  auto field = [&](const char* k) -> const nlohmann::json& {
    MOEKIT_CHECK_CODE(meta.contains(k), io, path, ": meta lacks '", k, "'");
    return meta[k];
  };
  auto size_field = [&](const char* k) {
    const auto& v = field(k);
    MOEKIT_CHECK_CODE(v.is_number_unsigned() && v.get<uint64_t>() <= (uint64_t(1) << 40), io, path, ": meta '", k,
                      "' must be a non-negative integer, got ", json_brief(v));
    return v.get<int64_t>();
  };
  auto bool_field = [&](const char* k) {
    const auto& v = field(k);
    MOEKIT_CHECK_CODE(v.is_boolean(), io, path, ": meta '", k, "' must be true or false, got ", json_brief(v));
    return v.get<bool>();
  };
  auto float_field = [&](const char* k) {
    const auto& v = meta[k];
    MOEKIT_CHECK_CODE(v.is_number() && std::isfinite(v.get<double>()), io, path, ": meta '", k,
                      "' must be a finite number, got ", json_brief(v));
    return v.get<float>();
  };
  ExpertsSpec s;
  s.num_experts = size_field("num_experts");
  s.hidden = size_field("hidden");
  s.has_gate = bool_field("has_gate");
  s.has_bias = bool_field("has_bias");
  s.is_transposed = bool_field("is_transposed");
  s.is_concatenated = bool_field("is_concatenated");
  if (meta.contains("act") && meta["act"].is_string()) s.activation = parse_activation(meta["act"].get<std::string>());
  if (meta.contains("limit") || meta.contains("alpha")) {
    s.gate = GateKind::clamped_swiglu;
    if (meta.contains("alpha")) s.alpha = float_field("alpha");
    if (meta.contains("limit")) s.limit = float_field("limit");
  }
  std::map<std::string, Tensor> params;
  for (const auto& name : f.names()) {
    if (name.rfind("param.", 0) == 0) params[name.substr(6)] = f.get(name);
  }
  const std::string first = s.has_gate ? "gate_up_proj" : "up_proj";
  MOEKIT_CHECK_CODE(params.count(first) && params.count("down_proj"), io, path, ": needs param.", first,
                    " and param.down_proj");
  // down_proj is [E, H, I] or [E, I, H] (transposed).
  const Shape& ds = params["down_proj"].shape();
  MOEKIT_CHECK_CODE(ds.size() == 3, io, path, ": param.down_proj must be 3-D, got ", shape_to_string(ds));
  s.intermediate = s.is_transposed ? ds[1] : ds[2];
  ExpertsCase c;
  c.experts = Experts(s, make_experts_weights(s, params));
  c.hidden_states = f.get("hidden_states");
  c.top_k_index = f.get("top_k_index");
  c.top_k_weights = f.get("top_k_weights");
  for (const auto& name : f.names())
    if (name.rfind("out.", 0) == 0) c.outputs[name.substr(4)] = f.get(name);
  MOEKIT_CHECK_CODE(!c.outputs.empty(), io, path, ": no out.* tensors");
  c.expected_name = c.outputs.count("eager") ? "eager" : c.outputs.begin()->first;
  c.expected = c.outputs[c.expected_name];
  // The call, validated before anything reads it (the f64 reference indexes with these shapes and ids).
  const Tensor& x = c.hidden_states;
  const Tensor& idx = c.top_k_index;
  const Tensor& w = c.top_k_weights;
  MOEKIT_CHECK_CODE(x.dim() == 2 && x.size(1) == s.hidden, io, path, ": hidden_states must be [T, ", s.hidden,
                    "] (hidden ", s.hidden, "), got ", shape_to_string(x.shape()));
  MOEKIT_CHECK_CODE(is_floating(x.dtype()) && x.dtype() != DType::f4e2m1 && x.dtype() != DType::ue8m0, io, path,
                    ": hidden_states must be floating (f32, bf16, f16), got ", dtype_name(x.dtype()));
  const int64_t T = x.size(0);
  MOEKIT_CHECK_CODE(idx.dim() == 2 && idx.size(0) == T && idx.size(1) >= 1, io, path, ": top_k_index must be [", T,
                    ", K] with K >= 1, got ", shape_to_string(idx.shape()));
  MOEKIT_CHECK_CODE(idx.dtype() == DType::i64 || idx.dtype() == DType::i32, io, path,
                    ": top_k_index must be i64 or i32, got ", dtype_name(idx.dtype()));
  MOEKIT_CHECK_CODE(w.shape() == idx.shape(), io, path, ": top_k_weights must be ", shape_to_string(idx.shape()),
                    " as top_k_index, got ", shape_to_string(w.shape()));
  MOEKIT_CHECK_CODE(is_floating(w.dtype()) && w.dtype() != DType::f4e2m1 && w.dtype() != DType::ue8m0, io, path,
                    ": top_k_weights must be floating, got ", dtype_name(w.dtype()));
  for (int64_t i = 0; i < idx.numel(); ++i) {
    const int64_t e = idx.dtype() == DType::i64 ? idx.ptr<int64_t>()[i] : int64_t(idx.ptr<int32_t>()[i]);
    // E itself is the expert-parallel sentinel (an expert on another rank): allowed.
    MOEKIT_CHECK_CODE(e >= 0 && e <= s.num_experts, io, path, ": top_k_index holds expert ", e, " at element ", i,
                      ", outside [0, ", s.num_experts, "] (", s.num_experts, " experts; ", s.num_experts,
                      " is the expert-parallel sentinel)");
  }
  for (const auto& [name, out] : c.outputs) {
    MOEKIT_CHECK_CODE(out.shape() == x.shape(), io, path, ": out.", printable(name), " must be ",
                      shape_to_string(x.shape()), " as hidden_states, got ", shape_to_string(out.shape()));
    MOEKIT_CHECK_CODE(is_floating(out.dtype()) && out.dtype() != DType::f4e2m1 && out.dtype() != DType::ue8m0, io, path,
                      ": out.", printable(name), " must be floating, got ", dtype_name(out.dtype()));
  }
  c.expected_values.resize(size_t(c.expected.numel()));
  for (size_t i = 0; i < c.expected_values.size(); ++i)
    c.expected_values[i] = load_as_f64(c.expected.data(), c.expected.dtype(), int64_t(i));
  c.meta_json = it->second;
  return c;
}

void poison_tensor(Tensor& t) {
  MOEKIT_CHECK(is_floating(t.dtype()), "poison_tensor: needs a floating tensor, got ", dtype_name(t.dtype()));
  Tensor h = Tensor::empty(t.shape(), DType::f32);
  h.fill_(std::numeric_limits<double>::quiet_NaN());
  t.copy_from(h.to(t.dtype()));
}

std::vector<double> reference_output(const ExpertsCase& c) {
  return reference_forward(c.experts, c.hidden_states, c.top_k_index, c.top_k_weights);
}

double relative_error(const TensorView& a, const std::vector<double>& ref) { return relative_l2(a, ref); }

}  // namespace moekit

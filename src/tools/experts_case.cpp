#include "experts_case.h"

#include "backends/reference.h"

#include <limits>
#include <nlohmann/json.hpp>

#include "moekit/interface.h"
#include "moekit/safetensors.h"

namespace moekit {

ExpertsCase load_experts_case(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  auto it = f.metadata().find("meta");
  MOEKIT_CHECK_CODE(it != f.metadata().end(), io, path, ": no 'meta' metadata entry (not an Experts case file)");
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(it->second);
  } catch (const std::exception& e) {
    MOEKIT_FAIL(io, path, ": 'meta' is not JSON (", e.what(), ")");
  }
  auto field = [&](const char* k) -> const nlohmann::json& {
    MOEKIT_CHECK_CODE(meta.contains(k), io, path, ": meta lacks '", k, "'");
    return meta[k];
  };
  ExpertsSpec s;
  s.num_experts = field("num_experts").get<int64_t>();
  s.hidden = field("hidden").get<int64_t>();
  s.has_gate = field("has_gate").get<bool>();
  s.has_bias = field("has_bias").get<bool>();
  s.is_transposed = field("is_transposed").get<bool>();
  s.is_concatenated = field("is_concatenated").get<bool>();
  if (meta.contains("act") && meta["act"].is_string()) s.activation = parse_activation(meta["act"].get<std::string>());
  if (meta.contains("limit") || meta.contains("alpha")) {
    s.gate = GateKind::clamped_swiglu;
    if (meta.contains("alpha")) s.alpha = meta["alpha"].get<float>();
    if (meta.contains("limit")) s.limit = meta["limit"].get<float>();
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

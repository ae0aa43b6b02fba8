// What `moekit inspect` prints of a safetensors file or a checkpoint folder, and the other reports of files
// and of this machine that the CLI shows.
#include <fmt/core.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "base/gemm.h"
#include "inspect.h"
#include "io/checkpoint.h"
#include "io/input.h"

namespace moekit::tools {
namespace {

std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.1f} {}", v, units[u]);
}

// The first of `keys` present in `c`, as text.
std::string field(const nlohmann::json& c, const std::vector<const char*>& keys) {
  for (const char* k : keys)
    if (c.contains(k) && !c[k].is_null())
      return c[k].is_string() ? printable(c[k].get<std::string>()) : json_brief(c[k], 200);
  return "";
}

void print_config_summary(const nlohmann::json& c, const std::string& indent) {
  const std::vector<std::pair<const char*, std::vector<const char*>>> rows = {
      {"model_type", {"model_type"}},
      {"architectures", {"architectures"}},
      {"dtype", {"dtype", "torch_dtype"}},
      {"layers", {"num_hidden_layers", "num_layers", "n_layer", "depth"}},
      {"hidden", {"hidden_size", "d_model", "n_embd"}},
      {"vocab", {"vocab_size"}},
      {"heads", {"num_attention_heads", "num_heads", "n_head"}},
      {"kv heads", {"num_key_value_heads"}},
      {"head_dim", {"head_dim"}},
      {"intermediate", {"intermediate_size"}},
      {"experts", {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}},
      {"top-k", {"num_experts_per_tok", "experts_per_token", "moe_topk"}},
      {"moe intermediate", {"moe_intermediate_size"}},
      {"shared experts", {"n_shared_experts", "shared_expert_intermediate_size"}},
      {"activation", {"hidden_act", "mlp_hidden_act"}},
      {"expert dtype", {"expert_dtype"}},
  };
  for (const auto& [label, keys] : rows) {
    const std::string v = field(c, keys);
    if (!v.empty()) fmt::print("{}{:<17} {}\n", indent, label, v);
  }
  if (c.contains("quantization_config") && c["quantization_config"].is_object())
    fmt::print("{}{:<17} {}\n", indent, "quantization", json_brief(c["quantization_config"], 200));
  for (const auto& [key, sub] : c.items()) {
    if (sub.is_object() && (key.size() > 7 && key.compare(key.size() - 7, 7, "_config") == 0) &&
        key != "quantization_config" && key != "rope_scaling") {
      fmt::print("{}{}:\n", indent, key);
      print_config_summary(sub, indent + "  ");
    }
  }
}

void print_tensor_table(const std::vector<std::pair<const SafetensorsEntry*, std::string>>& rows, bool show_file) {
  size_t w = 4;
  for (const auto& [e, f] : rows) w = std::max(w, e->name.size());
  fmt::print("  {:<{}}  {:<8} {:<22} {:>12}{}\n", "name", w, "dtype", "shape", "bytes", show_file ? "  file" : "");
  for (const auto& [e, f] : rows)
    fmt::print("  {:<{}}  {:<8} {:<22} {:>12}{}\n", e->name, w, safetensors_dtype_name(e->dtype),
               shape_to_string(e->shape), e->nbytes(), show_file ? "  " + f : "");
}

void print_dtype_totals(const std::vector<std::pair<const SafetensorsEntry*, std::string>>& rows) {
  std::map<std::string, std::pair<uint64_t, uint64_t>> per;  // dtype -> (tensors, bytes)
  uint64_t total = 0;
  for (const auto& [e, f] : rows) {
    auto& p = per[safetensors_dtype_name(e->dtype)];
    p.first += 1;
    p.second += e->nbytes();
    total += e->nbytes();
  }
  fmt::print("tensors: {} ({}, {} bytes)\n", rows.size(), human_bytes(total), total);
  for (const auto& [dt, p] : per) fmt::print("  {:<8} {:>6} tensors {:>14} bytes\n", dt, p.first, p.second);
}

void inspect_file(const std::string& path, bool list) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  fmt::print("safetensors file {}: {} bytes, header {} bytes\n", path, f.file_size(), f.header_size());
  if (!f.metadata().empty()) {
    fmt::print("metadata:\n");
    for (const auto& [k, v] : f.metadata()) fmt::print("  {}: {}\n", k, v.size() > 200 ? v.substr(0, 200) + "..." : v);
  }
  std::vector<std::pair<const SafetensorsEntry*, std::string>> rows;
  for (const auto& e : f.entries()) rows.push_back({&e, ""});
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.first->name < b.first->name; });
  print_dtype_totals(rows);
  if (list) print_tensor_table(rows, false);
}

void inspect_dir(const std::string& dir, bool list) {
  const Checkpoint ck = Checkpoint::open(dir);
  fmt::print("checkpoint {}: {} ({} file{})\n", dir, ck.sharded() ? "sharded" : "single file", ck.files().size(),
             ck.files().size() == 1 ? "" : "s");
  fmt::print("config:\n");
  print_config_summary(ck.config(), "  ");
  if (!ck.generation_config().empty()) fmt::print("generation_config: {}\n", json_brief(ck.generation_config(), 400));
  std::vector<std::pair<const SafetensorsEntry*, std::string>> rows;
  for (const auto& name : ck.names())
    rows.push_back({&ck.entry(name), std::filesystem::path(ck.file_of(name).path()).filename().string()});
  print_dtype_totals(rows);
  if (list) print_tensor_table(rows, ck.files().size() > 1);
}

}  // namespace

void print_inspection(const std::string& path, bool list) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  const std::string name = p.filename().string();
  const bool checkpoint_json =
      name == "config.json" || (name.size() > 11 && name.compare(name.size() - 11, 11, ".index.json") == 0);
  if (fs::is_directory(p, ec))
    inspect_dir(path, list);
  else if (checkpoint_json)  // a checkpoint's own JSON: show the folder
    inspect_dir(p.has_parent_path() ? p.parent_path().string() : ".", list);
  else
    inspect_file(path, list);
}

CheckpointTotals checkpoint_totals(const std::string& dir) {
  const Checkpoint ck = Checkpoint::open(dir);
  CheckpointTotals t;
  t.tensors = ck.names().size();
  t.files = ck.files().size();
  for (const auto& f : ck.files())
    for (const auto& e : f.entries()) t.bytes += e.nbytes();
  return t;
}

std::string cpu_gemm_summary() {
  std::string have;
  for (const cpu::Isa isa :
       {cpu::Isa::scalar, cpu::Isa::avx2, cpu::Isa::avx512, cpu::Isa::avx512bf16, cpu::Isa::amx})
    if (cpu::isa_supported(isa)) have += std::string(have.empty() ? "" : ", ") + cpu::isa_name(isa);
  return fmt::format("{} (this CPU runs {}; MOEKIT_CPU_ISA=scalar|avx2|avx512|avx512bf16|amx picks one)",
                     cpu::isa_name(cpu::gemm_kernels().isa), have);
}

}  // namespace moekit::tools

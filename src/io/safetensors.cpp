#include "moekit/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

namespace moekit {
namespace {

constexpr uint64_t kMaxHeader = 100ull * 1000 * 1000;  // 100 MB

DType parse_st_dtype(const std::string& s, const std::string& path, const std::string& name) {
  if (s == "F32") return DType::f32;
  if (s == "BF16") return DType::bf16;
  if (s == "F16") return DType::f16;
  if (s == "F64") return DType::f64;
  if (s == "F8_E4M3") return DType::f8e4m3;
  if (s == "F8_E8M0") return DType::ue8m0;
  if (s == "F4") return DType::f4e2m1;
  if (s == "I32") return DType::i32;
  if (s == "I64") return DType::i64;
  if (s == "U8") return DType::u8;
  if (s == "I8") return DType::i8;
  if (s == "BOOL") return DType::boolean;
  MOEKIT_FAIL(io, path, ": tensor '", name, "' has unknown dtype '", s,
              "' (known: F32, BF16, F16, F64, F8_E4M3, F8_E8M0, F4, I32, I64, U8, I8, BOOL)");
}

const char* st_dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::f64: return "F64";
    case DType::f8e4m3: return "F8_E4M3";
    case DType::ue8m0: return "F8_E8M0";
    case DType::f4e2m1: return "F4";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
    case DType::i8: return "I8";
    case DType::boolean: return "BOOL";
  }
  return "?";
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY);
  MOEKIT_CHECK_CODE(fd >= 0, io, path, ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    MOEKIT_FAIL(io, path, ": cannot stat");
  }
  const uint64_t size = uint64_t(st.st_size);
  if (size < 8) {
    ::close(fd);
    MOEKIT_FAIL(io, path, ": truncated: ", size, " bytes, a safetensors file has at least 8");
  }
  void* m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  MOEKIT_CHECK_CODE(m != MAP_FAILED, io, path, ": mmap failed (", std::strerror(errno), ")");
  f.mapping_ = std::shared_ptr<void>(m, [size](void* p) { munmap(p, size); });
  const auto* bytes = static_cast<const uint8_t*>(m);
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes, 8);  // little-endian
  MOEKIT_CHECK_CODE(hlen <= kMaxHeader, io, path, ": header length ", hlen, " exceeds the 100 MB limit");
  MOEKIT_CHECK_CODE(hlen <= size - 8, io, path, ": header length ", hlen, " runs beyond the end of the file (",
                    size, " bytes)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + hlen);
  } catch (const std::exception& e) {
    MOEKIT_FAIL(io, path, ": header is not valid JSON (", e.what(), ")");
  }
  MOEKIT_CHECK_CODE(header.is_object(), io, path, ": header is not a JSON object");
  const uint64_t data_size = size - 8 - hlen;
  f.data_ = bytes + 8 + hlen;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      MOEKIT_CHECK_CODE(it->is_object(), io, path, ": __metadata__ is not an object");
      for (auto m2 = it->begin(); m2 != it->end(); ++m2) {
        MOEKIT_CHECK_CODE(m2->is_string(), io, path, ": metadata '", m2.key(), "' is not a string");
        f.metadata_[m2.key()] = m2->get<std::string>();
      }
      continue;
    }
    const auto& v = *it;
    MOEKIT_CHECK_CODE(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"), io,
                      path, ": tensor '", name, "' needs dtype, shape and data_offsets");
    MOEKIT_CHECK_CODE(v["dtype"].is_string(), io, path, ": tensor '", name, "' dtype is not a string");
    SafetensorsEntry e;
    e.name = name;
    e.dtype = parse_st_dtype(v["dtype"].get<std::string>(), path, name);
    MOEKIT_CHECK_CODE(v["shape"].is_array(), io, path, ": tensor '", name, "' shape is not an array");
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      MOEKIT_CHECK_CODE(d.is_number_unsigned(), io, path, ": tensor '", name, "' has a bad dimension ", d.dump());
      const uint64_t x = d.get<uint64_t>();
      MOEKIT_CHECK_CODE(x == 0 || numel <= (uint64_t(1) << 62) / x, io, path, ": tensor '", name,
                        "' shape overflows");
      numel *= x;
      e.shape.push_back(int64_t(x));
    }
    const auto& off = v["data_offsets"];
    MOEKIT_CHECK_CODE(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                      io, path, ": tensor '", name, "' data_offsets must be two unsigned integers");
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    MOEKIT_CHECK_CODE(e.begin <= e.end, io, path, ": tensor '", name, "' offsets reversed [", e.begin, ", ", e.end, "]");
    MOEKIT_CHECK_CODE(e.end <= data_size, io, path, ": tensor '", name, "' offsets [", e.begin, ", ", e.end,
                      "] leave the data section (", data_size, " bytes): file truncated?");
    const uint64_t expect = (numel * uint64_t(dtype_bits(e.dtype)) + 7) / 8;
    MOEKIT_CHECK_CODE(e.end - e.begin == expect, io, path, ": tensor '", name, "' has ", e.end - e.begin,
                      " bytes but shape ", shape_to_string(e.shape), " of ", dtype_name(e.dtype), " needs ", expect);
    f.entries_.push_back(std::move(e));
  }
  // No two tensors may overlap.
  std::vector<const SafetensorsEntry*> sorted;
  for (const auto& e : f.entries_) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    MOEKIT_CHECK_CODE(sorted[i]->begin >= sorted[i - 1]->end || sorted[i - 1]->begin == sorted[i - 1]->end, io, path,
                      ": tensors '", sorted[i - 1]->name, "' and '", sorted[i]->name, "' overlap");
  }
  for (size_t i = 0; i < f.entries_.size(); ++i) f.index_[f.entries_[i].name] = i;
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.name);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) != 0; }

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = index_.find(name);
  MOEKIT_CHECK_CODE(it != index_.end(), not_found, path_, ": no tensor named '", name, "' (", entries_.size(),
                    " tensors in the file)");
  return entries_[it->second];
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  TensorView v(const_cast<uint8_t*>(data_ + e.begin), e.dtype, e.shape, Device::cpu());
  return Tensor::wrap(v, mapping_);
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t off = 0;
  std::vector<Tensor> host;
  for (const auto& [name, t] : tensors) {
    MOEKIT_CHECK(name != "__metadata__" && !name.empty(), "save_safetensors: bad tensor name '", name, "'");
    Tensor h = t.device().is_cpu() ? t.contiguous() : t.to(Device::cpu());
    const uint64_t n = h.nbytes();
    header[name] = {{"dtype", st_dtype_name(h.dtype())}, {"shape", h.shape()}, {"data_offsets", {off, off + n}}};
    off += n;
    host.push_back(std::move(h));
  }
  std::string hs = header.dump();
  while ((hs.size() + 8) % 8 != 0) hs.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MOEKIT_CHECK_CODE(out.good(), io, path, ": cannot open for writing");
  const uint64_t hlen = hs.size();
  out.write(reinterpret_cast<const char*>(&hlen), 8);
  out.write(hs.data(), std::streamsize(hs.size()));
  for (const auto& h : host) out.write(static_cast<const char*>(h.data()), std::streamsize(h.nbytes()));
  MOEKIT_CHECK_CODE(out.good(), io, path, ": write failed");
}

}  // namespace moekit

#include "moekit/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "io/input.h"

namespace moekit {
namespace {

constexpr uint64_t kMaxHeader = 100ull * 1000 * 1000;  // 100 MB, as the reference implementation
constexpr uint64_t kMaxDim = uint64_t(1) << 62;        // keeps every shape product inside int64
constexpr size_t kMaxHeaderArray = 4096;               // dimensions of one shape, at most

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::f32, "F32"},         {DType::bf16, "BF16"},       {DType::f16, "F16"}, {DType::f64, "F64"},
    {DType::f8e4m3, "F8_E4M3"},  {DType::ue8m0, "F8_E8M0"},  {DType::f4e2m1, "F4"}, {DType::i32, "I32"},
    {DType::i64, "I64"},         {DType::u8, "U8"},           {DType::i8, "I8"},   {DType::boolean, "BOOL"},
};

std::string known_dtypes() {
  std::string s;
  for (const auto& d : kDTypeNames) s += std::string(s.empty() ? "" : ", ") + d.name;
  return s;
}

// Byte size of `numel` elements of `t`; an empty string, or why there is none.
std::string byte_size(DType t, uint64_t numel, uint64_t& bytes) {
  const uint64_t bits = uint64_t(dtype_bits(t));
  if (bits % 8 == 0) {
    if (numel > std::numeric_limits<uint64_t>::max() / (bits / 8)) return "overflows the byte count";
    bytes = numel * (bits / 8);
    return "";
  }
  const uint64_t per_byte = 8 / bits;  // sub-byte types: whole bytes only, as the reference implementation
  if (numel % per_byte != 0) return "does not fill whole bytes";
  bytes = numel / per_byte;
  return "";
}

// Up to three names close to `name` (longest shared prefix, then shared suffix), for "did you mean".
std::string close_names(const std::string& name, const std::vector<std::string>& names) {
  std::vector<std::pair<size_t, const std::string*>> scored;
  for (const auto& n : names) {
    size_t p = 0, s = 0;
    while (p < n.size() && p < name.size() && n[p] == name[p]) ++p;
    while (s < n.size() && s < name.size() && n[n.size() - 1 - s] == name[name.size() - 1 - s]) ++s;
    scored.push_back({p * 4 + s, &n});
  }
  const size_t k = std::min<size_t>(3, scored.size());
  std::partial_sort(scored.begin(), scored.begin() + long(k), scored.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && *a.second < *b.second); });
  std::string out;
  for (size_t i = 0; i < k; ++i) out += std::string(i ? ", '" : "'") + *scored[i].second + "'";
  return out;
}

// Reads the header in one linear pass, one top-level entry at a time, without a DOM of the whole
// header: each tensor entry becomes a small JSON object holding only the fields a tensor has (dtype,
// shape, data_offsets; other fields are skipped unread), handed to `on_entry` when it closes. Memory
// stays proportional to the entries read. Refuses, in `problem`: invalid JSON, nesting deeper than a
// header's three levels (object, entry, shape), more than kMaxHeaderArray elements in one array, and
// duplicate keys (entry names, a tensor's fields, metadata keys).
class HeaderSax {
 public:
  using json = nlohmann::json;
  using OnEntry = std::function<void(const std::string& name, const json& value)>;
  explicit HeaderSax(OnEntry on_entry) : on_entry_(std::move(on_entry)) {}
  std::string top_type;  // the header's JSON type when it is not an object
  std::string problem;

  bool null() { return scalar(json(nullptr)); }
  bool boolean(bool v) { return scalar(json(v)); }
  bool number_integer(json::number_integer_t v) { return scalar(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return scalar(json(v)); }
  bool number_float(json::number_float_t v, const json::string_t&) { return scalar(json(v)); }
  bool string(json::string_t& v) { return scalar(json(v)); }
  bool binary(json::binary_t&) { return scalar(json()); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    if (depth_ == 1 && top_type.empty()) {
      name_ = k;
      if (!names_.insert(k).second) return fail("has the key '" + printable(k, 80) + "' more than once");
    }
    if (depth_ == 2) {
      field_ = k;
      if (keep_field() && entry_.contains(k)) return fail("has the key '" + printable(k, 80) + "' more than once");
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    return fail(std::string("is not valid JSON (") + e.what() + ")");
  }

 private:
  bool fail(std::string what) {
    if (problem.empty()) problem = std::move(what);
    return false;
  }
  bool keep_field() const {
    return entry_.is_object() &&
           (name_ == "__metadata__" || field_ == "dtype" || field_ == "shape" || field_ == "data_offsets");
  }
  bool count() {  // one more element in the innermost array
    if (!in_array_.empty() && in_array_.back() && ++elements_.back() > kMaxHeaderArray)
      return fail("has an array of more than " + std::to_string(kMaxHeaderArray) + " elements");
    return true;
  }
  bool scalar(json v) {
    if (!count()) return false;
    if (!top_type.empty()) return true;  // reported after the parse
    if (depth_ == 0) {
      top_type = v.type_name();
    } else if (depth_ == 1) {
      on_entry_(name_, v);
    } else if (depth_ == 2) {
      if (keep_field()) entry_[field_] = std::move(v);
    } else if (depth_ == 3 && collecting_) {
      entry_[field_].push_back(std::move(v));
    }
    return true;
  }
  bool open(json container) {
    if (!count()) return false;
    if (depth_ >= 3) return fail("nests deeper than 3 levels (an object of tensor entries holding arrays of integers)");
    in_array_.push_back(container.is_array());
    elements_.push_back(0);
    if (depth_ == 0 && !container.is_object()) top_type = container.type_name();
    if (!top_type.empty()) {
      ++depth_;
      return true;
    }
    if (depth_ == 1) entry_ = std::move(container);
    if (depth_ == 2) {
      // Arrays of the kept fields are collected (their elements are scalars); objects there become an
      // empty placeholder; containers of other fields are skipped.
      collecting_ = keep_field() && container.is_array();
      if (keep_field()) entry_[field_] = std::move(container);
    }
    ++depth_;
    return true;
  }
  bool close() {
    --depth_;
    in_array_.pop_back();
    elements_.pop_back();
    if (!top_type.empty()) return true;
    if (depth_ == 2) collecting_ = false;
    if (depth_ == 1) {
      on_entry_(name_, entry_);
      entry_ = json();
    }
    return true;
  }
  OnEntry on_entry_;
  int depth_ = 0;
  bool collecting_ = false;
  std::vector<bool> in_array_;
  std::vector<size_t> elements_;
  std::unordered_set<std::string> names_;
  std::string name_, field_;
  json entry_;
};

}  // namespace

const char* safetensors_dtype_name(DType t) {
  for (const auto& d : kDTypeNames)
    if (d.dtype == t) return d.name;
  MOEKIT_FAIL(invalid_argument, "dtype ", dtype_name(t), " has no safetensors name");
}

DType parse_safetensors_dtype(const std::string& name) {
  for (const auto& d : kDTypeNames)
    if (name == d.name) return d.dtype;
  MOEKIT_FAIL(io, "unknown safetensors dtype '", name, "' (known: ", known_dtypes(), ")");
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  require_regular_file(path);  // a FIFO would block open(); a directory is not "no such file"
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  MOEKIT_CHECK_CODE(fd >= 0, io, printable(path), ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    MOEKIT_FAIL(io, path, ": not a regular file");
  }
  const uint64_t size = uint64_t(st.st_size);
  if (size < 8) {
    ::close(fd);
    MOEKIT_FAIL(io, path, ": truncated: ", size, " bytes, a safetensors file has at least 8 (the header length)");
  }
  // Private and writable: a caller that writes into a tensor gets its own page, never a changed file.
  // Where the system will not commit that much copy-on-write memory (strict overcommit, a file larger
  // than memory), the mapping is read-only.
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  if (m == MAP_FAILED && errno == ENOMEM) m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);
  MOEKIT_CHECK_CODE(m != MAP_FAILED, io, path, ": mmap failed (", std::strerror(mmap_errno), ")");
  f.mapping_ = std::shared_ptr<void>(m, [size](void* p) { munmap(p, size); });
  f.file_size_ = size;
  const auto* bytes = static_cast<const uint8_t*>(m);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | bytes[i];  // little-endian
  MOEKIT_CHECK_CODE(hlen <= kMaxHeader, io, path, ": header length ", hlen, " exceeds the 100 MB limit");
  MOEKIT_CHECK_CODE(hlen <= size - 8, io, path, ": header length ", hlen, " runs beyond the end of the file (",
                    size, " bytes): truncated?");
  f.header_size_ = hlen;

  const char* htext = reinterpret_cast<const char*>(bytes + 8);
  const uint64_t data_size = size - 8 - hlen;
  f.data_ = bytes + 8 + hlen;

  // Each entry is checked as it closes (see HeaderSax): never a DOM of the whole header.
  const auto on_entry = [&](const std::string& name, const nlohmann::json& entry) {
    const nlohmann::json* it = &entry;
    if (name == "__metadata__") {
      MOEKIT_CHECK_CODE(it->is_object(), io, path, ": __metadata__ is not an object");
      for (auto m2 = it->begin(); m2 != it->end(); ++m2) {
        MOEKIT_CHECK_CODE(m2->is_string(), io, path, ": metadata '", printable(m2.key()), "' is not a string");
        f.metadata_[m2.key()] = m2->get<std::string>();
      }
      return;
    }
    const auto& v = *it;
    MOEKIT_CHECK_CODE(v.is_object(), io, path, ": tensor '", printable(name), "' is not an object");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      MOEKIT_CHECK_CODE(v.contains(field), io, path, ": tensor '", printable(name), "' has no '", field, "'");
    MOEKIT_CHECK_CODE(v["dtype"].is_string(), io, path, ": tensor '", printable(name), "' dtype is not a string");
    SafetensorsEntry e;
    e.name = name;
    const std::string dt = v["dtype"].get<std::string>();
    bool known = false;
    for (const auto& d : kDTypeNames)
      if (dt == d.name) e.dtype = d.dtype, known = true;
    MOEKIT_CHECK_CODE(known, io, path, ": tensor '", printable(name), "' has unknown dtype '", dt,
                      "' (known: ", known_dtypes(), ")");
    MOEKIT_CHECK_CODE(v["shape"].is_array(), io, path, ": tensor '", printable(name), "' shape is not an array");
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      MOEKIT_CHECK_CODE(d.is_number_unsigned(), io, path, ": tensor '", printable(name), "' has a bad dimension ",
                        json_brief(d), " (dimensions are non-negative integers)");
      const uint64_t x = d.get<uint64_t>();
      MOEKIT_CHECK_CODE(x <= kMaxDim && (x == 0 || numel <= kMaxDim / x), io, path, ": tensor '", printable(name),
                        "' shape ", json_brief(v["shape"]), " overflows the element count");
      numel *= x;
      e.shape.push_back(int64_t(x));
    }
    const auto& off = v["data_offsets"];
    MOEKIT_CHECK_CODE(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                      io, path, ": tensor '", printable(name), "' data_offsets must be two non-negative integers, got ",
                      json_brief(off));
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    MOEKIT_CHECK_CODE(e.begin <= e.end, io, path, ": tensor '", printable(name), "' offsets reversed [", e.begin, ", ",
                      e.end, "]");
    MOEKIT_CHECK_CODE(e.end <= data_size, io, path, ": tensor '", printable(name), "' offsets [", e.begin, ", ", e.end,
                      "] leave the data section (", data_size, " bytes): file truncated?");
    uint64_t expect = 0;
    const std::string size_problem = byte_size(e.dtype, numel, expect);
    MOEKIT_CHECK_CODE(size_problem.empty(), io, path, ": tensor '", printable(name), "' shape ",
                      shape_to_string(e.shape), " of ", dt, " ", size_problem);
    MOEKIT_CHECK_CODE(e.end - e.begin == expect, io, path, ": tensor '", printable(name), "' has ", e.end - e.begin,
                      " bytes but shape ", shape_to_string(e.shape), " of ", dt, " needs ", expect);
    f.entries_.push_back(std::move(e));
  };
  HeaderSax sax(on_entry);
  const bool parsed = nlohmann::json::sax_parse(htext, htext + hlen, &sax);
  MOEKIT_CHECK_CODE(sax.problem.empty(), io, path, ": header ", sax.problem);
  MOEKIT_CHECK_CODE(parsed, io, path, ": header is not valid JSON");
  MOEKIT_CHECK_CODE(sax.top_type.empty(), io, path, ": header is not a JSON object (", sax.top_type, ")");

  // The tensors tile the data section exactly: no overlap, no gap, nothing after the last one.
  std::sort(f.entries_.begin(), f.entries_.end(),
            [](const auto& a, const auto& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  uint64_t pos = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : f.entries_) {
    MOEKIT_CHECK_CODE(e.begin >= pos, io, path, ": tensors '", prev ? printable(prev->name) : "", "' [",
                      prev ? prev->begin : 0, ", ", pos, "] and '", e.name, "' [", e.begin, ", ", e.end, "] overlap");
    MOEKIT_CHECK_CODE(e.begin == pos, io, path, ": data bytes [", pos, ", ", e.begin,
                      ") belong to no tensor (gap before '", printable(e.name), "')");
    pos = e.end;
    prev = &e;
  }
  MOEKIT_CHECK_CODE(pos == data_size, io, path, ": ", data_size - pos, " bytes after the last tensor's data (",
                    data_size, " bytes of data, tensors end at ", pos, ")");
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
  if (it == index_.end()) {
    MOEKIT_FAIL(not_found, path_, ": no tensor named '", printable(name), "' (", entries_.size(), " tensors",
                entries_.empty() ? std::string() : "; close: " + close_names(name, names()), ")");
  }
  return entries_[it->second];
}

void SafetensorsFile::release(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data_ + e.begin) + page - 1) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data_ + e.end) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  TensorView v(const_cast<uint8_t*>(data_ + e.begin), e.dtype, e.shape, Device::cpu());
  const uint64_t align = uint64_t(std::max(1, dtype_bits(e.dtype) / 8));
  if (reinterpret_cast<uintptr_t>(v.data) % align != 0) return Tensor::copy_of(v, Device::cpu());
  return Tensor::wrap(v, mapping_);
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t off = 0;
  std::vector<Tensor> host;
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    MOEKIT_CHECK(name != "__metadata__", "save_safetensors: '__metadata__' cannot name a tensor");
    MOEKIT_CHECK(seen.insert(name).second, "save_safetensors: tensor '", name, "' given twice");
    MOEKIT_CHECK(t.defined(), "save_safetensors: tensor '", name, "' is undefined");
    Tensor h = t.device().is_cpu() ? t.contiguous() : t.to(Device::cpu()).contiguous();
    uint64_t n = 0;
    const std::string size_problem = byte_size(h.dtype(), uint64_t(h.numel()), n);
    MOEKIT_CHECK(size_problem.empty(), "save_safetensors: tensor '", name, "' ", h.view().to_string(), " ",
                 size_problem);
    header[name] = {{"dtype", safetensors_dtype_name(h.dtype())},
                    {"shape", h.shape()},
                    {"data_offsets", {off, off + n}}};
    off += n;
    host.push_back(std::move(h));
  }
  std::string hs = header.dump();
  while (hs.size() % 8 != 0) hs.push_back(' ');  // data starts 8-byte aligned
  const std::string tmp = path + ".partial";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    MOEKIT_CHECK_CODE(out.good(), io, path, ": cannot open for writing (", std::strerror(errno), ")");
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(hs.size()) >> (8 * i));
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(hs.data(), std::streamsize(hs.size()));
    for (const auto& h : host) out.write(static_cast<const char*>(h.data()), std::streamsize(h.nbytes()));
    out.flush();
    if (!out.good()) {
      out.close();
      std::remove(tmp.c_str());
      MOEKIT_FAIL(io, path, ": write failed");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    MOEKIT_FAIL(io, path, ": cannot move the written file into place (", std::strerror(err), ")");
  }
}

}  // namespace moekit

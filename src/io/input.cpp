#include "io/input.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <unordered_set>
#include <vector>

#include "moekit/error.h"

namespace moekit {
namespace {

// Checks depth, array lengths and duplicate keys while the parser reads; builds nothing.
class PrecheckSax {
 public:
  using json = nlohmann::json;
  explicit PrecheckSax(const JsonLimits& l) : limits_(l) {}
  std::string problem;

  bool null() { return value(); }
  bool boolean(bool) { return value(); }
  bool number_integer(json::number_integer_t) { return value(); }
  bool number_unsigned(json::number_unsigned_t) { return value(); }
  bool number_float(json::number_float_t, const json::string_t&) { return value(); }
  bool string(json::string_t&) { return value(); }
  bool binary(json::binary_t&) { return value(); }
  bool start_object(std::size_t) { return open(true); }
  bool start_array(std::size_t) { return open(false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    if (!limits_.reject_duplicate_keys) return true;
    if (!stack_.back().insert(k)) {
      problem = "has the key '" + printable(k, 80) + "' more than once";
      return false;
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    problem = std::string("is not valid JSON (") + e.what() + ")";
    return false;
  }

 private:
  struct Frame {
    bool object = false;
    size_t count = 0;
    std::vector<std::string> few;  // the first keys: most objects have a handful
    std::unordered_set<std::string> many;
    bool insert(const std::string& k) {
      if (many.empty()) {
        for (const auto& f : few)
          if (f == k) return false;
        few.push_back(k);
        if (few.size() > 16) {
          many.insert(few.begin(), few.end());
          few.clear();
        }
        return true;
      }
      return many.insert(k).second;
    }
  };
  bool value() {
    if (stack_.empty() || stack_.back().object) return true;
    if (++stack_.back().count > limits_.max_array) {
      problem = "has an array of more than " + std::to_string(limits_.max_array) + " elements at depth " +
                std::to_string(stack_.size());
      return false;
    }
    return true;
  }
  bool open(bool object) {
    if (!value()) return false;
    if (int(stack_.size()) >= limits_.max_depth) {
      problem = "nests deeper than " + std::to_string(limits_.max_depth) + " levels";
      return false;
    }
    stack_.emplace_back();
    stack_.back().object = object;
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }
  const JsonLimits& limits_;
  std::vector<Frame> stack_;
};

void brief_into(const nlohmann::json& v, std::string& out, size_t max_chars, int depth) {
  if (out.size() > max_chars) return;
  if (v.is_object() || v.is_array()) {
    out += v.is_object() ? '{' : '[';
    if (depth > 8 && !v.empty()) out += "...";
    bool first = true;
    if (depth <= 8)
      for (auto it = v.begin(); it != v.end() && out.size() <= max_chars; ++it) {
        if (!first) out += ',';
        first = false;
        if (v.is_object()) out += nlohmann::json(it.key()).dump() + ':';
        brief_into(*it, out, max_chars, depth + 1);
      }
    out += v.is_object() ? '}' : ']';
    return;
  }
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    out += nlohmann::json(s.size() > max_chars ? s.substr(0, max_chars) : s).dump();
    return;
  }
  out += v.dump();
}

const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "is a directory (not a regular file)";
  if (S_ISFIFO(m)) return "is a FIFO (not a regular file)";
  if (S_ISSOCK(m)) return "is a socket (not a regular file)";
  if (S_ISCHR(m) || S_ISBLK(m)) return "is a device (not a regular file)";
  return "is not a regular file";
}

}  // namespace

std::string json_precheck(const char* begin, const char* end, const JsonLimits& limits) {
  PrecheckSax sax(limits);
  const bool ok = nlohmann::json::sax_parse(begin, end, &sax);
  if (!ok && sax.problem.empty()) return "is not valid JSON";
  return ok ? std::string() : sax.problem;
}

nlohmann::json parse_json_bounded(const char* begin, const char* end, const std::string& source,
                                  const JsonLimits& limits) {
  const std::string problem = json_precheck(begin, end, limits);
  MOEKIT_CHECK_CODE(problem.empty(), io, source, ": ", problem);
  try {
    return nlohmann::json::parse(begin, end);
  } catch (const std::exception& e) {
    MOEKIT_FAIL(io, source, ": is not valid JSON (", e.what(), ")");
  }
}

std::string json_brief(const nlohmann::json& v, size_t max_chars) {
  std::string out;
  brief_into(v, out, max_chars, 0);
  if (out.size() > max_chars) out = out.substr(0, max_chars > 3 ? max_chars - 3 : 0) + "...";
  return out;
}

std::string printable(std::string_view s, size_t max_chars) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (const char ch : s) {
    if (out.size() >= max_chars) {
      out += "...";
      break;
    }
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

uint64_t require_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    MOEKIT_CHECK_CODE(err != ENOENT && err != ENOTDIR, not_found, printable(path), ": no such file");
    MOEKIT_FAIL(io, printable(path), ": cannot read (", std::strerror(err), ")");
  }
  MOEKIT_CHECK_CODE(S_ISREG(st.st_mode), io, printable(path), ": ", file_kind(st.st_mode));
  return uint64_t(st.st_size);
}

std::string read_regular_file(const std::string& path, uint64_t max_bytes) {
  require_regular_file(path);
  // Non-blocking, and checked again on the open descriptor: the path may change between the two.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  MOEKIT_CHECK_CODE(fd >= 0, io, printable(path), ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    MOEKIT_FAIL(io, printable(path), ": ", file_kind(st.st_mode));
  }
  if (uint64_t(st.st_size) > max_bytes) {
    ::close(fd);
    MOEKIT_FAIL(io, printable(path), ": ", uint64_t(st.st_size), " bytes, more than the ", max_bytes,
                " this file may have");
  }
  std::string text(size_t(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += size_t(n);
  }
  ::close(fd);
  text.resize(got);
  return text;
}

}  // namespace moekit

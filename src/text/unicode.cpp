#include "unicode.h"

#include <algorithm>

#include "moekit/error.h"
#include "unicode_tables.h"

namespace moekit::text {
namespace {

uint8_t lookup(const tables::Range* r, size_t n, uint32_t cp) {
  const tables::Range* end = r + n;
  const tables::Range* it = std::upper_bound(r, end, cp, [](uint32_t v, const tables::Range& x) { return v < x.lo; });
  if (it == r) return 0;
  --it;
  return cp <= it->hi ? it->value : 0;
}

constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

uint8_t ccc(uint32_t cp) { return cp < 0x300 ? 0 : lookup(tables::combining_ranges, tables::combining_ranges_size, cp); }

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto* b = tables::decompositions;
  const auto* e = b + tables::decompositions_size;
  const auto* it = std::lower_bound(b, e, cp, [](const tables::Decomposition& d, uint32_t v) { return d.cp < v; });
  if (it == e || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  decompose(it->first, out);
  if (it->second) decompose(it->second, out);
}

// The primary composite of (a, b), or 0.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  const auto* bg = tables::compositions;
  const auto* e = bg + tables::compositions_size;
  const auto* it = std::lower_bound(bg, e, std::pair<uint32_t, uint32_t>(a, b),
                                    [](const tables::Composition& c, const std::pair<uint32_t, uint32_t>& v) {
                                      return c.first != v.first ? c.first < v.first : c.second < v.second;
                                    });
  return it != e && it->first == a && it->second == b ? it->cp : 0;
}

}  // namespace

Category category(uint32_t cp) {
  return Category(lookup(tables::category_ranges, tables::category_ranges_size, cp));
}

char major_class(Category c) {
  static const char kMajor[] = "CLLLLLMMMNNNPPPPPPPSSSSZZZCCCC";
  return kMajor[size_t(c)];
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = uint8_t(s[i]);
    uint32_t cp = 0;
    int n = 0;
    if (b0 < 0x80) {
      cp = b0, n = 1;
    } else if (b0 >= 0xC2 && b0 <= 0xDF) {
      cp = b0 & 0x1F, n = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      cp = b0 & 0x0F, n = 3;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      cp = b0 & 0x07, n = 4;
    }
    bool ok = n > 0 && i + size_t(n) <= s.size();
    for (int k = 1; ok && k < n; ++k) {
      const auto b = uint8_t(s[i + size_t(k)]);
      ok = (b & 0xC0) == 0x80;
      cp = (cp << 6) | (b & 0x3F);
    }
    if (ok && n == 3) ok = cp >= 0x800 && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (ok && n == 4) ok = cp >= 0x10000 && cp <= 0x10FFFF;
    MOEKIT_CHECK(ok, "invalid UTF-8 at byte offset ", i, " (byte 0x", std::hex, int(b0), std::dec, ")");
    out.push_back(cp);
    i += size_t(n);
  }
  return out;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

std::string utf8_encode(const std::vector<uint32_t>& cps) {
  std::string s;
  s.reserve(cps.size());
  for (uint32_t cp : cps) utf8_append(s, cp);
  return s;
}

std::string utf8_lossy(std::string_view s) {
  // Rust's from_utf8_lossy: each maximal prefix of a valid sequence that turns out invalid is one U+FFFD.
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = uint8_t(s[i]);
    if (b0 < 0x80) {
      out += char(b0);
      ++i;
      continue;
    }
    int n = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) n = 2;
    else if (b0 >= 0xE0 && b0 <= 0xEF) n = 3, lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
    else if (b0 >= 0xF0 && b0 <= 0xF4) n = 4, lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    size_t k = 1;
    for (; k < size_t(n) && i + k < s.size(); ++k) {
      const auto b = uint8_t(s[i + k]);
      if (k == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) break;
    }
    if (k == size_t(n)) out.append(s.substr(i, k));
    else out += "\xEF\xBF\xBD";
    i += k;
  }
  return out;
}

std::vector<uint32_t> nfc(const std::vector<uint32_t>& cps) {
  if (std::all_of(cps.begin(), cps.end(), [](uint32_t c) { return c < 0x300; })) return cps;
  std::vector<uint32_t> d;
  d.reserve(cps.size());
  for (uint32_t cp : cps) decompose(cp, d);
  // Canonical ordering: a stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < d.size();) {
    if (ccc(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && ccc(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + long(i), d.begin() + long(j), [](uint32_t a, uint32_t b) { return ccc(a) < ccc(b); });
    i = j;
  }
  // Canonical composition.
  std::vector<uint32_t> out;
  out.reserve(d.size());
  long starter = -1;
  int last_ccc = -1;
  for (uint32_t cp : d) {
    const int c = ccc(cp);
    if (starter >= 0) {
      const bool blocked = last_ccc != -1 && (last_ccc == 0 || last_ccc >= c);
      if (!blocked) {
        if (uint32_t comp = compose(out[size_t(starter)], cp)) {
          out[size_t(starter)] = comp;
          continue;
        }
      }
    }
    if (c == 0) {
      starter = long(out.size());
      last_ccc = -1;
    } else {
      last_ccc = c;
    }
    out.push_back(cp);
  }
  return out;
}

}  // namespace moekit::text

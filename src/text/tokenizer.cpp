// Tokenizer: tokenizer.json's pipeline, step by step as the `tokenizers` package runs it:
// added tokens split off the raw text -> normalizer -> pre-tokenizer (pieces) -> BPE per piece ->
// post-processor (template ids); decoding maps ids to tokens and runs the decoder chain.
#include "moekit/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "moekit/error.h"
#include "regex.h"
#include "unicode.h"

namespace moekit {

using text::Regex;
using json = nlohmann::json;
using Cps = std::vector<uint32_t>;

namespace {

// ---- tokenizer.json access with errors that name the field --------------------------------------------

constexpr int64_t kMaxId = int64_t(1) << 24;  // ids and counts in tokenizer.json (vocabularies are ~2^18)

struct Src {
  std::string name;
  [[noreturn]] void fail(const std::string& where, const std::string& what) const {
    MOEKIT_FAIL(io, name, ": ", where, ": ", what);
  }
  const json& at(const json& j, const std::string& key, const std::string& where) const {
    if (!j.is_object() || !j.contains(key)) fail(where, "missing field \"" + key + "\"");
    return j.at(key);
  }
  std::string str(const json& j, const std::string& key, const std::string& where) const {
    const json& v = at(j, key, where);
    if (!v.is_string()) fail(where + "." + key, "expected a string, got " + v.dump());
    return v.get<std::string>();
  }
  std::string str_or(const json& j, const std::string& key, const std::string& where, const std::string& d) const {
    if (!j.is_object() || !j.contains(key) || j.at(key).is_null()) return d;
    return str(j, key, where);
  }
  bool boolean_or(const json& j, const std::string& key, const std::string& where, bool d) const {
    if (!j.is_object() || !j.contains(key) || j.at(key).is_null()) return d;
    const json& v = j.at(key);
    if (!v.is_boolean()) fail(where + "." + key, "expected true or false, got " + v.dump());
    return v.get<bool>();
  }
  int64_t integer(const json& v, const std::string& where) const {
    if (!v.is_number_integer()) fail(where, "expected an integer, got " + v.dump());
    const int64_t i = v.get<int64_t>();
    if (i < 0 || i >= kMaxId) fail(where, std::to_string(i) + " is out of range [0, " + std::to_string(kMaxId) + ")");
    return i;
  }
};

Cps cps_of(const std::string& s) { return text::utf8_decode(s); }
std::string str_of(const Cps& c) { return text::utf8_encode(c); }

// GPT-2's byte <-> printable character map.
struct ByteMap {
  uint32_t to_char[256];
  std::unordered_map<uint32_t, uint8_t> to_byte;
  ByteMap() {
    uint32_t n = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = keep ? b : 256 + n++;
      to_byte[to_char[b]] = uint8_t(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- pieces and splitting --------------------------------------------------------------------------------

struct Piece {
  Cps cps;
  bool at_start = false;  // begins at offset 0 of the original text
};

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

Behavior parse_behavior(const Src& s, const std::string& b, const std::string& where) {
  if (b == "Removed") return Behavior::removed;
  if (b == "Isolated") return Behavior::isolated;
  if (b == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (b == "MergedWithNext") return Behavior::merged_with_next;
  if (b == "Contiguous") return Behavior::contiguous;
  s.fail(where, "unknown split behavior \"" + b + "\"");
}

// Splits p at the matches ([begin, end) code point ranges, sorted, disjoint) as the behavior says.
void split_piece(const Piece& p, const std::vector<std::pair<size_t, size_t>>& matches, Behavior b, bool invert,
                 std::vector<Piece>& out) {
  struct Seg {
    size_t lo, hi;
    bool match;
  };
  std::vector<Seg> segs;
  size_t at = 0;
  for (const auto& [lo, hi] : matches) {
    if (lo > at) segs.push_back({at, lo, invert});
    segs.push_back({lo, hi, !invert});
    at = hi;
  }
  if (at < p.cps.size()) segs.push_back({at, p.cps.size(), invert});
  std::vector<Seg> res;
  switch (b) {
    case Behavior::isolated: res.swap(segs); break;
    case Behavior::removed:
      for (const auto& s : segs)
        if (!s.match) res.push_back(s);
      break;
    case Behavior::merged_with_previous: {
      bool prev = false;
      for (const auto& s : segs) {
        if (s.match && !prev && !res.empty()) res.back().hi = s.hi;
        else res.push_back(s);
        prev = s.match;
      }
      break;
    }
    case Behavior::merged_with_next: {
      bool prev = false;
      for (size_t i = segs.size(); i-- > 0;) {
        const Seg& s = segs[i];
        if (s.match && !prev && !res.empty()) res.back().lo = s.lo;
        else res.push_back(s);
        prev = s.match;
      }
      std::reverse(res.begin(), res.end());
      break;
    }
    case Behavior::contiguous: {
      bool prev = false;
      for (const auto& s : segs) {
        if (s.match && prev && !res.empty()) res.back().hi = s.hi;
        else res.push_back(s);
        prev = s.match;
      }
      break;
    }
  }
  for (const auto& s : res) {
    if (s.hi <= s.lo) continue;
    Piece q;
    q.cps.assign(p.cps.begin() + long(s.lo), p.cps.begin() + long(s.hi));
    q.at_start = p.at_start && s.lo == 0;
    out.push_back(std::move(q));
  }
}

std::vector<std::pair<size_t, size_t>> find_literal(const Cps& text, const Cps& lit) {
  std::vector<std::pair<size_t, size_t>> m;
  if (lit.empty()) return m;
  for (size_t i = 0; i + lit.size() <= text.size();) {
    if (std::equal(lit.begin(), lit.end(), text.begin() + long(i))) {
      m.emplace_back(i, i + lit.size());
      i += lit.size();
    } else {
      ++i;
    }
  }
  return m;
}

Cps replace_all(const Cps& text, const Cps& from, const Cps& to) {
  if (from.empty()) return text;
  Cps out;
  size_t last = 0;
  for (const auto& [lo, hi] : find_literal(text, from)) {
    out.insert(out.end(), text.begin() + long(last), text.begin() + long(lo));
    out.insert(out.end(), to.begin(), to.end());
    last = hi;
  }
  out.insert(out.end(), text.begin() + long(last), text.end());
  return out;
}

// ---- normalizers ----------------------------------------------------------------------------------------

struct Normalizer {
  enum Kind { nfc, prepend, replace, lowercase, strip } kind;
  Cps a, b;                // prepend: a; replace: a -> b
  bool left = false, right = false;  // strip
};

void parse_normalizer(const Src& s, const json& j, const std::string& where, std::vector<Normalizer>& out) {
  if (j.is_null()) return;
  const std::string type = s.str(j, "type", where);
  if (type == "Sequence") {
    const json& list = s.at(j, "normalizers", where);
    if (!list.is_array()) s.fail(where + ".normalizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i)
      parse_normalizer(s, list[i], where + ".normalizers[" + std::to_string(i) + "]", out);
  } else if (type == "NFC") {
    out.push_back({Normalizer::nfc, {}, {}});
  } else if (type == "Prepend") {
    out.push_back({Normalizer::prepend, cps_of(s.str(j, "prepend", where)), {}});
  } else if (type == "Replace") {
    const json& pat = s.at(j, "pattern", where);
    if (!pat.contains("String")) s.fail(where + ".pattern", "only String patterns are supported, got " + pat.dump());
    out.push_back({Normalizer::replace, cps_of(s.str(pat, "String", where + ".pattern")),
                   cps_of(s.str(j, "content", where))});
  } else if (type == "Lowercase") {
    out.push_back({Normalizer::lowercase, {}, {}});
  } else if (type == "Strip") {
    Normalizer n{Normalizer::strip, {}, {}};
    n.left = s.boolean_or(j, "strip_left", where, false);
    n.right = s.boolean_or(j, "strip_right", where, false);
    out.push_back(n);
  } else {
    s.fail(where, "unsupported normalizer type \"" + type +
                      "\" (supported: Sequence, NFC, Prepend, Replace, Lowercase, Strip)");
  }
}

// ---- pre-tokenizers -------------------------------------------------------------------------------------

struct PreTokenizer {
  enum Kind { byte_level, split, metaspace, digits } kind;
  bool add_prefix_space = false, use_regex = true;   // byte_level
  std::shared_ptr<Regex> regex;                      // split (regex pattern), byte_level (GPT-2)
  Cps literal;                                       // split (string pattern)
  Behavior behavior = Behavior::isolated;
  bool invert = false;
  uint32_t replacement = 0x2581;                     // metaspace
  enum Prepend { always, first, never } prepend = always;
  bool metaspace_split = true;
  bool individual_digits = false;
};

PreTokenizer::Prepend parse_prepend(const Src& s, const json& j, const std::string& where) {
  if (j.contains("prepend_scheme") && !j.at("prepend_scheme").is_null()) {
    const std::string p = s.str(j, "prepend_scheme", where);
    if (p == "always") return PreTokenizer::always;
    if (p == "first") return PreTokenizer::first;
    if (p == "never") return PreTokenizer::never;
    s.fail(where + ".prepend_scheme", "unknown value \"" + p + "\" (always, first, never)");
  }
  return s.boolean_or(j, "add_prefix_space", where, true) ? PreTokenizer::always : PreTokenizer::never;
}

uint32_t one_char(const Src& s, const json& j, const std::string& key, const std::string& where) {
  const Cps c = cps_of(s.str(j, key, where));
  if (c.size() != 1) s.fail(where + "." + key, "expected one character");
  return c[0];
}

void parse_pre_tokenizer(const Src& s, const json& j, const std::string& where, std::vector<PreTokenizer>& out) {
  if (j.is_null()) return;
  const std::string type = s.str(j, "type", where);
  PreTokenizer p{};
  if (type == "Sequence") {
    const json& list = s.at(j, "pretokenizers", where);
    if (!list.is_array()) s.fail(where + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i)
      parse_pre_tokenizer(s, list[i], where + ".pretokenizers[" + std::to_string(i) + "]", out);
    return;
  }
  if (type == "ByteLevel") {
    p.kind = PreTokenizer::byte_level;
    p.add_prefix_space = s.boolean_or(j, "add_prefix_space", where, true);
    p.use_regex = s.boolean_or(j, "use_regex", where, true);
    if (p.use_regex) p.regex = std::make_shared<Regex>(kGpt2Pattern);
  } else if (type == "Split") {
    p.kind = PreTokenizer::split;
    const json& pat = s.at(j, "pattern", where);
    try {
      if (pat.contains("Regex")) p.regex = std::make_shared<Regex>(s.str(pat, "Regex", where + ".pattern"));
      else if (pat.contains("String")) p.literal = cps_of(s.str(pat, "String", where + ".pattern"));
      else s.fail(where + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}, got " + pat.dump());
    } catch (const Error& e) {
      if (e.code() == ErrorCode::io) throw;
      s.fail(where + ".pattern", e.what());
    }
    p.behavior = parse_behavior(s, s.str(j, "behavior", where), where + ".behavior");
    p.invert = s.boolean_or(j, "invert", where, false);
  } else if (type == "Metaspace") {
    p.kind = PreTokenizer::metaspace;
    p.replacement = one_char(s, j, "replacement", where);
    p.prepend = parse_prepend(s, j, where);
    p.metaspace_split = s.boolean_or(j, "split", where, true);
  } else if (type == "Digits") {
    p.kind = PreTokenizer::digits;
    p.individual_digits = s.boolean_or(j, "individual_digits", where, false);
  } else if (type == "Whitespace") {
    p.kind = PreTokenizer::split;
    p.regex = std::make_shared<Regex>(R"(\w+|[^\w\s]+)");
    p.behavior = Behavior::removed;
    p.invert = true;
  } else {
    s.fail(where, "unsupported pre_tokenizer type \"" + type +
                      "\" (supported: Sequence, ByteLevel, Split, Metaspace, Digits, Whitespace)");
  }
  out.push_back(std::move(p));
}

void apply_pre_tokenizer(const PreTokenizer& p, std::vector<Piece>& pieces) {
  std::vector<Piece> out;
  for (Piece& piece : pieces) {
    switch (p.kind) {
      case PreTokenizer::byte_level: {
        if (p.add_prefix_space && (piece.cps.empty() || piece.cps[0] != ' ')) piece.cps.insert(piece.cps.begin(), ' ');
        std::vector<Piece> parts;
        if (p.use_regex) split_piece(piece, p.regex->find_all(piece.cps), Behavior::isolated, false, parts);
        else parts.push_back(piece);
        for (Piece& q : parts) {
          Cps mapped;
          for (uint32_t cp : q.cps) {
            std::string bytes;
            text::utf8_append(bytes, cp);
            for (char c : bytes) mapped.push_back(byte_map().to_char[uint8_t(c)]);
          }
          q.cps = std::move(mapped);
          out.push_back(std::move(q));
        }
        break;
      }
      case PreTokenizer::split:
        split_piece(piece, p.regex ? p.regex->find_all(piece.cps) : find_literal(piece.cps, p.literal), p.behavior,
                    p.invert, out);
        break;
      case PreTokenizer::metaspace: {
        for (uint32_t& c : piece.cps)
          if (c == ' ') c = p.replacement;
        const bool starts = !piece.cps.empty() && piece.cps[0] == p.replacement;
        if (!starts && (p.prepend == PreTokenizer::always || (p.prepend == PreTokenizer::first && piece.at_start)))
          piece.cps.insert(piece.cps.begin(), p.replacement);
        if (p.metaspace_split) split_piece(piece, find_literal(piece.cps, {p.replacement}), Behavior::merged_with_next,
                                           false, out);
        else out.push_back(std::move(piece));
        break;
      }
      case PreTokenizer::digits: {
        std::vector<std::pair<size_t, size_t>> m;
        for (size_t i = 0; i < piece.cps.size(); ++i)
          if (text::major_class(text::category(piece.cps[i])) == 'N') m.emplace_back(i, i + 1);
        split_piece(piece, m, p.individual_digits ? Behavior::isolated : Behavior::contiguous, false, out);
        break;
      }
    }
  }
  pieces = std::move(out);
}

// ---- decoders -------------------------------------------------------------------------------------------

struct Decoder {
  enum Kind { byte_level, metaspace, replace, byte_fallback, fuse, strip } kind;
  uint32_t replacement = 0x2581;
  bool metaspace_prepend = true;
  std::string from, to;  // replace
  uint32_t content = ' ';
  size_t start = 0, stop = 0;  // strip
};

void parse_decoder(const Src& s, const json& j, const std::string& where, std::vector<Decoder>& out) {
  if (j.is_null()) return;
  const std::string type = s.str(j, "type", where);
  Decoder d{};
  if (type == "Sequence") {
    const json& list = s.at(j, "decoders", where);
    if (!list.is_array()) s.fail(where + ".decoders", "expected an array");
    for (size_t i = 0; i < list.size(); ++i)
      parse_decoder(s, list[i], where + ".decoders[" + std::to_string(i) + "]", out);
    return;
  }
  if (type == "ByteLevel") {
    d.kind = Decoder::byte_level;
  } else if (type == "Metaspace") {
    d.kind = Decoder::metaspace;
    d.replacement = one_char(s, j, "replacement", where);
    d.metaspace_prepend = parse_prepend(s, j, where) != PreTokenizer::never;
  } else if (type == "Replace") {
    d.kind = Decoder::replace;
    const json& pat = s.at(j, "pattern", where);
    if (!pat.contains("String")) s.fail(where + ".pattern", "only String patterns are supported, got " + pat.dump());
    d.from = s.str(pat, "String", where + ".pattern");
    d.to = s.str(j, "content", where);
  } else if (type == "ByteFallback") {
    d.kind = Decoder::byte_fallback;
  } else if (type == "Fuse") {
    d.kind = Decoder::fuse;
  } else if (type == "Strip") {
    d.kind = Decoder::strip;
    d.content = one_char(s, j, "content", where);
    d.start = size_t(s.integer(s.at(j, "start", where), where + ".start"));
    d.stop = size_t(s.integer(s.at(j, "stop", where), where + ".stop"));
  } else {
    s.fail(where, "unsupported decoder type \"" + type +
                      "\" (supported: Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip)");
  }
  out.push_back(d);
}

void apply_decoder(const Decoder& d, std::vector<std::string>& toks) {
  std::vector<std::string> out;
  switch (d.kind) {
    case Decoder::byte_level: {
      std::string bytes;
      for (const std::string& t : toks) {
        std::string b;
        bool ok = true;
        for (uint32_t c : cps_of(t)) {
          auto it = byte_map().to_byte.find(c);
          if (it == byte_map().to_byte.end()) {
            ok = false;
            break;
          }
          b += char(it->second);
        }
        bytes += ok ? b : t;
      }
      out.push_back(text::utf8_lossy(bytes));
      break;
    }
    case Decoder::metaspace:
      for (size_t i = 0; i < toks.size(); ++i) {
        std::string s;
        for (uint32_t c : cps_of(toks[i])) {
          if (c == d.replacement) {
            if (!(i == 0 && d.metaspace_prepend)) s += ' ';
          } else {
            text::utf8_append(s, c);
          }
        }
        out.push_back(std::move(s));
      }
      break;
    case Decoder::replace:
      for (const std::string& t : toks) {
        if (d.from.empty()) {
          out.push_back(t);
          continue;
        }
        std::string s;
        size_t at = 0;
        for (size_t f; (f = t.find(d.from, at)) != std::string::npos; at = f + d.from.size()) s += t.substr(at, f - at) + d.to;
        s += t.substr(at);
        out.push_back(std::move(s));
      }
      break;
    case Decoder::byte_fallback: {
      std::string pending;
      auto flush = [&] {
        if (pending.empty()) return;
        if (text::utf8_lossy(pending) == pending) out.push_back(pending);
        else
          for (size_t i = 0; i < pending.size(); ++i) out.push_back("\xEF\xBF\xBD");
        pending.clear();
      };
      for (const std::string& t : toks) {
        unsigned v = 0;
        const bool is_byte = t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
                             std::isxdigit(uint8_t(t[3])) && std::isxdigit(uint8_t(t[4])) &&
                             std::sscanf(t.c_str() + 3, "%2x", &v) == 1;
        if (is_byte) {
          pending += char(v);
        } else {
          flush();
          out.push_back(t);
        }
      }
      flush();
      break;
    }
    case Decoder::fuse: {
      std::string s;
      for (const std::string& t : toks) s += t;
      out.push_back(std::move(s));
      break;
    }
    case Decoder::strip:
      for (const std::string& t : toks) {
        Cps c = cps_of(t);
        size_t lo = 0, hi = c.size();
        for (size_t k = 0; k < d.start && lo < hi && c[lo] == d.content; ++k) ++lo;
        for (size_t k = 0; k < d.stop && hi > lo && c[hi - 1] == d.content; ++k) --hi;
        out.push_back(str_of(Cps(c.begin() + long(lo), c.begin() + long(hi))));
      }
      break;
  }
  toks = std::move(out);
}

struct AddedToken {
  int64_t id;
  std::string content;
  bool special, lstrip, rstrip, normalized, single_word;
};

bool is_word_char(uint32_t c) {
  const text::Category k = text::category(c);
  const char m = text::major_class(k);
  return m == 'L' || m == 'M' || m == 'N' || k == text::Category::Pc;
}

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  std::unordered_map<std::string, int64_t> vocab;  // model vocabulary and added tokens
  std::vector<std::string> id_to_token;
  std::vector<bool> has_id, is_special;
  std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> merges;  // (left, right) -> (rank, merged id)
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  std::optional<int64_t> unk;
  std::string continuing_subword_prefix, end_of_word_suffix;
  std::vector<AddedToken> added;
  std::unordered_map<uint32_t, std::vector<size_t>> added_by_first;  // first code point -> added tokens
  std::vector<Cps> added_cps;
  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  std::vector<Decoder> decoders;
  bool has_decoder = false;
  std::vector<int64_t> prefix_ids, suffix_ids;  // post-processor, single sequence

  int64_t byte_token(uint8_t b) const {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", unsigned(b));
    auto it = vocab.find(name);
    return it == vocab.end() ? -1 : it->second;
  }

  void bpe(const Cps& word, std::vector<int64_t>& out) const {
    if (word.empty()) return;
    if (ignore_merges) {
      auto it = vocab.find(str_of(word));
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    struct Sym {
      int64_t id;
      long prev, next;
      bool alive;
    };
    std::vector<Sym> syms;
    bool last_unk = false;
    for (size_t i = 0; i < word.size(); ++i) {
      std::string s;
      text::utf8_append(s, word[i]);
      if (i > 0) s = continuing_subword_prefix + s;
      if (i + 1 == word.size()) s += end_of_word_suffix;
      auto it = vocab.find(s);
      std::vector<int64_t> ids;
      if (it != vocab.end()) {
        ids.push_back(it->second);
      } else if (byte_fallback) {
        std::string raw;
        text::utf8_append(raw, word[i]);
        for (char b : raw) {
          const int64_t t = byte_token(uint8_t(b));
          if (t < 0) {
            ids.clear();
            break;
          }
          ids.push_back(t);
        }
      }
      if (ids.empty()) {
        if (!unk) {
          last_unk = false;
          continue;  // no unk token: the character is dropped
        }
        if (fuse_unk && last_unk) continue;
        last_unk = true;
        ids.push_back(*unk);
      } else {
        last_unk = false;
      }
      for (int64_t id : ids) syms.push_back({id, long(syms.size()) - 1, long(syms.size()) + 1, true});
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    struct Cand {
      int64_t rank;
      long pos;
      int64_t left, right;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto push = [&](long pos) {
      if (pos < 0 || syms[size_t(pos)].next < 0) return;
      const int64_t l = syms[size_t(pos)].id, r = syms[size_t(syms[size_t(pos)].next)].id;
      auto it = merges.find(uint64_t(l) << 32 | uint64_t(r));
      if (it != merges.end()) heap.push({it->second.first, pos, l, r});
    };
    for (long i = 0; i < long(syms.size()); ++i) push(i);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      Sym& a = syms[size_t(c.pos)];
      if (!a.alive || a.next < 0 || a.id != c.left || syms[size_t(a.next)].id != c.right) continue;
      Sym& b = syms[size_t(a.next)];
      a.id = merges.at(uint64_t(c.left) << 32 | uint64_t(c.right)).second;
      b.alive = false;
      a.next = b.next;
      if (b.next >= 0) syms[size_t(b.next)].prev = c.pos;
      push(a.prev);
      push(c.pos);
    }
    for (const Sym& s : syms)
      if (s.alive) out.push_back(s.id);
  }

  // Splits `text` at added tokens: (chunk, -1) for text, ("", id) for a token. offset: of text in the input.
  void split_added(const Cps& t, bool normalized_pass, std::vector<std::pair<Piece, int64_t>>& out,
                   bool at_start) const {
    size_t chunk_start = 0, i = 0;
    auto emit_text = [&](size_t lo, size_t hi) {
      if (hi <= lo) return;
      Piece p;
      p.cps.assign(t.begin() + long(lo), t.begin() + long(hi));
      p.at_start = at_start && lo == 0;
      out.push_back({std::move(p), -1});
    };
    while (i < t.size()) {
      size_t best = SIZE_MAX, best_len = 0;
      const auto cand = added_by_first.find(t[i]);
      if (cand == added_by_first.end()) {
        ++i;
        continue;
      }
      for (size_t k : cand->second) {
        const AddedToken& a = added[k];
        if (a.normalized != normalized_pass) continue;
        const Cps& c = added_cps[k];
        if (c.size() <= best_len || i + c.size() > t.size() || !std::equal(c.begin(), c.end(), t.begin() + long(i)))
          continue;
        if (a.single_word && ((i > 0 && is_word_char(t[i - 1])) ||
                              (i + c.size() < t.size() && is_word_char(t[i + c.size()]))))
          continue;
        best = k, best_len = c.size();
      }
      if (best == SIZE_MAX) {
        ++i;
        continue;
      }
      size_t lo = i, hi = i + best_len;
      if (added[best].lstrip)
        while (lo > chunk_start && text::is_white_space(t[lo - 1])) --lo;
      if (added[best].rstrip)
        while (hi < t.size() && text::is_white_space(t[hi])) ++hi;
      emit_text(chunk_start, lo);
      out.push_back({Piece{}, added[best].id});
      chunk_start = i = hi;
    }
    emit_text(chunk_start, t.size());
  }

  Cps normalize(Cps t) const {
    for (const Normalizer& n : normalizers) {
      switch (n.kind) {
        case Normalizer::nfc: t = text::nfc(t); break;
        case Normalizer::prepend:
          if (!t.empty()) t.insert(t.begin(), n.a.begin(), n.a.end());
          break;
        case Normalizer::replace: t = replace_all(t, n.a, n.b); break;
        case Normalizer::lowercase:
          for (uint32_t& c : t)
            if (c >= 'A' && c <= 'Z') c += 32;
          break;
        case Normalizer::strip: {
          size_t lo = 0, hi = t.size();
          while (n.left && lo < hi && text::is_white_space(t[lo])) ++lo;
          while (n.right && hi > lo && text::is_white_space(t[hi - 1])) --hi;
          t = Cps(t.begin() + long(lo), t.begin() + long(hi));
          break;
        }
      }
    }
    return t;
  }
};

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MOEKIT_CHECK_CODE(f.good(), not_found, "cannot open tokenizer file '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return from_json(ss.str(), path);
}

Tokenizer Tokenizer::from_pretrained(const std::string& dir) {
  const auto p = std::filesystem::path(dir) / "tokenizer.json";
  MOEKIT_CHECK_CODE(std::filesystem::exists(p), not_found, "'", dir,
                    "' has no tokenizer.json (give token ids instead, or a tokenizer file)");
  return from_file(p.string());
}

Tokenizer Tokenizer::from_json(const std::string& text_json, const std::string& source) {
  try {
    return parse_tokenizer(text_json, source);
  } catch (const nlohmann::json::exception& e) {  // a shape the field checks did not foresee
    MOEKIT_FAIL(io, source, ": malformed tokenizer.json: ", e.what());
  }
}

Tokenizer Tokenizer::parse_tokenizer(const std::string& text_json, const std::string& source) {
  const Src s{source};
  json j;
  try {
    j = json::parse(text_json);
  } catch (const json::exception& e) {
    s.fail("JSON", e.what());
  }
  if (!j.is_object()) s.fail("top level", "expected a JSON object");
  Tokenizer tok;
  Impl& m = *tok.impl_;
  m.source = source;
  auto set_token = [&](const std::string& t, int64_t id) {
    if (size_t(id) >= m.id_to_token.size()) {
      m.id_to_token.resize(size_t(id) + 1);
      m.has_id.resize(size_t(id) + 1, false);
      m.is_special.resize(size_t(id) + 1, false);
    }
    m.id_to_token[size_t(id)] = t;
    m.has_id[size_t(id)] = true;
    m.vocab[t] = id;
  };

  const json& model = s.at(j, "model", "top level");
  const std::string type = s.str_or(model, "type", "model", "BPE");
  if (type != "BPE") s.fail("model.type", "unsupported model \"" + type + "\" (supported: BPE)");
  const json& vocab = s.at(model, "vocab", "model");
  if (!vocab.is_object()) s.fail("model.vocab", "expected an object of token -> id");
  for (auto it = vocab.begin(); it != vocab.end(); ++it) set_token(it.key(), s.integer(it.value(), "model.vocab[\"" + it.key() + "\"]"));
  m.byte_fallback = s.boolean_or(model, "byte_fallback", "model", false);
  m.fuse_unk = s.boolean_or(model, "fuse_unk", "model", false);
  m.ignore_merges = s.boolean_or(model, "ignore_merges", "model", false);
  m.continuing_subword_prefix = s.str_or(model, "continuing_subword_prefix", "model", "");
  m.end_of_word_suffix = s.str_or(model, "end_of_word_suffix", "model", "");
  const std::string unk = s.str_or(model, "unk_token", "model", "");
  if (!unk.empty()) {
    auto it = m.vocab.find(unk);
    if (it == m.vocab.end()) s.fail("model.unk_token", "\"" + unk + "\" is not in the vocabulary");
    m.unk = it->second;
  }
  if (model.contains("merges")) {
    const json& merges = model.at("merges");
    if (!merges.is_array()) s.fail("model.merges", "expected an array");
    for (size_t r = 0; r < merges.size(); ++r) {
      const std::string where = "model.merges[" + std::to_string(r) + "]";
      std::string a, b;
      const json& e = merges[r];
      if (e.is_string()) {
        const std::string line = e.get<std::string>();
        const size_t sp = line.find(' ');
        if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
          s.fail(where, "expected \"left right\", got \"" + line + "\"");
        a = line.substr(0, sp), b = line.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>(), b = e[1].get<std::string>();
      } else {
        s.fail(where, "expected \"left right\" or [left, right], got " + e.dump());
      }
      auto ia = m.vocab.find(a), ib = m.vocab.find(b), im = m.vocab.find(a + b);
      if (ia == m.vocab.end()) s.fail(where, "token \"" + a + "\" is not in the vocabulary");
      if (ib == m.vocab.end()) s.fail(where, "token \"" + b + "\" is not in the vocabulary");
      if (im == m.vocab.end()) s.fail(where, "merged token \"" + a + b + "\" is not in the vocabulary");
      m.merges.emplace(uint64_t(ia->second) << 32 | uint64_t(ib->second), std::make_pair(int64_t(r), im->second));
    }
  }

  if (j.contains("added_tokens") && !j.at("added_tokens").is_null()) {
    const json& list = j.at("added_tokens");
    if (!list.is_array()) s.fail("added_tokens", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      const json& a = list[i];
      AddedToken t{s.integer(s.at(a, "id", where), where + ".id"),
                   s.str(a, "content", where),
                   s.boolean_or(a, "special", where, false),
                   s.boolean_or(a, "lstrip", where, false),
                   s.boolean_or(a, "rstrip", where, false),
                   s.boolean_or(a, "normalized", where, false),
                   s.boolean_or(a, "single_word", where, false)};
      set_token(t.content, t.id);
      m.is_special[size_t(t.id)] = t.special;
      m.added_cps.push_back(cps_of(t.content));
      if (!m.added_cps.back().empty()) m.added_by_first[m.added_cps.back()[0]].push_back(m.added.size());
      m.added.push_back(std::move(t));
    }
  }
  if (j.contains("normalizer")) parse_normalizer(s, j.at("normalizer"), "normalizer", m.normalizers);
  if (j.contains("pre_tokenizer")) parse_pre_tokenizer(s, j.at("pre_tokenizer"), "pre_tokenizer", m.pre_tokenizers);
  if (j.contains("decoder") && !j.at("decoder").is_null()) {
    m.has_decoder = true;
    parse_decoder(s, j.at("decoder"), "decoder", m.decoders);
  }

  // Post-processor: the ids around a single sequence.
  std::function<void(const json&, const std::string&)> post = [&](const json& p, const std::string& where) {
    if (p.is_null()) return;
    const std::string pt = s.str(p, "type", where);
    auto id_of = [&](const std::string& t, const std::string& w) {
      auto it = m.vocab.find(t);
      if (it == m.vocab.end()) s.fail(w, "token \"" + t + "\" is not in the vocabulary");
      return it->second;
    };
    if (pt == "Sequence") {
      const json& list = s.at(p, "processors", where);
      if (!list.is_array()) s.fail(where + ".processors", "expected an array");
      for (size_t i = 0; i < list.size(); ++i) post(list[i], where + ".processors[" + std::to_string(i) + "]");
    } else if (pt == "TemplateProcessing") {
      const json& single = s.at(p, "single", where);
      if (!single.is_array()) s.fail(where + ".single", "expected an array");
      const json& specials = p.contains("special_tokens") ? p.at("special_tokens") : json::object();
      bool seen_seq = false;
      for (size_t i = 0; i < single.size(); ++i) {
        const std::string w = where + ".single[" + std::to_string(i) + "]";
        const json& item = single[i];
        if (item.contains("Sequence")) {
          seen_seq = true;
        } else if (item.contains("SpecialToken")) {
          const std::string name = s.str(item.at("SpecialToken"), "id", w);
          std::vector<int64_t> ids;
          if (specials.contains(name)) {
            for (const json& v : s.at(specials.at(name), "ids", w)) ids.push_back(s.integer(v, w));
          } else {
            ids.push_back(id_of(name, w));
          }
          auto& dst = seen_seq ? m.suffix_ids : m.prefix_ids;
          dst.insert(dst.end(), ids.begin(), ids.end());
        } else {
          s.fail(w, "expected Sequence or SpecialToken, got " + item.dump());
        }
      }
    } else if (pt == "BertProcessing" || pt == "RobertaProcessing") {
      const json& cls = s.at(p, "cls", where);
      const json& sep = s.at(p, "sep", where);
      if (!cls.is_array() || cls.size() != 2 || !sep.is_array() || sep.size() != 2)
        s.fail(where, "expected cls and sep as [token, id]");
      m.prefix_ids.push_back(s.integer(cls[1], where + ".cls"));
      m.suffix_ids.push_back(s.integer(sep[1], where + ".sep"));
    } else if (pt != "ByteLevel") {
      s.fail(where, "unsupported post_processor type \"" + pt +
                        "\" (supported: Sequence, TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel)");
    }
  };
  if (j.contains("post_processor")) post(j.at("post_processor"), "post_processor");
  return tok;
}

std::vector<int64_t> Tokenizer::encode(const std::string& input, bool add_special_tokens) const {
  const Impl& m = *impl_;
  std::vector<int64_t> ids;
  if (add_special_tokens) ids = m.prefix_ids;
  const Cps t = text::utf8_decode(input);
  std::vector<std::pair<Piece, int64_t>> raw;
  m.split_added(t, false, raw, true);
  for (auto& [chunk, id] : raw) {
    if (id >= 0) {
      ids.push_back(id);
      continue;
    }
    const bool at_start = chunk.at_start;
    const Cps normalized = m.normalize(chunk.cps);
    std::vector<std::pair<Piece, int64_t>> parts;
    m.split_added(normalized, true, parts, at_start);
    for (auto& [part, pid] : parts) {
      if (pid >= 0) {
        ids.push_back(pid);
        continue;
      }
      std::vector<Piece> pieces{std::move(part)};
      for (const PreTokenizer& p : m.pre_tokenizers) apply_pre_tokenizer(p, pieces);
      for (const Piece& p : pieces) m.bpe(p.cps, ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), m.suffix_ids.begin(), m.suffix_ids.end());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int64_t id : ids) {
    MOEKIT_CHECK(id >= 0 && size_t(id) < m.has_id.size() && m.has_id[size_t(id)], "token id ", id,
                 " is not in the vocabulary of ", m.source, " (", m.id_to_token.size(), " ids)");
    if (skip_special_tokens && m.is_special[size_t(id)]) continue;
    toks.push_back(m.id_to_token[size_t(id)]);
  }
  if (!m.has_decoder) {
    std::string s;
    for (size_t i = 0; i < toks.size(); ++i) s += (i ? " " : "") + toks[i];
    return s;
  }
  for (const Decoder& d : m.decoders) apply_decoder(d, toks);
  std::string s;
  for (const std::string& t : toks) s += t;
  return s;
}

bool Tokenizer::contains(int64_t id) const {
  return id >= 0 && size_t(id) < impl_->has_id.size() && impl_->has_id[size_t(id)];
}

int64_t Tokenizer::vocab_size() const { return int64_t(impl_->id_to_token.size()); }

std::optional<int64_t> Tokenizer::token_to_id(const std::string& token) const {
  auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::string Tokenizer::id_to_token(int64_t id) const {
  const Impl& m = *impl_;
  MOEKIT_CHECK(id >= 0 && size_t(id) < m.has_id.size() && m.has_id[size_t(id)], "token id ", id,
               " is not in the vocabulary of ", m.source);
  return m.id_to_token[size_t(id)];
}

}  // namespace moekit

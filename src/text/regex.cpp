#include "regex.h"

#include <functional>
#include <limits>

#include "moekit/error.h"
#include "unicode.h"

namespace moekit::text {

namespace {

constexpr size_t kInf = std::numeric_limits<size_t>::max();

uint32_t fold(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c == 0x17F) return 's';   // LATIN SMALL LETTER LONG S
  if (c == 0x212A) return 'k';  // KELVIN SIGN
  return c;
}

// One class item kind: a code point range, a set of general categories, or a named set.
struct ClassItem {
  enum Kind { range, categories, space, digit, word, any_but_newline } kind = range;
  uint32_t lo = 0, hi = 0;
  uint32_t mask = 0;  // categories: bit i for Category(i)
  bool negated = false;

  bool test(uint32_t c, bool icase) const {
    bool r = false;
    switch (kind) {
      case range:
        r = (c >= lo && c <= hi);
        if (!r && icase) {
          const uint32_t f = fold(c);
          r = (f >= lo && f <= hi) || (f >= 'a' && f <= 'z' && f - 32 >= lo && f - 32 <= hi);
        }
        break;
      case categories: r = (mask >> uint32_t(category(c))) & 1u; break;
      case space: r = is_white_space(c); break;
      case digit: r = category(c) == Category::Nd; break;
      case word: {
        const Category k = category(c);
        const char m = major_class(k);
        r = m == 'L' || m == 'M' || k == Category::Nd || k == Category::Pc;
        break;
      }
      case any_but_newline: r = c != '\n'; break;
    }
    return r != negated;
  }
};

}  // namespace

struct Regex::Node {
  enum Kind { chars, seq, alt, repeat, look, start, end } kind = seq;
  std::vector<ClassItem> items;  // chars: matches one code point that any item accepts (or none, if negated)
  bool negated = false;
  bool icase = false;
  std::vector<std::unique_ptr<Node>> kids;  // seq, alt; repeat and look: one
  size_t min = 0, max = 0;
  bool lazy = false, possessive = false;
  bool negative = false;  // look

  bool test(uint32_t c) const {
    bool any = false;
    for (const auto& it : items)
      if (it.test(c, icase)) {
        any = true;
        break;
      }
    return any != negated;
  }
};

namespace {

using Node = Regex::Node;

uint32_t category_mask(const std::string& name) {
  static const char* kNames[] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                 "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                 "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
  uint32_t m = 0;
  for (uint32_t i = 0; i < 30; ++i) {
    const std::string n = kNames[i];
    if (n == name || (name.size() == 1 && n[0] == name[0])) m |= 1u << i;
  }
  if (name == "L&" || name == "LC") m = (1u << 1) | (1u << 2) | (1u << 3);
  return m;
}

class Parser {
 public:
  explicit Parser(const std::string& pattern) : src_(pattern), p_(utf8_decode(pattern)) {}

  std::unique_ptr<Node> parse() {
    auto n = parse_alt(false);
    if (i_ != p_.size()) fail("unbalanced ')'");
    return n;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    MOEKIT_FAIL(invalid_argument, "regex '", src_, "': ", what, " at code point ", i_,
                " (supported: the subset of Oniguruma pre-tokenizer patterns use)");
  }
  bool more() const { return i_ < p_.size(); }
  uint32_t peek() const { return p_[i_]; }

  std::unique_ptr<Node> parse_alt(bool icase) {
    auto a = std::make_unique<Node>();
    a->kind = Node::alt;
    a->kids.push_back(parse_seq(icase));
    while (more() && peek() == '|') {
      ++i_;
      a->kids.push_back(parse_seq(icase));
    }
    if (a->kids.size() == 1) return std::move(a->kids[0]);
    return a;
  }

  std::unique_ptr<Node> parse_seq(bool icase) {
    auto s = std::make_unique<Node>();
    s->kind = Node::seq;
    while (more() && peek() != '|' && peek() != ')') {
      auto atom = parse_atom(icase);
      s->kids.push_back(parse_quant(std::move(atom)));
    }
    return s;
  }

  size_t parse_number() {
    size_t v = 0, n = 0;
    while (more() && peek() >= '0' && peek() <= '9') {
      v = v * 10 + (peek() - '0');
      ++i_, ++n;
    }
    if (n == 0) fail("expected a number in {}");
    return v;
  }

  std::unique_ptr<Node> parse_quant(std::unique_ptr<Node> atom) {
    if (!more()) return atom;
    size_t mn = 0, mx = 0;
    const uint32_t c = peek();
    if (c == '?') mn = 0, mx = 1;
    else if (c == '*') mn = 0, mx = kInf;
    else if (c == '+') mn = 1, mx = kInf;
    else if (c == '{') {
      ++i_;
      mn = parse_number();
      mx = mn;
      if (more() && peek() == ',') {
        ++i_;
        mx = more() && peek() == '}' ? kInf : parse_number();
      }
      if (!more() || peek() != '}') fail("expected '}'");
      if (mx < mn) fail("quantifier {n,m} with m < n");
    } else {
      return atom;
    }
    ++i_;
    if (atom->kind == Node::start || atom->kind == Node::end || atom->kind == Node::look) fail("quantified assertion");
    auto r = std::make_unique<Node>();
    r->kind = Node::repeat;
    r->min = mn, r->max = mx;
    if (more() && peek() == '?') r->lazy = true, ++i_;
    else if (more() && peek() == '+') r->possessive = true, ++i_;
    r->kids.push_back(std::move(atom));
    return r;
  }

  uint32_t parse_hex(size_t digits) {
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      if (!more()) fail("short hex escape");
      const uint32_t c = peek();
      uint32_t d;
      if (c >= '0' && c <= '9') d = c - '0';
      else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
      else fail("bad hex digit");
      v = v * 16 + d;
      ++i_;
    }
    return v;
  }

  // After a backslash: one class item (a literal is a one-code-point range).
  ClassItem parse_escape() {
    if (!more()) fail("trailing backslash");
    const uint32_t c = peek();
    ++i_;
    ClassItem it;
    auto lit = [&](uint32_t v) {
      it.kind = ClassItem::range;
      it.lo = it.hi = v;
      return it;
    };
    switch (c) {
      case 'n': return lit('\n');
      case 'r': return lit('\r');
      case 't': return lit('\t');
      case 'f': return lit('\f');
      case 'v': return lit('\v');
      case 'a': return lit('\a');
      case 'e': return lit(0x1B);
      case '0': return lit(0);
      case 's': case 'S': it.kind = ClassItem::space, it.negated = c == 'S'; return it;
      case 'd': case 'D': it.kind = ClassItem::digit, it.negated = c == 'D'; return it;
      case 'w': case 'W': it.kind = ClassItem::word, it.negated = c == 'W'; return it;
      case 'x': {
        if (more() && peek() == '{') {
          ++i_;
          uint32_t v = 0;
          size_t n = 0;
          while (more() && peek() != '}') v = v * 16 + parse_hex(1), ++n;
          if (!more() || n == 0 || n > 6) fail("bad \\x{...}");
          ++i_;
          return lit(v);
        }
        return lit(parse_hex(2));
      }
      case 'u': return lit(parse_hex(4));
      case 'p': case 'P': {
        std::string name;
        if (more() && peek() == '{') {
          ++i_;
          bool neg = false;
          if (more() && peek() == '^') neg = true, ++i_;
          while (more() && peek() != '}') name += char(peek()), ++i_;
          if (!more()) fail("unterminated \\p{");
          ++i_;
          it.negated = (c == 'P') != neg;
        } else {
          if (!more()) fail("bad \\p");
          name = std::string(1, char(peek()));
          ++i_;
          it.negated = c == 'P';
        }
        it.kind = ClassItem::categories;
        it.mask = category_mask(name);
        if (it.mask == 0) fail("unknown property \\p{" + name + "}");
        return it;
      }
      default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '1' && c <= '9')) fail("unsupported escape");
        return lit(c);
    }
  }

  std::unique_ptr<Node> parse_class(bool icase) {
    auto n = std::make_unique<Node>();
    n->kind = Node::chars;
    n->icase = icase;
    if (more() && peek() == '^') n->negated = true, ++i_;
    bool first = true;
    while (true) {
      if (!more()) fail("unterminated '['");
      uint32_t c = peek();
      if (c == ']' && !first) {
        ++i_;
        break;
      }
      first = false;
      if (c == '[') fail("nested class");
      ++i_;
      ClassItem it;
      if (c == '\\') {
        it = parse_escape();
      } else {
        it.lo = it.hi = c;
      }
      if (it.kind == ClassItem::range && more() && peek() == '-' && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        uint32_t hi = peek();
        ++i_;
        if (hi == '\\') {
          ClassItem h = parse_escape();
          if (h.kind != ClassItem::range) fail("class range ending in a set");
          hi = h.lo;
        }
        if (hi < it.lo) fail("class range out of order");
        it.hi = hi;
      }
      n->items.push_back(it);
    }
    return n;
  }

  std::unique_ptr<Node> parse_atom(bool icase) {
    const uint32_t c = peek();
    ++i_;
    if (c == '(') {
      bool sub_icase = icase;
      auto wrap = std::unique_ptr<Node>();
      if (more() && peek() == '?') {
        ++i_;
        if (!more()) fail("bad group");
        const uint32_t k = peek();
        ++i_;
        if (k == ':') {
        } else if (k == '=' || k == '!') {
          wrap = std::make_unique<Node>();
          wrap->kind = Node::look;
          wrap->negative = k == '!';
        } else if (k == 'i' && more() && peek() == ':') {
          ++i_;
          sub_icase = true;
        } else {
          fail("unsupported group (?" + std::string(1, char(k)));
        }
      }
      auto inner = parse_alt(sub_icase);
      if (!more() || peek() != ')') fail("missing ')'");
      ++i_;
      if (wrap) {
        wrap->kids.push_back(std::move(inner));
        return wrap;
      }
      return inner;
    }
    if (c == '[') return parse_class(icase);
    auto n = std::make_unique<Node>();
    if (c == '^' || c == '$') {
      n->kind = c == '^' ? Node::start : Node::end;
      return n;
    }
    if (c == '*' || c == '+' || c == '?' || c == '{') {
      --i_;
      fail("quantifier without an operand");
    }
    n->kind = Node::chars;
    n->icase = icase;
    if (c == '.') {
      ClassItem it;
      it.kind = ClassItem::any_but_newline;
      n->items.push_back(it);
    } else if (c == '\\') {
      n->items.push_back(parse_escape());
    } else {
      ClassItem it;
      it.lo = it.hi = c;
      n->items.push_back(it);
    }
    return n;
  }

  std::string src_;
  std::vector<uint32_t> p_;
  size_t i_ = 0;
};

using Cont = std::function<bool(size_t)>;

class Matcher {
 public:
  explicit Matcher(const std::vector<uint32_t>& t) : t_(t) {}

  bool match(const Node* n, size_t pos, const Cont& k) const {
    switch (n->kind) {
      case Node::chars:
        return pos < t_.size() && n->test(t_[pos]) && k(pos + 1);
      case Node::start:
        return pos == 0 && k(pos);
      case Node::end:
        return pos == t_.size() && k(pos);
      case Node::seq:
        return match_seq(n, 0, pos, k);
      case Node::alt:
        for (const auto& kid : n->kids)
          if (match(kid.get(), pos, k)) return true;
        return false;
      case Node::look: {
        const bool found = match(n->kids[0].get(), pos, [](size_t) { return true; });
        return found != n->negative && k(pos);
      }
      case Node::repeat:
        return match_repeat(n, pos, k);
    }
    return false;
  }

 private:
  bool match_seq(const Node* n, size_t i, size_t pos, const Cont& k) const {
    if (i == n->kids.size()) return k(pos);
    return match(n->kids[i].get(), pos, [&](size_t p) { return match_seq(n, i + 1, p, k); });
  }

  bool match_repeat(const Node* n, size_t pos, const Cont& k) const {
    const Node* kid = n->kids[0].get();
    if (kid->kind == Node::chars) {  // one code point per step: count, then back off without recursion
      size_t avail = 0;
      while (avail < n->max && pos + avail < t_.size() && kid->test(t_[pos + avail])) ++avail;
      if (avail < n->min) return false;
      if (n->possessive) return k(pos + avail);
      if (n->lazy) {
        for (size_t c = n->min; c <= avail; ++c)
          if (k(pos + c)) return true;
        return false;
      }
      for (size_t c = avail + 1; c-- > n->min;)
        if (k(pos + c)) return true;
      return false;
    }
    if (n->possessive) {
      size_t end = pos;
      size_t count = 0;
      while (count < n->max) {
        size_t got = kInf;
        if (!match(kid, end, [&](size_t p) { got = p; return true; }) || got == end) break;
        end = got, ++count;
      }
      return count >= n->min && k(end);
    }
    return repeat_step(n, kid, 0, pos, k);
  }

  bool repeat_step(const Node* n, const Node* kid, size_t count, size_t pos, const Cont& k) const {
    auto more = [&] {
      return count < n->max && match(kid, pos, [&](size_t p) {
               return p != pos && repeat_step(n, kid, count + 1, p, k);  // an empty iteration ends the loop
             });
    };
    if (n->lazy) return (count >= n->min && k(pos)) || more();
    return more() || (count >= n->min && k(pos));
  }

  const std::vector<uint32_t>& t_;
};

}  // namespace

Regex::Regex(const std::string& pattern) : pattern_(pattern) { root_ = Parser(pattern).parse(); }
Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> Regex::find_all(const std::vector<uint32_t>& text) const {
  std::vector<std::pair<size_t, size_t>> out;
  Matcher m(text);
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = kInf;
    const bool found = m.match(root_.get(), start, [&](size_t p) {
      end = p;
      return true;
    });
    if (!found) {
      ++start;
      continue;
    }
    if (end == start) {  // an empty match: skip it, move on by one code point
      ++start;
      continue;
    }
    out.emplace_back(start, end);
    start = end;
  }
  return out;
}

}  // namespace moekit::text

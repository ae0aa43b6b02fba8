// Internal: UTF-8, general categories and NFC, on the tables of unicode_tables.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moekit::text {

enum class Category : uint8_t {
  Cn, Lu, Ll, Lt, Lm, Lo, Mn, Mc, Me, Nd, Nl, No, Pc, Pd, Ps, Pe, Pi, Pf, Po, Sm, Sc, Sk, So, Zs, Zl, Zp, Cc,
  Cf, Cs, Co
};
Category category(uint32_t cp);
// The major class letter of a category: 'L', 'M', 'N', 'P', 'S', 'Z' or 'C'.
char major_class(Category c);
// Unicode White_Space (what \s matches).
bool is_white_space(uint32_t cp);

// Decodes UTF-8; throws Error (invalid_argument) naming the byte offset of the first invalid sequence.
std::vector<uint32_t> utf8_decode(std::string_view s);
void utf8_append(std::string& out, uint32_t cp);
std::string utf8_encode(const std::vector<uint32_t>& cps);
// Bytes -> text with each invalid sequence replaced by U+FFFD (as Rust's String::from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes);

// Normalization Form C.
std::vector<uint32_t> nfc(const std::vector<uint32_t>& cps);

}  // namespace moekit::text

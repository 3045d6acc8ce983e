// UTF-8 validation/lossy decoding, NFC (utf8proc + HF compatibility rule), GPT-2 byte table.
#include "tokenizer/unicode.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "core/error.h"
#include "core/utf8.h"

namespace fn::unicode {
namespace {

// Inversion list of code points assigned in Unicode <= 11.0 (scripts/tokenizer/make_age_table.sh).
constexpr char32_t kIn11[] = {
#include "tokenizer/unicode_in_11.inc"
};

// kHfCompatNote: HF tokenizers normalises with the crate unicode-normalization-alignments,
// whose tables predate Unicode 12: combining marks added later (e.g. U+1AC1..U+1ACE, U+1E2EC..
// U+1E2EF) have combining class 0 there, so HF neither reorders nor composes them. On the
// golden corpus HF's NFC equals "Unicode-11 tables" exactly (and differs from Unicode 12, 13,
// 14 for 1, 6 and 33 strings); we reproduce it by treating every code point not assigned in
// Unicode 11.0 that utf8proc would not leave alone as a segment boundary (an inert starter).
bool assigned_in_11(char32_t cp) {
  const auto* end = std::end(kIn11);
  const auto* it = std::upper_bound(std::begin(kIn11), end, cp);
  return ((it - std::begin(kIn11)) & 1) == 1;
}

bool nfc_relevant(char32_t cp) {
  const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
  return p->combining_class != 0 || p->comb_index != UINT16_MAX ||
         (p->decomp_seqindex != UINT16_MAX && p->decomp_type == 0);
}

// Decodes one code point of valid UTF-8 at s[i]; advances i.
char32_t next_cp(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    i += 1;
    return b0;
  }
  int n = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  char32_t cp = b0 & (0x7F >> n);
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

std::string utf8proc_nfc_segment(std::string_view s) {
  if (s.empty()) return {};
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(
      reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
      &out, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> guard(out, &std::free);
  FN_CHECK(n >= 0, "utf8proc NFC failed: {}", utf8proc_errmsg(n));
  return std::string(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
}

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // Fast path over ASCII.
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const int n = utf8_sequence_length(s, i);
    if (n <= 0) return i;
    i += static_cast<size_t>(n);
  }
  return std::string_view::npos;
}

void require_valid_utf8(std::string_view s, std::string_view what) {
  const size_t bad = find_invalid_utf8(s);
  FN_REQUIRE(bad == std::string_view::npos, Format,
             "invalid UTF-8 in {} at byte offset {} (byte 0x{:02X})", what, bad,
             bad == std::string_view::npos ? 0 : static_cast<unsigned char>(s[bad]));
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const int n = utf8_sequence_length(s, i);
    if (n > 0) {
      out.append(s.substr(i, static_cast<size_t>(n)));
      i += static_cast<size_t>(n);
    } else {
      out.append("\xEF\xBF\xBD");
      i = n == 0 ? s.size() : i + static_cast<size_t>(-n);
    }
  }
  return out;
}

size_t incomplete_utf8_tail(std::string_view s) {
  for (size_t k = 1; k <= 3 && k <= s.size(); ++k) {
    const size_t i = s.size() - k;
    const auto b = static_cast<unsigned char>(s[i]);
    if (b >= 0x80 && b < 0xC0) continue;  // continuation byte: look further back
    return utf8_sequence_length(s, i) == 0 ? k : 0;
  }
  return 0;
}

std::string nfc_utf8proc(std::string_view s) {
  if (is_ascii(s)) return std::string(s);
  return utf8proc_nfc_segment(s);
}

namespace {

// NFC of one segment with the HF rule (see kHfCompatNote).
void nfc_hf_segment(std::string_view s, std::string& out) {
  size_t seg = 0, i = 0;
  while (i < s.size()) {
    const size_t at = i;
    const char32_t cp = next_cp(s, i);
    if (cp >= 0x300 && !assigned_in_11(cp) && nfc_relevant(cp)) {
      out += utf8proc_nfc_segment(s.substr(seg, at - seg));
      out.append(s.substr(at, i - at));
      seg = i;
    }
  }
  out += utf8proc_nfc_segment(s.substr(seg));
}

}  // namespace

std::string nfc(std::string_view s) {
  // NFC(a + b) == NFC(a) + NFC(b) when b starts with an ASCII character (a starter that no
  // composition takes as its second element), so only the runs of non-ASCII characters, with
  // the one ASCII character before each (it may compose with a following mark), go to utf8proc.
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    size_t j = i;
    while (j < n && static_cast<unsigned char>(s[j]) < 0x80) ++j;
    if (j == n) {
      out.append(s.substr(i));
      break;
    }
    const size_t seg = j > i ? j - 1 : j;
    out.append(s.substr(i, seg - i));
    size_t k = j;
    while (k < n && static_cast<unsigned char>(s[k]) >= 0x80) ++k;
    nfc_hf_segment(s.substr(seg, k - seg), out);
    i = k;
  }
  return out;
}

const std::array<char32_t, 256>& byte_to_unicode() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? static_cast<char32_t>(b) : 256 + n++;
    }
    return t;
  }();
  return table;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace fn::unicode

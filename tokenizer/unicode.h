// UTF-8 and Unicode helpers of the tokenizer: validation, lossy decoding (HF/Rust
// from_utf8_lossy), NFC through utf8proc (with the HF-compatibility rule below), and the GPT-2
// byte <-> unicode table of byte-level BPE. Used by tokenizer/*.cpp, the tests, and apps/ for
// the JSONL error messages (utf8_lossy).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace fn::unicode {

/// Byte offset of the first invalid UTF-8 sequence in s (overlongs, surrogates and code points
/// above U+10FFFF are invalid), or std::string_view::npos when s is valid.
size_t find_invalid_utf8(std::string_view s);

/// Throws fn::Error(Format) "invalid UTF-8 in <what> at byte offset N" unless s is valid.
void require_valid_utf8(std::string_view s, std::string_view what);

/// Replaces each maximal invalid subpart with U+FFFD (Rust String::from_utf8_lossy, which HF
/// decode uses).
std::string utf8_lossy(std::string_view bytes);

/// Length of the longest suffix of s that is an incomplete but so far valid UTF-8 sequence
/// (0..3): the part a streaming decoder must hold back.
size_t incomplete_utf8_tail(std::string_view s);

/// NFC of valid UTF-8 (utf8proc, Unicode 15), except that combining marks assigned after
/// HF tokenizers' normalization tables (see kHfCompatNote in unicode.cpp) act as starters, as
/// they do in HF. Returns s unchanged when it is ASCII.
std::string nfc(std::string_view s);

/// Pure utf8proc NFC (no HF rule); for tests and the decode(encode(s)) == NFC(s) property.
std::string nfc_utf8proc(std::string_view s);

/// The GPT-2 byte-level table: byte -> code point of its printable stand-in (e.g. ' ' -> U+0120).
const std::array<char32_t, 256>& byte_to_unicode();

/// Appends the UTF-8 encoding of code point cp.
void append_utf8(std::string& out, char32_t cp);

}  // namespace fn::unicode

// One UTF-8 well-formedness rule (RFC 3629, Unicode Table 3-7) for every part of fngen: the
// tokenizer's validation and lossy decoding (tokenizer/unicode.h) and the log's escaping
// (core/log.h escape_for_log).
#pragma once

#include <cstddef>
#include <string_view>

namespace fn {

/// The UTF-8 sequence starting at s[i] (i < s.size()): its length 1..4 when well formed (no
/// overlong forms, surrogates or code points past U+10FFFF; ASCII bytes are 1), -(bytes of the
/// maximal invalid subpart) when ill formed (as counted by from_utf8_lossy / U+FFFD
/// substitution), or 0 when s ends inside a so far well-formed sequence.
int utf8_sequence_length(std::string_view s, std::size_t i);

}  // namespace fn

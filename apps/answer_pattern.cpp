#include "apps/answer_pattern.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"

namespace fn {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(code, msg, sizeof msg);
  return reinterpret_cast<const char*>(msg);
}

constexpr uint32_t kMatchLimit = 10'000'000;  // backtracking steps per match attempt
constexpr uint32_t kHeapLimitKib = 64 * 1024;

}  // namespace

struct AnswerPattern::Impl {
  pcre2_code* code = nullptr;
  pcre2_match_context* context = nullptr;
  ~Impl() {
    pcre2_match_context_free(context);
    pcre2_code_free(code);
  }
};

AnswerPattern::AnswerPattern(const std::string& pattern)
    : impl_(std::make_unique<Impl>()), pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE off = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
  FN_REQUIRE(impl_->code != nullptr, Format,
             "\"regex\" {} is not a valid PCRE2 pattern (offset {}: {})", pattern, off,
             pcre2_message(err));
  impl_->context = pcre2_match_context_create(nullptr);
  FN_REQUIRE(impl_->context != nullptr, Internal, "pcre2_match_context_create failed");
  pcre2_set_match_limit(impl_->context, kMatchLimit);
  pcre2_set_heap_limit(impl_->context, kHeapLimitKib);
}

AnswerPattern::~AnswerPattern() = default;

std::optional<std::string> AnswerPattern::last_match(const std::string& text) const {
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(impl_->code, nullptr), &pcre2_match_data_free);
  FN_REQUIRE(md != nullptr, Internal, "pcre2_match_data_create_from_pattern failed");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::optional<std::string> last;
  PCRE2_SIZE start = 0;
  while (start <= text.size()) {
    const int rc =
        pcre2_match(impl_->code, subject, text.size(), start, 0, md.get(), impl_->context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    FN_REQUIRE(rc >= 0, Format,
               "\"regex\" {}: PCRE2 gave up on the {}-byte generated text at offset {}: {}",
               pattern_, text.size(), start, pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    const bool group = rc > 1 && ov[2] != PCRE2_UNSET;
    const PCRE2_SIZE b = group ? ov[2] : ov[0], e = group ? ov[3] : ov[1];
    last = text.substr(b, e - b);
    // Continue after the match; past an empty match, by one whole UTF-8 character.
    start = ov[1];
    if (ov[1] == ov[0]) {
      if (start >= text.size()) break;
      ++start;
      while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80)
        ++start;
    }
  }
  return last;
}

}  // namespace fn

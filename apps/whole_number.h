// Whole-number command-line values, read the same way by every fngen subcommand: decimal digits
// only. CLI11 2.1.2 converts with strtoll(..., 0), so "010" would be octal 8, "0x3" hex 3, "08"
// an unclear "Could not convert", and a value past the type would clamp; add_whole_option checks
// and rewrites the text before CLI11 converts it, and parse_whole_number serves values read by
// hand (the comma-separated -p/-n lists of fngen bench). Every failure is a usage error (exit 2)
// naming the option and quoting the text as typed.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace fn {

/// The largest context size, prompt length or generated-token count an option accepts (2^31 - 1):
/// no model's context comes near it, and sums such as n_prompt + n_gen stay far from int64
/// overflow. Options that a value past the context merely saturates (--prefill-chunk,
/// --repeat-last-n) take any int64 instead.
inline constexpr int64_t kMaxTokenCount = std::numeric_limits<int32_t>::max();

/// The values a whole-number option allows: [min, max], plus one optional special value below
/// min (e.g. -1 = "until the context is full"). A leading '-' or '+' is accepted only when a
/// negative value is allowed. WholeRange(1, kMaxTokenCount).or_value(-1).because("...").
struct WholeRange {
  int64_t min = 0;
  uint64_t max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  std::optional<int64_t> special;
  /// Why the range is what it is, appended to the out-of-range message ("" = nothing).
  std::string why;

  WholeRange() = default;
  explicit WholeRange(int64_t lo, uint64_t hi = std::numeric_limits<int64_t>::max())
      : min(lo), max(hi) {}
  /// The same range, also allowing `v`.
  WholeRange or_value(int64_t v) const {
    WholeRange r = *this;
    r.special = v;
    return r;
  }
  /// The same range, explained by `reason` in its out-of-range message.
  WholeRange because(std::string reason) const {
    WholeRange r = *this;
    r.why = std::move(reason);
    return r;
  }
};

/// Reads `text`, the value typed for option `flag` ("-n/--max-new-tokens"), as a whole number in
/// `range`: decimal digits (leading zeros are decimal: "010" is 10) with one leading '+' or '-'
/// only when the range holds a negative value. Returns its canonical text: no '+', no leading
/// zeros, "-" only for a negative value. Throws fn::Error(Usage) "<flag>: '<text>' is not a
/// decimal whole number (...)" or "<flag>: '<text>' is out of range (allowed <range>)".
std::string check_whole_number(std::string_view text, std::string_view flag,
                               const WholeRange& range);

/// check_whole_number's value as int64 (range.max must not exceed INT64_MAX).
int64_t parse_whole_number(std::string_view text, std::string_view flag, const WholeRange& range);

/// "-n/--max-new-tokens": the first short and the first long name of `opt`.
std::string option_label(const CLI::Option& opt);

/// Attaches check_whole_number to `opt` as a CLI11 transform, so that CLI11 only ever converts the
/// canonical text; a failure is a CLI::ConversionError carrying the message (main(): exit 2).
/// Returns `opt`.
CLI::Option* check_whole(CLI::Option* opt, WholeRange range);

/// CLI::App::add_option of a whole-number option (an integer variable, or a std::string that
/// keeps the canonical text) checked by check_whole against `range`.
template <class T>
CLI::Option* add_whole_option(CLI::App* app, const std::string& names, T& var,
                              const std::string& description, WholeRange range) {
  if constexpr (std::is_integral_v<T>) {
    static_assert(!std::is_same_v<T, bool>, "a flag is not a whole-number option");
    // Never more than the variable holds (CLI11 would refuse the conversion without the reason).
    if (range.max > static_cast<uint64_t>(std::numeric_limits<T>::max()))
      range.max = static_cast<uint64_t>(std::numeric_limits<T>::max());
    if (range.min < static_cast<int64_t>(std::numeric_limits<T>::min()))
      range.min = static_cast<int64_t>(std::numeric_limits<T>::min());
  } else {
    static_assert(std::is_same_v<T, std::string>, "an integer or std::string variable");
  }
  // A std::string variable still reads as a number in --help ("INT", not "TEXT").
  return check_whole(app->add_option(names, var, description)->type_name("INT"), std::move(range));
}

}  // namespace fn

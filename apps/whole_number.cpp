#include "apps/whole_number.h"

#include <charconv>
#include <system_error>

#include "core/error.h"

namespace fn {
namespace {

// A value as sign and magnitude: the ranges reach from INT64_MIN to UINT64_MAX.
struct Whole {
  bool negative = false;
  uint64_t magnitude = 0;
};

Whole of(int64_t v) {
  // -(v + 1) + 1 avoids negating INT64_MIN.
  return v < 0 ? Whole{true, static_cast<uint64_t>(-(v + 1)) + 1}
               : Whole{false, static_cast<uint64_t>(v)};
}

// a <= b; zero has one sign.
bool less_equal(Whole a, Whole b) {
  if (a.magnitude == 0) a.negative = false;
  if (b.magnitude == 0) b.negative = false;
  if (a.negative != b.negative) return a.negative;
  return a.negative ? a.magnitude >= b.magnitude : a.magnitude <= b.magnitude;
}

bool equal(Whole a, Whole b) {
  return less_equal(a, b) && less_equal(b, a);
}

bool allows_negative(const WholeRange& r) {
  return r.min < 0 || (r.special && *r.special < 0);
}

std::string allowed_text(const WholeRange& r) {
  std::string s = "allowed ";
  if (r.special) s += fmt::format("{}, or ", *r.special);
  s += fmt::format("{} to {}", r.min, r.max);
  if (!r.why.empty()) s += "; " + r.why;
  return s;
}

}  // namespace

std::string check_whole_number(std::string_view text, std::string_view flag,
                               const WholeRange& range) {
  const bool signs = allows_negative(range);
  std::string_view digits = text;
  const bool negative = !digits.empty() && digits.front() == '-';
  if (!digits.empty() && (digits.front() == '-' || digits.front() == '+')) digits.remove_prefix(1);
  const bool all_digits =
      !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos;
  // A '-' before digits on an option without negative values is a value below its range; a '+'
  // there, or anything but digits, is not a number this CLI reads.
  FN_REQUIRE(all_digits && (signs || text.front() != '+'), Usage,
             "{}: '{}' is not a decimal whole number (digits 0-9 only{}, no hex, octal, exponent "
             "or fraction)",
             flag, text, signs ? ", with an optional leading '-' or '+'" : "");
  const std::size_t first = digits.find_first_not_of('0');
  digits = first == std::string_view::npos ? std::string_view("0") : digits.substr(first);
  Whole v{negative, 0};
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v.magnitude);
  const bool fits = ec == std::errc() && end == digits.data() + digits.size();
  const bool in_range =
      fits && ((less_equal(of(range.min), v) && less_equal(v, Whole{false, range.max})) ||
               (range.special && equal(v, of(*range.special))));
  FN_REQUIRE(in_range, Usage, "{}: '{}' is out of range ({})", flag, text, allowed_text(range));
  return v.negative && v.magnitude != 0 ? "-" + std::string(digits) : std::string(digits);
}

int64_t parse_whole_number(std::string_view text, std::string_view flag, const WholeRange& range) {
  FN_CHECK(range.max <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
           "{}: range up to {} read as int64", flag, range.max);
  const std::string canonical = check_whole_number(text, flag, range);
  int64_t v = 0;
  std::from_chars(canonical.data(), canonical.data() + canonical.size(), v);
  return v;
}

std::string option_label(const CLI::Option& opt) {
  std::string s;
  if (!opt.get_snames().empty()) s = "-" + opt.get_snames().front();
  if (!opt.get_lnames().empty()) s += (s.empty() ? "--" : "/--") + opt.get_lnames().front();
  return s.empty() ? opt.get_name() : s;
}

CLI::Option* check_whole(CLI::Option* opt, WholeRange range) {
  const std::string label = option_label(*opt);
  opt->transform(CLI::Validator(
      [label, range = std::move(range)](std::string& text) {
        try {
          text = check_whole_number(text, label, range);
        } catch (const Error& e) {
          // Not a ValidationError: CLI11 would prefix the option's long name a second time.
          throw CLI::ConversionError(e.what());
        }
        return std::string();
      },
      "", ""));
  return opt;
}

}  // namespace fn

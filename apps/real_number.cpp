#include "apps/real_number.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <system_error>

#include "apps/whole_number.h"
#include "core/error.h"

namespace fn {

std::string check_real_number(std::string_view text, std::string_view flag) {
  std::string_view body = text;
  const bool negative = !body.empty() && body.front() == '-';
  if (!body.empty() && (body.front() == '-' || body.front() == '+')) body.remove_prefix(1);
  // from_chars also reads "inf", "nan" and "infinity"; only digits may start the number.
  const bool starts_ok =
      !body.empty() && (std::isdigit(static_cast<unsigned char>(body.front())) != 0 ||
                        (body.front() == '.' && body.size() > 1 &&
                         std::isdigit(static_cast<unsigned char>(body[1])) != 0));
  double v = 0;
  std::from_chars_result r{body.data(), std::errc::invalid_argument};
  if (starts_ok) r = std::from_chars(body.data(), body.data() + body.size(), v);
  const bool whole = r.ptr == body.data() + body.size();
  FN_REQUIRE(starts_ok && whole && r.ec != std::errc::invalid_argument, Usage,
             "{}: '{}' is not a decimal number (digits with an optional sign, '.' fraction and "
             "e exponent, e.g. 0.7 or 1e-3; no hex, inf or nan)",
             flag, text);
  FN_REQUIRE(r.ec != std::errc::result_out_of_range && std::isfinite(v), Usage,
             "{}: '{}' is out of range (beyond a double)", flag, text);
  if (negative) v = -v;
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  FN_CHECK(ec == std::errc(), "{}: to_chars of {} failed", flag, text);
  return std::string(buf, end);
}

CLI::Option* check_real(CLI::Option* opt) {
  const std::string label = option_label(*opt);
  opt->transform(CLI::Validator(
      [label](std::string& text) {
        try {
          text = check_real_number(text, label);
        } catch (const Error& e) {
          // Not a ValidationError: CLI11 would prefix the option's long name a second time.
          throw CLI::ConversionError(e.what());
        }
        return std::string();
      },
      "", ""));
  return opt;
}

CLI::Option* add_real_option(CLI::App* app, const std::string& names, double& var,
                             const std::string& description) {
  return check_real(app->add_option(names, var, description));
}

}  // namespace fn

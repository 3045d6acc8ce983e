// Real-number command-line values (--temp, --top-p, --bandwidth-gbs, ...), read the same way by
// every fngen subcommand: a finite decimal number, nothing else. CLI11 2.1.2 alone reads an empty
// value as 0 (so `--temp ''` would mean greedy) and takes hex, "inf" and "nan"; add_real_option
// checks and rewrites the text before CLI11 converts it. Every failure is a usage error (exit 2)
// naming the option and quoting the text as typed.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <string_view>

namespace fn {

/// Reads `text`, the value typed for option `flag` ("--temp"), as a finite decimal number: an
/// optional '-' or '+', digits with an optional '.' fraction and an optional e/E exponent
/// (std::from_chars general format, whole text), no white space, hex, "inf" or "nan". Returns
/// the shortest text of the same double (std::to_chars), which CLI11 converts exactly. Throws
/// fn::Error(Usage) "<flag>: '<text>' is not a decimal number (...)" or "<flag>: '<text>' is out
/// of range (beyond a double)".
std::string check_real_number(std::string_view text, std::string_view flag);

/// Attaches check_real_number to `opt` as a CLI11 transform; a failure is a CLI::ConversionError
/// carrying the message (main(): exit 2). Returns `opt`.
CLI::Option* check_real(CLI::Option* opt);

/// CLI::App::add_option of a double option checked by check_real.
CLI::Option* add_real_option(CLI::App* app, const std::string& names, double& var,
                             const std::string& description);

}  // namespace fn

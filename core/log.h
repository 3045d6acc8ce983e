// Rank-aware logging to stderr: "[r{rank}/{world}] [I] hh:mm:ss.mmm message".
// By default INFO and DEBUG come from rank 0 only, WARN and ERROR from every rank; stdout is
// never written here (it carries results only). Level from set_log_level() or FN_LOG_LEVEL.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace fn {

enum class LogLevel { Error = 0, Warn = 1, Info = 2, Debug = 3, Trace = 4 };

/// Sets this process's rank and world size for the prefix (comm/ calls it after MPI_Init).
void set_log_rank(int rank, int world) noexcept;
/// Sets the most verbose level printed. Throws fn::Error(Usage) for an unknown name.
void set_log_level(LogLevel level) noexcept;
/// Parses "error|warn|info|debug|trace"; throws fn::Error(Usage) naming the value otherwise.
LogLevel parse_log_level(std::string_view name);
/// When true, every rank prints INFO/DEBUG too (--log-all-ranks).
void set_log_all_ranks(bool all) noexcept;
/// True when a message of this level would be printed by this rank.
bool log_enabled(LogLevel level) noexcept;
/// `message` safe to print on a terminal: valid UTF-8, tab and newline kept; every other byte
/// below 0x20, DEL, and every byte that is not part of a well-formed UTF-8 sequence (RFC 3629:
/// no overlong forms, surrogates or code points past U+10FFFF) becomes the four characters
/// "\xNN". Messages quote input (a file's bytes in a JSON parse error, a bad prompt), so a
/// hostile file cannot write raw bytes or escape sequences to stderr.
std::string escape_for_log(std::string_view message);
/// Writes one prefixed line to stderr (thread-safe, one write per line), escape_for_log'd.
void log_write(LogLevel level, std::string_view message) noexcept;

}  // namespace fn

#define FN_LOG_AT(level, ...)                                                         \
  do {                                                                                \
    if (::fn::log_enabled(level)) ::fn::log_write(level, ::fmt::format(__VA_ARGS__)); \
  } while (0)
#define FN_LOG_ERROR(...) FN_LOG_AT(::fn::LogLevel::Error, __VA_ARGS__)
#define FN_LOG_WARN(...) FN_LOG_AT(::fn::LogLevel::Warn, __VA_ARGS__)
#define FN_LOG_INFO(...) FN_LOG_AT(::fn::LogLevel::Info, __VA_ARGS__)
#define FN_LOG_DEBUG(...) FN_LOG_AT(::fn::LogLevel::Debug, __VA_ARGS__)

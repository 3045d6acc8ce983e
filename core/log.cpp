#include "core/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <string>

#include "core/error.h"
#include "core/utf8.h"

namespace fn {
namespace {

std::atomic<int> g_rank{0};
std::atomic<int> g_world{1};
std::atomic<bool> g_all_ranks{false};

LogLevel initial_level() {
  const char* env = std::getenv("FN_LOG_LEVEL");
  if (env == nullptr || env[0] == '\0') return LogLevel::Info;
  try {
    return parse_log_level(env);
  } catch (const Error&) {
    return LogLevel::Info;
  }
}

std::atomic<int>& level_ref() {
  static std::atomic<int> level{static_cast<int>(initial_level())};
  return level;
}

char level_letter(LogLevel level) {
  switch (level) {
    case LogLevel::Error:
      return 'E';
    case LogLevel::Warn:
      return 'W';
    case LogLevel::Info:
      return 'I';
    case LogLevel::Debug:
      return 'D';
    case LogLevel::Trace:
      return 'T';
  }
  return '?';
}

}  // namespace

void set_log_rank(int rank, int world) noexcept {
  g_rank = rank;
  g_world = world;
}
void set_log_level(LogLevel level) noexcept {
  level_ref() = static_cast<int>(level);
}
void set_log_all_ranks(bool all) noexcept {
  g_all_ranks = all;
}

LogLevel parse_log_level(std::string_view name) {
  if (name == "error") return LogLevel::Error;
  if (name == "warn") return LogLevel::Warn;
  if (name == "info") return LogLevel::Info;
  if (name == "debug") return LogLevel::Debug;
  if (name == "trace") return LogLevel::Trace;
  FN_THROW(Usage, "unknown log level '{}' (expected error, warn, info, debug or trace)", name);
}

bool log_enabled(LogLevel level) noexcept {
  if (static_cast<int>(level) > level_ref().load()) return false;
  if (level >= LogLevel::Info && g_rank.load() != 0 && !g_all_ranks.load()) return false;
  return true;
}

std::string escape_for_log(std::string_view m) {
  std::string out;
  out.reserve(m.size());
  for (std::size_t i = 0; i < m.size();) {
    const auto c = static_cast<unsigned char>(m[i]);
    const bool control = c < 0x80 && (c < 0x20 || c == 0x7F) && c != '\t' && c != '\n';
    const int len = control ? -1 : utf8_sequence_length(m, i);
    if (len <= 0) {  // one byte at a time: the next may start a well-formed sequence
      out += fmt::format("\\x{:02X}", c);
      ++i;
    } else {
      out.append(m.substr(i, static_cast<std::size_t>(len)));
      i += static_cast<std::size_t>(len);
    }
  }
  return out;
}

void log_write(LogLevel level, std::string_view message) noexcept {
  try {
    using namespace std::chrono;
    const auto now = system_clock::now();
    const std::time_t secs = system_clock::to_time_t(now);
    const int ms =
        static_cast<int>(duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000);
    std::tm tm{};
    localtime_r(&secs, &tm);
    std::string line = fmt::format("[r{}/{}] [{}] {:02}:{:02}:{:02}.{:03} {}\n", g_rank.load(),
                                   g_world.load(), level_letter(level), tm.tm_hour, tm.tm_min,
                                   tm.tm_sec, ms, escape_for_log(message));
    // One write() per line so lines of different ranks/threads never interleave mid-line.
    ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
    (void)ignored;
  } catch (...) {
  }
}

}  // namespace fn

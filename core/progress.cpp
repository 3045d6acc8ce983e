// ProgressLine (see progress.h).
#include "core/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace fn {

std::string format_progress(const std::string& label, uint64_t done, uint64_t total,
                            double seconds) {
  // GB for a real checkpoint, MB below 1 GB (a tiny model would read "0.00 / 0.00 GB").
  const bool giga = total >= 1'000'000'000;
  const double scale = giga ? 1e9 : 1e6;
  const char* unit = giga ? "GB" : "MB";
  const double amount = static_cast<double>(done) / scale;
  const double whole = static_cast<double>(total) / scale;
  const double pct =
      total > 0 ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0;
  std::string s =
      fmt::format("{}: {:.2f} / {:.2f} {} ({:.0f} %)", label, amount, whole, unit, std::floor(pct));
  if (seconds > 0 && done > 0) {
    const double rate = amount / seconds;
    s += fmt::format(", {:.2f} {}/s", rate, unit);
    if (done >= total) {
      s += fmt::format(", done in {:.1f} s", seconds);
    } else {
      s += fmt::format(", ETA {:.0f} s", (whole - amount) / rate);
    }
  }
  return s;
}

ProgressLine::ProgressLine(std::string label, uint64_t total_bytes, bool enabled, std::FILE* out,
                           int terminal)
    : label_(std::move(label)),
      total_(total_bytes),
      enabled_(enabled),
      out_(out ? out : stderr),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {
  terminal_ = terminal >= 0 ? terminal != 0 : isatty(fileno(out_)) != 0;
}

ProgressLine::~ProgressLine() {
  finish();
}

void ProgressLine::add(uint64_t bytes) {
  if (!enabled_ || finished_) return;
  done_ += bytes;
  const auto now = std::chrono::steady_clock::now();
  if (terminal_) {
    if (now - last_draw_ >= std::chrono::milliseconds(100)) draw(false);
    return;
  }
  const uint64_t decile =
      total_ > 0 ? std::min<uint64_t>(done_ * 10 / total_, 10) : 10;  // plain: every 10 %
  if (static_cast<int>(decile) >= next_decile_ && done_ < total_) {
    next_decile_ = static_cast<int>(decile) + 1;
    draw(false);
  }
}

void ProgressLine::finish() {
  if (!enabled_ || finished_) return;
  finished_ = true;
  draw(true);
}

void ProgressLine::draw(bool final_line) {
  last_draw_ = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(last_draw_ - start_).count();
  const std::string text = format_progress(label_, done_, total_, s);
  if (terminal_) {
    std::fprintf(out_, "\r\033[K%s%s", text.c_str(), final_line ? "\n" : "");
  } else {
    std::fprintf(out_, "%s\n", text.c_str());
  }
  std::fflush(out_);
}

}  // namespace fn

// A progress line for long loads (docs/design.md "The main job" step 4): rank 0
// shows bytes done / total, GB/s and the ETA while weights stream to the device. On a terminal
// one line is redrawn in place (at most every 100 ms); otherwise (CI logs, pipes) a plain line is
// written at every 10 % and at the end. Called by the CUDA model's loader; output goes to stderr.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace fn {

/// Formats one progress report: "LABEL: 12.35 / 61.40 GB (20 %), 3.10 GB/s, ETA 16 s" (MB below 1
/// GB total; GB = 1e9 bytes; the ETA is left out when nothing is known yet and reads "done" at 100
/// %).
std::string format_progress(const std::string& label, uint64_t done, uint64_t total,
                            double seconds);

/// Progress of one load. Not thread-safe; cheap to call add() per tensor.
class ProgressLine {
 public:
  /// `enabled` false makes every call a no-op (ranks other than 0). `out` defaults to stderr;
  /// `terminal` decides in-place redraws (defaults to isatty(out)).
  ProgressLine(std::string label, uint64_t total_bytes, bool enabled, std::FILE* out = nullptr,
               int terminal = -1);
  ~ProgressLine();
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  /// Counts `bytes` more as done and redraws when due.
  void add(uint64_t bytes);
  /// Writes the final line (100 % or where it stopped) once; the destructor calls it too.
  void finish();
  uint64_t done() const noexcept { return done_; }

 private:
  void draw(bool final_line);
  std::string label_;
  uint64_t total_, done_ = 0;
  bool enabled_, terminal_, finished_ = false;
  std::FILE* out_;
  int next_decile_ = 1;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace fn

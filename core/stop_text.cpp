// StopText (core/stop_text.h).
#include "core/stop_text.h"

#include <algorithm>

namespace fn {

StopText::StopText(const std::vector<std::string>& stops, const TextHooks& hooks)
    : stops_(stops), hooks_(hooks) {
  for (const auto& s : stops_) max_len_ = std::max(max_len_, s.size());
}

bool StopText::add(std::string_view piece) {
  const std::size_t old_len = text_.size();
  text_.append(piece);
  if (!stops_.empty()) {
    // A new match must end inside the new piece, so it starts at most max_len-1 bytes earlier.
    const std::size_t from = old_len >= max_len_ ? old_len - max_len_ + 1 : 0;
    std::size_t best = std::string::npos;
    for (const auto& s : stops_) {
      if (s.empty()) continue;
      const std::size_t pos = text_.find(s, from);
      if (pos != std::string::npos && pos < best) best = pos;
    }
    if (best != std::string::npos) {
      text_.resize(best);
      emit_upto(best);
      return true;
    }
  }
  emit_upto(text_.size() - held_suffix());
  return false;
}

void StopText::flush() {
  emit_upto(text_.size());
}

std::string StopText::take_text() {
  return std::move(text_);
}

std::size_t StopText::held_suffix() const {
  std::size_t held = 0;
  const std::size_t avail = text_.size() - emitted_;
  for (const auto& s : stops_) {
    for (std::size_t len = std::min(s.size() - (s.empty() ? 0 : 1), avail); len > held; --len) {
      if (text_.compare(text_.size() - len, len, s, 0, len) == 0) {
        held = len;
        break;
      }
    }
  }
  return held;
}

void StopText::emit_upto(std::size_t end) {
  if (end > emitted_) {
    if (hooks_.emit) hooks_.emit(std::string_view(text_).substr(emitted_, end - emitted_));
    emitted_ = end;
  }
}

}  // namespace fn

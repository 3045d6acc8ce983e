// StopText: rank 0's stop-string matcher over a generation's streamed text (core/generate.h,
// core/batch_engine.h). It keeps the whole generated text, emits through TextHooks::emit
// everything that can no longer be the start of a stop string, and cuts the text at the first
// stop string, which is never emitted, even when it spans several tokens.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "core/generate.h"

namespace fn {

class StopText {
 public:
  /// `stops` (empty strings never match) and `hooks` must outlive the matcher; only
  /// hooks.emit is used (may be empty).
  StopText(const std::vector<std::string>& stops, const TextHooks& hooks);

  /// Appends `piece`; returns true when a stop string completed (the text is cut before it and
  /// everything before it emitted).
  bool add(std::string_view piece);

  /// Emits everything held back (end of generation without a stop string).
  void flush();

  /// The text so far (after a stop: up to the stop string), moved out.
  std::string take_text();

 private:
  // Length of the longest suffix of the unemitted text that is a proper prefix of a stop string.
  std::size_t held_suffix() const;
  void emit_upto(std::size_t end);

  const std::vector<std::string>& stops_;
  const TextHooks& hooks_;
  std::string text_;
  std::size_t emitted_ = 0;
  std::size_t max_len_ = 0;
};

}  // namespace fn

// The answer pattern of an `fngen eval score` task (its "regex" field): PCRE2 in UTF mode, run
// under PCRE2's match and heap limits, so that a pattern which backtracks over a long generated
// text fails with an error instead of exhausting the stack (std::regex recursed once per
// character and crashed on ~15k characters) or the time.
#pragma once

#include <memory>
#include <optional>
#include <string>

namespace fn {

class AnswerPattern {
 public:
  /// Compiles `pattern` (Perl-compatible syntax; the ECMAScript patterns task files use, such as
  /// `^(\d+)` or `answer: (\w+)`, read the same). Throws fn::Error(Format) "\"regex\" P is not a
  /// valid PCRE2 pattern (offset N: reason)".
  explicit AnswerPattern(const std::string& pattern);
  ~AnswerPattern();
  AnswerPattern(const AnswerPattern&) = delete;
  AnswerPattern& operator=(const AnswerPattern&) = delete;

  /// The last non-overlapping match in `text` (UTF-8; invalid sequences never match): capture
  /// group 1 when the pattern has one and it took part in the match, else the whole match; no
  /// match: nullopt. Throws fn::Error(Format) naming the pattern when PCRE2 gives up (its match
  /// limit of 10^7 steps or heap limit of 64 MiB) on this text.
  std::optional<std::string> last_match(const std::string& text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string pattern_;
};

}  // namespace fn

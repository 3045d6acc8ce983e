// The record side of `fngen generate -i in.jsonl` (and `eval score`), without MPI or a model:
// the per-record seed derivation, the per-record sampling fields and their checks, the raw text
// of a record's "id" (echoed exactly as given), the scan of an existing -o file for --resume,
// the writer that keeps input order, and the progress line. apps/batch_generate.cpp runs the
// records; these pieces are unit-tested on their own (tests/test_batch_records.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/ngram.h"  // splitmix64
#include "core/sampler.h"

namespace fn {

/// The seed of one record of a batch: splitmix64(base ^ line) (core/ngram.h's splitmix64: the
/// output function of Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
/// OOPSLA 2014, z = x + 0x9e3779b97f4a7c15, z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9,
/// z = (z ^ (z >> 27)) * 0x94d049bb133111eb, z ^ (z >> 31), mod 2^64), `base` the run's --seed
/// (random when not given, printed on stderr) and `line` the record's 1-based line number in the
/// input file. Identical records on different lines so sample differently, and rerunning with the
/// same
/// --seed gives every record its seed again.
uint64_t record_seed(uint64_t base, uint64_t line) noexcept;

/// The seed of sample `sample_index` of a record whose seed is `seed` (a record's "n" asks for
/// several): `seed` itself for sample 0 (so that a record with "seed": S and one sample
/// reproduces a single run with --seed S), splitmix64(seed ^ sample_index) for the others.
uint64_t sample_seed(uint64_t seed, int64_t sample_index) noexcept;

/// Most samples one record may ask for with "n".
inline constexpr int64_t kMaxSamplesPerRecord = 1024;

/// What a record may set for itself; the flags (and generation_config.json) give the defaults.
struct RecordSettings {
  /// temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty,
  /// repeat_last_n and seed (the seed is meaningful only when seed_given).
  SamplingParams sampling;
  bool seed_given = false;        ///< the record's "seed" (else record_seed derives it)
  int64_t max_new_tokens = 0;     ///< as -n: > 0, -1 (until the context is full) or 0 (default)
  std::vector<std::string> stop;  ///< stop strings (non-empty, valid UTF-8)
  int64_t n = 1;                  ///< samples of this prompt, each its own output record
  int64_t top_logprobs = -1;      ///< as --logprobs: [0, kMaxTopLogprobs], -1 = none
};

/// The fields fngen reads from a generate record (eval score reads the same, less "n" and
/// "logprobs", plus its task fields).
inline constexpr std::array<std::string_view, 16> kGenerateRecordFields = {"id",
                                                                           "prompt",
                                                                           "prompt_ids",
                                                                           "messages",
                                                                           "seed",
                                                                           "temperature",
                                                                           "top_k",
                                                                           "top_p",
                                                                           "min_p",
                                                                           "repeat_penalty",
                                                                           "presence_penalty",
                                                                           "frequency_penalty",
                                                                           "max_tokens",
                                                                           "stop",
                                                                           "n",
                                                                           "logprobs"};

/// True for the fields fngen reads from a generate record: id, prompt, prompt_ids, messages,
/// seed, temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty,
/// max_tokens, stop, n, logprobs.
bool is_generate_record_field(std::string_view name) noexcept;

/// The sampling fields of a record (`rec`, a JSON object) applied over `defaults`:
///  - "seed": an integer in [0, 2^64 - 1];
///  - "temperature" (>= 0, 0 = greedy), "top_p" in (0, 1], "min_p" in [0, 1],
///    "repeat_penalty" (> 0), "presence_penalty", "frequency_penalty" (finite): numbers;
///  - "top_k": an integer >= 0; "max_tokens": an integer >= 1, or -1 (until the context is full);
///  - "stop": a string or a list of strings, each non-empty and valid UTF-8;
///  - "n": an integer in [1, kMaxSamplesPerRecord];
///  - "logprobs": an integer in [0, kMaxTopLogprobs] (as --logprobs).
/// The ranges are the flags' (validate_sampling_params). Fields absent or null keep the default.
/// Throws fn::Error(Format) naming the field, its value and the rule ("\"top_p\" must be a number
/// in (0, 1], got 2") for a value of the wrong type or out of range. `fields` restricts the
/// fields read (null: all of them; eval score reads no "n").
RecordSettings record_settings(const nlohmann::json& rec, const RecordSettings& defaults,
                               const std::set<std::string>* fields = nullptr);

/// The JSON text of the top-level member `key` of the JSON object text `line`, exactly as it
/// appears there (the last one when the key repeats, as nlohmann's parser keeps the last), or
/// nullopt when the object has no such member. `line` must hold one valid JSON object (parse it
/// first, which skips a leading UTF-8 byte-order mark: so does this); a key written with escapes
/// ("\u0069d") matches its unescaped form.
std::optional<std::string> member_text(std::string_view line, std::string_view key);

/// The text a record's "id" is echoed as: member_text(line, "id") (an integer past 64 bits keeps
/// its digits, a string stays the same string), or the 1-based line number when the record has
/// no "id" (or is not an object).
std::string record_id_text(std::string_view line, int64_t line_number);

/// One output line: `{"id":<id_text>,` followed by the members of `body` (an object without
/// "id"), invalid UTF-8 in its strings written as U+FFFD, and a newline.
std::string record_line(const std::string& id_text, const nlohmann::json& body);

/// The records an existing output file already holds (--resume).
struct ResumeScan {
  std::set<std::string> done;       ///< sample_key of every record written
  std::set<std::string> error_ids;  ///< id texts of error records (they stand for every sample)
  int64_t records = 0;              ///< complete lines kept
  uint64_t cut_bytes = 0;           ///< bytes of a trailing partial line removed
};

/// The key of one output record: the id text, a tab, the sample index.
std::string sample_key(const std::string& id_text, int64_t sample_index);

/// Reads the output file `path` of an earlier run for --resume: a trailing partial line (no
/// final newline: the run was killed mid-write) is cut off the file first, then every line must
/// be one JSON object with an "id"; an absent file is an empty scan. Throws fn::Error(Io) when
/// the file cannot be read or cut, fn::Error(Format) "<flag> <path>: line N is not an output
/// record of fngen generate (...)" for a line that is not.
ResumeScan scan_resume_output(const std::string& path, const char* flag);

/// Writes lines in sequence order: put(seq, line) keeps a line until every earlier sequence
/// number has been put, then writes each ready line with `write` (an empty line is a sequence
/// number that writes nothing). Sequence numbers start at 0 and are each put once.
class OrderedWriter {
 public:
  explicit OrderedWriter(std::function<void(const std::string&)> write);
  /// Stores `line` for `seq` and writes every line now in order. Throws fn::Error(Internal) for
  /// a sequence number already put; whatever `write` throws passes through.
  void put(int64_t seq, std::string line);
  /// The next sequence number to be written (= the count written so far).
  int64_t next() const noexcept { return next_; }
  /// Lines held back, waiting for an earlier one.
  std::size_t held() const noexcept { return held_.size(); }

 private:
  std::function<void(const std::string&)> write_;
  std::map<int64_t, std::string> held_;
  int64_t next_ = 0;
};

/// Writes `line` (a complete line, newline included) to `out` with one fwrite and flushes it, so
/// that a killed run leaves at most a trailing partial line (which --resume cuts off). Throws
/// fn::Error(Io) "cannot write to standard output (<reason>)" (out == stdout) or
/// "<flag> <path>: cannot write (<reason>)".
void write_line(std::FILE* out, const std::string& line, const std::string& path, const char* flag);

/// Opens `path` for appending (created 0644; with `truncate` emptied first when it is a regular
/// file) under an exclusive flock held until the file is closed, so that a second run writing the
/// same file is refused before it truncates or appends. Throws fn::Error(Io) naming `flag` and
/// the path when it cannot be opened, truncated, or is locked by another process.
std::FILE* open_output_locked(const std::string& path, bool truncate, const char* flag);

/// "records 12 / 100 (12 %), 3456 tokens, 345.6 tok/s, ETA 30 s": `done` of `total` output
/// records after `seconds` with `tokens` generated; the rate and ETA are left out while nothing
/// is done or no time has passed, and the ETA (seconds left at the current record rate) reads
/// "done" once done == total.
std::string format_batch_progress(int64_t done, int64_t total, int64_t tokens, double seconds);

/// The progress of a batch on rank 0: on a terminal one line redrawn in place at most every
/// 200 ms; elsewhere nothing (the summary line is printed by the caller in any case).
class BatchProgress {
 public:
  /// `enabled` false (other ranks, or stderr not a terminal) makes every call a no-op. `out`
  /// defaults to stderr.
  BatchProgress(int64_t total, bool enabled, std::FILE* out = nullptr);
  /// Counts one more record done with `tokens` generated tokens; redraws when due.
  void add(int64_t tokens);
  /// Clears the line (call before other stderr output and at the end).
  void clear();
  int64_t done() const noexcept { return done_; }
  int64_t tokens() const noexcept { return tokens_; }
  /// Seconds since construction.
  double seconds() const;

 private:
  int64_t total_, done_ = 0, tokens_ = 0;
  bool enabled_, drawn_ = false;
  std::FILE* out_;
  double start_ = 0, last_draw_ = -1;
};

}  // namespace fn

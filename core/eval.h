// Scripted quality evaluation for `fngen eval` (ecosystem doc §a.7): llama-perplexity windows,
// llama.cpp's KL-divergence statistics and the reference-logits file reader/writer. Called by
// apps/cmd_eval.cpp on every rank of the TP group, and by tests. The model is reached only through
// Backend::reset, Backend::forward and the vocabulary size (core/backend.h), so every backend plugs
// in unchanged. Statistics are in double; the file reader checks every size against the header
// before it reads any data.
//
// ---- Reference-logits file, version 1 (".fnlogits"; scripts/reference/dump_reference_logits.py
//      writes the same format from transformers) ----
//   bytes [0, 8)        header length H, uint64 little-endian
//   bytes [8, 8+H)      JSON header (UTF-8), padded with spaces so that 8+H is a multiple of 64
//   bytes [8+H, end)    the arrays, raw little-endian, row-major, at header["arrays"][name]
//                       ["offset"] (bytes from 8+H); the file ends exactly after the last array.
// Header fields (all required unless marked):
//   "magic": "fngen.reference_logits", "version": 1
//   "vocab_size": V      (columns of a full row; every token id is < V)
//   "tokenizer": "ids-only" (ids came from the user) or "fnv1a64:<file name>:<16 hex digits>"
//                (64-bit FNV-1a of the tokenizer.json / tokenizer.model bytes; see tokenizer_id())
//   "dtype": "float32" | "float16"   (of the value array)
//   "mode": "full" | "topk", "top_k": K (topk only)
//   "values": "logits" (raw, full mode only) | "logprobs" (natural-log softmax over all V)
//   "n_positions": N     (recorded rows = sum of the sequences' n_rows)
//   "sequences": [{"tokens": [ids fed in order from a fresh state], "first": f, "n_rows": r,
//                  "next_token": id or -1}]   rows are positions f..f+r-1 in order, f+r <= len;
//                the row of position p predicts tokens[p+1], or next_token for the last token
//                (-1: unknown; such a row counts for KLD and top-1 but has no NLL).
//   "arrays": {name: {"dtype", "shape", "offset"}}:
//       full: "values" dtype [N, V]
//       topk: "topk_ids" int32 [N, K] (descending probability), "topk_logprobs" dtype [N, K],
//             "residual_mass" float32 [N] (1 - sum of the top-K probabilities, computed in double),
//             "target_logprob" float32 [N] (log-prob of the row's target; NaN without target)
//   "source" (optional): free provenance object (producer, model, command).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/error.h"
#include "core/generate.h"

namespace fn {

/// The "magic" value of a reference-logits header and the version this build reads and writes.
inline constexpr const char* kLogitsMagic = "fngen.reference_logits";
inline constexpr int kLogitsVersion = 1;

/// 64-bit FNV-1a of `bytes` (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
uint64_t fnv1a64(std::string_view bytes) noexcept;

/// Tokenizer identity of a model directory: "fnv1a64:tokenizer.json:<hex>" over that file's bytes
/// (tokenizer.model when there is no tokenizer.json), "ids-only" when it has neither. Throws
/// fn::Error(Io) when the file exists but cannot be read.
std::string tokenizer_id(const std::filesystem::path& model_dir);

/// Parses token ids separated by one comma (spaces around it allowed) or by whitespace (newlines
/// included); each must lie in [0, vocab_size). An empty item (",1", "1,,2", "1,") is an error,
/// and so is a negative id whatever the vocabulary. vocab_size 0 checks the syntax alone (before
/// the vocabulary is known): ids past the int32 range then come back as 0 and are the caller's
/// to check again. `what` names the flag or file in errors (fn::Error of `kind`: Usage for a
/// flag's value, Format for a file's content), and an error names the item by its place in the
/// list counted from 1 ("item 2 = 512").
std::vector<int32_t> parse_token_ids(std::string_view text, int64_t vocab_size,
                                     const std::string& what, ErrorKind kind = ErrorKind::Usage);

// ---------------------------------------------------------------- per-row math

/// Natural-log softmax of `logits` in double: out[i] = l[i] - max - log(sum_j exp(l[j] - max)).
void log_softmax(std::span<const float> logits, std::vector<double>& out);

/// -log softmax(logits)[target] in double. Throws fn::Error(Internal) for a target out of range.
double token_nll(std::span<const float> logits, int32_t target);

/// Index of the largest value, ties to the lowest index.
int64_t argmax(std::span<const float> values) noexcept;

/// Mean and standard error as llama.cpp's mean_and_uncertainty: f = sum/n,
/// err = sqrt((sum2/n - f²)/(n-1)) when that variance is > 0 and n > 10, else 0.
struct MeanErr {
  double mean = 0, err = 0;
};
MeanErr mean_and_uncertainty(double sum, double sum2, int64_t count) noexcept;

/// Percentile with linear interpolation between order statistics (llama.cpp's and numpy's
/// default): sorted x, h = (n-1)q, x[⌊h⌋] + (h-⌊h⌋)(x[⌊h⌋+1]-x[⌊h⌋]). `sorted` must be ascending
/// and non-empty (fn::Error Internal otherwise).
double percentile(std::span<const double> sorted, double q);

// ---------------------------------------------------------------- perplexity

/// llama-perplexity over `tokens`: windows (chunks) of n_ctx tokens, window i = tokens[i·n_ctx,
/// (i+1)·n_ctx), each run from a fresh state; the logits of window positions n_ctx/2 .. n_ctx-2
/// score the next token (n_ctx - 1 - n_ctx/2 tokens per window). chunks = min(max_chunks,
/// ⌊len/n_ctx⌋) (max_chunks <= 0: all). PPL = exp(mean NLL); uncertainty = PPL · standard error
/// of the NLL (llama.cpp's "Final estimate: PPL = x +/- e").
struct PerplexityResult {
  int64_t n_ctx = 0, n_chunks = 0, n_tokens = 0;
  int64_t count = 0;                 ///< scored tokens
  double sum_nll = 0, sum_nll2 = 0;  ///< over scored tokens
  std::vector<double> running_ppl;   ///< after each chunk: exp(mean NLL so far), llama.cpp's [i]
  double ppl() const;                ///< exp(sum_nll / count)
  double ppl_err() const;            ///< ppl() · standard error of the NLL (0 when undefined)
};

class LogitsWriter;
struct LogitsSequence;

/// Runs sequence `s` from a fresh state (Backend::reset) through Backend::prefill_rows and calls
/// `on_rows(results, r0)` with the results of its rows r0 .. r0 + results.rows - 1 (row r =
/// position s.first + r, its target s.target(position)): one call without full rows, calls of
/// at most 128 rows with `keep_logits` (bounding the host copy). `gather` holds gather_k ids per
/// row of s (RowQuery::gather). Every rank of the TP group calls it alike. Throws as
/// prefill_rows, fn::Error(Internal) for rows outside the tokens or a gather of another size.
void sequence_rows(Backend& backend, const LogitsSequence& s, std::span<const int32_t> gather,
                   int64_t gather_k, bool keep_logits,
                   const std::function<void(const RowResults&, int64_t)>& on_rows);

/// Runs the windows on `backend` (every rank of the TP group calls it with the same tokens), each
/// one call of Backend::prefill_rows (the batched prefill; rows from n_ctx/2 on, the NLL from
/// the row's log-softmax normaliser and target logit reduced on the device), full rows crossing
/// to the host only when rows are saved. Every rank of the TP group must run the same calls, so
/// every rank passes keep_rows = true when rank 0 has a `save` writer (the others have none);
/// `save` alone implies it.
/// `on_chunk(i, partial)` runs after chunk i (0-based). When `save` is non-null (rank 0) each
/// scored row is appended to it (its header must come from perplexity_sequences()). Throws
/// fn::Error(Usage) when n_ctx < 4 or tokens hold fewer than n_ctx tokens (naming both numbers and
/// -c/--ctx-size).
PerplexityResult perplexity(Backend& backend, std::span<const int32_t> tokens, int64_t n_ctx,
                            int64_t max_chunks,
                            const std::function<void(int64_t, const PerplexityResult&)>& on_chunk,
                            LogitsWriter* save = nullptr, bool keep_rows = false);

// ---------------------------------------------------------------- the reference-logits file

enum class LogitsDtype { Float32, Float16 };
enum class LogitsMode { Full, TopK };

/// One teacher-forced sequence of a reference file (see the format above).
struct LogitsSequence {
  std::vector<int32_t> tokens;
  int64_t first = 0;
  int64_t n_rows = 0;
  int32_t next_token = -1;
  /// The token row `p` (a position, first <= p < first+n_rows) predicts, or -1.
  int32_t target(int64_t p) const {
    return p + 1 < static_cast<int64_t>(tokens.size()) ? tokens[static_cast<std::size_t>(p + 1)]
                                                       : next_token;
  }
};

/// The parsed header. `values_are_logprobs` is false only for full mode with "values": "logits".
struct LogitsHeader {
  int64_t vocab_size = 0;
  std::string tokenizer = "ids-only";
  LogitsDtype dtype = LogitsDtype::Float32;
  LogitsMode mode = LogitsMode::Full;
  int64_t top_k = 0;
  bool values_are_logprobs = false;
  std::vector<LogitsSequence> sequences;
  nlohmann::json source = nlohmann::json::object();
  /// Sum of n_rows.
  int64_t n_positions() const;
};

/// The windows perplexity() scores, as sequences of a header (first = n_ctx/2,
/// n_rows = n_ctx-1-first, next_token -1 since every row's target lies inside the window).
std::vector<LogitsSequence> perplexity_sequences(std::span<const int32_t> tokens, int64_t n_ctx,
                                                 int64_t max_chunks);

/// One reference row as eval uses it: full mode -> logprobs (V values, double; the stored values
/// re-normalised with a log-softmax in double, so that FP16 rounding cannot leave Σp != 1); topk
/// mode -> ids/logprobs of the top K, the residual mass and the target's log-prob.
struct RefRow {
  std::vector<double> logprobs;  ///< full mode: all V
  std::vector<int32_t> topk_ids;
  std::vector<double> topk_logprobs;
  double residual_mass = 0;
  double target_logprob = 0;  ///< topk mode (NaN without target); full mode: from logprobs
  int64_t top1 = 0;           ///< reference argmax
};

/// Writes a reference-logits file row by row. Rows must come in the header's order.
///
/// Staged: the bytes go to a sibling staging file of its own, "<path>.partial.<pid>.<random>"
/// (create_staging_file, core/paths.h: in the directory of the file `path` names, a symlink
/// followed as fopen would, so that the rename stays inside one file system), and only a
/// successful close() renames it onto that file. Until then a file already at `path` is
/// untouched; a writer destroyed without a successful close() (an exception unwinding, a failed
/// write, missing rows) removes its staging file, so the final path never holds a truncated file.
/// Two writers of one path (two runs with the same -o) never share a staging file: the file at
/// `path` is the complete output of the writer whose close() renamed last. A killed process can
/// leave its staging file (never the final file); no later writer touches it. A `path` that
/// exists and is not a regular file (/dev/null, /dev/full, a FIFO) cannot be renamed onto: it is
/// written in place, as a plain fopen would.
class LogitsWriter {
 public:
  /// Validates the header (vocab_size > 0, top_k in [1, V] for topk, sequences' ranges and ids),
  /// creates its staging file (a file at `path` keeps its permission bits through the rename) and
  /// writes the header. `what` (e.g. "-o/--output")
  /// names the flag that gave the path in every I/O error ("-o/--output out.fnl: write failed at
  /// byte 448 of out.fnl.partial.<pid>.<random> (...)"; in place: "-o/--output /dev/full: write
  /// failed at byte 448 (...)"). Throws fn::Error(Usage) for a bad header, Io when the staging file
  /// (or, in place, `path`) cannot be created or its header written; nothing is left behind then.
  LogitsWriter(const std::filesystem::path& path, LogitsHeader header,
               const std::string& what = {});
  /// Without a successful close(): closes the file, removes the staging file and logs a warning
  /// naming the path and the rows written (never throws).
  ~LogitsWriter();
  LogitsWriter(const LogitsWriter&) = delete;
  LogitsWriter& operator=(const LogitsWriter&) = delete;
  /// Appends the next row: `logits` are the raw FP32 logits (V values) of that position; the
  /// writer converts to the header's values/dtype/mode. Throws fn::Error(Internal) past the last
  /// row or for a wrong length. A failed write does not throw here (the run it is part of holds
  /// every TP rank in lockstep): the writer stops writing and check() / close() report it.
  void append(std::span<const float> logits);
  /// Throws fn::Error(Io) naming the first failed write, if one failed; the caller runs it where
  /// every rank agrees (agree_on_error) so that a run stops soon after a full disk, not at its end.
  void check() const;
  /// Flushes, syncs (fsync) and closes the staging file and renames it onto `path`: the final
  /// file appears here, complete, or not at all. Throws fn::Error(Io) naming the first failed
  /// write, a failed flush/sync/close or a failed rename (each naming the file), else Internal
  /// unless every row was written; on any throw the staging file is removed and `path` is as it
  /// was.
  /// A second call does nothing.
  void close();
  const LogitsHeader& header() const noexcept { return header_; }

 private:
  void write_row(std::span<const float> logits);  // the next row's bytes (Io on failure)
  void discard() noexcept;                        // closes file_, removes staging_ (if any)
  LogitsHeader header_;
  std::string name_;               // the flag (if given) and the path, for messages
  std::filesystem::path final_;    // the file renamed onto (symlinks at `path` followed)
  std::filesystem::path staging_;  // create_staging_file's; empty in place or once renamed/removed
  std::string at_;                 // " of <staging_>" in write messages (empty in place)
  std::FILE* file_ = nullptr;
  bool closing_ = false;  // close() ran (its own error was thrown: no warning)
  uint64_t data_start_ = 0;
  int64_t n_written_ = 0;
  int64_t seq_ = 0, pos_ = 0;  // sequence and position of the next row
  std::string write_error_;    // the first failed write's message (append stops writing)
  std::vector<uint64_t> offsets_;
};

/// Reads a reference-logits file. The constructor parses and validates the header and checks the
/// file size against it; rows are read on demand.
class LogitsReader {
 public:
  /// Throws fn::Error(Io) when `path` cannot be opened, Format naming the path and the field for
  /// a bad magic/version/field, an array whose offset or shape disagrees with the header, or a
  /// file size other than the one the header implies ("truncated" when shorter).
  explicit LogitsReader(const std::filesystem::path& path);
  ~LogitsReader();
  LogitsReader(const LogitsReader&) = delete;
  LogitsReader& operator=(const LogitsReader&) = delete;
  const LogitsHeader& header() const noexcept { return header_; }
  /// Row `i` (0 <= i < n_positions) whose target is `target` (-1 none). Throws Io on a read
  /// failure, Internal for i out of range, Format naming the row for values a reference cannot
  /// hold: a non-finite value; in top-K mode also an id outside the vocabulary or twice in the
  /// row, a log-probability above kLogprobSlack, a negative residual_mass, or probabilities that
  /// add up to more than 1 + kLogprobSlack.
  void read_row(int64_t i, int32_t target, RefRow& row);
  /// The rounding a producer may leave in stored top-K log-probabilities (above 0) and in their
  /// total probability (above 1).
  static constexpr double kLogprobSlack = 1e-3;

 private:
  LogitsHeader header_;
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  uint64_t data_start_ = 0;
  std::vector<uint64_t> offsets_;  // per array in header order
  std::vector<char> buf_;
  std::vector<int32_t> sorted_ids_;  // the duplicate check's scratch
};

/// Serialises a header to its JSON form (as written to the file; "arrays" excluded).
nlohmann::json header_to_json(const LogitsHeader& h);

// ---------------------------------------------------------------- KL divergence

/// llama.cpp's kl_divergence statistics of a test model Q against a reference ("base"), one row
/// at a time: per row KL(base ‖ Q) = Σ p_i (log p_i − log q_i) in double over all V (full mode,
/// no cut-off) or, in topk mode, Σ_{i∈topK} p_i (log p_i − log q_i) + r_p (log r_p − log r_q) with
/// r_q = 1 − Σ_{i∈topK} q_i (the top-K + residual approximation, a lower bound of the full KL);
/// NLLs and Δp = q(target) − p(target) on rows with a target; same top-1 = argmax agreement.
class KldStats {
 public:
  /// Adds one row: `q_logits` are the test model's raw logits (V values).
  void add(std::span<const float> q_logits, const RefRow& ref, int32_t target);
  /// Adds one row of a top-K reference from the test model's reductions of that row
  /// (RowResults, core/row_stats.h): its log-probs at ref.topk_ids (same order), its argmax and
  /// the log-prob of `target` (ignored when target is -1). The same numbers as add() on the full
  /// row, up to the summation order of the normaliser. Throws fn::Error(Internal) for a full
  /// reference row or a count other than K.
  void add_topk(std::span<const double> q_topk_logprobs, int32_t q_argmax, double q_target_logprob,
                const RefRow& ref, int32_t target);
  int64_t count() const noexcept { return static_cast<int64_t>(kld_.size()); }
  int64_t count_nll() const noexcept { return count_nll_; }
  /// The three blocks of llama.cpp's output (perplexity, KL divergence, token probability), one
  /// text, lines as llama.cpp prints them.
  std::string report() const;
  /// The same numbers, machine-readable (keys: ppl_q, ppl_base, ..., kld {mean, err, max, p99_9,
  /// p99, p95, p90, median, p10, p5, p1, p0_1, min}, delta_p {...}, same_top1, counts).
  nlohmann::json to_json() const;
  /// One llama.cpp-style running line (PPL, ln ratio, KLD, Δp RMS, same top p) after a chunk.
  std::string chunk_line(int64_t chunk) const;
  /// Header of chunk_line's table.
  static std::string chunk_header();
  double mean_kld() const;
  double same_top1() const;  ///< fraction in [0, 1]
  double ppl_q() const;      ///< exp(mean NLL of Q)
  double ppl_base() const;   ///< exp(mean NLL of the reference)

 private:
  double sum_nll_ = 0, sum_nll2_ = 0, sum_nll_base_ = 0, sum_nll_base2_ = 0, sum_nll_nll_base_ = 0;
  double sum_kld_ = 0, sum_kld2_ = 0, sum_dp_ = 0, sum_dp2_ = 0, sum_dp4_ = 0;
  int64_t count_nll_ = 0, same_top_ = 0;
  std::vector<double> kld_, dp_;
  // The top-K + residual KL of one row from the model's log-probs `lq` at ref.topk_ids.
  static double topk_kld(std::span<const double> lq, const RefRow& ref);
  // Accumulates one row's KL, top-1 agreement and (target >= 0) the NLL of Q and of the base.
  void add_parts(double kld, bool same_top, int32_t target, double nll, const RefRow& ref);
  std::vector<double> lq_, gathered_;  // scratch
};

/// Runs every sequence of `reader`'s header on `backend` through Backend::prefill_rows
/// (sequence_rows) and accumulates KldStats: for a top-K base the device gathers the model's
/// log-probs at the reference's K ids per row (rank 0 reads a sequence's rows first and
/// broadcasts their ids), so only K + 2 numbers per row cross to the host; a full base takes
/// the full rows. Every rank of
/// the TP group calls it; `reader` is non-null on rank 0 only, which broadcasts the header's
/// sequences through `coll` first. `on_sequence(i, stats)` runs on rank 0 after sequence i.
/// Throws fn::Error(Format) when the backend's vocab_size differs from the file's (naming both).
KldStats kl_divergence(Backend& backend, Collectives& coll, LogitsReader* reader,
                       const std::function<void(int64_t, const KldStats&)>& on_sequence);

// ---------------------------------------------------------------- multiple-choice log-likelihood

/// One continuation's score (lm-evaluation-harness' loglikelihood request): the summed natural-log
/// probability of its tokens given the context and the tokens before them, its token count, and
/// whether every token was the model's argmax at its position (greedy match).
struct ChoiceScore {
  double logprob = 0;
  int64_t n_tokens = 0;
  bool greedy = true;
};

/// Scores each of `choices` (each >= 1 token) as the continuation of `context` (>= 1 token): the
/// context's first n-1 tokens run once through Backend::prefill (from a fresh state), the state
/// is kept (Backend::snapshot), and per choice the state is restored (Backend::restore) and
/// [last context token] ++ choice[0 .. m-2] runs through Backend::prefill_rows with the choice's
/// tokens as targets: row j's target log-prob is log p(choice[j] | context, choice[<j]). Every
/// rank calls it alike. Throws fn::Error(Internal) for an empty context or choice or a backend
/// without snapshot, and as prefill_rows (Usage when context + choice exceed the context size).
std::vector<ChoiceScore> score_choices(Backend& backend, std::span<const int32_t> context,
                                       const std::vector<std::vector<int32_t>>& choices);

/// One multiple-choice item of score_items: its context (>= 1 token) and choices (each >= 1).
struct ChoiceItem {
  std::vector<int32_t> context;
  std::vector<std::vector<int32_t>> choices;
};

/// score_choices for many items, side by side in the backend's sequence slots where it has
/// more than one and capabilities().copy_slot (else item after item through score_choices).
/// Items are taken in order, in groups whose choices together fit slot_count(): the contexts'
/// first n-1 tokens run in one Backend::prefill_slots call, each on the slot of the item's first
/// choice; that slot is copied (Backend::copy_slot) to the slots of its other choices; then every
/// choice of the group ([last context token] ++ choice[0 .. m-2], the choice as targets) runs in
/// one prefill_slots call with a row query. An item with more choices than slots runs alone
/// through score_choices. Returns score_choices' list per item: the same values where
/// prefill_slots runs its pieces one after another (the cpu backend: bitwise), a batched pass's
/// within the numerics contract (docs/numerics.md). Leaves slot 0 selected. Every rank calls it
/// alike. Throws as score_choices.
std::vector<std::vector<ChoiceScore>> score_items(Backend& backend,
                                                  const std::vector<ChoiceItem>& items);

/// The index of the largest value, ties to the lowest index (lm-eval's argmax): acc picks it over
/// the summed log-probs, acc_norm over log-prob / byte length of each choice's text. Throws
/// fn::Error(Internal) for an empty list.
int64_t best_choice(std::span<const double> values);

/// Feeds each sequence of `header` (identical on every rank) through Backend::prefill_rows with
/// full rows (sequence_rows) and appends its rows to `writer`
/// (non-null on rank 0 only): the engine side of `fngen eval dump-logits`. `on_row(n)` runs on
/// every rank after row n (1-based count over all sequences) is written, e.g. to agree on
/// LogitsWriter::check. The caller closes the writer (LogitsWriter::close, which reports a failed
/// write), on every rank's agreement.
void dump_logits(Backend& backend, const std::vector<LogitsSequence>& sequences,
                 LogitsWriter* writer, const std::function<void(int64_t)>& on_row = {});

}  // namespace fn

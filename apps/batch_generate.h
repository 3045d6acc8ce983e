// Batch generation, `mpirun -np W fngen generate --tp T -i in.jsonl [-o out.jsonl] [--resume]`:
// the W ranks form W/T tensor-parallel groups (consecutive world ranks, one node each; GPUs by
// node-local rank), each loads the model once, and world rank 0 hands the records out: a group
// runs up to --max-batch records side by side (continuous batching, core/batch_engine.h; a
// record enters as soon as a slot frees), its leader asks for records as slots free, and each
// output line goes back to rank 0, which writes the records in input order, each as soon as it
// and every earlier one are done. A record's output does not depend on its neighbours. Each record
// may set its own sampling ("seed", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
// "presence_penalty", "frequency_penalty", "max_tokens", "stop", "n"; apps/batch_records.h);
// without a "seed" its seed derives from
// --seed and its line number. --resume skips the records an earlier run already wrote to -o.
// Also the pieces the single-prompt path shares (the result JSON, the -n rules).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "apps/backend.h"
#include "apps/batch_records.h"
#include "core/batch_engine.h"
#include "core/collectives.h"
#include "core/generate.h"
#include "tokenizer/chat.h"

namespace fn {

class MpiContext;
class Tokenizer;

/// -n/--max-new-tokens when not given: 256, or fewer when the context ends first.
inline constexpr int64_t kDefaultNewTokens = 256;

/// The tokens to generate after a prompt of n_prompt tokens: `max_new_tokens` as given when
/// > 0; 0 (the default) is kDefaultNewTokens capped at the context's end; -1 is up to the
/// context's end. At least 1 (check_room ran before).
int64_t new_tokens_for(int64_t n_prompt, int64_t max_new_tokens, int64_t ctx);

/// The prompt plus -n must fit the context; the default -n (0) and -1 (until the context is
/// full) need room for one token. Throws fn::Error(Usage) for an empty prompt and for an -n the
/// prompt leaves no room for; fn::Error(Format) when the prompt alone leaves no room
/// (n_prompt >= ctx: bad input, as the same prompt is a bad record in a batch). The messages
/// name -n/--max-new-tokens and -c/--ctx-size.
void check_room(int64_t n_prompt, int64_t max_new_tokens, int64_t ctx);

/// The sampling settings as written into results: temperature, top_k, top_p, min_p,
/// repetition_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed.
nlohmann::json sampling_json(const SamplingParams& s);

/// One line describing the sampling settings for the summaries on stderr.
std::string sampling_text(const SamplingParams& s);

/// The result fields shared by --json and the JSONL records: n_prompt_tokens, n_gen_tokens,
/// text, token_ids, finish_reason, ttft_ms, prefill_ms, per_token_ms, tpot_ms (mean/p50/p90/
/// p99/max/count; null statistics without an inter-token gap), e2e_ms, decode_tokens_per_s
/// (null with one token), prefill_tokens_per_s; with `chat` also content (and reasoning when
/// the text has a think block); with r.logprobs (--logprobs K) also "logprobs": per generated
/// token {"id", "logprob", "top_logprobs": [{"id", "logprob"} ...]} (natural logs, the K most
/// likely first), each entry with "token" (its text, invalid UTF-8 as U+FFFD) and "bytes" (its
/// raw bytes) when `tokenizer` is given.
nlohmann::json result_json(const GenerationResult& r, bool chat, const Tokenizer* tokenizer);

/// How record_prompt turns a record's prompt into ids.
struct RecordPromptOptions {
  const Tokenizer* tokenizer = nullptr;  ///< null: the model directory has none
  int64_t vocab_size = 0;
  bool chat = false;          ///< --chat: "prompt" is rendered as a user turn of the chat template
  std::string system_prompt;  ///< prepended to chat prompts and "messages" without a system turn
  ChatOptions chat_options;
  std::filesystem::path model_dir;  ///< named in the message of a text prompt without tokenizer
};

/// A record's prompt as ids, and whether it went through the chat template.
struct RecordPrompt {
  std::vector<int32_t> ids;
  bool chat = false;
};

/// The prompt of one generate or eval score record (a JSON object): exactly one of "prompt" (a
/// string; with o.chat a user turn of the template), "prompt_ids" (integers in
/// [0, vocab_size)) or "messages" (chat_messages_from_json). Throws fn::Error(Format) naming the
/// field (a record that is not an object, no or several prompt fields, a wrong type, an id
/// outside the vocabulary, text the tokenizer refuses), fn::Error(Usage) for text without a
/// tokenizer.
RecordPrompt record_prompt(const nlohmann::json& rec, const RecordPromptOptions& o);

/// "  r0 12.3  r1 12.4": per-rank MiB for the summaries.
std::string memory_text(const std::vector<double>& mib);

/// The seed every record's seed derives from (record_seed, apps/batch_records.h): `seed` (--seed)
/// when given, else a random one drawn on rank 0 of `coll`, broadcast, and printed by rank 0 on
/// stderr ("`who`: no -s/--seed given: ... rerun with --seed N ...") so that a rerun reproduces
/// every record. Collective over `coll`.
uint64_t batch_base_seed(std::optional<uint64_t> seed, Collectives& coll, const char* who);

/// Checks the --tp of a batch run against the world size: 0 (unset) or a divisor of
/// `world_size` (world_size / tp data-parallel groups). Throws fn::Error(Usage) naming both.
void check_batch_tp(int64_t tp, int world_size);

/// Everything a batch run needs besides the records.
struct BatchOptions {
  std::string input;                ///< -i path (for messages)
  std::string output;               ///< -o path; empty: standard output
  bool resume = false;              ///< skip the records -o already holds, append the rest
  std::filesystem::path model_dir;  ///< the checkpoint (and tokenizer) directory
  /// --random-weights: the config.json whose geometry each group builds on random device weights
  /// (seeded by weights_seed); model_dir then names only the tokenizer directory (may be empty).
  std::filesystem::path random_config;
  uint64_t weights_seed = 0;
  BackendFlags backend;  ///< --tp: the group size (0: the world size)
  int64_t ctx = 0;       ///< context size in tokens
  /// The defaults a record overrides: sampling (generation_config.json, then the flags; the seed
  /// is unused), max_new_tokens (-n: 0 default, -1, or N), stop (--stop) and top_logprobs
  /// (--logprobs).
  RecordSettings defaults;
  std::optional<uint64_t> seed;         ///< --seed; none: a random one, drawn on rank 0 and printed
  std::vector<int64_t> stop_token_ids;  ///< eos ids (config and generation_config)
  bool ignore_eos = false;
  bool chat = false;  ///< render "prompt" as a user turn of the chat template
  ChatOptions chat_options;
  std::string system_prompt;   ///< prepended to chat prompts and "messages" without a system turn
  bool host_sampling = false;  ///< --host-sampling (GenerateOptions::host_sampling)
  /// --prefill-budget: prompt tokens a group prefills per engine step (BatchEngineOptions).
  int64_t prefill_budget = kDefaultPrefillBudget;
  int64_t vocab_size = 0;
};

/// Runs the batch on every rank (collective over `world`, the MPI world's collectives):
/// `lines` are the input file's lines (rank 0 only; blank lines are skipped, line numbers count
/// them), `tokenizer` rank 0's tokenizer (null when the model directory has none; each group
/// leader loads its own). Writes one output line per record and sample (an error record, with
/// "finish_reason": "error" and the message, for a record that cannot run), a progress line on
/// a terminal and a summary on stderr. Throws fn::Error on every rank alike (agreed on): Usage
/// for a --tp that does not divide the world or a group spanning nodes, what the load throws,
/// Io for -o, Format when every record failed, and the first error of a generation.
int run_batch_generate(const BatchOptions& options, const std::vector<std::string>& lines,
                       const Tokenizer* tokenizer, MpiContext& mpi, Collectives& world);

}  // namespace fn

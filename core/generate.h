// The generation loop of `fngen generate` and `fngen bench` (docs/design.md "The main job", steps
// 7-9), over any Backend (core/backend.h): prefill the prompt, then sample and decode until a stop
// id, a stop string, max_new_tokens or the context end, with per-token timing. One function,
// generate(), chooses between the two ways of sampling: on the device inside the backend's decode
// loop (Backend::decode) when the backend has it and the options allow it, else forward() and the
// host sampler. Called on every rank of the TP group with the same prompt. Invariant: every rank
// takes the same decision at every step (docs/model.md §E.3): the logits and the sampler state are
// identical on all ranks, and on the host path rank 0's token and stop decision are broadcast
// anyway, so that a divergence can never leave the ranks running different sequences (and stop
// strings, matched on text only rank 0 has, need it).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/backend.h"
#include "core/collectives.h"
#include "core/sampler.h"

namespace fn {

/// Rank 0's text side (core does not see the tokenizer; apps adapts StreamingDetokenizer).
/// Every member may be empty: no text is produced then.
struct TextHooks {
  /// Incremental detokenizer: the text that became complete with this id (UTF-8 safe).
  std::function<std::string(int32_t)> feed;
  /// End of stream: the held-back text.
  std::function<std::string()> finish;
  /// Streams text as it becomes final (stop strings already removed). Called on rank 0 only.
  std::function<void(std::string_view)> emit;
};

enum class FinishReason {
  Eos,     ///< a stop id was generated (kept in token_ids, not in the text)
  Stop,    ///< a --stop string appeared in the text (cut from the text)
  Length,  ///< max_new_tokens reached
};
/// "eos", "stop", "length".
const char* finish_reason_name(FinishReason r) noexcept;

/// Settings of one generation.
struct GenerateOptions {
  SamplingParams sampling;
  int64_t max_new_tokens = 256;           ///< > 0
  int64_t ctx_size = 4096;                ///< prompt + max_new_tokens must not exceed it
  std::vector<int64_t> stop_token_ids;    ///< config eos ∪ generation_config eos_token_id
  std::vector<std::string> stop_strings;  ///< matched on the detokenized text (rank 0)
  bool ignore_eos = false;                ///< do not stop on stop_token_ids
  /// Sample on the host (forward() + Sampler) even where the backend can sample on the device
  /// (--host-sampling; `fngen eval score`, which runs the model as its other modes do).
  bool host_sampling = false;
  /// Feed the prompt through forward() one token at a time instead of Backend::prefill (eval:
  /// the same logits as its per-token scoring).
  bool stepwise_prefill = false;
  /// --logprobs K: each generated token's log-prob and its K most likely alternatives
  /// (GenerationResult::logprobs; K in [0, kMaxTopLogprobs]); -1: none (nothing computed).
  int64_t top_logprobs = -1;
};

/// Latency distribution in milliseconds: mean, p50/p90/p99 (linear interpolation between order
/// statistics, numpy's default), max. All zero for no samples.
struct LatencyStats {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
  int64_t count = 0;
};
/// Stats of `ms`. Percentile q: sorted x, h = (n-1)·q, x[⌊h⌋] + (h-⌊h⌋)(x[⌊h⌋+1] - x[⌊h⌋]).
LatencyStats latency_stats(std::span<const double> ms);

/// What one generation produced; identical on every rank except `text` (rank 0 only).
struct GenerationResult {
  int64_t n_prompt_tokens = 0;
  std::vector<int32_t> token_ids;  ///< generated ids, a final stop id included
  /// With GenerateOptions::top_logprobs >= 0: one entry per token_ids entry, from the logits row
  /// that id was sampled from (on the device where it samples, else token_logprobs on the host);
  /// else empty.
  std::vector<TokenLogprobs> logprobs;
  std::string text;  ///< streamed text (rank 0; empty without TextHooks)
  FinishReason finish = FinishReason::Length;
  double prefill_ms = 0;       ///< first prompt token in -> last prompt logits out
  double ttft_ms = 0;          ///< prompt start -> first token chosen and broadcast
  std::vector<double> itl_ms;  ///< gap before each later token (token_ids.size() - 1)
  LatencyStats tpot;           ///< of itl_ms (TPOT = (E2E - TTFT) / (n - 1) = its mean)
  double e2e_ms = 0;           ///< prompt start -> last token
  /// Decode rate: itl count / sum of itl (tokens/s); 0 with fewer than 2 tokens.
  double decode_tokens_per_s = 0;
  /// Prefill rate: prompt tokens / prefill_ms (tokens/s).
  double prefill_tokens_per_s = 0;
};

/// Fills the figures derived from r.itl_ms, r.prefill_ms and r.n_prompt_tokens: r.tpot
/// (latency_stats of the gaps), r.decode_tokens_per_s (gaps / their sum; 0 without a gap) and
/// r.prefill_tokens_per_s (0 when prefill_ms is 0).
void finish_generation_stats(GenerationResult& r);

/// Throws fn::Error(Usage) unless 0 < prompt_len, max_new_tokens > 0 and prompt_len +
/// max_new_tokens <= ctx_size, except that the last is fn::Error(Format) when the prompt alone
/// leaves no room (prompt_len >= ctx_size: bad input, README "Exit codes"); the message names
/// the numbers and the flags (-c/--ctx-size, and -n/--max-new-tokens unless the prompt alone
/// leaves no room).
void check_context(int64_t prompt_len, int64_t max_new_tokens, int64_t ctx_size);

/// True when `options` can sample on the device (Backend::decode, Backend::sample_batch): every
/// sampling setting can (the penalties run on the device over the sequence's own window, stop
/// strings are matched on rank 0's text of the ids the host receives every step), so only an
/// explicit host_sampling (--host-sampling, eval score) keeps the host sampler. No errors.
bool device_sampling_supported(const GenerateOptions& options);

/// True when generate() samples on the device for `backend` and `options`: the backend has
/// decode() (BackendCapabilities::device_decode) and device_sampling_supported(options).
bool samples_on_device(const Backend& backend, const GenerateOptions& options);

/// Throws fn::Error(Usage) unless `top_logprobs` is -1 or in [0, kMaxTopLogprobs] (naming
/// --logprobs).
void check_top_logprobs(int64_t top_logprobs);

/// Generates from `prompt` on `backend`, which the caller has reset (or moved to the prompt's
/// first position). Runs on every rank of `coll` with the same arguments; `hooks` matter on
/// rank 0 only. The prompt runs through Backend::prefill (forward() per token with
/// stepwise_prefill). Then, as samples_on_device() says:
///  - on the host: per step, sample (every rank), rank 0 checks stop ids / stop strings /
///    length and broadcasts {token, stop} (8 bytes), every rank accepts the broadcast token and
///    feeds it through forward();
///  - on the device: the prompt but its last token is prefilled, then Backend::decode runs from
///    the last prompt token with options.sampling and its seed, the prompt as the penalty
///    window's start; every rank sees the same ids, so stop ids end the loop on every rank
///    alike without a broadcast; with stop strings rank 0 matches each id's text before the
///    next id is taken and broadcasts its decision (4 bytes per token), and no id after the
///    one that completed a stop string is kept, however far the device ran ahead.
/// Timing: prefill_ms is the prompt's prefill (on the device path without the last prompt
/// token, which runs in the first decode step); TTFT and the gaps are taken when each id is
/// known on the host. With options.top_logprobs >= 0 each token's TokenLogprobs is computed where
/// it is sampled (GenerationResult::logprobs). Throws check_context's and check_top_logprobs'
/// errors before any model call; fn::Error(Usage)
/// when stop_strings are given without hooks.feed on rank 0; whatever the backend throws.
GenerationResult generate(Backend& backend, Collectives& coll, std::span<const int32_t> prompt,
                          const GenerateOptions& options, const TextHooks& hooks = {});

/// Resident memory of this process now, in MiB (/proc/self/statm; 0 where unavailable).
double current_rss_mib();

/// Peak resident memory of this process in MiB (getrusage ru_maxrss).
double peak_rss_mib();

/// Every rank's peak_rss_mib(), gathered (a collective: all ranks call it). Index = rank.
std::vector<double> gather_peak_rss_mib(Collectives& coll);

}  // namespace fn

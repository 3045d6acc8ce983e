// BatchEngine: continuous batching over a Backend's sequence slots (core/backend.h), the engine
// of `fngen generate -i` and `eval score` (docs/design.md "Batched generation"). Requests enter
// free slots as they free (admit); every step() prefills up to a budget of prompt tokens of the
// admitted sequences, in admission order and in chunks, then runs one decode step for every
// sequence that has a token to feed (Backend::forward_batch) and samples each one's next token
// with its own Sampler (on a backend with batch_sampling: on the device, Backend::sample_batch,
// with the same settings over the sequence's own penalty window; stop strings are matched here
// on the host either way), so a sequence's output never depends on its neighbours: every id,
// log-prob and stop decision is the one generate() (core/generate.h) gives the request alone on
// the host path — bitwise, given a backend whose forward_batch rows equal forward()'s (the cpu
// backend). With one slot the engine runs each request through generate() itself, so a
// single-slot backend keeps its own decode loop (the cuda backend's sampling on the device).
// Invariants: every rank of the TP group calls admit() and step() in the same order with the
// same requests (hooks aside: rank 0's); rank 0 decides the stops and broadcasts them with the
// ids (2 int32 per sequence and step), so every rank finishes the same sequences at the same
// step. No CUDA here.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "core/collectives.h"
#include "core/generate.h"

namespace fn {

/// Prompt tokens a step prefills by default (SGLang's --chunked-prefill-size, vLLM's
/// max_num_batched_tokens): a long prompt enters in chunks of this size, one per step, so the
/// decoding sequences are stalled by at most one chunk.
inline constexpr int64_t kDefaultPrefillBudget = 2048;

struct BatchEngineOptions {
  int64_t max_batch = 1;  ///< sequences side by side, in [1, backend.slot_count()]
  int64_t prefill_budget = kDefaultPrefillBudget;  ///< prompt tokens per step, >= 1
};

/// One sequence to generate.
struct BatchRequest {
  int64_t key = 0;              ///< the caller's handle, returned with the result
  std::vector<int32_t> prompt;  ///< token ids, at least one
  /// As generate() reads them: sampling (with its seed), max_new_tokens (> 0), ctx_size, stop
  /// ids and strings, ignore_eos, host_sampling, stepwise_prefill, top_logprobs.
  GenerateOptions options;
  TextHooks hooks;  ///< rank 0: the detokenizer (feed/finish; stop strings need feed)
};

/// A finished sequence: the request's key and what generate() would have returned for it
/// (timings from its admission; TTFT and gaps are taken when the step's ids are broadcast).
struct BatchOutput {
  int64_t key = 0;
  GenerationResult result;
};

class BatchEngine {
 public:
  /// Runs on `backend` (its slots [0, o.max_batch) become the engine's; the selected slot is
  /// whatever the engine last used) with the collectives `coll`, both outliving the engine.
  /// Throws fn::Error(Internal) for max_batch outside [1, backend.slot_count()] or a budget < 1.
  BatchEngine(Backend& backend, Collectives& coll, const BatchEngineOptions& o);
  ~BatchEngine();
  BatchEngine(const BatchEngine&) = delete;
  BatchEngine& operator=(const BatchEngine&) = delete;

  /// Sequences the engine holds at once (max_batch).
  int64_t capacity() const noexcept { return capacity_; }
  /// Sequences admitted and not yet returned by step().
  int64_t running() const noexcept;
  /// capacity() - running().
  int64_t free_slots() const noexcept { return capacity_ - running(); }

  /// Takes `r` into a free slot (reset there); it starts prefilling at the next step(). Every
  /// rank alike. Throws, before any model call and leaving the engine as it was:
  /// check_context's and check_top_logprobs' errors (core/generate.h), the Sampler's
  /// validate_sampling_params Usage errors, fn::Error(Usage) for stop strings without
  /// hooks.feed on rank 0, fn::Error(Internal) when no slot is free.
  void admit(BatchRequest r);

  /// One iteration (nothing when no sequence runs): the prefill chunks within the budget (a
  /// sequence whose prompt completes samples its first token from the prompt's last logits),
  /// one forward_batch over the sequences with a token to feed, then rank 0's stop decisions
  /// for every token of the step, broadcast. Returns the sequences that finished, by key.
  /// With capacity() 1 it runs the one admitted request to its end through generate().
  /// Throws whatever the backend and the collectives throw (every rank alike where the backend
  /// does); the engine is then unusable.
  std::vector<BatchOutput> step();

 private:
  struct Seq;
  void decide(std::vector<Seq*>& seqs, std::vector<int32_t>& ids, std::vector<BatchOutput>& out);

  Backend& backend_;
  Collectives& coll_;
  int64_t capacity_ = 1;
  int64_t budget_ = kDefaultPrefillBudget;
  int64_t admitted_ = 0;                     // admission counter (prefill order)
  std::vector<std::unique_ptr<Seq>> slots_;  // [capacity]: null where free
};

}  // namespace fn

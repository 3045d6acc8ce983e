// Backend: one rank's loaded model as every caller sees it (docs/design.md "Backends"): the
// load-time facts, the sequence it runs (reset, one forward step, a prefill of many tokens) and,
// where the backend has them, sampling on the device and the benchmark probes. Implemented by the
// CPU reference backend (core/cpu_backend.h) and the CUDA backend (cuda/model/cuda_backend.h); the
// generation loop (core/generate.h), eval (core/eval.h) and the apps drive models only through
// it. Invariants: every rank of a TP group calls the same functions in the same order with the
// same arguments (each call may hold collectives), and every rank gets the same logits and ids.
// No CUDA syntax here.
//
// Sequences side by side: a backend holds slot_count() sequence slots (per-sequence state:
// position, caches, recurrent and convolution states, n-gram context). The single-sequence
// functions (reset, position, forward, prefill, prefill_rows, snapshot, restore, decode) act on
// the selected slot (select_slot; slot 0 after the load); forward_batch runs one decode step
// for several slots at once. The continuous-batching engine (core/batch_engine.h) drives them.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/row_stats.h"
#include "core/sampler.h"

namespace fn {

/// Facts fixed when the model was loaded (the same on every rank except the byte and time
/// figures, which are this rank's).
struct BackendInfo {
  std::string name;             ///< "cpu" or "cuda"
  std::string all_reduce_name;  ///< TP > 1: "mpi" (cpu), "custom" or "nccl" (cuda); else ""
  int64_t vocab_size = 0;       ///< columns of a logits row
  int tp_size = 1;              ///< ranks of the TP group
  double load_ms = 0;           ///< wall time of the load on this rank, milliseconds
  double weight_mib = 0;        ///< weight bytes this rank holds (host for cpu, device for cuda)
  bool random_weights = false;  ///< weights generated from a seed, not read from a checkpoint
};

/// What the optional functions of Backend do on this backend. A false entry means the function
/// throws fn::Error(Internal) (a caller's bug: check the flag first).
struct BackendCapabilities {
  bool device_decode = false;   ///< decode(): sampling inside the device's decode loop
  bool device_memory = false;   ///< device_used_mib()
  bool graph_captures = false;  ///< graph_captures()
  bool set_position = false;    ///< set_position_for_benchmark()
  bool profile = false;         ///< profile_steps(), set_prefill_profile(), last_prefill_profile()
  bool snapshot = false;        ///< snapshot() / restore()
  bool batch_sampling = false;  ///< sample_batch()
  bool copy_slot = false;       ///< copy_slot()
};

/// One sequence's piece of a multi-sequence prefill (Backend::prefill_slots): `tokens` fed to
/// slot `slot` from that slot's position on.
struct SlotTokens {
  int64_t slot = 0;
  std::span<const int32_t> tokens;
};

/// One sequence's sampling in a batched device step (Backend::sample_batch): its settings (the
/// penalties included; the seed seeds the draw), the RNG position, the number of ids this
/// sequence sampled before (as decode() counts its steps from 0), and at step 0 the ids it
/// accepted before its first sampled one (its prompt), which start its penalty window.
struct SlotSampling {
  SamplingParams sampling;
  int64_t step = 0;
  /// Read at step 0 when the penalties are on: the sequence's accepted ids so far, oldest
  /// first (the whole prompt; the host sampler's window before its first sample). The backend
  /// keeps the window from there on, adding each id it samples for the slot. Must stay valid
  /// for the call only.
  std::span<const int32_t> history;
};

/// Which logits Backend::prefill returns.
enum class PrefillOutput {
  None,  ///< none (the caller feeds the last prompt token itself, e.g. to decode())
  Last,  ///< the last token's, vocab_size FP32 values
};

/// The per-family time of the real decode step (Backend::profile_steps): `ms[i]` milliseconds
/// per step of family `families[i]` ("hc", "gdn", "qsa", "router", "moe_routed",
/// "shared_expert", "all_reduce", "lm_head", "ple", "other" on cuda), their sum `step_ms`,
/// averaged over `steps` steps, timed eagerly or inside a CUDA graph (`in_graph`).
struct StepBreakdown {
  std::vector<std::string> families;
  std::vector<double> ms;
  double step_ms = 0;
  int64_t steps = 0;
  bool in_graph = false;
  std::vector<int64_t> segments;  ///< event-delimited segments per step, by family
  int64_t events = 0;             ///< events recorded per step
};

/// The per-family time of one prefill call (Backend::last_prefill_profile): `ms[i]` milliseconds
/// of family `families[i]` (StepBreakdown's names) over the whole call and `flops[i]` its FLOPs
/// (core/flops.h prefill_flops; 0 where the family has none counted), for `tokens` prompt tokens
/// in `passes` passes.
struct PrefillBreakdown {
  std::vector<std::string> families;
  std::vector<double> ms, flops;
  int64_t tokens = 0, passes = 0;
};

/// One rank's model and its sequence state. Not copyable; owned by the caller that loaded it.
class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  /// The load-time facts.
  const BackendInfo& info() const noexcept { return info_; }

  /// Which optional functions this backend has (default: none).
  virtual BackendCapabilities capabilities() const noexcept { return {}; }

  /// Forgets the sequence: position 0, caches and states as after the load.
  virtual void reset() = 0;

  /// Tokens processed since the load or reset() (the position of the next token).
  virtual int64_t position() const noexcept = 0;

  /// One decode step: feeds `token` at position() and returns the vocab_size FP32 logits of
  /// that position, identical on every rank (valid until the next call on this backend).
  /// Throws fn::Error(Usage) for a token outside [0, vocab_size) or a full context (naming
  /// -c/--ctx-size), fn::Error(Format) when a logit is not finite, and whatever the device or
  /// the collectives throw (Cuda, Nccl, Mpi).
  virtual std::span<const float> forward(int32_t token) = 0;

  /// Runs `tokens` at positions position() .. position() + n - 1, leaving every state as n
  /// forward() calls would (batched where the backend has it, token by token otherwise), and
  /// returns the last token's logits for PrefillOutput::Last (vocab_size FP32, identical on
  /// every rank, valid until the next call) or an empty span for None. A batched prefill may
  /// differ from forward() in the last bits (other summation orders). Throws fn::Error(Usage)
  /// for an empty list (the tokens before a bad id have run), and as forward().
  virtual std::span<const float> prefill(std::span<const int32_t> tokens, PrefillOutput output) = 0;

  /// Runs `tokens` as prefill() does (batched where the backend has it) and returns, for rows
  /// q.first .. n-1 (row p: the logits after token p), the per-row reductions of RowResults
  /// (core/row_stats.h): log-softmax normaliser, the log-prob of the row's target and of its
  /// gathered ids, the argmax, and the full rows only with q.keep_logits. The CUDA backend
  /// reduces the rows on the device (cuda/kernels/logit_stats.h) so only these values cross to
  /// the host; the default runs forward() per token and reduces on the host (host_row_stats),
  /// the reference. Results are identical on every rank. A batched run may differ from forward()
  /// in the last bits (summation orders, docs/numerics.md). Throws fn::Error(Usage) for an empty
  /// list or a query that does not fit it (check_row_query), Format for a non-finite logit, and
  /// as prefill().
  virtual RowResults prefill_rows(std::span<const int32_t> tokens, const RowQuery& q);

  /// capabilities().snapshot only: copies the sequence state (position, caches, recurrent and
  /// convolution states, n-gram context) into the backend's one snapshot slot, replacing what it
  /// held, so that restore() returns to this point (eval loglik scores each choice from the
  /// state after its context). Every rank calls it alike. Throws fn::Error(Internal) without it,
  /// fn::Error(Cuda) when the device slot cannot be allocated.
  virtual void snapshot();

  /// capabilities().snapshot only: returns the sequence state to the last snapshot(), so that the
  /// next tokens run exactly as they would have after it. Throws fn::Error(Internal) without it
  /// or before any snapshot() since the load.
  virtual void restore();

  /// capabilities().device_decode only: feeds `first` at position(), then samples up to `count`
  /// ids on the device with `sampling` (penalties, temperature, top-k, top-p, min-p, as
  /// fn::Sampler) and the RNG `seed`, feeding each back; calls on_token(id) as each id reaches
  /// the host, and stops early when it returns false: no id after that one is reported or
  /// returned, whatever the device ran ahead. `history`: the ids accepted before the first
  /// sampled one, oldest first (the prompt, `first` its last), which start the penalty window
  /// (each sampled id joins it; read only when the penalties are on). Returns the ids sampled,
  /// the one that stopped the loop included. With top_logprobs >= 0 (at most kMaxTopLogprobs,
  /// core/row_stats.h) the device also reduces each step's logits row to the id's TokenLogprobs
  /// with top_logprobs alternatives (as token_logprobs() up to the summation order of the
  /// normaliser), appended to *logprobs before on_token(id) is called; with -1 (logprobs may be
  /// null) nothing is computed. The same on every rank. Throws as forward(); fn::Error(Internal) on
  /// a backend without it or for top_logprobs outside [-1, kMaxTopLogprobs] or a null logprobs with
  /// top_logprobs >= 0.
  virtual std::vector<int32_t> decode(int32_t first, int64_t count, const SamplingParams& sampling,
                                      uint64_t seed, const std::function<bool(int32_t)>& on_token,
                                      int64_t top_logprobs, std::vector<TokenLogprobs>* logprobs,
                                      std::span<const int32_t> history);

  /// The number of sequence slots this backend holds (>= 1; 1: only the one sequence).
  virtual int64_t slot_count() const noexcept { return 1; }

  /// The slot the single-sequence functions act on (0 after the load).
  virtual int64_t selected_slot() const noexcept { return 0; }

  /// Makes slot `slot` the one the single-sequence functions act on; the other slots keep their
  /// sequences untouched. A slot never selected before starts as after reset(). Every rank
  /// calls it alike. Throws fn::Error(Internal) for a slot outside [0, slot_count()).
  virtual void select_slot(int64_t slot);

  /// One decode step for several sequences: feeds tokens[i] to slot slots[i] at that slot's
  /// position and returns their logits, row i (vocab_size FP32 values at offset i * vocab_size)
  /// for slots[i], identical on every rank and valid until the next call on this backend. Every
  /// slot's state ends as one forward(tokens[i]) on it alone would leave it, and its row equals
  /// that forward()'s logits (bitwise on a backend that runs them one after the other, as the
  /// default does; a batched device step within the numerics contract, docs/numerics.md). The
  /// selected slot is unchanged. Throws fn::Error(Internal) for mismatched lengths, an empty
  /// list, a slot outside [0, slot_count()) or one given twice, and as forward() (the slots
  /// before the failing one have run).
  virtual std::span<const float> forward_batch(std::span<const int64_t> slots,
                                               std::span<const int32_t> tokens);

  /// capabilities().batch_sampling only: forward_batch() that samples each slot's next id on
  /// the device with sampling[i] (decode()'s sampler, penalties included, over the slot's own
  /// penalty window: ids equal to decode()'s for the same logits, window, seed and step) and
  /// returns the ids, row i for slots[i]; only the ids cross to the host. Throws as
  /// forward_batch(), and fn::Error(Internal) without it or for lists of other lengths.
  virtual std::vector<int32_t> sample_batch(std::span<const int64_t> slots,
                                            std::span<const int32_t> tokens,
                                            std::span<const SlotSampling> sampling);

  /// Several sequences' tokens in one call, each piece on its own slot from that slot's position
  /// (a batched backend runs them in shared passes; the default one prefill after another),
  /// leaving every slot as prefill() on it alone would. With a query (q not null) it returns the
  /// rows of all pieces, piece after piece (each piece's row p: the logits after its token p),
  /// as prefill_rows() reduces them; q->first must be 0 and q's targets and gathered ids run
  /// over those concatenated rows. Without one it returns no rows. The selected slot is
  /// unchanged. Throws fn::Error(Internal) for an empty list, a slot outside [0, slot_count())
  /// or one given twice; fn::Error(Usage) for an empty piece, a query that does not fit the
  /// concatenated rows (check_row_query) or q->first != 0; and as prefill_rows().
  virtual RowResults prefill_slots(std::span<const SlotTokens> pieces, const RowQuery* q);

  /// capabilities().copy_slot only: slot `to` becomes a copy of slot `from`'s sequence (position,
  /// caches up to it, recurrent and convolution states, n-gram context), so that both go on
  /// alike (eval loglik runs each choice of a context on its own copy). Every rank calls it
  /// alike; the selected slot stays selected. Throws fn::Error(Internal) without it, for slots
  /// outside [0, slot_count()) or from == to.
  virtual void copy_slot(int64_t from, int64_t to);

  /// capabilities().device_memory only: device memory in use on this rank's device now, MiB
  /// (total - free). A soak compares it across records. Throws fn::Error(Internal) without it.
  virtual double device_used_mib() const;

  /// capabilities().graph_captures only: how many CUDA graphs have been captured since the load
  /// (a long run must see it stay flat). Throws fn::Error(Internal) without it.
  virtual int64_t graph_captures() const;

  /// capabilities().set_position only, benchmarks: moves the position to `position` without
  /// running tokens (the caches keep what they hold). Throws fn::Error(Usage) outside
  /// [0, ctx_size), fn::Error(Internal) without it.
  virtual void set_position_for_benchmark(int64_t position);

  /// capabilities().profile only, benchmarks: `steps` greedy decode steps from position(),
  /// `first` fed first, timed per op family, eagerly or inside a CUDA graph (`in_graph`);
  /// advances the position by `steps`. Every rank calls it alike. Throws as decode(),
  /// fn::Error(Internal) without it.
  virtual StepBreakdown profile_steps(int32_t first, int64_t steps, bool in_graph);

  /// capabilities().profile only, benchmarks: with `on`, later prefill calls time each op family
  /// (an event at every family boundary). Throws fn::Error(Internal) without it.
  virtual void set_prefill_profile(bool on);
  /// capabilities().profile only: the last profiled prefill call's breakdown (nullopt when none
  /// ran). Throws fn::Error(Internal) without it.
  virtual std::optional<PrefillBreakdown> last_prefill_profile() const;

 protected:
  explicit Backend(BackendInfo info) : info_(std::move(info)) {}

  BackendInfo info_;

 private:
  std::vector<float> batch_logits_;  // forward_batch's rows (the default implementation)
};

}  // namespace fn

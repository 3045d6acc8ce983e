// On-device token choice over the full-vocabulary logits (docs/model.md §C.8, §E.3): the
// repetition / presence / frequency penalties over the sequence's own window of accepted tokens
// (kept on the device), then greedy argmax (ties to the lowest id) or core/sampler.h's chain
// top-k -> top-p -> min-p -> temperature -> draw, with a counter-based RNG of (seed, *step) so
// every rank picks the same token. Called at the end of the CUDA decode graph and per row of the
// batched step; legal in graph capture once the workspace is sized (setup). Deterministic: same
// logits, window, seed and step -> same token.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fn {

/// One sequence's penalty window on the device: the ids it accepted (its prompt, then each id
/// sampled for it), oldest first, in a ring: accepted id k (0-based) at tokens[k % capacity].
/// The owner fills it before the sequence's first sample (e.g. with the prompt); launch_sample
/// appends every id it chooses (the id is accepted: a sequence that stops samples no further).
struct DevicePenaltyWindow {
  int32_t* tokens = nullptr;  ///< device [capacity] int32 ring of accepted ids
  int64_t* count = nullptr;   ///< device int64 scalar: ids accepted so far (not capped)
  int64_t capacity = 0;       ///< ring length, >= 1; at least the window read (see below)
};

/// Sampling settings, the device mirror of fn::SamplingParams (core/sampler.h), and the
/// sequence's penalty window.
struct DeviceSamplingParams {
  float temperature = 1.0f;  ///< <= 0: greedy (argmax, ties to the lowest id); finite
  int top_k = 0;             ///< 0: no limit; >= 0
  float top_p = 1.0f;        ///< (0, 1]; 1: off
  float min_p = 0.0f;        ///< [0, 1]; 0: off
  uint64_t seed = 0;         ///< RNG seed (the same on every rank)
  /// Penalties, FP64 as the host sampler computes them (fn::SamplingParams' values unchanged):
  double repetition_penalty = 1.0;  ///< > 0 and finite; 1: off
  double presence_penalty = 0.0;    ///< finite; subtracted once per id in the window
  double frequency_penalty = 0.0;   ///< finite; subtracted per occurrence in the window
  /// The window: the last repeat_last_n accepted ids; 0: no penalty at all; -1: every id.
  int64_t repeat_last_n = 64;
  /// Read when penalties_active(); appended to whenever window.tokens is set. Fixed while a
  /// graph built with these settings is replayed (its contents change on the device).
  DevicePenaltyWindow window;
};

/// True when launch_sample applies penalties for `s`: repeat_last_n != 0 and a penalty that is
/// not off (repetition_penalty != 1, presence_penalty != 0 or frequency_penalty != 0), exactly
/// when fn::Sampler::sample changes a logit. Host only, no errors.
bool penalties_active(const DeviceSamplingParams& s) noexcept;

/// One token choice. Semantics (equal to fn::Sampler::sample, same order):
///  penalties (penalties_active): over the window = the last min(*window.count, repeat_last_n)
///  accepted ids (all of them for -1), each distinct id t in [0, vocab) seen c times: in FP64,
///  l = logits[t]; l = l <= 0 ? l * repetition_penalty : l / repetition_penalty;
///  l -= c * frequency_penalty + presence_penalty; rounded to FP32 (fn::Sampler::apply_penalties
///  bit for bit: every operation rounded on its own, never fused) into a workspace copy of the
///  row, which the steps below read (params.logits itself is not written). A window longer than
///  window.capacity reads the last capacity ids and sets *error_flag = 3;
///  greedy: argmax of logits, ties to the lowest id (= fn::argmax_lowest);
///  else: candidates = non-NaN logits sorted by (logit desc, id asc) (a stable device radix
///  sort); top-k keeps the first k; top-p keeps the shortest prefix whose softmax mass
///  (temperature 1, FP64 sums of exp(l - max) in a fixed chunked order) reaches top_p; min-p keeps
///  logits >= max + ln(min_p); then the token is drawn from softmax(l / temperature) over the kept
///  prefix by the Gumbel-max trick: argmax_j (l_j - max) / T + G_j, G_j = -ln(-ln U_j), U_j a
///  52-bit uniform from splitmix64(seed, *step, id_j) (same distribution as the host sampler, not
///  the same RNG stream). With no filter (top_k 0, top_p 1, min_p 0) the sort is skipped.
struct SampleParams {
  const float* logits = nullptr;  ///< [vocab] FP32 full vocabulary, identical on every rank
  int64_t vocab = 0;              ///< 1 .. 2^31 - 1
  DeviceSamplingParams sampling;  ///< fixed while a graph built with it is replayed
  const int64_t* step = nullptr;  ///< device scalar: the RNG stream position (read, not advanced)
  int32_t* token_out = nullptr;   ///< device scalar: the chosen id, always in [0, vocab)
  /// device [history_capacity] or nullptr: history[*step] = id when 0 <= *step < capacity; a step
  /// outside the capacity writes nothing and sets *error_flag = 3.
  int32_t* history = nullptr;
  int64_t history_capacity = 0;
  void* workspace = nullptr;  ///< device, 256-byte aligned, sample_workspace_bytes() bytes
  /// device scalar: set to 2 when the logits hold NaN/Inf (the token is still in range: NaN never
  /// chosen unless all are NaN; penalised values are checked too: a penalty that overflows FP32
  /// sets it as well); set to 3 on a history overflow or a penalty window longer than its
  /// capacity. Never cleared here.
  int32_t* error_flag = nullptr;
  size_t workspace_bytes = 0;  ///< size of workspace (checked against the need)
  /// optional device scalar (tests, debug): candidates kept after top-k/top-p/min-p; greedy
  /// writes 1, the unfiltered path writes vocab.
  int32_t* kept_count_out = nullptr;
};

/// Workspace bytes launch_sample needs for this vocabulary and these settings (size it at setup
/// with filtered non-greedy settings, top_k > 0 or top_p < 1 or min_p > 0: that size allows
/// every setting, penalties included). Host only (queries CUB's radix-sort temp size: needs a
/// current device). Throws fn::Error(Internal) on vocab out of range, fn::Error(Cuda) when the
/// size query fails.
size_t sample_workspace_bytes(int64_t vocab, const DeviceSamplingParams& sampling);

/// Launches the choice (greedy: 2 kernels; filtered sampling: a memset, 5 kernels and the CUB
/// sort; unfiltered sampling: 2 kernels; penalties add 3 kernels before them: copy the row and
/// clear the counts, count the window's ids, apply). Measured on H200 at V 248320 (graph replay):
/// greedy 5.5 us, unfiltered sampling 9.6 us, filtered (top_k 40, top_p 0.9, min_p 0.02) 78 us,
/// most of it the full radix sort (a top-k prefilter before the sort would cut it; not done yet).
/// Throws fn::Error(Internal) on null pointers, settings out of range (penalties included: a
/// repetition_penalty <= 0 or not finite, a non-finite presence / frequency penalty,
/// repeat_last_n < -1), active penalties without a window (null pointers or capacity < 1) or a
/// short workspace; fn::Error(Cuda) on a failed launch.
void launch_sample(const SampleParams& params, cudaStream_t stream);

}  // namespace fn

// Token sampler of the generation loop (docs/model.md §C.8, llama.cpp's sampler chain): penalties,
// top-k, top-p, min-p, temperature and a seeded draw over full-vocabulary FP32 logits. Called by
// core/generate.cpp on every rank with the same logits; deterministic across ranks and machines
// (std::mt19937_64 is fully specified by the standard and the uniform variate is built from its
// raw bits), so every rank takes the same decision (docs/model.md §E.3).
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

namespace fn {

/// Sampling settings, llama.cpp's flag semantics ("off" values disable a stage).
struct SamplingParams {
  double temperature = 1.0;         ///< --temp; <= 0 means greedy (argmax, ties to the lowest id)
  int64_t top_k = 0;                ///< --top-k; 0 keeps every token (negative: Usage error)
  double top_p = 1.0;               ///< --top-p in (0, 1]; 1 cuts nothing
  double min_p = 0.0;               ///< --min-p in [0, 1]; keep p >= min_p * p_max; 0 = off
  double repetition_penalty = 1.0;  ///< --repeat-penalty (> 0); 1 = off
  int64_t repeat_last_n = 64;       ///< --repeat-last-n: penalty window; 0 = off, -1 = all
  double presence_penalty = 0.0;    ///< --presence-penalty: subtracted once per seen token
  double frequency_penalty = 0.0;   ///< --frequency-penalty: subtracted per occurrence
  uint64_t seed = 0;                ///< --seed (the caller resolves -1 to a random value)
};

/// Throws fn::Error(Usage) naming the flag when a value is out of range (temperature < 0 or
/// not finite, top_p outside (0, 1], min_p outside [0, 1], repetition_penalty <= 0,
/// repeat_last_n < -1, a non-finite penalty).
void validate_sampling_params(const SamplingParams& p);

/// One sequence's sampler: the penalty window (tokens seen) and the RNG state.
///
/// sample() applies, in llama.cpp's default order (common/sampling: penalties; top_k; top_p;
/// min_p; temperature; dist):
///  1. penalties over the last repeat_last_n accepted tokens (prompt and generated, as llama.cpp
///     accepts the prompt into its sampler): for a token seen c > 0 times, a logit l > 0 becomes
///     l / repetition_penalty, l <= 0 becomes l * repetition_penalty, then
///     l -= c * frequency_penalty + presence_penalty;
///  2. temperature <= 0: argmax of the penalised logits, ties to the lowest id (docs/model.md
///  §C.8);
///  3. top-k: the k largest logits (ties broken towards the lower id);
///  4. top-p: softmax of the survivors (temperature 1, as llama.cpp), keep the shortest prefix of
///     the sorted list whose cumulative probability reaches top_p (at least one token);
///  5. min-p: keep tokens with logit >= max logit + ln(min_p) (p >= min_p * p_max);
///  6. divide by temperature, softmax (double), draw u in [0, 1) = (rng() >> 11) * 2^-53 and
///     pick the first token whose cumulative probability exceeds u * total.
class Sampler {
 public:
  /// Validates `params` (validate_sampling_params) and seeds the RNG with params.seed.
  explicit Sampler(const SamplingParams& params);

  /// Adds a token to the penalty window (call for every prompt token and every sampled token).
  void accept(int32_t token);

  /// Picks the next token from `logits` (vocab_size FP32 values, not modified). Does not accept
  /// it. Throws fn::Error(Internal) for empty logits.
  int32_t sample(std::span<const float> logits);

  /// Step 1 of sample() alone, in place on `logits` (vocab_size FP32 values): each distinct id of
  /// the penalty window in [0, logits.size()), seen c times, becomes, in FP64 with every
  /// operation rounded on its own, l <= 0 ? l * repetition_penalty : l / repetition_penalty,
  /// minus (c * frequency_penalty + presence_penalty), rounded to FP32. Nothing when every
  /// penalty is off or the window is empty. The reference of the device sampler's penalties
  /// (cuda/kernels/sample.h). No errors.
  void apply_penalties(std::span<float> logits) const;

  const SamplingParams& params() const noexcept { return params_; }

  /// The candidates left after steps 1-5 of the last sample() with their final probabilities
  /// (after temperature), in decreasing probability (ties: lower id first). For tests.
  struct Candidate {
    int32_t id;
    double p;
  };
  const std::vector<Candidate>& last_distribution() const noexcept { return last_; }

  /// Uniform double in [0, 1) from the raw bits of the next mt19937_64 output (53 bits).
  double next_uniform();

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::deque<int32_t> window_;
  std::unordered_map<int32_t, int32_t> counts_;
  std::vector<float> work_;
  std::vector<int32_t> order_;
  std::vector<Candidate> last_;
};

/// Index of the largest value, ties to the lowest index (greedy decoding, docs/model.md §C.8).
/// Throws fn::Error(Internal) for an empty span. NaN values are never chosen unless all are NaN.
int32_t argmax_lowest(std::span<const float> values);

}  // namespace fn

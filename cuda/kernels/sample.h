// On-device token choice over the full-vocabulary logits (docs/model.md §C.8, §E.3): greedy argmax
// (ties to the lowest id) or core/sampler.h's chain top-k -> top-p -> min-p -> temperature ->
// draw, with a counter-based RNG of (seed, *step) so every rank picks the same token. Called at
// the end of the CUDA decode graph; legal in graph capture once the workspace is sized (setup).
// Deterministic: same logits, seed and step -> same token. Penalties are not applied here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fn {

/// Sampling settings, the device mirror of fn::SamplingParams (core/sampler.h) minus penalties.
struct DeviceSamplingParams {
  float temperature = 1.0f;  ///< <= 0: greedy (argmax, ties to the lowest id); finite
  int top_k = 0;             ///< 0: no limit; >= 0
  float top_p = 1.0f;        ///< (0, 1]; 1: off
  float min_p = 0.0f;        ///< [0, 1]; 0: off
  uint64_t seed = 0;         ///< RNG seed (the same on every rank)
};

/// One token choice. Semantics (equal to fn::Sampler::sample without penalties, same order):
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
  /// chosen unless all are NaN); set to 3 on a history overflow. Never cleared here.
  int32_t* error_flag = nullptr;
  size_t workspace_bytes = 0;  ///< size of workspace (checked against the need)
  /// optional device scalar (tests, debug): candidates kept after top-k/top-p/min-p; greedy
  /// writes 1, the unfiltered path writes vocab.
  int32_t* kept_count_out = nullptr;
};

/// Workspace bytes launch_sample needs for this vocabulary and these settings (size it at setup
/// with the non-greedy settings to allow both). Host only (queries CUB's radix-sort temp size:
/// needs a current device). Throws fn::Error(Internal) on vocab out of range, fn::Error(Cuda)
/// when the size query fails.
size_t sample_workspace_bytes(int64_t vocab, const DeviceSamplingParams& sampling);

/// Launches the choice (greedy: 2 kernels; filtered sampling: a memset, 5 kernels and the CUB
/// sort; unfiltered sampling: 2 kernels). Measured on H200 at V 248320 (graph replay): greedy
/// 5.5 us, unfiltered sampling 9.6 us, filtered (top_k 40, top_p 0.9, min_p 0.02) 78 us, most of
/// it the full radix sort (a top-k prefilter before the sort would cut it; not done yet). Throws
/// fn::Error(Internal) on null pointers, settings out of range or a short workspace;
/// fn::Error(Cuda) on a failed launch.
void launch_sample(const SampleParams& params, cudaStream_t stream);

}  // namespace fn

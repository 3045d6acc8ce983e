// Per-row reductions of full-vocabulary logits rows on the device (the device twin of
// core/row_stats.h's host_row_stats): the log-softmax normaliser, the argmax, the log-prob of a
// target id and of a few gathered ids. Called by the batched prefill (cuda/model/cuda_prefill.cpp)
// on each group of lm_head rows, so that `eval ppl`, `kld` and `loglik` copy a few numbers per row
// to the host instead of vocab_size floats. Not graph-captured (legal in a capture, though).
// Also the per-token top log-probs of `generate --logprobs K` (the device twin of
// core/row_stats.h's token_logprobs), captured into the decode graph after the sampler
// (cuda/model/step.cpp) when requested.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fn {

/// One launch over `rows` rows. Row r's logits are logits[r * ld .. r * ld + vocab). Per row
/// (one CTA): mx = max over the FP32 values, argmax = the lowest id holding it; lse = mx +
/// log(Σ exp(l - mx)), each term and the sum in FP64 (threads sum strided columns, then a tree
/// over the CTA: the host reference sums in column order, so the two differ in summation order
/// only); target_logprob[r] = l[targets[r]] - lse (NaN when targets is null or the id is -1);
/// gather_logprob[r * gather_k + j] = l[gather[r * gather_k + j]] - lse (NaN for id -1). A row
/// holding a NaN or infinite logit gets lse = NaN (the caller reports it as a non-finite logit).
/// Ids other than -1 must lie in [0, vocab) (not checked on the device).
struct LogitStatsParams {
  const float* logits = nullptr;     ///< device [rows, ld] FP32
  int64_t rows = 0;                  ///< >= 1
  int64_t vocab = 0;                 ///< 1 .. 2^31 - 1
  int64_t ld = 0;                    ///< >= vocab, floats between row starts
  const int32_t* targets = nullptr;  ///< device [rows] or nullptr
  const int32_t* gather = nullptr;   ///< device [rows, gather_k] or nullptr (gather_k 0)
  int64_t gather_k = 0;              ///< >= 0
  double* lse = nullptr;             ///< device [rows]
  double* target_logprob = nullptr;  ///< device [rows]
  int32_t* argmax = nullptr;         ///< device [rows]
  double* gather_logprob = nullptr;  ///< device [rows, gather_k] or nullptr (gather_k 0)
};

/// Launches the reduction (rows CTAs of 512 threads). Throws fn::Error(Internal) on null
/// outputs or sizes out of range, fn::Error(Cuda) on a failed launch.
void launch_logit_stats(const LogitStatsParams& params, cudaStream_t stream);

/// The most alternatives launch_top_logprobs reports: core/row_stats.h's kMaxTopLogprobs (this
/// header stays free of the C++20 host headers; decode.cpp checks the two agree).
inline constexpr int kTopLogprobsCapacity = 20;

/// What launch_top_logprobs writes: one device struct, copied to the host whole (248 bytes).
struct TopLogprobsOut {
  double logprob;  ///< l[chosen] - lse; NaN when *chosen is outside [0, vocab)
  /// top_logprobs[j] = l[top_ids[j]] - lse for j < k; NaN for j >= k
  double top_logprobs[kTopLogprobsCapacity];
  /// the k largest logits by (logit desc, id asc) for j < k; -1 for j >= k
  int32_t top_ids[kTopLogprobsCapacity];
};

/// One logits row reduced to the log-probs of a chosen token and of the row's k most likely ids
/// (core/row_stats.h token_logprobs, the host reference): lse = mx + log(Σ exp(l - mx)) with
/// every term and the sums in FP64 (each warp sums relative to its own max, rescaled to the
/// block's and then the row's max by one FP64 factor each: the two differ in summation order and
/// a few FP64 roundings, a few units of the last place); logprob = l[*chosen] - lse; top_ids =
/// the first k ids of the order (logit desc, id asc), exactly the host's, with l[id] - lse.
/// -0 and +0 tie (ordered by id); NaN ranks below -Inf (never among the top k while the row holds
/// k values that are not NaN). A row holding a NaN or infinite logit gets NaN for every log-prob
/// (token_logprobs refuses it; the decode step's sampler flags it). Deterministic: the same row
/// gives the same bits. No state survives a launch: the workspace is scratch.
struct TopLogprobsParams {
  const float* logits = nullptr;  ///< device [vocab] FP32
  int64_t vocab = 0;              ///< 1 .. 2^31 - 1
  /// device scalar: the id whose log-prob TopLogprobsOut::logprob reports (the sampler's output)
  const int32_t* chosen = nullptr;
  int64_t k = 0;                  ///< 0 .. min(kTopLogprobsCapacity, vocab)
  void* workspace = nullptr;      ///< device, 8-byte aligned, top_logprobs_workspace_bytes(vocab)
  size_t workspace_bytes = 0;     ///< size of workspace (checked against the need)
  TopLogprobsOut* out = nullptr;  ///< device, 8-byte aligned
};

/// Workspace bytes launch_top_logprobs needs for `vocab` columns: 176 bytes per block of 1024
/// columns, at most 45,056 (256 blocks). Host only, no CUDA call. Throws fn::Error(Internal) for
/// vocab outside [1, 2^31 - 1].
size_t top_logprobs_workspace_bytes(int64_t vocab);

/// Launches the reduction: min(ceil(vocab / 1024), 256) CTAs of 256 threads, each reducing its
/// 1024-column chunks to a (max, Σ exp) pair and its k best (logit, id) keys, then one CTA that
/// merges them and writes *out. Both kernels are programmatic dependents (cuda/common/pdl.cuh):
/// they wait for the previous kernels before reading anything. Legal inside stream capture (no
/// allocation, no synchronisation). Throws fn::Error(Internal) on null pointers, sizes out of
/// range, a misaligned or short workspace; fn::Error(Cuda) on a failed launch.
void launch_top_logprobs(const TopLogprobsParams& params, cudaStream_t stream);

}  // namespace fn

// Per-row reductions of full-vocabulary logits rows on the device (the device twin of
// core/row_stats.h's host_row_stats): the log-softmax normaliser, the argmax, the log-prob of a
// target id and of a few gathered ids. Called by the batched prefill (cuda/model/cuda_prefill.cpp)
// on each group of lm_head rows, so that `eval ppl`, `kld` and `loglik` copy a few numbers per row
// to the host instead of vocab_size floats. Not graph-captured (legal in a capture, though).
#pragma once

#include <cuda_runtime_api.h>

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

}  // namespace fn

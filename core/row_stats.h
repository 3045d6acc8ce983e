// Per-row reductions of logits rows (docs/design.md "Numerics"): the log-softmax normaliser, the
// log-prob of a target id and of a few gathered ids, and the argmax, as eval needs them from a
// batched prefill (Backend::prefill_rows, core/backend.h) without the full rows crossing to the
// host. This file holds the request and result types and the host reference (the oracle the CUDA
// kernel cuda/kernels/logit_stats.h is tested against). No CUDA here.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace fn {

/// What Backend::prefill_rows reports for the rows `first` .. n-1 of a prefill of n tokens (row p
/// = the logits after token p). Row-local indices r = p - first.
struct RowQuery {
  int64_t first = 0;  ///< rows before it report nothing (0 <= first < n)
  /// Per reported row (n - first entries, or empty = none): the id whose log-prob the row
  /// reports, -1 for none.
  std::span<const int32_t> targets;
  /// Per reported row, gather_k ids (row-major [n - first, gather_k]; -1 = none) whose log-probs
  /// the row reports (the reference's top-K ids for a KL divergence). Empty when gather_k is 0.
  std::span<const int32_t> gather;
  int64_t gather_k = 0;
  /// Also return the full FP32 rows (a file must be written, or a full-row reference compared).
  bool keep_logits = false;
};

/// What Backend::prefill_rows returns, per reported row r (n - first rows). Log-probs are natural
/// logs of softmax over all V columns, in double.
struct RowResults {
  int64_t rows = 0;
  std::vector<double> lse;             ///< [rows] max + log Σ exp(l - max)
  std::vector<double> target_logprob;  ///< [rows] l[target] - lse; NaN without target
  std::vector<int32_t> argmax;         ///< [rows] largest logit, ties to the lowest id
  std::vector<double> gather_logprob;  ///< [rows, gather_k] l[id] - lse; NaN for id -1
  std::vector<float> logits;           ///< [rows, V] keep_logits only, else empty
};

/// Checks `q` against a prefill of `n` tokens and a vocabulary of `vocab` columns: first in
/// [0, n), targets empty or n - first entries, gather n - first times gather_k entries, every id
/// -1 or in [0, vocab). Throws fn::Error(Usage) naming the field.
void check_row_query(const RowQuery& q, int64_t n, int64_t vocab);

/// Sizes `out` for `rows` rows of a query with `gather_k` gathered ids (keep_logits: V columns).
void resize_row_results(RowResults& out, int64_t rows, int64_t gather_k, bool keep_logits,
                        int64_t vocab);

/// Copies `part`'s rows into `out` (sized by resize_row_results for the same gather_k, with V =
/// `vocab` logits per row where out keeps them) from row `at` on. Throws fn::Error(Internal)
/// when they do not fit.
void append_row_results(RowResults& out, const RowResults& part, int64_t at, int64_t gather_k,
                        int64_t vocab);

/// The host reference of one row: writes reported row `r` of `out` from the FP32 `logits`
/// (V values) and the query's ids of that row. Max and argmax over the FP32 values (ties to the
/// lowest id); the sum of exp(l - max) in double, in column order. Throws fn::Error(Format) when
/// a logit is not finite.
void host_row_stats(std::span<const float> logits, const RowQuery& q, int64_t r, RowResults& out);

/// The most alternatives `generate --logprobs K` reports per token (OpenAI's top_logprobs limit).
inline constexpr int64_t kMaxTopLogprobs = 20;

/// The log-probabilities of one generated token (`generate --logprobs K`): natural logs of the
/// softmax of the model's raw logits row (before temperature, penalties and top-k / top-p /
/// min-p: what vLLM reports by default and OpenAI's logprobs are), in double.
struct TokenLogprobs {
  double logprob = 0;                ///< of the token chosen
  std::vector<int32_t> top_ids;      ///< the K largest logits, by (logit desc, id asc)
  std::vector<double> top_logprobs;  ///< their log-probs, same order
};

/// The host reference of TokenLogprobs: lse = max + log Σ exp(l - max) (the sum in double, in
/// column order, as host_row_stats), logprob = l[chosen] - lse, and the first `k` ids of the
/// order (logit desc, id asc) with l[id] - lse. Throws fn::Error(Format) when a logit is not
/// finite, fn::Error(Internal) for an empty row, `chosen` outside it, or k outside
/// [0, min(kMaxTopLogprobs, row size)].
TokenLogprobs token_logprobs(std::span<const float> logits, int32_t chosen, int64_t k);

}  // namespace fn

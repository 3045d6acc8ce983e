// Per-row reductions of logits rows: the host reference (core/row_stats.h).
#include "core/row_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace fn {

void check_row_query(const RowQuery& q, int64_t n, int64_t vocab) {
  FN_REQUIRE(q.first >= 0 && q.first < n, Usage,
             "prefill_rows: the first reported row {} is outside the {} rows", q.first, n);
  const int64_t rows = n - q.first;
  FN_REQUIRE(q.targets.empty() || static_cast<int64_t>(q.targets.size()) == rows, Usage,
             "prefill_rows: {} targets for {} reported rows", q.targets.size(), rows);
  FN_REQUIRE(q.gather_k >= 0, Usage, "prefill_rows: gather_k {} < 0", q.gather_k);
  FN_REQUIRE(static_cast<int64_t>(q.gather.size()) == rows * q.gather_k, Usage,
             "prefill_rows: {} gathered ids for {} rows of {}", q.gather.size(), rows, q.gather_k);
  const auto check = [&](std::span<const int32_t> ids, const char* what) {
    for (std::size_t i = 0; i < ids.size(); ++i)
      FN_REQUIRE(ids[i] >= -1 && ids[i] < vocab, Usage,
                 "prefill_rows: {} entry {} = {} is neither -1 nor an id in [0, {})", what, i,
                 ids[i], vocab);
  };
  check(q.targets, "target");
  check(q.gather, "gathered id");
}

void resize_row_results(RowResults& out, int64_t rows, int64_t gather_k, bool keep_logits,
                        int64_t vocab) {
  const auto n = static_cast<std::size_t>(rows);
  out.rows = rows;
  out.lse.assign(n, 0.0);
  out.target_logprob.assign(n, std::numeric_limits<double>::quiet_NaN());
  out.argmax.assign(n, 0);
  out.gather_logprob.assign(n * static_cast<std::size_t>(gather_k),
                            std::numeric_limits<double>::quiet_NaN());
  if (keep_logits)
    out.logits.assign(n * static_cast<std::size_t>(vocab), 0.0f);
  else
    out.logits.clear();
}

void append_row_results(RowResults& out, const RowResults& part, int64_t at, int64_t gather_k,
                        int64_t vocab) {
  FN_CHECK(at >= 0 && at + part.rows <= out.rows, "row results {}..{} past {} rows", at,
           at + part.rows, out.rows);
  const auto a = static_cast<std::ptrdiff_t>(at);
  std::copy(part.lse.begin(), part.lse.end(), out.lse.begin() + a);
  std::copy(part.target_logprob.begin(), part.target_logprob.end(), out.target_logprob.begin() + a);
  std::copy(part.argmax.begin(), part.argmax.end(), out.argmax.begin() + a);
  std::copy(part.gather_logprob.begin(), part.gather_logprob.end(),
            out.gather_logprob.begin() + a * gather_k);
  if (!out.logits.empty())
    std::copy(part.logits.begin(), part.logits.end(), out.logits.begin() + a * vocab);
}

void host_row_stats(std::span<const float> logits, const RowQuery& q, int64_t r, RowResults& out) {
  FN_CHECK(!logits.empty(), "row statistics of an empty row");
  float mx = logits[0];
  int32_t best = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    FN_REQUIRE(std::isfinite(logits[i]), Format,
               "the model produced a non-finite logit ({} for token {}): the checkpoint's weights "
               "hold NaN/Inf or overflow",
               logits[i], i);
    if (logits[i] > mx) {
      mx = logits[i];
      best = static_cast<int32_t>(i);
    }
  }
  double sum = 0.0;
  for (const float v : logits) sum += std::exp(static_cast<double>(v) - static_cast<double>(mx));
  const double lse = static_cast<double>(mx) + std::log(sum);
  const auto ri = static_cast<std::size_t>(r);
  out.lse[ri] = lse;
  out.argmax[ri] = best;
  if (!q.targets.empty() && q.targets[ri] >= 0)
    out.target_logprob[ri] =
        static_cast<double>(logits[static_cast<std::size_t>(q.targets[ri])]) - lse;
  const auto k = static_cast<std::size_t>(q.gather_k);
  for (std::size_t j = 0; j < k; ++j) {
    const int32_t id = q.gather[ri * k + j];
    if (id >= 0)
      out.gather_logprob[ri * k + j] =
          static_cast<double>(logits[static_cast<std::size_t>(id)]) - lse;
  }
}

TokenLogprobs token_logprobs(std::span<const float> logits, int32_t chosen, int64_t k) {
  FN_CHECK(!logits.empty(), "log-probs of an empty row");
  FN_CHECK(chosen >= 0 && static_cast<std::size_t>(chosen) < logits.size(),
           "log-probs of id {} outside the row of {}", chosen, logits.size());
  FN_CHECK(k >= 0 && k <= kMaxTopLogprobs && static_cast<std::size_t>(k) <= logits.size(),
           "top log-probs k {} outside [0, {}]", k, kMaxTopLogprobs);
  RowQuery q;
  const int32_t target = chosen;
  q.targets = std::span<const int32_t>(&target, 1);
  RowResults row;
  resize_row_results(row, 1, 0, false, static_cast<int64_t>(logits.size()));
  host_row_stats(logits, q, 0, row);
  TokenLogprobs out;
  out.logprob = row.target_logprob[0];
  // The k largest by (logit desc, id asc): a partial sort of the ids.
  std::vector<int32_t> ids(logits.size());
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  const auto before = [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<std::size_t>(a)], lb = logits[static_cast<std::size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), before);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t id = ids[static_cast<std::size_t>(j)];
    out.top_ids.push_back(id);
    out.top_logprobs.push_back(static_cast<double>(logits[static_cast<std::size_t>(id)]) -
                               row.lse[0]);
  }
  return out;
}

}  // namespace fn

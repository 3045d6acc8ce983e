// The defaults of Backend's optional functions (core/backend.h): a caller's bug when reached.
#include "core/backend.h"

#include <algorithm>

#include "core/error.h"

namespace fn {

RowResults Backend::prefill_rows(std::span<const int32_t> tokens, const RowQuery& q) {
  const auto n = static_cast<int64_t>(tokens.size());
  FN_REQUIRE(n >= 1, Usage, "prefill: the prompt has no tokens");
  const int64_t V = info_.vocab_size;
  check_row_query(q, n, V);
  RowResults out;
  resize_row_results(out, n - q.first, q.gather_k, q.keep_logits, V);
  for (int64_t p = 0; p < n; ++p) {
    const std::span<const float> logits = forward(tokens[static_cast<std::size_t>(p)]);
    if (p < q.first) continue;
    host_row_stats(logits, q, p - q.first, out);
    if (q.keep_logits)
      std::copy(logits.begin(), logits.end(),
                out.logits.begin() + static_cast<std::ptrdiff_t>((p - q.first) * V));
  }
  return out;
}

void Backend::snapshot() {
  FN_THROW(Internal, "the {} backend has no state snapshot", info_.name);
}

void Backend::restore() {
  FN_THROW(Internal, "the {} backend has no state snapshot", info_.name);
}

std::vector<int32_t> Backend::decode(int32_t, int64_t, const SamplingParams&, uint64_t,
                                     const std::function<bool(int32_t)>&, int64_t,
                                     std::vector<TokenLogprobs>*) {
  FN_THROW(Internal, "the {} backend does not sample on the device (decode)", info_.name);
}

double Backend::device_used_mib() const {
  FN_THROW(Internal, "the {} backend has no device memory figure", info_.name);
}

int64_t Backend::graph_captures() const {
  FN_THROW(Internal, "the {} backend captures no graphs", info_.name);
}

void Backend::set_position_for_benchmark(int64_t) {
  FN_THROW(Internal, "the {} backend cannot set its position for a benchmark", info_.name);
}

StepBreakdown Backend::profile_steps(int32_t, int64_t, bool) {
  FN_THROW(Internal, "the {} backend has no per-family step profile", info_.name);
}

}  // namespace fn

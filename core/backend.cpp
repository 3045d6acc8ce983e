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
                                     std::vector<TokenLogprobs>*, std::span<const int32_t>) {
  FN_THROW(Internal, "the {} backend does not sample on the device (decode)", info_.name);
}

void Backend::select_slot(int64_t slot) {
  FN_CHECK(slot == 0, "the {} backend has one sequence slot, not slot {}", info_.name, slot);
}

std::span<const float> Backend::forward_batch(std::span<const int64_t> slots,
                                              std::span<const int32_t> tokens) {
  const int64_t n_slots = slot_count();
  FN_CHECK(!slots.empty() && slots.size() == tokens.size(),
           "forward_batch: {} slots for {} tokens (need the same number, at least one)",
           slots.size(), tokens.size());
  std::vector<bool> seen(static_cast<std::size_t>(n_slots), false);
  for (const int64_t s : slots) {
    FN_CHECK(s >= 0 && s < n_slots, "forward_batch: slot {} outside [0, {})", s, n_slots);
    FN_CHECK(!seen[static_cast<std::size_t>(s)], "forward_batch: slot {} given twice", s);
    seen[static_cast<std::size_t>(s)] = true;
  }
  const auto V = static_cast<std::size_t>(info_.vocab_size);
  batch_logits_.resize(slots.size() * V);
  const int64_t was = selected_slot();
  try {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      select_slot(slots[i]);
      const std::span<const float> row = forward(tokens[i]);
      std::copy(row.begin(), row.end(), batch_logits_.begin() + static_cast<std::ptrdiff_t>(i * V));
    }
  } catch (...) {
    select_slot(was);
    throw;
  }
  select_slot(was);
  return batch_logits_;
}

std::vector<int32_t> Backend::sample_batch(std::span<const int64_t>, std::span<const int32_t>,
                                           std::span<const SlotSampling>) {
  FN_THROW(Internal, "the {} backend does not sample batched steps on the device", info_.name);
}

RowResults Backend::prefill_slots(std::span<const SlotTokens> pieces, const RowQuery* q) {
  const int64_t n_slots = slot_count();
  FN_CHECK(!pieces.empty(), "prefill_slots: no pieces");
  std::vector<bool> seen(static_cast<std::size_t>(n_slots), false);
  int64_t total = 0;
  for (const SlotTokens& p : pieces) {
    FN_CHECK(p.slot >= 0 && p.slot < n_slots, "prefill_slots: slot {} outside [0, {})", p.slot,
             n_slots);
    FN_CHECK(!seen[static_cast<std::size_t>(p.slot)], "prefill_slots: slot {} given twice", p.slot);
    seen[static_cast<std::size_t>(p.slot)] = true;
    FN_REQUIRE(!p.tokens.empty(), Usage, "prefill_slots: slot {} has no tokens", p.slot);
    total += static_cast<int64_t>(p.tokens.size());
  }
  RowResults out;
  if (q != nullptr) {
    FN_REQUIRE(q->first == 0, Usage, "prefill_slots: the query's rows start at {}, not 0",
               q->first);
    check_row_query(*q, total, info_.vocab_size);
    resize_row_results(out, total, q->gather_k, q->keep_logits, info_.vocab_size);
  }
  const int64_t was = selected_slot();
  try {
    int64_t row = 0;
    for (const SlotTokens& p : pieces) {
      select_slot(p.slot);
      const auto n = static_cast<int64_t>(p.tokens.size());
      if (q == nullptr) {
        prefill(p.tokens, PrefillOutput::None);
        continue;
      }
      RowQuery sub;
      sub.keep_logits = q->keep_logits;
      sub.gather_k = q->gather_k;
      if (!q->targets.empty()) sub.targets = q->targets.subspan(static_cast<std::size_t>(row), n);
      if (q->gather_k > 0)
        sub.gather = q->gather.subspan(static_cast<std::size_t>(row * q->gather_k),
                                       static_cast<std::size_t>(n * q->gather_k));
      const RowResults r = prefill_rows(p.tokens, sub);
      append_row_results(out, r, row, q->gather_k, info_.vocab_size);
      row += n;
    }
  } catch (...) {
    select_slot(was);
    throw;
  }
  select_slot(was);
  return out;
}

void Backend::copy_slot(int64_t, int64_t) {
  FN_THROW(Internal, "the {} backend cannot copy a sequence slot", info_.name);
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

void Backend::set_prefill_profile(bool) {
  FN_THROW(Internal, "the {} backend has no per-family prefill profile", info_.name);
}

std::optional<PrefillBreakdown> Backend::last_prefill_profile() const {
  FN_THROW(Internal, "the {} backend has no per-family prefill profile", info_.name);
}

}  // namespace fn

// Backend::prefill_rows, snapshot/restore, perplexity through the prefill and the
// multiple-choice scorer on the CPU reference backend (tp4 fixture, label cpu): the per-row
// reductions against log_softmax of forward()'s rows and the fixture's transformers rows, the
// snapshot returning bit for bit to its state, perplexity through the prefill equal to the
// token-by-token run, and score_choices against the log-probs loglik_reference.py computed from
// transformers' rows (tests/data/eval/loglik_tp4.expected.json).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "core/collectives.h"
#include "core/cpu_backend.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "core/eval.h"
#include "core/row_stats.h"
#include "test_cpu_fixture.h"

namespace {

std::vector<float> copy(std::span<const float> s) {
  return {s.begin(), s.end()};
}

}  // namespace

TEST_CASE("prefill_rows: normaliser, target and gathered log-probs, argmax of every row") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend b(fn::CpuModel::load(f.dir, coll), 0.0);
  const std::span<const int32_t> seq(f.tokens);
  const int64_t n = 20, first = 7, rows = n - first, K = 3;
  std::vector<int32_t> targets, gather;
  for (int64_t p = first; p < n; ++p) {
    targets.push_back(p % 5 == 0 ? -1 : seq[static_cast<std::size_t>(p + 1)]);
    for (int64_t j = 0; j < K; ++j)
      gather.push_back(j == 2 ? -1 : static_cast<int32_t>((p * 37 + j * 11) % f.vocab));
  }
  fn::RowQuery q;
  q.first = first;
  q.targets = targets;
  q.gather = gather;
  q.gather_k = K;
  q.keep_logits = true;
  const fn::RowResults r = b.prefill_rows(seq.first(static_cast<std::size_t>(n)), q);
  CHECK(b.position() == n);
  REQUIRE(r.rows == rows);

  // The same rows one forward() at a time; the reductions by log_softmax (core/eval.h).
  b.reset();
  std::vector<double> ls;
  for (int64_t p = 0; p < n; ++p) {
    const std::vector<float> row = copy(b.forward(seq[static_cast<std::size_t>(p)]));
    if (p < first) continue;
    const auto i = static_cast<std::size_t>(p - first);
    fn::log_softmax(row, ls);
    CHECK(std::equal(row.begin(), row.end(),
                     r.logits.begin() + static_cast<std::ptrdiff_t>(i * f.vocab)));
    CHECK(r.argmax[i] == fn::argmax(row));
    CHECK(r.lse[i] == doctest::Approx(static_cast<double>(row[0]) - ls[0]).epsilon(1e-14));
    if (targets[i] < 0) {
      CHECK(std::isnan(r.target_logprob[i]));
    } else {
      CHECK(r.target_logprob[i] ==
            doctest::Approx(ls[static_cast<std::size_t>(targets[i])]).epsilon(1e-13));
      // And transformers' row of that position (the fixture): within the CPU model's agreement.
      std::vector<double> ref;
      fn::log_softmax(std::span<const float>(f.row(static_cast<std::size_t>(p)),
                                             static_cast<std::size_t>(f.vocab)),
                      ref);
      CHECK(std::abs(r.target_logprob[i] - ref[static_cast<std::size_t>(targets[i])]) < 2e-3);
    }
    for (int64_t j = 0; j < K; ++j) {
      const double got = r.gather_logprob[i * K + static_cast<std::size_t>(j)];
      const int32_t id = gather[i * K + static_cast<std::size_t>(j)];
      if (id < 0)
        CHECK(std::isnan(got));
      else
        CHECK(got == doctest::Approx(ls[static_cast<std::size_t>(id)]).epsilon(1e-13));
    }
  }

  // A query that does not fit the prefill is a usage error, before any token runs.
  b.reset();
  fn::RowQuery bad;
  bad.first = n;
  CHECK_THROWS_AS(b.prefill_rows(seq.first(static_cast<std::size_t>(n)), bad), fn::Error);
  fn::RowQuery bad_id;
  std::vector<int32_t> t1(static_cast<std::size_t>(n), static_cast<int32_t>(f.vocab));
  bad_id.targets = t1;
  CHECK_THROWS_AS(b.prefill_rows(seq.first(static_cast<std::size_t>(n)), bad_id), fn::Error);
  CHECK(b.position() == 0);
}

TEST_CASE("snapshot/restore: the tokens after a restore run exactly as after the snapshot") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend b(fn::CpuModel::load(f.dir, coll), 0.0);
  REQUIRE(b.capabilities().snapshot);
  const std::span<const int32_t> seq(f.tokens);
  // Before any snapshot, restore is the caller's bug.
  CHECK_THROWS_AS(b.restore(), fn::Error);
  // 22 tokens: past a QSA block boundary (ratio 4) and the PLE conv/n-gram context.
  b.prefill(seq.first(22), fn::PrefillOutput::None);
  b.snapshot();
  std::vector<std::vector<float>> first_run;
  for (std::size_t p = 22; p < 35; ++p) first_run.push_back(copy(b.forward(seq[p])));
  // Another continuation in between, then back.
  b.restore();
  CHECK(b.position() == 22);
  for (std::size_t p = 0; p < 9; ++p) b.forward(seq[40 + p]);
  b.restore();
  for (std::size_t p = 22; p < 35; ++p) CHECK(copy(b.forward(seq[p])) == first_run[p - 22]);
  // A fresh run gives the same rows too (the snapshot held the whole state).
  b.reset();
  b.prefill(seq.first(22), fn::PrefillOutput::None);
  for (std::size_t p = 22; p < 35; ++p) CHECK(copy(b.forward(seq[p])) == first_run[p - 22]);
}

TEST_CASE("perplexity through prefill_rows equals the token-by-token windows") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend b(fn::CpuModel::load(f.dir, coll), 0.0);
  const std::span<const int32_t> tokens(f.tokens);
  const int64_t n_ctx = 24;  // 3 windows of the 72 tokens
  const fn::PerplexityResult r = fn::perplexity(b, tokens, n_ctx, -1, {});
  double sum = 0, sum2 = 0;
  int64_t count = 0;
  for (int64_t c = 0; c < 3; ++c) {
    b.reset();
    for (int64_t p = 0; p < n_ctx - 1; ++p) {
      const auto logits = b.forward(tokens[static_cast<std::size_t>(c * n_ctx + p)]);
      if (p < n_ctx / 2) continue;
      const double nll = fn::token_nll(logits, tokens[static_cast<std::size_t>(c * n_ctx + p + 1)]);
      sum += nll;
      sum2 += nll * nll;
      ++count;
    }
  }
  CHECK(r.count == count);
  CHECK(r.n_chunks == 3);
  // The same rows and the same column-order sums: equal up to the last bit of each NLL.
  CHECK(r.sum_nll == doctest::Approx(sum).epsilon(1e-14));
  CHECK(r.sum_nll2 == doctest::Approx(sum2).epsilon(1e-14));
  CHECK(r.ppl() == doctest::Approx(std::exp(sum / static_cast<double>(count))).epsilon(1e-13));
}

TEST_CASE("score_choices: the summed log-probs of transformers' rows (loglik_reference.py)") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend b(fn::CpuModel::load(f.dir, coll), 0.0);
  const std::vector<fn::test::LoglikItem> items = fn::test::load_loglik_tp4();
  REQUIRE(!items.empty());
  int64_t greedy_seen = 0;
  for (const fn::test::LoglikItem& it : items) {
    const nlohmann::json& want = it.want;
    const std::vector<fn::ChoiceScore> got = fn::score_choices(b, it.context, it.choices);
    REQUIRE(got.size() == it.choices.size());
    std::vector<double> ll, norm;
    for (std::size_t c = 0; c < got.size(); ++c) {
      const nlohmann::json& w = want.at("choices").at(c);
      INFO("item ", it.id, " choice ", c);
      CHECK(got[c].n_tokens == w.at("n_tokens").get<int64_t>());
      // Each token's log-prob within 2e-3 of transformers' (the FP32 CPU model's agreement).
      CHECK(std::abs(got[c].logprob - w.at("logprob").get<double>()) <
            2e-3 * static_cast<double>(got[c].n_tokens));
      CHECK(got[c].greedy == w.at("greedy").get<bool>());
      greedy_seen += got[c].greedy;
      ll.push_back(got[c].logprob);
      norm.push_back(got[c].logprob / static_cast<double>(got[c].n_tokens));
    }
    CHECK(fn::best_choice(ll) == want.at("pred").get<int64_t>());
    CHECK(fn::best_choice(norm) == want.at("pred_norm").get<int64_t>());
  }
  CHECK(greedy_seen > 0);  // the items past the prompt continue with the greedy ids
}

TEST_CASE("best_choice: the largest value, ties to the lowest index") {
  const std::vector<double> v{-3.0, -1.0, -1.0, -2.0};
  CHECK(fn::best_choice(v) == 1);
  CHECK_THROWS_AS(fn::best_choice(std::span<const double>()), fn::Error);
}

TEST_CASE("score_items: the items side by side in slots give score_choices' values bit for bit") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  const std::vector<fn::test::LoglikItem> ref = fn::test::load_loglik_tp4();
  REQUIRE(ref.size() >= 2);
  std::vector<fn::ChoiceItem> items;
  for (const fn::test::LoglikItem& it : ref) items.push_back({it.context, it.choices});
  // A one-token context (nothing to prefill before the choices) and an item with more choices
  // than the slots (it runs alone through score_choices).
  items.push_back({{f.tokens[3]}, {{f.tokens[4], f.tokens[5]}, {f.tokens[6]}}});
  std::vector<std::vector<int32_t>> many;
  for (int j = 0; j < 6; ++j) many.push_back({f.tokens[static_cast<std::size_t>(j + 1)]});
  items.push_back({std::vector<int32_t>(f.tokens.begin(), f.tokens.begin() + 5), many});
  fn::CpuBackend one(fn::CpuModel::load(f.dir, coll), 0.0);
  std::vector<std::vector<fn::ChoiceScore>> want;
  for (const fn::ChoiceItem& it : items)
    want.push_back(fn::score_choices(one, it.context, it.choices));
  for (const int64_t slots : {1, 3, 5}) {
    CAPTURE(slots);
    fn::CpuBackend b(fn::CpuModel::load(f.dir, coll), 0.0, slots);
    // Another sequence in slot 2 before the call: score_items resets the slots it takes.
    b.select_slot(std::min<int64_t>(2, slots - 1));
    b.prefill(std::span<const int32_t>(f.tokens).first(4), fn::PrefillOutput::None);
    const std::vector<std::vector<fn::ChoiceScore>> got = fn::score_items(b, items);
    CHECK(b.selected_slot() == 0);
    REQUIRE(got.size() == items.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      REQUIRE(got[i].size() == want[i].size());
      for (std::size_t c = 0; c < got[i].size(); ++c) {
        INFO("item ", i, " choice ", c);
        CHECK(got[i][c].logprob == want[i][c].logprob);
        CHECK(got[i][c].n_tokens == want[i][c].n_tokens);
        CHECK(got[i][c].greedy == want[i][c].greedy);
      }
    }
  }
}

TEST_CASE("copy_slot and prefill_slots on cpu: a copy goes on as its source; rows per piece") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend b(fn::CpuModel::load(f.dir, coll), 0.0, 3);
  const std::span<const int32_t> seq(f.tokens);
  b.select_slot(1);
  b.prefill(seq.first(6), fn::PrefillOutput::None);
  b.select_slot(0);
  b.copy_slot(1, 2);
  CHECK(b.selected_slot() == 0);
  b.select_slot(2);
  CHECK(b.position() == 6);
  const std::vector<float> from_copy = copy(b.forward(seq[6]));
  b.select_slot(1);
  const std::vector<float> from_source = copy(b.forward(seq[6]));
  CHECK(from_copy == from_source);
  // Two pieces in one call: each piece's rows equal prefill_rows on its slot alone.
  std::vector<int32_t> targets(seq.begin() + 8, seq.begin() + 12);
  targets.insert(targets.end(), seq.begin() + 1, seq.begin() + 4);
  const std::vector<fn::SlotTokens> pieces = {{2, seq.subspan(7, 4)}, {0, seq.first(3)}};
  fn::RowQuery q;
  q.targets = targets;
  b.select_slot(1);
  const fn::RowResults r = b.prefill_slots(pieces, &q);
  CHECK(b.selected_slot() == 1);
  REQUIRE(r.rows == 7);
  fn::CpuBackend alone(fn::CpuModel::load(f.dir, coll), 0.0);
  fn::RowQuery q0;
  q0.targets = std::span<const int32_t>(targets).subspan(4, 3);
  const fn::RowResults r0 = alone.prefill_rows(seq.first(3), q0);
  for (int j = 0; j < 3; ++j) {
    CHECK(r.target_logprob[static_cast<std::size_t>(4 + j)] ==
          r0.target_logprob[static_cast<std::size_t>(j)]);
    CHECK(r.argmax[static_cast<std::size_t>(4 + j)] == r0.argmax[static_cast<std::size_t>(j)]);
  }
  // Bad calls: a slot twice, an empty piece, a query not starting at row 0.
  const std::vector<fn::SlotTokens> twice = {{0, seq.first(1)}, {0, seq.first(1)}};
  CHECK_THROWS_AS(b.prefill_slots(twice, nullptr), fn::Error);
  const std::vector<fn::SlotTokens> empty = {{0, seq.first(0)}};
  CHECK_THROWS_AS(b.prefill_slots(empty, nullptr), fn::Error);
  fn::RowQuery late;
  late.first = 1;
  CHECK_THROWS_AS(b.prefill_slots(pieces, &late), fn::Error);
  CHECK_THROWS_AS(b.copy_slot(1, 1), fn::Error);
}

// The per-row logits reductions on the device (cuda/kernels/logit_stats.h) against the host
// reference (core/row_stats.h host_row_stats), and CudaBackend's prefill_rows and snapshot/restore
// on the tp4 fixture at TP = 1 (label gpu): the reductions equal the host's on the same rows up to
// the summation order of the normaliser, a restored state runs the next tokens bit for bit as the
// snapshot's, and score_choices matches transformers' log-probs (tests/data/eval/loglik_tp4.*).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/eval.h"
#include "core/row_stats.h"
#include "cuda/kernels/logit_stats.h"
#include "cuda/model/cuda_backend.h"
#include "cuda/model/cuda_model.h"
#include "cuda_test_util.h"
#include "test_cpu_fixture.h"

namespace {

std::vector<float> copy(std::span<const float> s) {
  return {s.begin(), s.end()};
}

std::unique_ptr<fn::CudaBackend> load(const fn::test::RefFixture& f) {
  fn::CudaModelOptions o;
  o.ctx_size = 256;
  o.use_graph = true;
  return std::make_unique<fn::CudaBackend>(nullptr, nullptr, fn::CudaModel::load(f.dir, o), 1, 0.0,
                                           false);
}

// The kernel over `rows` rows of `vocab` (row stride ld) against host_row_stats.
void check_kernel(int64_t rows, int64_t vocab, int64_t ld, int64_t k, uint64_t seed) {
  std::vector<float> logits =
      fn::test::normal_floats(static_cast<std::size_t>(rows * ld), 4.0f, seed);
  std::vector<int32_t> targets, gather;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits.data() + r * ld;
    // A tie at the max between two ids (the lower must win).
    if (r % 2 == 0) {
      row[vocab - 1] = 40.0f;
      row[vocab / 3] = 40.0f;
    }
    targets.push_back(r == 1 ? -1 : static_cast<int32_t>((r * 131 + 5) % vocab));
    for (int64_t j = 0; j < k; ++j)
      gather.push_back(j == 1 ? -1 : static_cast<int32_t>((r * 17 + j * 1009) % vocab));
  }
  fn::test::DeviceArray<float> d_logits(logits);
  fn::test::DeviceArray<int32_t> d_t(targets),
      d_g(gather.empty() ? std::vector<int32_t>{0} : gather);
  fn::test::DeviceArray<double> d_lse(static_cast<std::size_t>(rows)),
      d_tlp(static_cast<std::size_t>(rows)),
      d_glp(static_cast<std::size_t>(std::max<int64_t>(rows * k, 1)));
  fn::test::DeviceArray<int32_t> d_arg(static_cast<std::size_t>(rows));
  fn::LogitStatsParams p;
  p.logits = d_logits.ptr;
  p.rows = rows;
  p.vocab = vocab;
  p.ld = ld;
  p.targets = d_t.ptr;
  p.gather = k > 0 ? d_g.ptr : nullptr;
  p.gather_k = k;
  p.lse = d_lse.ptr;
  p.target_logprob = d_tlp.ptr;
  p.argmax = d_arg.ptr;
  p.gather_logprob = k > 0 ? d_glp.ptr : nullptr;
  fn::launch_logit_stats(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto lse = d_lse.download(), tlp = d_tlp.download(), glp = d_glp.download();
  const auto arg = d_arg.download();

  fn::RowQuery q;
  q.targets = targets;
  q.gather = gather;
  q.gather_k = k;
  fn::RowResults want;
  fn::resize_row_results(want, rows, k, false, vocab);
  for (int64_t r = 0; r < rows; ++r)
    fn::host_row_stats(
        std::span<const float>(logits.data() + r * ld, static_cast<std::size_t>(vocab)), q, r,
        want);
  for (int64_t r = 0; r < rows; ++r) {
    const auto i = static_cast<std::size_t>(r);
    INFO("row ", r, " vocab ", vocab);
    CHECK(arg[i] == want.argmax[i]);
    if (r % 2 == 0) CHECK(arg[i] == vocab / 3);
    // FP64 sums of the same terms in another order: a few units of the last place.
    CHECK(std::abs(lse[i] - want.lse[i]) <= 1e-13 * std::abs(want.lse[i]) + 1e-13);
    if (targets[i] < 0)
      CHECK(std::isnan(tlp[i]));
    else
      CHECK(std::abs(tlp[i] - want.target_logprob[i]) <= 1e-12);
    for (int64_t j = 0; j < k; ++j) {
      const auto jj = i * static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
      if (gather[jj] < 0)
        CHECK(std::isnan(glp[jj]));
      else
        CHECK(std::abs(glp[jj] - want.gather_logprob[jj]) <= 1e-12);
    }
  }
}

}  // namespace

TEST_CASE("logit_stats: the device reductions equal host_row_stats up to summation order") {
  check_kernel(5, 248320, 248320, 32, 1);  // the real vocabulary, a top-32 gather
  check_kernel(3, 384, 400, 0, 2);         // a small row with a stride, no gather
  check_kernel(2, 1, 1, 1, 3);             // one column: lse = the logit, log-prob 0
}

TEST_CASE("logit_stats: a row holding NaN or ±Inf gets a NaN normaliser, as the host refuses it") {
  std::vector<float> logits{1.0f, 2.0f, std::numeric_limits<float>::quiet_NaN(),
                            0.5f, 1.0f, std::numeric_limits<float>::infinity(),
                            2.0f, 0.0f, 1.0f,
                            2.0f, 3.0f, 0.0f};
  fn::test::DeviceArray<float> d(logits);
  fn::test::DeviceArray<double> lse(3), tlp(3);
  fn::test::DeviceArray<int32_t> arg(3);
  fn::LogitStatsParams p;
  p.logits = d.ptr;
  p.rows = 3;
  p.vocab = 4;
  p.ld = 4;
  p.lse = lse.ptr;
  p.target_logprob = tlp.ptr;
  p.argmax = arg.ptr;
  fn::launch_logit_stats(p, nullptr);
  const auto l = lse.download();
  CHECK(std::isnan(l[0]));
  CHECK(std::isnan(l[1]));
  CHECK(l[2] ==
        doctest::Approx(3.0 + std::log(std::exp(-2.0) + std::exp(-1.0) + 1.0 + std::exp(-3.0))));
  CHECK(arg.download()[2] == 2);
  fn::LogitStatsParams bad = p;
  bad.ld = 3;
  CHECK_THROWS_AS(fn::launch_logit_stats(bad, nullptr), fn::Error);
}

TEST_CASE("cuda backend: prefill_rows reduces the prefill's own rows; first > 0 skips rows") {
  const auto f = fn::test::load_ref_fixture("tp4");
  auto b = load(f);
  const std::span<const int32_t> seq(f.tokens);
  const int64_t n = 45, K = 4;  // two lm_head groups of 32 rows
  // The rows the prefill gives (PrefillLogits::All), reduced on the host.
  const std::vector<float> all = copy(b->model().prefill(seq.first(n), fn::PrefillLogits::All));
  std::vector<int32_t> targets, gather;
  for (int64_t p = 0; p < n; ++p) {
    targets.push_back(seq[static_cast<std::size_t>(p + 1)]);
    for (int64_t j = 0; j < K; ++j)
      gather.push_back(static_cast<int32_t>((p * 31 + j * 97) % f.vocab));
  }
  fn::RowQuery q;
  q.targets = targets;
  q.gather = gather;
  q.gather_k = K;
  q.keep_logits = true;
  b->reset();
  const fn::RowResults r = b->prefill_rows(seq.first(n), q);
  CHECK(b->position() == n);
  REQUIRE(r.rows == n);
  CHECK(r.logits == all);  // the same passes and lm_head groups: the same rows, bit for bit
  fn::RowResults want;
  fn::resize_row_results(want, n, K, false, f.vocab);
  for (int64_t p = 0; p < n; ++p)
    fn::host_row_stats(std::span<const float>(all).subspan(static_cast<std::size_t>(p * f.vocab),
                                                           static_cast<std::size_t>(f.vocab)),
                       q, p, want);
  for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i) {
    CHECK(r.argmax[i] == want.argmax[i]);
    CHECK(std::abs(r.lse[i] - want.lse[i]) <= 1e-12);
    CHECK(std::abs(r.target_logprob[i] - want.target_logprob[i]) <= 1e-12);
  }
  for (std::size_t i = 0; i < want.gather_logprob.size(); ++i)
    CHECK(std::abs(r.gather_logprob[i] - want.gather_logprob[i]) <= 1e-12);

  // Rows from 20 on only, without full rows: the same values within the prefill's tolerance
  // (the lm_head groups start elsewhere, so cuBLAS may sum in another order).
  fn::RowQuery q2;
  q2.first = 20;
  q2.targets = std::span<const int32_t>(targets).subspan(20);
  b->reset();
  const fn::RowResults r2 = b->prefill_rows(seq.first(n), q2);
  REQUIRE(r2.rows == n - 20);
  CHECK(r2.logits.empty());
  for (std::size_t i = 0; i < static_cast<std::size_t>(n - 20); ++i)
    CHECK(std::abs(r2.target_logprob[i] - want.target_logprob[i + 20]) <= 1e-3);
}

TEST_CASE("cuda backend: snapshot/restore returns to the state bit for bit") {
  const auto f = fn::test::load_ref_fixture("tp4");
  auto b = load(f);
  REQUIRE(b->capabilities().snapshot);
  const std::span<const int32_t> seq(f.tokens);
  CHECK_THROWS_AS(b->restore(), fn::Error);
  b->prefill(seq.first(22), fn::PrefillOutput::None);
  b->snapshot();
  std::vector<std::vector<float>> first_run;
  for (std::size_t p = 22; p < 35; ++p) first_run.push_back(copy(b->forward(seq[p])));
  b->restore();
  CHECK(b->position() == 22);
  for (std::size_t p = 0; p < 9; ++p) b->forward(seq[40 + p]);
  b->restore();
  for (std::size_t p = 22; p < 35; ++p) CHECK(copy(b->forward(seq[p])) == first_run[p - 22]);
  // A fresh run of the same tokens: the same rows (the snapshot held every state it needed).
  b->reset();
  b->prefill(seq.first(22), fn::PrefillOutput::None);
  for (std::size_t p = 22; p < 35; ++p) CHECK(copy(b->forward(seq[p])) == first_run[p - 22]);
}

TEST_CASE("cuda backend: score_choices against transformers' log-probs (loglik_tp4)") {
  const auto f = fn::test::load_ref_fixture("tp4");
  auto b = load(f);
  const std::string dir = std::string(FN_TEST_DATA_DIR) + "/eval/";
  std::ifstream items(dir + "loglik_tp4.jsonl");
  std::ifstream ex(dir + "loglik_tp4.expected.json");
  REQUIRE(items.good());
  REQUIRE(ex.good());
  const nlohmann::json expected = nlohmann::json::parse(ex);
  std::string line;
  std::size_t i = 0;
  while (std::getline(items, line)) {
    const nlohmann::json it = nlohmann::json::parse(line);
    const nlohmann::json& want = expected.at("items").at(i++);
    const auto ctx = it.at("context_ids").get<std::vector<int32_t>>();
    const auto choices = it.at("choices").get<std::vector<std::vector<int32_t>>>();
    const std::vector<fn::ChoiceScore> got = fn::score_choices(*b, ctx, choices);
    for (std::size_t c = 0; c < got.size(); ++c) {
      INFO("item ", it.at("id"), " choice ", c);
      // BF16 activations: each token's log-prob within 0.1 of the FP32 reference.
      CHECK(std::abs(got[c].logprob - want.at("choices").at(c).at("logprob").get<double>()) <=
            0.1 * static_cast<double>(got[c].n_tokens));
    }
  }
  CHECK(i == expected.at("items").size());
}

// The per-row logits reductions on the device (cuda/kernels/logit_stats.h) against the host
// reference (core/row_stats.h host_row_stats), and CudaBackend's prefill_rows and snapshot/restore
// on the tp4 fixture at TP = 1 (label gpu): the reductions equal the host's on the same rows up to
// the summation order of the normaliser, a restored state runs the next tokens bit for bit as the
// snapshot's, and score_choices matches transformers' log-probs (tests/data/eval/loglik_tp4.*).
// The top log-probs (launch_top_logprobs) against token_logprobs: the same ids in the same order
// on rows with ties (at the max and across the k-th place), log-probs within 1e-9; CudaModel's
// decode with top_logprobs gives the ids it gives without, and per step token_logprobs of the
// row forward() gives for the same sequence; a bench of the reduction (FN_BENCH=1).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
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

std::unique_ptr<fn::CudaBackend> load(const fn::test::RefFixture& f, int64_t slots = 1,
                                      int64_t prefill_chunk = 8192) {
  fn::CudaModelOptions o;
  o.ctx_size = 256;
  o.use_graph = true;
  o.slots = slots;
  o.prefill_chunk = prefill_chunk;
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

// launch_top_logprobs over `row` with the chosen id `chosen` (waited for).
fn::TopLogprobsOut device_top(const std::vector<float>& row, int32_t chosen, int64_t k) {
  const auto vocab = static_cast<int64_t>(row.size());
  fn::test::DeviceArray<float> d_row(row);
  fn::test::DeviceArray<int32_t> d_chosen(std::vector<int32_t>{chosen});
  fn::test::DeviceArray<unsigned char> ws(fn::top_logprobs_workspace_bytes(vocab));
  fn::test::DeviceArray<fn::TopLogprobsOut> out(1);
  fn::TopLogprobsParams p;
  p.logits = d_row.ptr;
  p.vocab = vocab;
  p.chosen = d_chosen.ptr;
  p.k = k;
  p.workspace = ws.ptr;
  p.workspace_bytes = ws.n;
  p.out = out.ptr;
  fn::launch_top_logprobs(p, nullptr);
  FN_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download()[0];
}

// The device's top log-probs of `row` against token_logprobs: the ids equal, the log-probs within
// 1e-9 (FP64 sums of the same terms in another order: the normalisers differ by a few units of
// the last place), the slots past k empty.
void check_top(const std::vector<float>& row, int32_t chosen, int64_t k) {
  INFO("vocab ", row.size(), " k ", k, " chosen ", chosen);
  const fn::TopLogprobsOut got = device_top(row, chosen, k);
  const fn::TokenLogprobs want = fn::token_logprobs(row, chosen, k);
  CHECK(std::abs(got.logprob - want.logprob) <= 1e-9);
  for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) {
    INFO("place ", j);
    CHECK(got.top_ids[j] == want.top_ids[j]);
    CHECK(std::abs(got.top_logprobs[j] - want.top_logprobs[j]) <= 1e-9);
  }
  for (auto j = static_cast<std::size_t>(k); j < static_cast<std::size_t>(fn::kMaxTopLogprobs);
       ++j) {
    CHECK(got.top_ids[j] == -1);
    CHECK(std::isnan(got.top_logprobs[j]));
  }
}

// A random row of `vocab` logits with ties: 3 ids (scattered, so in different blocks of the
// reduction) share the max, and the next k + 2 share a second value, so the k-th place falls
// inside a tie for k = 1 and k >= 4 (the lower ids must win).
std::vector<float> tied_row(int64_t vocab, int64_t k, uint64_t seed) {
  std::vector<float> row = fn::test::normal_floats(static_cast<std::size_t>(vocab), 4.0f, seed);
  std::vector<int32_t> ids(static_cast<std::size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  const std::size_t top = std::min<std::size_t>(3, ids.size() / 2);
  const std::size_t second =
      std::min<std::size_t>(top + static_cast<std::size_t>(k) + 2, ids.size());
  for (std::size_t i = 0; i < second; ++i)
    row[static_cast<std::size_t>(ids[i])] = i < top ? 40.0f : 30.0f;
  return row;
}

// Runs decode() from the fixture's prompt (the prompt but its last token fed by forward()).
std::vector<int32_t> decode_from_prompt(fn::CudaModel& m, const fn::test::RefFixture& f,
                                        int64_t steps, const fn::SamplingParams& s, uint64_t seed,
                                        int64_t k, std::vector<fn::TokenLogprobs>* lps) {
  m.reset();
  const std::size_t P = f.prompt_ids.size();
  for (std::size_t i = 0; i + 1 < P; ++i) m.forward(f.prompt_ids[i]);
  return m.decode(
      f.prompt_ids[P - 1], steps, s, seed, [](int32_t) { return true; }, k, lps);
}

// The rows forward() gives along the same sequence: row s = the logits after the token that
// decode()'s step s feeds (the prompt's last token, then ids[0], ids[1], ...).
std::vector<std::vector<float>> forward_rows(fn::CudaModel& m, const fn::test::RefFixture& f,
                                             const std::vector<int32_t>& ids) {
  m.reset();
  const std::size_t P = f.prompt_ids.size();
  for (std::size_t i = 0; i + 1 < P; ++i) m.forward(f.prompt_ids[i]);
  std::vector<std::vector<float>> rows;
  int32_t fed = f.prompt_ids[P - 1];
  for (const int32_t id : ids) {
    rows.push_back(copy(m.forward(fed)));
    fed = id;
  }
  return rows;
}

// decode()'s log-probs of `ids` against token_logprobs over forward()'s rows: the same ids in the
// same order, log-probs within 1e-9 (decode's step and forward()'s run the same kernels, so the
// rows are the same bits and only the normaliser's summation order differs).
void check_decode_logprobs(const std::vector<std::vector<float>>& rows,
                           const std::vector<int32_t>& ids,
                           const std::vector<fn::TokenLogprobs>& lps, int64_t k) {
  REQUIRE(lps.size() == ids.size());
  REQUIRE(rows.size() == ids.size());
  for (std::size_t s = 0; s < ids.size(); ++s) {
    INFO("step ", s);
    const fn::TokenLogprobs want = fn::token_logprobs(rows[s], ids[s], k);
    CHECK(std::abs(lps[s].logprob - want.logprob) <= 1e-9);
    CHECK(lps[s].top_ids == want.top_ids);
    REQUIRE(lps[s].top_logprobs.size() == want.top_logprobs.size());
    for (std::size_t j = 0; j < want.top_logprobs.size(); ++j)
      CHECK(std::abs(lps[s].top_logprobs[j] - want.top_logprobs[j]) <= 1e-9);
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
  const std::vector<fn::test::LoglikItem> items = fn::test::load_loglik_tp4();
  REQUIRE(!items.empty());
  for (const fn::test::LoglikItem& it : items) {
    const std::vector<fn::ChoiceScore> got = fn::score_choices(*b, it.context, it.choices);
    for (std::size_t c = 0; c < got.size(); ++c) {
      INFO("item ", it.id, " choice ", c);
      // BF16 activations: each token's log-prob within 0.1 of the FP32 reference.
      CHECK(std::abs(got[c].logprob - it.want.at("choices").at(c).at("logprob").get<double>()) <=
            0.1 * static_cast<double>(got[c].n_tokens));
    }
  }
}

TEST_CASE("cuda backend: score_items side by side in slots gives score_choices' log-probs") {
  const auto f = fn::test::load_ref_fixture("tp4");
  const std::vector<fn::test::LoglikItem> ref = fn::test::load_loglik_tp4();
  std::vector<fn::ChoiceItem> items;
  for (const fn::test::LoglikItem& it : ref) items.push_back({it.context, it.choices});
  items.push_back({{f.tokens[3]}, {{f.tokens[4], f.tokens[5]}, {f.tokens[6]}}});
  auto one = load(f);
  std::vector<std::vector<fn::ChoiceScore>> want;
  for (const fn::ChoiceItem& it : items)
    want.push_back(fn::score_choices(*one, it.context, it.choices));
  // 5 slots: groups of items side by side; a 16-row pass cuts the choices' rows across passes.
  for (const int64_t chunk : {8192, 16}) {
    CAPTURE(chunk);
    auto b = load(f, 5, chunk);
    REQUIRE(b->slot_count() == 5);
    const std::vector<std::vector<fn::ChoiceScore>> got = fn::score_items(*b, items);
    REQUIRE(got.size() == items.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      REQUIRE(got[i].size() == want[i].size());
      for (std::size_t c = 0; c < got[i].size(); ++c) {
        INFO("item ", i, " choice ", c);
        CHECK(got[i][c].n_tokens == want[i][c].n_tokens);
        // The same rows in other passes: cuBLAS's summation order for another row count.
        CHECK(std::abs(got[i][c].logprob - want[i][c].logprob) <=
              2e-2 * static_cast<double>(got[i][c].n_tokens));
      }
    }
    // A copied slot goes on as its source.
    b->select_slot(1);
    b->reset();
    const std::span<const int32_t> seq(f.tokens);
    b->prefill(seq.first(9), fn::PrefillOutput::None);
    b->copy_slot(1, 3);
    const std::vector<float> a = copy(b->forward(seq[9]));
    b->select_slot(3);
    CHECK(b->position() == 9);
    CHECK(copy(b->forward(seq[9])) == a);
  }
}

TEST_CASE("top log-probs: the device reduction equals token_logprobs, ties and order included") {
  // 1, 7, 1000 (one block), 248320 (the real vocabulary: 243 blocks), 1000003 (blocks that take
  // several chunks each).
  for (const int64_t vocab : {1, 7, 1000, 248320, 1000003}) {
    for (const int64_t k : {0, 1, 5, 20}) {
      if (k > vocab || (vocab == 1000003 && k < 5)) continue;
      const std::vector<float> row = tied_row(vocab, k, static_cast<uint64_t>(vocab * 31 + k));
      const fn::TokenLogprobs all = fn::token_logprobs(row, 0, std::min<int64_t>(vocab, 20));
      const int32_t argmax = all.top_ids[0];
      // The chosen id at the max, at the k-th place (inside the top k), and at the minimum
      // (outside it).
      const auto lowest =
          static_cast<int32_t>(std::min_element(row.begin(), row.end()) - row.begin());
      check_top(row, argmax, k);
      if (k >= 1) check_top(row, all.top_ids[static_cast<std::size_t>(k - 1)], k);
      check_top(row, lowest, k);
    }
  }
  // -0 and +0 tie: the lower id first, whichever the sign.
  check_top({-1.0f, 0.0f, -3.0f, -0.0f, -2.0f, -0.0f, -5.0f}, 3, 4);
}

TEST_CASE("top log-probs: non-finite rows, capture into a graph, precondition checks") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // A NaN ranks below every number and makes every log-prob NaN (the host refuses such a row).
  const fn::TopLogprobsOut n = device_top({1.0f, nan, 3.0f, 2.0f, -1.0f}, 2, 4);
  CHECK(std::isnan(n.logprob));
  CHECK(n.top_ids[0] == 2);
  CHECK(n.top_ids[1] == 3);
  CHECK(n.top_ids[2] == 0);
  CHECK(n.top_ids[3] == 4);
  CHECK(std::isnan(n.top_logprobs[0]));
  CHECK(std::isnan(device_top({1.0f, std::numeric_limits<float>::infinity(), 0.0f}, 0, 1).logprob));

  // Captured into a graph and replayed: the eager launch's bits.
  const std::vector<float> row = tied_row(248320, 20, 5);
  const fn::TopLogprobsOut eager = device_top(row, 17, 20);
  cudaStream_t stream = nullptr;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  fn::test::DeviceArray<float> d_row(row);
  fn::test::DeviceArray<int32_t> d_chosen(std::vector<int32_t>{17});
  fn::test::DeviceArray<unsigned char> ws(fn::top_logprobs_workspace_bytes(248320));
  fn::test::DeviceArray<fn::TopLogprobsOut> out(1);
  fn::TopLogprobsParams p;
  p.logits = d_row.ptr;
  p.vocab = 248320;
  p.chosen = d_chosen.ptr;
  p.k = 20;
  p.workspace = ws.ptr;
  p.workspace_bytes = ws.n;
  p.out = out.ptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  fn::launch_top_logprobs(p, stream);
  FN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 3; ++r) FN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));
  const fn::TopLogprobsOut replayed = out.download()[0];
  CHECK(std::memcmp(&replayed, &eager, sizeof eager) == 0);
  FN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FN_CUDA_CHECK(cudaGraphDestroy(graph));
  FN_CUDA_CHECK(cudaStreamDestroy(stream));

  fn::TopLogprobsParams bad = p;
  bad.k = 21;
  CHECK_THROWS_AS(fn::launch_top_logprobs(bad, nullptr), fn::Error);
  bad = p;
  bad.vocab = 7;
  bad.k = 8;
  CHECK_THROWS_AS(fn::launch_top_logprobs(bad, nullptr), fn::Error);
  bad = p;
  bad.workspace_bytes = p.workspace_bytes - 1;
  CHECK_THROWS_AS(fn::launch_top_logprobs(bad, nullptr), fn::Error);
  bad = p;
  bad.chosen = nullptr;
  CHECK_THROWS_AS(fn::launch_top_logprobs(bad, nullptr), fn::Error);
  CHECK_THROWS_AS(fn::top_logprobs_workspace_bytes(0), fn::Error);
}

TEST_CASE("cuda model: decode's top log-probs equal token_logprobs of forward()'s rows (tp4)") {
  const auto f = fn::test::load_ref_fixture("tp4");
  const int64_t steps = static_cast<int64_t>(f.generated_ids.size()) - 1;
  REQUIRE(steps >= 4);
  fn::SamplingParams greedy;
  greedy.temperature = 0;
  fn::SamplingParams sampled;
  sampled.temperature = 0.9;
  sampled.top_k = 40;
  for (const bool use_graph : {true, false}) {
    CAPTURE(use_graph);
    fn::CudaModelOptions o;
    o.ctx_size = 256;
    o.use_graph = use_graph;
    auto m = fn::CudaModel::load(f.dir, o);

    // Greedy: the same ids with and without; each chosen id is its row's first alternative.
    const std::vector<int32_t> base = decode_from_prompt(*m, f, steps, greedy, 0, -1, nullptr);
    std::vector<fn::TokenLogprobs> lps;
    const std::vector<int32_t> ids = decode_from_prompt(*m, f, steps, greedy, 0, 5, &lps);
    CHECK(ids == base);
    check_decode_logprobs(forward_rows(*m, f, ids), ids, lps, 5);
    for (std::size_t s = 0; s < lps.size(); ++s) {
      CHECK(lps[s].top_ids[0] == ids[s]);
      CHECK(lps[s].logprob == lps[s].top_logprobs[0]);
    }

    // Sampled (temperature 0.9, top_k 40, seed 3): the same ids with and without.
    const std::vector<int32_t> sbase = decode_from_prompt(*m, f, steps, sampled, 3, -1, nullptr);
    std::vector<fn::TokenLogprobs> slps;
    const std::vector<int32_t> sids = decode_from_prompt(*m, f, steps, sampled, 3, 5, &slps);
    CHECK(sids == sbase);
    check_decode_logprobs(forward_rows(*m, f, sids), sids, slps, 5);

    // k = 0: the chosen id's log-prob alone, the same bits as with k = 5.
    std::vector<fn::TokenLogprobs> zero;
    CHECK(decode_from_prompt(*m, f, steps, sampled, 3, 0, &zero) == sids);
    REQUIRE(zero.size() == slps.size());
    for (std::size_t s = 0; s < zero.size(); ++s) {
      CHECK(zero[s].top_ids.empty());
      CHECK(zero[s].logprob == slps[s].logprob);
    }

    // Graphs: the one without log-probs outlives the ones with them; the one with them is
    // captured again only for another k (k = 0 above replaced the k = 5 one).
    if (use_graph) {
      const int64_t before = m->graph_captures();
      decode_from_prompt(*m, f, steps, sampled, 3, -1, nullptr);
      std::vector<fn::TokenLogprobs> again;
      decode_from_prompt(*m, f, steps, sampled, 3, 5, &again);
      CHECK(m->graph_captures() == before + 1);
      decode_from_prompt(*m, f, steps, sampled, 3, 5, &again);
      decode_from_prompt(*m, f, steps, sampled, 3, -1, nullptr);
      CHECK(m->graph_captures() == before + 1);
    }

    // Arguments out of range are the caller's bug.
    std::vector<fn::TokenLogprobs> none;
    CHECK_THROWS_AS(decode_from_prompt(*m, f, 1, greedy, 0, 21, &none), fn::Error);
    CHECK_THROWS_AS(decode_from_prompt(*m, f, 1, greedy, 0, -2, &none), fn::Error);
    CHECK_THROWS_AS(decode_from_prompt(*m, f, 1, greedy, 0, 5, nullptr), fn::Error);
  }
}

TEST_CASE("top log-probs bench: microseconds per reduction at the real vocabulary (FN_BENCH=1)") {
  const char* env = std::getenv("FN_BENCH");
  if (env == nullptr || std::string(env) != "1") return;
  const int64_t V = 248320;
  const std::vector<float> row = fn::test::normal_floats(static_cast<std::size_t>(V), 4.0f, 9);
  fn::test::DeviceArray<float> d_row(row);
  fn::test::DeviceArray<int32_t> d_chosen(std::vector<int32_t>{17});
  fn::test::DeviceArray<unsigned char> ws(fn::top_logprobs_workspace_bytes(V));
  fn::test::DeviceArray<fn::TopLogprobsOut> out(1);
  fn::test::DeviceArray<double> lse(1), tlp(1);
  fn::test::DeviceArray<int32_t> arg(1);
  cudaStream_t stream = nullptr;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const int64_t k : {0, 5, 20}) {
    fn::TopLogprobsParams p;
    p.logits = d_row.ptr;
    p.vocab = V;
    p.chosen = d_chosen.ptr;
    p.k = k;
    p.workspace = ws.ptr;
    p.workspace_bytes = ws.n;
    p.out = out.ptr;
    const double us = fn::test::graph_us_per_call(
        stream, 50, 4, [&](cudaStream_t st) { fn::launch_top_logprobs(p, st); });
    std::printf("top log-probs bench: V %lld k %lld: %.3f us per reduction, launches included\n",
                static_cast<long long>(V), static_cast<long long>(k), us);
  }
  // The one-block row reduction of the prefill (launch_logit_stats) for scale.
  fn::LogitStatsParams q;
  q.logits = d_row.ptr;
  q.rows = 1;
  q.vocab = V;
  q.ld = V;
  q.lse = lse.ptr;
  q.target_logprob = tlp.ptr;
  q.argmax = arg.ptr;
  const double us = fn::test::graph_us_per_call(
      stream, 50, 4, [&](cudaStream_t st) { fn::launch_logit_stats(q, st); });
  std::printf("top log-probs bench: launch_logit_stats, one row of V %lld: %.3f us\n",
              static_cast<long long>(V), us);
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

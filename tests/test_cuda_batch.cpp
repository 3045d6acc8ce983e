// CudaModel's sequence slots and batched step (forward_batch) on the transformers fixtures, TP=1
// (label gpu): three slots prefilled with different prefixes then stepped together, teacher-
// forced, give per row what each sequence gives alone on a one-slot model through forward()
// (the decode graph) within the CUDA tolerance (argmax equal wherever the margin exceeds it);
// slot 0 continues through the decode graph after batched steps, another slot through
// forward(), and a reset slot leaves the others as they were. The continuous-batching engine on
// three slots generates the reference's greedy ids for staggered copies of the prompt.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/batch_engine.h"
#include "core/collectives.h"
#include "core/error.h"
#include "cuda/model/cuda_backend.h"
#include "cuda/model/cuda_model.h"
#include "cuda_model_check.h"
#include "test_cpu_fixture.h"

using fn::test::argmax;
using fn::test::kRelTol;
using fn::test::margin;
using fn::test::max_abs;
using fn::test::max_abs_diff;

namespace {

fn::CudaModelOptions options(int64_t slots) {
  fn::CudaModelOptions o;
  o.ctx_size = 256;
  o.slots = slots;
  return o;
}

// Compares a batched row with the lone run's row: within kRelTol * max|ref|, and the same argmax
// where the lone row's margin exceeds that. Returns the ratio max|diff| / (kRelTol * max|ref|).
double check_row(const float* got, const std::vector<float>& ref, const std::string& what) {
  const auto V = static_cast<int64_t>(ref.size());
  const double tol = kRelTol * max_abs(ref.data(), V);
  const double diff = max_abs_diff(got, ref.data(), V);
  CAPTURE(what);
  CHECK(diff <= tol);
  if (margin(ref.data(), V) > tol) CHECK(argmax(got, V) == argmax(ref.data(), V));
  return diff / tol;
}

// Sequence j of the test: the fixture's tokens rotated by 5 j (distinct content per slot).
std::vector<int32_t> sequence(const fn::test::RefFixture& f, int j) {
  std::vector<int32_t> t = f.tokens;
  std::rotate(t.begin(), t.begin() + (5 * j) % static_cast<int64_t>(t.size()), t.end());
  return t;
}

}  // namespace

TEST_CASE("cuda slots: batched steps equal each sequence alone through the decode graph") {
  fn::test::use_gpu_of_rank();
  for (const char* name : {"tp4", "g3_tiny", "ple2_long"}) {
    CAPTURE(name);
    const auto f = fn::test::load_ref_fixture(name);
    const int64_t V = f.vocab;
    const int64_t prefix[3] = {7, 2, 12};  // each slot's prompt length
    constexpr int64_t kSteps = 10;
    // The lone runs: prefill the prefix, then forward() (the graph) per token.
    auto lone = fn::CudaModel::load(f.dir, options(1));
    std::vector<std::vector<std::vector<float>>> want(3);
    for (int j = 0; j < 3; ++j) {
      const std::vector<int32_t> t = sequence(f, j);
      lone->reset();
      lone->prefill(std::span<const int32_t>(t).first(static_cast<std::size_t>(prefix[j])),
                    fn::PrefillLogits::None);
      for (int64_t k = 0; k < kSteps + 2; ++k) {
        const auto row = lone->forward(t[static_cast<std::size_t>(prefix[j] + k)]);
        want[static_cast<std::size_t>(j)].emplace_back(row.begin(), row.end());
      }
    }
    auto m = fn::CudaModel::load(f.dir, options(3));
    REQUIRE(m->slot_count() == 3);
    for (int j = 0; j < 3; ++j) {
      m->select_slot(j);
      CHECK(m->position() == 0);
      const std::vector<int32_t> t = sequence(f, j);
      m->prefill(std::span<const int32_t>(t).first(static_cast<std::size_t>(prefix[j])),
                 fn::PrefillLogits::None);
    }
    m->select_slot(1);
    double worst = 0;
    const std::vector<int64_t> order = {2, 0, 1};
    for (int64_t k = 0; k < kSteps; ++k) {
      std::vector<int32_t> feed;
      for (const int64_t j : order)
        feed.push_back(sequence(f, static_cast<int>(j))[static_cast<std::size_t>(prefix[j] + k)]);
      const auto rows = m->forward_batch(order, feed);
      REQUIRE(static_cast<int64_t>(rows.size()) == 3 * V);
      for (std::size_t i = 0; i < order.size(); ++i) {
        const auto j = static_cast<std::size_t>(order[i]);
        worst = std::max(worst, check_row(rows.data() + i * V, want[j][static_cast<std::size_t>(k)],
                                          fmt::format("slot {} step {}", j, k)));
      }
    }
    MESSAGE(fmt::format("{}: worst batched row {:.3f} of the tolerance", name, worst));
    CHECK(m->selected_slot() == 1);
    CHECK(m->position() == prefix[1] + kSteps);
    // Slot 0 goes on through the decode graph, slot 1 through forward() (a batched step).
    m->select_slot(0);
    check_row(m->forward(sequence(f, 0)[static_cast<std::size_t>(prefix[0] + kSteps)]).data(),
              want[0][kSteps], "slot 0 through the graph");
    m->select_slot(1);
    check_row(m->forward(sequence(f, 1)[static_cast<std::size_t>(prefix[1] + kSteps)]).data(),
              want[1][kSteps], "slot 1 through forward()");
    // Resetting slot 1 leaves slot 2.
    m->reset();
    CHECK(m->position() == 0);
    const int64_t two = 2;
    const int32_t next = sequence(f, 2)[static_cast<std::size_t>(prefix[2] + kSteps)];
    check_row(
        m->forward_batch(std::span<const int64_t>(&two, 1), std::span<const int32_t>(&next, 1))
            .data(),
        want[2][kSteps], "slot 2 after slot 1's reset");
    // The decode loop and the snapshot are slot 0's.
    CHECK_THROWS_AS(m->snapshot(), fn::Error);
    const std::vector<int64_t> twice = {2, 2};
    const std::vector<int32_t> ids = {1, 1};
    CHECK_THROWS_AS(m->forward_batch(twice, ids), fn::Error);
  }
}

TEST_CASE("cuda slots: the batch engine on three slots generates the reference's greedy ids") {
  fn::test::use_gpu_of_rank();
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CudaBackend backend(nullptr, nullptr, fn::CudaModel::load(f.dir, options(3)), 1, 0, false);
  REQUIRE(backend.slot_count() == 3);
  fn::BatchEngine engine(backend, coll, {.max_batch = 3, .prefill_budget = 5});
  constexpr int64_t kNew = 16;
  std::deque<fn::BatchRequest> queue;
  for (int64_t key = 0; key < 5; ++key) {
    fn::BatchRequest r;
    r.key = key;
    r.prompt = f.prompt_ids;
    r.options.ctx_size = 256;
    r.options.max_new_tokens = kNew;
    r.options.sampling.temperature = 0.0;
    r.options.ignore_eos = true;
    queue.push_back(std::move(r));
  }
  std::map<int64_t, fn::GenerationResult> got;
  while (!queue.empty() || engine.running() > 0) {
    if (!queue.empty() && engine.free_slots() > 0) {  // one admission per step: staggered
      engine.admit(std::move(queue.front()));
      queue.pop_front();
    }
    for (fn::BatchOutput& o : engine.step()) got.emplace(o.key, std::move(o.result));
  }
  REQUIRE(got.size() == 5);
  const int64_t P = static_cast<int64_t>(f.prompt_ids.size());
  for (const auto& [key, r] : got) {
    CAPTURE(key);
    REQUIRE(static_cast<int64_t>(r.token_ids.size()) == kNew);
    // Equal to the reference's ids up to the first row whose margin is within the tolerance
    // (a near tie the summation order may decide; the ids after it follow another path).
    for (int64_t i = 0; i < kNew; ++i) {
      const float* row = f.row(static_cast<std::size_t>(P - 1 + i));
      if (margin(row, f.vocab) <= kRelTol * max_abs(row, f.vocab)) break;
      CHECK(r.token_ids[static_cast<std::size_t>(i)] ==
            f.generated_ids[static_cast<std::size_t>(i)]);
    }
  }
}

TEST_CASE("cuda slots: sample_batch draws each row as the device sampler does") {
  fn::test::use_gpu_of_rank();
  const auto f = fn::test::load_ref_fixture("g3_tiny");
  const int64_t V = f.vocab;
  // Two models in the same state: one returns the rows, the other samples them on the device.
  std::unique_ptr<fn::CudaModel> m[3];
  for (auto& x : m) {
    x = fn::CudaModel::load(f.dir, options(3));
    for (int j = 0; j < 3; ++j) {
      x->select_slot(j);
      const std::vector<int32_t> t = sequence(f, j);
      x->prefill(std::span<const int32_t>(t).first(static_cast<std::size_t>(3 + j)),
                 fn::PrefillLogits::None);
    }
  }
  const std::vector<int64_t> slots = {0, 1, 2};
  std::vector<int32_t> feed;
  for (int j = 0; j < 3; ++j) feed.push_back(sequence(f, j)[static_cast<std::size_t>(3 + j)]);
  const auto rows = m[0]->forward_batch(slots, feed);
  std::vector<fn::DeviceSamplingParams> greedy(3);
  for (auto& g : greedy) g.temperature = 0.0f;
  const std::vector<int64_t> steps = {0, 4, 9};
  const std::vector<int32_t> ids = m[1]->sample_batch(slots, feed, greedy, steps);
  REQUIRE(ids.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(ids[i] == argmax(rows.data() + i * V, V));
  // Sampled rows (top-k 20, T 1, a seed per row): ids in the vocabulary.
  std::vector<fn::DeviceSamplingParams> drawn(3);
  for (std::size_t i = 0; i < 3; ++i) {
    drawn[i].temperature = 1.0f;
    drawn[i].top_k = 20;
    drawn[i].seed = 7 + i;
  }
  const std::vector<int32_t> a = m[2]->sample_batch(slots, feed, drawn, steps);
  for (const int32_t id : a) CHECK((id >= 0 && id < V));
  CHECK_THROWS_AS(m[2]->sample_batch(slots, feed, drawn, std::vector<int64_t>{0, 1}), fn::Error);
}

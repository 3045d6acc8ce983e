// CpuModel at TP = 1 against the transformers FP32 reference fixtures (tests/data/fixtures):
// every prompt position and 32 teacher-forced greedy steps, plus state reset.
#include <doctest/doctest.h>

#include <cmath>

#include "core/collectives.h"
#include "core/cpu_model.h"
#include "test_cpu_fixture.h"

using fn::test::RefFixture;

namespace {

// Runs the fixture's tokens through the model; checks every row against the reference.
std::vector<float> run_and_check(fn::CpuModel& model, const RefFixture& f) {
  REQUIRE(model.config().vocab_size == f.vocab);
  std::vector<float> all;
  double worst_rel = 0.0;
  for (std::size_t p = 0; p < f.tokens.size(); ++p) {
    const auto logits = model.forward(f.tokens[p]);
    REQUIRE(static_cast<int64_t>(logits.size()) == f.vocab);
    const double diff = fn::test::max_abs_diff(logits.data(), f.row(p), f.vocab);
    const double scale = fn::test::max_abs(f.row(p), f.vocab);
    worst_rel = std::max(worst_rel, diff / scale);
    CAPTURE(p);
    CHECK(diff <= 1e-4 * scale);
    if (p + 1 >= f.prompt_ids.size()) {
      const std::size_t i = p + 1 - f.prompt_ids.size();
      CHECK(fn::test::argmax(logits.data(), f.vocab) == f.generated_ids[i]);
    }
    all.insert(all.end(), logits.begin(), logits.end());
  }
  MESSAGE(f.name << ": worst max|logit - ref| / max|ref| over " << f.tokens.size()
                 << " rows = " << worst_rel);
  return all;
}

}  // namespace

TEST_CASE("cpu model: TP=1 logits match the transformers FP32 reference on every fixture") {
  for (const std::string name : {"g3_tiny", "tp4", "ple2_long"}) {
    CAPTURE(name);
    const RefFixture f = fn::test::load_ref_fixture(name);
    fn::LocalCollectives local;
    auto model = fn::CpuModel::load(f.dir, local);
    const std::vector<float> first = run_and_check(*model, f);
    CHECK(model->position() == static_cast<int64_t>(f.tokens.size()));
    // reset() forgets the sequence: a second pass gives bit-identical logits.
    model->reset();
    CHECK(model->position() == 0);
    std::vector<float> second;
    for (int32_t t : f.tokens) {
      const auto l = model->forward(t);
      second.insert(second.end(), l.begin(), l.end());
    }
    CHECK(first == second);
  }
}

TEST_CASE("cpu model: a token outside the vocabulary is a usage error") {
  const RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  fn::LocalCollectives local;
  auto model = fn::CpuModel::load(f.dir, local);
  CHECK_THROWS_AS(model->forward(static_cast<int32_t>(f.vocab)), fn::Error);
  CHECK_THROWS_AS(model->forward(-1), fn::Error);
  CHECK(model->position() == 0);
}

TEST_CASE("cpu model: prefill(T) equals prefill(T-1) followed by one decode step") {
  const RefFixture f = fn::test::load_ref_fixture("ple2_long");
  fn::LocalCollectives local;
  auto a = fn::CpuModel::load(f.dir, local);
  auto b = fn::CpuModel::load(f.dir, local);
  const std::span<const int32_t> prompt(f.prompt_ids);
  const auto la = a->prefill(prompt);
  const std::vector<float> full(la.begin(), la.end());
  b->prefill(prompt.first(prompt.size() - 1));
  const auto lb = b->forward(prompt.back());
  CHECK(std::vector<float>(lb.begin(), lb.end()) == full);
  CHECK(a->position() == b->position());
  // and both continue identically
  const auto na = a->forward(f.generated_ids[0]);
  const std::vector<float> next_a(na.begin(), na.end());
  const auto nb = b->forward(f.generated_ids[0]);
  CHECK(std::vector<float>(nb.begin(), nb.end()) == next_a);
  CHECK_THROWS_AS(a->prefill({}), fn::Error);
}

TEST_CASE("cpu model: the per-sequence state has the sizes of docs/model.md §C.0 at TP=1") {
  // g3_tiny: 3 GDN layers (conv_dim 2*2*16 + 6*16 = 160, 3-deep conv state, 6 x 16 x 16 FP32
  // recurrent state), 1 QSA layer (K and V: 2 KV heads x 32 per token, raw indexer keys 16 per
  // token, one pooled key of 16 per 4 tokens), 1 PLE layer (4 x 64 channels x 9 taps, 2 context
  // ids of 8 bytes).
  const RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  fn::LocalCollectives local;
  auto model = fn::CpuModel::load(f.dir, local);
  const uint64_t fixed = 3 * (160 * 3 + 6 * 16 * 16) * 4 + 256 * 9 * 4 + 2 * 8;
  CHECK(model->state_bytes() == fixed);
  for (int t = 0; t < 10; ++t) model->forward(f.tokens[static_cast<std::size_t>(t)]);
  CHECK(model->state_bytes() == fixed + (10 * (2 * 64 + 16) + 2 * 16) * 4);
}

// Continuous batching (core/batch_engine.h) on the cpu backend's sequence slots: forward_batch
// rows equal forward() on each slot alone (bitwise), a slot keeps its sequence while others run,
// and every request the engine runs beside others — greedy, seeded top-k / top-p / min-p,
// penalties, stop ids, stop strings, log-probs, prompts prefilled in chunks of a small budget,
// token-by-token prefill — gives bitwise what generate() gives it alone on a fresh backend (ids,
// log-probs, finish reason, text). Also admit()'s checks and the one-slot path.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/batch_engine.h"
#include "core/collectives.h"
#include "core/cpu_backend.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "core/generate.h"
#include "core/sampler.h"
#include "test_cpu_fixture.h"

namespace {

bool bitwise_equal(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// "<id>", built by appends: `"<" + std::to_string(id) + ">"` trips GCC 12's false -Wrestrict
// warning (GCC bug 105651) in a Release build.
std::string bracketed(int64_t id) {
  std::string s = "<";
  s += std::to_string(id);
  s += '>';
  return s;
}

// Text of an id for the stop-string cases: "<id>".
fn::TextHooks id_text_hooks() {
  fn::TextHooks h;
  h.feed = [](int32_t id) { return bracketed(id); };
  h.finish = [] { return std::string(); };
  return h;
}

// The requests of the comparison: each a prompt (a slice of the fixture's tokens) and settings.
std::vector<fn::BatchRequest> comparison_requests(const fn::test::RefFixture& f) {
  std::vector<fn::BatchRequest> reqs;
  const auto base = [&](int64_t first, int64_t len) {
    fn::BatchRequest r;
    r.key = static_cast<int64_t>(reqs.size());
    r.prompt.assign(f.tokens.begin() + first, f.tokens.begin() + first + len);
    r.options.ctx_size = 256;
    r.options.max_new_tokens = 10;
    r.options.sampling.temperature = 0.0;
    r.options.stop_token_ids = {f.generated_ids[4]};  // a stop id the greedy run reaches
    r.options.ignore_eos = true;
    return r;
  };
  {  // greedy, the whole prompt (chunked by the budget)
    fn::BatchRequest r = base(0, static_cast<int64_t>(f.prompt_ids.size()));
    r.options.max_new_tokens = 12;
    reqs.push_back(std::move(r));
  }
  {  // seeded top-k sampling with log-probs
    fn::BatchRequest r = base(2, 5);
    r.options.sampling.temperature = 0.8;
    r.options.sampling.top_k = 20;
    r.options.sampling.seed = 1234;
    r.options.top_logprobs = 3;
    reqs.push_back(std::move(r));
  }
  {  // top-p and min-p, a one-token prompt
    fn::BatchRequest r = base(7, 1);
    r.options.sampling.temperature = 1.0;
    r.options.sampling.top_p = 0.9;
    r.options.sampling.min_p = 0.05;
    r.options.sampling.seed = 99;
    reqs.push_back(std::move(r));
  }
  {  // penalties (host sampler history), greedy
    fn::BatchRequest r = base(1, 9);
    r.options.sampling.repetition_penalty = 1.3;
    r.options.sampling.presence_penalty = 0.5;
    r.options.sampling.frequency_penalty = 0.25;
    reqs.push_back(std::move(r));
  }
  {  // the stop id ends it early (the greedy continuation of the whole prompt reaches it)
    fn::BatchRequest r = base(0, static_cast<int64_t>(f.prompt_ids.size()));
    r.options.ignore_eos = false;
    r.options.max_new_tokens = 20;
    reqs.push_back(std::move(r));
  }
  {  // one token only, token-by-token prefill, log-probs 0
    fn::BatchRequest r = base(3, 6);
    r.options.max_new_tokens = 1;
    r.options.stepwise_prefill = true;
    r.options.top_logprobs = 0;
    reqs.push_back(std::move(r));
  }
  {  // a stop string on the text of the greedy run's third id
    fn::BatchRequest r = base(0, static_cast<int64_t>(f.prompt_ids.size()));
    r.options.stop_strings = {bracketed(f.generated_ids[2])};
    r.hooks = id_text_hooks();
    reqs.push_back(std::move(r));
  }
  {  // sampled, long answer, seeded differently
    fn::BatchRequest r = base(4, 8);
    r.options.sampling.temperature = 1.2;
    r.options.sampling.seed = 7;
    r.options.max_new_tokens = 16;
    r.options.top_logprobs = 5;
    reqs.push_back(std::move(r));
  }
  return reqs;
}

// Runs `reqs` through an engine of `max_batch` on `model`, admitting in order as slots free.
std::map<int64_t, fn::GenerationResult> run_engine(fn::Backend& model, fn::Collectives& coll,
                                                   std::vector<fn::BatchRequest> reqs,
                                                   int64_t max_batch, int64_t budget,
                                                   int64_t* max_running = nullptr) {
  fn::BatchEngine engine(model, coll, {.max_batch = max_batch, .prefill_budget = budget});
  std::deque<fn::BatchRequest> queue(std::make_move_iterator(reqs.begin()),
                                     std::make_move_iterator(reqs.end()));
  std::map<int64_t, fn::GenerationResult> out;
  while (!queue.empty() || engine.running() > 0) {
    while (!queue.empty() && engine.free_slots() > 0) {
      engine.admit(std::move(queue.front()));
      queue.pop_front();
    }
    if (max_running) *max_running = std::max(*max_running, engine.running());
    for (fn::BatchOutput& o : engine.step()) out.emplace(o.key, std::move(o.result));
  }
  return out;
}

void check_same(const fn::GenerationResult& got, const fn::GenerationResult& want) {
  CHECK(got.token_ids == want.token_ids);
  CHECK(got.finish == want.finish);
  CHECK(got.text == want.text);
  CHECK(got.n_prompt_tokens == want.n_prompt_tokens);
  REQUIRE(got.logprobs.size() == want.logprobs.size());
  for (std::size_t i = 0; i < got.logprobs.size(); ++i) {
    CHECK(got.logprobs[i].logprob == want.logprobs[i].logprob);
    CHECK(got.logprobs[i].top_ids == want.logprobs[i].top_ids);
    CHECK(got.logprobs[i].top_logprobs == want.logprobs[i].top_logprobs);
  }
  CHECK(got.itl_ms.size() + 1 == got.token_ids.size());
  CHECK(got.ttft_ms >= got.prefill_ms);
}

// The cpu backend's slots with what CudaBackend::sample_batch does, emulated on the host: each
// row of a batched step is sampled with its sequence's settings over its own penalty window,
// started at step 0 from SlotSampling::history and fed with every id sampled for the slot
// (fn::Sampler, so a greedy row's id is the host sampler's). Records every step-0 history.
class EmulatedBatchDevice final : public fn::Backend {
 public:
  explicit EmulatedBatchDevice(fn::CpuBackend& cpu)
      : fn::Backend(cpu.info()), cpu_(cpu), samplers_(static_cast<std::size_t>(cpu.slot_count())) {}
  std::vector<std::vector<int32_t>> first_histories;  // each sequence's step-0 history
  std::vector<fn::SamplingParams> first_settings;     // and its settings
  int64_t device_rows = 0;                            // rows sampled here

  fn::BackendCapabilities capabilities() const noexcept override {
    fn::BackendCapabilities c;
    c.batch_sampling = true;
    return c;
  }
  void reset() override { cpu_.reset(); }
  int64_t position() const noexcept override { return cpu_.position(); }
  std::span<const float> forward(int32_t t) override { return cpu_.forward(t); }
  std::span<const float> prefill(std::span<const int32_t> tokens,
                                 fn::PrefillOutput output) override {
    return cpu_.prefill(tokens, output);
  }
  int64_t slot_count() const noexcept override { return cpu_.slot_count(); }
  int64_t selected_slot() const noexcept override { return cpu_.selected_slot(); }
  void select_slot(int64_t slot) override { cpu_.select_slot(slot); }
  std::span<const float> forward_batch(std::span<const int64_t> slots,
                                       std::span<const int32_t> tokens) override {
    return cpu_.forward_batch(slots, tokens);
  }
  std::vector<int32_t> sample_batch(std::span<const int64_t> slots, std::span<const int32_t> tokens,
                                    std::span<const fn::SlotSampling> sampling) override {
    REQUIRE(sampling.size() == slots.size());
    const auto rows = cpu_.forward_batch(slots, tokens);
    const auto V = static_cast<std::size_t>(info().vocab_size);
    std::vector<int32_t> ids;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      std::optional<fn::Sampler>& s = samplers_[static_cast<std::size_t>(slots[i])];
      if (sampling[i].step == 0) {
        s.emplace(sampling[i].sampling);
        for (const int32_t t : sampling[i].history) s->accept(t);
        first_histories.emplace_back(sampling[i].history.begin(), sampling[i].history.end());
        first_settings.push_back(sampling[i].sampling);
      }
      REQUIRE(s.has_value());
      const int32_t id = s->sample(rows.subspan(i * V, V));
      s->accept(id);
      ids.push_back(id);
      ++device_rows;
    }
    return ids;
  }

 private:
  fn::CpuBackend& cpu_;
  std::vector<std::optional<fn::Sampler>> samplers_;  // per slot: the window on the "device"
};

}  // namespace

TEST_CASE(
    "batch engine: penalties and stop strings sample on a batch-sampling backend, each sequence "
    "over its own window from its prompt, equal to generate() alone") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend ref(fn::CpuModel::load(f.dir, coll), 0.0);
  std::map<int64_t, fn::GenerationResult> alone;
  std::vector<std::vector<int32_t>> device_prompts;
  for (fn::BatchRequest& r : comparison_requests(f)) {
    ref.reset();
    alone.emplace(r.key, fn::generate(ref, coll, r.prompt, r.options, r.hooks));
    // The device takes every request but those asking for log-probs (computed on the host).
    if (r.options.top_logprobs < 0) device_prompts.push_back(r.prompt);
  }
  REQUIRE(alone.at(6).finish == fn::FinishReason::Stop);
  for (const int64_t max_batch : {3, 8}) {
    CAPTURE(max_batch);
    fn::CpuBackend cpu(fn::CpuModel::load(f.dir, coll), 0.0, max_batch);
    EmulatedBatchDevice dev(cpu);
    const auto got = run_engine(dev, coll, comparison_requests(f), max_batch, 64);
    REQUIRE(got.size() == alone.size());
    for (const auto& [key, want] : alone) {
      CAPTURE(key);
      check_same(got.at(key), want);
    }
    CHECK(dev.device_rows > 0);
    // One step 0 per device request, its history its whole prompt: the penalty request (1..9)
    // and the stop-string request are among them.
    auto seen = dev.first_histories;
    auto want_prompts = device_prompts;
    std::sort(seen.begin(), seen.end());
    std::sort(want_prompts.begin(), want_prompts.end());
    CHECK(seen == want_prompts);
    CHECK(std::any_of(dev.first_settings.begin(), dev.first_settings.end(),
                      [](const fn::SamplingParams& s) { return s.repetition_penalty != 1.0; }));
  }
}

TEST_CASE("cpu slots: forward_batch rows equal forward() per slot; slots keep their sequences") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend one(fn::CpuModel::load(f.dir, coll), 0.0);
  fn::CpuBackend three(fn::CpuModel::load(f.dir, coll), 0.0, 3);
  CHECK(one.slot_count() == 1);
  CHECK(three.slot_count() == 3);
  CHECK(three.selected_slot() == 0);
  const std::span<const int32_t> t(f.tokens);
  const auto V = static_cast<std::size_t>(f.vocab);

  // Slot s runs the fixture from token s; the reference runs each alone.
  std::vector<std::vector<float>> want(3);
  for (int s = 0; s < 3; ++s) {
    one.reset();
    one.prefill(t.subspan(static_cast<std::size_t>(s), 4), fn::PrefillOutput::None);
    const auto row = one.forward(t[static_cast<std::size_t>(s) + 4]);
    want[static_cast<std::size_t>(s)].assign(row.begin(), row.end());
  }
  for (int s = 0; s < 3; ++s) {
    three.select_slot(s);
    CHECK(three.position() == 0);  // a fresh slot starts reset
    three.prefill(t.subspan(static_cast<std::size_t>(s), 4), fn::PrefillOutput::None);
  }
  three.select_slot(1);
  const std::vector<int64_t> slots = {2, 0, 1};
  const std::vector<int32_t> feed = {t[6], t[4], t[5]};
  const auto rows = three.forward_batch(slots, feed);
  REQUIRE(rows.size() == 3 * V);
  CHECK(bitwise_equal(rows.subspan(0, V), want[2]));
  CHECK(bitwise_equal(rows.subspan(V, V), want[0]));
  CHECK(bitwise_equal(rows.subspan(2 * V, V), want[1]));
  CHECK(three.selected_slot() == 1);  // unchanged
  for (int s = 0; s < 3; ++s) {
    three.select_slot(s);
    CHECK(three.position() == 5);
  }
  // Resetting one slot leaves the others.
  three.select_slot(0);
  three.reset();
  three.select_slot(2);
  CHECK(three.position() == 5);

  const std::vector<int64_t> twice = {1, 1};
  const std::vector<int32_t> two = {t[0], t[1]};
  CHECK_THROWS_AS(three.forward_batch(twice, two), fn::Error);
  const std::vector<int64_t> outside = {3};
  CHECK_THROWS_AS(three.forward_batch(outside, std::span<const int32_t>(two).first(1)), fn::Error);
  CHECK_THROWS_AS(three.select_slot(3), fn::Error);
  CHECK_THROWS_AS(one.select_slot(1), fn::Error);
}

TEST_CASE("batch engine: each request beside others equals generate() alone, bitwise") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend ref(fn::CpuModel::load(f.dir, coll), 0.0);
  std::map<int64_t, fn::GenerationResult> alone;
  for (fn::BatchRequest& r : comparison_requests(f)) {
    ref.reset();
    alone.emplace(r.key, fn::generate(ref, coll, r.prompt, r.options, r.hooks));
  }
  // The cases do what they are there for.
  CHECK(alone.at(4).finish == fn::FinishReason::Eos);
  CHECK(alone.at(6).finish == fn::FinishReason::Stop);
  CHECK(alone.at(5).token_ids.size() == 1);

  for (const int64_t max_batch : {4, 3, 8}) {
    for (const int64_t budget : {3, 64}) {
      CAPTURE(max_batch);
      CAPTURE(budget);
      fn::CpuBackend model(fn::CpuModel::load(f.dir, coll), 0.0, max_batch);
      int64_t most = 0;
      const auto got = run_engine(model, coll, comparison_requests(f), max_batch, budget, &most);
      CHECK(most == std::min<int64_t>(max_batch, static_cast<int64_t>(alone.size())));
      REQUIRE(got.size() == alone.size());
      for (const auto& [key, want] : alone) {
        CAPTURE(key);
        check_same(got.at(key), want);
      }
    }
  }
}

TEST_CASE("batch engine: one slot runs each request through generate()") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend ref(fn::CpuModel::load(f.dir, coll), 0.0);
  fn::CpuBackend model(fn::CpuModel::load(f.dir, coll), 0.0);
  const auto got = run_engine(model, coll, comparison_requests(f), 1, 2);
  for (fn::BatchRequest& r : comparison_requests(f)) {
    ref.reset();
    check_same(got.at(r.key), fn::generate(ref, coll, r.prompt, r.options, r.hooks));
  }
}

TEST_CASE("batch engine: admit refuses bad requests and leaves the engine as it was") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend model(fn::CpuModel::load(f.dir, coll), 0.0, 2);
  CHECK_THROWS_AS(fn::BatchEngine(model, coll, {.max_batch = 3}), fn::Error);
  CHECK_THROWS_AS(fn::BatchEngine(model, coll, {.max_batch = 2, .prefill_budget = 0}), fn::Error);
  fn::BatchEngine engine(model, coll, {.max_batch = 2, .prefill_budget = 8});
  const auto request = [&] {
    fn::BatchRequest r;
    r.prompt = {f.prompt_ids[0], f.prompt_ids[1]};
    r.options.ctx_size = 16;
    r.options.max_new_tokens = 4;
    r.options.sampling.temperature = 0.0;
    return r;
  };
  // The kind admit() throws; none when it admitted the request.
  const auto kind_of = [&](fn::BatchRequest r) -> std::optional<fn::ErrorKind> {
    try {
      engine.admit(std::move(r));
    } catch (const fn::Error& e) {
      return e.kind();
    }
    return std::nullopt;
  };
  fn::BatchRequest empty = request();
  empty.prompt.clear();
  CHECK(kind_of(std::move(empty)) == fn::ErrorKind::Usage);
  fn::BatchRequest too_long = request();
  too_long.options.max_new_tokens = 15;
  CHECK(kind_of(std::move(too_long)) == fn::ErrorKind::Usage);
  fn::BatchRequest bad_temp = request();
  bad_temp.options.sampling.temperature = -1.0;
  CHECK(kind_of(std::move(bad_temp)) == fn::ErrorKind::Usage);
  fn::BatchRequest no_text = request();
  no_text.options.stop_strings = {"x"};
  CHECK(kind_of(std::move(no_text)) == fn::ErrorKind::Usage);
  fn::BatchRequest bad_lp = request();
  bad_lp.options.top_logprobs = 21;
  CHECK(kind_of(std::move(bad_lp)) == fn::ErrorKind::Usage);
  CHECK(engine.running() == 0);
  engine.admit(request());
  engine.admit(request());
  CHECK(engine.free_slots() == 0);
  CHECK(kind_of(request()) == fn::ErrorKind::Internal);
  int64_t finished = 0;
  while (engine.running() > 0) finished += static_cast<int64_t>(engine.step().size());
  CHECK(finished == 2);
  CHECK(engine.step().empty());
}

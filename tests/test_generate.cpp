// Generation loop (core/generate.h) on a scripted fake backend (stop ids, --ignore-eos, length,
// stop strings across token boundaries, the context check, latency statistics, the choice
// between host and device sampling) and on the tp4 and g3_tiny reference fixtures at TP = 1
// (greedy ids = the reference's 32 decode ids; prefill(T) = prefill(T-1) + one decode step).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/collectives.h"
#include "core/cpu_backend.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "core/generate.h"
#include "test_cpu_fixture.h"

namespace {

// A backend whose greedy continuation is `script`: after n forward calls the logits put 1 on
// script[n - 1] (0 elsewhere), so the prompt's last token decides the first generated one; an
// empty script gives all-zero (flat) logits. Its
// prefill feeds the tokens through forward() and records each batch it was given; with
// `device` set it has a decode() that emulates the device loop (feed, argmax, report, feed back)
// one step ahead, as the decode graph runs (step i + 1 is fed before id i is reported), recording
// the id each call started from and the history it was given.
class ScriptedModel final : public fn::Backend {
 public:
  explicit ScriptedModel(std::vector<int32_t> s, bool device = false)
      : fn::Backend(info_of()), script(std::move(s)), device_(device) {}

  std::vector<int32_t> script;
  std::vector<float> logits;
  std::vector<int32_t> fed;
  std::vector<std::vector<int32_t>> prefilled;         // each prefill() call's tokens
  std::vector<fn::PrefillOutput> prefill_outputs;      // and what it was asked to return
  std::vector<int32_t> decode_firsts;                  // each decode() call's first id
  std::vector<int64_t> decode_top_logprobs;            // and the top_logprobs it was given
  std::vector<std::vector<int32_t>> decode_histories;  // and the penalty history

  fn::BackendCapabilities capabilities() const noexcept override {
    fn::BackendCapabilities c;
    c.device_decode = device_;
    return c;
  }
  void reset() override { fed.clear(); }
  int64_t position() const noexcept override { return static_cast<int64_t>(fed.size()); }
  std::span<const float> forward(int32_t t) override {
    fed.push_back(t);
    logits.assign(16, 0.0f);
    if (script.empty()) return logits;  // flat: every id alike
    const std::size_t i = std::min(fed.size() - 1, script.size() - 1);
    logits[static_cast<std::size_t>(script[i])] = 1.0f;
    return logits;
  }
  std::span<const float> prefill(std::span<const int32_t> tokens,
                                 fn::PrefillOutput output) override {
    prefilled.emplace_back(tokens.begin(), tokens.end());
    prefill_outputs.push_back(output);
    std::span<const float> l;
    for (int32_t t : tokens) l = forward(t);
    return output == fn::PrefillOutput::Last ? l : std::span<const float>();
  }
  std::vector<int32_t> decode(int32_t first, int64_t count, const fn::SamplingParams&, uint64_t,
                              const std::function<bool(int32_t)>& on_token, int64_t top_logprobs,
                              std::vector<fn::TokenLogprobs>* logprobs,
                              std::span<const int32_t> history) override {
    REQUIRE(device_);
    decode_firsts.push_back(first);
    decode_top_logprobs.push_back(top_logprobs);
    decode_histories.emplace_back(history.begin(), history.end());
    std::vector<int32_t> out;
    int32_t t = first;
    const auto step = [&] {
      const auto l = forward(t);
      t = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
      return t;
    };
    int32_t next = count > 0 ? step() : 0;
    for (int64_t i = 0; i < count; ++i) {
      const int32_t id = next;
      if (i + 1 < count) next = step();  // run ahead, as the decode graph: fed before reported
      out.push_back(id);
      // The device's reduction, emulated with a marker the host path cannot produce.
      if (top_logprobs >= 0) logprobs->push_back({-100.0 - static_cast<double>(i), {id}, {-1.0}});
      if (!on_token(id)) break;
    }
    return out;
  }

 private:
  static fn::BackendInfo info_of() {
    fn::BackendInfo i;
    i.name = "scripted";
    i.vocab_size = 16;
    return i;
  }
  bool device_ = false;
};

fn::GenerateOptions greedy(int64_t n) {
  fn::GenerateOptions o;
  o.sampling.temperature = 0.0;
  o.max_new_tokens = n;
  o.ctx_size = 1000;
  return o;
}

// Text hooks over a fixed id -> text table, recording every emitted chunk.
struct FakeText {
  explicit FakeText(std::map<int32_t, std::string> p) : pieces(std::move(p)) {}
  std::map<int32_t, std::string> pieces;
  std::vector<std::string> emitted;
  fn::TextHooks hooks() {
    fn::TextHooks h;
    h.feed = [this](int32_t id) { return pieces.at(id); };
    h.finish = [] { return std::string(); };
    h.emit = [this](std::string_view s) { emitted.emplace_back(s); };
    return h;
  }
  std::string joined() const {
    std::string s;
    for (const auto& e : emitted) s += e;
    return s;
  }
};

}  // namespace

TEST_CASE("generate: stops at a stop id (kept in the ids, not in the text) unless --ignore-eos") {
  fn::LocalCollectives coll;
  ScriptedModel m{{3, 4, 9, 5, 6}};
  FakeText t{{{3, "a"}, {4, "b"}, {9, "<eos>"}, {5, "c"}, {6, "d"}}};
  auto o = greedy(10);
  o.stop_token_ids = {9, 12};
  const std::vector<int32_t> prompt = {1, 2};
  // Prompt [1, 2]: the logits after token 2 give script[1] = 4 first.
  auto r = fn::generate(m, coll, prompt, o, t.hooks());
  CHECK(r.token_ids == std::vector<int32_t>{4, 9});
  CHECK(r.finish == fn::FinishReason::Eos);
  CHECK(r.text == "b");
  CHECK(t.joined() == "b");
  CHECK(r.n_prompt_tokens == 2);
  CHECK(r.itl_ms.size() == 1);
  CHECK(m.fed == std::vector<int32_t>{1, 2, 4});  // the stop id is never fed back

  ScriptedModel m2{{3, 4, 9, 5, 6}};
  FakeText t2{{{3, "a"}, {4, "b"}, {9, "<eos>"}, {5, "c"}, {6, "d"}}};
  o.ignore_eos = true;
  o.max_new_tokens = 4;
  r = fn::generate(m2, coll, prompt, o, t2.hooks());
  CHECK(r.token_ids == std::vector<int32_t>{4, 9, 5, 6});
  CHECK(r.finish == fn::FinishReason::Length);
  CHECK(r.text == "b<eos>cd");
  CHECK(r.itl_ms.size() == 3);
  CHECK(r.tpot.count == 3);
}

TEST_CASE("generate: max_new_tokens ends the run with finish reason length") {
  fn::LocalCollectives coll;
  ScriptedModel m{{5, 5, 5, 5, 5, 5, 5, 5}};
  const std::vector<int32_t> prompt = {1};
  auto r = fn::generate(m, coll, prompt, greedy(3));
  CHECK(r.token_ids == std::vector<int32_t>{5, 5, 5});
  CHECK(r.finish == fn::FinishReason::Length);
  CHECK(m.fed.size() == 3);  // prompt + 2 fed back; the last token is never fed
  CHECK(r.text.empty());
  CHECK(r.ttft_ms > 0.0);
  CHECK(r.e2e_ms >= r.ttft_ms);
}

TEST_CASE("generate: a stop string across token boundaries is cut and never printed") {
  fn::LocalCollectives coll;
  ScriptedModel m{{1, 2, 3, 4, 5}};
  FakeText t{{{1, "Hel"}, {2, "lo w"}, {3, "or"}, {4, "ld!"}, {5, "zz"}}};
  auto o = greedy(10);
  o.stop_strings = {"world", "xyz"};
  const std::vector<int32_t> prompt = {0};
  const auto r = fn::generate(m, coll, prompt, o, t.hooks());
  CHECK(r.finish == fn::FinishReason::Stop);
  CHECK(r.token_ids == std::vector<int32_t>{1, 2, 3, 4});
  CHECK(r.text == "Hello ");
  CHECK(t.joined() == "Hello ");
  // "w" and "or" were held back while they could still start "world".
  for (const auto& e : t.emitted) CHECK(e.find('w') == std::string::npos);
  // A held-back partial match that fails is released: "wo" + "x" is not "world".
  ScriptedModel m2{{1, 2, 3}};
  FakeText t2{{{1, "a w"}, {2, "o"}, {3, "x"}}};
  o.stop_strings = {"world"};
  o.max_new_tokens = 3;
  const auto r2 = fn::generate(m2, coll, prompt, o, t2.hooks());
  CHECK(r2.finish == fn::FinishReason::Length);
  CHECK(r2.text == "a wox");
  CHECK(t2.joined() == "a wox");
  // Held text is flushed at the end of a run that stopped on length.
  ScriptedModel m3{{1, 2}};
  FakeText t3{{{1, "x"}, {2, "wor"}}};
  o.max_new_tokens = 2;
  const auto r3 = fn::generate(m3, coll, prompt, o, t3.hooks());
  CHECK(t3.joined() == "xwor");
  CHECK(r3.text == "xwor");
  // A stop string inside one token cuts that token's text.
  ScriptedModel m4{{1, 2}};
  FakeText t4{{{1, "ab"}, {2, "c\n\nd"}}};
  o.stop_strings = {"\n\n"};
  const auto r4 = fn::generate(m4, coll, prompt, o, t4.hooks());
  CHECK(r4.finish == fn::FinishReason::Stop);
  CHECK(t4.joined() == "abc");
}

TEST_CASE("generate: --stop without a tokenizer is a usage error") {
  fn::LocalCollectives coll;
  ScriptedModel m{{1}};
  auto o = greedy(2);
  o.stop_strings = {"x"};
  const std::vector<int32_t> prompt = {0};
  CHECK_THROWS_AS(fn::generate(m, coll, prompt, o), fn::Error);
  CHECK(m.fed.empty());
}

TEST_CASE("generate: a prompt longer than the context is a usage error naming both numbers") {
  fn::LocalCollectives coll;
  ScriptedModel m{{1}};
  auto o = greedy(8);
  o.ctx_size = 10;
  const std::vector<int32_t> prompt(5, 1);
  try {
    fn::generate(m, coll, prompt, o);
    FAIL("no error");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Usage);
    const std::string w = e.what();
    CHECK(w.find("5 tokens") != std::string::npos);
    CHECK(w.find("(8)") != std::string::npos);
    CHECK(w.find("ctx-size 10") != std::string::npos);
  }
  CHECK(m.fed.empty());  // checked before any forward
  o.max_new_tokens = 5;  // exactly fills the context: fine
  CHECK(fn::generate(m, coll, prompt, o).token_ids.size() == 5);
  // A prompt that alone fills the context is bad input (Format), whatever -n is.
  const std::vector<int32_t> full(10, 1);
  o.max_new_tokens = 1;
  try {
    fn::generate(m, coll, full, o);
    FAIL("no error");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
    CHECK(std::string(e.what()).find("10 tokens") != std::string::npos);
  }
}

TEST_CASE("generate: an empty prompt is a usage error") {
  fn::LocalCollectives coll;
  ScriptedModel m{{1}};
  const std::vector<int32_t> prompt;
  try {
    fn::generate(m, coll, prompt, greedy(4));
    FAIL("no error");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Usage);
    CHECK(std::string(e.what()).find("empty") != std::string::npos);
  }
}

TEST_CASE("generate: latency statistics (numpy's linear percentiles)") {
  const std::vector<double> x = {10, 1, 9, 2, 8, 3, 7, 4, 6, 5};
  const auto s = fn::latency_stats(x);
  CHECK(s.count == 10);
  CHECK(s.mean == doctest::Approx(5.5));
  CHECK(s.p50 == doctest::Approx(5.5));
  CHECK(s.p90 == doctest::Approx(9.1));
  CHECK(s.p99 == doctest::Approx(9.91));
  CHECK(s.max == 10);
  const auto one = fn::latency_stats(std::vector<double>{3.0});
  CHECK(one.p99 == 3.0);
  CHECK(fn::latency_stats(std::vector<double>{}).count == 0);
}

TEST_CASE("generate: sampling with a seed is reproducible through the loop") {
  fn::LocalCollectives coll;
  // Uniform logits over 16 ids (a script that is all one id, its 1 replaced by 0): the draw
  // alone decides.
  ScriptedModel f{{0}};
  f.script.clear();
  auto o = greedy(20);
  o.sampling.temperature = 1.0;
  o.sampling.seed = 99;
  const std::vector<int32_t> prompt = {0};
  const auto a = fn::generate(f, coll, prompt, o);
  const auto b = fn::generate(f, coll, prompt, o);
  CHECK(a.token_ids == b.token_ids);
  std::map<int32_t, int> distinct;
  for (int32_t t : a.token_ids) ++distinct[t];
  CHECK(distinct.size() > 4);  // not stuck on one id
}

TEST_CASE("generate: greedy on the reference fixtures reproduces the 32 decode ids (TP=1)") {
  for (const char* name : {"tp4", "g3_tiny", "ple2_long"}) {
    CAPTURE(name);
    const auto f = fn::test::load_ref_fixture(name);
    fn::LocalCollectives coll;
    fn::CpuBackend model(fn::CpuModel::load(f.dir, coll), 0.0);
    auto o = greedy(32);
    o.ignore_eos = true;
    o.ctx_size = 4096;
    o.stop_token_ids = {7, 8};
    const auto r = fn::generate(model, coll, f.prompt_ids, o);
    const std::vector<int32_t> want(f.generated_ids.begin(), f.generated_ids.begin() + 32);
    CHECK(r.token_ids == want);
    CHECK(r.finish == fn::FinishReason::Length);
    // Without --ignore-eos the run ends at the first stop id of the reference stream.
    model.reset();
    o.ignore_eos = false;
    const auto r2 = fn::generate(model, coll, f.prompt_ids, o);
    std::size_t first_stop = 0;
    while (first_stop < want.size() && want[first_stop] != 7 && want[first_stop] != 8) ++first_stop;
    REQUIRE(first_stop < want.size());  // the README says each stream contains a stop id
    CHECK(r2.finish == fn::FinishReason::Eos);
    CHECK(r2.token_ids ==
          std::vector<int32_t>(want.begin(), want.begin() + static_cast<long>(first_stop) + 1));
  }
}

TEST_CASE("generate: prefill(T) equals prefill(T-1) plus one decode step") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend model(fn::CpuModel::load(f.dir, coll), 0.0);
  const std::span<const int32_t> all(f.prompt_ids);
  const auto a = model.prefill(all, fn::PrefillOutput::Last);
  const std::vector<float> full(a.begin(), a.end());
  CHECK(model.position() == static_cast<int64_t>(all.size()));
  model.reset();
  CHECK(model.prefill(all.first(all.size() - 1), fn::PrefillOutput::None).empty());
  const auto b = model.forward(all.back());
  const double scale = fn::test::max_abs(full.data(), f.vocab);
  const double diff = fn::test::max_abs_diff(full.data(), b.data(), f.vocab);
  MESSAGE("max |prefill(T) - (prefill(T-1) + step)| = " << diff << " (scale " << scale << ")");
  CHECK(diff <= 1e-5 * scale);
  // And both match the reference's last prompt row.
  CHECK(fn::test::max_abs_diff(full.data(), f.row(all.size() - 1), f.vocab) <= 1e-4 * scale);
}

TEST_CASE(
    "generate: the prompt runs in one prefill call and decoding continues through forward, or "
    "through the device loop from the last prompt token") {
  fn::LocalCollectives coll;
  const std::vector<int32_t> prompt = {1, 2, 9};
  // Host sampling: one prefill of the whole prompt asking for its last logits.
  ScriptedModel m{{3, 4, 5, 6, 7, 8}};
  CHECK_FALSE(fn::samples_on_device(m, greedy(3)));
  const auto r = fn::generate(m, coll, prompt, greedy(3));
  REQUIRE(m.prefilled.size() == 1);
  CHECK(m.prefilled[0] == prompt);
  CHECK(m.prefill_outputs[0] == fn::PrefillOutput::Last);
  CHECK(r.token_ids == std::vector<int32_t>{5, 6, 7});
  CHECK(m.fed == std::vector<int32_t>{1, 2, 9, 5, 6});  // prompt via the prefill, then decode

  // stepwise_prefill: the same run feeds the prompt token by token, never calling prefill().
  ScriptedModel m2{{3, 4, 5, 6, 7, 8}};
  auto step = greedy(3);
  step.stepwise_prefill = true;
  const auto r2 = fn::generate(m2, coll, prompt, step);
  CHECK(m2.prefilled.empty());
  CHECK(r2.token_ids == r.token_ids);
  CHECK(m2.fed == m.fed);

  // A backend with a device loop: the prefill takes prompt[0 .. n-2] without logits, the last
  // prompt token starts decode(); the same ids.
  ScriptedModel m3{{3, 4, 5, 6, 7, 8}, true};
  CHECK(fn::samples_on_device(m3, greedy(3)));
  const auto r3 = fn::generate(m3, coll, prompt, greedy(3));
  REQUIRE(m3.prefilled.size() == 1);
  CHECK(m3.prefilled[0] == std::vector<int32_t>{1, 2});
  CHECK(m3.prefill_outputs[0] == fn::PrefillOutput::None);
  CHECK(m3.decode_firsts == std::vector<int32_t>{9});
  CHECK(r3.token_ids == r.token_ids);
  CHECK(r3.finish == fn::FinishReason::Length);
  CHECK(r3.itl_ms.size() == 2);

  // A one-token prompt has nothing to prefill before decoding starts.
  ScriptedModel m4{{3, 4, 5, 6, 7, 8}, true};
  const std::vector<int32_t> one = {1};
  const auto r4 = fn::generate(m4, coll, one, greedy(2));
  CHECK(m4.prefilled.empty());
  CHECK(m4.decode_firsts == std::vector<int32_t>{1});
  CHECK(r4.token_ids == std::vector<int32_t>{3, 4});
}

TEST_CASE(
    "generate: penalties and stop strings sample on the device; only host_sampling keeps a "
    "device-capable backend on the host sampler") {
  fn::LocalCollectives coll;
  const std::vector<int32_t> prompt = {1, 2};
  CHECK(fn::device_sampling_supported(greedy(3)));
  for (int which = 0; which < 4; ++which) {
    CAPTURE(which);
    auto d = greedy(3);
    if (which == 0) d.sampling.repetition_penalty = 1.1;
    if (which == 1) d.sampling.presence_penalty = 0.5;
    if (which == 2) d.sampling.frequency_penalty = 0.5;
    if (which == 3) d.stop_strings = {"zz"};
    CHECK(fn::device_sampling_supported(d));
    ScriptedModel m{{3, 4, 5, 6}, true};
    CHECK(fn::samples_on_device(m, d));
    FakeText t{{{4, "a"}, {5, "x"}, {6, "b"}}};
    const auto r = fn::generate(m, coll, prompt, d, t.hooks());
    CHECK(m.decode_firsts == std::vector<int32_t>{2});
    REQUIRE(m.decode_histories.size() == 1);
    CHECK(m.decode_histories[0] == prompt);  // the whole prompt starts the penalty window
    CHECK(r.token_ids == std::vector<int32_t>{4, 5, 6});
    CHECK(r.text == "axb");
  }
  auto h = greedy(3);
  h.host_sampling = true;
  h.sampling.repetition_penalty = 1.1;
  h.stop_strings = {"zz"};
  CHECK_FALSE(fn::device_sampling_supported(h));
  ScriptedModel m{{3, 4, 5, 6}, true};
  CHECK_FALSE(fn::samples_on_device(m, h));
  FakeText t{{{4, "a"}, {5, "x"}, {6, "b"}}};
  const auto r = fn::generate(m, coll, prompt, h, t.hooks());
  CHECK(m.decode_firsts.empty());  // decode() never ran
  REQUIRE(m.prefilled.size() == 1);
  CHECK(m.prefilled[0] == prompt);  // the whole prompt, its last logits sampled on the host
  CHECK(r.token_ids == std::vector<int32_t>{4, 5, 6});
}

TEST_CASE(
    "generate: on the device path a stop string ends the ids at the token that completes it, "
    "the text cut as on the host path") {
  fn::LocalCollectives coll;
  const std::vector<int32_t> prompt = {1, 2};
  // "x" then "yz": the stop string "xy" spans two tokens and completes on id 6.
  const std::map<int32_t, std::string> pieces = {{4, "a"}, {5, "x"}, {6, "yz"}, {7, "b"}};
  for (const bool device : {false, true}) {
    CAPTURE(device);
    auto o = greedy(4);
    o.stop_strings = {"xy"};
    ScriptedModel m{{3, 4, 5, 6, 7, 8}, true};
    o.host_sampling = !device;
    FakeText t{pieces};
    const auto r = fn::generate(m, coll, prompt, o, t.hooks());
    CHECK(m.decode_firsts.size() == (device ? 1u : 0u));
    CHECK(r.finish == fn::FinishReason::Stop);
    CHECK(r.token_ids == std::vector<int32_t>{4, 5, 6});  // nothing after the stop's last id
    // The device path ran a step ahead: it fed 6 (and computed 7), yet 7 was never reported.
    CHECK(m.fed ==
          (device ? std::vector<int32_t>{1, 2, 4, 5, 6} : std::vector<int32_t>{1, 2, 4, 5}));
    CHECK(r.text == "a");
    CHECK(t.joined() == "a");  // the stop string and what follows it never streamed
  }
  // Without hooks.feed on rank 0 a stop string cannot be matched, on either path.
  for (const bool device : {false, true}) {
    auto o = greedy(3);
    o.stop_strings = {"x"};
    o.host_sampling = !device;
    ScriptedModel m{{3, 4, 5, 6}, true};
    CHECK_THROWS_AS(fn::generate(m, coll, prompt, o), fn::Error);
    CHECK(m.prefilled.empty());
  }
}

TEST_CASE("token_logprobs: hand-computed log-softmax, the K largest with ties to the lower id") {
  // logits {1, 3, 3, 0}: lse = log(e + 2 e^3 + 1).
  const std::vector<float> l = {1.0f, 3.0f, 3.0f, 0.0f};
  const double lse = std::log(std::exp(1.0) + 2.0 * std::exp(3.0) + 1.0);
  const fn::TokenLogprobs t = fn::token_logprobs(l, 3, 3);
  CHECK(t.logprob == doctest::Approx(0.0 - lse).epsilon(1e-15));
  CHECK(t.top_ids == std::vector<int32_t>{1, 2, 0});
  REQUIRE(t.top_logprobs.size() == 3);
  CHECK(t.top_logprobs[0] == doctest::Approx(3.0 - lse).epsilon(1e-15));
  CHECK(t.top_logprobs[1] == t.top_logprobs[0]);
  CHECK(t.top_logprobs[2] == doctest::Approx(1.0 - lse).epsilon(1e-15));
  const fn::TokenLogprobs none = fn::token_logprobs(l, 1, 0);
  CHECK(none.top_ids.empty());
  CHECK(none.logprob == doctest::Approx(3.0 - lse).epsilon(1e-15));
  // k past the row or past kMaxTopLogprobs, a chosen id outside the row: the caller's bug.
  CHECK_THROWS_AS(fn::token_logprobs(l, 0, 5), fn::Error);
  const std::vector<float> wide(64, 0.5f);
  CHECK(fn::token_logprobs(wide, 63, fn::kMaxTopLogprobs).top_ids.size() == 20);
  CHECK_THROWS_AS(fn::token_logprobs(wide, 0, fn::kMaxTopLogprobs + 1), fn::Error);
  CHECK_THROWS_AS(fn::token_logprobs(l, 4, 1), fn::Error);
  // A non-finite logit is the checkpoint's fault (Format), as in eval.
  const std::vector<float> bad = {0.0f, std::nanf(""), 1.0f};
  try {
    fn::token_logprobs(bad, 0, 1);
    FAIL("no throw");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
  }
}

TEST_CASE(
    "generate --logprobs: the host path reduces each sampled row, the device path asks decode") {
  fn::LocalCollectives coll;
  auto o = greedy(3);
  o.top_logprobs = 2;
  {
    ScriptedModel m({5, 9, 4, 11});
    const auto r = fn::generate(m, coll, std::vector<int32_t>{1}, o);
    REQUIRE(r.token_ids == std::vector<int32_t>{5, 9, 4});
    REQUIRE(r.logprobs.size() == 3);
    // Each row is 1 at the scripted id, 0 at the other 15: lse = log(e + 15).
    const double lse = std::log(std::exp(1.0) + 15.0);
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(r.logprobs[i].logprob == doctest::Approx(1.0 - lse).epsilon(1e-15));
      CHECK(r.logprobs[i].top_ids[0] == r.token_ids[i]);
      CHECK(r.logprobs[i].top_ids[1] == (r.token_ids[i] == 0 ? 1 : 0));  // ties: the lowest id
      CHECK(r.logprobs[i].top_logprobs[1] == doctest::Approx(-lse).epsilon(1e-15));
    }
  }
  {
    ScriptedModel m({5, 9, 4, 11}, true);
    const auto r = fn::generate(m, coll, std::vector<int32_t>{1}, o);
    CHECK(m.decode_top_logprobs == std::vector<int64_t>{2});
    REQUIRE(r.logprobs.size() == 3);
    CHECK(r.logprobs[2].logprob == -102.0);  // what decode() appended, in order
  }
  {
    ScriptedModel m({5, 9, 4, 11}, true);
    const auto r = fn::generate(m, coll, std::vector<int32_t>{1}, greedy(3));
    CHECK(m.decode_top_logprobs == std::vector<int64_t>{-1});
    CHECK(r.logprobs.empty());
  }
  ScriptedModel m({5});
  o.top_logprobs = fn::kMaxTopLogprobs + 1;
  CHECK_THROWS_WITH_AS(fn::generate(m, coll, std::vector<int32_t>{1}, o),
                       doctest::Contains("--logprobs must be in [0, 20]"), fn::Error);
  CHECK(m.fed.empty());  // refused before any model call
}

TEST_CASE("generate --logprobs on the fixtures: the transformers reference's log-softmax") {
  for (const char* name : {"tp4", "g3_tiny"}) {
    CAPTURE(name);
    const auto f = fn::test::load_ref_fixture(name);
    fn::LocalCollectives coll;
    fn::CpuBackend model(fn::CpuModel::load(f.dir, coll), 0.0);
    auto o = greedy(16);
    o.ignore_eos = true;
    o.ctx_size = 4096;
    o.top_logprobs = 5;
    const auto r = fn::generate(model, coll, f.prompt_ids, o);
    REQUIRE(r.logprobs.size() == 16);
    for (std::size_t i = 0; i < 16; ++i) {
      CAPTURE(i);
      // The reference row this token was chosen from, its log-softmax in double.
      const float* row = f.row(f.prompt_ids.size() - 1 + i);
      double mx = row[0];
      for (int64_t v = 0; v < f.vocab; ++v) mx = std::max(mx, static_cast<double>(row[v]));
      double sum = 0;
      for (int64_t v = 0; v < f.vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
      const double lse = mx + std::log(sum);
      const auto ref = [&](int32_t id) { return static_cast<double>(row[id]) - lse; };
      const fn::TokenLogprobs& t = r.logprobs[i];
      // The CPU backend matches the reference logits to ~1e-6 (docs/numerics.md); a log-prob
      // adds the normaliser's error of the same size.
      CHECK(std::abs(t.logprob - ref(r.token_ids[i])) < 1e-4);
      REQUIRE(t.top_ids.size() == 5);
      std::vector<double> sorted;
      for (int64_t v = 0; v < f.vocab; ++v) sorted.push_back(ref(static_cast<int32_t>(v)));
      std::sort(sorted.rbegin(), sorted.rend());
      for (std::size_t k = 0; k < 5; ++k) {
        CHECK(std::abs(t.top_logprobs[k] - ref(t.top_ids[k])) < 1e-4);
        // The k-th reported value is the reference's k-th largest (ids may swap only within
        // rounding of a tie).
        CHECK(std::abs(t.top_logprobs[k] - sorted[k]) < 1e-4);
      }
    }
  }
}

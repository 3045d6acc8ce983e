// generate() (core/generate.h) over a backend with a device decode loop, checked with a CPU
// emulation of that loop (feed, sample with the settings and the penalty window started from the
// prompt, report one step behind the feeds, feed back) on the reference fixture: the same ids,
// finish reason, counts, penalised ids and stop-string cuts as the host loop over the plain CPU
// backend.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/collectives.h"
#include "core/cpu_backend.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "core/generate.h"
#include "core/sampler.h"
#include "test_cpu_fixture.h"

namespace {

// The CPU backend with what CudaModel::decode does: each step feeds a token and picks the next
// id with the sampling settings (fn::Sampler: the penalties over a window started from
// `history`, each id accepted as it is picked; greedy here), one step ahead of the host as the
// decode graph runs (step i + 1 is fed before id i is reported), hands each id to on_token and
// stops reporting when it says stop.
class EmulatedDevice final : public fn::Backend {
 public:
  explicit EmulatedDevice(fn::CpuBackend& cpu) : fn::Backend(cpu.info()), cpu_(cpu) {}
  int64_t decode_calls = 0;
  std::vector<int32_t> last_history;  // the last decode() call's history

  fn::BackendCapabilities capabilities() const noexcept override {
    fn::BackendCapabilities c;
    c.device_decode = true;
    return c;
  }
  void reset() override { cpu_.reset(); }
  int64_t position() const noexcept override { return cpu_.position(); }
  std::span<const float> forward(int32_t t) override { return cpu_.forward(t); }
  std::span<const float> prefill(std::span<const int32_t> tokens,
                                 fn::PrefillOutput output) override {
    return cpu_.prefill(tokens, output);
  }
  std::vector<int32_t> decode(int32_t first, int64_t count, const fn::SamplingParams& sampling,
                              uint64_t, const std::function<bool(int32_t)>& on_token,
                              int64_t top_logprobs, std::vector<fn::TokenLogprobs>* logprobs,
                              std::span<const int32_t> history) override {
    ++decode_calls;
    last_history.assign(history.begin(), history.end());
    REQUIRE(sampling.temperature <= 0.0);  // greedy: the device's id is the host sampler's
    fn::Sampler sampler(sampling);
    for (int32_t t : history) sampler.accept(t);
    std::vector<int32_t> out;
    struct Picked {
      int32_t id;
      fn::TokenLogprobs lp;
    };
    int32_t t = first;
    const auto step = [&] {
      const auto l = cpu_.forward(t);
      t = sampler.sample(l);
      sampler.accept(t);
      return Picked{
          t, top_logprobs >= 0 ? fn::token_logprobs(l, t, top_logprobs) : fn::TokenLogprobs{}};
    };
    Picked next = count > 0 ? step() : Picked{};
    for (int64_t i = 0; i < count; ++i) {
      const Picked p = next;
      if (i + 1 < count) next = step();  // run ahead
      out.push_back(p.id);
      if (top_logprobs >= 0) logprobs->push_back(p.lp);
      if (!on_token(p.id)) break;
    }
    return out;
  }

 private:
  fn::CpuBackend& cpu_;
};

fn::GenerateOptions greedy(int64_t n) {
  fn::GenerateOptions o;
  o.sampling.temperature = 0.0;
  o.max_new_tokens = n;
  o.ctx_size = 512;
  return o;
}

}  // namespace

TEST_CASE("generate on device: the same ids as the host loop, stop ids and lengths alike") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend cpu(fn::CpuModel::load(f.dir, coll), 0.0);
  EmulatedDevice dev_backend(cpu);

  auto o = greedy(12);
  o.ignore_eos = true;
  CHECK_FALSE(fn::samples_on_device(cpu, o));
  CHECK(fn::samples_on_device(dev_backend, o));
  cpu.reset();
  const auto host = fn::generate(cpu, coll, f.prompt_ids, o);
  dev_backend.reset();
  const auto dev = fn::generate(dev_backend, coll, f.prompt_ids, o);
  CHECK(dev_backend.decode_calls == 1);
  CHECK(dev.token_ids == host.token_ids);
  CHECK(dev.token_ids.size() == 12);
  CHECK(dev.finish == fn::FinishReason::Length);
  CHECK(dev.itl_ms.size() == 11);
  CHECK(dev.n_prompt_tokens == static_cast<int64_t>(f.prompt_ids.size()));
  CHECK(cpu.position() == static_cast<int64_t>(f.prompt_ids.size()) + 11);

  // A stop id: the loop ends on it (kept in the ids), exactly like the host loop.
  o.ignore_eos = false;
  o.stop_token_ids = {host.token_ids[4]};
  cpu.reset();
  const auto host_stop = fn::generate(cpu, coll, f.prompt_ids, o);
  dev_backend.reset();
  const auto dev_stop = fn::generate(dev_backend, coll, f.prompt_ids, o);
  CHECK(dev_backend.decode_calls == 2);
  CHECK(dev_stop.token_ids == host_stop.token_ids);
  CHECK(dev_stop.finish == fn::FinishReason::Eos);
  CHECK(dev_stop.token_ids.back() == host.token_ids[4]);

  // host_sampling on the device-capable backend: the host loop, the same ids again.
  o.host_sampling = true;
  dev_backend.reset();
  const auto forced = fn::generate(dev_backend, coll, f.prompt_ids, o);
  CHECK(dev_backend.decode_calls == 2);
  CHECK(forced.token_ids == host_stop.token_ids);
}

TEST_CASE("generate on device: --logprobs gives the host loop's log-probs, one per token") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend cpu(fn::CpuModel::load(f.dir, coll), 0.0);
  EmulatedDevice dev_backend(cpu);
  auto o = greedy(6);
  o.ignore_eos = true;
  o.top_logprobs = 4;
  cpu.reset();
  const auto host = fn::generate(cpu, coll, f.prompt_ids, o);
  dev_backend.reset();
  const auto dev = fn::generate(dev_backend, coll, f.prompt_ids, o);
  REQUIRE(host.logprobs.size() == 6);
  REQUIRE(dev.logprobs.size() == 6);
  for (std::size_t i = 0; i < 6; ++i) {
    CHECK(dev.logprobs[i].logprob == host.logprobs[i].logprob);
    CHECK(dev.logprobs[i].top_ids == host.logprobs[i].top_ids);
    CHECK(dev.logprobs[i].top_logprobs == host.logprobs[i].top_logprobs);
    CHECK(host.logprobs[i].top_ids.front() == host.token_ids[i]);  // greedy: the best is chosen
  }
}

TEST_CASE(
    "generate on device: penalties over the prompt and the generated ids give the host loop's "
    "ids for every window length") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend cpu(fn::CpuModel::load(f.dir, coll), 0.0);
  EmulatedDevice dev_backend(cpu);
  auto plain = greedy(16);
  plain.ignore_eos = true;
  cpu.reset();
  const auto unpenalised = fn::generate(cpu, coll, f.prompt_ids, plain);
  const auto P = static_cast<int64_t>(f.prompt_ids.size());
  bool changed = false;
  // Off, shorter than the prompt, the prompt alone, longer than prompt + generated, everything.
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{4}, P, int64_t{64}, int64_t{-1}}) {
    CAPTURE(n);
    auto o = plain;
    o.sampling.repetition_penalty = 1.5;
    o.sampling.presence_penalty = 0.75;
    o.sampling.frequency_penalty = 0.5;
    o.sampling.repeat_last_n = n;
    CHECK(fn::samples_on_device(dev_backend, o));
    cpu.reset();
    const auto host = fn::generate(cpu, coll, f.prompt_ids, o);
    dev_backend.reset();
    const int64_t calls = dev_backend.decode_calls;
    const auto dev = fn::generate(dev_backend, coll, f.prompt_ids, o);
    CHECK(dev_backend.decode_calls == calls + 1);
    CHECK(dev_backend.last_history == f.prompt_ids);
    CHECK(dev.token_ids == host.token_ids);
    CHECK(dev.finish == host.finish);
    if (n == 0) CHECK(host.token_ids == unpenalised.token_ids);  // repeat_last_n 0: no penalty
    changed |= host.token_ids != unpenalised.token_ids;
  }
  CHECK(changed);  // the penalties changed the greedy ids somewhere: the comparison has teeth
}

TEST_CASE(
    "generate on device: a stop string spanning two tokens ends the ids and the text as the host "
    "loop does, though the device ran a step ahead") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend cpu(fn::CpuModel::load(f.dir, coll), 0.0);
  EmulatedDevice dev_backend(cpu);
  auto o = greedy(12);
  o.ignore_eos = true;
  std::string streamed;
  fn::TextHooks hooks;
  hooks.feed = [](int32_t id) { return fmt::format("<{}>", id); };  // (GCC 12 warns on "<" + s)
  hooks.emit = [&streamed](std::string_view s) { streamed += s; };
  cpu.reset();
  const auto all = fn::generate(cpu, coll, f.prompt_ids, o);
  REQUIRE(all.token_ids.size() == 12);
  // The end of id 4's text and the start of id 5's.
  o.stop_strings = {std::to_string(all.token_ids[4]) + "><" + std::to_string(all.token_ids[5])};
  streamed.clear();
  cpu.reset();
  const auto host = fn::generate(cpu, coll, f.prompt_ids, o, hooks);
  const std::string host_streamed = streamed;
  REQUIRE(host.finish == fn::FinishReason::Stop);
  REQUIRE(host.token_ids.size() <= 6);
  streamed.clear();
  dev_backend.reset();
  const auto dev = fn::generate(dev_backend, coll, f.prompt_ids, o, hooks);
  CHECK(dev_backend.decode_calls == 1);
  CHECK(dev.finish == fn::FinishReason::Stop);
  CHECK(dev.token_ids == host.token_ids);
  CHECK(dev.text == host.text);
  CHECK(streamed == host_streamed);
  CHECK(dev.text.find(o.stop_strings[0]) == std::string::npos);
  // The step queued ahead fed the stop's last id; no id after it was kept.
  CHECK(cpu.position() == static_cast<int64_t>(f.prompt_ids.size() + dev.token_ids.size()));
}

// generate() (core/generate.h) over a backend with a device decode loop, checked with a CPU
// emulation of that loop (feed, argmax, report, feed back) on the reference fixture: the same
// ids, finish reason and counts as the host loop over the plain CPU backend.
#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "core/collectives.h"
#include "core/cpu_backend.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "core/generate.h"
#include "test_cpu_fixture.h"

namespace {

// The CPU backend with what CudaModel::decode does: each step feeds a token, picks the greedy id
// (lowest id on ties), hands it to on_token and feeds it next unless on_token said stop.
class EmulatedDevice final : public fn::Backend {
 public:
  explicit EmulatedDevice(fn::CpuBackend& cpu) : fn::Backend(cpu.info()), cpu_(cpu) {}
  int64_t decode_calls = 0;

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
  std::vector<int32_t> decode(int32_t first, int64_t count, const fn::SamplingParams&, uint64_t,
                              const std::function<bool(int32_t)>& on_token, int64_t top_logprobs,
                              std::vector<fn::TokenLogprobs>* logprobs) override {
    ++decode_calls;
    std::vector<int32_t> out;
    int32_t t = first;
    for (int64_t i = 0; i < count; ++i) {
      const auto l = cpu_.forward(t);
      const int32_t id = fn::test::argmax(l.data(), static_cast<int64_t>(l.size()));
      out.push_back(id);
      if (top_logprobs >= 0) logprobs->push_back(fn::token_logprobs(l, id, top_logprobs));
      if (!on_token(id)) break;
      t = id;
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

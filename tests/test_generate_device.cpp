// generate_on_device (core/generate.h): the generation loop over a backend's on-device decode
// loop, checked with a CPU emulation of that loop (feed, argmax, report, feed back) on the
// reference fixture: the same ids, finish reason and counts as the host loop generate().
#include <doctest/doctest.h>

#include <vector>

#include "core/collectives.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "core/generate.h"
#include "test_cpu_fixture.h"

namespace {

// What CudaModel::decode does, on the CPU model: each step feeds a token, picks the greedy id
// (lowest id on ties), hands it to on_token and feeds it next unless on_token said stop.
fn::DecodeFn emulated_decode(fn::CpuModel& m) {
  return [&m](int32_t first, int64_t count, const fn::SamplingParams&,
              const std::function<bool(int32_t)>& on_token) {
    std::vector<int32_t> out;
    int32_t t = first;
    for (int64_t i = 0; i < count; ++i) {
      const auto l = m.forward(t);
      const int32_t id = fn::test::argmax(l.data(), static_cast<int64_t>(l.size()));
      out.push_back(id);
      if (!on_token(id)) break;
      t = id;
    }
    return out;
  };
}

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
  auto m = fn::CpuModel::load(f.dir, coll);
  const fn::ForwardFn forward = [&m](int32_t t) { return m->forward(t); };
  const fn::DecodeFn decode = emulated_decode(*m);

  auto o = greedy(12);
  o.ignore_eos = true;
  m->reset();
  const auto host = fn::generate(forward, coll, f.prompt_ids, o);
  m->reset();
  const auto dev = fn::generate_on_device(forward, decode, coll, f.prompt_ids, o);
  CHECK(dev.token_ids == host.token_ids);
  CHECK(dev.token_ids.size() == 12);
  CHECK(dev.finish == fn::FinishReason::Length);
  CHECK(dev.itl_ms.size() == 11);
  CHECK(dev.n_prompt_tokens == static_cast<int64_t>(f.prompt_ids.size()));
  CHECK(m->position() == static_cast<int64_t>(f.prompt_ids.size()) + 11);

  // A stop id: the loop ends on it (kept in the ids), exactly like the host loop.
  o.ignore_eos = false;
  o.stop_token_ids = {host.token_ids[4]};
  m->reset();
  const auto host_stop = fn::generate(forward, coll, f.prompt_ids, o);
  m->reset();
  const auto dev_stop = fn::generate_on_device(forward, decode, coll, f.prompt_ids, o);
  CHECK(dev_stop.token_ids == host_stop.token_ids);
  CHECK(dev_stop.finish == fn::FinishReason::Eos);
  CHECK(dev_stop.token_ids.back() == host.token_ids[4]);
}

TEST_CASE("generate on device: stop strings and penalties need the host sampler") {
  auto o = greedy(4);
  CHECK(fn::device_sampling_supported(o));
  o.stop_strings = {"x"};
  CHECK_FALSE(fn::device_sampling_supported(o));
  o.stop_strings.clear();
  o.sampling.repetition_penalty = 1.1;
  CHECK_FALSE(fn::device_sampling_supported(o));
  fn::LocalCollectives coll;
  const std::vector<int32_t> prompt = {1, 2};
  const fn::ForwardFn forward = [](int32_t) { return std::span<const float>(); };
  const fn::DecodeFn decode = [](int32_t, int64_t, const fn::SamplingParams&,
                                 const std::function<bool(int32_t)>&) {
    return std::vector<int32_t>();
  };
  CHECK_THROWS_WITH_AS(fn::generate_on_device(forward, decode, coll, prompt, o),
                       doctest::Contains("penalty"), fn::Error);
}

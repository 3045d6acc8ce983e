// CudaBackend (cuda/model/cuda_backend.h): CudaModel behind the Backend interface, on the tp4
// reference fixture at TP = 1 (label gpu, one process): its load-time facts and capabilities,
// reset() back to position 0 with the first row reproduced bit for bit, the batched prefill
// against forward() one token at a time (within the CUDA model's tolerance, 2e-2 · max |logit|)
// and against the reference's last prompt row, generate() sampling on the device giving the
// host sampler's greedy ids, and the benchmark probes.
#include <doctest/doctest.h>

#include <memory>
#include <span>
#include <vector>

#include "core/collectives.h"
#include "core/error.h"
#include "core/generate.h"
#include "cuda/model/cuda_backend.h"
#include "cuda/model/cuda_model.h"
#include "test_cpu_fixture.h"

namespace {

constexpr double kRelTol = 2e-2;  // the CUDA model's logits tolerance (BF16 activations)

std::vector<float> copy(std::span<const float> s) {
  return {s.begin(), s.end()};
}

std::unique_ptr<fn::CudaBackend> load(const fn::test::RefFixture& f) {
  fn::CudaModelOptions o;
  o.ctx_size = 256;
  o.use_graph = true;
  return std::make_unique<fn::CudaBackend>(nullptr, nullptr, fn::CudaModel::load(f.dir, o), 1, 7.0,
                                           false);
}

}  // namespace

TEST_CASE("cuda backend: facts, capabilities, reset, prefill against forward, and the probes") {
  const auto f = fn::test::load_ref_fixture("tp4");
  auto b = load(f);
  const fn::BackendInfo& i = b->info();
  CHECK(i.name == "cuda");
  CHECK(i.all_reduce_name.empty());
  CHECK(i.vocab_size == f.vocab);
  CHECK(i.tp_size == 1);
  CHECK(i.load_ms == 7.0);
  CHECK(i.weight_mib > 0.0);
  CHECK(i.weight_mib ==
        static_cast<double>(b->model().load_stats().weight_bytes) / (1024.0 * 1024.0));
  CHECK_FALSE(i.random_weights);
  const fn::BackendCapabilities c = b->capabilities();
  CHECK(c.device_decode);
  CHECK(c.device_memory);
  CHECK(c.graph_captures);
  CHECK(c.set_position);
  CHECK(c.profile);

  const std::span<const int32_t> prompt(f.prompt_ids);
  const auto n = static_cast<int64_t>(prompt.size());
  REQUIRE(n >= 2);
  std::vector<float> first_row, last_row;
  for (int64_t p = 0; p < n; ++p) {
    const auto l = b->forward(prompt[static_cast<std::size_t>(p)]);
    REQUIRE(static_cast<int64_t>(l.size()) == f.vocab);
    if (p == 0) first_row = copy(l);
    if (p == n - 1) last_row = copy(l);
  }
  CHECK(b->position() == n);
  CHECK(b->graph_captures() >= 1);
  CHECK(b->device_used_mib() >= i.weight_mib);

  b->reset();
  CHECK(b->position() == 0);
  CHECK(copy(b->forward(prompt[0])) == first_row);

  b->reset();
  const std::vector<float> pre = copy(b->prefill(prompt, fn::PrefillOutput::Last));
  CHECK(b->position() == n);
  const double scale = fn::test::max_abs(last_row.data(), f.vocab);
  CHECK(fn::test::max_abs_diff(pre.data(), last_row.data(), f.vocab) <= kRelTol * scale);
  const std::size_t last = static_cast<std::size_t>(n - 1);
  const double ref_scale = fn::test::max_abs(f.row(last), f.vocab);
  CHECK(fn::test::max_abs_diff(pre.data(), f.row(last), f.vocab) <= kRelTol * ref_scale);

  b->reset();
  CHECK(b->prefill(prompt.first(last), fn::PrefillOutput::None).empty());
  CHECK(b->position() == n - 1);

  b->reset();
  b->set_position_for_benchmark(5);
  CHECK(b->position() == 5);
  const fn::StepBreakdown s = b->profile_steps(prompt[0], 2, false);
  CHECK(b->position() == 7);
  REQUIRE(s.families.size() == static_cast<std::size_t>(fn::kStepFamilyCount));
  CHECK(s.families.front() == "hc");
  CHECK(s.ms.size() == s.families.size());
  CHECK(s.segments.size() == s.families.size());
  CHECK(s.steps == 2);
  CHECK_FALSE(s.in_graph);
  CHECK(s.step_ms > 0.0);
}

TEST_CASE("cuda backend: generate() samples on the device with the host sampler's greedy ids") {
  const auto f = fn::test::load_ref_fixture("tp4");
  auto b = load(f);
  fn::LocalCollectives coll;
  fn::GenerateOptions o;
  o.sampling.temperature = 0.0;
  o.max_new_tokens = 8;
  o.ctx_size = 256;
  o.ignore_eos = true;
  // Both runs feed the prompt through forward(), so both see the same step's logits.
  o.stepwise_prefill = true;
  CHECK(fn::samples_on_device(*b, o));
  const fn::GenerationResult dev = fn::generate(*b, coll, f.prompt_ids, o);
  b->reset();
  o.host_sampling = true;
  CHECK_FALSE(fn::samples_on_device(*b, o));
  const fn::GenerationResult host = fn::generate(*b, coll, f.prompt_ids, o);
  CHECK(dev.token_ids.size() == 8);
  CHECK(dev.token_ids == host.token_ids);
  CHECK(dev.finish == fn::FinishReason::Length);
  CHECK(dev.itl_ms.size() == 7);
}

TEST_CASE(
    "cuda backend: penalties run in the decode graph over the prompt and the generated ids: the "
    "host sampler's greedy ids for windows shorter and longer than the sequence") {
  const auto f = fn::test::load_ref_fixture("tp4");
  auto b = load(f);
  fn::LocalCollectives coll;
  fn::GenerateOptions o;
  o.sampling.temperature = 0.0;
  o.sampling.repetition_penalty = 1.5;
  o.sampling.presence_penalty = 0.5;
  o.sampling.frequency_penalty = 0.25;
  o.max_new_tokens = 12;
  o.ctx_size = 256;
  o.ignore_eos = true;
  o.stepwise_prefill = true;  // both paths see forward()'s logits for the prompt
  for (const int64_t n : {int64_t{3}, int64_t{64}, int64_t{-1}}) {
    CAPTURE(n);
    o.sampling.repeat_last_n = n;
    o.host_sampling = false;
    CHECK(fn::samples_on_device(*b, o));
    b->reset();
    const fn::GenerationResult dev = fn::generate(*b, coll, f.prompt_ids, o);
    o.host_sampling = true;
    b->reset();
    const fn::GenerationResult host = fn::generate(*b, coll, f.prompt_ids, o);
    CHECK(dev.token_ids.size() == 12);
    CHECK(dev.token_ids == host.token_ids);
  }
}

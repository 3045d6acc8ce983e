// CpuBackend (core/cpu_backend.h): the CPU reference model behind the Backend interface, on the
// tp4 reference fixture at TP = 1: its load-time facts, prefill equal to forward() token by token
// (the same code path, so bitwise) and to the reference rows, reset() back to position 0 with
// the first row reproduced, and no optional capability but the state snapshot.
#include <doctest/doctest.h>

#include <functional>
#include <span>
#include <vector>

#include "core/collectives.h"
#include "core/cpu_backend.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "test_cpu_fixture.h"

namespace {

std::vector<float> copy(std::span<const float> s) {
  return {s.begin(), s.end()};
}

}  // namespace

TEST_CASE("cpu backend: the load-time facts are the model's") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  auto model = fn::CpuModel::load(f.dir, coll);
  const uint64_t weight_bytes = model->weight_bytes();
  REQUIRE(weight_bytes > 0);
  const fn::CpuBackend b(std::move(model), 12.5);
  const fn::BackendInfo& i = b.info();
  CHECK(i.name == "cpu");
  CHECK(i.all_reduce_name.empty());  // TP 1: no all-reduce
  CHECK(i.vocab_size == f.vocab);
  CHECK(i.tp_size == 1);
  CHECK(i.load_ms == 12.5);
  CHECK(i.weight_mib == static_cast<double>(weight_bytes) / (1024.0 * 1024.0));
  CHECK_FALSE(i.random_weights);
  CHECK(b.position() == 0);
  CHECK_THROWS_AS(fn::CpuBackend(nullptr, 0.0), fn::Error);
}

TEST_CASE(
    "cpu backend: prefill equals forward one token at a time, and reset restores position 0") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend b(fn::CpuModel::load(f.dir, coll), 0.0);
  const std::span<const int32_t> prompt(f.prompt_ids);
  const auto n = static_cast<int64_t>(prompt.size());
  REQUIRE(n >= 2);

  // Forward one by one: every row, the first and the last kept.
  std::vector<float> first_row, last_row;
  for (int64_t p = 0; p < n; ++p) {
    const auto l = b.forward(prompt[static_cast<std::size_t>(p)]);
    REQUIRE(static_cast<int64_t>(l.size()) == f.vocab);
    if (p == 0) first_row = copy(l);
    if (p == n - 1) last_row = copy(l);
  }
  CHECK(b.position() == n);

  // reset(): position 0, and the first token gives the first row again, bit for bit.
  b.reset();
  CHECK(b.position() == 0);
  const std::vector<float> again = copy(b.forward(prompt[0]));
  CHECK(again == first_row);
  const double scale0 = fn::test::max_abs(first_row.data(), f.vocab);
  CHECK(fn::test::max_abs_diff(again.data(), f.row(0), f.vocab) <= 1e-4 * scale0);

  // prefill(Last) from position 0: the last row of the one-by-one run, bit for bit (the CPU
  // prefill is forward() token by token), and the reference's last prompt row.
  b.reset();
  const std::vector<float> pre = copy(b.prefill(prompt, fn::PrefillOutput::Last));
  CHECK(b.position() == n);
  CHECK(pre == last_row);
  const double scale = fn::test::max_abs(last_row.data(), f.vocab);
  CHECK(fn::test::max_abs_diff(pre.data(), f.row(static_cast<std::size_t>(n - 1)), f.vocab) <=
        1e-4 * scale);

  // prefill(None): no logits, the same states: the next forward gives the next reference row.
  b.reset();
  CHECK(b.prefill(prompt.first(static_cast<std::size_t>(n - 1)), fn::PrefillOutput::None).empty());
  CHECK(b.position() == n - 1);
  CHECK(copy(b.forward(prompt.back())) == last_row);

  // An empty prefill is a usage error.
  try {
    b.prefill({}, fn::PrefillOutput::Last);
    FAIL("no error");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Usage);
  }
}

TEST_CASE(
    "cpu backend: only the snapshot capability, and each other optional call is an internal "
    "error") {
  const auto f = fn::test::load_ref_fixture("tp4");
  fn::LocalCollectives coll;
  fn::CpuBackend b(fn::CpuModel::load(f.dir, coll), 0.0);
  const fn::BackendCapabilities c = b.capabilities();
  CHECK_FALSE(c.device_decode);
  CHECK_FALSE(c.device_memory);
  CHECK_FALSE(c.graph_captures);
  CHECK_FALSE(c.set_position);
  CHECK_FALSE(c.profile);
  CHECK(c.snapshot);
  auto kind = [](const std::function<void()>& call) {
    try {
      call();
    } catch (const fn::Error& e) {
      return e.kind();
    }
    return fn::ErrorKind::Usage;  // "did not throw" reads as a mismatch below
  };
  CHECK(kind([&] {
          b.decode(1, 2, fn::SamplingParams{}, 0, [](int32_t) { return true; }, -1, nullptr, {});
        }) == fn::ErrorKind::Internal);
  CHECK(kind([&] { (void)b.device_used_mib(); }) == fn::ErrorKind::Internal);
  CHECK(kind([&] { (void)b.graph_captures(); }) == fn::ErrorKind::Internal);
  CHECK(kind([&] { b.set_position_for_benchmark(3); }) == fn::ErrorKind::Internal);
  CHECK(kind([&] { (void)b.profile_steps(1, 2, false); }) == fn::ErrorKind::Internal);
  CHECK(b.position() == 0);  // none of them ran a token
}

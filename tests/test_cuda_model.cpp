// CudaModel (cuda/model/cuda_model.h) against the transformers FP32 reference fixtures,
// teacher-forced: on the GPU machine with mpirun -np 2 (one GPU per rank) every fixture at TP=1
// (each rank alone) and TP = world size (2, or 4 on a 4-GPU machine); max |logit - ref| <= 2e-2 *
// max |ref| at every row; argmax equal to the reference's wherever the reference's top-1 margin
// exceeds that tolerance; graph replay bitwise equal to the eager step; all ranks bitwise equal at
// TP > 1; the on-device greedy decode loop reproduces the host-side argmax chain; free-running
// greedy generation matches the reference's tokens up to its first low-margin step.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/custom_all_reduce.h"
#include "comm/device_all_reduce.h"
#include "comm/gpu_comm.h"
#include "comm/mpi_check.h"
#include "comm/mpi_collectives.h"
#include "core/choice_check.h"
#include "core/collectives.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "cuda/common/cuda_check.h"
#include "cuda/model/cuda_model.h"
#include "cuda/model/cuda_model_testing.h"
#include "cuda/model/kernel_plan.h"
#include "cuda_model_check.h"
#include "test_cpu_fixture.h"

using fn::test::check_rows;
using fn::test::cpu_run;
using fn::test::CpuRun;
using fn::test::kRelTol;
using fn::test::margin;
using fn::test::RefFixture;
using fn::test::RowCheck;
using fn::test::run_rows;
using fn::test::run_rows_replayed;

namespace {

const char* const kFixtures[] = {"g3_tiny", "tp4", "ple2_long"};

fn::CudaModelOptions options(int rank, int size, fn::DeviceAllReduce* ar, bool graph) {
  fn::CudaModelOptions o;
  o.ctx_size = 256;
  o.use_graph = graph;
  o.tp_rank = rank;
  o.tp_size = size;
  o.all_reduce = ar;
  return o;
}

}  // namespace

TEST_CASE("cuda model: TP=1 matches the transformers reference on every fixture, teacher-forced") {
  fn::test::use_gpu_of_rank();
  for (const std::string name : kFixtures) {
    CAPTURE(name);
    const RefFixture f = fn::test::load_ref_fixture(name);
    const CpuRun cpu = cpu_run(f);
    {  // the acceptance check: every row, with the reference's discrete choices replayed
      fn::CudaModelTestOptions test;
      test.replay_choices = true;
      auto replay = fn::CudaModelTesting::load(f.dir, options(0, 1, nullptr, true), test);
      const RowCheck rc = check_rows(f, run_rows_replayed(*replay, f, cpu), cpu.ill);
      MESSAGE(name << " TP=1, choices replayed: worst |diff| / (2e-2 max|ref|) = " << rc.worst_ratio
                   << " over " << f.tokens.size() - static_cast<std::size_t>(rc.tie_rows)
                   << " rows; " << rc.tie_rows << " ill-conditioned rows reported (worst "
                   << rc.worst_tie_ratio << "); per row (* = ill-conditioned):" << rc.per_row);
      CHECK(rc.worst_ratio <= 1.0);
      CHECK(rc.argmax_mismatch == 0);
    }
    // Free-running choices: reported (a BF16 engine may flip a near-tie choice, and the flip
    // then lives on in the KV cache and the GDN state for a few positions).
    auto graph = fn::CudaModel::load(f.dir, options(0, 1, nullptr, true));
    const std::vector<float> g = run_rows(*graph, f);
    const RowCheck rc = check_rows(f, g, cpu.tie_or_ill);
    MESSAGE(name << " TP=1, own choices: per-row |diff|/tol (* = near-tie or ill-conditioned):"
                 << rc.per_row);
    MESSAGE(name << " TP=1, own choices: worst " << rc.worst_ratio
                 << " away from near-tie/ill-conditioned rows, " << rc.worst_tie_ratio << " at the "
                 << rc.tie_rows << " such rows; argmax flips where the reference margin > tol: "
                 << rc.argmax_mismatch << ", near-tie argmax flips " << rc.near_ties);
    CHECK(rc.argmax_mismatch == 0);

    // Eager (--no-graph) gives the replayed graph's logits bit for bit.
    auto eager = fn::CudaModel::load(f.dir, options(0, 1, nullptr, false));
    const std::vector<float> e = run_rows(*eager, f);
    REQUIRE(e.size() == g.size());
    CHECK(std::memcmp(e.data(), g.data(), g.size() * sizeof(float)) == 0);

    // reset() then the same sequence: bitwise the same again (states really cleared).
    graph->reset();
    const std::vector<float> again = run_rows(*graph, f);
    CHECK(std::memcmp(again.data(), g.data(), g.size() * sizeof(float)) == 0);

    // On-device greedy decode == the host argmax chain over forward(); and it reproduces the
    // reference's greedy tokens up to the reference's first step with margin below tolerance.
    const std::size_t P = f.prompt_ids.size();
    const int64_t steps = static_cast<int64_t>(f.generated_ids.size()) - 1;
    graph->reset();
    for (std::size_t i = 0; i + 1 < P; ++i) graph->forward(f.prompt_ids[i]);
    fn::SamplingParams greedy;
    greedy.temperature = 0;
    const std::vector<int32_t> dev =
        graph->decode(f.prompt_ids[P - 1], steps, greedy, 0, [](int32_t) { return true; });
    REQUIRE(static_cast<int64_t>(dev.size()) == steps);
    eager->reset();
    std::vector<int32_t> host;
    std::span<const float> l;
    for (std::size_t i = 0; i < P; ++i) l = eager->forward(f.prompt_ids[i]);
    for (int64_t s = 0; s < steps; ++s) {
      const int32_t id = fn::test::argmax(l.data(), f.vocab);
      host.push_back(id);
      l = eager->forward(id);
    }
    CHECK(dev == host);

    // A stop from on_token after step k: decode() returns ids 0..k; the step queued ahead has
    // fed the stop id (position P + k + 1) and the next id to feed is host[k + 1]. The states
    // match position(): the rest of the chain continues bit for bit.
    if (steps >= 4) {
      const int64_t k = 1;
      auto m = fn::CudaModel::load(f.dir, options(0, 1, nullptr, true));
      for (std::size_t i = 0; i + 1 < P; ++i) m->forward(f.prompt_ids[i]);
      int64_t seen = 0;
      const std::vector<int32_t> head =
          m->decode(f.prompt_ids[P - 1], steps, greedy, 0, [&](int32_t) { return seen++ < k; });
      REQUIRE(static_cast<int64_t>(head.size()) == k + 1);
      CHECK(std::equal(head.begin(), head.end(), host.begin()));
      const int64_t fed = k + 2;  // decode steps that ran
      CHECK(m->position() == static_cast<int64_t>(P) - 1 + fed);
      const std::vector<int32_t> tail =
          m->decode(host[static_cast<std::size_t>(fed - 1)], steps - fed, greedy, 0,
                    [](int32_t) { return true; });
      CHECK(std::equal(tail.begin(), tail.end(), host.begin() + fed, host.end()));
      CHECK(m->position() == static_cast<int64_t>(P) - 1 + steps);
    }
    // Eagerly (no graph) decode() runs one step at a time: the stop id is not fed.
    if (steps >= 4) {
      const int64_t k = 1;
      auto m = fn::CudaModel::load(f.dir, options(0, 1, nullptr, false));
      for (std::size_t i = 0; i + 1 < P; ++i) m->forward(f.prompt_ids[i]);
      int64_t seen = 0;
      const std::vector<int32_t> head =
          m->decode(f.prompt_ids[P - 1], steps, greedy, 0, [&](int32_t) { return seen++ < k; });
      REQUIRE(static_cast<int64_t>(head.size()) == k + 1);
      CHECK(std::equal(head.begin(), head.end(), host.begin()));
      CHECK(m->position() == static_cast<int64_t>(P) - 1 + k + 1);
    }
    int64_t agree = 0;
    for (int64_t s = 0; s < steps; ++s) {
      const float* ref = f.row(P - 1 + static_cast<std::size_t>(s));
      const double tol = kRelTol * fn::test::max_abs(ref, f.vocab);
      if (margin(ref, f.vocab) <= tol) break;  // the reference itself is within rounding here
      CHECK_MESSAGE(
          dev[static_cast<std::size_t>(s)] == f.generated_ids[static_cast<std::size_t>(s)],
          "greedy step " << s);
      if (dev[static_cast<std::size_t>(s)] != f.generated_ids[static_cast<std::size_t>(s)]) break;
      ++agree;
    }
    MESSAGE(name << ": free-running greedy agrees with the reference for " << agree << " of "
                 << steps << " steps (up to the first low-margin step)");
  }
}

TEST_CASE("cuda model: per-layer residual drift against the CPU model (diagnostic report)") {
  int rank = 0;
  fn::test::mpi_world(&rank);
  if (rank != 0) return;
  for (const std::string name : kFixtures) {
    const RefFixture f = fn::test::load_ref_fixture(name);
    fn::LocalCollectives coll;
    auto cpu = fn::CpuModel::load(f.dir, coll);
    fn::CudaModelTestOptions test;
    test.replay_choices = true;
    test.keep_residuals = true;
    auto gpu = fn::CudaModelTesting::load(f.dir, options(0, 1, nullptr, false), test);
    std::string report;
    for (std::size_t p = 0; p < f.tokens.size(); ++p) {
      cpu->forward(f.tokens[p]);
      fn::CudaModelTesting::set_forced_choices(*gpu, cpu->last_choices().router,
                                               cpu->last_choices().indexer);
      gpu->forward(f.tokens[p]);
      const auto hc = cpu->last_residuals();
      const auto hg = fn::CudaModelTesting::debug_residuals(*gpu);
      REQUIRE(hc.size() == hg.size());
      report += fmt::format("\n  row {:2}:", p);
      for (std::size_t i = 0; i < hc.size(); ++i) {
        const double scale = fn::test::max_abs(hc[i].data(), static_cast<int64_t>(hc[i].size()));
        const double d =
            fn::test::max_abs_diff(hc[i].data(), hg[i].data(), static_cast<int64_t>(hc[i].size()));
        report += fmt::format(" {:.4f}", d / scale);
      }
    }
    MESSAGE(name << ": max|H_cuda - H_cpu| / max|H_cpu| after each inject (mixer, MoE per "
                 << "layer):" << report);
  }
}

TEST_CASE("cuda model: TP = world size matches the reference and all ranks agree bitwise") {
  int rank = 0;
  const int n = fn::test::mpi_world(&rank);
  if (n < 2) {
    MESSAGE("TP > 1 needs mpirun -np 2 or 4 (one GPU per rank); this run has " << n << " rank(s)");
    return;
  }
  int ran = 0;
  fn::GpuComm gpu(fn::gpu_group_of_world());
  cudaStream_t stream = nullptr;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto ar =
      fn::make_device_all_reduce(fn::AllReduceStrategy::Auto, gpu, fn::CustomAllReduceOptions{});
  for (const std::string name : kFixtures) {
    CAPTURE(name);
    const RefFixture f = fn::test::load_ref_fixture(name);
    const CpuRun cpu = cpu_run(f);
    auto o = options(rank, n, ar.get(), true);
    o.stream = stream;
    fn::CudaModelTestOptions replay;
    replay.replay_choices = true;
    std::unique_ptr<fn::CudaModel> model;
    try {
      model = fn::CudaModelTesting::load(f.dir, o, replay);
    } catch (const fn::Error& e) {  // the shard plan's Usage error, alike on every rank
      if (e.kind() != fn::ErrorKind::Usage) throw;
      MESSAGE(name << ": TP=" << n << " does not divide this model: " << e.what());
      continue;
    }
    ++ran;
    const std::vector<float> g = run_rows_replayed(*model, f, cpu);
    const RowCheck rc = check_rows(f, g, cpu.ill);
    MESSAGE(name << " TP=" << n << " (" << std::string(ar->name())
                 << "), choices replayed: worst |diff| / (2e-2 "
                 << "max|ref|) = " << rc.worst_ratio << " over " << f.tokens.size() - rc.tie_rows
                 << " rows; " << rc.tie_rows << " ill-conditioned rows reported (worst "
                 << rc.worst_tie_ratio << ")");
    CHECK(rc.worst_ratio <= 1.0);
    CHECK(rc.argmax_mismatch == 0);
    std::vector<float> root = g;
    FN_MPI_CHECK(
        MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD));
    CHECK(std::memcmp(root.data(), g.data(), g.size() * sizeof(float)) == 0);

    o.use_graph = false;
    auto eager = fn::CudaModelTesting::load(f.dir, o, replay);
    const std::vector<float> e = run_rows_replayed(*eager, f, cpu);
    CHECK(std::memcmp(e.data(), g.data(), g.size() * sizeof(float)) == 0);
    eager.reset();
    model.reset();

    // The engine's own router and indexer choices are the same on both ranks: the logits of a
    // free-running teacher-forced pass are bitwise equal.
    o.use_graph = true;
    auto own = fn::CudaModel::load(f.dir, o);
    const std::vector<float> mine = run_rows(*own, f);
    std::vector<float> theirs = mine;
    FN_MPI_CHECK(
        MPI_Bcast(theirs.data(), static_cast<int>(theirs.size()), MPI_FLOAT, 0, MPI_COMM_WORLD));
    CHECK(std::memcmp(theirs.data(), mine.data(), mine.size() * sizeof(float)) == 0);
    own.reset();

    // The debug mode of --check-choices: the step's expert ids and indexer blocks, hashed and
    // compared across the ranks after every step (core/choice_check.h), equal at every step.
    o.record_choices = true;
    auto checked = fn::CudaModel::load(f.dir, o);
    fn::MpiCollectives coll(MPI_COMM_WORLD);
    int64_t checked_steps = 0;
    for (std::size_t i = 0; i < f.tokens.size(); ++i) {
      checked->forward(f.tokens[i]);
      const fn::StepChoices c = checked->last_choices();
      REQUIRE(static_cast<int64_t>(c.router.size()) == checked->config().num_hidden_layers);
      for (const auto& ids : c.router)
        REQUIRE(static_cast<int64_t>(ids.size()) == checked->config().num_experts_per_tok);
      CHECK_NOTHROW(fn::require_same_choices(coll, fn::hash_choices(c.router, c.indexer),
                                             static_cast<int64_t>(i)));
      ++checked_steps;
    }
    CHECK(checked_steps == static_cast<int64_t>(f.tokens.size()));
  }
  CHECK(ran >= 1);  // tp4 divides at TP 2 and 4; g3_tiny and ple2_long at TP 2
  FN_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda model: bad input is a clear error") {
  fn::test::use_gpu_of_rank();
  const RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  auto o = options(0, 1, nullptr, true);
  o.ctx_size = 4;
  auto m = fn::CudaModel::load(f.dir, o);
  CHECK_THROWS_WITH_AS(m->forward(static_cast<int32_t>(f.vocab)),
                       doctest::Contains("outside the vocabulary"), fn::Error);
  CHECK_THROWS_WITH_AS(m->forward(-1), doctest::Contains("outside the vocabulary"), fn::Error);
  for (int i = 0; i < 4; ++i) m->forward(1);
  CHECK_THROWS_WITH_AS(m->forward(1), doctest::Contains("-c/--ctx-size"), fn::Error);
  CHECK_THROWS_WITH_AS(m->last_choices(), doctest::Contains("record_choices"), fn::Error);
  o.ctx_size = 1 << 30;
  CHECK_THROWS_WITH_AS(fn::CudaModel::load(f.dir, o), doctest::Contains("max_position_embeddings"),
                       fn::Error);
  // A shared expert of 12 rows (not a multiple of 8, which its down launch needs): refused at
  // load, naming the field, before anything is allocated.
  fn::ModelConfig odd = fn::load_model_config(f.dir + "/config.json");
  odd.shared_expert_intermediate_size = 12;
  try {
    fn::CudaModel::random(odd, fn::load_quant_config(f.dir), 1, options(0, 1, nullptr, true));
    FAIL("a shared expert of 12 rows loaded");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
    CHECK(std::string(e.what()).find("shared_expert_intermediate_size 12") != std::string::npos);
  }
}

TEST_CASE("kernel plan: the device and the shapes at each rank decide each variant") {
  fn::test::use_gpu_of_rank();
  int device = 0, major = 0;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  FN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  const fn::ModelConfig real =
      fn::load_model_config(FN_SOURCE_DIR "/configs/qwen3.8-flash-next.json");
  // TP=1: every real-shape instance; on sm_90+ the bulk gate+up (hidden 2560 = 10 x 256) and the
  // GDN clusters; the HC inject launched alone (no all-reduce before the next read).
  const fn::KernelPlan p1 = fn::plan_kernels(real, 1);
  CHECK(p1.compute_capability / 10 == major);
  CHECK(p1.hc_down_fixed);
  CHECK(p1.hc_mix_fixed);
  CHECK(p1.gdn_fixed);
  CHECK(p1.moe_down_fixed);
  CHECK(p1.router_fixed);
  CHECK(p1.moe_gate_up_bulk == (major >= 9));
  CHECK(p1.gdn_cluster == (major >= 9));
  CHECK_FALSE(p1.fold_hc_inject);
  // TP=2: 320 expert rows per rank are not the down kernel's compile-time 640; the inject folds.
  const fn::KernelPlan p2 = fn::plan_kernels(real, 2);
  CHECK_FALSE(p2.moe_down_fixed);
  CHECK(p2.hc_down_fixed);
  CHECK(p2.router_fixed);
  CHECK(p2.fold_hc_inject);
  // The tiny fixture (hidden 64, 8 experts, GDN heads of 16): the runtime-shape instances, the
  // FP32 gate+up (hidden not a multiple of 256) and the arrival counters.
  const fn::ModelConfig tiny =
      fn::load_model_config(FN_TEST_DATA_DIR "/fixtures/g3_tiny/config.json");
  const fn::KernelPlan pt = fn::plan_kernels(tiny, 1);
  CHECK_FALSE(pt.hc_down_fixed);
  CHECK_FALSE(pt.hc_mix_fixed);
  CHECK_FALSE(pt.gdn_fixed);
  CHECK_FALSE(pt.moe_down_fixed);
  CHECK_FALSE(pt.router_fixed);
  CHECK_FALSE(pt.moe_gate_up_bulk);
  CHECK_FALSE(pt.gdn_cluster);
  CHECK(fn::describe_kernel_plan(p1).find(fmt::format("sm_{}", p1.compute_capability)) == 0);
}

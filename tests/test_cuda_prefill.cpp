// CudaModel::prefill against token-by-token forward() on the same engine: on
// the GPU machine with mpirun -np 2 (one GPU per rank). For prompt lengths {1 .. 8192} and pass
// sizes {whole, 512, 17}: the logits at every prompt position and for 16 teacher-forced decode
// steps after the prefill agree with the token-by-token run within the CUDA tolerance (argmax
// equal wherever the margin exceeds it). The 16 decode steps read every state prefill leaves
// (GDN state and conv context, KV + indexer caches, PLE conv history, n-gram context, position).
// Random in-memory weights of a tiny fixture's config (max_position_embeddings raised); the
// fixtures' own prompts and checkpoints too; TP=1 on each rank and TP=2 across the two.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/custom_all_reduce.h"
#include "comm/device_all_reduce.h"
#include "comm/gpu_comm.h"
#include "comm/mpi_check.h"
#include "core/config.h"
#include "core/error.h"
#include "core/flops.h"
#include "cuda/common/cuda_check.h"
#include "cuda/model/cuda_model.h"
#include "cuda/model/cuda_model_testing.h"
#include "cuda_model_check.h"
#include "test_cpu_fixture.h"

using fn::test::argmax;
using fn::test::kRelTol;
using fn::test::margin;
using fn::test::max_abs;
using fn::test::max_abs_diff;

namespace {

// The prompt lengths: the QSA dense/selected boundary sits at n = 2051 tokens (B = 512
// blocks of 4 at the real budget of 2048, which the test config takes), 4096 and 8192 the long
// cases.
const int64_t kLengths[] = {1,    2,    3,    4,    5,    63,   64,   65,  2047,
                            2048, 2049, 2050, 2051, 2052, 2053, 4096, 8192};
constexpr int64_t kDecodeSteps = 16;
constexpr int64_t kWhole = 8192;
const int64_t kChunks[] = {kWhole, 512, 17};

// A fixture's config with max_position_embeddings raised to `max_pos` (the fixtures stop at
// 1024) and the real indexer budget (2048 tokens: 512 blocks), parsed as load_model_config would.
fn::ModelConfig raised_config(const std::string& fixture, int64_t max_pos) {
  const std::string path = std::string(FN_TEST_DATA_DIR) + "/fixtures/" + fixture + "/config.json";
  std::ifstream in(path);
  REQUIRE(in.good());
  nlohmann::json j = nlohmann::json::parse(in);
  nlohmann::json& t = j.contains("text_config") ? j["text_config"] : j;
  t["max_position_embeddings"] = max_pos;
  t["indexer_budget"] = 2048;
  return fn::parse_model_config(j, path);
}

struct Group {
  std::unique_ptr<fn::GpuComm> gpu;
  std::unique_ptr<fn::DeviceAllReduce> ar;
};

fn::CudaModelOptions options(int rank, int size, fn::DeviceAllReduce* ar, int64_t ctx,
                             int64_t chunk, bool record = false) {
  fn::CudaModelOptions o;
  o.record_choices = record;
  o.ctx_size = ctx;
  o.tp_rank = rank;
  o.tp_size = size;
  o.all_reduce = ar;
  o.prefill_chunk = chunk;
  return o;
}

// Row-by-row comparison of `got` with `ref` ([rows, vocab] both): the worst max|diff| as a
// fraction of kRelTol * max|ref|, rows beyond the tolerance, and argmax mismatches on rows whose
// reference margin exceeds the tolerance.
struct Agreement {
  double worst = 0;
  int64_t bad_rows = 0;
  int64_t argmax_mismatch = 0;
  int64_t first_bad = -1;
};

// Rows the comparison skips: a row whose router or indexer choice differs between the two runs
// (a near tie that summation order decides), and every later row when the differing choice was
// in a layer before the last (its state carries the difference on). Empty: every row.
struct Skip {
  std::vector<bool> row;
  int64_t flipped = 0;  // rows with a different choice
  int64_t skipped = 0;  // rows skipped in all
};

Skip choice_flips(const std::vector<fn::StepChoices>& ref, const std::vector<fn::StepChoices>& got,
                  const fn::ModelConfig& cfg) {
  const int64_t layers = cfg.num_hidden_layers;
  std::vector<int64_t> qsa_layer;  // the layer index of each QSA layer, in order
  for (int64_t l = 0; l < layers; ++l)
    if (cfg.is_qsa(l)) qsa_layer.push_back(l);
  Skip k;
  REQUIRE(ref.size() >= got.size());
  k.row.assign(got.size(), false);
  bool tainted = false;
  for (std::size_t p = 0; p < got.size(); ++p) {
    bool flip = false, carries = false;
    for (std::size_t l = 0; l < got[p].router.size(); ++l) {
      if (got[p].router[l] != ref[p].router[l]) {
        flip = true;
        carries = carries || static_cast<int64_t>(l) + 1 < layers;
      }
    }
    // A selection flip changes that row's attention output only (the caches do not depend on
    // it), so it carries on through the later layers' states unless its layer is the last.
    REQUIRE(got[p].indexer.size() == qsa_layer.size());
    for (std::size_t q = 0; q < got[p].indexer.size(); ++q) {
      if (got[p].indexer[q] != ref[p].indexer[q]) {
        flip = true;
        carries = carries || qsa_layer[q] + 1 < layers;
      }
    }
    k.flipped += flip ? 1 : 0;
    k.row[p] = flip || tainted;
    k.skipped += k.row[p] ? 1 : 0;
    tainted = tainted || carries;
  }
  return k;
}

Agreement compare(const float* ref, const float* got, int64_t rows, int64_t vocab,
                  const Skip& skip = {}) {
  Agreement a;
  for (int64_t p = 0; p < rows; ++p) {
    if (!skip.row.empty() && skip.row[static_cast<std::size_t>(p)]) continue;
    const float* r = ref + p * vocab;
    const float* g = got + p * vocab;
    const double tol = kRelTol * max_abs(r, vocab);
    const double ratio = max_abs_diff(g, r, vocab) / tol;
    a.worst = std::max(a.worst, ratio);
    if (ratio > 1.0) {
      ++a.bad_rows;
      if (a.first_bad < 0) a.first_bad = p;
    }
    if (argmax(g, vocab) != argmax(r, vocab) && margin(r, vocab) > tol) ++a.argmax_mismatch;
  }
  return a;
}

// Teacher-forced logits of tokens[0..n) through forward(), from a reset model; with
// record_choices, each step's choices in `choices`.
std::vector<float> forward_rows(fn::CudaModel& m, const std::vector<int32_t>& tokens, int64_t n,
                                std::vector<fn::StepChoices>* choices = nullptr) {
  m.reset();
  std::vector<float> all;
  all.reserve(static_cast<std::size_t>(n * m.config().vocab_size));
  for (int64_t i = 0; i < n; ++i) {
    const auto l = m.forward(tokens[static_cast<std::size_t>(i)]);
    all.insert(all.end(), l.begin(), l.end());
    if (choices) choices->push_back(m.last_choices());
  }
  return all;
}

// prefill(tokens[0..L), All) then forward() of tokens[L .. L+steps), from a reset model; with
// record_choices, every row's choices in `choices`.
std::vector<float> prefill_rows(fn::CudaModel& m, const std::vector<int32_t>& tokens, int64_t L,
                                int64_t steps, std::vector<fn::StepChoices>* choices = nullptr) {
  m.reset();
  const auto pre = m.prefill(std::span<const int32_t>(tokens.data(), static_cast<std::size_t>(L)),
                             fn::PrefillLogits::All);
  std::vector<float> all(pre.begin(), pre.end());
  REQUIRE(m.position() == L);
  if (choices) {
    *choices = m.prefill_choices();
    REQUIRE(static_cast<int64_t>(choices->size()) == L);
  }
  for (int64_t i = 0; i < steps; ++i) {
    const auto l = m.forward(tokens[static_cast<std::size_t>(L + i)]);
    all.insert(all.end(), l.begin(), l.end());
    if (choices) choices->push_back(m.last_choices());
  }
  return all;
}

// forward() of tokens[0..choices.size()) from a reset model built with replay_choices, each step
// forced to make the given choices (a prefill run's, so both runs take the same discrete
// decisions and differ by rounding only).
std::vector<float> replayed_rows(fn::CudaModel& m, const std::vector<int32_t>& tokens,
                                 const std::vector<fn::StepChoices>& choices) {
  m.reset();
  std::vector<float> all;
  for (std::size_t i = 0; i < choices.size(); ++i) {
    fn::CudaModelTesting::set_forced_choices(m, choices[i].router, choices[i].indexer);
    const auto l = m.forward(tokens[i]);
    all.insert(all.end(), l.begin(), l.end());
  }
  return all;
}

// The length x chunk table for one TP group; rank 0 prints it. Per cell: the worst row of the
// prefill run against token by token with the prefill's choices replayed (every row checked),
// and how many rows chose another expert set or block set than free-running token by token
// (near ties that summation order decides; those rows and the rows a carried flip reaches are
// left out of the free-running comparison, which checks the others).
void length_chunk_table(int tp_rank, int tp_size, fn::DeviceAllReduce* ar, bool print) {
  // Models sharing an all-reduce must share its stream (CudaModelOptions::stream).
  cudaStream_t stream = nullptr;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{stream};
  const fn::ModelConfig cfg = raised_config("g3_tiny", 16384);
  const fn::QuantConfig quant =
      fn::load_quant_config(std::string(FN_TEST_DATA_DIR) + "/fixtures/g3_tiny");
  const int64_t ctx = kWhole + kDecodeSteps;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size - 1));
  std::vector<int32_t> seq(static_cast<std::size_t>(ctx));
  for (auto& t : seq) t = tok(rng);
  // A few EOS tokens inside the prompt (the n-gram shift resets behind them).
  for (std::size_t i : {100u, 2049u, 5000u}) seq[i] = static_cast<int32_t>(cfg.ple_eos());

  std::vector<std::unique_ptr<fn::CudaModel>> models;
  for (int64_t chunk : kChunks) {
    auto o = options(tp_rank, tp_size, ar, ctx, chunk, true);
    o.stream = stream;
    models.push_back(fn::CudaModel::random(cfg, quant, 11, o));
  }
  auto replay_opt = options(tp_rank, tp_size, ar, ctx, kWhole);
  replay_opt.stream = stream;
  fn::CudaModelTestOptions replay_test;
  replay_test.replay_choices = true;
  auto replay = fn::CudaModelTesting::random(cfg, quant, 11, replay_opt, replay_test);
  std::vector<fn::StepChoices> free_choices;
  const std::vector<float> free_rows = forward_rows(*models[0], seq, ctx, &free_choices);
  const int64_t V = cfg.vocab_size;
  std::string table = "| length | whole | 512 | 17 |\n|---|---|---|---|\n";
  int64_t rows_all = 0, flipped_all = 0;
  double worst_free = 0;
  for (int64_t L : kLengths) {
    std::string line = fmt::format("| {} |", L);
    for (std::size_t ci = 0; ci < models.size(); ++ci) {
      CAPTURE(L);
      CAPTURE(kChunks[ci]);
      std::vector<fn::StepChoices> choices;
      const std::vector<float> got = prefill_rows(*models[ci], seq, L, kDecodeSteps, &choices);
      REQUIRE(static_cast<int64_t>(got.size()) == (L + kDecodeSteps) * V);
      const std::vector<float> ref = replayed_rows(*replay, seq, choices);
      const Agreement a = compare(ref.data(), got.data(), L + kDecodeSteps, V);
      CHECK_MESSAGE(a.bad_rows == 0, "first row beyond the tolerance: ", a.first_bad);
      CHECK(a.argmax_mismatch == 0);
      const Skip skip = choice_flips(free_choices, choices, cfg);
      const Agreement f = compare(free_rows.data(), got.data(), L + kDecodeSteps, V, skip);
      CHECK_MESSAGE(f.bad_rows == 0, "free-running, first row beyond the tolerance: ", f.first_bad);
      CHECK(f.argmax_mismatch == 0);
      rows_all += L + kDecodeSteps;
      flipped_all += skip.flipped;
      worst_free = std::max(worst_free, f.worst);
      line += fmt::format(
          " {:.1e}{}{} |", a.worst,
          skip.flipped ? fmt::format(" ({})", skip.flipped) : std::string(),
          a.bad_rows + a.argmax_mismatch + f.bad_rows + f.argmax_mismatch ? " FAIL" : "");
    }
    table += line + "\n";
  }
  if (print)
    MESSAGE(fmt::format(
        "TP={}: worst max|prefill - token-by-token| / (2e-2 max|ref|) over the prompt rows and {} "
        "decode steps, token by token replaying the prefill's choices; in parentheses the rows "
        "whose own choices differ ({} of {} rows in all; free-running rows before a carried flip: "
        "worst {:.1e}):\n{}",
        tp_size, kDecodeSteps, flipped_all, rows_all, worst_free, table));
}

}  // namespace

TEST_CASE("cuda prefill: every prompt length and pass size gives token-by-token's logits (TP=1)") {
  const int rank = fn::test::use_gpu_of_rank();
  length_chunk_table(0, 1, nullptr, rank == 0);
}

TEST_CASE("cuda prefill: every prompt length and pass size gives token-by-token's logits (TP=2)") {
  int rank = fn::test::use_gpu_of_rank();
  const int size = fn::test::mpi_world(&rank);
  fn::GpuComm gpu(fn::gpu_group_of_world());
  auto ar =
      fn::make_device_all_reduce(fn::AllReduceStrategy::Auto, gpu, fn::CustomAllReduceOptions{});
  length_chunk_table(rank, size, ar.get(), rank == 0);
}

TEST_CASE(
    "cuda prefill: the fixtures' prompts prefill to forward()'s logits, in one pass and in "
    "passes of 3") {
  fn::test::use_gpu_of_rank();
  for (const std::string name : {"g3_tiny", "tp4", "ple2_long"}) {
    CAPTURE(name);
    const fn::test::RefFixture f = fn::test::load_ref_fixture(name);
    const auto n = static_cast<int64_t>(f.tokens.size());
    for (int64_t chunk : {int64_t{256}, int64_t{3}}) {
      CAPTURE(chunk);
      auto m = fn::CudaModel::load(f.dir, options(0, 1, nullptr, 256, chunk, true));
      fn::CudaModelTestOptions replay_test;
      replay_test.replay_choices = true;
      auto replay =
          fn::CudaModelTesting::load(f.dir, options(0, 1, nullptr, 256, chunk), replay_test);
      std::vector<fn::StepChoices> free_choices, choices;
      forward_rows(*m, f.tokens, n, &free_choices);
      const int64_t L = static_cast<int64_t>(f.prompt_ids.size());
      const std::vector<float> got = prefill_rows(*m, f.tokens, L, n - L, &choices);
      const std::vector<float> ref = replayed_rows(*replay, f.tokens, choices);
      const Agreement a = compare(ref.data(), got.data(), n, f.vocab);
      CHECK(a.bad_rows == 0);
      CHECK(a.argmax_mismatch == 0);
      const Skip skip = choice_flips(free_choices, choices, m->config());
      MESSAGE(
          fmt::format("{} chunk {}: worst {:.2e} of the tolerance (choices replayed); {} of "
                      "{} rows choose otherwise than free-running token by token",
                      name, chunk, a.worst, skip.flipped, n));
      // Against the transformers reference too (test_cuda_model's free-running check: rows with
      // a near-tie choice or an ill-conditioned gate in the CPU run are reported, not checked).
      const fn::test::RowCheck rc = fn::test::check_rows(f, got, fn::test::cpu_run(f).tie_or_ill);
      CHECK(rc.argmax_mismatch == 0);
    }
  }
}

TEST_CASE(
    "cuda prefill: an empty prompt, a token outside the vocabulary and a prompt past the "
    "context are usage errors that leave the model usable") {
  fn::test::use_gpu_of_rank();
  const fn::test::RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  auto m = fn::CudaModel::load(f.dir, options(0, 1, nullptr, 8, 4));
  const std::vector<int32_t> none;
  CHECK_THROWS_WITH_AS(m->prefill(none), doctest::Contains("the prompt is empty"), fn::Error);
  const std::vector<int32_t> bad = {1, 2, static_cast<int32_t>(f.vocab)};
  CHECK_THROWS_WITH_AS(m->prefill(bad), doctest::Contains("outside the vocabulary"), fn::Error);
  const std::vector<int32_t> long_prompt(9, 1);
  CHECK_THROWS_WITH_AS(m->prefill(long_prompt), doctest::Contains("-c/--ctx-size 8"), fn::Error);
  CHECK(m->position() == 0);
  const std::vector<int32_t> ok = {1, 2, 3, 4, 5, 6, 7, 8};
  const auto l = m->prefill(ok);
  CHECK(static_cast<int64_t>(l.size()) == f.vocab);
  CHECK(m->position() == 8);
  CHECK_THROWS_WITH_AS(m->forward(1), doctest::Contains("the context is full"), fn::Error);
}

TEST_CASE("cuda prefill: a profiled prefill reports every family's time and the model's FLOPs") {
  fn::test::use_gpu_of_rank();
  const fn::test::RefFixture f = fn::test::load_ref_fixture("g3_tiny");
  auto m = fn::CudaModel::load(f.dir, options(0, 1, nullptr, 64, 16));
  const std::vector<int32_t> prompt(f.tokens.begin(), f.tokens.begin() + 40);
  m->prefill(prompt);
  CHECK_FALSE(m->last_prefill_profile().has_value());  // not asked for
  m->reset();
  m->set_prefill_profile(true);
  m->prefill(prompt);
  m->set_prefill_profile(false);
  const std::optional<fn::PrefillProfile> p = m->last_prefill_profile();
  REQUIRE(p.has_value());
  CHECK(p->tokens == 40);
  CHECK(p->passes == 3);  // 16 + 16 + 8
  const fn::PrefillFlops want = fn::prefill_flops(m->config(), 0, 40, 1);
  double flops = 0;
  for (int i = 0; i < fn::kStepFamilyCount; ++i) {
    const auto fam = static_cast<fn::StepFamily>(i);
    const char* name = fn::step_family_name(fam);
    CAPTURE(name);
    CHECK(p->flops[static_cast<std::size_t>(i)] == want.of(name));
    flops += p->flops[static_cast<std::size_t>(i)];
    // g3_tiny has every family but the all-reduce (TP=1) in its prefill.
    if (fam != fn::StepFamily::AllReduce && fam != fn::StepFamily::Other)
      CHECK(p->ms[static_cast<std::size_t>(i)] > 0.0);
  }
  CHECK(flops == doctest::Approx(want.total()).epsilon(1e-12));
  m->reset();
  m->prefill(prompt);  // profile off again: the last profiled call's figures stay
  REQUIRE(m->last_prefill_profile().has_value());
  CHECK(m->last_prefill_profile()->ms == p->ms);
}

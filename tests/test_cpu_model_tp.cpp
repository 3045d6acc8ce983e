// CpuModel tensor-parallel over MPI (4 ranks, label mpi): MPI_Comm_split makes groups of 1, 2 and
// 4 ranks inside one 4-rank run; each group runs every reference fixture whose dimensions its TP
// size divides, checks every row against the transformers FP32 reference and against TP=1, and
// checks that every rank of a group returns bit-identical logits.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstring>
#include <map>
#include <set>

#include "comm/mpi_check.h"
#include "comm/mpi_collectives.h"
#include "core/collectives.h"
#include "core/cpu_model.h"
#include "core/error.h"
#include "test_cpu_fixture.h"

using fn::test::RefFixture;

namespace {

// A sub-communicator of `tp` consecutive world ranks (freed on destruction).
struct Group {
  MPI_Comm comm = MPI_COMM_NULL;
  explicit Group(int tp) {
    int world_rank = 0;
    FN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
    FN_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, world_rank / tp, world_rank, &comm));
  }
  ~Group() { MPI_Comm_free(&comm); }
};

int world_size() {
  int n = 0;
  FN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &n));
  return n;
}

// All logits rows of the fixture's token sequence at TP = tp, or empty when tp does not divide
// the model (ShardPlan::build's Usage error, raised identically on every rank).
std::vector<float> run_tp(const RefFixture& f, int tp) {
  Group g(tp);
  fn::MpiCollectives coll(g.comm);
  REQUIRE(coll.size() == tp);
  std::unique_ptr<fn::CpuModel> model;
  try {
    model = fn::CpuModel::load(f.dir, coll);
  } catch (const fn::Error& e) {
    if (e.kind() == fn::ErrorKind::Usage) return {};
    throw;
  }
  std::vector<float> all;
  for (int32_t t : f.tokens) {
    const auto l = model->forward(t);
    all.insert(all.end(), l.begin(), l.end());
  }
  // Every rank of the group holds the same logits, bit for bit.
  std::vector<float> root = all;
  coll.broadcast(root.data(), root.size() * sizeof(float), 0);
  CHECK(std::memcmp(root.data(), all.data(), all.size() * sizeof(float)) == 0);
  return all;
}

}  // namespace

TEST_CASE(
    "cpu model: TP=1, 2 and 4 match the reference and agree with each other on every "
    "fixture") {
  REQUIRE(world_size() == 4);
  const std::map<std::string, std::set<int>> must_run = {
      {"g3_tiny", {1, 2}}, {"tp4", {1, 2, 4}}, {"ple2_long", {1, 2}}};
  for (const auto& [name, required] : must_run) {
    CAPTURE(name);
    const RefFixture f = fn::test::load_ref_fixture(name);
    const std::size_t n_rows = f.tokens.size();
    std::map<int, std::vector<float>> by_tp;
    for (int tp : {1, 2, 4}) {
      std::vector<float> l = run_tp(f, tp);
      if (l.empty()) {
        CHECK(required.count(tp) ==
              0);  // only a TP the fixture's dimensions rule out may be absent
        continue;
      }
      REQUIRE(l.size() == n_rows * static_cast<std::size_t>(f.vocab));
      by_tp[tp] = std::move(l);
    }
    for (int tp : required) REQUIRE(by_tp.count(tp) == 1);
    for (const auto& [tp, l] : by_tp) {
      CAPTURE(tp);
      double worst_ref = 0.0, worst_tp1 = 0.0;
      for (std::size_t p = 0; p < n_rows; ++p) {
        CAPTURE(p);
        const float* row = l.data() + p * static_cast<std::size_t>(f.vocab);
        const double scale = fn::test::max_abs(f.row(p), f.vocab);
        const double d_ref = fn::test::max_abs_diff(row, f.row(p), f.vocab);
        const double d_tp1 = fn::test::max_abs_diff(
            row, by_tp[1].data() + p * static_cast<std::size_t>(f.vocab), f.vocab);
        CHECK(d_ref <= 1e-4 * scale);
        CHECK(d_tp1 <= 1e-4 * scale);
        worst_ref = std::max(worst_ref, d_ref / scale);
        worst_tp1 = std::max(worst_tp1, d_tp1 / scale);
        if (p + 1 >= f.prompt_ids.size())
          CHECK(fn::test::argmax(row, f.vocab) == f.generated_ids[p + 1 - f.prompt_ids.size()]);
      }
      MESSAGE(name << " TP=" << tp << ": worst rel. error vs reference " << worst_ref
                   << ", vs TP=1 " << worst_tp1);
    }
  }
}

TEST_CASE(
    "cpu model: a TP size that does not divide the model's heads is a usage error naming "
    "the constraint") {
  REQUIRE(world_size() == 4);
  const RefFixture f = fn::test::load_ref_fixture("g3_tiny");  // 2 GDN key heads: TP=4 impossible
  Group g(4);
  fn::MpiCollectives coll(g.comm);
  try {
    (void)fn::CpuModel::load(f.dir, coll);
    FAIL("no throw");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Usage);
    MESSAGE(std::string(e.what()));
    CHECK(std::string(e.what()).find("4") != std::string::npos);
  }
}

TEST_CASE("mpi collectives: the all-reduce is the rank-order sum, identical on every rank") {
  fn::MpiCollectives coll(MPI_COMM_WORLD);
  const int n = coll.size(), r = coll.rank();
  // Element 0 is order-dependent in float: rank order gives ((1e8 + 3) + 3) + 3 = 1e8 (each 3 is
  // below half an ulp of 1e8), while 3 + 3 + 3 + 1e8 would give 100000008.
  std::vector<float> v = {r == 0 ? 1e8f : 3.0f, static_cast<float>(r + 1),
                          -0.5f * static_cast<float>(r)};
  coll.all_reduce_sum(v.data(), v.size());
  float want0 = 1e8f;
  for (int i = 1; i < n; ++i) want0 += 3.0f;
  CHECK(v[0] == want0);
  CHECK(v[1] == static_cast<float>(n * (n + 1) / 2));
  CHECK(v[2] == -0.25f * static_cast<float>(n * (n - 1)));
  std::vector<float> mine = {static_cast<float>(r), static_cast<float>(10 * r)};
  std::vector<float> all(2 * static_cast<std::size_t>(n));
  coll.all_gather(mine.data(), 2, all.data());
  for (int i = 0; i < n; ++i) {
    CHECK(all[2 * i] == static_cast<float>(i));
    CHECK(all[2 * i + 1] == static_cast<float>(10 * i));
  }
  int64_t token = r == n - 1 ? 4242 : -1;
  coll.broadcast(&token, sizeof(token), n - 1);
  CHECK(token == 4242);
}

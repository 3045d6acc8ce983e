// The generation loop tensor-parallel over MPI (4 ranks, label mpi): on the tp4 reference
// fixture at TP = 2 and 4 (MPI_Comm_split groups), greedy decoding reproduces the reference's 32
// ids on every rank, prefill(T) equals prefill(T-1) + one decode step, and seeded sampling gives
// the same tokens on every rank of a group (docs/model.md §E.3).
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstring>

#include "comm/mpi_check.h"
#include "comm/mpi_collectives.h"
#include "core/cpu_backend.h"
#include "core/cpu_model.h"
#include "core/generate.h"
#include "test_cpu_fixture.h"

namespace {

struct Group {
  MPI_Comm comm = MPI_COMM_NULL;
  explicit Group(int tp) {
    int world_rank = 0;
    FN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
    FN_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, world_rank / tp, world_rank, &comm));
  }
  ~Group() { MPI_Comm_free(&comm); }
};

// True when every rank of coll holds the same ids.
bool same_on_all_ranks(fn::Collectives& coll, const std::vector<int32_t>& ids) {
  std::vector<float> mine(ids.begin(), ids.end());  // ids < 2^24: exact as float
  std::vector<float> all(mine.size() * static_cast<std::size_t>(coll.size()));
  coll.all_gather(mine.data(), mine.size(), all.data());
  for (int r = 0; r < coll.size(); ++r) {
    if (std::memcmp(all.data() + r * mine.size(), mine.data(), mine.size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

}  // namespace

TEST_CASE("generate over MPI: tp4 greedy ids, prefill split and seeded sampling at TP 2 and 4") {
  int world = 0;
  FN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  REQUIRE(world == 4);
  const auto f = fn::test::load_ref_fixture("tp4");
  const std::vector<int32_t> want(f.generated_ids.begin(), f.generated_ids.begin() + 32);
  for (int tp : {2, 4}) {
    CAPTURE(tp);
    Group g(tp);
    fn::MpiCollectives coll(g.comm);
    fn::CpuBackend model(fn::CpuModel::load(f.dir, coll), 0.0);
    fn::GenerateOptions o;
    o.sampling.temperature = 0.0;
    o.max_new_tokens = 32;
    o.ctx_size = 1024;
    o.stop_token_ids = {8, 7};
    o.ignore_eos = true;
    const auto r = fn::generate(model, coll, f.prompt_ids, o);
    CHECK(r.token_ids == want);
    CHECK(same_on_all_ranks(coll, r.token_ids));

    // prefill(T) vs prefill(T-1) + one decode step.
    model.reset();
    const std::span<const int32_t> all(f.prompt_ids);
    const auto a = model.prefill(all, fn::PrefillOutput::Last);
    const std::vector<float> full(a.begin(), a.end());
    model.reset();
    model.prefill(all.first(all.size() - 1), fn::PrefillOutput::None);
    const auto b = model.forward(all.back());
    const double scale = fn::test::max_abs(full.data(), f.vocab);
    CHECK(fn::test::max_abs_diff(full.data(), b.data(), f.vocab) <= 1e-5 * scale);

    // Seeded sampling (top-k 20, top-p 0.95, T 1): every rank takes the same decisions.
    model.reset();
    o.sampling = fn::SamplingParams{};
    o.sampling.temperature = 1.0;
    o.sampling.top_k = 20;
    o.sampling.top_p = 0.95;
    o.sampling.seed = 11;
    o.max_new_tokens = 24;
    const auto s = fn::generate(model, coll, f.prompt_ids, o);
    CHECK(s.token_ids.size() == 24);
    CHECK(same_on_all_ranks(coll, s.token_ids));
    CHECK(s.token_ids != std::vector<int32_t>(want.begin(), want.begin() + 24));  // it sampled
  }
}

// core/choice_check.h: the FNV-1a hash against hand-computed values, and the cross-rank compare
// over MPI (label mpi, 4 ranks): equal choices pass, one rank's different expert id throws on
// every rank with the step and the hashes in the message.
#include <doctest/doctest.h>
#include <mpi.h>

#include <string>

#include "comm/mpi_check.h"
#include "comm/mpi_collectives.h"
#include "core/choice_check.h"
#include "core/error.h"

namespace {

// FNV-1a 64 over raw bytes, written out independently of the implementation.
uint64_t fnv(const std::vector<unsigned char>& bytes) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char b : bytes) h = (h ^ b) * 1099511628211ull;
  return h;
}

void put_u64(std::vector<unsigned char>& v, uint64_t x) {
  for (int i = 0; i < 8; ++i) v.push_back(static_cast<unsigned char>(x >> (8 * i)));
}

void put_i32(std::vector<unsigned char>& v, int32_t x) {
  for (int i = 0; i < 4; ++i)
    v.push_back(static_cast<unsigned char>(static_cast<uint32_t>(x) >> (8 * i)));
}

}  // namespace

TEST_CASE("choice check: the hash is FNV-1a over list counts, lengths and ids") {
  std::vector<unsigned char> empty;
  put_u64(empty, 0);
  put_u64(empty, 0);
  CHECK(fn::hash_choices({}, {}) == fnv(empty));

  std::vector<unsigned char> b;
  put_u64(b, 2);  // two router layers
  put_u64(b, 2);
  put_i32(b, 7);
  put_i32(b, -1);
  put_u64(b, 0);
  put_u64(b, 1);  // one QSA layer
  put_u64(b, 1);
  put_i32(b, 511);
  CHECK(fn::hash_choices({{7, -1}, {}}, {{511}}) == fnv(b));
  // The same ids split differently between layers hash differently.
  CHECK(fn::hash_choices({{7}, {-1}}, {{511}}) != fn::hash_choices({{7, -1}, {}}, {{511}}));
  CHECK(fn::hash_choices({{1, 2}}, {}) != fn::hash_choices({{2, 1}}, {}));
}

TEST_CASE("choice check: equal choices pass on every rank, one different id fails on all") {
  int rank = 0;
  FN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  fn::MpiCollectives coll(MPI_COMM_WORLD);
  const std::vector<std::vector<int32_t>> router = {{3, 9, 1}, {0, 4, 2}};
  const std::vector<std::vector<int32_t>> indexer = {{0, 1, 5}};
  CHECK_NOTHROW(fn::require_same_choices(coll, fn::hash_choices(router, indexer), 12));

  auto mine = router;
  if (rank == coll.size() - 1) mine[1][2] = 5;
  if (coll.size() == 1) return;
  bool threw = false;
  try {
    fn::require_same_choices(coll, fn::hash_choices(mine, indexer), 12);
  } catch (const fn::Error& e) {
    threw = true;
    CHECK(e.kind() == fn::ErrorKind::Internal);
    const std::string m = e.what();
    CHECK(m.find("decode step 12") != std::string::npos);
    CHECK(m.find("rank 0: ") != std::string::npos);
  }
  CHECK(threw);
}

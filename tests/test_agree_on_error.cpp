// core/collectives.h agree_on_error over MPI (label mpi, 4 ranks): no failure returns on every
// rank; one rank's fn::Error reaches every rank with its kind, its message prefixed by the rank
// and its source location; several failing ranks give the lowest one's error naming the others;
// a std::exception other than fn::Error travels as Internal. The one-rank group rethrows as is.
#include <doctest/doctest.h>
#include <mpi.h>

#include <stdexcept>
#include <string>

#include "comm/mpi_check.h"
#include "comm/mpi_collectives.h"
#include "core/collectives.h"
#include "core/error.h"

namespace {

// Runs agree_on_error(coll, f) and returns the error every rank got (or none).
struct Outcome {
  bool threw = false;
  fn::ErrorKind kind = fn::ErrorKind::Internal;
  std::string message;
  std::string where;
  bool on_every_rank = false;
};

template <typename F>
Outcome agree(fn::Collectives& coll, F f) {
  Outcome o;
  try {
    fn::agree_on_error(coll, f);
  } catch (const fn::Error& e) {
    o = Outcome{true, e.kind(), e.what(), e.where(), e.on_every_rank()};
  }
  return o;
}

}  // namespace

TEST_CASE("agree_on_error: no failure returns on every rank, with f run once per rank") {
  fn::MpiCollectives coll(MPI_COMM_WORLD);
  int runs = 0;
  const Outcome o = agree(coll, [&] { ++runs; });
  CHECK_FALSE(o.threw);
  CHECK(runs == 1);
}

TEST_CASE("agree_on_error: one rank's error reaches every rank, prefixed by that rank") {
  fn::MpiCollectives coll(MPI_COMM_WORLD);
  REQUIRE(coll.size() == 4);
  const Outcome o = agree(coll, [&] {
    if (coll.rank() == 2) FN_THROW(Format, "shard.safetensors: tensor 'w' is cut short");
  });
  CHECK(o.threw);
  CHECK(o.kind == fn::ErrorKind::Format);
  CHECK(o.message == "rank 2: shard.safetensors: tensor 'w' is cut short");
  CHECK(o.where.find("test_agree_on_error.cpp:") != std::string::npos);
  CHECK(o.on_every_rank);
}

TEST_CASE("agree_on_error: rank 0's own error keeps its message; others are named") {
  fn::MpiCollectives coll(MPI_COMM_WORLD);
  REQUIRE(coll.size() == 4);
  const Outcome o = agree(coll, [&] {
    if (coll.rank() == 0) FN_THROW(Io, "a.bin: cannot open");
    if (coll.rank() == 3) FN_THROW(Cuda, "out of memory");
  });
  CHECK(o.threw);
  CHECK(o.kind == fn::ErrorKind::Io);
  CHECK(o.message == "a.bin: cannot open (rank(s) 3 failed with other errors)");
  CHECK(o.on_every_rank);
}

TEST_CASE("agree_on_error: the lowest failing rank wins; a std::exception is Internal") {
  fn::MpiCollectives coll(MPI_COMM_WORLD);
  REQUIRE(coll.size() == 4);
  const Outcome o = agree(coll, [&] {
    if (coll.rank() == 1) throw std::runtime_error("boom");
    if (coll.rank() >= 2) FN_THROW(Usage, "rank {} usage", coll.rank());
  });
  CHECK(o.threw);
  CHECK(o.kind == fn::ErrorKind::Internal);
  CHECK(o.message == "rank 1: boom (rank(s) 2, 3 failed with other errors)");
  CHECK(o.where.empty());
  // The next collective still lines up on every rank.
  int rank = coll.rank(), sum = 0;
  FN_MPI_CHECK(MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  CHECK(sum == 6);
}

TEST_CASE("agree_on_error: one message on every rank stays as is; a shared one names its ranks") {
  fn::MpiCollectives coll(MPI_COMM_WORLD);
  REQUIRE(coll.size() == 4);
  Outcome o = agree(coll, [] { FN_THROW(Usage, "tp_size must be 1, 2, 4 or 8, got 3"); });
  CHECK(o.threw);
  CHECK(o.kind == fn::ErrorKind::Usage);
  CHECK(o.message == "tp_size must be 1, 2, 4 or 8, got 3");
  o = agree(coll, [&] {
    if (coll.rank() % 2 == 1) FN_THROW(Cuda, "GPU {} is full", 7);
  });
  CHECK(o.kind == fn::ErrorKind::Cuda);
  CHECK(o.message == "rank 1: GPU 7 is full (also on rank(s) 3)");
  // The same text with another kind is another error.
  o = agree(coll, [&] {
    if (coll.rank() == 1) FN_THROW(Cuda, "x");
    if (coll.rank() == 2) FN_THROW(Io, "x");
  });
  CHECK(o.message == "rank 1: x (rank(s) 2 failed with other errors)");
}

TEST_CASE("agree_on_error: the one-rank group rethrows the error, marked") {
  fn::LocalCollectives one;
  const Outcome o = agree(one, [] { FN_THROW(Mpi, "peer gone"); });
  CHECK(o.threw);
  CHECK(o.kind == fn::ErrorKind::Mpi);
  CHECK(o.message == "peer gone");
  CHECK(o.on_every_rank);
}

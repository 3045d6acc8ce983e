// Checks the multi-rank harness itself: all ranks run, and a sum over ranks is what each
// rank can compute locally.
#include <doctest/doctest.h>
#include <mpi.h>

#include "comm/mpi_check.h"

TEST_CASE("mpi harness: every rank takes part and sees the same world size") {
  int rank = -1, size = 0;
  FN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  FN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  REQUIRE(size >= 1);
  int sum = 0;
  FN_MPI_CHECK(MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  CHECK(sum == size * (size - 1) / 2);
}

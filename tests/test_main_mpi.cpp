// doctest main for multi-rank tests (label mpi), run as `mpirun -np 4 ...`. Every rank runs
// every test; each rank's failure count is summed with MPI_Allreduce; rank 0 prints its report
// and a one-line summary, other ranks print their report only when they failed; every rank
// exits non-zero if any rank failed. (Debian's doctest 2.4.9 has no doctest_mpi.h.)
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <iostream>
#include <sstream>

#include "comm/mpi_context.h"
#include "core/log.h"

int main(int argc, char** argv) {
  fn::MpiContext mpi(&argc, &argv);
  std::ostringstream captured;
  doctest::Context context(argc, argv);
  if (mpi.world_rank() != 0) context.setCout(&captured);
  int failed = context.run();
  if (context.shouldExit()) return failed;
  int local_failed = failed != 0 ? 1 : 0;
  int ranks_failed = 0;
  MPI_Allreduce(&local_failed, &ranks_failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (local_failed && mpi.world_rank() != 0) {
    std::cerr << "[r" << mpi.world_rank() << "/" << mpi.world_size() << "] failures:\n"
              << captured.str() << std::flush;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (mpi.world_rank() == 0) {
    std::printf("[mpi] %d of %d ranks failed\n", ranks_failed, mpi.world_size());
    std::fflush(stdout);
  }
  return ranks_failed == 0 ? 0 : 1;
}

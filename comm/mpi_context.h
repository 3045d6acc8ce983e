// MPI bootstrap for every fngen process: init/finalize, world and node-local rank, and the
// abort path main() takes on a fatal error so that no rank is left waiting in a collective.
// One MpiContext per process, created first thing in main() (apps/) or the test main.
#pragma once

#include <mpi.h>

namespace fn {

/// Owns MPI_Init/MPI_Finalize. Errors on MPI_COMM_WORLD return codes (MPI_ERRORS_RETURN) so
/// FN_MPI_CHECK can report them.
class MpiContext {
 public:
  /// Initializes MPI (thread level FUNNELED) and computes the ranks. Throws fn::Error(Mpi).
  MpiContext(int* argc, char*** argv);
  ~MpiContext();
  MpiContext(const MpiContext&) = delete;
  MpiContext& operator=(const MpiContext&) = delete;

  int world_rank() const noexcept { return world_rank_; }
  int world_size() const noexcept { return world_size_; }
  /// Rank among the processes of this node (MPI_Comm_split_type SHARED); picks the GPU.
  int local_rank() const noexcept { return local_rank_; }
  int local_size() const noexcept { return local_size_; }
  MPI_Comm world() const noexcept { return MPI_COMM_WORLD; }

  /// Runs the abort hooks (comm/abort_hooks.h: ncclCommAbort), then ends every rank with
  /// `code` (MPI_Abort); used only by main()'s error funnel.
  [[noreturn]] static void abort_all(int code) noexcept;

 private:
  int world_rank_ = 0;
  int world_size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  MPI_Comm node_comm_ = MPI_COMM_NULL;
};

}  // namespace fn

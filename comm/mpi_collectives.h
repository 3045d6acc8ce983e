// fn::Collectives over an MPI communicator: the CPU backend's tensor-parallel exchange
// (MODEL.md §E.2: all-reduce after each GDN/QSA and MoE block, the PLE n-gram embedding, the
// logits gather). Created by apps/ and the mpi tests on MPI_COMM_WORLD or a split of it.
// Invariant: all_reduce_sum gathers every contribution and sums in rank order 0..size-1 on every
// rank, so its result is bit-identical on all ranks and independent of Open MPI's algorithm.
#pragma once

#include <mpi.h>

#include <vector>

#include "core/collectives.h"

namespace fn {

/// Collectives on `comm` (not owned, not freed; must outlive this object).
class MpiCollectives final : public Collectives {
 public:
  /// Reads rank and size of comm. Throws fn::Error(Mpi) when MPI fails.
  explicit MpiCollectives(MPI_Comm comm);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  /// MPI_Allgather of every rank's n floats, then the sum in rank order (bit-identical).
  void all_reduce_sum(float* data, std::size_t n) override;
  /// MPI_Allgather.
  void all_gather(const float* in, std::size_t n_per_rank, float* out) override;
  /// MPI_Bcast (in chunks below INT_MAX bytes).
  void broadcast(void* data, std::size_t bytes, int root) override;
  /// The communicator given at construction.
  MPI_Comm comm() const noexcept { return comm_; }

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  std::vector<float> scratch_;
};

}  // namespace fn

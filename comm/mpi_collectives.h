// fn::Collectives over an MPI communicator: the CPU backend's tensor-parallel exchange
// (docs/model.md §E.2: all-reduce after each GDN/QSA and MoE block, the PLE n-gram embedding, the
// logits gather). Created by apps/ and the mpi tests on MPI_COMM_WORLD or a split of it.
// Invariants: all_reduce_sum gathers every contribution and sums in rank order 0..size-1 on every
// rank, so its result is bit-identical on all ranks and independent of Open MPI's algorithm.
// Every exchange is non-blocking point-to-point polled against a deadline (the stall timeout,
// core/collectives.h): a rank that stops answering (SIGSTOP, a hang, a dead host) is named in an
// fn::Error(Mpi) on every rank that waits for it, instead of a job that spins forever.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <vector>

#include "core/collectives.h"

namespace fn {

/// Collectives on `comm` (not owned, not freed; must outlive this object).
class MpiCollectives final : public Collectives {
 public:
  /// Reads rank and size of comm. `stall_timeout_s`: how long one collective waits for the
  /// parts of its peers before it throws (seconds, 0 = no bound; default the process-wide
  /// stall_timeout(), --stall-timeout). Throws fn::Error(Mpi) when MPI fails, fn::Error(Usage)
  /// for a negative or non-finite timeout.
  explicit MpiCollectives(MPI_Comm comm, double stall_timeout_s = stall_timeout());
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  /// Every rank's n floats to every rank (as all_gather), then the sum in rank order
  /// (bit-identical on every rank).
  void all_reduce_sum(float* data, std::size_t n) override;
  /// out[r * n_per_rank ..] = rank r's in: one message to and from every peer.
  void all_gather(const float* in, std::size_t n_per_rank, float* out) override;
  /// Rank `root` sends the bytes to every peer (in messages below 1 GiB).
  void broadcast(void* data, std::size_t bytes, int root) override;
  /// The communicator given at construction.
  MPI_Comm comm() const noexcept { return comm_; }
  /// The stall timeout in seconds (0 = none).
  double stall_timeout_seconds() const noexcept { return timeout_s_; }

 private:
  // all_gather, naming `what` (the public collective) in messages.
  void gather(const float* in, std::size_t n_per_rank, float* out, const char* what);
  // Waits for every request; requests[i] exchanges with rank peers[i]. Throws fn::Error(Mpi)
  // naming the peers whose requests are still open when the stall timeout passes.
  void wait_all(const char* what);

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_ = 0;
  long long calls_ = 0;  // collectives started, for messages
  std::vector<float> scratch_;
  std::vector<MPI_Request> requests_;
  std::vector<int> peers_;
};

}  // namespace fn

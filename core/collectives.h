// The collectives interface through which the CPU backend (and anything else in core/) reaches
// its tensor-parallel peers without seeing MPI (docs/design.md "Layout"). comm/mpi_collectives.h
// implements it over MPI; LocalCollectives below is the one-rank case used by TP=1 runs and tests.
// Invariant: every rank calls the same collectives in the same order with the same sizes, and a
// collective's result is bit-identical on every rank (docs/model.md §E.3). No wait is unbounded: a
// collective that waits longer than stall_timeout() for a peer names it in an fn::Error(Mpi).
#pragma once

#include <cstddef>
#include <functional>

namespace fn {

/// The default of --stall-timeout: seconds a collective waits for a peer (a decode step or a load
/// phase of any real model finishes far sooner; a stopped or hung rank never does).
inline constexpr double kDefaultStallTimeoutSeconds = 300;
/// The largest --stall-timeout (about 11.6 days; larger values would overflow the deadline).
inline constexpr double kMaxStallTimeoutSeconds = 1e6;

/// Sets the process-wide bound on how long one collective waits for its peers (--stall-timeout):
/// seconds >= 0, 0 = no bound. Read by collectives created afterwards (MpiCollectives). Throws
/// fn::Error(Usage) for a negative or non-finite value.
void set_stall_timeout(double seconds);
/// The bound set_stall_timeout set (kDefaultStallTimeoutSeconds until then).
double stall_timeout() noexcept;

/// Collective operations over the ranks of one tensor-parallel group.
class Collectives {
 public:
  virtual ~Collectives() = default;
  /// This process's rank in the group, 0 <= rank() < size().
  virtual int rank() const = 0;
  /// Number of ranks in the group (the TP size).
  virtual int size() const = 0;
  /// In place: data[i] = sum over ranks of data[i], n floats. Implementations must give every
  /// rank the bit-identical result (the MPI one sums in rank order 0..size-1 on every rank).
  /// Throws fn::Error(Mpi) on a communication failure, and when a peer's part has not come
  /// within the stall timeout (naming that rank).
  virtual void all_reduce_sum(float* data, std::size_t n) = 0;
  /// out[r * n_per_rank + i] = rank r's in[i]; out holds size() * n_per_rank floats and must not
  /// alias in. Throws fn::Error(Mpi) on a communication failure or a stalled peer (as above).
  virtual void all_gather(const float* in, std::size_t n_per_rank, float* out) = 0;
  /// Copies `bytes` bytes at data from rank `root` to every rank. Throws fn::Error(Mpi) on a
  /// communication failure or a stalled peer (as above), fn::Error(Internal) for a root outside
  /// the group.
  virtual void broadcast(void* data, std::size_t bytes, int root) = 0;
};

/// The single-rank group: rank 0 of 1; all_reduce_sum and broadcast leave the data as is,
/// all_gather copies in to out.
class LocalCollectives final : public Collectives {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(float* data, std::size_t n) override;
  void all_gather(const float* in, std::size_t n_per_rank, float* out) override;
  void broadcast(void* data, std::size_t bytes, int root) override;
};

/// Runs `f` on every rank of `coll`, then agrees on its outcome, so that an error only some
/// ranks hit (a file region or a device only one rank reads) is reported by rank 0 and ends
/// every rank alike. Collective: every rank calls it at the same point, and `f` must not
/// communicate (or must fail alike on every rank before it does). When `f` throws on one or more
/// ranks, every rank throws the fn::Error of the lowest failing rank r: its kind (a
/// std::exception other than fn::Error counts as Internal), its source location, its message
/// (as is when every rank failed with that same message; else prefixed "rank r: " when r != 0,
/// followed by "(also on rank(s) ...)" for the ranks with the same message and "(rank(s) ...
/// failed with other errors)" for the rest), and Error::on_every_rank() set. Returns normally
/// when `f` returned on every rank. Throws fn::Error(Mpi) when the agreement itself fails.
void agree_on_error(Collectives& coll, const std::function<void()>& f);

}  // namespace fn

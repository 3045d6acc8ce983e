// MpiCollectives (see mpi_collectives.h).
#include "comm/mpi_collectives.h"

#include <climits>
#include <cstdint>

#include "comm/mpi_check.h"

namespace fn {

namespace {
int checked_count(std::size_t n, const char* what) {
  FN_CHECK(n <= static_cast<std::size_t>(INT_MAX), "{}: {} elements exceed an MPI int count", what,
           n);
  return static_cast<int>(n);
}
}  // namespace

MpiCollectives::MpiCollectives(MPI_Comm comm) : comm_(comm) {
  FN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  FN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

void MpiCollectives::all_reduce_sum(float* data, std::size_t n) {
  if (size_ == 1 || n == 0) return;
  scratch_.resize(n * static_cast<std::size_t>(size_));
  const int count = checked_count(n, "all_reduce_sum");
  FN_MPI_CHECK(MPI_Allgather(data, count, MPI_FLOAT, scratch_.data(), count, MPI_FLOAT, comm_));
  // Fixed rank order on every rank: the result does not depend on the MPI reduction algorithm.
  for (std::size_t i = 0; i < n; ++i) {
    float acc = scratch_[i];
    for (int r = 1; r < size_; ++r) acc += scratch_[static_cast<std::size_t>(r) * n + i];
    data[i] = acc;
  }
}

void MpiCollectives::all_gather(const float* in, std::size_t n_per_rank, float* out) {
  const int count = checked_count(n_per_rank, "all_gather");
  FN_MPI_CHECK(MPI_Allgather(in, count, MPI_FLOAT, out, count, MPI_FLOAT, comm_));
}

void MpiCollectives::broadcast(void* data, std::size_t bytes, int root) {
  FN_CHECK(root >= 0 && root < size_, "broadcast: root {} outside a group of {}", root, size_);
  auto* p = static_cast<std::byte*>(data);
  while (bytes > 0) {
    const std::size_t chunk = bytes < (std::size_t{1} << 30) ? bytes : (std::size_t{1} << 30);
    FN_MPI_CHECK(MPI_Bcast(p, static_cast<int>(chunk), MPI_BYTE, root, comm_));
    p += chunk;
    bytes -= chunk;
  }
}

}  // namespace fn

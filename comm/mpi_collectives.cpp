// MpiCollectives (see mpi_collectives.h).
#include "comm/mpi_collectives.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>

#include "comm/mpi_check.h"

namespace fn {

namespace {

// Point-to-point tags of the collectives (any fixed values below MPI's guaranteed MPI_TAG_UB of
// 32767). Messages between two ranks with one tag are received in the order sent (MPI's
// non-overtaking rule), and every rank runs the same collectives in the same order, so each
// message meets the receive of the same collective.
constexpr int kTagGather = 0x4647;  // all_gather and all_reduce_sum
constexpr int kTagBcast = 0x4642;   // broadcast

// Polls before the waiting loop starts to sleep between polls: a peer a few microseconds late
// costs no sleep; one seconds late costs no busy core.
constexpr int kSpinPolls = 20000;
constexpr auto kPollSleep = std::chrono::microseconds(50);

int checked_count(std::size_t n, const char* what) {
  FN_CHECK(n <= static_cast<std::size_t>(INT_MAX), "{}: {} elements exceed an MPI int count", what,
           n);
  return static_cast<int>(n);
}

}  // namespace

MpiCollectives::MpiCollectives(MPI_Comm comm, double stall_timeout_s)
    : comm_(comm), timeout_s_(stall_timeout_s) {
  FN_REQUIRE(std::isfinite(stall_timeout_s) && stall_timeout_s >= 0 &&
                 stall_timeout_s <= kMaxStallTimeoutSeconds,
             Usage,
             "the stall timeout must be a number of seconds in [0, {:g}] (0: no bound), got {}",
             kMaxStallTimeoutSeconds, stall_timeout_s);
  FN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  FN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

void MpiCollectives::wait_all(const char* what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(timeout_s_));
  int done = 0;
  for (long polls = 0;; ++polls) {
    FN_MPI_CHECK(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done,
                             MPI_STATUSES_IGNORE));
    if (done) break;
    if (polls < kSpinPolls) continue;
    if (timeout_s_ > 0 && Clock::now() >= deadline) {
      // Completed requests are MPI_REQUEST_NULL; the others name the ranks that went silent.
      std::vector<int> silent;
      for (std::size_t i = 0; i < requests_.size(); ++i) {
        int one = 0;
        FN_MPI_CHECK(MPI_Test(&requests_[i], &one, MPI_STATUS_IGNORE));
        if (!one) silent.push_back(peers_[i]);
      }
      if (silent.empty()) break;  // everything arrived at the last moment
      std::sort(silent.begin(), silent.end());
      silent.erase(std::unique(silent.begin(), silent.end()), silent.end());
      // The open requests are abandoned: the job ends (MPI_Abort in main's error funnel).
      requests_.clear();
      peers_.clear();
      FN_THROW(Mpi,
               "rank{} {} went silent: rank {} waited more than {} s for {} part in {} "
               "(collective #{}); it stopped, hung or died (bound: --stall-timeout, 0 = none)",
               silent.size() > 1 ? "s" : "", fmt::join(silent, ", "), rank_, timeout_s_,
               silent.size() > 1 ? "their" : "its", what, calls_);
    }
    std::this_thread::sleep_for(kPollSleep);
  }
  requests_.clear();
  peers_.clear();
}

void MpiCollectives::all_gather(const float* in, std::size_t n_per_rank, float* out) {
  gather(in, n_per_rank, out, "all_gather");
}

void MpiCollectives::gather(const float* in, std::size_t n_per_rank, float* out, const char* what) {
  ++calls_;
  if (n_per_rank == 0) return;
  std::memcpy(out + static_cast<std::size_t>(rank_) * n_per_rank, in, n_per_rank * sizeof(float));
  if (size_ == 1) return;
  const int count = checked_count(n_per_rank, what);
  requests_.resize(2 * static_cast<std::size_t>(size_ - 1));
  peers_.clear();
  std::size_t i = 0;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    FN_MPI_CHECK(MPI_Irecv(out + static_cast<std::size_t>(p) * n_per_rank, count, MPI_FLOAT, p,
                           kTagGather, comm_, &requests_[i++]));
    peers_.push_back(p);
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    FN_MPI_CHECK(MPI_Isend(in, count, MPI_FLOAT, p, kTagGather, comm_, &requests_[i++]));
    peers_.push_back(p);
  }
  wait_all(what);
}

void MpiCollectives::all_reduce_sum(float* data, std::size_t n) {
  if (size_ == 1 || n == 0) {
    ++calls_;
    return;
  }
  scratch_.resize(n * static_cast<std::size_t>(size_));
  gather(data, n, scratch_.data(), "all_reduce_sum");
  // Fixed rank order on every rank: the result does not depend on the arrival order.
  for (std::size_t i = 0; i < n; ++i) {
    float acc = scratch_[i];
    for (int r = 1; r < size_; ++r) acc += scratch_[static_cast<std::size_t>(r) * n + i];
    data[i] = acc;
  }
}

void MpiCollectives::broadcast(void* data, std::size_t bytes, int root) {
  FN_CHECK(root >= 0 && root < size_, "broadcast: root {} outside a group of {}", root, size_);
  ++calls_;
  if (size_ == 1 || bytes == 0) return;
  constexpr std::size_t kChunk = std::size_t{1} << 30;
  auto* p = static_cast<std::byte*>(data);
  requests_.clear();
  peers_.clear();
  for (std::size_t off = 0; off < bytes; off += kChunk) {
    const int count = static_cast<int>(std::min(kChunk, bytes - off));
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || (rank_ != root && r != root)) continue;
      requests_.emplace_back();
      if (rank_ == root) {
        FN_MPI_CHECK(MPI_Isend(p + off, count, MPI_BYTE, r, kTagBcast, comm_, &requests_.back()));
      } else {
        FN_MPI_CHECK(MPI_Irecv(p + off, count, MPI_BYTE, r, kTagBcast, comm_, &requests_.back()));
      }
      peers_.push_back(r);
    }
  }
  wait_all("broadcast");
}

}  // namespace fn

// comm_stall_peer: the stall watchdog of MpiCollectives (run by comm_stall_peer.sh, label mpi).
// Every rank loops over all_reduce_sum, all_gather and broadcast, checking each result against
// the value every rank can compute; after 50 rounds the last rank stops taking part: `stop`
// raises SIGSTOP (as `kill -STOP` does), `sleep` sleeps 120 s (a hung rank). The others must end
// through the error funnel (MPI_Abort, exit 5) once the stall timeout (argv[2] seconds) passes,
// with a message naming the silent rank, never spin forever.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "comm/mpi_collectives.h"
#include "comm/mpi_context.h"
#include "core/error.h"
#include "core/log.h"

namespace {

using Clock = std::chrono::steady_clock;
Clock::time_point g_last_ok = Clock::now();

int run(fn::MpiContext& mpi, const std::string& mode, double timeout_s) {
  FN_REQUIRE(mode == "stop" || mode == "sleep", Usage, "comm_stall_peer: mode stop|sleep, not {}",
             mode);
  fn::MpiCollectives coll(mpi.world(), timeout_s);
  const int n = coll.size(), me = coll.rank();
  const bool victim = me == n - 1;
  std::vector<float> v(64), all(64 * static_cast<std::size_t>(n));
  for (int it = 0; it < 1000000; ++it) {
    if (victim && it == 50) {
      FN_LOG_WARN("comm_stall_peer: rank {} stops taking part ({})", me, mode);
      if (mode == "stop") std::raise(SIGSTOP);
      sleep(120);
      return 0;
    }
    // all_reduce_sum: rank r gives r + 1 (+ it); the sum is n(n+1)/2 + n·it, exact in FP32.
    for (auto& x : v) x = static_cast<float>(me + 1 + it % 7);
    coll.all_reduce_sum(v.data(), v.size());
    const float want = static_cast<float>(n * (n + 1) / 2 + n * (it % 7));
    for (float x : v) FN_REQUIRE(x == want, Internal, "round {}: sum {} != {}", it, x, want);
    // all_gather: rank r's block holds r.
    for (auto& x : v) x = static_cast<float>(me);
    coll.all_gather(v.data(), v.size(), all.data());
    for (std::size_t i = 0; i < all.size(); ++i)
      FN_REQUIRE(all[i] == static_cast<float>(i / v.size()), Internal, "round {}: gather", it);
    // broadcast from a rotating root.
    int word = me == it % n ? it : -1;
    coll.broadcast(&word, sizeof word, it % n);
    FN_REQUIRE(word == it, Internal, "round {}: broadcast gave {}", it, word);
    g_last_ok = Clock::now();
  }
  FN_LOG_ERROR("comm_stall_peer: every round completed although a rank stopped");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::unique_ptr<fn::MpiContext> mpi;
  int code = 1;
  try {
    mpi = std::make_unique<fn::MpiContext>(&argc, &argv);
    code = run(*mpi, argc > 1 ? argv[1] : "stop", argc > 2 ? std::atof(argv[2]) : 3.0);
    if (code == 0) {
      mpi.reset();
      return 0;
    }
  } catch (const fn::Error& e) {
    const double s = std::chrono::duration<double>(Clock::now() - g_last_ok).count();
    FN_LOG_ERROR("{} error: {}", fn::error_kind_name(e.kind()), e.what());
    FN_LOG_ERROR("comm_stall_peer: stall detected {:.2f} s after the last completed round", s);
    code = fn::exit_code(e.kind());
  }
  mpi.release();
  fn::MpiContext::abort_all(code);
}

// comm_dead_peer: the "no hang" check of the custom all-reduce (run by comm_dead_peer.sh).
// Every rank loops over small all-reduces; after 200 iterations the last rank stops taking
// part: `stuck` sleeps 120 s (a hung peer), `kill` raises SIGKILL (a dead one). The others must
// end with a clear error and a non-zero exit (MPI_Abort through the error funnel) once the
// bounded wait (FN_ALLREDUCE_TIMEOUT_MS) expires, never hang. Prints how long the failure took
// to detect, counted from the last completed all-reduce.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>

#include "comm/custom_all_reduce.h"
#include "comm/gpu_comm.h"
#include "comm/mpi_context.h"
#include "core/log.h"
#include "cuda/common/cuda_check.h"

namespace {

using Clock = std::chrono::steady_clock;
Clock::time_point g_last_ok = Clock::now();

int run(fn::MpiContext& mpi, const std::string& mode) {
  FN_REQUIRE(mode == "stuck" || mode == "kill", Usage, "comm_dead_peer: mode stuck|kill, not {}",
             mode);
  fn::GpuComm gpu(mpi);
  fn::CustomAllReduce ar(gpu, fn::CustomAllReduceOptions{});
  cudaStream_t stream = nullptr;
  FN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void* buf = nullptr;
  FN_CUDA_CHECK(cudaMalloc(&buf, 2560 * 4));
  FN_CUDA_CHECK(cudaMemset(buf, 0, 2560 * 4));
  const bool victim = mpi.world_rank() == mpi.world_size() - 1;
  for (int it = 0; it < 100000; ++it) {
    if (victim && it == 200) {
      FN_LOG_WARN("comm_dead_peer: rank {} stops taking part ({})", mpi.world_rank(), mode);
      if (mode == "kill") raise(SIGKILL);
      sleep(120);
      return 0;
    }
    ar.all_reduce_sum(buf, buf, 2560, fn::DType::F32, stream);
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    ar.check_health();
    g_last_ok = Clock::now();
  }
  FN_LOG_ERROR("comm_dead_peer: all iterations completed although a peer stopped");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::unique_ptr<fn::MpiContext> mpi;
  int code = 1;
  try {
    mpi = std::make_unique<fn::MpiContext>(&argc, &argv);
    code = run(*mpi, argc > 1 ? argv[1] : "stuck");
    if (code == 0) {
      mpi.reset();
      return 0;
    }
  } catch (const fn::Error& e) {
    const double s = std::chrono::duration<double>(Clock::now() - g_last_ok).count();
    FN_LOG_ERROR("{} error: {}", fn::error_kind_name(e.kind()), e.what());
    FN_LOG_ERROR("comm_dead_peer: failure detected {:.2f} s after the last completed all-reduce",
                 s);
    code = fn::exit_code(e.kind());
  }
  mpi.release();
  fn::MpiContext::abort_all(code);
}

// CustomAllReduce: the IPC all-reduce for a tensor-parallel group on one node (NVLink or other
// peer access). Each rank allocates its shared region (flags + receive slots) up front,
// exchanges cudaIpcMemHandle_t with MPI_Allgather and opens its peers'; calls push the payload
// into the peers' regions (one-shot LL packets for small messages, two-shot above), sum in
// fixed rank order (bitwise equal on every rank) and keep their epoch counter in device memory
// (CUDA-graph safe). Every wait is bounded: a dead or stuck peer becomes an fn::Error(Mpi) from
// check_health(), never a hang. Protocol: comm/custom_all_reduce_kernels.cu.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/custom_all_reduce_kernels.h"
#include "comm/device_all_reduce.h"

namespace fn {

/// Which kernel a call uses; Auto picks one-shot up to oneshot_max_bytes, two-shot above.
enum class AllReduceAlgo { Auto, OneShot, TwoShot };

/// Sizes and knobs; must be equal on every rank (checked at construction).
struct CustomAllReduceOptions {
  /// Largest payload of one one-shot launch (bytes); bigger one-shot calls are split. Auto
  /// uses one-shot up to this size. Env FN_ALLREDUCE_ONESHOT_MAX_BYTES overrides.
  std::size_t oneshot_max_bytes = std::size_t{1} << 20;
  /// Largest payload of one two-shot launch (bytes); bigger calls are split into launches.
  std::size_t twoshot_max_bytes = std::size_t{8} << 20;
  /// Bound on every wait, ms; <= 0 means env FN_ALLREDUCE_TIMEOUT_MS, else 5000.
  int64_t timeout_ms = 0;
  /// Epoch the counters start from (tests start just below the 32-bit wrap).
  uint32_t initial_epoch = 0;
  /// Test hook: the self-test flips one bit of rank 0's custom result (forces the fallback).
  bool corrupt_self_test = false;
};

/// See the file comment. Not copyable; destroy before the GpuComm it was built from.
class CustomAllReduce final : public DeviceAllReduce {
 public:
  /// Collective. Allocates and shares the region; throws fn::Error(Usage) when the group has
  /// more than 8 ranks or options differ between ranks, fn::Error(Cuda|Mpi) on failures.
  /// Does not check peer access (make_device_all_reduce does).
  CustomAllReduce(GpuComm& gpu, const CustomAllReduceOptions& options);
  /// Closes the peers' IPC handles and frees the region (no MPI call).
  ~CustomAllReduce() override;
  CustomAllReduce(const CustomAllReduce&) = delete;
  CustomAllReduce& operator=(const CustomAllReduce&) = delete;

  void all_reduce_sum(const void* in, void* out, std::size_t count, DType dtype,
                      cudaStream_t stream) override;
  /// As above with a forced algorithm (tests and comm_bench compare them).
  void all_reduce_sum(const void* in, void* out, std::size_t count, DType dtype,
                      cudaStream_t stream, AllReduceAlgo algo);
  const char* name() const noexcept override { return "custom"; }
  /// Throws fn::Error(Mpi) naming the rank waited for, the epoch and the timeout when a wait
  /// timed out (the peer died or stopped calling).
  void check_health() override;
  /// True once a wait timed out (no throw).
  bool failed() const noexcept;

  /// Collective startup self-test: custom (Auto) and `reference` all-reduce the same
  /// integer-valued F32 and BF16 data (exact in any summation order) at sizes covering both
  /// algorithms and ragged tails; compares the bytes. Returns true when every rank matched;
  /// otherwise false with a one-line report (also false when a wait timed out).
  bool self_test(DeviceAllReduce& reference, cudaStream_t stream, std::string* report);

  /// The algorithm Auto uses for a payload of `bytes`.
  AllReduceAlgo auto_algo(std::size_t bytes) const noexcept;
  const CustomAllReduceOptions& options() const noexcept { return options_; }

 private:
  void launch(const void* in, void* out, std::size_t count, bool bf16, cudaStream_t stream,
              AllReduceAlgo algo);

  GpuComm& gpu_;
  CustomAllReduceOptions options_;
  detail::ArLayout layout_;
  char* region_ = nullptr;                 // own shared region (cudaMalloc)
  std::vector<char*> peers_;               // every rank's region as mapped here
  detail::ArState* state_ = nullptr;       // device memory
  detail::ArError* error_host_ = nullptr;  // mapped host memory
  detail::ArError* error_dev_ = nullptr;
  uint64_t timeout_ns_ = 0;
  int64_t timeout_ms_ = 0;
  int oneshot_blocks_max_ = 1;
  int twoshot_blocks_max_ = 1;
  cudaStream_t stream_ = nullptr;  // the one stream this instance serves (set by the first call)
  bool stream_bound_ = false;
};

}  // namespace fn

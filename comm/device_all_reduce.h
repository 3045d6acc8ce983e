// The collectives interface of the CUDA path: an in-place-capable sum all-reduce over the
// tensor-parallel group, enqueued on a stream and legal inside CUDA graph capture. Two
// implementations: NCCL (NcclAllReduce) and the IPC custom all-reduce (CustomAllReduce,
// comm/custom_all_reduce.h). The engine picks one at startup with make_device_all_reduce()
// from `--allreduce auto|custom|nccl` and logs the choice once; never per token.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string_view>

#include "core/dtype.h"

namespace fn {

class GpuComm;
struct CustomAllReduceOptions;

/// out[i] = sum over ranks r of in_r[i]. Every rank calls with the same count and dtype, in
/// the same order. One instance serves one stream (never two calls in flight at once).
class DeviceAllReduce {
 public:
  virtual ~DeviceAllReduce() = default;
  /// Enqueues the all-reduce of `count` elements of `dtype` (F32 or BF16; BF16 sums in FP32)
  /// from `in` to `out` (device pointers, 16-byte aligned, may be equal) on `stream`.
  /// Capture-safe (no synchronisation, no allocation). Throws fn::Error(Internal) for another
  /// dtype or misaligned pointers, fn::Error(Cuda|Nccl) when enqueueing fails.
  virtual void all_reduce_sum(const void* in, void* out, std::size_t count, DType dtype,
                              cudaStream_t stream) = 0;
  /// "nccl" or "custom".
  virtual const char* name() const noexcept = 0;
  /// Throws fn::Error(Mpi) when an earlier call found a peer dead or stuck (a bounded wait
  /// timed out). Reads host memory only: call it after synchronising with the stream.
  virtual void check_health() {}
};

/// NCCL ncclAllReduce(ncclSum) on the GpuComm's communicator.
class NcclAllReduce final : public DeviceAllReduce {
 public:
  explicit NcclAllReduce(GpuComm& gpu) : gpu_(gpu) {}
  void all_reduce_sum(const void* in, void* out, std::size_t count, DType dtype,
                      cudaStream_t stream) override;
  const char* name() const noexcept override { return "nccl"; }

 private:
  GpuComm& gpu_;
};

/// The `--allreduce` values.
enum class AllReduceStrategy { Auto, Custom, Nccl };

/// Parses "auto", "custom" or "nccl"; throws fn::Error(Usage) naming --allreduce otherwise.
AllReduceStrategy parse_all_reduce_strategy(std::string_view text);
/// "auto", "custom", "nccl".
const char* all_reduce_strategy_name(AllReduceStrategy strategy) noexcept;

/// Collective. Builds the all-reduce for `strategy` and logs the choice once (rank 0):
/// - nccl: NcclAllReduce.
/// - auto: CustomAllReduce where gpu.custom_all_reduce_possible() (one node, peer access,
///   FN_DISABLE_P2P unset) and its startup self-test against NCCL passes; NCCL otherwise.
/// - custom: as auto, but missing peer access is an error (fn::Error(Usage)); a failed
///   self-test still falls back to NCCL, logged as an error.
std::unique_ptr<DeviceAllReduce> make_device_all_reduce(AllReduceStrategy strategy, GpuComm& gpu,
                                                        const CustomAllReduceOptions& options);

}  // namespace fn

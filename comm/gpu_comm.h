// GPU bootstrap of the CUDA path: each rank drives the GPU numbered by its node-local rank,
// checked to be present and not shared with another rank, and joins one NCCL communicator
// over all ranks (ncclUniqueId from rank 0 by MPI_Bcast). Created once after MpiContext by
// the CUDA backend (and by comm tests/bench); collective: every rank constructs it together.
// Also decides, identically on every rank, whether the IPC custom all-reduce may be used.
#pragma once

#include <mpi.h>
#include <nccl.h>

#include <string>
#include <vector>

namespace fn {

class MpiContext;

/// The ranks of the tensor-parallel group and this rank's place on its node.
struct GpuGroup {
  MPI_Comm comm = MPI_COMM_NULL;  ///< the group (the world; not freed by GpuComm)
  int rank = 0;
  int size = 1;
  int local_rank = 0;  ///< among the group's ranks on this node: picks the GPU
  int local_size = 1;
};

/// The group of MpiContext's world.
GpuGroup gpu_group(const MpiContext& mpi);
/// The same, computed from MPI_COMM_WORLD directly (MPI initialised; for tests and tools that
/// do not own the MpiContext). Collective.
GpuGroup gpu_group_of_world();

/// The GPU this rank drives and the PCI bus ids / UUIDs of every rank's GPU.
struct GpuSelection {
  int device = -1;                   ///< CUDA ordinal in this process
  std::vector<std::string> bus_ids;  ///< per world rank, "0000:19:00.0" form
  std::vector<std::string> uuids;    ///< per world rank, "GPU-xxxxxxxx-..." form
};

/// Selects and activates (cudaSetDevice) this rank's GPU: `device_override` when >= 0, else
/// the node-local rank. Collective over group.comm. Throws fn::Error(Cuda) when there is no
/// usable GPU or fewer GPUs than local ranks (naming the rank and CUDA_VISIBLE_DEVICES), and
/// fn::Error(Usage) on every rank when two ranks landed on one GPU (same UUID).
GpuSelection select_gpu(const GpuGroup& group, int device_override = -1);

/// Device, NCCL communicator and peer-access facts for the tensor-parallel group (= world).
class GpuComm {
 public:
  /// Collective. Selects the GPU (select_gpu), sets NCCL_NVLS_ENABLE=0 (never NVLink
  /// multicast), creates the NCCL communicator, registers an abort hook (ncclCommAbort) and
  /// decides custom_all_reduce_possible(). Throws fn::Error(Cuda|Nccl|Mpi|Usage).
  explicit GpuComm(const GpuGroup& group, int device_override = -1);
  /// GpuComm(gpu_group(mpi), device_override).
  explicit GpuComm(const MpiContext& mpi, int device_override = -1);
  /// ncclCommDestroy, or ncclCommAbort when unwinding from an exception (no MPI call).
  ~GpuComm();
  GpuComm(const GpuComm&) = delete;
  GpuComm& operator=(const GpuComm&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int device() const noexcept { return selection_.device; }
  MPI_Comm mpi_comm() const noexcept { return mpi_comm_; }
  ncclComm_t nccl() const noexcept { return nccl_; }
  const GpuSelection& selection() const noexcept { return selection_; }

  /// True (on every rank alike) when all ranks share one node and every GPU can access every
  /// other one (cudaDeviceCanAccessPeer); false with the reason otherwise. The environment
  /// variable FN_DISABLE_P2P=1 makes the peer-access check fail (to test the NCCL fallback).
  bool custom_all_reduce_possible(std::string* why = nullptr) const;

  /// ncclCommAbort (idempotent, never throws): the fatal-error path; also run by the abort
  /// hook that MpiContext::abort_all calls before MPI_Abort.
  void abort() noexcept;

 private:
  int rank_ = 0;
  int size_ = 1;
  MPI_Comm mpi_comm_ = MPI_COMM_NULL;
  GpuSelection selection_;
  ncclComm_t nccl_ = nullptr;
  bool custom_possible_ = false;
  std::string custom_why_;
  int abort_hook_ = 0;
};

}  // namespace fn

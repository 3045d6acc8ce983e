// Launch interface of the IPC custom all-reduce kernels (comm/custom_all_reduce_kernels.cu).
// Called only by CustomAllReduce (comm/custom_all_reduce.cpp), which owns the buffers that the
// params point into; plain C++ (no CUDA syntax) so host code includes it from .cpp files.
// Protocol and invariants: see the comment at the top of custom_all_reduce_kernels.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fn::detail {

inline constexpr int kArMaxRanks = 8;    ///< most ranks one custom all-reduce serves
inline constexpr int kArMaxBlocks = 64;  ///< most CTAs of a two-shot launch (flags per CTA)
/// Every (1 << kArSweepBits) epochs the epoch's parity flags are rewritten (see the .cu).
inline constexpr int kArSweepBits = 20;

/// Per-communicator state in ordinary device memory of this rank (not shared).
struct ArState {
  uint32_t epoch;  ///< epoch of the last finished call; a call runs at epoch + 1
  uint32_t done;   ///< CTAs of the running call that finished (the last one advances epoch)
  uint32_t abort;  ///< set once a wait timed out: later calls do nothing
  uint32_t pad;
};

/// Written once by the first CTA whose wait timed out; lives in mapped host memory so the host
/// reads it without synchronising.
struct ArError {
  uint32_t code;   ///< 0 none, 1 timeout
  uint32_t peer;   ///< rank waited for
  uint32_t epoch;  ///< epoch of the call
  uint32_t block;  ///< CTA index
  uint32_t phase;  ///< 0 one-shot, 1 two-shot reduce-scatter, 2 two-shot all-gather
  uint32_t pad[3];
};

/// Layout of each rank's shared (IPC) region, identical on every rank:
///   [flags: 2 parity x 2 phase x kArMaxRanks src x kArMaxBlocks CTA, uint32 epochs]
///   [one-shot LL slots: 2 parity x world src x ll_slot_bytes]
///   [two-shot slots:    2 parity x world src x ts_slot_bytes]
struct ArLayout {
  uint64_t flags_offset = 0;
  uint64_t ll_offset = 0;
  uint64_t ll_slot_bytes = 0;  ///< 16-byte packets carrying 8 payload bytes each
  uint64_t ts_offset = 0;
  uint64_t ts_slot_bytes = 0;
  uint64_t total_bytes = 0;
};

/// One launch (one epoch) of the custom all-reduce.
struct ArParams {
  const void* in = nullptr;  ///< [count] F32 or BF16, 16-byte aligned, device memory
  void* out = nullptr;       ///< [count], may equal in
  uint64_t count = 0;        ///< elements in this launch
  int rank = 0;
  int world = 1;
  char* bases[kArMaxRanks] = {};  ///< every rank's shared region as mapped here ([rank] = own)
  ArLayout layout;
  ArState* state = nullptr;  ///< this rank's state (device memory)
  ArError* error = nullptr;  ///< device pointer of the mapped host ArError
  uint64_t timeout_ns = 0;   ///< bound on every wait (globaltimer ns)
  int blocks = 1;            ///< grid size; a function of count only, so equal on all ranks
};

/// Sizes the shared region for `world` ranks (one-shot payload up to ll_max_bytes per launch,
/// two-shot payload up to ts_max_bytes per launch).
ArLayout make_ar_layout(int world, std::size_t ll_max_bytes, std::size_t ts_max_bytes);

/// Fills the flags and LL packet flags of `own` (this rank's region) with `epoch`, data with 0.
void launch_ar_init(char* own, const ArLayout& layout, int world, uint32_t epoch,
                    cudaStream_t stream);
/// Threads per CTA of the one-shot / two-shot kernels (the host sizes grids with them).
int ar_oneshot_threads();
int ar_twoshot_threads();
/// One-shot push (LL packets: 8 payload bytes + the epoch twice per 16-byte store).
/// bf16 selects BF16 (else F32). Enqueues only (capture-safe), as a programmatic dependent
/// launch when fn::pdl_enabled() (cuda/common/pdl.h) on an sm_90+ device; throws
/// fn::Error(Cuda).
void launch_ar_oneshot(const ArParams& params, bool bf16, cudaStream_t stream);
/// Two-shot push: reduce-scatter into the owner's slots, then all-gather of reduced shards.
/// Launched and checked as launch_ar_oneshot.
void launch_ar_twoshot(const ArParams& params, bool bf16, cudaStream_t stream);

}  // namespace fn::detail

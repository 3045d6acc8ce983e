// Shared-memory ring primitives of the sm_90+ bulk-copy kernels (cuda/kernels/moe_nvfp4_bulk.cu:
// the routed gate+up; cuda/kernels/moe_grouped.cu: the grouped routed experts): mbarrier
// initialisation, arrival, transaction-count arrival and parity wait, and cp.async.bulk from
// global into shared memory completing on an mbarrier (the TMA engine, no tensor map). Device
// code of sm_90+ only (empty elsewhere: callers guard their kernels the same way). Included by .cu
// files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fn::bulk {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/// The shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// Initialises the mbarrier at bar (shared memory, 8-byte aligned) for `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

/// One arrival on bar (release semantics: this thread's earlier shared-memory reads are done).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

/// One arrival on bar that also expects `bytes` transaction bytes (the bulk copies' total) in
/// the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

/// Spins until the phase of bar with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
}

/// bytes (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst,
/// completing as transaction bytes on bar.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
#endif  // sm_90+

}  // namespace fn::bulk

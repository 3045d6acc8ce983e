// Shared-memory ring primitives of the sm_90+ bulk-copy kernels (cuda/kernels/moe_nvfp4_bulk.cu:
// the routed gate+up; cuda/kernels/moe_grouped.cu: the grouped routed experts): mbarrier
// initialisation (one ring's, init_ring), arrival, transaction-count arrival, parity wait and the
// stage/parity step (next_stage), and cp.async.bulk from
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

/// Thread 0 of the CTA initialises a ring of `stages` stages: full[s] completes on the producer's
/// one arrival plus its copies' transaction bytes, empty[s] on `consumers` consumer arrivals; then
/// the initialisation is made visible to the async proxy. The caller synchronises the CTA after.
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int stages,
                                          uint32_t consumers) {
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) {
    mbar_init(full + s, 1);
    mbar_init(empty + s, consumers);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/// The next stage of a ring of `stages`: wraps to 0 and flips the phase parity.
__device__ __forceinline__ void next_stage(int& stage, uint32_t& parity, int stages) {
  if (++stage == stages) {
    stage = 0;
    parity ^= 1u;
  }
}
#endif  // sm_90+

}  // namespace fn::bulk

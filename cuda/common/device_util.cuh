// Small device helpers shared by the decode kernels in cuda/*.cu: streaming 16-byte loads, async
// global -> shared copies (cp.async, their commit groups and waits), exact BF16/FP16-bit unpacking,
// SiLU, mailbox slots. Device code only; included by .cu files, never by host headers. Every helper
// is exact bit manipulation except silu (expf).
#pragma once

#include <cstdint>

namespace fn::dev {

/// 16-byte load of data read exactly once per kernel (weights): non-coherent path, no L1
/// allocation so the L1 keeps the activations every row re-reads. The data must not change while
/// the kernel runs. PTX ISA 7.4, sm_70+.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

/// Asynchronous 16-byte copy global -> shared of data no kernel writes while this one runs
/// (weights): cp.async.cg (sm_80+, bypasses L1; the copy lands after cp_async_wait_all), a plain
/// streaming load and shared store below sm_80. Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
#else
  *static_cast<uint4*>(smem) = ld_stream16(gmem);
#endif
}

/// Asynchronous 4-byte copy global -> shared (cp.async.ca, sm_80+; a plain load and store below),
/// for data earlier kernels wrote (a cache row, a block key). Both addresses 4-byte aligned.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem) : "memory");
#else
  *static_cast<uint32_t*>(smem) = *static_cast<const uint32_t*>(gmem);
#endif
}

/// Waits until every cp_async16 of the calling thread has landed (cp.async.wait_all); the block
/// still needs a __syncthreads() before other threads read the copies. No-op below sm_80.
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

/// Closes the calling thread's cp.async copies issued since its last commit into one group
/// (cp.async.commit_group, sm_80+). No-op below sm_80, where the copies land at once.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

/// Waits until at most N of the calling thread's committed groups are still in flight
/// (cp.async.wait_group N); the block still needs a __syncthreads() before other threads read
/// the copies. No-op below sm_80.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

/// 16-byte read-only load that may stay in L1 (activations re-read by many rows).
__device__ __forceinline__ uint4 ld_cached16(const void* p) {
  return __ldg(static_cast<const uint4*>(p));
}

/// The low BF16 of a packed pair as float (exact).
__device__ __forceinline__ float bf16_lo(uint32_t v) {
  return __uint_as_float(v << 16);
}
/// The high BF16 of a packed pair as float (exact).
__device__ __forceinline__ float bf16_hi(uint32_t v) {
  return __uint_as_float(v & 0xffff0000u);
}

/// acc + dot(8 BF16 weights (one 16-byte load), 8 FP32 x values): a chain of fmaf in ascending
/// column order (deterministic). The inner step of the BF16 GEMVs (gemv_bf16.cu, hc.cu).
__device__ __forceinline__ float fma8_bf16(uint4 w, const float (&xf)[8], float acc) {
  acc = fmaf(bf16_lo(w.x), xf[0], acc);
  acc = fmaf(bf16_hi(w.x), xf[1], acc);
  acc = fmaf(bf16_lo(w.y), xf[2], acc);
  acc = fmaf(bf16_hi(w.y), xf[3], acc);
  acc = fmaf(bf16_lo(w.z), xf[4], acc);
  acc = fmaf(bf16_hi(w.z), xf[5], acc);
  acc = fmaf(bf16_lo(w.w), xf[6], acc);
  acc = fmaf(bf16_hi(w.w), xf[7], acc);
  return acc;
}

/// float -> BF16 bits, round to nearest even, NaN kept quiet (matches fn::float_to_bf16).
__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// The HC inject of one residual value (docs/model.md §C.3, after the block): h + iota * y, the
/// product and the sum each rounded once in FP32 (no FMA), as fn::cpu::hc_inject. The inject
/// kernel and the down pass's folded inject (hc.cu) both go through it.
__device__ __forceinline__ float hc_inject_value(float h, float iota, float y) {
  return __fadd_rn(h, __fmul_rn(iota, y));
}

/// x * sigmoid(x) in FP32 (docs/model.md §C.7 SwiGLU). expf, not __expf: ~2 ulp.
__device__ __forceinline__ float silu(float x) {
  return x / (1.0f + expf(-x));
}

/// Sums acc[] over the `team` lanes (a power of two, 8..kBlockThreads) of each team, teams being
/// aligned groups of consecutive threads. The result is valid in the team's lane 0. Fixed order
/// (butterfly inside a warp, then the team's warps ascending), so bitwise reproducible. Every
/// thread of the block must call it (it may __syncthreads when team > 32).
template <int kN, int kBlockThreads>
__device__ __forceinline__ void team_reduce(float (&acc)[kN], int team, int lane_in_team) {
  const int width = team < 32 ? team : 32;
#pragma unroll
  for (int r = 0; r < kN; ++r)
    for (int off = width >> 1; off > 0; off >>= 1)
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
  if (team > 32) {  // uniform over the block: team is a launch parameter
    __shared__ float partial[kBlockThreads / 32][kN];
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int r = 0; r < kN; ++r) partial[warp][r] = acc[r];
    }
    __syncthreads();
    if (lane_in_team == 0) {
      const int count = team >> 5;
#pragma unroll
      for (int r = 0; r < kN; ++r) {
        float s = partial[warp][r];
        for (int i = 1; i < count; ++i) s += partial[warp + i][r];
        acc[r] = s;
      }
    }
  }
}

// ---- Mailbox slots ----------------------------------------------------------------------
// One block waits for values that the other blocks of its grid store, without an arrival ticket:
// a slot holds kMailEmpty (all bits set) until its value is posted, and the waiting block reads
// each slot until it is no longer empty. A value is never posted with the empty bits (a NaN; the
// poster names the NaN bits that stand in for it). Relaxed gpu-scope accesses: the
// waiter reads only the slots themselves, so no fence orders anything else. Users: the router's
// top-k (cuda/kernels/moe_device.cuh), the QSA select (cuda/kernels/qsa.cu).
constexpr uint32_t kMailEmpty = 0xffffffffu;

/// A 32-bit word of global memory stored / loaded relaxed at gpu scope: the accesses of the
/// mailbox slots, the done flags and the join words below.
__device__ __forceinline__ void st_relaxed_u32(void* p, uint32_t bits) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(bits) : "memory");
}
__device__ __forceinline__ uint32_t ld_relaxed_u32(const void* p) {
  uint32_t b;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(b) : "l"(p) : "memory");
  return b;
}

/// Stores `bits` into a mailbox slot (relaxed, gpu scope).
__device__ __forceinline__ void mail_store(float* slot, uint32_t bits) {
  st_relaxed_u32(slot, bits);
}

/// Posts v; a v whose bits are kMailEmpty (a NaN) is posted as `empty_as` instead.
__device__ __forceinline__ void mail_post(float* slot, float v, uint32_t empty_as) {
  const uint32_t b = __float_as_uint(v);
  mail_store(slot, b == kMailEmpty ? empty_as : b);
}

/// The slot's bits now (relaxed, gpu scope): kMailEmpty until posted.
__device__ __forceinline__ uint32_t mail_peek(const float* slot) {
  return ld_relaxed_u32(slot);
}

/// The slot's value, read until posted. The poster must be resident or done, else this spins
/// forever (the callers' posters are blocks of the same grid, each of which posts its slots
/// without waiting for anything).
__device__ __forceinline__ float mail_wait(const float* slot) {
  uint32_t b = mail_peek(slot);
  while (b == kMailEmpty) b = mail_peek(slot);
  return __uint_as_float(b);
}

// ---- Done flags -----------------------------------------------------------------------
// One CTA of a grid still running tells CTAs of a later launch that its results are out, where
// the later launch's programmatic wait covers a different predecessor (the QSA select beside the
// overlapped projection, cuda/kernels/qsa.cu). The flag is zeroed by a kernel that both sides
// follow.

/// Publishes the caller's CTA's earlier writes (ordered before this thread by a barrier), then
/// sets *flag = 1 (relaxed, gpu scope). One thread.
__device__ __forceinline__ void flag_publish(int* flag) {
  __threadfence();
  st_relaxed_u32(flag, 1u);
}

/// Reads *flag until it is 1, then fences so that this thread's later reads (and those the
/// caller's barrier orders after it) see what the publisher wrote before flag_publish. The
/// publisher must be resident or done, else this spins forever. One thread.
__device__ __forceinline__ void flag_wait(const int* flag) {
  while (ld_relaxed_u32(flag) != 1u) {
  }
  __threadfence();
}

// ---- Join words ---------------------------------------------------------------------------
// A launch that needs the results of a launch other than its stream predecessor (which it waits
// for programmatically): the writer's CTAs each add one signal (the low 16 bits) after their
// results; every reader CTA waits for the full count, then adds a reader ticket (the high 16
// bits), and the last reader resets the word to 0 for the next use. The word starts at 0
// (zeroed once at allocation) and is 0 again after every use.

/// One signal after the calling CTA's results (ordered before this thread by a barrier).
__device__ __forceinline__ void join_signal(unsigned* word) {
  __threadfence();
  atomicAdd(word, 1u);
}

/// Waits until *word counts `signals` signals, fences (this thread's later reads, and those its
/// barrier orders after it, see the writers' results), then takes a reader ticket; the last of
/// `readers` readers resets the word. One thread per reader CTA. The writers must be resident or
/// done, else this spins forever.
__device__ __forceinline__ void join_wait(unsigned* word, unsigned signals, unsigned readers) {
  while ((ld_relaxed_u32(word) & 0xffffu) != signals) {
  }
  __threadfence();
  if ((atomicAdd(word, 0x10000u) >> 16) == readers - 1) atomicExch(word, 0u);
}

/// Order-preserving key of a float (the sampler's and the top log-probs' ranking): a larger
/// value gives a larger key; -0 and +0 give the same key (they tie on the host); NaN gives 0,
/// below every number (-Inf is 0x007fffff).
__device__ __forceinline__ uint32_t order_key(float l) {
  if (isnan(l)) return 0u;
  if (l == 0.0f) l = 0.0f;
  const uint32_t u = __float_as_uint(l);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// The float of a nonzero order_key.
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

}  // namespace fn::dev

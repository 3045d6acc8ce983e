// Kernels of the IPC custom all-reduce (CustomAllReduce, comm/custom_all_reduce.h).
//
// Protocol (every rank runs the same launches, in the same order, on one stream):
// - A call runs at epoch e = state.epoch + 1 (uint32, wraps). The last CTA of the call to
//   finish (a `done` counter) stores state.epoch = e, so the counter lives in device memory
//   and advances on every CUDA-graph replay; nothing on the host is baked into a graph.
// - Each rank's shared region has two halves selected by the parity e & 1. A peer can be at
//   most one call ahead of us (it cannot finish call e+1 before we have sent our part of e+1,
//   which we do only after finishing e), so while we read parity e & 1 it writes the other one.
// - One-shot (small messages): LL packets. A 16-byte store {data0, e, data1, e} carries 8
//   payload bytes and the epoch twice; each 8-byte half is written atomically (NCCL's LL
//   protocol), so a reader that sees e in both flag words sees both data words. Each rank
//   pushes its payload into slot [e&1][its rank] of every rank (itself included), then polls its
//   own slots. No barrier, no fence, no clearing: a packet is valid when its flags equal e.
// - Two-shot (large messages): rank q owns shard q. Phase 1 pushes shard q of the input to
//   rank q's slot [e&1][src]; a CTA-level flag (st.release.sys after the CTA's stores) per
//   (phase, src, CTA) says "arrived"; rank q sums its shard and pushes the sum into the same
//   slot array of every peer (the shard-q region, unused by phase 1); phase-2 flags; gather.
//   Only same-index CTAs talk to each other, and the partition of elements to CTAs is a
//   function of count only, so it is the same on every rank.
// - Sum order is fixed (rank 0, 1, ..., world-1, in FP32, then one rounding to the payload
//   type), so every rank computes bitwise the same result (two-shot: the owner computes it).
// - Flags are compared for equality with e. A slot untouched for 2^32 calls could hold a stale
//   value equal to e; to exclude that, every 2^kArSweepBits epochs (and right after the wrap)
//   the call's last CTA rewrites every flag of its parity to e once all CTAs have consumed.
// - Every wait is bounded (timeout_ns by %globaltimer). On timeout the CTA records who it waited
//   for in mapped host memory (ArError), sets state.abort, and the call and all later calls
//   return without waiting; the host reports the error (CustomAllReduce::check_health).
// - Grids never exceed the smallest multiprocessor count of the group, so every CTA of a call
//   can be resident at once (a CTA waits only for its same-index peer CTAs).
// - Programmatic dependent launch (cuda/common/pdl.cuh: the decode kernels' switch
//   fn::pdl_enabled() and device check): each kernel waits for the previous kernel of the stream
//   to complete before any read (the payload, the epoch), then lets the next kernel be scheduled
//   at once, so that kernel's blocks become resident and stage their weights while this one
//   waits on its peers (its own wait still waits for this grid's completion).
#include "comm/custom_all_reduce_kernels.h"

#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.cuh"

namespace fn::detail {

namespace {

constexpr int kLlThreads = 256;  // one 16-byte packet per thread per step
constexpr int kTsThreads = 512;  // as vLLM's two-stage kernel (36 x 512 there)
constexpr int kFlagsPerParity = 2 * kArMaxRanks * kArMaxBlocks;

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr)
               : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile_v4(uint4* ptr, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(ptr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* ptr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* ptr) {
  return *reinterpret_cast<const volatile uint32_t*>(ptr);
}

// ---- payload words: 32 bits hold one F32 or two BF16 ------------------------------------------

template <bool kBf16>
struct Payload {
  static constexpr int kPerWord = kBf16 ? 2 : 1;
};

// acc[0..kPerWord) = (first ? 0 : acc) + word's values, in FP32.
template <bool kBf16>
__device__ __forceinline__ void acc_word(float* acc, uint32_t w, bool first) {
  if constexpr (kBf16) {
    const float lo = __uint_as_float(w << 16);
    const float hi = __uint_as_float(w & 0xffff0000u);
    acc[0] = first ? lo : acc[0] + lo;
    acc[1] = first ? hi : acc[1] + hi;
  } else {
    const float v = __uint_as_float(w);
    acc[0] = first ? v : acc[0] + v;
  }
}

// FP32 -> BF16 bits, round to nearest even (what __float2bfloat16_rn does; NaN stays NaN).
__device__ __forceinline__ uint32_t bf16_rne(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

template <bool kBf16>
__device__ __forceinline__ uint32_t pack_word(const float* acc) {
  if constexpr (kBf16) {
    return bf16_rne(acc[0]) | (bf16_rne(acc[1]) << 16);
  } else {
    return __float_as_uint(acc[0]);
  }
}

// Loads N payload words starting at word w0 of a [count]-element array; elements past count
// read as 0 (the padding of the last packet/vector).
template <bool kBf16, int N>
__device__ __forceinline__ void load_words(const void* base, uint64_t w0, uint64_t count,
                                           uint32_t (&w)[N]) {
  constexpr int kPer = Payload<kBf16>::kPerWord;
  const uint64_t e0 = w0 * kPer;
  const uint32_t* words = static_cast<const uint32_t*>(base) + w0;
  if (e0 + N * kPer <= count) {
    if constexpr (N == 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(words);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(words);
      w[0] = v.x, w[1] = v.y;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) w[j] = 0;
  if constexpr (kBf16) {
    const uint16_t* elems = static_cast<const uint16_t*>(base);
    for (int k = 0; k < 2 * N; ++k) {
      if (e0 + k < count) w[k / 2] |= static_cast<uint32_t>(elems[e0 + k]) << (16 * (k % 2));
    }
  } else {
    for (int k = 0; k < N; ++k) {
      if (e0 + k < count) w[k] = words[k];
    }
  }
}

// Stores N payload words at word w0; elements past count are not written.
template <bool kBf16, int N>
__device__ __forceinline__ void store_words(void* base, uint64_t w0, uint64_t count,
                                            const uint32_t (&w)[N]) {
  constexpr int kPer = Payload<kBf16>::kPerWord;
  const uint64_t e0 = w0 * kPer;
  uint32_t* words = static_cast<uint32_t*>(base) + w0;
  if (e0 + N * kPer <= count) {
    if constexpr (N == 4) {
      *reinterpret_cast<uint4*>(words) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      *reinterpret_cast<uint2*>(words) = make_uint2(w[0], w[1]);
    }
    return;
  }
  if constexpr (kBf16) {
    uint16_t* elems = static_cast<uint16_t*>(base);
    for (int k = 0; k < 2 * N; ++k) {
      if (e0 + k < count) elems[e0 + k] = static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2)));
    }
  } else {
    for (int k = 0; k < N; ++k) {
      if (e0 + k < count) words[k] = w[k];
    }
  }
}

// ---- shared-region addressing (ArLayout) ------------------------------------------------------

__device__ __forceinline__ uint4* ll_slot(const ArParams& p, char* base, uint32_t par, int src) {
  return reinterpret_cast<uint4*>(base + p.layout.ll_offset +
                                  (static_cast<uint64_t>(par) * p.world + src) *
                                      p.layout.ll_slot_bytes);
}

__device__ __forceinline__ uint4* ts_slot(const ArParams& p, char* base, uint32_t par, int src) {
  return reinterpret_cast<uint4*>(base + p.layout.ts_offset +
                                  (static_cast<uint64_t>(par) * p.world + src) *
                                      p.layout.ts_slot_bytes);
}

__device__ __forceinline__ uint32_t* flag_at(const ArParams& p, char* base, uint32_t par, int phase,
                                             int src, int block) {
  return reinterpret_cast<uint32_t*>(base + p.layout.flags_offset) +
         ((par * 2 + phase) * kArMaxRanks + src) * kArMaxBlocks + block;
}

// ---- timeouts, epoch advance, sweep -----------------------------------------------------------

// First timed-out CTA of this rank records the facts for the host; every later wait gives up.
__device__ void report_timeout(const ArParams& p, uint32_t e, int peer, int phase) {
  if (atomicCAS(&p.state->abort, 0u, 1u) == 0u) {
    volatile ArError* err = p.error;
    err->peer = static_cast<uint32_t>(peer);
    err->epoch = e;
    err->block = blockIdx.x;
    err->phase = static_cast<uint32_t>(phase);
    __threadfence_system();
    err->code = 1;
    __threadfence_system();
  }
}

// Polls an LL packet until both flag words equal e; false on timeout or abort.
__device__ bool wait_packet(const ArParams& p, const uint4* slot, uint32_t e, int src, uint4& v) {
  const uint64_t start = globaltimer_ns();
  for (uint32_t spin = 1;; ++spin) {
    v = ld_volatile_v4(slot);
    if (v.y == e && v.w == e) return true;
    if ((spin & 255u) == 0u) {
      if (ld_volatile_u32(&p.state->abort) != 0u) return false;
      if (globaltimer_ns() - start > p.timeout_ns) {
        report_timeout(p, e, src, 0);
        return false;
      }
    }
  }
}

// Rewrites every flag of parity `par` to e (see the protocol notes). Called by one CTA after
// all CTAs of this rank have consumed the call's data.
__device__ void sweep_flags(const ArParams& p, uint32_t e, uint32_t par) {
  char* own = p.bases[p.rank];
  const uint64_t packets = p.layout.ll_slot_bytes / 16 * static_cast<uint64_t>(p.world);
  uint32_t* ll = reinterpret_cast<uint32_t*>(ll_slot(p, own, par, 0));
  for (uint64_t i = threadIdx.x; i < packets; i += blockDim.x) {
    ll[4 * i + 1] = e;
    ll[4 * i + 3] = e;
  }
  uint32_t* flags =
      reinterpret_cast<uint32_t*>(own + p.layout.flags_offset) + par * kFlagsPerParity;
  for (int i = threadIdx.x; i < kFlagsPerParity; i += blockDim.x) flags[i] = e;
}

// End of every call: the last CTA to finish sweeps (periodically) and publishes the epoch.
// A programmatic dependent launch of `kernel` with p.blocks CTAs of `threads` (launch_pdl: the
// attribute when fn::pdl_enabled() on an sm_90+ device). Throws fn::Error(Cuda) naming `what`.
template <typename Kernel>
void launch_ar(Kernel kernel, int threads, const ArParams& p, cudaStream_t stream,
               const char* what) {
  launch_pdl(what, kernel, dim3(static_cast<unsigned>(p.blocks)),
             dim3(static_cast<unsigned>(threads)), 0, stream, p);
}

__device__ void finish_call(const ArParams& p, uint32_t e, int* s_last) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t prev = atomicAdd(&p.state->done, 1u);
    *s_last = prev == gridDim.x - 1 ? 1 : 0;
    __threadfence();
  }
  __syncthreads();
  if (*s_last == 0) return;
  if ((e & ((1u << kArSweepBits) - 1u)) < 2u && ld_volatile_u32(&p.state->abort) == 0u) {
    sweep_flags(p, e, e & 1u);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    p.state->done = 0;
    p.state->epoch = e;
  }
}

// ---- one-shot -------------------------------------------------------------------------------

template <bool kBf16>
__global__ void __launch_bounds__(kLlThreads) ar_oneshot_kernel(ArParams p) {
  dev::pdl_begin();  // before any read: the payload and the epoch come from earlier kernels
  __shared__ uint32_t s_epoch;
  __shared__ int s_last;
  if (threadIdx.x == 0) s_epoch = ld_volatile_u32(&p.state->epoch) + 1u;
  __syncthreads();
  const uint32_t e = s_epoch;
  const uint32_t par = e & 1u;
  constexpr int kPer = Payload<kBf16>::kPerWord;
  const uint64_t words = (p.count + kPer - 1) / kPer;
  const uint64_t packets = (words + 1) / 2;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  bool failed = ld_volatile_u32(&p.state->abort) != 0u;
  if (!failed) {
    // Push: my packet i into slot [par][my rank] of every rank (me included).
    for (uint64_t i = first; i < packets; i += stride) {
      uint32_t w[2];
      load_words<kBf16, 2>(p.in, 2 * i, p.count, w);
      const uint4 packet = make_uint4(w[0], e, w[1], e);
      for (int r = 0; r < p.world; ++r)
        st_volatile_v4(ll_slot(p, p.bases[r], par, p.rank) + i, packet);
    }
    // Receive and sum in rank order.
    char* own = p.bases[p.rank];
    for (uint64_t i = first; i < packets && !failed; i += stride) {
      float acc[2 * kPer];
      for (int src = 0; src < p.world; ++src) {
        const uint4* slot = ll_slot(p, own, par, src) + i;
        uint4 v = ld_volatile_v4(slot);
        if (v.y != e || v.w != e) {
          if (!wait_packet(p, slot, e, src, v)) {
            failed = true;
            break;
          }
        }
        acc_word<kBf16>(acc, v.x, src == 0);
        acc_word<kBf16>(acc + kPer, v.z, src == 0);
      }
      if (failed) break;
      const uint32_t w[2] = {pack_word<kBf16>(acc), pack_word<kBf16>(acc + kPer)};
      store_words<kBf16, 2>(p.out, 2 * i, p.count, w);
    }
  }
  finish_call(p, e, &s_last);
}

// ---- two-shot -------------------------------------------------------------------------------

// After this CTA's stores of `phase`: tell every rank in [0, world) except `skip` that they
// arrived. Every thread fences its own stores at system scope before the CTA barrier, then one
// thread per destination rank publishes the flag with a release store (the flag can never
// overtake the data, whatever the cumulativity of a single fence).
__device__ void signal_ranks(const ArParams& p, uint32_t e, uint32_t par, int phase, int skip) {
  __threadfence_system();
  __syncthreads();
  const int r = threadIdx.x;
  if (r < p.world && r != skip) {
    st_release_sys(flag_at(p, p.bases[r], par, phase, p.rank, blockIdx.x), e);
  }
}

// Waits until every rank except `skip` signalled `phase` for this CTA; sets *s_failed on timeout.
__device__ void wait_ranks(const ArParams& p, uint32_t e, uint32_t par, int phase, int skip,
                           int* s_failed) {
  const int src = threadIdx.x;
  if (src < p.world && src != skip) {
    const uint32_t* flag = flag_at(p, p.bases[p.rank], par, phase, src, blockIdx.x);
    const uint64_t start = globaltimer_ns();
    for (uint32_t spin = 1;; ++spin) {
      if (ld_acquire_sys(flag) == e) break;
      if ((spin & 255u) == 0u) {
        if (ld_volatile_u32(&p.state->abort) != 0u) {
          *s_failed = 1;
          break;
        }
        if (globaltimer_ns() - start > p.timeout_ns) {
          report_timeout(p, e, src, phase + 1);
          *s_failed = 1;
          break;
        }
      }
    }
  }
  __syncthreads();
}

template <bool kBf16>
__global__ void __launch_bounds__(kTsThreads) ar_twoshot_kernel(ArParams p) {
  dev::pdl_begin();  // before any read: the payload and the epoch come from earlier kernels
  __shared__ uint32_t s_epoch;
  __shared__ int s_last;
  __shared__ int s_failed;
  if (threadIdx.x == 0) {
    s_epoch = ld_volatile_u32(&p.state->epoch) + 1u;
    s_failed = ld_volatile_u32(&p.state->abort) != 0u ? 1 : 0;
  }
  __syncthreads();
  const uint32_t e = s_epoch;
  const uint32_t par = e & 1u;
  constexpr int kPer = Payload<kBf16>::kPerWord;
  const uint64_t words = (p.count + kPer - 1) / kPer;
  const uint64_t vectors = (words + 3) / 4;  // 16-byte vectors
  const uint64_t shard = (vectors + p.world - 1) / p.world;
  const uint64_t per_cta = (shard + gridDim.x - 1) / gridDim.x;
  const uint64_t lo = blockIdx.x * per_cta;
  const uint64_t hi = lo + per_cta < shard ? lo + per_cta : shard;
  char* own = p.bases[p.rank];

  if (s_failed == 0) {
    // Phase 1 (reduce-scatter push): my part of shard q goes to rank q's slot [par][me].
    for (int q = 0; q < p.world; ++q) {
      uint4* dst = ts_slot(p, p.bases[q], par, p.rank);
      for (uint64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const uint64_t v = q * shard + j;
        if (v >= vectors) break;
        uint32_t w[4];
        load_words<kBf16, 4>(p.in, 4 * v, p.count, w);
        dst[v] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    signal_ranks(p, e, par, 0, -1);
    wait_ranks(p, e, par, 0, -1, &s_failed);
  }
  if (s_failed == 0) {
    // Reduce my shard in rank order; write it out and push it to every peer's slot [par][me].
    for (uint64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
      const uint64_t v = p.rank * shard + j;
      if (v >= vectors) break;
      float acc[4 * kPer];
      for (int src = 0; src < p.world; ++src) {
        const int4 x = __ldcg(reinterpret_cast<const int4*>(ts_slot(p, own, par, src) + v));
        acc_word<kBf16>(acc, static_cast<uint32_t>(x.x), src == 0);
        acc_word<kBf16>(acc + kPer, static_cast<uint32_t>(x.y), src == 0);
        acc_word<kBf16>(acc + 2 * kPer, static_cast<uint32_t>(x.z), src == 0);
        acc_word<kBf16>(acc + 3 * kPer, static_cast<uint32_t>(x.w), src == 0);
      }
      const uint32_t w[4] = {pack_word<kBf16>(acc), pack_word<kBf16>(acc + kPer),
                             pack_word<kBf16>(acc + 2 * kPer), pack_word<kBf16>(acc + 3 * kPer)};
      store_words<kBf16, 4>(p.out, 4 * v, p.count, w);
      for (int q = 0; q < p.world; ++q) {
        if (q != p.rank)
          ts_slot(p, p.bases[q], par, p.rank)[v] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    signal_ranks(p, e, par, 1, p.rank);
    wait_ranks(p, e, par, 1, p.rank, &s_failed);
  }
  if (s_failed == 0) {
    // Phase 2 (all-gather): the reduced shards of the peers.
    for (int q = 0; q < p.world; ++q) {
      if (q == p.rank) continue;
      const uint4* src = ts_slot(p, own, par, q);
      for (uint64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const uint64_t v = q * shard + j;
        if (v >= vectors) break;
        const int4 x = __ldcg(reinterpret_cast<const int4*>(src + v));
        const uint32_t w[4] = {static_cast<uint32_t>(x.x), static_cast<uint32_t>(x.y),
                               static_cast<uint32_t>(x.z), static_cast<uint32_t>(x.w)};
        store_words<kBf16, 4>(p.out, 4 * v, p.count, w);
      }
    }
  }
  finish_call(p, e, &s_last);
}

__global__ void ar_init_kernel(char* own, ArLayout layout, int world, uint32_t epoch) {
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint32_t* flags = reinterpret_cast<uint32_t*>(own + layout.flags_offset);
  for (uint64_t i = first; i < 2 * static_cast<uint64_t>(kFlagsPerParity); i += stride)
    flags[i] = epoch;
  uint4* ll = reinterpret_cast<uint4*>(own + layout.ll_offset);
  const uint64_t packets = 2 * static_cast<uint64_t>(world) * layout.ll_slot_bytes / 16;
  for (uint64_t i = first; i < packets; i += stride) ll[i] = make_uint4(0, epoch, 0, epoch);
}

}  // namespace

ArLayout make_ar_layout(int world, std::size_t ll_max_bytes, std::size_t ts_max_bytes) {
  auto round_up = [](uint64_t x, uint64_t m) { return (x + m - 1) / m * m; };
  ArLayout l;
  l.flags_offset = 0;
  l.ll_offset = round_up(2 * static_cast<uint64_t>(kFlagsPerParity) * sizeof(uint32_t), 256);
  l.ll_slot_bytes = round_up(round_up(ll_max_bytes, 8) * 2, 256);
  l.ts_offset = l.ll_offset + 2 * static_cast<uint64_t>(world) * l.ll_slot_bytes;
  l.ts_slot_bytes = round_up(ts_max_bytes, 256);
  l.total_bytes = l.ts_offset + 2 * static_cast<uint64_t>(world) * l.ts_slot_bytes;
  return l;
}

void launch_ar_init(char* own, const ArLayout& layout, int world, uint32_t epoch,
                    cudaStream_t stream) {
  ar_init_kernel<<<64, 256, 0, stream>>>(own, layout, world, epoch);
  FN_CUDA_LAUNCH_CHECK("ar_init_kernel");
}

void launch_ar_oneshot(const ArParams& params, bool bf16, cudaStream_t stream) {
  if (bf16) {
    launch_ar(ar_oneshot_kernel<true>, kLlThreads, params, stream, "ar_oneshot_kernel");
  } else {
    launch_ar(ar_oneshot_kernel<false>, kLlThreads, params, stream, "ar_oneshot_kernel");
  }
  FN_CUDA_LAUNCH_CHECK("ar_oneshot_kernel");
}

void launch_ar_twoshot(const ArParams& params, bool bf16, cudaStream_t stream) {
  if (bf16) {
    launch_ar(ar_twoshot_kernel<true>, kTsThreads, params, stream, "ar_twoshot_kernel");
  } else {
    launch_ar(ar_twoshot_kernel<false>, kTsThreads, params, stream, "ar_twoshot_kernel");
  }
  FN_CUDA_LAUNCH_CHECK("ar_twoshot_kernel");
}

int ar_oneshot_threads() {
  return kLlThreads;
}
int ar_twoshot_threads() {
  return kTsThreads;
}

}  // namespace fn::detail

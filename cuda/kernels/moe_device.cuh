// MoE device code shared by the router kernel of decode_ops.cu (per token and per prefill row),
// the fused shared-expert kernels of moe_shared.cu and the prefill's row kernels of prefill_ops.cu
// (docs/model.md §C.7): the router softmax + top-k of one row run by one 512-thread block, the
// shared-expert gate's sigmoid and the SwiGLU element. Included by .cu files only. One copy of
// each, so the decode step and the prefill give the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/config.h"
#include "cuda/common/device_util.cuh"

namespace fn::dev {

constexpr int kRouterThreads = 512;  // threads of a block running router_topk_block
// E limit of router_topk_block (shared-memory lists): the config's cap (core/config.h).
constexpr int kMaxExperts = static_cast<int>(kMaxNumExperts);
constexpr int kMaxTopK = 64;  // k limit of router_topk_block

// Ranking key of a probability: NaN ranks as -Inf (so the order stays total).
__device__ __forceinline__ float rank_key(float p) {
  return isnan(p) ? -INFINITY : p;
}

// The bits of a non-NaN float mapped so that unsigned order is float order (-0 just below +0).
__device__ __forceinline__ uint32_t ordered_bits(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

// The sort key of expert e with probability p: the higher key comes first in the order
// (rank_key(p) desc, e asc). High word: the float's bits mapped so that unsigned order is float
// order (-0 as +0, as the float comparison), low word: ~e. Never 0 (0 marks "no expert").
__device__ __forceinline__ unsigned long long router_key(float p, int e) {
  float v = rank_key(p);
  if (v == 0.0f) v = 0.0f;
  return (static_cast<unsigned long long>(ordered_bits(v)) << 32) |
         (0xffffffffu - static_cast<uint32_t>(e));
}

__device__ __forceinline__ int key_id(unsigned long long key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key & 0xffffffffull));
}

// A logit as an unsigned code in float order, for redux.sync: non-NaN floats map to
// [0x007fffff (-Inf), 0xff800000 (+Inf)] (-0 below +0), NaN to 1; 0 is left for "no expert".
__device__ __forceinline__ uint32_t logit_code(float l) {
  return isnan(l) ? 1u : ordered_bits(l);
}

// Max (kMax) or min of v over the 32 lanes of a full warp: redux.sync on sm_80+, a butterfly of
// shuffles below (the same value in every lane).
template <bool kMax>
__device__ __forceinline__ uint32_t warp_reduce_u32(uint32_t v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  return kMax ? __reduce_max_sync(0xffffffffu, v) : __reduce_min_sync(0xffffffffu, v);
#else
  for (int off = 16; off > 0; off >>= 1) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, v, off);
    v = (kMax ? o > v : o < v) ? o : v;
  }
  return v;
#endif
}
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
  return warp_reduce_u32<true>(v);
}
__device__ __forceinline__ uint32_t warp_min_u32(uint32_t v) {
  return warp_reduce_u32<false>(v);
}

// The float of a code >= 2 (a non-NaN logit).
__device__ __forceinline__ float code_logit(uint32_t c) {
  return __uint_as_float((c & 0x80000000u) != 0u ? (c & 0x7fffffffu) : ~c);
}

// Number of keys in list[0, n) greater than key, stopping once the count reaches stop (a count
// >= stop is all a caller needs). list is 16-byte aligned and list[n] is 0 when n is odd (0 is
// below every key), so the keys are read in pairs, four pairs per step.
__device__ __forceinline__ int count_greater(const unsigned long long* list, int n,
                                             unsigned long long key, int stop) {
  const ulonglong2* pairs = reinterpret_cast<const ulonglong2*>(list);
  const int n2 = (n + 1) / 2;
  int count = 0;
#pragma unroll 1
  for (int j = 0; j < n2 && count < stop; j += 4) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (j + u < n2) {
        const ulonglong2 x = pairs[j + u];
        count += (x.x > key ? 1 : 0) + (x.y > key ? 1 : 0);
      }
    }
  }
  return count;
}

/// Router softmax + top-k of one row (docs/model.md §C.7 step 1; the semantics of
/// fn::launch_router_topk, cuda/kernels/decode_ops.h) on logits the caller already holds: thread t
/// passes l0 = logit of expert t and l1 = logit of expert t + 512 (any value where the expert is >=
/// E). p = softmax(logits[0, E)) (FP32 expf(l - max), FP64 sum), the top k of p in the order (p
/// desc, id asc), w = p / sum(p_selected) (FP64) when norm, else p; a NaN p ranks as -Inf and sets
/// *flag = 4 (flag may be null). 1 <= E <= kMaxExperts, 1 <= k <= min(E, kMaxTopK). Must be called
/// by all kRouterThreads threads of a block (uniformly: it uses __syncthreads; warp 0 writes the
/// outputs, the other warps return from it early). The same code for every caller, so the same
/// bits.
///
/// The bits: the sum is one fixed tree (thread t adds the terms of experts t and t + 512 to 0.0,
/// then a butterfly xor 16..1 in each warp, then the 16 warp sums in ascending order), p and w
/// are correctly rounded divisions, the selection is exact; tests/router_topk_reference.cu keeps
/// the earlier sorted-list version, which test_cuda_decode_ops compares bitwise. Two block
/// barriers when at most 64 experts are candidates (the usual case), four otherwise; the time is
/// the dependent chain (redux, barrier, expf, FP64 butterfly, barrier, FP64 sum of the 16
/// warp sums, FP64 divide, ranking, FP64 sum of the selected, FP64 divide), not the code size (a
/// 16 KB straight-line probe ran at its FFMA latency on H200).
__device__ __forceinline__ void router_topk_values(float l0, float l1, int E, int k, bool norm,
                                                   int32_t* ids, float* weights, int32_t* flag) {
  constexpr int kWarps = kRouterThreads / 32;
  constexpr int kMaxBound = kMaxTopK;  // bound entries: kWarps * ceil(k / kWarps) <= 64
  static_assert(kMaxExperts <= 2 * kRouterThreads, "two experts per thread at most");
  static_assert(kMaxTopK % kWarps == 0, "bound entries fill whole warps");
  __shared__ __align__(16) uint32_t s_wmax[kWarps];
  __shared__ __align__(16) double s_wsum[kWarps];
  __shared__ __align__(16) uint32_t s_bcode[kMaxBound];
  __shared__ float s_blogit[kMaxBound];
  __shared__ int s_cid[kMaxExperts];
  __shared__ float s_cv[kMaxExperts];
  __shared__ __align__(16) unsigned long long s_ckey[kMaxExperts];
  __shared__ float s_cp[kMaxExperts];
  __shared__ unsigned long long s_skey[kMaxTopK];
  __shared__ float s_sp[kMaxTopK];
  __shared__ int s_n;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Thread t holds experts t and t + 512 (the sum tree's per-thread terms).
  const int e0 = tid, e1 = tid + kRouterThreads;
  const bool has0 = e0 < E, has1 = e1 < E;
  if (tid == 0) s_n = 0;

  // 1. Per warp, by redux.sync on logit codes: the max (round 0) and the bound set S, the warp's
  // r = ceil(k / 16) largest logits (entry warp * r + j; code 0 when the warp has fewer experts).
  const int r = (k + kWarps - 1) / kWarps, nb = kWarps * r;
  {
    uint32_t c0 = has0 ? logit_code(l0) : 0u, c1 = has1 ? logit_code(l1) : 0u;
#pragma unroll 1
    for (int j = 0; j < r; ++j) {
      const uint32_t c = c0 > c1 ? c0 : c1;
      const uint32_t m = warp_max_u32(c);
      if (j == 0 && lane == 0) s_wmax[warp] = m;
      if (lane == __ffs(__ballot_sync(0xffffffffu, c == m)) - 1) {
        const bool first = c0 == m;
        s_bcode[warp * r + j] = m;
        s_blogit[warp * r + j] = first ? l0 : l1;
        if (first)
          c0 = 0u;
        else
          c1 = 0u;
      }
    }
  }
  // Some term is NaN (so the sum and every p) exactly when a logit is NaN or the max is +-Inf
  // (Inf - Inf); otherwise every term is finite, >= 0 and about <= 1, the max's exactly 1, so the
  // sum lies in [1, ~E] and no p is NaN.
  const bool nan_logit = __syncthreads_or((has0 && isnan(l0)) || (has1 && isnan(l1))) != 0;

  // The max in every thread (fmaxf's: NaN skipped, -Inf when all are NaN; a max of -0 or +0
  // gives the same l - max bits up to the sign of a zero, and expf(-0) = expf(+0) = 1).
  uint32_t mc = 0u;
#pragma unroll
  for (int w = 0; w < kWarps; w += 4) {
    const uint4 m4 = *reinterpret_cast<const uint4*>(s_wmax + w);
    mc = max(mc, max(max(m4.x, m4.y), max(m4.z, m4.w)));
  }
  const float mx = mc <= 1u ? -INFINITY : code_logit(mc);
  const bool nan_terms = nan_logit || isinf(mx);

  // 2. exp(l - max) in FP32, the sum in FP64 (as route_top_k) over the fixed tree.
  const float v0 = has0 ? expf(l0 - mx) : 0.0f;
  const float v1 = has1 ? expf(l1 - mx) : 0.0f;
  double sum = 0.0;
  if (has0) sum += static_cast<double>(v0);
  if (has1) sum += static_cast<double>(v1);
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) s_wsum[warp] = sum;

  // 3. The candidates, before the sum is known. p(v) = float(v / sum) rises with v. The k entries
  // of S ranked first by (code desc, entry asc) are k distinct experts, so the k-th largest key
  // is at least the least of theirs, whose p is p(vb), vb their least term (vb = 0 when an entry
  // has no expert). An expert with p(v) = p(vb) and v < vb has vb - v <= 2^-22 vb + 2^-139 (two
  // values rounding to one float, sum <= 1024), so every top-k expert has v >= thr below, with
  // room for thr's own roundings. With NaN terms every key ties on -Inf: the top k are 0..k-1.
  uint32_t vb_bits = 0xffffffffu;
#pragma unroll 1
  for (int i = lane; i < nb; i += 32) {
    const uint32_t ci = s_bcode[i];
    int rank = 0;
#pragma unroll 1
    for (int j = 0; j < nb; j += 4) {
      const uint4 c4 = *reinterpret_cast<const uint4*>(s_bcode + j);
      rank += (c4.x > ci || (c4.x == ci && j < i)) ? 1 : 0;
      rank += (c4.y > ci || (c4.y == ci && j + 1 < i)) ? 1 : 0;
      rank += (c4.z > ci || (c4.z == ci && j + 2 < i)) ? 1 : 0;
      rank += (c4.w > ci || (c4.w == ci && j + 3 < i)) ? 1 : 0;
    }
    if (rank < k) {
      const uint32_t b = ci == 0u ? 0u : __float_as_uint(expf(s_blogit[i] - mx));
      vb_bits = b < vb_bits ? b : vb_bits;  // terms >= +0: bit order is float order
    }
  }
  const float vb = __uint_as_float(warp_min_u32(vb_bits));
  const float thr = fmaf(vb, -0x1p-16f, vb) - 0x1p-120f;
  const bool cand0 = has0 && (nan_terms ? e0 < k : v0 >= thr);
  const bool cand1 = has1 && (nan_terms ? e1 < k : v1 >= thr);
  const unsigned b0 = __ballot_sync(0xffffffffu, cand0), b1 = __ballot_sync(0xffffffffu, cand1);
  if ((b0 | b1) != 0u) {
    int base = 0;
    if (lane == 0) base = atomicAdd(&s_n, __popc(b0) + __popc(b1));
    base = __shfl_sync(0xffffffffu, base, 0);
    const unsigned below = (1u << lane) - 1u;
    if (cand0) {
      const int at = base + __popc(b0 & below);
      s_cid[at] = e0;
      s_cv[at] = v0;
    }
    if (cand1) {
      const int at = base + __popc(b0) + __popc(b1 & below);
      s_cid[at] = e1;
      s_cv[at] = v1;
    }
  }
  __syncthreads();

  // 4. p and the key of each candidate, then its rank = the number of greater candidate keys
  // (its rank among all experts, as the top k are candidates); rank r < k goes to place r. Up to
  // 64 candidates (the usual case: about 16 for E 512, k 10) warp 0 works alone, else the block.
  const int n = s_n;
  const bool block_wide = n > 64;
  if (!block_wide && warp != 0) return;
  const int g = block_wide ? tid : lane, gs = block_wide ? kRouterThreads : 32;
  double total = s_wsum[0];
  for (int w = 1; w < kWarps; ++w) total += s_wsum[w];
#pragma unroll 1
  for (int i = g; i < n; i += gs) {
    const float p = static_cast<float>(static_cast<double>(s_cv[i]) / total);
    s_ckey[i] = router_key(p, s_cid[i]);
    s_cp[i] = p;
  }
  if (g == 0 && (n & 1) != 0) s_ckey[n] = 0ull;  // n odd: n < kMaxExperts
  if (block_wide)
    __syncthreads();
  else
    __syncwarp();
#pragma unroll 1
  for (int i = g; i < n; i += gs) {
    const unsigned long long key = s_ckey[i];
    const int rank = count_greater(s_ckey, n, key, k);
    if (rank < k) {
      s_skey[rank] = key;
      s_sp[rank] = s_cp[i];
    }
  }
  if (block_wide)
    __syncthreads();
  else
    __syncwarp();
  if (warp != 0) return;

  // 5. Warp 0 writes place r from lane r (and r - 32); each lane sums the selected p in place
  // order (the same FP64 sum).
  double sel_sum = 0.0;
  if (norm)
    for (int j = 0; j < k; ++j) sel_sum += static_cast<double>(s_sp[j]);
#pragma unroll 1
  for (int i = lane; i < k; i += 32) {
    const float pe = s_sp[i];
    ids[i] = key_id(s_skey[i]);
    weights[i] = norm ? static_cast<float>(static_cast<double>(pe) / sel_sum) : pe;
  }
  if (lane == 0 && isnan(total) && flag != nullptr) *flag = 4;
}

/// router_topk_values on logits[0, E) read from memory once, with ld.global.cg (L2, not L1), so a
/// block may read logits that other blocks of its own grid wrote before a __threadfence() and an
/// atomic arrival. Called after the logits are complete and visible to the block; the rest as
/// router_topk_values.
__device__ __forceinline__ void router_topk_block(const float* logits, int E, int k, bool norm,
                                                  int32_t* ids, float* weights, int32_t* flag) {
  const int e0 = threadIdx.x, e1 = threadIdx.x + kRouterThreads;
  const float l0 = e0 < E ? __ldcg(logits + e0) : 0.0f;
  const float l1 = e1 < E ? __ldcg(logits + e1) : 0.0f;
  router_topk_values(l0, l1, E, k, norm, ids, weights, flag);
}

// ---- The router mailbox (launch_router_shared_gate_up) ------------------------------------------
// A slot per expert (dev::kMailEmpty until posted: cudaMemset 0xFF at allocation) so that one
// block can wait for the logits of its whole grid without an arrival ticket (device_util.cuh); it
// empties each slot again for the next launch. A NaN logit with the empty bits is posted as the
// canonical NaN (kRouterNanPost; every NaN ranks alike in router_topk_values).
constexpr uint32_t kRouterNanPost = 0x7fffffffu;

/// The logits of experts threadIdx.x and threadIdx.x + kRouterThreads (0 past E) from the
/// mailbox, each read until posted, then emptied for the next launch. Every slot [0, E) must be
/// posted once by this grid, else the caller spins forever: the poster blocks must all be
/// resident or finished (they are: the launch's dependents start only after every block of the
/// grid has passed its programmatic wait, cuda/common/pdl.cuh).
__device__ __forceinline__ void router_mail_take(float* mail, int E, float& l0, float& l1) {
  const int e0 = threadIdx.x, e1 = threadIdx.x + kRouterThreads;
  uint32_t b0 = e0 < E ? mail_peek(mail + e0) : 0u;
  uint32_t b1 = e1 < E ? mail_peek(mail + e1) : 0u;
  while (b0 == kMailEmpty || b1 == kMailEmpty) {
    if (b0 == kMailEmpty) b0 = mail_peek(mail + e0);
    if (b1 == kMailEmpty) b1 = mail_peek(mail + e1);
  }
  if (e0 < E) mail_store(mail + e0, kMailEmpty);
  if (e1 < E) mail_store(mail + e1, kMailEmpty);
  l0 = __uint_as_float(b0);
  l1 = __uint_as_float(b1);
}

/// The logistic function in the two-branch form of fn::cpu::sigmoid (expf; docs/model.md §C.7 step
/// 4, the shared-expert gate).
__device__ __forceinline__ float sigmoid_2branch(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

/// One SwiGLU element as BF16 bits (docs/model.md §C.7 steps 2-3): bf16(silu(g) * u), FP32 math.
__device__ __forceinline__ uint16_t swiglu_bf16_bits(float g, float u) {
  return float_to_bf16_bits(silu(g) * u);
}

}  // namespace fn::dev

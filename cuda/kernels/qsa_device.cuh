// Device code shared by the QSA decode kernels (cuda/kernels/qsa.cu) and the QSA prefill kernels
// (cuda/kernels/qsa_prefill.cu): FP64 block sum, norm + RoPE of one head, the indexer score of one
// block, the top-k block radix select and the per-head combine with the sigmoid gate. One
// definition of each so that prefill rows reproduce decode steps bit for bit. Included by those .cu
// files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_util.cuh"

namespace fn::qsa_dev {

constexpr int kQsaThreads = 256;         // CTA size of every QSA kernel except select
constexpr int kQsaSelectThreads = 1024;  // the select CTA
constexpr int kQsaMaxDim = 256;          // hd and ihd limit (one element per prep thread)
constexpr int kQsaMaxChunks = 4096;      // combine keeps one weight per chunk in shared memory
constexpr int kQsaSelectCache = 8192;    // select keys kept in shared memory

// The local q heads that read local KV head j of the launch `a` (any QSA args struct with hq,
// q_head_first, q_per_kv, kv_head_first): returns how many, with the first in *i0 (-1 when none).
// Contiguous because (q_head_first + i) / q_per_kv is monotone in i.
template <class Args>
__device__ __forceinline__ int q_heads_of_kv(const Args& a, int j, int* i0) {
  int first = -1, count = 0;
  for (int i = 0; i < a.hq; ++i) {
    if ((a.q_head_first + i) / a.q_per_kv - a.kv_head_first == j) {
      if (first < 0) first = i;
      ++count;
    }
  }
  *i0 = first;
  return count;
}

// Block-wide FP64 sum in a fixed order (butterfly per warp, then warps ascending); every thread
// gets the total. `red` holds kQsaThreads / 32 doubles.
__device__ inline double block_sum_f64(double v, double* red) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = red[0];
  for (int i = 1; i < kQsaThreads / 32; ++i) s += red[i];
  __syncthreads();
  return s;
}

// rms_norm_1p then rope_neox (core/cpu_ops.cpp) of one head of n <= kMaxDim values x into the
// shared y, op for op as the CPU code in FP32 (the statistic in FP64); intrinsics keep nvcc from
// contracting the RoPE products into FMAs. cos/sin of the FP32 angle are evaluated in FP64 and
// rounded once. Every thread of the block must call it.
__device__ inline void norm_rope(const float* x, const float* w, int n, float eps, int rot,
                                 double theta, int64_t pos, float* y, double* red) {
  const int tid = threadIdx.x;
  const float xv = tid < n ? x[tid] : 0.0f;
  const double ss = block_sum_f64(static_cast<double>(xv) * xv, red);
  const float mean = static_cast<float>(ss / static_cast<double>(n));
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
  if (tid < n) y[tid] = __fmul_rn(__fmul_rn(xv, inv), __fadd_rn(1.0f, w[tid]));
  __syncthreads();
  const int half = rot / 2;
  if (tid < half) {
    const float inv_freq = static_cast<float>(
        1.0 / pow(theta, static_cast<double>(2 * tid) / static_cast<double>(rot)));
    const float phi = __fmul_rn(static_cast<float>(pos), inv_freq);
    double sd, cd;
    sincos(static_cast<double>(phi), &sd, &cd);
    const float c = static_cast<float>(cd), s = static_cast<float>(sd);
    const float a = y[tid], b = y[tid + half];
    y[tid] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    y[tid + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
  __syncthreads();
}

// The RoPE rotation of pair `i` at position `pos` exactly as norm_rope computes it (FP64 pow and
// sincos of the FP32 angle, rounded once). Split out so that a kernel can evaluate it before its
// programmatic wait (it reads nothing another kernel writes).
__device__ inline void rope_cos_sin(double theta, int rot, int64_t pos, int i, float* c, float* s) {
  const float inv_freq =
      static_cast<float>(1.0 / pow(theta, static_cast<double>(2 * i) / static_cast<double>(rot)));
  const float phi = __fmul_rn(static_cast<float>(pos), inv_freq);
  double sd, cd;
  sincos(static_cast<double>(phi), &sd, &cd);
  *c = static_cast<float>(cd);
  *s = static_cast<float>(sd);
}

// norm_rope with the thread's input value xv (0 for tid >= n), weight wv and, for tid < rot/2,
// the rotation (c, s) of rope_cos_sin given by the caller: the same operation sequence, so the
// same bits. Every thread of a kQsaThreads block must call it.
__device__ inline void norm_rope_cs(float xv, float wv, int n, float eps, int rot, float c, float s,
                                    float* y, double* red) {
  const int tid = threadIdx.x;
  const double ss = block_sum_f64(static_cast<double>(xv) * xv, red);
  const float mean = static_cast<float>(ss / static_cast<double>(n));
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
  if (tid < n) y[tid] = __fmul_rn(__fmul_rn(xv, inv), __fadd_rn(1.0f, wv));
  __syncthreads();
  const int half = rot / 2;
  if (tid < half) {
    const float a = y[tid], b = y[tid + half];
    y[tid] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    y[tid + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
  __syncthreads();
}

// The block key values lane `lane` uses in block_score (kb[lane + 32 r]), loaded ahead.
__device__ __forceinline__ void load_block_key(const float* kb, int ihd, int lane, float* kv) {
#pragma unroll
  for (int r = 0; r < kQsaMaxDim / 32; ++r) {
    const int d = lane + 32 * r;
    kv[r] = d < ihd ? kb[d] : 0.0f;
  }
}

// block_score's math on a block key already loaded by load_block_key.
__device__ inline float block_score_kv(const float* qs, const float* kv, int ni, int ihd, int lane,
                                       double scale) {
  double acc = 0.0;
  for (int h = 0; h < ni; ++h) {
    double p = 0.0;
#pragma unroll
    for (int r = 0; r < kQsaMaxDim / 32; ++r) {
      const int d = lane + 32 * r;
      if (d < ihd) p += static_cast<double>(qs[h * ihd + d]) * kv[r];
    }
    for (int off = 16; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off);
    const float dh = static_cast<float>(p);
    acc += static_cast<double>(0.0f < dh ? dh : 0.0f);
  }
  return static_cast<float>(acc * scale);
}

// indexer_scores of one block for one warp (every lane gets the result): FP64 dot per head (as
// cpu::dot), relu in FP32 (std::max(0.0f, x) semantics), the head sum in FP64, times `scale`
// (1/sqrt(ihd) in FP64). `qs` holds the ni indexer queries of ihd floats, `kb` the block key.
__device__ inline float block_score(const float* qs, const float* kb, int ni, int ihd, int lane,
                                    double scale) {
  float kv[kQsaMaxDim / 32];
  load_block_key(kb, ihd, lane, kv);
  return block_score_kv(qs, kv, ni, ihd, lane, scale);
}

// Monotone map of a score to an unsigned key (larger score -> larger key); -0 maps as +0 so that
// equal values compare equal as the CPU's float comparison does. NaN lands above +inf.
__device__ __forceinline__ uint32_t order_key(float s) {
  const uint32_t u = s == 0.0f ? 0u : __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One radix-select pass's bin choice, run by the 32 lanes of warp 0 over the 256-bin histogram:
// lane l holds bins 255-8l .. 248-8l (from the top); the lane whose bins hold the
// remaining-th largest key writes the extended prefix and the rank left inside that bin.
__device__ __forceinline__ void radix_pick_bin(const unsigned* hist, int lane, uint32_t prefix,
                                               int shift, int remaining, uint32_t* s_prefix,
                                               int* s_remaining, int* s_count = nullptr) {
  unsigned c[8], tot = 0;
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    c[r] = hist[255 - 8 * lane - r];
    tot += c[r];
  }
  unsigned incl = tot;
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned n = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += n;
  }
  const unsigned excl = incl - tot;
  const unsigned rem = static_cast<unsigned>(remaining);
  if (excl < rem && rem <= incl) {
    unsigned cum = excl;
    bool found = false;
#pragma unroll
    for (int r = 0; r < 8; ++r) {  // unrolled: c stays in registers
      if (!found && cum + c[r] >= rem) {
        *s_prefix = prefix | (static_cast<uint32_t>(255 - 8 * lane - r) << shift);
        *s_remaining = static_cast<int>(rem - cum);
        if (s_count != nullptr) *s_count = static_cast<int>(c[r]);
        found = true;
      }
      cum += c[r];
    }
  }
}

// The compaction of a radix select with threshold key T: every index i < B with key(i) > T, plus
// the lowest-indexed `remaining` ones with key(i) == T, written ascending to selected (i goes to
// selected[#greater before i + min(#equal before i, remaining)]). Warp w owns the indices
// [32 R w, 32 R (w + 1)), R = ceil(B / kQsaSelectThreads), in R rounds of 32 consecutive ones;
// ballots count within a warp and one barrier passes the warps' totals (scan_sh: 32 words).
// Every thread of a kQsaSelectThreads CTA must call it.
template <typename Key>
__device__ __forceinline__ void compact_selected(const Key& key, int B, uint32_t T, int remaining,
                                                 unsigned long long* scan_sh, int* selected) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned lt = (1u << lane) - 1u;
  const int rounds = (B + kQsaSelectThreads - 1) / kQsaSelectThreads;
  const int first = warp * 32 * rounds;
  unsigned gt = 0, eq = 0;
  for (int r = 0; r < rounds; ++r) {  // uniform over the CTA
    const int i = first + 32 * r + lane;
    const uint32_t u = i < B ? key(i) : 0u;
    gt += __popc(__ballot_sync(0xffffffffu, i < B && u > T));
    eq += __popc(__ballot_sync(0xffffffffu, i < B && u == T));
  }
  if (lane == 0) scan_sh[warp] = (static_cast<unsigned long long>(gt) << 32) | eq;
  __syncthreads();
  unsigned long long before = lane < warp ? scan_sh[lane] : 0ull;  // the warps ahead of this one
  for (int off = 16; off > 0; off >>= 1) before += __shfl_xor_sync(0xffffffffu, before, off);
  unsigned gt_before = static_cast<unsigned>(before >> 32);
  unsigned eq_before = static_cast<unsigned>(before & 0xffffffffull);
  const unsigned rem = static_cast<unsigned>(remaining);
  for (int r = 0; r < rounds; ++r) {
    const int i = first + 32 * r + lane;
    const uint32_t u = i < B ? key(i) : 0u;
    const unsigned g = __ballot_sync(0xffffffffu, i < B && u > T);
    const unsigned e = __ballot_sync(0xffffffffu, i < B && u == T);
    const unsigned eq_rank = eq_before + __popc(e & lt);  // equal keys before i
    if (i < B && (u > T || (u == T && eq_rank < rem)))
      selected[gt_before + __popc(g & lt) + min(eq_rank, rem)] = i;
    gt_before += __popc(g);
    eq_before += __popc(e);
  }
}

// top_k + qsa_selected_tokens' block part over scores[0..B): k < B blocks, higher score first,
// equal scores -> lower index, written ascending to selected[0..k). Radix select (4 passes of 8
// bits) finds the k-th key T; every key > T is selected plus the lowest-indexed (k - #greater)
// keys equal to T. Every thread of a kQsaSelectThreads CTA must call it.
__device__ inline void select_top_blocks(const float* scores, int B, int k, int* selected) {
  __shared__ unsigned hist[256];
  __shared__ uint32_t keys[kQsaSelectCache];
  __shared__ uint32_t s_prefix;
  __shared__ int s_remaining;
  __shared__ unsigned long long scan_sh[32];
  const int tid = threadIdx.x, lane = tid & 31;
  // Keys of the first kQsaSelectCache blocks in shared memory; later ones are re-read.
  const int cached = min(B, kQsaSelectCache);
  for (int i = tid; i < cached; i += kQsaSelectThreads) keys[i] = order_key(scores[i]);
  __syncthreads();
  auto key = [&](int i) { return i < kQsaSelectCache ? keys[i] : order_key(scores[i]); };
  uint32_t prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) hist[tid] = 0;
    __syncthreads();
    for (int i = tid; i < B; i += kQsaSelectThreads) {
      const uint32_t u = key(i);
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid < 32) radix_pick_bin(hist, lane, prefix, shift, remaining, &s_prefix, &s_remaining);
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    mask |= 255u << shift;
    __syncthreads();
  }
  compact_selected(key, B, prefix, remaining, scan_sh, selected);
}

// select_top_blocks with the same result (the same blocks in the same order) for a CTA that
// reaches it while other CTAs of its grid write `scores`, with the keys of the first
// kQsaSelectCache blocks in the caller's shared array `keys` (kQsaSelectCache words). `scores` is
// a mailbox (device_util.cuh) whose slots [0, B) other CTAs of the grid post, each read until
// posted (the slots stay posted). Every thread of a kQsaSelectThreads CTA must call it.
// The same radix select as select_top_blocks with fewer barriers on its critical path: each
// thread's slot reads all in flight before the first wait; two histograms and prefix slots
// alternate between passes (the next pass's histogram is zeroed during this one), so a pass
// takes two barriers instead of four; the passes stop once the chosen bin holds exactly the keys
// still wanted (all of them are selected, so finer bits cannot change the set); and the
// compaction (compact_selected) counts with warp ballots and passes the warps' totals through
// one barrier.
__device__ inline void select_top_blocks_cg(const float* scores, int B, int k, int* selected,
                                            uint32_t* keys) {
  __shared__ unsigned hist[2][256];
  __shared__ uint32_t s_prefix[2];
  __shared__ int s_remaining[2], s_count[2];
  __shared__ unsigned long long scan_sh[32];
  const int tid = threadIdx.x, lane = tid & 31;
  const int cached = min(B, kQsaSelectCache);
  {
    constexpr int kPer = kQsaSelectCache / kQsaSelectThreads;
    uint32_t v[kPer];
#pragma unroll
    for (int r = 0; r < kPer; ++r) {  // every read in flight before the first wait
      const int i = tid + r * kQsaSelectThreads;
      v[r] = i < cached ? dev::mail_peek(scores + i) : 0u;
    }
#pragma unroll
    for (int r = 0; r < kPer; ++r) {  // the bits as read, in this thread's own words of keys
      const int i = tid + r * kQsaSelectThreads;
      if (i < cached) keys[i] = v[r];
    }
    for (int i = tid; i < cached; i += kQsaSelectThreads) {  // a slot read empty: read again
      uint32_t x = keys[i];
      while (x == dev::kMailEmpty) x = dev::mail_peek(scores + i);
      keys[i] = order_key(__uint_as_float(x));
    }
    // Past the cache (B > kQsaSelectCache): each slot posted before any thread reads it below.
    for (int i = kQsaSelectCache + tid; i < B; i += kQsaSelectThreads) dev::mail_wait(scores + i);
    if (tid < 256) hist[0][tid] = 0;
  }
  __syncthreads();
  auto key = [&](int i) {
    if (i < kQsaSelectCache) return keys[i];
    return order_key(__uint_as_float(dev::mail_peek(scores + i)));
  };
  uint32_t prefix = 0, mask = 0;
  int remaining = k;
  for (int pass = 0, shift = 24; shift >= 0; ++pass, shift -= 8) {
    unsigned* h = hist[pass & 1];
    // The other histogram: its last reader (the previous pass's bin pick) finished before the
    // barrier that ended that pass.
    if (tid < 256) hist[(pass + 1) & 1][tid] = 0;
    for (int i0 = 0; i0 < B; i0 += kQsaSelectThreads) {  // uniform trip count over the CTA
      const int i = i0 + tid;
      bool in = false;
      unsigned bin = 0;
      if (i < B) {
        const uint32_t u = key(i);
        in = (u & mask) == prefix;
        bin = (u >> shift) & 255u;
      }
      if (in) atomicAdd(&h[bin], 1u);  // plain: measured faster than warp aggregation
    }
    __syncthreads();
    if (tid < 32)
      radix_pick_bin(h, lane, prefix, shift, remaining, &s_prefix[pass & 1], &s_remaining[pass & 1],
                     &s_count[pass & 1]);
    __syncthreads();
    // Read before the next pass's first barrier; written again two passes on.
    prefix = s_prefix[pass & 1];
    remaining = s_remaining[pass & 1];
    mask |= 255u << shift;
    if (s_count[pass & 1] == remaining) break;  // uniform: every key of the bin is selected
  }
  compact_selected([&](int i) { return key(i) & mask; }, B, prefix, remaining, scan_sh, selected);
}

// The chunk weights of a combine over nc chunks: sc[c] = ps[c] and wc[c] = exp(pm[c] - M) with
// M the max of pm (exact in any order); wc, sc and red ([kQsaThreads / 32]) in shared memory.
// Every thread of a kQsaThreads CTA must call it; the weights are visible to all on return.
__device__ inline void combine_weights(const float* pm, const float* ps, int nc, float* wc,
                                       float* sc, float* red) {
  const int tid = threadIdx.x;
  float m = -INFINITY;
  for (int c = tid; c < nc; c += kQsaThreads) {
    wc[c] = pm[c];
    sc[c] = ps[c];
    m = fmaxf(m, wc[c]);
  }
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((tid & 31) == 0) red[tid >> 5] = m;
  __syncthreads();
  float M = red[0];
  for (int w = 1; w < kQsaThreads / 32; ++w) M = fmaxf(M, red[w]);  // max: exact in any order
  for (int c = tid; c < nc; c += kQsaThreads) wc[c] = expf(wc[c] - M);
  __syncthreads();
}

// Combine of one query head over its nc chunks in ascending order (pm/ps: per-chunk maxima and
// sums, po: [nc, hd] unnormalised outputs), then * sigmoid(gate) (the two-branch form of
// cpu::sigmoid) -> BF16 into out[0..hd). Chunk loads are batched 8 at a time (the summation
// order stays c = 0, 1, ...). Every thread of a kQsaThreads CTA must call it.
__device__ inline void combine_head(const float* pm, const float* ps, const float* po, int nc,
                                    int hd, const float* gate, uint16_t* out) {
  __shared__ float wc[kQsaMaxChunks];
  __shared__ float sc[kQsaMaxChunks];
  __shared__ float red[kQsaThreads / 32];
  const int tid = threadIdx.x;
  combine_weights(pm, ps, nc, wc, sc, red);
  float L = 0.0f;
  for (int c = 0; c < nc; ++c) L = fmaf(sc[c], wc[c], L);
  for (int d = tid; d < hd; d += kQsaThreads) {
    float o = 0.0f;
    for (int c0 = 0; c0 < nc; c0 += 8) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = c0 + u < nc ? po[int64_t{c0 + u} * hd + d] : 0.0f;
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (c0 + u < nc) o = fmaf(v[u], wc[c0 + u], o);
    }
    o = o / L;
    const float g = gate[d];
    float sg;
    if (g >= 0.0f) {
      sg = 1.0f / (1.0f + expf(-g));
    } else {
      const float e = expf(g);
      sg = e / (1.0f + e);
    }
    out[d] = dev::float_to_bf16_bits(o * sg);
  }
}

}  // namespace fn::qsa_dev

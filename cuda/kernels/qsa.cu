// QSA decode kernels (see qsa.h): prep (norms, RoPE, cache rows, block key), indexer scores,
// top-k block select, chunked attention, combine + gate. Every kernel reads t from device memory.
#include "cuda/kernels/qsa.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/real_shape.h"
#include "cuda/kernels/gemv_bf16.h"
#include "cuda/kernels/qsa_device.cuh"

namespace fn {
namespace {

constexpr int kThreads = 256;         // prep, scores, attention, combine
constexpr int kSelectThreads = 1024;  // the one select CTA
constexpr int kMaxDim = 256;          // hd and ihd limit (one element per prep thread)
constexpr int kMaxIndexerQ = 4096;    // indexer_heads * ihd floats in static shared memory
constexpr int kMaxChunks = 4096;      // combine keeps one weight per chunk in shared memory
constexpr int kSmemLimit = 48 * 1024;
constexpr int kMaxG = 16;           // query heads per KV head (12 real), one accumulator each
constexpr int kSelectCache = 8192;  // select keys kept in shared memory (B <= 8192: t < 32768)
constexpr uint16_t kBf16Nan = 0x7FC0;
static_assert(kThreads == qsa_dev::kQsaThreads && kSelectThreads == qsa_dev::kQsaSelectThreads);
static_assert(kMaxDim == qsa_dev::kQsaMaxDim && kMaxChunks == qsa_dev::kQsaMaxChunks);
static_assert(kSelectCache == qsa_dev::kQsaSelectCache);

struct Args {
  const float* proj;
  const float* q_norm;
  const float* k_norm;
  const float* iq_norm;
  const float* ik_norm;
  const int64_t* position;
  uint16_t* k_cache;
  uint16_t* v_cache;
  float* raw_keys;
  float* block_keys;
  uint16_t* out;
  float* q;
  float* qi;
  float* scores;
  int* selected;
  int* counters;
  const int32_t* forced;
  float* part_out;
  float* part_max;
  float* part_sum;
  int64_t ctx;
  double theta;
  int hq, hkv, q_head_first, q_per_kv, kv_head_first, hd, rot;
  int ni, ihd, ratio, topk;
  float eps;
  int chunk, max_chunks, gmax;
  int combine_stage;  // chunks staged per round by the sliced combine
  int role0;          // qsa_prep_early_kernel: the role of CTA 0 (a part of the roles)
  int* select_done;   // the select's done flag (overlapped projection), else nullptr
  // Rows by slot (QsaDecodeParams::row_slot set; blockIdx.z is the row): each row's slot, the
  // slots' caches, the rows' strides of proj and out, and the bytes of one row's workspace.
  const int32_t* row_slot;
  uint16_t* const* slot_k;
  uint16_t* const* slot_v;
  float* const* slot_raw;
  float* const* slot_block;
  int64_t proj_stride, out_stride, ws_stride;
};

template <typename T>
__device__ __forceinline__ T* byte_offset(T* p, int64_t bytes) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(p) + bytes);
}

// Row blockIdx.z of a launch over several rows: its position, its slot's caches, its projection
// and output rows and its own workspace. Every kernel calls it first.
__device__ __forceinline__ void select_row(Args& a) {
  if (a.row_slot == nullptr) return;  // one row on the caches of the parameters
  const int r = static_cast<int>(blockIdx.z);
  const int slot = a.row_slot[r];
  a.k_cache = a.slot_k[slot];
  a.v_cache = a.slot_v[slot];
  a.raw_keys = a.slot_raw[slot];
  a.block_keys = a.slot_block[slot];
  a.position += r;
  a.proj += r * a.proj_stride;
  a.out += r * a.out_stride;
  const int64_t w = r * a.ws_stride;
  a.q = byte_offset(a.q, w);
  a.qi = byte_offset(a.qi, w);
  a.scores = byte_offset(a.scores, w);
  a.selected = byte_offset(a.selected, w);
  a.counters = byte_offset(a.counters, w);
  a.part_out = byte_offset(a.part_out, w);
  a.part_max = byte_offset(a.part_max, w);
  a.part_sum = byte_offset(a.part_sum, w);
}

// The attention's wait for the select when the select runs beside the projection (the
// programmatic wait covers the query heads' prep only): thread 0 reads the done flag, and the
// barrier orders every thread's reads of the selection after it.
__device__ __forceinline__ void wait_select(const Args& a) {
  if (a.select_done == nullptr) return;  // uniform over the grid
  if (threadIdx.x == 0) dev::flag_wait(a.select_done);
  __syncthreads();
}

__device__ __forceinline__ bool valid_t(int64_t t, int64_t ctx) {
  return t >= 0 && t < ctx;
}

// The select's work before the top-k itself (the scores launch's select CTA): the counters ({0, 0,
// 0, 0} for a t outside the cache), then every complete block when at most k are (dense attention)
// or a forced choice (tests). Returns the k the top-k select must still pick, 0 when nothing is
// left to do. Every thread of the CTA calls it with B = (t + 1) / ratio.
__device__ __forceinline__ int select_prologue(const Args& a, int64_t t, int B) {
  const int tid = threadIdx.x;
  if (!valid_t(t, a.ctx)) {
    if (tid < 4) a.counters[tid] = 0;
    return 0;
  }
  const int k = min(a.topk, B);
  const int tail = static_cast<int>(t + 1 - int64_t{B} * a.ratio);
  if (tid == 0) {
    a.counters[0] = k;
    a.counters[1] = B;
    a.counters[2] = k * a.ratio + tail;
    a.counters[3] = 0;
  }
  if (k == B) {  // every complete block is selected (dense attention)
    for (int i = tid; i < B; i += kSelectThreads) a.selected[i] = i;
    return 0;
  }
  if (a.forced != nullptr) {  // tests: a reference's choice replayed
    for (int i = tid; i < k; i += kSelectThreads) a.selected[i] = a.forced[i];
    return 0;
  }
  return k;
}

// Lane `lane`'s share of the query heads' dot products with one K row (BF16 pairs k_row):
// acc[g] = sum over pairs p = lane, lane + 32, ... of q_g[2p] k[2p] + q_g[2p+1] k[2p+1] (FP32 fmaf
// chain in ascending p), for g < G; the caller reduces over the lanes.
// kG / kPairs > 0: G and pairs fixed at compile time (the same operations, constant addresses).
template <int kG = 0, int kPairs = 0>
__device__ __forceinline__ void qk_lane_dots(const uint32_t* k_row, const float2* q2, int pairs_rt,
                                             int G_rt, int lane, float (&acc)[kMaxG]) {
  const int pairs = kPairs > 0 ? kPairs : pairs_rt;
  const int G = kG > 0 ? kG : G_rt;
#pragma unroll
  for (int g = 0; g < kMaxG; ++g) acc[g] = 0.0f;
  for (int p = lane; p < pairs; p += 32) {
    const uint32_t kv = k_row[p];
    const float k0 = dev::bf16_lo(kv), k1 = dev::bf16_hi(kv);
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
      if (g < G) {
        const float2 qq = q2[g * pairs + p];
        acc[g] = fmaf(qq.x, k0, acc[g]);
        acc[g] = fmaf(qq.y, k1, acc[g]);
      }
    }
  }
}

// The chunk's softmax statistics per query head g < G (one warp per head): the max of the
// scores s_s[g * chunk + n], n < cnt, then p = exp(s - max) in place and its sum (lane-strided,
// then a butterfly), stored as part_max / part_sum of head i0 + g, chunk c.
// kChunk > 0: the chunk fixed at compile time (a.chunk otherwise).
template <int kChunk = 0>
__device__ __forceinline__ void chunk_softmax(const Args& a, float* s_s, int G, int cnt, int i0,
                                              int c, int warp, int lane) {
  const int chunk = kChunk > 0 ? kChunk : a.chunk;
  for (int g = warp; g < G; g += kThreads / 32) {
    float m = -INFINITY;
    for (int n = lane; n < cnt; n += 32) m = fmaxf(m, s_s[g * chunk + n]);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float l = 0.0f;
    for (int n = lane; n < cnt; n += 32) {
      const float p = expf(s_s[g * chunk + n] - m);
      s_s[g * chunk + n] = p;
      l += p;
    }
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) {
      a.part_max[(i0 + g) * a.max_chunks + c] = m;
      a.part_sum[(i0 + g) * a.max_chunks + c] = l;
    }
  }
}

// Attention of the query heads of local KV head blockIdx.y over attended tokens
// [chunk*blockIdx.x, +chunk): scores q.k * (1/sqrt(hd)) (FP32), per-chunk max and
// sum of exp(s - max), unnormalised sum_n p_n v_n. Token n of the attended list is block
// selected[n / ratio] for n < ratio * nsel, else the tail token ratio*B + (n - ratio*nsel).
// The chunk's K and V rows are staged in shared memory by all threads at once; one FP32
// accumulator per query head (kMaxG, unrolled) so the heads' chains overlap.
__global__ void __launch_bounds__(kThreads) qsa_attn_kernel(Args a) {
  select_row(a);
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  wait_select(a);
  extern __shared__ __align__(16) float smem[];
  const int64_t t = *a.position;
  if (!valid_t(t, a.ctx)) return;
  const int nsel = a.counters[0], B = a.counters[1], n_tokens = a.counters[2];
  const int c = blockIdx.x, j = blockIdx.y;
  const int start = c * a.chunk;
  if (start >= n_tokens) return;
  const int cnt = min(a.chunk, n_tokens - start);
  int i0 = -1;
  const int G = qsa_dev::q_heads_of_kv(a, j, &i0);  // the local q heads of KV head j
  if (G == 0) return;
  const int hd = a.hd, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pairs = hd / 2;
  float* q_s = smem;                                             // [gmax, hd]
  float* s_s = q_s + a.gmax * hd;                                // [gmax, chunk]
  int* tok_s = reinterpret_cast<int*>(s_s + a.gmax * a.chunk);   // [chunk]
  uint32_t* k_s = reinterpret_cast<uint32_t*>(tok_s + a.chunk);  // [chunk, hd/2] BF16 pairs
  uint32_t* v_s = k_s + a.chunk * pairs;                         // [chunk, hd/2] BF16 pairs
  for (int i = tid; i < G * hd; i += kThreads) q_s[i] = a.q[int64_t{i0} * hd + i];
  const int nb = nsel * a.ratio;
  for (int n = tid; n < cnt; n += kThreads) {
    const int ln = start + n;
    tok_s[n] =
        ln < nb ? a.selected[ln / a.ratio] * a.ratio + ln % a.ratio : B * a.ratio + (ln - nb);
  }
  __syncthreads();
  const int64_t row = int64_t{a.hkv} * hd;
#pragma unroll 4
  for (int idx = tid; idx < cnt * pairs; idx += kThreads) {
    const int n = idx / pairs, p = idx - n * pairs;
    const int64_t base = tok_s[n] * row + int64_t{j} * hd;
    k_s[idx] = reinterpret_cast<const uint32_t*>(a.k_cache + base)[p];
    v_s[idx] = reinterpret_cast<const uint32_t*>(a.v_cache + base)[p];
  }
  __syncthreads();
  const float scale = 1.0f / sqrtf(static_cast<float>(hd));
  const float2* q2 = reinterpret_cast<const float2*>(q_s);
  for (int n = warp; n < cnt; n += kThreads / 32) {
    float acc[kMaxG];
    qk_lane_dots(k_s + n * pairs, q2, pairs, G, lane, acc);
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
      if (g < G) {
        for (int off = 16; off > 0; off >>= 1) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], off);
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < kMaxG; ++g)
        if (g < G) s_s[g * a.chunk + n] = acc[g] * scale;
    }
  }
  __syncthreads();
  chunk_softmax(a, s_s, G, cnt, i0, c, warp, lane);
  __syncthreads();
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v_s);
  for (int d = tid; d < hd; d += kThreads) {
    float acc[kMaxG];
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) acc[g] = 0.0f;
    for (int n = 0; n < cnt; ++n) {
      const float v = __uint_as_float(uint32_t{v16[n * hd + d]} << 16);
#pragma unroll
      for (int g = 0; g < kMaxG; ++g)
        if (g < G) acc[g] = fmaf(s_s[g * a.chunk + n], v, acc[g]);
    }
#pragma unroll
    for (int g = 0; g < kMaxG; ++g)
      if (g < G) a.part_out[(int64_t{i0 + g} * a.max_chunks + c) * hd + d] = acc[g];
  }
}

// cp.async (sm_80+, cuda/common/device_util.cuh): global -> shared without a register round trip.
using dev::cp_async16;
using dev::cp_async4;
using dev::cp_async_wait_all;

// qsa_attn_kernel for hd % 8 == 0 and 16-byte aligned caches (the query heads of KV head
// blockIdx.y, chunk blockIdx.x): per head the same operations in the same order (dot products,
// butterflies, max, exp, sums, PV chains), so the same partial bits; q and the K/V rows arrive by
// cp.async (every copy in flight at once), the heads' butterflies are interleaved and PV reads
// four tokens' weights per shared load.
//
// kG, kHD, kChunk > 0 (qsa_attn_fixed_shape: the real model's 12 query heads per KV head, head
// dim 256, chunk 32 or 16, q heads aligned to their KV heads): the head count,
// head dim and chunk are compile-time constants, so every shared-memory and cache address is a
// constant offset and the per-head loops have no predicates; the operations and their order are
// those of the runtime-shape instance <0, 0, 0>, so the same bits. (ncu: the runtime
// instance at TP=1 executed ~133 warp-instructions per head and token, most of them integer
// address arithmetic and predicates, against ~30 of math.)
template <int kG, int kHD, int kChunk>
__global__ void __launch_bounds__(kThreads) qsa_attn_split_kernel(Args a) {
  select_row(a);
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  wait_select(a);
  extern __shared__ __align__(16) float smem[];
  const int64_t t = *a.position;
  if (!valid_t(t, a.ctx)) return;
  const int nsel = a.counters[0], B = a.counters[1], n_tokens = a.counters[2];
  const int chunk = kChunk > 0 ? kChunk : a.chunk;
  const int gmax = kG > 0 ? kG : a.gmax;
  const int c = blockIdx.x, j = blockIdx.y;
  const int start = c * chunk;
  if (start >= n_tokens) return;
  const int cnt = min(chunk, n_tokens - start);
  int i0 = -1, G = 0;
  if constexpr (kG > 0) {  // the launcher checked: KV head j owns local q heads [j kG, +kG)
    i0 = j * kG;
    G = kG;
  } else {
    const int g_all = qsa_dev::q_heads_of_kv(a, j, &i0);
    if (g_all == 0) return;
    G = g_all;
  }
  const int hd = kHD > 0 ? kHD : a.hd, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pairs = hd / 2;
  float* q_s = smem;                                           // [gmax, hd]
  float* s_s = q_s + gmax * hd;                                // [gmax, chunk]
  int* tok_s = reinterpret_cast<int*>(s_s + gmax * chunk);     // [chunk]
  uint32_t* k_s = reinterpret_cast<uint32_t*>(tok_s + chunk);  // [chunk, hd/2] BF16 pairs
  uint32_t* v_s = k_s + chunk * pairs;                         // [chunk, hd/2] BF16 pairs
  const float* qg = a.q + int64_t{i0} * hd;
  for (int i = tid; i < G * hd / 4; i += kThreads) cp_async16(q_s + 4 * i, qg + 4 * i);
  const int nb = nsel * a.ratio;
  for (int n = tid; n < cnt; n += kThreads) {
    const int ln = start + n;
    tok_s[n] =
        ln < nb ? a.selected[ln / a.ratio] * a.ratio + ln % a.ratio : B * a.ratio + (ln - nb);
  }
  __syncthreads();
  const int64_t row = int64_t{a.hkv} * hd;
  const int vecs = hd / 8;
  for (int idx = tid; idx < cnt * vecs; idx += kThreads) {
    const int n = idx / vecs, v = idx - n * vecs;
    const int64_t base = tok_s[n] * row + int64_t{j} * hd + 8 * v;
    cp_async16(k_s + n * pairs + 4 * v, a.k_cache + base);
    cp_async16(v_s + n * pairs + 4 * v, a.v_cache + base);
  }
  cp_async_wait_all();
  __syncthreads();
  const float scale = 1.0f / sqrtf(static_cast<float>(hd));
  const float2* q2 = reinterpret_cast<const float2*>(q_s);
  for (int n = warp; n < cnt; n += kThreads / 32) {
    float acc[kMaxG];
    qk_lane_dots<kG, kHD / 2>(k_s + n * pairs, q2, pairs, G, lane, acc);
    // Each head's butterfly in the same order as qsa_attn_kernel, the heads interleaved.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
      for (int g = 0; g < kMaxG; ++g)
        if (g < G) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], off);
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < kMaxG; ++g)
        if (g < G) s_s[g * chunk + n] = acc[g] * scale;
    }
  }
  __syncthreads();
  chunk_softmax<kChunk>(a, s_s, G, cnt, i0, c, warp, lane);
  __syncthreads();
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v_s);
  for (int d = tid; d < hd; d += kThreads) {
    float acc[kMaxG];
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) acc[g] = 0.0f;
    int n0 = 0;
    for (; n0 + 4 <= cnt; n0 += 4) {  // four tokens' weights per shared load; the same FMA order
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = __uint_as_float(uint32_t{v16[(n0 + u) * hd + d]} << 16);
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) {
        if (g < G) {
          const float4 s4 = *reinterpret_cast<const float4*>(s_s + g * chunk + n0);
          acc[g] = fmaf(s4.x, v[0], acc[g]);
          acc[g] = fmaf(s4.y, v[1], acc[g]);
          acc[g] = fmaf(s4.z, v[2], acc[g]);
          acc[g] = fmaf(s4.w, v[3], acc[g]);
        }
      }
    }
    for (int n = n0; n < cnt; ++n) {
      const float v = __uint_as_float(uint32_t{v16[n * hd + d]} << 16);
#pragma unroll
      for (int g = 0; g < kMaxG; ++g)
        if (g < G) acc[g] = fmaf(s_s[g * chunk + n], v, acc[g]);
    }
#pragma unroll
    for (int g = 0; g < kMaxG; ++g)
      if (g < G) a.part_out[(int64_t{i0 + g} * a.max_chunks + c) * hd + d] = acc[g];
  }
}

// The compile-time shape of qsa_attn_split_kernel's fixed instances: the real model's 12 query
// heads per KV head (24 / 2 globally) and head dim 256.
constexpr int kFixedG = real_shape::kQsaQPerKv;
constexpr int kFixedHd = real_shape::kQsaHeadDim;

// Whether a launch of qsa_attn_split_kernel with `heads` query heads per CTA may take a fixed
// instance: every local KV head j owns exactly the local query heads [j kFixedG, (j + 1) kFixedG)
// (q_per_kv = kFixedG and the rank's q heads start at its first KV head's), head dim kFixedHd.
bool qsa_attn_fixed_shape(const QsaDecodeParams& p, int heads) {
  return heads == kFixedG && p.head_dim == kFixedHd && p.q_per_kv == kFixedG &&
         p.q_head_first == p.kv_head_first * kFixedG && p.num_q_heads == kFixedG * p.num_kv_heads;
}

// One CTA per role: query heads [0, hq), KV heads [hq, hq+hkv) (K row + V row), indexer query
// heads, then one CTA for the raw indexer key and, when a block completes, its block key
// (indexer_block_key: the FP64 mean of the block's raw keys, norm, RoPE at the block's first
// position). The work that needs no earlier kernel's output is done before the programmatic wait
// (cuda/common/pdl.cuh): the position (written at the end of the previous step, many launches
// back), the norm weight, the RoPE rotation (FP64 pow + sincos) and, for a completing block, the
// FP64 sum of its raw keys of earlier steps. role0: the role of CTA 0 (the launch may hold a part
// of the roles).
__global__ void __launch_bounds__(kThreads) qsa_prep_early_kernel(Args a) {
  select_row(a);
  __shared__ float y[kMaxDim];
  __shared__ double red[kThreads / 32];
  const int64_t t = *a.position;  // not written by the last two launches
  const bool ok = valid_t(t, a.ctx);
  const int role = blockIdx.x + a.role0, tid = threadIdx.x;
  const int64_t hd = a.hd, qkv = int64_t{a.hq} * 2 * hd;
  const int64_t idx_off = qkv + 2 * int64_t{a.hkv} * hd;
  const int kind = role < a.hq ? 0 : role < a.hq + a.hkv ? 1 : role < a.hq + a.hkv + a.ni ? 2 : 3;
  const float* w = kind == 0 ? a.q_norm : kind == 1 ? a.k_norm : kind == 2 ? a.iq_norm : a.ik_norm;
  const int n = kind < 2 ? a.hd : a.ihd;
  const bool block_done = ok && (t + 1) % a.ratio == 0;
  const int64_t b = (t + 1) / a.ratio - 1;
  const int64_t pos = kind == 3 ? b * a.ratio : t;
  const float wv = tid < n ? w[tid] : 0.0f;
  float c = 0.0f, s = 0.0f;
  if (tid < a.rot / 2) qsa_dev::rope_cos_sin(a.theta, a.rot, pos, tid, &c, &s);
  double acc = 0.0;  // indexer_block_key's FP64 sum of the block's rows of earlier steps
  if (kind == 3 && block_done && tid < a.ihd)
    for (int i = 0; i + 1 < a.ratio; ++i) acc += a.raw_keys[(b * a.ratio + i) * a.ihd + tid];
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  // The launch that holds the indexer's roles (all roles, or the indexer's part beside the
  // overlapped projection) readies the scores launch: its done flag, its mailbox.
  const bool indexer_part = a.role0 + static_cast<int>(gridDim.x) > a.hq + a.hkv;
  if (indexer_part && blockIdx.x == 0 && tid == 0 && a.select_done != nullptr) *a.select_done = 0;
  if (indexer_part) {  // the scores launch's mailbox slots [0, B) emptied
    const int64_t nb = ok ? (t + 1) / a.ratio : 0;
    for (int64_t i = int64_t{blockIdx.x} * kThreads + tid; i < nb;
         i += int64_t{gridDim.x} * kThreads)
      dev::mail_store(a.scores + i, dev::kMailEmpty);
  }
  if (!ok) return;
  if (kind == 0) {
    const float xv = tid < n ? a.proj[role * 2 * hd + tid] : 0.0f;
    qsa_dev::norm_rope_cs(xv, wv, n, a.eps, a.rot, c, s, y, red);
    if (tid < a.hd) a.q[role * hd + tid] = y[tid];
  } else if (kind == 1) {
    const int j = role - a.hq;
    const float xv = tid < n ? a.proj[qkv + j * hd + tid] : 0.0f;
    qsa_dev::norm_rope_cs(xv, wv, n, a.eps, a.rot, c, s, y, red);
    const int64_t row = t * a.hkv * hd + j * hd;
    if (tid < a.hd) {
      a.k_cache[row + tid] = dev::float_to_bf16_bits(y[tid]);
      a.v_cache[row + tid] = dev::float_to_bf16_bits(a.proj[qkv + (a.hkv + j) * hd + tid]);
    }
  } else if (kind == 2) {
    const int h = role - a.hq - a.hkv;
    const float xv = tid < n ? a.proj[idx_off + h * a.ihd + tid] : 0.0f;
    qsa_dev::norm_rope_cs(xv, wv, n, a.eps, a.rot, c, s, y, red);
    if (tid < a.ihd) a.qi[h * a.ihd + tid] = y[tid];
  } else {
    const float* cur = a.proj + idx_off + int64_t{a.ni} * a.ihd;
    if (tid < a.ihd) a.raw_keys[t * a.ihd + tid] = cur[tid];
    if (!block_done) return;  // uniform over the CTA
    float xv = 0.0f;
    if (tid < a.ihd) {
      acc += cur[tid];
      xv = static_cast<float>(acc / static_cast<double>(a.ratio));
    }
    qsa_dev::norm_rope_cs(xv, wv, n, a.eps, a.rot, c, s, y, red);
    if (tid < a.ihd) a.block_keys[b * a.ihd + tid] = y[tid];
  }
}

// indexer_scores for blocks 0..B-1: one warp per block (kSelectThreads per CTA), FP64 dot per
// head (as cpu::dot), then relu in FP32 (std::max(0.0f, x) semantics), the head sum in FP64,
// times 1/sqrt(ihd) in FP64 (qsa_dev::block_score_kv), with each warp's first block key loaded
// before the programmatic wait when an earlier step wrote it (every block but the one completing
// now). Then top_k + qsa_selected_tokens' block part in the grid's last CTA: k = min(topk, B)
// blocks, higher score first, equal scores -> lower index, written ascending (radix select,
// qsa_dev::select_top_blocks_cg), reading each score from its mailbox slot as it is posted (the
// prep launch emptied the slots; no fence or atomic in any CTA).
__global__ void __launch_bounds__(kSelectThreads, 1) qsa_scores_select_kernel(Args a) {
  select_row(a);
  __shared__ __align__(16) uint32_t buf[kSelectCache];  // indexer queries, then select keys
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = *a.position;  // not written by the last two launches
  const bool ok = valid_t(t, a.ctx);
  const int64_t B = ok ? (t + 1) / a.ratio : 0;
  const int64_t b_old = ok && (t + 1) % a.ratio == 0 ? B - 1 : B;  // blocks of earlier steps
  const int64_t warps = int64_t{gridDim.x} * (kSelectThreads / 32);
  const int64_t b0 = int64_t{blockIdx.x} * (kSelectThreads / 32) + warp;
  float kv[kMaxDim / 32];
  const bool early = b0 < b_old;
  // Beside the overlapped projection the successor is the projection's query and KV rows, which
  // read only x (complete: the indexer prep waited for the indexer's rows, which waited for x's
  // writer, before it let this launch start): it may start now.
  if (a.select_done != nullptr) dev::pdl_launch_dependents();
  if (early) qsa_dev::load_block_key(a.block_keys + b0 * a.ihd, a.ihd, lane, kv);
  dev::pdl_wait();
  if (a.select_done == nullptr) dev::pdl_launch_dependents();
  if (int64_t{blockIdx.x} * (kSelectThreads / 32) < B) {  // uniform over the CTA
    float* qs = reinterpret_cast<float*>(buf);
    for (int i = tid; i < a.ni * a.ihd; i += kSelectThreads) qs[i] = a.qi[i];
    __syncthreads();
    const double scale = 1.0 / sqrt(static_cast<double>(a.ihd));
    for (int64_t b = b0; b < B; b += warps) {  // a warp scores several blocks past 32 x grid
      if (b != b0 || !early) qsa_dev::load_block_key(a.block_keys + b * a.ihd, a.ihd, lane, kv);
      const float sc = qsa_dev::block_score_kv(qs, kv, a.ni, a.ihd, lane, scale);
      if (lane == 0)  // a -NaN with the empty bits posted as the -NaN next to it
        dev::mail_post(a.scores + b, sc, dev::kMailEmpty - 1u);
    }
  }
  if (blockIdx.x + 1u != gridDim.x) return;  // uniform over the CTA
  __syncthreads();                           // its queries in buf no longer read
  const int Bi = static_cast<int>(B);
  const int k = select_prologue(a, t, Bi);
  if (k > 0) qsa_dev::select_top_blocks_cg(a.scores, Bi, k, a.selected, buf);
  if (a.select_done != nullptr) {  // the attention waits for this CTA's results
    __syncthreads();
    if (tid == 0) dev::flag_publish(a.select_done);
  }
}

constexpr int kCombineSlice = 32;  // head dims per sliced-combine CTA (one warp of chains)

// qsa_dev::combine_head of query head blockIdx.x for dims [32 blockIdx.y, +32): the same
// operations in the same order (max, exp weights, L and each output's FMA chain over the chunks
// ascending, division, gate), with the slice's partial outputs staged in shared memory by all
// threads (many loads in flight) before one warp runs the chains. The gate's sigmoid (the GEMV
// output, several launches back) is computed before the programmatic wait.
__global__ void __launch_bounds__(kThreads) qsa_combine_slice_kernel(Args a) {
  select_row(a);
  extern __shared__ __align__(16) float csm[];
  __shared__ float red[kThreads / 32];
  const int i = blockIdx.x, hd = a.hd, tid = threadIdx.x;
  const int d = blockIdx.y * kCombineSlice + tid;
  const bool mine = tid < kCombineSlice && d < hd;
  const int64_t t = *a.position;  // not written by the last two launches
  float sg = 0.0f;
  if (mine) {
    const float g = a.proj[int64_t{i} * 2 * hd + hd + d];
    if (g >= 0.0f) {
      sg = 1.0f / (1.0f + expf(-g));
    } else {
      const float e = expf(g);
      sg = e / (1.0f + e);
    }
  }
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  uint16_t* out = a.out + int64_t{i} * hd;
  if (!valid_t(t, a.ctx)) {
    if (mine) out[d] = kBf16Nan;
    return;
  }
  const int nc = (a.counters[2] + a.chunk - 1) / a.chunk;
  const float* pm = a.part_max + int64_t{i} * a.max_chunks;
  const float* ps = a.part_sum + int64_t{i} * a.max_chunks;
  const float* po = a.part_out + int64_t{i} * a.max_chunks * hd;
  float* wc = csm;                // [max_chunks]
  float* sc = wc + a.max_chunks;  // [max_chunks]
  float* st = sc + a.max_chunks;  // [combine_stage, kCombineSlice]
  qsa_dev::combine_weights(pm, ps, nc, wc, sc, red);
  float o = 0.0f;
  const int d0 = blockIdx.y * kCombineSlice;
  for (int c0 = 0; c0 < nc; c0 += a.combine_stage) {
    const int cs = min(a.combine_stage, nc - c0);
    for (int idx = tid; idx < cs * kCombineSlice; idx += kThreads) {
      const int cc = idx / kCombineSlice, dd = idx - cc * kCombineSlice;
      if (d0 + dd < hd)
        cp_async4(st + idx, po + int64_t{c0 + cc} * hd + d0 + dd);
      else
        st[idx] = 0.0f;
    }
    cp_async_wait_all();
    __syncthreads();
    if (mine)
      for (int cc = 0; cc < cs; ++cc) o = fmaf(st[cc * kCombineSlice + tid], wc[c0 + cc], o);
    __syncthreads();
  }
  if (!mine) return;
  float L = 0.0f;
  for (int c = 0; c < nc; ++c) L = fmaf(sc[c], wc[c], L);
  o = o / L;
  out[d] = dev::float_to_bf16_bits(o * sg);
}

using detail::aligned;

size_t align256(size_t x) {
  return (x + 255) & ~size_t{255};
}

size_t attn_smem_bytes(int gmax, int hd, int chunk) {
  return size_t(gmax) * hd * 4 + size_t(gmax) * chunk * 4 + size_t(chunk) * 4 +
         2 * size_t(chunk) * hd * 2;
}

void check_shape(const QsaDecodeParams& p, const char* op) {
  FN_LAUNCH_REQUIRE(p.ctx_size >= 1 && p.ctx_size <= (int64_t{1} << 30), op);
  FN_LAUNCH_REQUIRE(p.num_q_heads >= 1 && p.num_q_heads <= 1024, op);
  FN_LAUNCH_REQUIRE(p.num_kv_heads >= 1 && p.q_per_kv >= 1, op);
  FN_LAUNCH_REQUIRE(p.q_head_first >= 0 && p.kv_head_first >= 0, op);
  FN_LAUNCH_REQUIRE(p.head_dim >= 2 && p.head_dim <= kMaxDim && p.head_dim % 2 == 0, op);
  FN_LAUNCH_REQUIRE(p.indexer_heads >= 1 && p.indexer_head_dim >= 1, op);
  FN_LAUNCH_REQUIRE(p.indexer_head_dim <= kMaxDim, op);
  FN_LAUNCH_REQUIRE(p.indexer_heads * p.indexer_head_dim <= kMaxIndexerQ, op);
  FN_LAUNCH_REQUIRE(p.rotary_dim >= 2 && p.rotary_dim % 2 == 0, op);
  FN_LAUNCH_REQUIRE(p.rotary_dim <= p.head_dim && p.rotary_dim <= p.indexer_head_dim, op);
  FN_LAUNCH_REQUIRE(p.rope_theta > 0, op);
  FN_LAUNCH_REQUIRE(p.ratio >= 1 && p.block_topk >= 1, op);
  FN_LAUNCH_REQUIRE(p.eps >= 0.0f, op);
  for (int i = 0; i < p.num_q_heads; ++i) {
    const int kv = (p.q_head_first + i) / p.q_per_kv - p.kv_head_first;
    FN_LAUNCH_REQUIRE(kv >= 0 && kv < p.num_kv_heads, op);
  }
}

}  // namespace

QsaWorkspaceLayout qsa_workspace_layout(const QsaDecodeParams& p) {
  constexpr const char* kOp = "qsa_workspace_layout";
  check_shape(p, kOp);
  QsaWorkspaceLayout w;
  const int64_t max_blocks = p.ctx_size / p.ratio;
  const int64_t sel_max = std::min<int64_t>(p.block_topk, max_blocks);
  w.max_tokens = std::min<int64_t>(p.ctx_size, int64_t{p.ratio} * sel_max + p.ratio - 1);
  int gmax = 0;
  for (int j = 0; j < p.num_kv_heads; ++j) {
    int g = 0;
    for (int i = 0; i < p.num_q_heads; ++i)
      g += (p.q_head_first + i) / p.q_per_kv - p.kv_head_first == j;
    gmax = std::max(gmax, g);
  }
  FN_LAUNCH_REQUIRE(gmax <= kMaxG, kOp);
  // Chunk: about 256 attention CTAs at the largest token count, 16..64 tokens, within 48 KiB of
  // shared memory.
  const int64_t per = (w.max_tokens * p.num_kv_heads + 255) / 256;
  int chunk = static_cast<int>(std::clamp<int64_t>((per + 15) / 16 * 16, 16, 64));
  while (chunk > 16 && attn_smem_bytes(gmax, p.head_dim, chunk) > kSmemLimit) chunk -= 16;
  FN_LAUNCH_REQUIRE(attn_smem_bytes(gmax, p.head_dim, chunk) <= kSmemLimit, kOp);
  w.chunk = chunk;
  w.max_chunks = static_cast<int>((w.max_tokens + chunk - 1) / chunk);
  FN_LAUNCH_REQUIRE(w.max_chunks <= kMaxChunks, kOp);
  const size_t hq = p.num_q_heads, hd = p.head_dim;
  size_t off = 0;
  w.q = off;
  off = align256(off + hq * hd * 4);
  w.qi = off;
  off = align256(off + size_t(p.indexer_heads) * p.indexer_head_dim * 4);
  w.scores = off;
  off = align256(off + size_t(std::max<int64_t>(max_blocks, 1)) * 4);
  w.selected = off;
  off = align256(off + size_t(std::max<int64_t>(sel_max, 1)) * 4);
  w.counters = off;
  w.select_done = off + 64;
  off = align256(off + 68);
  w.part_out = off;
  off = align256(off + hq * w.max_chunks * hd * 4);
  w.part_max = off;
  off = align256(off + hq * w.max_chunks * 4);
  w.part_sum = off;
  off = align256(off + hq * w.max_chunks * 4);
  w.total = off;
  return w;
}

size_t qsa_decode_workspace_bytes(const QsaDecodeParams& p) {
  return qsa_workspace_layout(p).total;
}

int64_t qsa_proj_size(const QsaDecodeParams& p) {
  return int64_t{p.num_q_heads} * 2 * p.head_dim + 2 * int64_t{p.num_kv_heads} * p.head_dim +
         int64_t{p.indexer_heads + 1} * p.indexer_head_dim;
}

void launch_qsa_decode(const QsaDecodeParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_qsa_decode";
  FN_LAUNCH_REQUIRE(p.proj != nullptr && p.q_norm != nullptr && p.k_norm != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.iq_norm != nullptr && p.ik_norm != nullptr && p.position != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.k_cache != nullptr && p.v_cache != nullptr && p.raw_keys != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.block_keys != nullptr && p.workspace != nullptr && p.out != nullptr, kOp);
  FN_LAUNCH_REQUIRE(aligned(p.workspace, 256) && aligned(p.k_cache, 4) && aligned(p.v_cache, 4),
                    kOp);
  const QsaWorkspaceLayout w = qsa_workspace_layout(p);
  char* ws = static_cast<char*>(p.workspace);
  Args a{};
  a.proj = p.proj;
  a.q_norm = p.q_norm;
  a.k_norm = p.k_norm;
  a.iq_norm = p.iq_norm;
  a.ik_norm = p.ik_norm;
  a.position = p.position;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.raw_keys = p.raw_keys;
  a.block_keys = p.block_keys;
  a.out = p.out;
  a.q = reinterpret_cast<float*>(ws + w.q);
  a.qi = reinterpret_cast<float*>(ws + w.qi);
  a.scores = reinterpret_cast<float*>(ws + w.scores);
  a.selected = reinterpret_cast<int*>(ws + w.selected);
  a.counters = reinterpret_cast<int*>(ws + w.counters);
  a.forced = p.forced_blocks;
  a.part_out = reinterpret_cast<float*>(ws + w.part_out);
  a.part_max = reinterpret_cast<float*>(ws + w.part_max);
  a.part_sum = reinterpret_cast<float*>(ws + w.part_sum);
  a.ctx = p.ctx_size;
  a.theta = p.rope_theta;
  a.hq = p.num_q_heads;
  a.hkv = p.num_kv_heads;
  a.q_head_first = p.q_head_first;
  a.q_per_kv = p.q_per_kv;
  a.kv_head_first = p.kv_head_first;
  a.hd = p.head_dim;
  a.rot = p.rotary_dim;
  a.ni = p.indexer_heads;
  a.ihd = p.indexer_head_dim;
  a.ratio = p.ratio;
  a.topk = p.block_topk;
  a.eps = p.eps;
  a.chunk = w.chunk;
  a.max_chunks = w.max_chunks;
  a.gmax = 0;
  for (int j = 0; j < p.num_kv_heads; ++j) {
    int g = 0;
    for (int i = 0; i < p.num_q_heads; ++i)
      g += (p.q_head_first + i) / p.q_per_kv - p.kv_head_first == j;
    a.gmax = std::max(a.gmax, g);
  }
  // Chunks the sliced combine stages per round: all of them when shared memory allows.
  const int64_t stage_room =
      (kSmemLimit - 256 - 2 * int64_t{w.max_chunks} * 4) / (kCombineSlice * 4);
  a.combine_stage = static_cast<int>(std::clamp<int64_t>(stage_room, 1, w.max_chunks));
  a.role0 = 0;
  a.select_done = nullptr;
  const bool overlap = p.in_proj != nullptr;
  FN_LAUNCH_REQUIRE(p.rows >= 1 && p.rows <= 65535, kOp);
  const auto rows = static_cast<unsigned>(p.rows);
  FN_LAUNCH_REQUIRE(p.rows == 1 || p.row_slot != nullptr, kOp);
  if (p.row_slot != nullptr) {
    FN_LAUNCH_REQUIRE(p.slot_k_cache != nullptr && p.slot_v_cache != nullptr &&
                          p.slot_raw_keys != nullptr && p.slot_block_keys != nullptr && !overlap &&
                          p.forced_blocks == nullptr,
                      kOp);
    FN_LAUNCH_REQUIRE(
        p.proj_stride >= qsa_proj_size(p) && p.out_stride >= int64_t{p.num_q_heads} * p.head_dim,
        kOp);
    a.row_slot = p.row_slot;
    a.slot_k = p.slot_k_cache;
    a.slot_v = p.slot_v_cache;
    a.slot_raw = p.slot_raw_keys;
    a.slot_block = p.slot_block_keys;
    a.proj_stride = p.proj_stride;
    a.out_stride = p.out_stride;
    a.ws_stride = static_cast<int64_t>(w.total);
  }
  if (overlap) {
    FN_LAUNCH_REQUIRE(p.x != nullptr, kOp);
    FN_LAUNCH_REQUIRE(p.hidden >= 8 && p.hidden <= 8192 && p.hidden % 8 == 0, kOp);
    FN_LAUNCH_REQUIRE(aligned(p.in_proj, 16) && aligned(p.x, 16), kOp);
    a.select_done = reinterpret_cast<int*>(ws + w.select_done);
  }
  const int64_t max_blocks = p.ctx_size / p.ratio;
  const size_t smem = attn_smem_bytes(a.gmax, p.head_dim, w.chunk);
  // Four programmatic dependent launches: prep, scores + select, attention, sliced combine. With
  // the overlapped projection: the indexer's rows, their prep, scores + select, the query and KV
  // rows beside the select, their prep, attention (after the select's flag), sliced combine.
  const int head_roles = p.num_q_heads + p.num_kv_heads, idx_roles = p.indexer_heads + 1;
  const int64_t idx_off =
      int64_t{p.num_q_heads} * 2 * p.head_dim + 2 * int64_t{p.num_kv_heads} * p.head_dim;
  GemvBf16Params g;
  if (overlap) {
    // Both parts at the team width of one GEMV over all rows: a row's sum depends only on it
    // (cuda/kernels/gemv_bf16.cuh), so the same bits as launch_gemv_bf16 over the stacked matrix.
    const int64_t idx_rows = int64_t{idx_roles} * p.indexer_head_dim;
    const GemvBf16Plan whole =
        plan_gemv_bf16(idx_off + idx_rows, p.hidden, detail::current_sm_count());
    g.weight = p.in_proj + idx_off * p.hidden;
    g.rows = idx_rows;
    g.cols = p.hidden;
    g.ld = p.hidden;
    g.x = p.x;
    g.x_dtype = DType::F32;
    g.y = p.proj + idx_off;
    g.y_dtype = DType::F32;
    g.plan = plan_gemv_bf16_part(whole, idx_rows, 1);
    launch_gemv_bf16(g, stream);
    g.weight = p.in_proj;
    g.rows = idx_off;
    g.y = p.proj;
    g.plan = plan_gemv_bf16_part(whole, idx_off, whole.rows_per_team);
    g.no_pdl_wait = true;
  }
  {
    Args ai = a;
    if (overlap) ai.role0 = head_roles;
    launch_pdl("qsa_prep_early_kernel", qsa_prep_early_kernel,
               dim3(static_cast<unsigned>(overlap ? idx_roles : head_roles + idx_roles), 1, rows),
               kThreads, 0, stream, ai);
    FN_CUDA_LAUNCH_CHECK("qsa_prep_early_kernel");
  }
  {
    // One warp per block, in at most half the SMs plus one CTAs (67 on H200); past that a warp
    // scores several blocks. On H200 a 68th scoring CTA made the select 3.7 us later, more than
    // a warp's second block costs (docs/perf-history.md).
    const int64_t cap = std::max(1, detail::current_sm_count() / 2 + 1);
    const int ctas = static_cast<int>(std::clamp<int64_t>(
        (max_blocks + kSelectThreads / 32 - 1) / (kSelectThreads / 32), 1, cap));
    launch_pdl("qsa_scores_select_kernel", qsa_scores_select_kernel,
               dim3(static_cast<unsigned>(ctas), 1, rows), kSelectThreads, 0, stream, a);
    FN_CUDA_LAUNCH_CHECK("qsa_scores_select_kernel");
  }
  if (overlap) {
    launch_gemv_bf16(g, stream);  // beside the select: x was complete before the indexer's rows
    // the query and KV heads' roles (role0 0)
    launch_pdl("qsa_prep_early_kernel", qsa_prep_early_kernel, head_roles, kThreads, 0, stream, a);
    FN_CUDA_LAUNCH_CHECK("qsa_prep_early_kernel");
  }
  if (p.head_dim % 8 == 0 && aligned(p.k_cache, 16) && aligned(p.v_cache, 16)) {
    // All query heads of a KV head in one CTA per chunk: on H200 at t = 8191 splitting them over
    // CTAs measured slower (docs/perf-history.md).
    const dim3 grid(w.max_chunks, p.num_kv_heads, rows);
    const bool fixed = qsa_attn_fixed_shape(p, a.gmax);
    if (fixed && w.chunk == 32)
      launch_pdl("qsa_attn_split_kernel", qsa_attn_split_kernel<kFixedG, kFixedHd, 32>, grid,
                 kThreads, smem, stream, a);
    else if (fixed && w.chunk == 16)
      launch_pdl("qsa_attn_split_kernel", qsa_attn_split_kernel<kFixedG, kFixedHd, 16>, grid,
                 kThreads, smem, stream, a);
    else
      launch_pdl("qsa_attn_split_kernel", qsa_attn_split_kernel<0, 0, 0>, grid, kThreads, smem,
                 stream, a);
    FN_CUDA_LAUNCH_CHECK("qsa_attn_split_kernel");
  } else {  // head dims not a multiple of 8 or caches not 16-byte aligned
    launch_pdl("qsa_attn_kernel", qsa_attn_kernel, dim3(w.max_chunks, p.num_kv_heads, rows),
               kThreads, smem, stream, a);
    FN_CUDA_LAUNCH_CHECK("qsa_attn_kernel");
  }
  const size_t csmem =
      (2 * size_t(w.max_chunks) + size_t(a.combine_stage) * kCombineSlice) * sizeof(float);
  launch_pdl("qsa_combine_slice_kernel", qsa_combine_slice_kernel,
             dim3(p.num_q_heads, (p.head_dim + kCombineSlice - 1) / kCombineSlice, rows), kThreads,
             csmem, stream, a);
  FN_CUDA_LAUNCH_CHECK("qsa_combine_slice_kernel");
}

}  // namespace fn

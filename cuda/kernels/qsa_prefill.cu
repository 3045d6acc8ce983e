// QSA prefill kernels (see qsa_prefill.h). Rows are processed in groups; per group: prep (norms,
// RoPE, K/V/raw-key rows), block keys completed in the group, indexer scores, top-k select, then
// the attention: the tensor-core one (kFused: per sub-group of rows the union of their blocks,
// then one CTA per sub-group and KV head over the union's 64-token tiles with per-row masks, MMAs
// on BF16 pieces of the FP32 operands, online softmax, gate, BF16 out), the CUDA-core one
// (kFusedCudaCores: one CTA per row and KV head, online softmax over 64-token tiles, gate, BF16
// out) or decode's chunked attention + combine. Row y of a group is position t0 + y.
// The arithmetic of every step up to the selection is decode's (cuda/kernels/qsa_device.cuh); the
// chunked attention performs decode's exact operation sequence per token with more work per
// shared-memory load, the fused ones the same math in other FP32 summation orders.
//
// Measured before the tensor-core kernel ("fused" is kFusedCudaCores; H200, real shapes: hd 256,
// 4 x 128 indexer, ratio 4, block_topk 512, ctx 8192, p0 = 0; ms per layer, per-kernel times from
// an event-bracketed run, summed over groups):
//   TP=1 M=8192  decode chunks (81-row groups): 73.6 = prep 1.3, block keys 0.8, scores 4.5,
//                select 0.9, attention 63.4, combine 5.0
//                fused (2048-row groups):       21.4 = prep 0.6, block keys 0.04, scores 3.6,
//                select 0.2, attention 17.0
//   TP=2 M=8192  decode chunks 59.8 (attention 49.5, combine 5.3); fused 12.7 (attention 8.5,
//                scores 3.6)
//   M=2048       decode chunks 10.3 (TP=1) / 8.2 (TP=2); fused 2.6 / 1.3
// Fused groups of 256 / 1024 rows: 22.3 / 21.6 ms (TP=1, M=8192); 64 rows: 41.9 ms.
// The tensor-core kernel (kFused; one H100, TP=1, M=8192, 2048-row groups): 20.2 ms per layer,
// attention 15.7 (kFusedCudaCores in the same run: 21.25); 1024 / 256 / 64-row groups: 21.3 /
// 39.4 / 137.3 ms (fewer CTAs per launch as the groups shrink).
// 232,742 of 50,331,648 outputs differ from decode's, none outside the bound (worst 0.992 of it).
#include "cuda/kernels/qsa_prefill.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/nvfp4_mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/kernels/qsa_device.cuh"

namespace fn {
namespace {

using qsa_dev::kQsaMaxDim;
using qsa_dev::kQsaSelectThreads;
using qsa_dev::kQsaThreads;
using qsa_dev::norm_rope;

constexpr int kMaxIndexerQ = 4096;  // indexer_heads * ihd floats in static shared memory
constexpr int kMaxG = 16;           // query heads per KV head (decode's limit)
constexpr int kTokensPerWarp = 4;   // attention: tokens whose q.k chains a warp runs together
constexpr int kMaxGroupRows = 2048;
constexpr int kDefaultSmem = 48 * 1024;
constexpr int kFusedTile = 64;  // fused attention: attended tokens per K/V tile (2 per lane)
constexpr size_t kMaxFusedSmem = 200 * 1024;  // fused attention: dynamic shared memory limit
// Tensor-core attention (prefill_tc_attn_kernel): 8 warps, one m16 MMA tile of query vectors
// (row, q head) each; K/V tiles of 64 union tokens; O of up to 256 dims in registers.
constexpr int kTcWarps = 8;
constexpr int kTcThreads = 32 * kTcWarps;
constexpr int kTcVectors = 16 * kTcWarps;
constexpr int kTcTile = 64;
constexpr int kTcMaxHd = 256;
constexpr size_t kMaxUnionSmem = 48 * 1024;  // union kernel: block bitmap + prefix (static limit)

struct PArgs {
  const float* proj;
  int64_t proj_stride;
  const float* q_norm;
  const float* k_norm;
  const float* iq_norm;
  const float* ik_norm;
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
  float* part_out;
  float* part_max;
  float* part_sum;
  int* u_count;        // [subs] union blocks per sub-group (tensor-core attention)
  int* u_blocks;       // [subs, u_cap] union blocks ascending
  uint32_t* u_mask;    // [subs, tc_rows, u_words] row r's bit per union block
  int tc_rows;         // rows per sub-group
  int u_cap, u_words;  // union capacity (blocks) and mask words per row
  int bm_words;        // union kernel's bitmap words (max_blocks / 32 + 1)
  int64_t t0;          // position of group row 0
  int64_t r0;          // chunk row of group row 0 (proj and out row index)
  int64_t b_first;     // first block completed inside the group
  int64_t max_blocks;  // scores per row
  int64_t sel_max;     // selected slots per row
  double theta;
  int hq, hkv, q_head_first, q_per_kv, kv_head_first, hd, rot;
  int ni, ihd, ratio, topk;
  float eps;
  int chunk, max_chunks, gmax, gpad;
  bool vec16;  // hd % 8 == 0 and 16-byte aligned caches: K/V rows staged with 16-byte loads
};

__device__ __forceinline__ const float* proj_row(const PArgs& a, int64_t y) {
  return a.proj + (a.r0 + y) * a.proj_stride;
}

// Decode's prep roles for row blockIdx.y (position t0 + y): query heads, KV heads (K row + V
// row), indexer query heads, the raw indexer key. Block keys follow in their own kernel (they read
// raw keys of earlier rows of the group).
__global__ void __launch_bounds__(kQsaThreads) prefill_prep_kernel(PArgs a) {
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  __shared__ float y_s[kQsaMaxDim];
  __shared__ double red[kQsaThreads / 32];
  const int64_t y = blockIdx.y, t = a.t0 + y;
  const float* proj = proj_row(a, y);
  const int role = blockIdx.x, tid = threadIdx.x;
  const int64_t hd = a.hd, qkv = int64_t{a.hq} * 2 * hd;
  const int64_t idx_off = qkv + 2 * int64_t{a.hkv} * hd;
  if (role < a.hq) {
    norm_rope(proj + role * 2 * hd, a.q_norm, a.hd, a.eps, a.rot, a.theta, t, y_s, red);
    if (tid < a.hd) a.q[(y * a.hq + role) * hd + tid] = y_s[tid];
  } else if (role < a.hq + a.hkv) {
    const int j = role - a.hq;
    norm_rope(proj + qkv + j * hd, a.k_norm, a.hd, a.eps, a.rot, a.theta, t, y_s, red);
    const int64_t row = t * a.hkv * hd + j * hd;
    if (tid < a.hd) {
      a.k_cache[row + tid] = dev::float_to_bf16_bits(y_s[tid]);
      a.v_cache[row + tid] = dev::float_to_bf16_bits(proj[qkv + (a.hkv + j) * hd + tid]);
    }
  } else if (role < a.hq + a.hkv + a.ni) {
    const int h = role - a.hq - a.hkv;
    norm_rope(proj + idx_off + h * a.ihd, a.iq_norm, a.ihd, a.eps, a.rot, a.theta, t, y_s, red);
    if (tid < a.ihd) a.qi[(y * a.ni + h) * a.ihd + tid] = y_s[tid];
  } else {
    const float* cur = proj + idx_off + int64_t{a.ni} * a.ihd;
    if (tid < a.ihd) a.raw_keys[t * a.ihd + tid] = cur[tid];
  }
}

// indexer_block_key of block b_first + blockIdx.x (complete inside the group): decode's FP64 mean
// in row order over the raw keys (all written by now; the last is the completing row's key, which
// decode reads from proj: the same bits), norm, RoPE at the block's first position.
__global__ void __launch_bounds__(kQsaThreads) prefill_block_key_kernel(PArgs a) {
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  __shared__ float y_s[kQsaMaxDim];
  __shared__ float xin[kQsaMaxDim];
  __shared__ double red[kQsaThreads / 32];
  const int64_t b = a.b_first + blockIdx.x;
  const int tid = threadIdx.x;
  if (tid < a.ihd) {
    double acc = 0.0;
    for (int i = 0; i + 1 < a.ratio; ++i) acc += a.raw_keys[(b * a.ratio + i) * a.ihd + tid];
    acc += a.raw_keys[(b * a.ratio + a.ratio - 1) * a.ihd + tid];
    xin[tid] = static_cast<float>(acc / static_cast<double>(a.ratio));
  }
  __syncthreads();
  norm_rope(xin, a.ik_norm, a.ihd, a.eps, a.rot, a.theta, b * a.ratio, y_s, red);
  if (tid < a.ihd) a.block_keys[b * a.ihd + tid] = y_s[tid];
}

// Scores of blocks 0..B-1 for row blockIdx.y when it selects (B > block_topk): one warp per block
// (decode's block_score), warps striding over the blocks.
__global__ void __launch_bounds__(kQsaThreads) prefill_scores_kernel(PArgs a) {
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  __shared__ float qs[kMaxIndexerQ];
  const int64_t y = blockIdx.y, t = a.t0 + y;
  const int64_t B = (t + 1) / a.ratio;
  if (B <= a.topk) return;  // dense row: every block is selected, no scores needed
  if (int64_t{blockIdx.x} * (kQsaThreads / 32) >= B) return;  // uniform over the CTA
  const float* qi = a.qi + y * a.ni * a.ihd;
  for (int i = threadIdx.x; i < a.ni * a.ihd; i += kQsaThreads) qs[i] = qi[i];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t{gridDim.x} * (kQsaThreads / 32);
  const double scale = 1.0 / sqrt(static_cast<double>(a.ihd));
  float* scores = a.scores + y * a.max_blocks;
  for (int64_t b = int64_t{blockIdx.x} * (kQsaThreads / 32) + (threadIdx.x >> 5); b < B;
       b += warps) {
    const float s = qsa_dev::block_score(qs, a.block_keys + b * a.ihd, a.ni, a.ihd, lane, scale);
    if (lane == 0) scores[b] = s;
  }
}

// Decode's select for row blockIdx.y: counters, identity when every block is selected, else the
// radix top-k (qsa_dev::select_top_blocks).
__global__ void __launch_bounds__(kQsaSelectThreads) prefill_select_kernel(PArgs a) {
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  const int tid = threadIdx.x;
  const int64_t y = blockIdx.x, t = a.t0 + y;
  const int B = static_cast<int>((t + 1) / a.ratio);
  const int k = min(a.topk, B);
  const int tail = static_cast<int>(t + 1 - int64_t{B} * a.ratio);
  int* counters = a.counters + 4 * y;
  int* selected = a.selected + y * a.sel_max;
  if (tid == 0) {
    counters[0] = k;
    counters[1] = B;
    counters[2] = k * a.ratio + tail;
    counters[3] = 0;
  }
  if (k == B) {
    for (int i = tid; i < B; i += kQsaSelectThreads) selected[i] = i;
    return;
  }
  qsa_dev::select_top_blocks(a.scores + y * a.max_blocks, B, k, selected);
}

// Attention of row blockIdx.z, local KV head blockIdx.y, attended tokens [chunk*blockIdx.x,
// +chunk): decode's qsa_attn_kernel operation for operation (per token and head one fmaf chain
// over the dims in lane-strided pairs, the same butterfly, scale, per-chunk max, exp sum and
// fmaf chain over the chunk's V rows), with a warp running kTokensPerWarp tokens' chains together
// (each q load feeds all of them) and the probabilities stored token-major so a thread reads a
// token's G of them with 16-byte loads.
__global__ void __launch_bounds__(kQsaThreads) prefill_attn_kernel(PArgs a) {
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  extern __shared__ float4 smem4[];
  const int64_t y = blockIdx.z;
  const int* counters = a.counters + 4 * y;
  const int nsel = counters[0], B = counters[1], n_tokens = counters[2];
  const int c = blockIdx.x, j = blockIdx.y;
  const int start = c * a.chunk;
  if (start >= n_tokens) return;
  const int cnt = min(a.chunk, n_tokens - start);
  int i0 = -1;
  const int G = qsa_dev::q_heads_of_kv(a, j, &i0);
  if (G == 0) return;
  const int hd = a.hd, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pairs = hd / 2, gpad = a.gpad;
  float* s_s = reinterpret_cast<float*>(smem4);  // [chunk, gpad]
  float* q_s = s_s + a.chunk * gpad;             // [gmax, hd] (rounded to 4)
  int* tok_s = reinterpret_cast<int*>(q_s + (a.gmax * hd + 3) / 4 * 4);  // [chunk]
  uint32_t* k_s = reinterpret_cast<uint32_t*>(tok_s + a.chunk);          // [chunk, hd/2] BF16 pairs
  uint32_t* v_s = k_s + a.chunk * pairs;                                 // [chunk, hd/2] BF16 pairs
  const float* q = a.q + (y * a.hq + i0) * int64_t{hd};
  for (int i = tid; i < G * hd; i += kQsaThreads) q_s[i] = q[i];
  const int* selected = a.selected + y * a.sel_max;
  const int nb = nsel * a.ratio;
  for (int n = tid; n < cnt; n += kQsaThreads) {
    const int ln = start + n;
    tok_s[n] = ln < nb ? selected[ln / a.ratio] * a.ratio + ln % a.ratio : B * a.ratio + (ln - nb);
  }
  __syncthreads();
  const int64_t row = int64_t{a.hkv} * hd;
  if (a.vec16) {
    const int vecs = hd / 8;
    uint4* k4 = reinterpret_cast<uint4*>(k_s);
    uint4* v4 = reinterpret_cast<uint4*>(v_s);
#pragma unroll 4
    for (int idx = tid; idx < cnt * vecs; idx += kQsaThreads) {
      const int n = idx / vecs, p = idx - n * vecs;
      const int64_t base = tok_s[n] * row + int64_t{j} * hd;
      k4[idx] = reinterpret_cast<const uint4*>(a.k_cache + base)[p];
      v4[idx] = reinterpret_cast<const uint4*>(a.v_cache + base)[p];
    }
  } else {
#pragma unroll 4
    for (int idx = tid; idx < cnt * pairs; idx += kQsaThreads) {
      const int n = idx / pairs, p = idx - n * pairs;
      const int64_t base = tok_s[n] * row + int64_t{j} * hd;
      k_s[idx] = reinterpret_cast<const uint32_t*>(a.k_cache + base)[p];
      v_s[idx] = reinterpret_cast<const uint32_t*>(a.v_cache + base)[p];
    }
  }
  __syncthreads();
  const float scale = 1.0f / sqrtf(static_cast<float>(hd));
  const float2* q2 = reinterpret_cast<const float2*>(q_s);
  constexpr int kWarps = kQsaThreads / 32;
  for (int n0 = warp; n0 < cnt; n0 += kWarps * kTokensPerWarp) {
    float acc[kTokensPerWarp][kMaxG];
#pragma unroll
    for (int u = 0; u < kTokensPerWarp; ++u)
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) acc[u][g] = 0.0f;
    for (int p = lane; p < pairs; p += 32) {
      float k0[kTokensPerWarp], k1[kTokensPerWarp];
#pragma unroll
      for (int u = 0; u < kTokensPerWarp; ++u) {
        const int n = n0 + kWarps * u;
        const uint32_t kv = n < cnt ? k_s[n * pairs + p] : 0u;
        k0[u] = dev::bf16_lo(kv);
        k1[u] = dev::bf16_hi(kv);
      }
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) {
        if (g < G) {
          const float2 qq = q2[g * pairs + p];
#pragma unroll
          for (int u = 0; u < kTokensPerWarp; ++u) {
            acc[u][g] = fmaf(qq.x, k0[u], acc[u][g]);
            acc[u][g] = fmaf(qq.y, k1[u], acc[u][g]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kTokensPerWarp; ++u) {
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) {
        if (g < G) {
          for (int off = 16; off > 0; off >>= 1)
            acc[u][g] += __shfl_xor_sync(0xffffffffu, acc[u][g], off);
        }
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int u = 0; u < kTokensPerWarp; ++u) {
        const int n = n0 + kWarps * u;
        if (n < cnt) {
#pragma unroll
          for (int g = 0; g < kMaxG; ++g)
            if (g < G) s_s[n * gpad + g] = acc[u][g] * scale;
        }
      }
    }
  }
  __syncthreads();
  const int64_t part = (y * a.hq + i0) * int64_t{a.max_chunks};
  for (int g = warp; g < G; g += kWarps) {
    float m = -INFINITY;
    for (int n = lane; n < cnt; n += 32) m = fmaxf(m, s_s[n * gpad + g]);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float l = 0.0f;
    for (int n = lane; n < cnt; n += 32) {
      const float p = expf(s_s[n * gpad + g] - m);
      s_s[n * gpad + g] = p;
      l += p;
    }
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) {
      a.part_max[part + int64_t{g} * a.max_chunks + c] = m;
      a.part_sum[part + int64_t{g} * a.max_chunks + c] = l;
    }
  }
  __syncthreads();
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v_s);
  const float4* s4 = reinterpret_cast<const float4*>(s_s);
  for (int d = tid; d < hd; d += kQsaThreads) {
    float acc[kMaxG];
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) acc[g] = 0.0f;
    for (int n = 0; n < cnt; ++n) {
      const float v = __uint_as_float(uint32_t{v16[n * hd + d]} << 16);
      float pr[kMaxG] = {};
#pragma unroll
      for (int g4 = 0; g4 < kMaxG / 4; ++g4) {
        if (4 * g4 < G) {
          const float4 w = s4[(n * gpad) / 4 + g4];
          pr[4 * g4] = w.x;
          pr[4 * g4 + 1] = w.y;
          pr[4 * g4 + 2] = w.z;
          pr[4 * g4 + 3] = w.w;
        }
      }
#pragma unroll
      for (int g = 0; g < kMaxG; ++g)
        if (g < G) acc[g] = fmaf(pr[g], v, acc[g]);
    }
#pragma unroll
    for (int g = 0; g < kMaxG; ++g)
      if (g < G) a.part_out[((part + int64_t{g} * a.max_chunks) + c) * hd + d] = acc[g];
  }
}

// Combine of query head blockIdx.x of row blockIdx.y (qsa_dev::combine_head).
__global__ void __launch_bounds__(kQsaThreads) prefill_combine_kernel(PArgs a) {
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  const int i = blockIdx.x, hd = a.hd;
  const int64_t y = blockIdx.y;
  const int nc = (a.counters[4 * y + 2] + a.chunk - 1) / a.chunk;
  const int64_t part = (y * a.hq + i) * int64_t{a.max_chunks};
  qsa_dev::combine_head(a.part_max + part, a.part_sum + part, a.part_out + part * hd, nc, hd,
                        proj_row(a, y) + int64_t{i} * 2 * hd + hd,
                        a.out + ((a.r0 + y) * a.hq + i) * int64_t{hd});
}

// ---- fused attention ----

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
#else
// Below sm_80: a plain 16-byte load through L2 (as .cg) and shared store, landed at once, so
// there is nothing to commit or wait for (the callers' __syncthreads publish the tiles).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  *static_cast<uint4*>(smem) = __ldcg(static_cast<const uint4*>(gmem));
}
#endif

// sigmoid of the gate, the two-branch form of cpu::sigmoid (as qsa_dev::combine_head).
__device__ __forceinline__ float gate_sigmoid(float g) {
  if (g >= 0.0f) return 1.0f / (1.0f + expf(-g));
  const float e = expf(g);
  return e / (1.0f + e);
}

// Dynamic shared memory of the fused attention (bytes): q [gp, hd+4] FP32, partial scores
// [4, gp, tile+2] FP32, alpha/l [32] FP32, K [tile, hd+8] BF16, V [tile, hd] BF16, token ids
// [max_tokens] int32.
__host__ __device__ inline size_t fused_smem_bytes(int gp, int hd, int64_t max_tokens) {
  return 4 * (size_t(gp) * (hd + 4) + 4 * size_t(gp) * (kFusedTile + 2) + 32) +
         2 * (size_t(kFusedTile) * (hd + 8) + size_t(kFusedTile) * hd) + 4 * size_t(max_tokens);
}

// Attention of row (gridDim.x - 1 - blockIdx.x) (longest rows first) and local KV head blockIdx.y
// over all its attended tokens (decode's token list), then the gate and BF16 out. GP: the KV head's
// query-head count rounded up to 4 (<= 16), HPT = GP / 4 heads per thread. Tiles of 64 tokens:
// K(t+1) is fetched (cp.async) during the PV of tile t, V(t+1) during the QK of t+1.
//  QK: warp w sums dims [(w/2) * hd/4, +hd/4) for tokens (w%2)*32 + lane%8 + {0, 8, 16, 24} and
//      heads (lane/8)*HPT + h: per 8 dims 4 K and 2*HPT q 16-byte loads feed 32*HPT FMAs; the
//      four quarters are added in the softmax step (s = (((d0 + d1) + d2) + d3) * 1/sqrt(hd)).
//  softmax: warp w owns heads w and w + 8: running max m and sum l in registers, p = exp(s - m)
//      written over quarter 0's scores, alpha = exp(m_old - m_new) for the output rescale.
//  PV: thread (dims 8*(tid%(hd/8))..+7, head quarter (tid/(hd/8))%4, token parity
//      tid/(hd/2)) accumulates HPT heads x 8 dims; the two parities are added at the end.
// Expects hd % 32 == 0 and 16-byte aligned caches (the launcher checks).
template <int GP>
__global__ void __launch_bounds__(kQsaThreads, 2) prefill_fused_attn_kernel(PArgs a) {
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  constexpr int HPT = GP / 4;
  constexpr int T = kFusedTile;
  constexpr int SPS = T + 2;  // score row stride (floats): conflict-free QK stores
  static_assert(GP % 4 == 0 && GP <= kMaxG && T == 64);
  extern __shared__ float4 smem4[];
  const int64_t y = int64_t{gridDim.x} - 1 - blockIdx.x;
  const int j = blockIdx.y;
  const int* counters = a.counters + 4 * y;
  const int nsel = counters[0], B = counters[1], n_tokens = counters[2];
  int i0 = -1;
  const int G = qsa_dev::q_heads_of_kv(a, j, &i0);
  if (G == 0 || n_tokens <= 0) return;
  const int hd = a.hd, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int qs_stride = hd + 4, ks_stride = hd + 8;
  float* q_s = reinterpret_cast<float*>(smem4);           // [GP, hd+4]
  float* sp = q_s + GP * qs_stride;                       // [4, GP, T+2]
  float* alpha_s = sp + 4 * GP * SPS;                     // [16]
  float* l_s = alpha_s + 16;                              // [16]
  uint16_t* k_s = reinterpret_cast<uint16_t*>(l_s + 16);  // [T, hd+8]
  uint16_t* v_s = k_s + T * ks_stride;                    // [T, hd]
  int* tok_s = reinterpret_cast<int*>(v_s + T * hd);      // [n_tokens]
  const float* q = a.q + (y * a.hq + i0) * int64_t{hd};
  for (int i = tid; i < GP * hd; i += kQsaThreads) {
    const int g = i / hd, d = i - g * hd;
    q_s[g * qs_stride + d] = g < G ? q[i] : 0.0f;
  }
  if (tid < 32) alpha_s[tid] = 0.0f;  // alpha and l of padding heads (never used for outputs)
  const int* selected = a.selected + y * a.sel_max;
  const int nb = nsel * a.ratio;
  for (int n = tid; n < n_tokens; n += kQsaThreads)
    tok_s[n] = n < nb ? selected[n / a.ratio] * a.ratio + n % a.ratio : B * a.ratio + (n - nb);
  __syncthreads();
  const int vecs = hd / 8;
  const int64_t row = int64_t{a.hkv} * hd, head_off = int64_t{j} * hd;
  auto load_rows = [&](const uint16_t* cache, uint16_t* dst, int stride, int start) {
    const int cnt = min(T, n_tokens - start);
    for (int idx = tid; idx < cnt * vecs; idx += kQsaThreads) {
      const int n = idx / vecs, p = idx - n * vecs;
      cp_async16(dst + n * stride + 8 * p, cache + tok_s[start + n] * row + head_off + 8 * p);
    }
    dev::cp_async_commit();
  };
  const int n_tiles = (n_tokens + T - 1) / T;
  const int tb = warp & 1, dq = warp >> 1, t8 = lane & 7, hg = lane >> 3;
  const int dlen = hd / 4;
  const int noct = hd / 8, oct = tid % noct, pq = (tid / noct) & 3, par = tid / (noct * 4);
  const bool pv_active = tid < noct * 8;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  float acc[HPT][8];
#pragma unroll
  for (int h = 0; h < HPT; ++h)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.0f;
  const float scale = 1.0f / sqrtf(static_cast<float>(hd));
  load_rows(a.k_cache, k_s, ks_stride, 0);
  load_rows(a.v_cache, v_s, hd, 0);
  for (int it = 0; it < n_tiles; ++it) {
    const int start = it * T, cnt = min(T, n_tokens - start);
    dev::cp_async_wait_group<1>();  // K(it) has landed (V(it) may be in flight)
    __syncthreads();
    {
      float s[4][HPT];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int h = 0; h < HPT; ++h) s[u][h] = 0.0f;
      const uint16_t* kr = k_s + (tb * 32 + t8) * ks_stride + dq * dlen;
      const float* qb = q_s + hg * HPT * qs_stride + dq * dlen;
      for (int d = 0; d < dlen; d += 8) {
        float kf[4][8];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint4 kv = *reinterpret_cast<const uint4*>(kr + 8 * u * ks_stride + d);
          kf[u][0] = dev::bf16_lo(kv.x);
          kf[u][1] = dev::bf16_hi(kv.x);
          kf[u][2] = dev::bf16_lo(kv.y);
          kf[u][3] = dev::bf16_hi(kv.y);
          kf[u][4] = dev::bf16_lo(kv.z);
          kf[u][5] = dev::bf16_hi(kv.z);
          kf[u][6] = dev::bf16_lo(kv.w);
          kf[u][7] = dev::bf16_hi(kv.w);
        }
#pragma unroll
        for (int h = 0; h < HPT; ++h) {
          const float4 qa = *reinterpret_cast<const float4*>(qb + h * qs_stride + d);
          const float4 qc = *reinterpret_cast<const float4*>(qb + h * qs_stride + d + 4);
          const float qf[8] = {qa.x, qa.y, qa.z, qa.w, qc.x, qc.y, qc.z, qc.w};
#pragma unroll
          for (int u = 0; u < 4; ++u)
#pragma unroll
            for (int e = 0; e < 8; ++e) s[u][h] = fmaf(qf[e], kf[u][e], s[u][h]);
        }
      }
      float* o = sp + (dq * GP + hg * HPT) * SPS + tb * 32 + t8;
#pragma unroll
      for (int h = 0; h < HPT; ++h)
#pragma unroll
        for (int u = 0; u < 4; ++u) o[h * SPS + 8 * u] = s[u][h];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int g = warp + 8 * r;
      if (g < G) {  // warp-uniform
        float* s0 = sp + g * SPS;
        float sv[2], mt = -INFINITY;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = lane + 32 * e;
          const float d01 = s0[n] + s0[GP * SPS + n];
          const float d012 = d01 + s0[2 * GP * SPS + n];
          sv[e] = n < cnt ? (d012 + s0[3 * GP * SPS + n]) * scale : -INFINITY;
          mt = fmaxf(mt, sv[e]);
        }
        for (int off = 16; off > 0; off >>= 1)
          mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
        const float m_new = fmaxf(m_run[r], mt);
        const float alpha = expf(m_run[r] - m_new);  // 0 on the first tile
        float ls = 0.0f;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = lane + 32 * e;
          const float p = n < cnt ? expf(sv[e] - m_new) : 0.0f;
          s0[n] = p;
          ls += p;
        }
        for (int off = 16; off > 0; off >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, off);
        l_run[r] = fmaf(l_run[r], alpha, ls);
        m_run[r] = m_new;
        if (lane == 0) alpha_s[g] = alpha;
      }
    }
    // The K tile is free: fetch the next one while this tile's PV runs.
    if (it + 1 < n_tiles) {
      load_rows(a.k_cache, k_s, ks_stride, start + T);
    } else {
      dev::cp_async_commit();  // an empty group keeps the wait count uniform
    }
    dev::cp_async_wait_group<1>();  // V(it) has landed
    __syncthreads();
    if (pv_active) {
#pragma unroll
      for (int h = 0; h < HPT; ++h) {
        const float al = alpha_s[pq * HPT + h];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] *= al;
      }
      const uint16_t* vb = v_s + 8 * oct;
      const float* pb = sp + pq * HPT * SPS;
#pragma unroll 2
      for (int n = par; n < cnt; n += 2) {
        const uint4 vv = *reinterpret_cast<const uint4*>(vb + n * hd);
        const float vf[8] = {dev::bf16_lo(vv.x), dev::bf16_hi(vv.x), dev::bf16_lo(vv.y),
                             dev::bf16_hi(vv.y), dev::bf16_lo(vv.z), dev::bf16_hi(vv.z),
                             dev::bf16_lo(vv.w), dev::bf16_hi(vv.w)};
#pragma unroll
        for (int h = 0; h < HPT; ++h) {
          const float pr = pb[h * SPS + n];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(pr, vf[e], acc[h][e]);
        }
      }
    }
    __syncthreads();  // V and p are free
    if (it + 1 < n_tiles) {
      load_rows(a.v_cache, v_s, hd, start + T);
    } else {
      dev::cp_async_commit();
    }
  }
  // Odd-token partial sums through shared memory (the K tile area: every copy has landed).
  float* red = reinterpret_cast<float*>(k_s);  // [GP, hd]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int g = warp + 8 * r;
    if (g < G && lane == 0) l_s[g] = l_run[r];
  }
  if (pv_active && par == 1) {
#pragma unroll
    for (int h = 0; h < HPT; ++h)
#pragma unroll
      for (int e = 0; e < 8; ++e) red[(pq * HPT + h) * hd + 8 * oct + e] = acc[h][e];
  }
  __syncthreads();
  if (pv_active && par == 0) {
    const float* proj = proj_row(a, y);
#pragma unroll
    for (int h = 0; h < HPT; ++h) {
      const int g = pq * HPT + h;
      if (g < G) {
        const float L = l_s[g];
        const float* gate = proj + int64_t{i0 + g} * 2 * hd + hd + 8 * oct;
        uint16_t* out = a.out + ((a.r0 + y) * a.hq + i0 + g) * int64_t{hd} + 8 * oct;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float o = (acc[h][e] + red[g * hd + 8 * oct + e]) / L;
          out[e] = dev::float_to_bf16_bits(o * gate_sigmoid(gate[e]));
        }
      }
    }
  }
}

// ---- tensor-core attention over groups of rows ----
//
// One CTA per (sub-group of tc_rows consecutive rows, local KV head): its G query heads times the
// rows are kTcVectors query vectors v = r * G + g (one m16 tile per warp; the rest padding), run
// against the union of the rows' attended tokens in tiles of 64. prefill_union_kernel builds, per
// sub-group, the union as an ascending block list (every row's selected blocks and its tail block)
// and per row a bitmask over that list; the attention masks token u of the list for row r unless
// its block is in r's mask and the token is <= r's position (the tail block's later tokens).
// Products on the tensor cores (mma.sync m16n8k16, BF16 in, FP32 accumulate; every product of two
// BF16 values is exact) with the FP32 operands split into BF16 pieces: K and V are BF16 already,
// q = q_hi + q_mid + q_lo (three round-to-nearest steps: q to about 2^-24 relative, i.e. q as FP32
// holds it) and p = p_hi + p_lo (|p - p_hi - p_lo| <= 2^-16 p, about 2^-19 p rms), so S = q.k up
// to the FP32 sums and O += p v up to the FP32 sums and the 2^-16 of each p (docs/numerics.md).

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// Four 8x8 BF16 matrices from shared memory (lane l gives the address of row l % 8 of matrix
// l / 8); thread t receives row t / 4, columns 2 (t % 4), +1 of each (PTX ISA "ldmatrix").
// Volatile with a memory clobber: the tiles change between the barriers of the tile loop.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
// The same, transposed: thread t receives rows 2 (t % 4), +1 of column t / 4 of each matrix.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
// BF16 pair of (e0, e1), round to nearest even, e0 in the low half (the lower k index).
__device__ __forceinline__ uint32_t pack_bf16x2(float e0, float e1) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(e1), "f"(e0));
  return d;
}
// (e0, e1) = hi + lo + r with hi, lo BF16 pairs and |r| <= 2^-16 |e| (each rounding to 8
// significant bits errs by at most 2^-8 relative; e - hi is exact in FP32).
__device__ __forceinline__ void split_bf16x2(float e0, float e1, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16x2(e0, e1);
  lo = pack_bf16x2(e0 - __uint_as_float(hi << 16), e1 - __uint_as_float(hi & 0xffff0000u));
}
// (e0, e1) = hi + mid + lo + r with |r| <= 2^-24 |e|: the 24 significant bits of an FP32 value in
// three 8-bit pieces (both remainders exact in FP32).
__device__ __forceinline__ void split3_bf16x2(float2 e, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
  hi = pack_bf16x2(e.x, e.y);
  const float r0 = e.x - __uint_as_float(hi << 16), r1 = e.y - __uint_as_float(hi & 0xffff0000u);
  mid = pack_bf16x2(r0, r1);
  lo = pack_bf16x2(r0 - __uint_as_float(mid << 16), r1 - __uint_as_float(mid & 0xffff0000u));
}
#endif

// Union of the attended blocks of sub-group blockIdx.x of the group's `rows` rows (rows
// tc_rows * blockIdx.x ..): a bitmap over blocks 0..B of the sub-group's last row, its exclusive
// word prefix (the rank of a block in the union), then u_count[s], u_blocks[s] (ascending) and per
// row u_mask[s][r]: bit i set when union block i is selected by row r or is its tail block.
// Dynamic shared memory: 2 * bm_words words.
__global__ void __launch_bounds__(kQsaThreads) prefill_union_kernel(PArgs a, int rows) {
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  extern __shared__ uint32_t bm[];  // [bm_words] bitmap, then [bm_words] exclusive prefix
  __shared__ int wsum[kQsaThreads / 32];
  constexpr int kWarps = kQsaThreads / 32;
  int* pre = reinterpret_cast<int*>(bm + a.bm_words);
  const int s = blockIdx.x, y0 = s * a.tc_rows, rs = min(a.tc_rows, rows - y0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t_last = a.t0 + y0 + rs - 1;
  const int nw = static_cast<int>((t_last + 1) / a.ratio / 32 + 1);  // words of blocks 0..B_last
  for (int w = tid; w < nw; w += kQsaThreads) bm[w] = 0u;
  __syncthreads();
  // Each row's selected blocks and its tail block (B, when tokens past the complete blocks exist).
  for (int r = warp; r < rs; r += kWarps) {
    const int y = y0 + r;
    const int nsel = a.counters[4 * y], B = a.counters[4 * y + 1];
    const int* sel = a.selected + int64_t{y} * a.sel_max;
    for (int i = lane; i < nsel; i += 32) atomicOr(&bm[sel[i] >> 5], 1u << (sel[i] & 31));
    if (lane == 0 && a.t0 + y + 1 > int64_t{B} * a.ratio) atomicOr(&bm[B >> 5], 1u << (B & 31));
  }
  __syncthreads();
  // Exclusive prefix of the words' popcounts: thread tid owns words [tid * per, +per).
  const int per = (nw + kQsaThreads - 1) / kQsaThreads;
  const int w0 = min(nw, tid * per), w1 = min(nw, w0 + per);
  int cnt = 0;
  for (int w = w0; w < w1; ++w) cnt += __popc(bm[w]);
  int incl = cnt;
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  int run = incl - cnt, total = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) run += wsum[w];
    total += wsum[w];
  }
  int* ublocks = a.u_blocks + int64_t{s} * a.u_cap;
  for (int w = w0; w < w1; ++w) {
    pre[w] = run;
    for (uint32_t bits = bm[w]; bits != 0u; bits &= bits - 1u)
      ublocks[run++] = 32 * w + __ffs(bits) - 1;
  }
  if (tid == 0) a.u_count[s] = total;
  uint32_t* mask = a.u_mask + int64_t{s} * a.tc_rows * a.u_words;
  const int mw = (total + 31) / 32;
  for (int i = tid; i < rs * mw; i += kQsaThreads) {
    const int r = i / mw;
    mask[int64_t{r} * a.u_words + (i - r * mw)] = 0u;
  }
  __syncthreads();  // prefix in shared memory, zeroed masks in global memory
  auto rank = [&](int b) { return pre[b >> 5] + __popc(bm[b >> 5] & ((1u << (b & 31)) - 1u)); };
  for (int r = warp; r < rs; r += kWarps) {
    const int y = y0 + r;
    const int nsel = a.counters[4 * y], B = a.counters[4 * y + 1];
    const int* sel = a.selected + int64_t{y} * a.sel_max;
    uint32_t* mr = mask + int64_t{r} * a.u_words;
    for (int i = lane; i < nsel; i += 32) {
      const int k = rank(sel[i]);
      atomicOr(&mr[k >> 5], 1u << (k & 31));
    }
    if (lane == 0 && a.t0 + y + 1 > int64_t{B} * a.ratio) {
      const int k = rank(B);
      atomicOr(&mr[k >> 5], 1u << (k & 31));
    }
  }
}

// Dynamic shared memory of the tensor-core attention (bytes): q [kTcVectors, hd+8] FP32, K and V
// [kTcTile, hd+8] BF16, row masks [kTcVectors, 2] uint32. The K/V row stride of hd + 8 BF16 (an
// odd number of 16-byte units for hd % 16 == 0) keeps every ldmatrix conflict-free (its 8 row
// addresses fall into 8 distinct 16-byte bank groups); the q stride of hd + 8 floats (8 mod 32
// banks) keeps the A-fragment float2 loads conflict-free (each half-warp: rows g..g+3 x 8 banks).
// 203,776 bytes at hd 256.
inline size_t tc_smem_bytes(int hd) {
  const size_t st = size_t(hd) + 8;
  return 4 * size_t(kTcVectors) * st + 2 * 2 * size_t(kTcTile) * st + 8 * size_t(kTcVectors);
}

// Attention of sub-group (gridDim.x - 1 - blockIdx.x) (longest rows first) of the group's `rows`
// rows and local KV head blockIdx.y over the union of its rows' tokens (prefill_union_kernel),
// then the gate and BF16 out. Warp w owns query vectors 16w..16w+15 (v = r * G + g).
// Per tile of 64 union tokens: K(t) and V(t) land by cp.async; the row masks of the tile are
// built by ballots; S = Q K^T (hd/16 k-steps x 8 n-tiles x 3 q pieces of MMAs), masked
// entries -inf, online softmax in FP32 (s = dot * 1/sqrt(hd) as decode, running max and exp sum
// per vector, alpha = exp(m_old - m_new)); K(t+1) is fetched during O = alpha O + P V (P from the
// S accumulators in the A-fragment layout, split hi + lo; V by ldmatrix.trans), V(t+1) after it.
// Expects hd % 16 == 0, hd <= 256, G <= kTcVectors / tc_rows, 16-byte aligned caches (the
// launcher checks) and sm_80+ (below, the launcher runs prefill_fused_attn_kernel instead).
__global__ void __launch_bounds__(kTcThreads, 1) prefill_tc_attn_kernel(PArgs a, int rows) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  dev::pdl_begin();  // everything here depends on the previous kernel (cuda/common/pdl.cuh)
  constexpr int T = kTcTile;
  constexpr int kMaxNt = kTcMaxHd / 8;  // n-tiles of 8 dims in O
  static_assert(T == 64 && kTcVectors == 16 * kTcWarps);
  extern __shared__ float4 smem4[];
  const int s = static_cast<int>(gridDim.x - 1 - blockIdx.x), j = blockIdx.y;
  const int R = a.tc_rows, y0 = s * R, rs = min(R, rows - y0);
  int i0 = -1;
  const int G = qsa_dev::q_heads_of_kv(a, j, &i0);
  if (G == 0) return;
  const int nv = rs * G;  // live query vectors
  const int hd = a.hd, st = hd + 8, nks = hd / 16;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* q_s = reinterpret_cast<float*>(smem4);                        // [kTcVectors, hd+8]
  uint16_t* k_s = reinterpret_cast<uint16_t*>(q_s + kTcVectors * st);  // [T, hd+8]
  uint16_t* v_s = k_s + T * st;                                        // [T, hd+8]
  uint32_t* mask_s = reinterpret_cast<uint32_t*>(v_s + T * st);        // [kTcVectors, 2]
  const int pairs = hd / 2;
  for (int idx = tid; idx < kTcVectors * pairs; idx += kTcThreads) {
    const int v = idx / pairs, d = 2 * (idx - v * pairs);
    float2 qv = make_float2(0.0f, 0.0f);  // padding vectors: q = 0 (and fully masked)
    if (v < nv) {
      const int r = v / G, g = v - r * G;
      const float* q = a.q + (int64_t{y0 + r} * a.hq + i0 + g) * hd + d;
      qv = make_float2(q[0], q[1]);
    }
    *reinterpret_cast<float2*>(q_s + v * st + d) = qv;
  }
  const int nu = a.u_count[s];
  const int* ub = a.u_blocks + int64_t{s} * a.u_cap;
  const uint32_t* um = a.u_mask + int64_t{s} * R * a.u_words;
  const int ratio = a.ratio;
  const int64_t t_first = a.t0 + y0, t_last = t_first + rs - 1;
  // Union tokens: every block complete except the last one (the last row's tail block, whose
  // tokens past t_last are not written yet): n_tok tokens, none past t_last.
  const int64_t b_max = ub[nu - 1];
  const int n_tok =
      (nu - 1) * ratio + static_cast<int>(std::min<int64_t>(ratio, t_last - b_max * ratio + 1));
  const int n_tiles = (n_tok + T - 1) / T;
  const int vecs = hd / 8;
  const int64_t row = int64_t{a.hkv} * hd, head_off = int64_t{j} * hd;
  // Tile rows past n_tok are zeros (p = 0 there, and 0 * 0 adds nothing).
  auto load_tile = [&](const uint16_t* cache, uint16_t* dst, int start) {
    for (int idx = tid; idx < T * vecs; idx += kTcThreads) {
      const int n = idx / vecs, p = idx - n * vecs;
      const int u = start + n;
      uint16_t* d = dst + n * st + 8 * p;
      if (u < n_tok) {
        const int ui = u / ratio;
        const int64_t tok = int64_t{ub[ui]} * ratio + (u - ui * ratio);
        cp_async16(d, cache + tok * row + head_off + 8 * p);
      } else {
        *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    dev::cp_async_commit();
  };
  // mask_s[2r + h] bit i: union token start + 32h + i is visible to row r.
  auto build_mask = [&](int start) {
    for (int task = warp; task < 2 * R; task += kTcWarps) {
      const int r = task >> 1, h = task & 1, u = start + 32 * h + lane;
      bool vis = false;
      if (r < rs && u < n_tok) {
        const int ui = u / ratio;
        const int64_t tok = int64_t{ub[ui]} * ratio + (u - ui * ratio);
        vis = ((um[int64_t{r} * a.u_words + (ui >> 5)] >> (ui & 31)) & 1u) != 0u &&
              tok <= t_first + r;
      }
      const uint32_t bits = __ballot_sync(0xffffffffu, vis);
      if (lane == 0) mask_s[task] = bits;
    }
  };
  const bool live = 16 * warp < nv;  // warp-uniform: a warp of padding vectors only syncs
  const int gq = lane >> 2, tq = lane & 3;
  const int vr[2] = {16 * warp + gq, 16 * warp + gq + 8};  // this thread's two vectors
  const int rr[2] = {vr[0] < nv ? vr[0] / G : -1, vr[1] < nv ? vr[1] / G : -1};
  // Q's A fragment: rows gq and gq + 8 of the warp's tile, dims 2 tq, +1 and 2 tq + 8, +9 of the
  // k-step. ldmatrix row addresses: K (B, x4): tokens 8 * (lane / 16) + lane % 8, dims
  // 8 * ((lane / 8) % 2) -> {b0, b1} of tokens 0-7, {b0, b1} of tokens 8-15. V (B, x4 trans):
  // tokens 8 * ((lane / 8) % 2) + lane % 8, dims 8 * (lane / 16) -> {b0, b1} of dims 0-7, {b0, b1}
  // of dims 8-15.
  const float* qa = q_s + (16 * warp + gq) * st + 2 * tq;
  const uint16_t* kb = k_s + (8 * (lane >> 4) + (lane & 7)) * st + 8 * ((lane >> 3) & 1);
  const uint16_t* vb = v_s + (8 * ((lane >> 3) & 1) + (lane & 7)) * st + 8 * (lane >> 4);
  float o[kMaxNt][4];
#pragma unroll
  for (int nt = 0; nt < kMaxNt; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // l: this thread's columns
  const float scale = 1.0f / sqrtf(static_cast<float>(hd));
  load_tile(a.k_cache, k_s, 0);
  load_tile(a.v_cache, v_s, 0);
  for (int it = 0; it < n_tiles; ++it) {
    const int start = it * T;
    build_mask(start);  // mask_s's last readers (tile it-1's softmax) are past two barriers
    dev::cp_async_wait_group<1>();  // K(it) has landed (V(it) may be in flight)
    __syncthreads();
    float sc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nt][e] = 0.0f;
    float alpha[2] = {1.0f, 1.0f};
    if (live) {
#pragma unroll
      for (int ks = 0; ks < kTcMaxHd / 16; ++ks) {
        if (ks < nks) {
          uint32_t ah[4], am[4], al[4];
#pragma unroll
          for (int f = 0; f < 4; ++f) {  // a[f]: row gq + 8 (f % 2), dims + 8 (f / 2)
            const float2 x =
                *reinterpret_cast<const float2*>(qa + 8 * (f & 1) * st + 16 * ks + 8 * (f >> 1));
            split3_bf16x2(x, ah[f], am[f], al[f]);
          }
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            uint32_t b[4];
            ldsm_x4(b, kb + np * 16 * st + 16 * ks);
            nvfp4_mma::mma_bf16(sc[2 * np], ah[0], ah[1], ah[2], ah[3], b[0], b[1]);
            nvfp4_mma::mma_bf16(sc[2 * np], am[0], am[1], am[2], am[3], b[0], b[1]);
            nvfp4_mma::mma_bf16(sc[2 * np], al[0], al[1], al[2], al[3], b[0], b[1]);
            nvfp4_mma::mma_bf16(sc[2 * np + 1], ah[0], ah[1], ah[2], ah[3], b[2], b[3]);
            nvfp4_mma::mma_bf16(sc[2 * np + 1], am[0], am[1], am[2], am[3], b[2], b[3]);
            nvfp4_mma::mma_bf16(sc[2 * np + 1], al[0], al[1], al[2], al[3], b[2], b[3]);
          }
        }
      }
      // Mask, scale, online softmax: sc[nt][2h + e] is vector vr[h], union token
      // start + 8 nt + 2 tq + e; the vector's 64 columns live in the 4 lanes of its quad.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t mlo = 0u, mhi = 0u;
        if (rr[h] >= 0) {
          mlo = mask_s[2 * rr[h]];
          mhi = mask_s[2 * rr[h] + 1];
        }
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * nt + 2 * tq + e;
            const uint32_t bit = ((col < 32 ? mlo : mhi) >> (col & 31)) & 1u;
            const float sv = bit != 0u ? sc[nt][2 * h + e] * scale : -INFINITY;
            sc[nt][2 * h + e] = sv;
            mx = fmaxf(mx, sv);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[h], mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // no visible token yet
        alpha[h] = expf(m_run[h] - m_use);                      // 0 while m_run is -inf
        float ls = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = expf(sc[nt][2 * h + e] - m_use);  // exp(-inf) = 0 when masked
            sc[nt][2 * h + e] = p;
            ls += p;
          }
        }
        l_run[h] = fmaf(l_run[h], alpha[h], ls);
        m_run[h] = m_new;
      }
    }
    dev::cp_async_wait_all();  // V(it) has landed
    __syncthreads();           // V(it) visible; every warp is done with K(it)
    if (it + 1 < n_tiles) load_tile(a.k_cache, k_s, start + T);
    if (live) {
#pragma unroll
      for (int nt = 0; nt < kMaxNt; ++nt) {
        o[nt][0] *= alpha[0];
        o[nt][1] *= alpha[0];
        o[nt][2] *= alpha[1];
        o[nt][3] *= alpha[1];
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // union tokens 16 kk .. 16 kk + 15 of the tile
        uint32_t ph[4], pl[4];
        split_bf16x2(sc[2 * kk][0], sc[2 * kk][1], ph[0], pl[0]);
        split_bf16x2(sc[2 * kk][2], sc[2 * kk][3], ph[1], pl[1]);
        split_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1], ph[2], pl[2]);
        split_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3], ph[3], pl[3]);
#pragma unroll
        for (int dp = 0; dp < kTcMaxHd / 16; ++dp) {
          if (dp < nks) {
            uint32_t b[4];
            ldsm_x4_trans(b, vb + kk * 16 * st + 16 * dp);
            nvfp4_mma::mma_bf16(o[2 * dp], ph[0], ph[1], ph[2], ph[3], b[0], b[1]);
            nvfp4_mma::mma_bf16(o[2 * dp], pl[0], pl[1], pl[2], pl[3], b[0], b[1]);
            nvfp4_mma::mma_bf16(o[2 * dp + 1], ph[0], ph[1], ph[2], ph[3], b[2], b[3]);
            nvfp4_mma::mma_bf16(o[2 * dp + 1], pl[0], pl[1], pl[2], pl[3], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with V(it) and mask_s
    if (it + 1 < n_tiles) load_tile(a.v_cache, v_s, start + T);
  }
  if (!live) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (rr[h] < 0) continue;
    const int r = rr[h], g = vr[h] - r * G;
    const int64_t y = y0 + r;
    const float L = l_run[h];
    const float* gate = proj_row(a, y) + int64_t{i0 + g} * 2 * hd + hd;
    uint16_t* out = a.out + ((a.r0 + y) * a.hq + i0 + g) * int64_t{hd};
#pragma unroll
    for (int nt = 0; nt < kMaxNt; ++nt) {
      if (nt < hd / 8) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = 8 * nt + 2 * tq + e;
          out[d] = dev::float_to_bf16_bits(o[nt][2 * h + e] / L * gate_sigmoid(gate[d]));
        }
      }
    }
  }
#endif
}

using detail::aligned;

size_t align256(size_t x) {
  return (x + 255) & ~size_t{255};
}

int local_gmax(const QsaDecodeParams& p) {
  int gmax = 0;
  for (int j = 0; j < p.num_kv_heads; ++j) {
    int g = 0;
    for (int i = 0; i < p.num_q_heads; ++i)
      g += (p.q_head_first + i) / p.q_per_kv - p.kv_head_first == j;
    gmax = std::max(gmax, g);
  }
  return gmax;
}

size_t attn_smem_bytes(int gmax, int gpad, int hd, int chunk) {
  return 4 * (size_t(chunk) * gpad + (size_t(gmax) * hd + 3) / 4 * 4 + size_t(chunk)) +
         2 * size_t(chunk) * hd * 2;
}

// Per-row bytes of the layout's arrays (each array padded to 256 bytes per group, added below).
struct RowBytes {
  size_t q, qi, scores, selected, counters, part_out, part_max, part_sum, unions;
  size_t sum() const {
    return q + qi + scores + selected + counters + part_out + part_max + part_sum + unions;
  }
};

}  // namespace

QsaPrefillLayout qsa_prefill_layout(const QsaPrefillParams& p) {
  constexpr const char* kOp = "qsa_prefill_layout";
  QsaPrefillLayout w;
  w.decode = qsa_workspace_layout(p.shape);  // validates the shape
  const QsaDecodeParams& s = p.shape;
  FN_LAUNCH_REQUIRE(p.tokens >= 1 && p.max_group_rows >= 0, kOp);
  FN_LAUNCH_REQUIRE(s.indexer_heads * s.indexer_head_dim <= kMaxIndexerQ, kOp);
  w.max_blocks = std::max<int64_t>(s.ctx_size / s.ratio, 1);
  w.sel_max = std::max<int64_t>(std::min<int64_t>(s.block_topk, s.ctx_size / s.ratio), 1);
  const size_t hq = s.num_q_heads, hd = s.head_dim, mc = w.decode.max_chunks;
  RowBytes r{};
  r.q = hq * hd * 4;
  r.qi = size_t(s.indexer_heads) * s.indexer_head_dim * 4;
  r.scores = size_t(w.max_blocks) * 4;
  r.selected = size_t(w.sel_max) * 4;
  r.counters = 16;
  const int gmax = local_gmax(s);
  w.fused = p.attention != QsaPrefillAttention::kDecodeChunks && s.head_dim % 32 == 0 &&
            gmax <= kMaxG &&
            fused_smem_bytes((gmax + 3) / 4 * 4, s.head_dim, w.decode.max_tokens) <= kMaxFusedSmem;
  w.tensor_cores = w.fused && p.attention == QsaPrefillAttention::kFused &&
                   s.head_dim <= kTcMaxHd && 8 * size_t(w.max_blocks / 32 + 1) <= kMaxUnionSmem;
  if (w.tensor_cores) {
    w.tc_rows = kTcVectors / gmax;
    w.union_cap = std::min<int64_t>(w.tc_rows * (w.sel_max + 1), w.max_blocks + 1);
    w.union_words = (w.union_cap + 31) / 32;
    // Per row, the sub-group's arrays shared out (for the group size only).
    r.unions =
        (4 + 4 * size_t(w.union_cap) + 4 * size_t(w.tc_rows * w.union_words)) / size_t(w.tc_rows) +
        1;
  }
  if (!w.fused) {
    r.part_out = hq * mc * hd * 4;
    r.part_max = hq * mc * 4;
    r.part_sum = hq * mc * 4;
  }
  int64_t rows = static_cast<int64_t>(kQsaPrefillWorkspaceBudget / r.sum());
  if (p.max_group_rows > 0) rows = std::min(rows, p.max_group_rows);
  w.group_rows = std::clamp<int64_t>(rows, 1, std::min<int64_t>(p.tokens, kMaxGroupRows));
  const size_t n = w.group_rows;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align256(off + n * bytes);
    return at;
  };
  w.q = take(r.q);
  w.qi = take(r.qi);
  w.scores = take(r.scores);
  w.selected = take(r.selected);
  w.counters = take(r.counters);
  w.part_out = take(r.part_out);
  w.part_max = take(r.part_max);
  w.part_sum = take(r.part_sum);
  if (w.tensor_cores) {
    const size_t subs = (n + w.tc_rows - 1) / w.tc_rows;
    auto take_subs = [&](size_t bytes) {
      const size_t at = off;
      off = align256(off + subs * bytes);
      return at;
    };
    w.union_count = take_subs(4);
    w.union_blocks = take_subs(4 * size_t(w.union_cap));
    w.union_mask = take_subs(4 * size_t(w.tc_rows * w.union_words));
  }
  w.total = off;
  return w;
}

size_t qsa_prefill_workspace_bytes(const QsaPrefillParams& p) {
  return qsa_prefill_layout(p).total;
}

void launch_qsa_prefill(const QsaPrefillParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_qsa_prefill";
  const QsaDecodeParams& s = p.shape;
  FN_LAUNCH_REQUIRE(p.proj != nullptr && s.q_norm != nullptr && s.k_norm != nullptr, kOp);
  FN_LAUNCH_REQUIRE(s.iq_norm != nullptr && s.ik_norm != nullptr, kOp);
  FN_LAUNCH_REQUIRE(s.k_cache != nullptr && s.v_cache != nullptr && s.raw_keys != nullptr, kOp);
  FN_LAUNCH_REQUIRE(s.block_keys != nullptr && p.workspace != nullptr && p.out != nullptr, kOp);
  FN_LAUNCH_REQUIRE(aligned(p.workspace, 256) && aligned(s.k_cache, 4) && aligned(s.v_cache, 4),
                    kOp);
  const QsaPrefillLayout w = qsa_prefill_layout(p);
  FN_LAUNCH_REQUIRE(p.first_position >= 0 && p.first_position <= s.ctx_size - p.tokens, kOp);
  FN_LAUNCH_REQUIRE(p.proj_stride >= qsa_proj_size(s), kOp);
  char* ws = static_cast<char*>(p.workspace);
  PArgs a{};
  a.proj = p.proj;
  a.proj_stride = p.proj_stride;
  a.q_norm = s.q_norm;
  a.k_norm = s.k_norm;
  a.iq_norm = s.iq_norm;
  a.ik_norm = s.ik_norm;
  a.k_cache = s.k_cache;
  a.v_cache = s.v_cache;
  a.raw_keys = s.raw_keys;
  a.block_keys = s.block_keys;
  a.out = p.out;
  a.q = reinterpret_cast<float*>(ws + w.q);
  a.qi = reinterpret_cast<float*>(ws + w.qi);
  a.scores = reinterpret_cast<float*>(ws + w.scores);
  a.selected = reinterpret_cast<int*>(ws + w.selected);
  a.counters = reinterpret_cast<int*>(ws + w.counters);
  a.part_out = reinterpret_cast<float*>(ws + w.part_out);
  a.part_max = reinterpret_cast<float*>(ws + w.part_max);
  a.part_sum = reinterpret_cast<float*>(ws + w.part_sum);
  a.max_blocks = w.max_blocks;
  a.sel_max = w.sel_max;
  a.theta = s.rope_theta;
  a.hq = s.num_q_heads;
  a.hkv = s.num_kv_heads;
  a.q_head_first = s.q_head_first;
  a.q_per_kv = s.q_per_kv;
  a.kv_head_first = s.kv_head_first;
  a.hd = s.head_dim;
  a.rot = s.rotary_dim;
  a.ni = s.indexer_heads;
  a.ihd = s.indexer_head_dim;
  a.ratio = s.ratio;
  a.topk = s.block_topk;
  a.eps = s.eps;
  a.chunk = w.decode.chunk;
  a.max_chunks = w.decode.max_chunks;
  a.gmax = local_gmax(s);
  a.gpad = (a.gmax + 3) / 4 * 4;
  a.vec16 = s.head_dim % 8 == 0 && aligned(s.k_cache, 16) && aligned(s.v_cache, 16);
  a.u_count = reinterpret_cast<int*>(ws + w.union_count);
  a.u_blocks = reinterpret_cast<int*>(ws + w.union_blocks);
  a.u_mask = reinterpret_cast<uint32_t*>(ws + w.union_mask);
  a.tc_rows = static_cast<int>(w.tc_rows);
  a.u_cap = static_cast<int>(w.union_cap);
  a.u_words = static_cast<int>(w.union_words);
  a.bm_words = static_cast<int>(w.max_blocks / 32 + 1);
  size_t smem = 0;
  void (*fused_kernel)(PArgs) = nullptr;
  // kFused: the tensor-core kernel where the device has BF16 MMAs and the shared memory.
  bool tc = false;
  const size_t tc_smem = tc_smem_bytes(s.head_dim);
  const size_t union_smem = 8 * size_t(a.bm_words);
  if (w.tensor_cores) {
    int dev = 0, major = 0, optin = 0;
    FN_CUDA_CHECK(cudaGetDevice(&dev));
    FN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    FN_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    tc = major >= 8 && tc_smem <= static_cast<size_t>(optin);
  }
  if (tc) {
    FN_LAUNCH_REQUIRE(a.vec16, kOp);  // cp.async moves 16-byte pieces of the cache rows
    if (tc_smem > kDefaultSmem) {
      FN_CUDA_CHECK(cudaFuncSetAttribute(prefill_tc_attn_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(tc_smem)));
    }
  } else if (w.fused) {
    FN_LAUNCH_REQUIRE(a.vec16, kOp);  // cp.async moves 16-byte pieces of the cache rows
    const int gp = a.gpad;
    fused_kernel = gp == 4    ? prefill_fused_attn_kernel<4>
                   : gp == 8  ? prefill_fused_attn_kernel<8>
                   : gp == 12 ? prefill_fused_attn_kernel<12>
                              : prefill_fused_attn_kernel<16>;
    smem = fused_smem_bytes(gp, s.head_dim, w.decode.max_tokens);
    if (smem > kDefaultSmem) {
      FN_CUDA_CHECK(cudaFuncSetAttribute(fused_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
    }
  } else {
    smem = attn_smem_bytes(a.gmax, a.gpad, s.head_dim, w.decode.chunk);
    if (smem > kDefaultSmem) {
      FN_CUDA_CHECK(cudaFuncSetAttribute(prefill_attn_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
    }
  }
  // Bench timing: events around each kernel, summed per kernel type after one stream sync.
  enum Kind { kPrep, kBlockKeys, kScores, kSelect, kAttention, kCombine, kKinds };
  struct Timed {
    Kind kind;
    cudaEvent_t e0, e1;
  };
  std::vector<Timed> timed;
  auto run = [&](Kind kind, auto&& launch) {
    if (p.timing == nullptr) {
      launch();
      return;
    }
    Timed t{kind, nullptr, nullptr};
    FN_CUDA_CHECK(cudaEventCreate(&t.e0));
    FN_CUDA_CHECK(cudaEventCreate(&t.e1));
    FN_CUDA_CHECK(cudaEventRecord(t.e0, stream));
    launch();
    FN_CUDA_CHECK(cudaEventRecord(t.e1, stream));
    timed.push_back(t);
  };
  const int roles = s.num_q_heads + s.num_kv_heads + s.indexer_heads + 1;
  int64_t groups = 0;
  for (int64_t r0 = 0; r0 < p.tokens; r0 += w.group_rows) {
    ++groups;
    const int rows = static_cast<int>(std::min(w.group_rows, p.tokens - r0));
    a.r0 = r0;
    a.t0 = p.first_position + r0;
    const int64_t t_end = a.t0 + rows;  // one past the group's last position
    a.b_first = (a.t0 + s.ratio) / s.ratio - 1;
    const int64_t n_blocks = t_end / s.ratio - a.b_first;
    run(kPrep, [&] {
      launch_pdl("prefill_prep_kernel", prefill_prep_kernel, dim3(roles, rows), kQsaThreads, 0,
                 stream, a);
    });
    if (n_blocks > 0) {
      run(kBlockKeys, [&] {
        launch_pdl("prefill_block_key_kernel", prefill_block_key_kernel,
                   static_cast<unsigned>(n_blocks), kQsaThreads, 0, stream, a);
      });
    }
    const int64_t max_b = t_end / s.ratio;  // B of the group's last row
    if (max_b > s.block_topk) {
      const int ctas = static_cast<int>(std::clamp<int64_t>((max_b + 63) / 64, 1, 1024));
      run(kScores, [&] {
        launch_pdl("prefill_scores_kernel", prefill_scores_kernel, dim3(ctas, rows), kQsaThreads, 0,
                   stream, a);
      });
    }
    run(kSelect, [&] {
      launch_pdl("prefill_select_kernel", prefill_select_kernel, rows, kQsaSelectThreads, 0, stream,
                 a);
    });
    // The choice log (--check-choices): this group's rows, before the next group overwrites them.
    if (p.selected_log != nullptr) {
      FN_CUDA_CHECK(cudaMemcpyAsync(p.selected_log + r0 * w.sel_max, a.selected,
                                    size_t(rows) * w.sel_max * sizeof(int32_t),
                                    cudaMemcpyDeviceToDevice, stream));
    }
    if (p.counters_log != nullptr) {
      FN_CUDA_CHECK(cudaMemcpyAsync(p.counters_log + r0 * 4, a.counters,
                                    size_t(rows) * 4 * sizeof(int32_t), cudaMemcpyDeviceToDevice,
                                    stream));
    }
    if (tc) {
      const int subs = static_cast<int>((rows + w.tc_rows - 1) / w.tc_rows);
      run(kAttention, [&] {
        launch_pdl("prefill_union_kernel", prefill_union_kernel, subs, kQsaThreads, union_smem,
                   stream, a, rows);
      });
      run(kAttention, [&] {
        launch_pdl("prefill_tc_attn_kernel", prefill_tc_attn_kernel, dim3(subs, s.num_kv_heads),
                   kTcThreads, tc_smem, stream, a, rows);
      });
    } else if (w.fused) {
      run(kAttention, [&] {
        launch_pdl("prefill_fused_attn_kernel", fused_kernel, dim3(rows, s.num_kv_heads),
                   kQsaThreads, smem, stream, a);
      });
    } else {
      run(kAttention, [&] {
        launch_pdl("prefill_attn_kernel", prefill_attn_kernel,
                   dim3(w.decode.max_chunks, s.num_kv_heads, rows), kQsaThreads, smem, stream, a);
      });
      run(kCombine, [&] {
        launch_pdl("prefill_combine_kernel", prefill_combine_kernel, dim3(s.num_q_heads, rows),
                   kQsaThreads, 0, stream, a);
      });
    }
  }
  if (p.timing != nullptr) {
    FN_CUDA_CHECK(cudaStreamSynchronize(stream));
    double ms[kKinds] = {};
    for (const Timed& t : timed) {
      float e = 0;
      FN_CUDA_CHECK(cudaEventElapsedTime(&e, t.e0, t.e1));
      ms[t.kind] += e;
      FN_CUDA_CHECK(cudaEventDestroy(t.e0));
      FN_CUDA_CHECK(cudaEventDestroy(t.e1));
    }
    p.timing->prep_ms += ms[kPrep];
    p.timing->block_keys_ms += ms[kBlockKeys];
    p.timing->scores_ms += ms[kScores];
    p.timing->select_ms += ms[kSelect];
    p.timing->attention_ms += ms[kAttention];
    p.timing->combine_ms += ms[kCombine];
    p.timing->groups += groups;
  }
}

}  // namespace fn

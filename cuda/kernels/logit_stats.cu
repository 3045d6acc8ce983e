// Per-row reductions of logits rows on the device (cuda/kernels/logit_stats.h).
//
// Top log-probs: every column becomes a 64-bit key, the order-preserving bits of its logit above
// the bit-inverted id, so that a larger key is a larger logit or, on a tie, a lower id: the host's
// order (logit desc, id asc) as one unsigned comparison, and every key distinct. A warp keeps its
// k best keys as a list spread over its lanes (lane j holds the j-th) and refreshes it by k
// extraction rounds: each lane offers the head of its few candidates, sorted descending in
// registers, the warp takes the maximum (two redux.sync on sm_80+) and the lane that held it pops
// it. A block merges its warps' lists the same way; the finishing block keeps only the keys at
// or above the largest k-th key of any block (the row's k-th key is at least that), which is
// usually a few dozen, and extracts the k best from those.
#include "cuda/kernels/logit_stats.h"

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"

namespace fn {
namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads)
    logit_stats_kernel(const float* __restrict__ logits, int64_t vocab, int64_t ld,
                       const int32_t* __restrict__ targets, const int32_t* __restrict__ gather,
                       int64_t gather_k, double* __restrict__ lse_out,
                       double* __restrict__ target_out, int32_t* __restrict__ argmax_out,
                       double* __restrict__ gather_out) {
  __shared__ float s_max[kThreads];
  __shared__ int32_t s_idx[kThreads];
  __shared__ double s_sum[kThreads];
  __shared__ int s_bad;
  const int64_t r = blockIdx.x;
  const float* row = logits + r * ld;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) s_bad = 0;
  // Max, lowest id of the max, and whether any value is not finite.
  float mx = -INFINITY;
  int32_t best = INT32_MAX;
  bool bad = false;
  for (int64_t i = tid; i < vocab; i += kThreads) {
    const float v = row[i];
    if (!isfinite(v)) bad = true;
    if (v > mx) {  // strided ids ascend per thread: the first max is this thread's lowest
      mx = v;
      best = static_cast<int32_t>(i);
    }
  }
  s_max[tid] = mx;
  s_idx[tid] = best;
  __syncthreads();
  if (bad) atomicOr(&s_bad, 1);
  for (int off = kThreads / 2; off > 0; off >>= 1) {
    if (tid < off) {
      const float a = s_max[tid], b = s_max[tid + off];
      const int32_t ia = s_idx[tid], ib = s_idx[tid + off];
      if (b > a || (b == a && ib < ia)) {
        s_max[tid] = b;
        s_idx[tid] = ib;
      }
    }
    __syncthreads();
  }
  const double m = static_cast<double>(s_max[0]);
  double sum = 0.0;
  for (int64_t i = tid; i < vocab; i += kThreads) sum += exp(static_cast<double>(row[i]) - m);
  s_sum[tid] = sum;
  __syncthreads();
  for (int off = kThreads / 2; off > 0; off >>= 1) {
    if (tid < off) s_sum[tid] += s_sum[tid + off];
    __syncthreads();
  }
  const double lse = s_bad ? NAN : m + log(s_sum[0]);
  if (tid == 0) {
    lse_out[r] = lse;
    // With no finite value the index stays INT32_MAX: report 0 (the row is an error anyway).
    argmax_out[r] = s_idx[0] == INT32_MAX ? 0 : s_idx[0];
    const int32_t t = targets ? targets[r] : -1;
    target_out[r] = t >= 0 ? static_cast<double>(row[t]) - lse : NAN;
  }
  for (int64_t j = tid; j < gather_k; j += kThreads) {
    const int32_t id = gather[r * gather_k + j];
    gather_out[r * gather_k + j] = id >= 0 ? static_cast<double>(row[id]) - lse : NAN;
  }
}

// ---- top log-probs ------------------------------------------------------------------------------

constexpr int kTopThreads = 256;
constexpr int kTopWarps = kTopThreads / 32;
constexpr int kTopPerThread = 4;
constexpr int64_t kTopChunk = kTopThreads * kTopPerThread;  // columns per block and pass
constexpr int kTopMaxBlocks = 256;  // the finishing block takes one partial per thread
constexpr int kTopK = kTopLogprobsCapacity;
static_assert(kTopMaxBlocks <= kTopThreads, "one partial per finishing thread");
static_assert(kTopWarps * 4 == 32 && kTopK % 4 == 0, "block merge: 4 lanes per warp list");

using Key = unsigned long long;

// One block's reduction of its columns.
struct TopPartial {
  Key keys[kTopK];   // the block's k best keys, descending; 0 past the block's columns
  double sum;        // Σ exp(l - max) over its values that are not NaN, FP64
  uint32_t max_key;  // order key of that max; 0 when every value is NaN
  int32_t bad;       // 1 when a value is NaN or infinite
};

int64_t top_grid(int64_t vocab) {
  const int64_t chunks = (vocab + kTopChunk - 1) / kTopChunk;
  return chunks < kTopMaxBlocks ? chunks : kTopMaxBlocks;
}

using dev::key_value;
using dev::order_key;

// The column's key: never 0 (the low word ~id is at least 2^31), so 0 marks an empty slot.
__device__ __forceinline__ Key top_key(float l, int64_t id) {
  return (static_cast<Key>(order_key(l)) << 32) | static_cast<Key>(~static_cast<uint32_t>(id));
}

__device__ __forceinline__ int32_t key_id(Key k) {
  return static_cast<int32_t>(~static_cast<uint32_t>(k));
}

__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
#endif
}

// The warp's largest key, in every lane: the largest high word, then the largest low word among
// the lanes holding it.
__device__ __forceinline__ Key warp_max_key(Key v) {
  const uint32_t hi = warp_max_u32(static_cast<uint32_t>(v >> 32));
  const uint32_t lo =
      warp_max_u32(static_cast<uint32_t>(v >> 32) == hi ? static_cast<uint32_t>(v) : 0u);
  return (static_cast<Key>(hi) << 32) | lo;
}

// Sum over the warp, valid in lane 0 (a fixed tree: the same bits every time).
__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

// Sorts a lane's keys descending in registers (odd-even transposition; P is small).
template <int P>
__device__ __forceinline__ void sort_desc(Key (&a)[P]) {
#pragma unroll
  for (int r = 0; r < P; ++r) {
#pragma unroll
    for (int i = r & 1; i + 1 < P; i += 2) {
      if (a[i] < a[i + 1]) {
        const Key t = a[i];
        a[i] = a[i + 1];
        a[i + 1] = t;
      }
    }
  }
}

// The k (<= 32) largest keys of the warp's candidates, in k extraction rounds: every lane holds
// a[0..P) sorted descending (0 = empty, nonzero keys distinct across the warp); lane j < k
// returns the j-th largest (0 when there are fewer), the other lanes 0. Consumes a.
template <int P>
__device__ __forceinline__ Key warp_select(Key (&a)[P], int k) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  Key mine = 0;
  for (int j = 0; j < k; ++j) {
    const Key best = warp_max_key(a[0]);
    if (best == 0) break;  // warp-uniform: no candidate left
    if (lane == j) mine = best;
    if (a[0] == best) {  // the one lane that held it pops it
#pragma unroll
      for (int i = 0; i + 1 < P; ++i) a[i] = a[i + 1];
      a[P - 1] = 0;
    }
  }
  return mine;
}

// One block per group of kTopChunk-column chunks (chunk c = blockIdx.x, + gridDim.x, ...).
__global__ void __launch_bounds__(kTopThreads)
    top_partial_kernel(const float* __restrict__ logits, int64_t vocab, int k,
                       TopPartial* __restrict__ parts) {
  __shared__ Key s_keys[kTopWarps][kTopK];
  __shared__ uint32_t s_max[kTopWarps];
  __shared__ double s_sum[kTopWarps];
  dev::pdl_begin();  // the logits come from the previous kernels (cuda/common/pdl.cuh)
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  uint32_t wmax = 0;  // warp-uniform: the order key of the warp's max so far
  double sum = 0.0;   // this lane's Σ exp(l - key_value(wmax))
  Key list = 0;       // lane j < k: the warp's j-th best key so far
  bool bad = false;
  for (int64_t c = blockIdx.x; c * kTopChunk < vocab; c += gridDim.x) {
    float l[kTopPerThread];
    Key key[kTopPerThread];
    uint32_t cmax = 0;
#pragma unroll
    for (int r = 0; r < kTopPerThread; ++r) {
      const int64_t i = c * kTopChunk + r * kTopThreads + threadIdx.x;
      l[r] = 0.0f;
      key[r] = 0;
      if (i < vocab) {
        l[r] = logits[i];
        bad |= !isfinite(l[r]);
        key[r] = top_key(l[r], i);
        cmax = max(cmax, static_cast<uint32_t>(key[r] >> 32));
      }
    }
    cmax = warp_max_u32(cmax);
    if (cmax > wmax) {  // a new max: rescale the terms summed so far
      if (wmax != 0)
        sum *= exp(static_cast<double>(key_value(wmax)) - static_cast<double>(key_value(cmax)));
      wmax = cmax;
    }
    const double mx = wmax != 0 ? static_cast<double>(key_value(wmax)) : 0.0;
#pragma unroll
    for (int r = 0; r < kTopPerThread; ++r)
      if ((key[r] >> 32) != 0) sum += exp(static_cast<double>(l[r]) - mx);
    if (k > 0) {
      // A key below the list's k-th cannot enter it; skip the rounds when none is above.
      const Key floor = __shfl_sync(0xffffffffu, list, k - 1);
      Key a[kTopPerThread + 1];
      bool any = false;
#pragma unroll
      for (int r = 0; r < kTopPerThread; ++r) {
        a[r] = key[r] > floor ? key[r] : 0;
        any |= a[r] != 0;
      }
      if (__any_sync(0xffffffffu, any)) {
        a[kTopPerThread] = list;
        sort_desc(a);
        list = warp_select(a, k);
      }
    }
  }
  sum = warp_sum(sum);
  if (lane < k) s_keys[warp][lane] = list;
  if (lane == 0) {
    s_max[warp] = wmax;
    s_sum[warp] = sum;
  }
  const int any_bad = __syncthreads_or(bad ? 1 : 0);
  if (warp != 0) return;
  // The block's max and sum: each warp's sum rescaled from its max to the block's.
  const uint32_t own = lane < kTopWarps ? s_max[lane] : 0u;
  const uint32_t bmax = warp_max_u32(own);
  double part = 0.0;
  if (own != 0)
    part = s_sum[lane] *
           exp(static_cast<double>(key_value(own)) - static_cast<double>(key_value(bmax)));
  part = warp_sum(part);
  TopPartial& out = parts[blockIdx.x];
  if (k > 0) {
    // Lane 4w + q takes entries q, q + 4, ... of warp w's list: a descending run of it.
    Key a[kTopK / 4];
#pragma unroll
    for (int r = 0; r < kTopK / 4; ++r) {
      const int j = (lane & 3) + 4 * r;
      a[r] = j < k ? s_keys[lane >> 2][j] : 0;
    }
    const Key best = warp_select(a, k);
    if (lane < k) out.keys[lane] = best;
  }
  if (lane == 0) {
    out.sum = part;
    out.max_key = bmax;
    out.bad = any_bad;
  }
}

// One block: merges the n_parts (<= kTopThreads) partials and writes *out.
__global__ void __launch_bounds__(kTopThreads)
    top_finish_kernel(const float* __restrict__ logits, int64_t vocab,
                      const int32_t* __restrict__ chosen, int k,
                      const TopPartial* __restrict__ parts, int n_parts,
                      TopLogprobsOut* __restrict__ out) {
  __shared__ Key s_cand[kTopMaxBlocks * kTopK];
  __shared__ uint32_t s_wmax[kTopWarps];
  __shared__ Key s_wfloor[kTopWarps];
  __shared__ double s_wsum[kTopWarps];
  __shared__ int s_n;
  dev::pdl_begin();  // the partials come from the previous kernel (cuda/common/pdl.cuh)
  const int t = static_cast<int>(threadIdx.x);
  const int lane = t & 31, warp = t >> 5;
  if (t == 0) s_n = 0;
  const bool have = t < n_parts;
  const TopPartial* p = parts + t;
  const uint32_t pmax = have ? p->max_key : 0u;
  // The row's k-th key is at least every block's k-th key: `floor` is the largest of those.
  const Key pfloor = have && k > 0 ? p->keys[k - 1] : 0;
  const uint32_t wm = warp_max_u32(pmax);
  const Key wf = warp_max_key(pfloor);
  if (lane == 0) {
    s_wmax[warp] = wm;
    s_wfloor[warp] = wf;
  }
  const int any_bad = __syncthreads_or(have && p->bad != 0 ? 1 : 0);
  uint32_t mkey = 0;
  Key floor = 0;
#pragma unroll
  for (int w = 0; w < kTopWarps; ++w) {
    mkey = max(mkey, s_wmax[w]);
    floor = max(floor, s_wfloor[w]);
  }
  double part = 0.0;
  if (pmax != 0)
    part =
        p->sum * exp(static_cast<double>(key_value(pmax)) - static_cast<double>(key_value(mkey)));
  part = warp_sum(part);
  if (lane == 0) s_wsum[warp] = part;
  if (have) {  // this block's keys at or above the floor (a prefix: they are descending)
    for (int j = 0; j < k; ++j) {
      const Key key = p->keys[j];
      if (key < floor || key == 0) break;
      s_cand[atomicAdd(&s_n, 1)] = key;
    }
  }
  __syncthreads();
  if (warp != 0) return;
  double lse = 0.0;
  if (lane == 0) {
    double s = 0.0;
    for (int w = 0; w < kTopWarps; ++w) s += s_wsum[w];
    lse = any_bad || mkey == 0 ? static_cast<double>(NAN)
                               : static_cast<double>(key_value(mkey)) + log(s);
    const int32_t c = *chosen;
    out->logprob = c >= 0 && c < vocab ? static_cast<double>(logits[c]) - lse : NAN;
  }
  lse = __shfl_sync(0xffffffffu, lse, 0);
  if (k > 0) {
    // The survivors (the order of s_cand does not matter: the keys are a total order) in passes
    // of 8 per lane, each merged with the list so far.
    const int n = s_n;
    Key list = 0;
    for (int base = 0; base < n; base += 32 * 8) {
      Key a[9];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int i = base + r * 32 + lane;
        a[r] = i < n ? s_cand[i] : 0;
      }
      a[8] = list;
      sort_desc(a);
      list = warp_select(a, k);
    }
    if (lane < k) {
      const int32_t id = key_id(list);
      out->top_ids[lane] = id;
      out->top_logprobs[lane] = static_cast<double>(logits[id]) - lse;
    }
  }
  if (lane >= k && lane < kTopK) {
    out->top_ids[lane] = -1;
    out->top_logprobs[lane] = NAN;
  }
}

}  // namespace

void launch_logit_stats(const LogitStatsParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_logit_stats";
  FN_LAUNCH_REQUIRE(
      p.logits != nullptr && p.lse != nullptr && p.target_logprob != nullptr && p.argmax != nullptr,
      kOp);
  FN_LAUNCH_REQUIRE(p.rows >= 1 && p.rows <= INT32_MAX, kOp);
  FN_LAUNCH_REQUIRE(p.vocab >= 1 && p.vocab <= INT32_MAX && p.ld >= p.vocab, kOp);
  FN_LAUNCH_REQUIRE(p.gather_k >= 0 && p.gather_k <= INT32_MAX, kOp);
  FN_LAUNCH_REQUIRE(p.gather_k == 0 || (p.gather != nullptr && p.gather_logprob != nullptr), kOp);
  logit_stats_kernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(
      p.logits, p.vocab, p.ld, p.targets, p.gather, p.gather_k, p.lse, p.target_logprob, p.argmax,
      p.gather_logprob);
  FN_CUDA_LAUNCH_CHECK("logit_stats_kernel");
}

size_t top_logprobs_workspace_bytes(int64_t vocab) {
  FN_LAUNCH_REQUIRE(vocab >= 1 && vocab <= INT32_MAX, "top_logprobs_workspace_bytes");
  return static_cast<size_t>(top_grid(vocab)) * sizeof(TopPartial);
}

void launch_top_logprobs(const TopLogprobsParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_top_logprobs";
  FN_LAUNCH_REQUIRE(
      p.logits != nullptr && p.chosen != nullptr && p.workspace != nullptr && p.out != nullptr,
      kOp);
  FN_LAUNCH_REQUIRE(p.vocab >= 1 && p.vocab <= INT32_MAX, kOp);
  FN_LAUNCH_REQUIRE(p.k >= 0 && p.k <= kTopLogprobsCapacity && p.k <= p.vocab, kOp);
  FN_LAUNCH_REQUIRE(detail::aligned(p.workspace, alignof(TopPartial)), kOp);
  FN_LAUNCH_REQUIRE(detail::aligned(p.out, alignof(TopLogprobsOut)), kOp);
  const int64_t grid = top_grid(p.vocab);
  FN_LAUNCH_REQUIRE(p.workspace_bytes >= static_cast<size_t>(grid) * sizeof(TopPartial), kOp);
  auto* parts = static_cast<TopPartial*>(p.workspace);
  const int k = static_cast<int>(p.k);
  launch_pdl("top_partial_kernel", top_partial_kernel, static_cast<unsigned>(grid), kTopThreads, 0,
             stream, p.logits, p.vocab, k, parts);
  FN_CUDA_LAUNCH_CHECK("top_partial_kernel");
  launch_pdl("top_finish_kernel", top_finish_kernel, 1, kTopThreads, 0, stream, p.logits, p.vocab,
             p.chosen, k, static_cast<const TopPartial*>(parts), static_cast<int>(grid), p.out);
  FN_CUDA_LAUNCH_CHECK("top_finish_kernel");
}

}  // namespace fn

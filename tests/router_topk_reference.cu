// The router softmax + top-k block of cuda/kernels/moe_device.cuh as it was before the
// redux/candidate version (commit c9b54c1: block max, FP64 sum, per-warp bitonic sorts of 64 keys,
// ranks by binary searches with atomics), kept verbatim as the bit-exact reference of
// fn::dev::router_topk_block, and row launchers for both (tests/test_cuda_decode_ops.cpp compares
// them bitwise).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/cuda_check.h"
#include "cuda/kernels/moe_device.cuh"
#include "tests/router_topk_reference.h"

namespace fn::test {
namespace {

constexpr int kRouterThreads = 512;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 64;

// ---- the reference: moe_device.cuh at c9b54c1, unchanged but for the function's name ----------

constexpr int kSortList = 64;  // keys sorted per warp: two per lane

// Ranking key of a probability: NaN ranks as -Inf (so the order stays total).
__device__ __forceinline__ float rank_key(float p) {
  return isnan(p) ? -INFINITY : p;
}

// The sort key of expert e with probability p: the higher key comes first in the order
// (rank_key(p) desc, e asc). High word: the float's bits mapped so that unsigned order is float
// order (-0 as +0, as the float comparison), low word: ~e. Never 0 (0 pads the lists).
__device__ __forceinline__ unsigned long long router_key(float p, int e) {
  float v = rank_key(p);
  if (v == 0.0f) v = 0.0f;
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(e));
}

__device__ __forceinline__ int key_id(unsigned long long key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key & 0xffffffffull));
}

// Bitonic sort, descending, of the warp's 64 keys: element lane in a0, element 32 + lane in a1.
__device__ __forceinline__ void warp_sort64_desc(unsigned long long& a0, unsigned long long& a1,
                                                 int lane) {
#pragma unroll
  for (int size = 2; size <= kSortList; size <<= 1) {
#pragma unroll
    for (int j = size >> 1; j > 0; j >>= 1) {
      if (j == 32) {  // size 64, one descending block: pairs (lane, 32 + lane) in registers
        const unsigned long long hi = a0 > a1 ? a0 : a1, lo = a0 > a1 ? a1 : a0;
        a0 = hi;
        a1 = lo;
      } else {
        const unsigned long long b0 = __shfl_xor_sync(0xffffffffu, a0, j);
        const unsigned long long b1 = __shfl_xor_sync(0xffffffffu, a1, j);
        // Element i of a block of `size` sorted descending when (i & size) == 0; of the pair
        // (i, i ^ j) the lower index takes the larger key in a descending block.
        const bool lower = (lane & j) == 0;
        const bool max0 = lower == ((lane & size) == 0);
        const bool max1 = lower == (((lane + 32) & size) == 0);
        a0 = max0 ? (a0 > b0 ? a0 : b0) : (a0 < b0 ? a0 : b0);
        a1 = max1 ? (a1 > b1 ? a1 : b1) : (a1 < b1 ? a1 : b1);
      }
    }
  }
}

// Number of keys greater than key in a descending list of kSortList keys (binary lifting).
__device__ __forceinline__ int count_greater(const unsigned long long* list,
                                             unsigned long long key) {
  int pos = 0;
#pragma unroll
  for (int step = kSortList; step > 0; step >>= 1)
    if (pos + step <= kSortList && list[pos + step - 1] > key) pos += step;
  return pos;
}

/// Router softmax + top-k of one row (docs/model.md §C.7 step 1; the semantics of
/// fn::launch_router_topk, cuda/kernels/decode_ops.h): p = softmax(logits[0, E)) (FP32 expf(l -
/// max), FP64 sum), the top k of p in the order (p desc, id asc), w = p / sum(p_selected) (FP64)
/// when norm, else p; a NaN p ranks as -Inf and sets *flag = 4 (flag may be null). Must be called
/// by all kRouterThreads threads of a block (uniformly: it uses __syncthreads), after the logits
/// are complete and visible to the block; the logits are read with ld.global.cg (L2, not L1), so a
/// block may read logits that other blocks of its own grid wrote before a __threadfence() and an
/// atomic arrival. The same code for every caller, so the same bits.
__device__ __forceinline__ void reference_router_topk_block(const float* logits, int E, int k,
                                                            bool norm, int32_t* ids, float* weights,
                                                            int32_t* flag) {
  __shared__ float p[kMaxExperts];
  __shared__ unsigned long long sorted[kMaxExperts];
  __shared__ float warp_max[kRouterThreads / 32];
  __shared__ double warp_sum[kRouterThreads / 32];
  __shared__ int sel[kMaxTopK];
  __shared__ int rank_of[kMaxExperts];  // ranks of the candidates (lists * min(k, 64) <= E max)
  __shared__ float s_max;
  __shared__ double s_sum;
  __shared__ int s_nan;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) s_nan = 0;

  // Max (fmaxf skips NaN), fixed order: per thread, butterfly, warps ascending.
  float mx = -INFINITY;
  for (int e = tid; e < E; e += kRouterThreads) mx = fmaxf(mx, __ldcg(logits + e));
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) warp_max[warp] = mx;
  __syncthreads();
  if (tid == 0) {
    float m = warp_max[0];
    for (int w = 1; w < kRouterThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
    s_max = m;
  }
  __syncthreads();
  mx = s_max;

  // exp(l - max) in FP32, the sum in FP64 (as route_top_k), fixed order.
  double sum = 0.0;
  for (int e = tid; e < E; e += kRouterThreads) {
    const float v = expf(__ldcg(logits + e) - mx);
    p[e] = v;
    sum += static_cast<double>(v);
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) warp_sum[warp] = sum;
  __syncthreads();
  if (tid == 0) {
    double s = warp_sum[0];
    for (int w = 1; w < kRouterThreads / 32; ++w) s += warp_sum[w];
    s_sum = s;
  }
  __syncthreads();
  sum = s_sum;
  for (int e = tid; e < E; e += kRouterThreads) {
    const float v = static_cast<float>(static_cast<double>(p[e]) / sum);
    p[e] = v;
    if (isnan(v)) s_nan = 1;
  }
  __syncthreads();

  // The top k in the order (p desc, id asc): each warp of the first ceil(E / 64) sorts 64 keys
  // (bitonic, in registers), then a candidate's rank is its place in its own list plus the count
  // of greater keys in every other list (binary search). Keys are distinct, so ranks are too.
  const int lists = (E + kSortList - 1) / kSortList;
  if (warp < lists) {
    const int e0 = warp * kSortList + lane, e1 = e0 + 32;
    unsigned long long a0 = e0 < E ? router_key(p[e0], e0) : 0ull;
    unsigned long long a1 = e1 < E ? router_key(p[e1], e1) : 0ull;
    warp_sort64_desc(a0, a1, lane);
    sorted[warp * kSortList + lane] = a0;
    sorted[warp * kSortList + 32 + lane] = a1;
  }
  __syncthreads();
  const int kc = k < kSortList ? k : kSortList;  // past place k - 1 of its list nothing ranks < k
  const int cands = lists * kc;                  // candidate c = w * kc + q: place q of list w
  for (int c = tid; c < cands; c += kRouterThreads) rank_of[c] = c % kc;
  __syncthreads();
  // One binary search per (candidate, other list), all in parallel; the counts are summed with
  // integer atomics (exact, so the rank does not depend on their order).
  for (int t = tid; t < cands * lists; t += kRouterThreads) {
    const int c = t / lists, o = t - c * lists, w = c / kc;
    if (o == w) continue;
    const unsigned long long key = sorted[w * kSortList + c - w * kc];
    if (key == 0ull) continue;  // padding: ranks after every expert
    const int n = count_greater(sorted + o * kSortList, key);
    if (n != 0) atomicAdd(&rank_of[c], n);
  }
  __syncthreads();
  for (int c = tid; c < cands; c += kRouterThreads) {
    const int w = c / kc;
    const unsigned long long key = sorted[w * kSortList + c - w * kc];
    if (key != 0ull && rank_of[c] < k) sel[rank_of[c]] = key_id(key);
  }
  __syncthreads();
  // Thread r < k writes place r; each sums the selected p in place order (the same FP64 sum).
  if (tid < k) {
    double sel_sum = 0.0;
    for (int r = 0; r < k; ++r) sel_sum += static_cast<double>(p[sel[r]]);
    const float pe = p[sel[tid]];
    ids[tid] = sel[tid];
    weights[tid] = norm ? static_cast<float>(static_cast<double>(pe) / sel_sum) : pe;
  }
  if (tid == 0 && s_nan != 0 && flag != nullptr) *flag = 4;
}

// ---- row kernels: one 512-thread block per row, per-row flags ----------------------------------

__global__ void __launch_bounds__(kRouterThreads)
    reference_rows_kernel(const float* logits, int64_t stride, int E, int k, bool norm,
                          int32_t* ids, float* weights, int32_t* flags) {
  const int64_t row = blockIdx.x;
  reference_router_topk_block(logits + row * stride, E, k, norm, ids + row * k, weights + row * k,
                              flags + row);
}

__global__ void __launch_bounds__(kRouterThreads)
    current_rows_kernel(const float* logits, int64_t stride, int E, int k, bool norm, int32_t* ids,
                        float* weights, int32_t* flags) {
  const int64_t row = blockIdx.x;
  fn::dev::router_topk_block(logits + row * stride, E, k, norm, ids + row * k, weights + row * k,
                             flags + row);
}

}  // namespace

void router_topk_rows(bool reference, const float* logits, int64_t stride, int rows, int E, int k,
                      bool norm, int32_t* ids, float* weights, int32_t* flags,
                      cudaStream_t stream) {
  static_assert(kRouterThreads == fn::dev::kRouterThreads && kMaxExperts == fn::dev::kMaxExperts &&
                kMaxTopK == fn::dev::kMaxTopK);
  if (rows <= 0) return;
  if (reference)
    reference_rows_kernel<<<static_cast<unsigned>(rows), kRouterThreads, 0, stream>>>(
        logits, stride, E, k, norm, ids, weights, flags);
  else
    current_rows_kernel<<<static_cast<unsigned>(rows), kRouterThreads, 0, stream>>>(
        logits, stride, E, k, norm, ids, weights, flags);
  FN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fn::test

// Small decode-step kernels (see decode_ops.h).
#include "cuda/decode_ops.h"

#include <cuda_runtime.h>

#include "comm/cuda_check.h"
#include "cuda/device_util.cuh"
#include "cuda/launch_check.h"
#include "cuda/pdl.cuh"

namespace fn {
namespace {

constexpr int kThreads = 256;
constexpr int kRouterThreads = 512;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 64;

unsigned grid_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// ---- embedding -------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    embed_kernel(const uint16_t* table, int64_t vocab, int64_t D, const int32_t* token, float* H,
                 int hc, int32_t* flag) {
  dev::pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int32_t t = *token;
  const bool ok = t >= 0 && static_cast<int64_t>(t) < vocab;
  if (!ok && i == 0) *flag = 1;
  if (i >= D) return;
  const float v = ok ? __uint_as_float(static_cast<uint32_t>(table[t * D + i]) << 16) : 0.0f;
  for (int s = 0; s < hc; ++s) H[s * D + i] = v;
}

// ---- HC inject ---------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    hc_inject_kernel(float* H, const float* iota, const float* y, int hc, int64_t D) {
  dev::pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= D) return;
  const float yi = y[i];
  for (int s = 0; s < hc; ++s) {
    // Product and sum rounded separately (no contraction), as fn::cpu::hc_inject.
    H[s * D + i] = __fadd_rn(H[s * D + i], __fmul_rn(iota[s], yi));
  }
}

// ---- SwiGLU
// --------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(const float* gate_up, uint16_t* h, int64_t I) {
  dev::pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= I) return;
  h[i] = dev::float_to_bf16_bits(dev::silu(gate_up[i]) * gate_up[I + i]);
}

// ---- router ------------------------------------------------------------------------------------

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

__global__ void __launch_bounds__(kRouterThreads)
    router_topk_kernel(const float* logits_rows, int64_t stride, int E, int k, bool norm,
                       int32_t* ids_rows, float* weights_rows, int32_t* flag) {
  __shared__ float p[kMaxExperts];
  __shared__ unsigned long long sorted[kMaxExperts];
  __shared__ float warp_max[kRouterThreads / 32];
  __shared__ double warp_sum[kRouterThreads / 32];
  __shared__ int sel[kMaxTopK];
  __shared__ int rank_of[kMaxExperts];  // ranks of the candidates (lists * min(k, 64) <= E max)
  __shared__ float s_max;
  __shared__ double s_sum;
  __shared__ int s_nan;
  dev::pdl_begin();
  // One CTA per row (launch_router_topk: one row).
  const int64_t row = blockIdx.x;
  const float* logits = logits_rows + row * stride;
  int32_t* ids = ids_rows + row * k;
  float* weights = weights_rows + row * k;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) s_nan = 0;

  // Max (fmaxf skips NaN), fixed order: per thread, butterfly, warps ascending.
  float mx = -INFINITY;
  for (int e = tid; e < E; e += kRouterThreads) mx = fmaxf(mx, logits[e]);
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
    const float v = expf(logits[e] - mx);
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

// ---- MoE combine
// ---------------------------------------------------------------------------------

__device__ __forceinline__ float sigmoid_2branch(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

__global__ void __launch_bounds__(kThreads)
    moe_combine_kernel(float* y, const float* ys, const float* gate_logit, int64_t D) {
  dev::pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= D) return;
  const float gamma = sigmoid_2branch(*gate_logit);
  y[i] = fmaf(gamma, ys[i], y[i]);
}

// ---- logits scatter
// ------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    scatter_logits_kernel(const float* local, float* full, int64_t v_local, int64_t v_first,
                          int64_t V) {
  dev::pdl_begin();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < V; i += stride) {
    const int64_t j = i - v_first;
    full[i] = (j >= 0 && j < v_local) ? local[j] : 0.0f;
  }
}

}  // namespace

void launch_embed(const EmbedParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_embed";
  FN_LAUNCH_REQUIRE(
      p.table != nullptr && p.token != nullptr && p.H != nullptr && p.error_flag != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.vocab >= 1 && p.vocab <= INT32_MAX && p.hidden >= 1 && p.hc_count >= 1, kOp);
  launch_pdl("embed_kernel", embed_kernel, grid_for(p.hidden), kThreads, 0, stream, p.table,
             p.vocab, p.hidden, p.token, p.H, p.hc_count, p.error_flag);
  FN_CUDA_LAUNCH_CHECK("embed_kernel");
}

void launch_hc_inject(const HcInjectParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_inject";
  FN_LAUNCH_REQUIRE(p.H != nullptr && p.iota != nullptr && p.y != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.hc_count >= 1 && p.hidden >= 1, kOp);
  launch_pdl("hc_inject_kernel", hc_inject_kernel, grid_for(p.hidden), kThreads, 0, stream, p.H,
             p.iota, p.y, p.hc_count, p.hidden);
  FN_CUDA_LAUNCH_CHECK("hc_inject_kernel");
}

void launch_swiglu(const SwigluParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_swiglu";
  FN_LAUNCH_REQUIRE(p.gate_up != nullptr && p.h != nullptr && p.inter >= 1, kOp);
  launch_pdl("swiglu_kernel", swiglu_kernel, grid_for(p.inter), kThreads, 0, stream, p.gate_up, p.h,
             p.inter);
  FN_CUDA_LAUNCH_CHECK("swiglu_kernel");
}

void launch_router_topk(const RouterParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_router_topk";
  FN_LAUNCH_REQUIRE(p.logits != nullptr && p.ids != nullptr && p.weights != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.num_experts >= 1 && p.num_experts <= kMaxExperts, kOp);
  FN_LAUNCH_REQUIRE(p.top_k >= 1 && p.top_k <= p.num_experts && p.top_k <= kMaxTopK, kOp);
  launch_pdl("router_topk_kernel", router_topk_kernel, 1, kRouterThreads, 0, stream, p.logits,
             int64_t{0}, p.num_experts, p.top_k, p.norm_topk_prob, p.ids, p.weights, p.error_flag);
  FN_CUDA_LAUNCH_CHECK("router_topk_kernel");
}

void launch_router_topk_rows(const RouterRowsParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_router_topk_rows";
  FN_LAUNCH_REQUIRE(p.rows >= 0 && p.rows <= INT32_MAX, kOp);
  if (p.rows == 0) return;
  FN_LAUNCH_REQUIRE(p.logits != nullptr && p.ids != nullptr && p.weights != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.num_experts >= 1 && p.num_experts <= kMaxExperts, kOp);
  FN_LAUNCH_REQUIRE(p.top_k >= 1 && p.top_k <= p.num_experts && p.top_k <= kMaxTopK, kOp);
  FN_LAUNCH_REQUIRE(p.logits_stride >= p.num_experts, kOp);
  router_topk_kernel<<<static_cast<unsigned>(p.rows), kRouterThreads, 0, stream>>>(
      p.logits, p.logits_stride, p.num_experts, p.top_k, p.norm_topk_prob, p.ids, p.weights,
      p.error_flag);
  FN_CUDA_LAUNCH_CHECK("router_topk_kernel (rows)");
}

void launch_moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_combine";
  FN_LAUNCH_REQUIRE(p.y != nullptr && p.y_shared != nullptr && p.gate_logit != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.hidden >= 1, kOp);
  launch_pdl("moe_combine_kernel", moe_combine_kernel, grid_for(p.hidden), kThreads, 0, stream, p.y,
             p.y_shared, p.gate_logit, p.hidden);
  FN_CUDA_LAUNCH_CHECK("moe_combine_kernel");
}

void launch_scatter_logits(const ScatterLogitsParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_scatter_logits";
  FN_LAUNCH_REQUIRE(p.full != nullptr && (p.local != nullptr || p.v_local == 0), kOp);
  FN_LAUNCH_REQUIRE(p.vocab >= 1 && p.v_local >= 0 && p.v_first >= 0, kOp);
  FN_LAUNCH_REQUIRE(p.v_first + p.v_local <= p.vocab, kOp);
  const int64_t blocks = (p.vocab + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 1024 ? blocks : 1024);
  launch_pdl("scatter_logits_kernel", scatter_logits_kernel, grid, kThreads, 0, stream, p.local,
             p.full, p.v_local, p.v_first, p.vocab);
  FN_CUDA_LAUNCH_CHECK("scatter_logits_kernel");
}

}  // namespace fn

// Small decode-step kernels (see decode_ops.h).
#include "cuda/decode_ops.h"

#include <cuda_runtime.h>

#include "comm/cuda_check.h"
#include "cuda/device_util.cuh"
#include "cuda/launch_check.h"

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
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= I) return;
  h[i] = dev::float_to_bf16_bits(dev::silu(gate_up[i]) * gate_up[I + i]);
}

// ---- router ------------------------------------------------------------------------------------

// Ranking key of a probability: NaN ranks as -Inf (so the order stays total).
__device__ __forceinline__ float rank_key(float p) {
  return isnan(p) ? -INFINITY : p;
}

__global__ void __launch_bounds__(kRouterThreads)
    router_topk_kernel(const float* logits, int E, int k, bool norm, int32_t* ids, float* weights,
                       int32_t* flag) {
  __shared__ float p[kMaxExperts];
  __shared__ float warp_max[kRouterThreads / 32];
  __shared__ double warp_sum[kRouterThreads / 32];
  __shared__ int sel[kMaxTopK];
  __shared__ float s_max;
  __shared__ double s_sum;
  __shared__ int s_nan;
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

  // Rank of each expert in the order (p desc, id asc): the number of experts before it. Ranks
  // are distinct, so the top-k land in sel[0..k) exactly once.
  for (int e = tid; e < E; e += kRouterThreads) {
    const float pe = rank_key(p[e]);
    int rank = 0;
    for (int j = 0; j < E; ++j) {
      const float pj = rank_key(p[j]);
      rank += (pj > pe || (pj == pe && j < e)) ? 1 : 0;
    }
    if (rank < k) sel[rank] = e;
  }
  __syncthreads();
  if (tid == 0) {
    double sel_sum = 0.0;
    for (int r = 0; r < k; ++r) sel_sum += static_cast<double>(p[sel[r]]);
    for (int r = 0; r < k; ++r) {
      const float pe = p[sel[r]];
      ids[r] = sel[r];
      weights[r] = norm ? static_cast<float>(static_cast<double>(pe) / sel_sum) : pe;
    }
    if (s_nan != 0 && flag != nullptr) *flag = 4;
  }
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
  embed_kernel<<<grid_for(p.hidden), kThreads, 0, stream>>>(p.table, p.vocab, p.hidden, p.token,
                                                            p.H, p.hc_count, p.error_flag);
  FN_CUDA_LAUNCH_CHECK("embed_kernel");
}

void launch_hc_inject(const HcInjectParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_inject";
  FN_LAUNCH_REQUIRE(p.H != nullptr && p.iota != nullptr && p.y != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.hc_count >= 1 && p.hidden >= 1, kOp);
  hc_inject_kernel<<<grid_for(p.hidden), kThreads, 0, stream>>>(p.H, p.iota, p.y, p.hc_count,
                                                                p.hidden);
  FN_CUDA_LAUNCH_CHECK("hc_inject_kernel");
}

void launch_swiglu(const SwigluParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_swiglu";
  FN_LAUNCH_REQUIRE(p.gate_up != nullptr && p.h != nullptr && p.inter >= 1, kOp);
  swiglu_kernel<<<grid_for(p.inter), kThreads, 0, stream>>>(p.gate_up, p.h, p.inter);
  FN_CUDA_LAUNCH_CHECK("swiglu_kernel");
}

void launch_router_topk(const RouterParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_router_topk";
  FN_LAUNCH_REQUIRE(p.logits != nullptr && p.ids != nullptr && p.weights != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.num_experts >= 1 && p.num_experts <= kMaxExperts, kOp);
  FN_LAUNCH_REQUIRE(p.top_k >= 1 && p.top_k <= p.num_experts && p.top_k <= kMaxTopK, kOp);
  router_topk_kernel<<<1, kRouterThreads, 0, stream>>>(
      p.logits, p.num_experts, p.top_k, p.norm_topk_prob, p.ids, p.weights, p.error_flag);
  FN_CUDA_LAUNCH_CHECK("router_topk_kernel");
}

void launch_moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_combine";
  FN_LAUNCH_REQUIRE(p.y != nullptr && p.y_shared != nullptr && p.gate_logit != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.hidden >= 1, kOp);
  moe_combine_kernel<<<grid_for(p.hidden), kThreads, 0, stream>>>(p.y, p.y_shared, p.gate_logit,
                                                                  p.hidden);
  FN_CUDA_LAUNCH_CHECK("moe_combine_kernel");
}

void launch_scatter_logits(const ScatterLogitsParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_scatter_logits";
  FN_LAUNCH_REQUIRE(p.full != nullptr && (p.local != nullptr || p.v_local == 0), kOp);
  FN_LAUNCH_REQUIRE(p.vocab >= 1 && p.v_local >= 0 && p.v_first >= 0, kOp);
  FN_LAUNCH_REQUIRE(p.v_first + p.v_local <= p.vocab, kOp);
  const int64_t blocks = (p.vocab + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 1024 ? blocks : 1024);
  scatter_logits_kernel<<<grid, kThreads, 0, stream>>>(p.local, p.full, p.v_local, p.v_first,
                                                       p.vocab);
  FN_CUDA_LAUNCH_CHECK("scatter_logits_kernel");
}

}  // namespace fn

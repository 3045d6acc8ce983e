// Small decode-step kernels (see decode_ops.h).
#include "cuda/kernels/decode_ops.h"

#include <cuda_runtime.h>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/kernels/moe_device.cuh"

namespace fn {
namespace {

constexpr int kThreads = 256;
using dev::kMaxExperts;
using dev::kMaxTopK;
using dev::kRouterThreads;

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
  const float yi = __ldg(y + i);
  // Four streams at a time, every load before any store: a store to H could alias a later
  // stream's H or iota for all the compiler knows, so interleaved it would serialise one memory
  // round trip per stream (the kernel sits on the step's critical path 96 times per token).
  constexpr int kBatch = 4;
  for (int s0 = 0; s0 < hc; s0 += kBatch) {
    float h[kBatch], io[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const bool ok = s0 + k < hc;
      h[k] = ok ? H[(s0 + k) * D + i] : 0.0f;
      io[k] = ok ? __ldg(iota + s0 + k) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (s0 + k < hc) H[(s0 + k) * D + i] = dev::hc_inject_value(h[k], io[k], yi);
  }
}

// ---- router ------------------------------------------------------------------------------------

// One CTA per row (launch_router_topk: one row), dev::router_topk_block
// (cuda/kernels/moe_device.cuh).
__global__ void __launch_bounds__(kRouterThreads)
    router_topk_kernel(const float* logits_rows, int64_t stride, int E, int k, bool norm,
                       int32_t* ids_rows, float* weights_rows, int32_t* flag) {
  dev::pdl_begin();
  const int64_t row = blockIdx.x;
  dev::router_topk_block(logits_rows + row * stride, E, k, norm, ids_rows + row * k,
                         weights_rows + row * k, flag);
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

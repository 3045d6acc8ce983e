// Per-row reductions of logits rows on the device (cuda/kernels/logit_stats.h).
#include "cuda/kernels/logit_stats.h"

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/common/cuda_check.h"
#include "cuda/common/launch_check.h"

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

}  // namespace fn

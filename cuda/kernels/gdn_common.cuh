// Device math shared by the Gated DeltaNet decode (cuda/kernels/gdn.cu) and prefill
// (cuda/kernels/gdn_prefill.cu) kernels, so both compute the gates and the causal conv tap sum with
// the same operations in the same order (docs/model.md §C.5 steps 2 and 4). Device code only;
// included by .cu files.
#pragma once

#include "cuda/common/device_util.cuh"

namespace fn::dev {

/// The CPU op's two-branch sigmoid (cpu::sigmoid): exp never overflows.
__device__ __forceinline__ float sigmoid2(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

/// log(1 + e^x), the identity above 20 (docs/model.md §C.5 step 4).
__device__ __forceinline__ float softplus(float x) {
  return x > 20.0f ? x : log1pf(expf(x));
}

/// Step 4 decay exp(g) with g = -exp(A_log) * softplus(a + dt_bias), FP32.
__device__ __forceinline__ float gdn_decay(float a, float A_log, float dt_bias) {
  const float g = -expf(A_log) * softplus(a + dt_bias);
  return expf(g);
}

}  // namespace fn::dev

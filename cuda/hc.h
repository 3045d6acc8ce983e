// Grouped (1 + w) RMSNorm and the hyper-connection read ("mix", MODEL.md §C.2, §C.3) for one
// decode token. Called by the CUDA decode step before each mixer / MoE and for the final mixer.
// The HC read is three launches: launch_group_rms_norm_1p (H -> N), launch_gemv_bf16 over the
// stacked [W_dn; W_inj] (N -> t, FP32), launch_hc_mix (t, N -> m, iota). Deterministic, no
// atomics, graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn {

/// GroupRMSNorm1p (MODEL.md §C.2): for each group g of group_size consecutive elements,
/// out = x * rsqrt(mean(x^2) + eps) * (1 + w) in FP32, rounded to BF16 on store. The weight has
/// one entry per element (num_groups * group_size, 10240 distinct values for the HC norm).
struct GroupRmsNormParams {
  const float* x = nullptr;          ///< [num_groups * group_size] FP32 (the HC residual H)
  const uint16_t* weight = nullptr;  ///< [num_groups * group_size] BF16 bits (hc_norm.weight)
  uint16_t* out = nullptr;           ///< [num_groups * group_size] BF16 bits; must not alias x
  int num_groups = 0;                ///< hc_count (4), >= 1
  int64_t group_size = 0;            ///< hidden_size (2560), >= 1, multiple of 4
  float eps = 1e-6f;                 ///< rms_norm_eps
};

/// Launches one block per group. Throws fn::Error(Internal) on null pointers, bad sizes or
/// misalignment (x 16-byte, weight/out 8-byte aligned); fn::Error(Cuda) on a failed launch.
void launch_group_rms_norm_1p(const GroupRmsNormParams& params, cudaStream_t stream);

/// HC mix (MODEL.md §C.3 steps 2-5) from t = [W_dn N ; W_inj N] (FP32, hc_lowrank + hc_count
/// values, produced by launch_gemv_bf16 over the stacked weights):
///   u = silu(t[0:r] / hc_count) (FP32, not rounded), G = sigmoid(W_up u) (FP32),
///   m[i] = (1/hc_count) sum_s G[s*D + i] * N[s*D + i]  -> BF16,
///   iota[s] = 2 * sigmoid(t[r + s] / hc_count)          -> FP32 (when iota != nullptr).
struct HcMixParams {
  const uint16_t* w_up = nullptr;  ///< [hc_count * D, r] BF16 bits row-major, 16-byte aligned
  const float* t = nullptr;        ///< [r + hc_count] FP32 (iota part unused when iota == nullptr)
  const uint16_t* n = nullptr;     ///< [hc_count * D] BF16 bits: the normed residual N
  uint16_t* m = nullptr;           ///< [D] BF16 bits: the block input
  float* iota = nullptr;           ///< [hc_count] FP32 inject weights, or nullptr (final mixer)
  int hc_count = 4;                ///< must be 4 (the kernel keeps one accumulator per stream)
  int64_t hidden = 0;              ///< D (2560)
  int64_t rank = 0;                ///< r = hc_lowrank (320), multiple of 8
};

/// Launches the mix: one team of lanes per output i reads the 4 rows i + s*D of W_up. Throws
/// fn::Error(Internal) on null pointers, hc_count != 4, bad sizes or misalignment.
void launch_hc_mix(const HcMixParams& params, cudaStream_t stream);

}  // namespace fn

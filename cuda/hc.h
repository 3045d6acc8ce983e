// The hyper-connection read ("mix", MODEL.md §C.2, §C.3) for one decode token, in two launches:
// launch_hc_down (grouped (1 + w) RMSNorm of H fused into the split-K GEMV over the stacked
// [W_dn; W_inj] -> N and the partial dots of t) and launch_hc_mix (t, N -> m, iota). Called by the
// CUDA decode step before each mixer / MoE and for the final mixer. Deterministic (fixed summation
// orders, no atomics), graph-capturable, PDL-aware (weights load before the dependency wait).
// Numerics (issue 9): N and m are FP32 (every BF16 GEMV reads them as FP32 inputs); only the NVFP4
// routed experts read a BF16 copy of m (W4A16, DESIGN.md). Rounding N and m to BF16 was measured
// to cause almost all of the CUDA engine's KL divergence against transformers (1.4e-3 .. 3.3e-3
// with BF16 N and m, 4e-5 .. 1e-4 with FP32 in the FP32 CPU emulation).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn {

/// The HC down pass (MODEL.md §C.2 and §C.3 step 1-2 and 5's GEMV): per group g of `hidden`
/// elements, N = H * rsqrt(mean(H_g^2) + eps) * (1 + w) in FP32 (the statistic summed in FP32 in
/// a fixed order, (1 + w) never rounded), and t = W N with W = [W_dn; W_inj] BF16, split over the
/// columns: t_partial[p * rows + r] = sum over columns c in chunk p of W[r, c] * N[c] (FP32,
/// ascending within a lane, then a fixed butterfly). The consumer (launch_hc_mix) sums the
/// hc_down_splits() partials in ascending p. Every block recomputes the statistic of the groups
/// its chunk touches (same order, so the same bits in every block); the blocks of the first row
/// block write N.
struct HcDownParams {
  const float* H = nullptr;          ///< [hc_count * hidden] FP32 residual, 16-byte aligned
  const uint16_t* norm = nullptr;    ///< [hc_count * hidden] BF16 bits (hc_norm.weight)
  const uint16_t* weight = nullptr;  ///< [rows, hc_count * hidden] BF16 bits, 16-byte aligned
  int64_t rows = 0;                  ///< hc_lowrank (+ hc_count with the inject rows), >= 1
  int hc_count = 4;                  ///< groups (streams), 1..64
  int64_t hidden = 0;                ///< D (2560): multiple of 8, >= 8
  float eps = 1e-6f;                 ///< rms_norm_eps
  float* n = nullptr;                ///< out: [hc_count * hidden] FP32 N, 16-byte aligned
  /// out: [hc_down_splits(hc_count * hidden), rows] FP32 partial dots; must not alias n or H.
  float* t_partial = nullptr;
};

/// Column chunks of the HC down pass for a row width of `width` = hc_count * hidden columns
/// (1024 columns per chunk; 10 at the real width 10240): the leading dimension of
/// HcDownParams::t_partial. launch_hc_mix sums at most 16 (width <= 16384).
int64_t hc_down_splits(int64_t width);

/// Launches ceil(rows / 32) x hc_down_splits(width) blocks of 256 threads (32 rows x 1024 columns
/// each; at the real shape 11 x 10, the whole 6.6 MB matrix in flight before the PDL wait).
/// Throws fn::Error(Internal) on null pointers, bad sizes or misalignment; fn::Error(Cuda) on a
/// failed launch.
void launch_hc_down(const HcDownParams& params, cudaStream_t stream);

/// HC mix (MODEL.md §C.3 steps 2-5) from the partial dots of launch_hc_down:
///   t[j] = sum_{p < t_splits} t[p * t_stride + j] (FP32, ascending p),
///   u = silu(t[0:r] / hc_count) (FP32, not rounded), G = sigmoid(W_up u) (FP32),
///   m[i] = (1/hc_count) sum_s G[s*D + i] * N[s*D + i]  -> FP32 (and BF16 in m_bf16 if given),
///   iota[s] = 2 * sigmoid(t[r + s] / hc_count)          -> FP32 (when iota != nullptr).
struct HcMixParams {
  const uint16_t* w_up = nullptr;  ///< [hc_count * D, r] BF16 bits row-major, 16-byte aligned
  /// [t_splits, t_stride] FP32 partial dots (iota part unused when iota == nullptr)
  const float* t = nullptr;
  int64_t t_splits = 1;      ///< partials per value, 1..16 (hc_down_splits)
  int64_t t_stride = 0;      ///< >= r (+ hc_count with iota): the rows of the down GEMV
  const float* n = nullptr;  ///< [hc_count * D] FP32: the normed residual N
  /// [D] FP32 block input: the input of every BF16 GEMV (mixer in_proj, router, shared expert,
  /// lm_head), kept FP32 (issue 9's KL finding).
  float* m = nullptr;
  /// [D] BF16 bits: m rounded to nearest even, or nullptr. Only the MLP-side read passes it: the
  /// NVFP4 routed experts take BF16 activations (W4A16, DESIGN.md numerics contract).
  uint16_t* m_bf16 = nullptr;
  float* iota = nullptr;  ///< [hc_count] FP32 inject weights, or nullptr (final mixer)
  int hc_count = 4;       ///< must be 4 (the kernel keeps one accumulator per stream)
  int64_t hidden = 0;     ///< D (2560)
  int64_t rank = 0;       ///< r = hc_lowrank (320), multiple of 8, <= 8192 (u in shared memory)
};

/// Launches the mix: each block first sums the partials into u = silu(t / 4) in shared memory,
/// then one team of lanes per output i reads the 4 rows i + s*D of W_up. Throws
/// fn::Error(Internal) on null pointers, hc_count != 4, bad sizes or misalignment.
void launch_hc_mix(const HcMixParams& params, cudaStream_t stream);

}  // namespace fn

// The hyper-connection read ("mix", docs/model.md §C.2, §C.3) for one decode token (or for
// `tokens` independent tokens at once, each with its own residual), in two launches: launch_hc_down
// (split-K GEMV over the stacked [W_dn; W_inj] against H * (1 + w), per-chunk partial dots and
// partial sums of squares, no block-wide step) and launch_hc_mix (the group RMSNorm scales from the
// partial squares, t, u, G, N -> m, iota). Called by the CUDA decode step before each mixer / MoE
// and for the final mixer, and over B rows by the batched decode step
// (cuda/model/cuda_prefill.cpp): each block stages its weight tile once and loops over the tokens,
// and each token's outputs are bitwise those of a one-token launch on its operands. Deterministic
// (fixed summation orders, no atomics), graph-capturable, PDL-aware (weights are staged in shared
// memory with cp.async before the dependency wait; the mix holds them in registers instead where
// they do not fit). Numerics: N and m are FP32 (every BF16 GEMV reads m as FP32); only the NVFP4
// routed experts read a BF16 copy of m (W4A16, docs/design.md). Rounding N and m to BF16 was
// measured to cause almost all of the CUDA engine's KL divergence against transformers (1.4e-3
// .. 3.3e-3 with BF16 N and m, 4e-5 .. 1e-4 with FP32 in the FP32 CPU emulation).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn {

/// The HC down pass (docs/model.md §C.2 and §C.3 step 1-2 and 5's GEMV) without the norm's scale:
/// every column chunk p lies inside one group g(p) = p / hc_down_chunks(hidden) (chunks of 1280
/// columns, the group's last one shorter), and
///   t_partial[p * rows + r] = sum over columns c in chunk p of W[r, c] * (H[c] * (1 + w[c])),
///   sumsq[p]                = sum over columns c in chunk p of H[c]^2,
/// both FP32 (x = H * (1 + w) rounded once after (1 + w) is; ascending within a lane, then a
/// fixed butterfly over the 32 lanes). Since N = scale_g * H * (1 + w) with one scale per group,
/// t = W N = sum_p scale_g(p) * t_partial[p]: launch_hc_mix applies the scales. No block-wide
/// reduction and no statistic before the dot: the latency after the PDL wait is one load of H.
///
/// Several tokens (`tokens` = B > 1): token b's operands and outputs sit at fixed strides from
/// the pointers below (splits = hc_down_splits(hc_count, hidden)):
///   H, H_out     + b * hc_count * hidden     t_partial   + b * splits * rows
///   inject_y     + b * hidden                sumsq       + b * splits
///   inject_iota  + b * hc_count
/// (so B residual rows [B, hc_count * hidden] row-major, B partial blocks [B, splits, rows], ...).
/// Each block stages its weight tile once and loops over the tokens in order: the weights are
/// read once per launch whatever B is, and each token's outputs are bitwise those of a one-token
/// launch on its operands.
struct HcDownParams {
  const float* H = nullptr;          ///< [tokens, hc_count * hidden] FP32 residual, 16-B aligned
  const uint16_t* norm = nullptr;    ///< [hc_count * hidden] BF16 bits (hc_norm.weight), 16-B
  const uint16_t* weight = nullptr;  ///< [rows, hc_count * hidden] BF16 bits, 16-byte aligned
  int64_t rows = 0;                  ///< hc_lowrank (+ hc_count with the inject rows), >= 1
  int hc_count = 4;                  ///< groups (streams), 1..64
  int64_t hidden = 0;                ///< D (2560): multiple of 8, >= 8
  /// out: [tokens, hc_down_splits(hc_count, hidden), rows] FP32 partial dots; must not alias H.
  float* t_partial = nullptr;
  /// out: [tokens, hc_down_splits(hc_count, hidden)] FP32 partial sums of H^2
  float* sumsq = nullptr;
  /// Optional HC inject of the previous block folded into this read (docs/model.md §C.3, after the
  /// block): with inject_y set, the pass reads H' = H + iota[s] * y (per element, the product and
  /// the sum each rounded once in FP32, no FMA: the same bits as launch_hc_inject) in place of H,
  /// and the blocks of the first row block write H' to H_out (hc_count * hidden FP32, 16-byte
  /// aligned, must not alias H, t_partial or sumsq). The HC mix behind it reads H_out. Saves the
  /// inject launch in the decode step. All three null: no inject (H is read as is). H_out's rows
  /// must not overlap H's rows.
  const float* inject_iota = nullptr;  ///< [tokens, hc_count] FP32 inject weights (last HC mix's)
  const float* inject_y = nullptr;     ///< [tokens, hidden] FP32 block output (after all-reduce)
  float* H_out = nullptr;              ///< out: [tokens, hc_count * hidden] FP32 after inject
  /// true: the kernel runs its compile-time-shape instance when hc_count is 4 and D is 2560 (the
  /// real model); false: always the runtime-shape instance. Same bits.
  bool fixed_shape = true;
  /// Independent tokens of this launch, 1..4096 (the layout above; neither registers nor shared
  /// memory depend on it: the blocks loop over the tokens, so the launch's time grows with it).
  int tokens = 1;
  /// Tokens per block, >= 0 (0: all of them): the grid repeats its blocks ceil(tokens / this)
  /// times along z, each copy staging the same weight tile (from L2 after the first) for its
  /// own run of tokens, so the tokens' serial loops run side by side. The same bits per token.
  int tokens_per_block = 0;
};

/// Column chunks per group of `hidden` columns: ceil(hidden / 1280) (2 at D = 2560).
int64_t hc_down_chunks(int64_t hidden);

/// Column chunks of the HC down pass: hc_count * hc_down_chunks(hidden) (8 at the real shape),
/// the leading dimension of HcDownParams::t_partial and the length of HcDownParams::sumsq.
/// launch_hc_mix takes at most 16.
int64_t hc_down_splits(int64_t hc_count, int64_t hidden);

/// Launches hc_down_splits x ceil(rows / 16) blocks of 256 threads (16 rows x 1280 columns each,
/// staged in shared memory with cp.async, ~43 KB; at the real shape 8 x 21 blocks, the whole
/// 6.6 MB matrix in flight before the PDL wait), whatever `tokens` is, times
/// ceil(tokens / tokens_per_block) along z. With tokens > 1 an
/// instance of 2 blocks per SM (128 registers) runs, loading each token's H while the token before
/// it computes; tokens = 1 runs the one-token instance (the decode step's, 64 registers). Throws
/// fn::Error(Internal) on null pointers, bad sizes (tokens outside 1..4096 included) or
/// misalignment; fn::Error(Cuda) on a failed launch.
void launch_hc_down(const HcDownParams& params, cudaStream_t stream);

/// HC mix (docs/model.md §C.2, §C.3 steps 2-5) from the partials of launch_hc_down, chunk p in
/// group g(p) = p / (t_splits / 4):
///   scale_g = rsqrt((sum_{p in g} sumsq[p]) / D + eps)           (FP32, ascending p),
///   t[j] = sum_p scale_g(p) * t[p * t_stride + j]                 (FP32 fmaf chain, ascending p),
///   u = silu(t[0:r] / hc_count) (FP32, not rounded), G = sigmoid(W_up u) (FP32),
///   N[s*D + i] = H[s*D + i] * scale_s * (1 + w[s*D + i])           (FP32, as docs/model.md §C.2),
///   m[i] = (1/hc_count) sum_s G[s*D + i] * N[s*D + i]  -> FP32 (and BF16 in m_bf16 if given),
///   iota[s] = 2 * sigmoid(t[r + s] / hc_count)          -> FP32 (when iota != nullptr).
/// Several tokens (`tokens` = B > 1): token b's operands and outputs sit at fixed strides:
///   t     + b * t_splits * t_stride     H          + b * hc_count * D
///   sumsq + b * t_splits                m, m_bf16, m_lo  + b * D
///   iota  + b * hc_count
/// (launch_hc_down's t_partial and sumsq for the same tokens, with t_stride its rows). Each block
/// holds its W_up rows once and loops over the tokens in order (u of the token, then the dots);
/// each token's outputs are bitwise those of a one-token launch on its operands.
struct HcMixParams {
  const uint16_t* w_up = nullptr;  ///< [hc_count * D, r] BF16 bits row-major, 16-byte aligned
  /// [tokens, t_splits, t_stride] FP32 partial dots (iota part unused when iota == nullptr)
  const float* t = nullptr;
  const float* sumsq = nullptr;    ///< [tokens, t_splits] FP32 partial sums of H^2 (hc_down)
  int64_t t_splits = 4;            ///< partials per value: 4 * chunks per group, 4..16
  int64_t t_stride = 0;            ///< >= r (+ hc_count with iota): the rows of the down GEMV
  const float* H = nullptr;        ///< [tokens, hc_count * D] FP32 residual (down pass's input)
  const uint16_t* norm = nullptr;  ///< [hc_count * D] BF16 bits (hc_norm.weight)
  float eps = 1e-6f;               ///< rms_norm_eps
  /// [tokens, D] FP32 block input: the input of every BF16 GEMV (mixer in_proj, router, shared
  /// expert, lm_head), kept FP32 (the KL finding above).
  float* m = nullptr;
  /// [tokens, D] BF16 bits: m rounded to nearest even, or nullptr. The decode step's MLP-side
  /// read passes it: the NVFP4 routed experts take BF16 activations (W4A16, docs/design.md
  /// numerics contract); the batched step passes it as the hi half of its GEMM input.
  uint16_t* m_bf16 = nullptr;
  /// [tokens, D] BF16 bits: bf16(m - bf16(m)), or nullptr: with m_bf16 the hi + lo pair of
  /// launch_split_bf16 (cuda/kernels/prefill_ops.h), the batched step's cuBLAS GEMM input.
  uint16_t* m_lo = nullptr;
  float* iota = nullptr;  ///< [tokens, hc_count] FP32 inject weights, or nullptr (final mixer)
  int hc_count = 4;       ///< must be 4 (the kernel keeps one accumulator per stream)
  int64_t hidden = 0;     ///< D (2560)
  int64_t rank = 0;       ///< r = hc_lowrank (320), multiple of 8, <= 8192 (u in shared memory)
  /// true: the staged kernel runs its compile-time-shape instance when the read is the real
  /// model's (rank 320, D 2560, 8 partials) and the launcher plans 32-lane teams (132 SMs);
  /// false: always the runtime-shape instance. Same bits.
  bool fixed_shape = true;
  /// Independent tokens of this launch, 1..4096 (the layout above). The staged kernel reads its
  /// W_up rows once per launch; the register kernel keeps its first 3 vectors per lane and row in
  /// registers and reads the rest again for each token (from L2 after the first), one block per
  /// SM when tokens > 1.
  int tokens = 1;
  /// Tokens per block, >= 0 (0: all of them): the grid repeats its blocks ceil(tokens / this)
  /// times along y (as HcDownParams::tokens_per_block). The same bits per token.
  int tokens_per_block = 0;
};

/// Whether launch_hc_mix(p) runs the shared-memory staged kernel: the block's W_up rows plus u
/// fit in 48 KB (4 * (256 / team) * rank * 2 + rank * 4 bytes, the team as planned by the
/// launcher: 32 lanes at rank 320 on 132 SMs, 21.8 KB); otherwise the register kernel runs, with
/// the same teams and summation order (the same bits). False for sizes the launcher rejects.
bool hc_mix_uses_staging(const HcMixParams& p);

/// Launches the mix: after the PDL wait every thread issues all its loads at once (partials,
/// partial squares, H), each block sums them into u = silu(t / 4) in shared memory, then one team
/// of lanes per output i reads the 4 rows i + s*D of W_up (loaded before the wait: into shared
/// memory when hc_mix_uses_staging(params), else into registers); with several tokens each block
/// repeats the steps after the wait per token. Throws fn::Error(Internal) on null pointers,
/// hc_count != 4, bad sizes (tokens outside 1..4096 included) or misalignment.
void launch_hc_mix(const HcMixParams& params, cudaStream_t stream);

}  // namespace fn

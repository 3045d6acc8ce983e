// Routed experts of the MoE for M prompt tokens of one layer on one TP rank (batched prefill;
// docs/model.md §C.7 steps 1-2 and the routed part of step 4, §B.4 NVFP4): the router for
// every row, then y[p] = sum_j w[p,j] * down(e[p,j], swiglu(gate_up(e[p,j], x[p]))). Called by the
// CUDA prefill step; the shared expert and the gated combine are the caller's. Invariants: the
// router rows are bitwise the decode router's; the routed sum matches the decode kernels
// (cuda/kernels/moe_nvfp4.h) up to FP32 accumulation order (h rounded to BF16 where decode rounds
// it); deterministic (no float atomics); launch_moe_prefill synchronises its stream (not
// capturable).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/moe_nvfp4.h"

namespace fn {

// The router for many rows (RouterRowsParams, launch_router_topk_rows) is in decode_ops.h,
// beside the decode step's router it shares its kernel with.

/// Which implementation launch_moe_prefill uses.
enum class MoePrefillPath {
  Auto,    ///< PerRow when tokens <= kMoePrefillPerRowMaxTokens and the decode kernels accept
           ///< the shape, else Fused
  PerRow,  ///< the decode kernels' FP32 instances over all tokens in one launch each (bitwise
           ///< those kernels' single-token results)
  Fused,   ///< pairs sorted by expert, a grouped W4A16 GEMM per expert (mma.sync BF16) that
           ///< decodes NVFP4 into shared memory once per row tile (no BF16 weight copy in
           ///< global memory), SwiGLU in the epilogue
};

/// Auto takes the per-row path up to this many tokens (each row then costs one gate+up and one
/// down launch, ~25 us at the real shape, less than the fused path's fixed cost).
inline constexpr int64_t kMoePrefillPerRowMaxTokens = 16;

/// The routed experts for `tokens` rows (docs/model.md §C.7): for every token p and slot j < top_k
/// with e = ids[p, j] in [0, num_experts):
///   g = (W_gate[e] x[p]) * gs_gate[e], u = (W_up[e] x[p]) * gs_up[e],
///   h = bf16(silu(g) * u)   (FP32 math, one BF16 rounding, as launch_moe_gate_up_nvfp4),
///   y[p] = sum_j (weights[p, j] * gs_down[e]) * (W_down[e] h)   (FP32).
/// Ids outside [0, num_experts) contribute 0 (as decode). The Fused path decodes the NVFP4
/// weights to BF16 (E2M1 x E4M3 times a power of two is exact in BF16, the global scale left
/// out) into shared memory tiles (no global BF16 copy) and multiplies with mma.sync BF16 tensor
/// cores (FP32 accumulation), then applies the power of two, the global scales and SwiGLU in the
/// epilogue: only the FP32 summation order differs from decode. y[p] sums its contributions in slot
/// order j = 0..top_k-1, as decode, so results are bitwise reproducible for the same ids.
struct MoePrefillParams {
  Nvfp4Experts gate_up;            ///< rows = 2 * I (gate rows, then up rows), cols = hidden_size
  Nvfp4Experts down;               ///< rows = hidden_size, cols = I; same num_experts as gate_up
  const int32_t* ids = nullptr;    ///< [tokens, top_k] device (launch_router_topk_rows)
  const float* weights = nullptr;  ///< [tokens, top_k] device FP32 routing weights
  int64_t tokens = 0;              ///< M, >= 0 (0 does nothing)
  int top_k = 0;                   ///< >= 1
  const uint16_t* x =
      nullptr;                ///< [tokens, hidden] BF16 bits (m' rounded to BF16), 16-byte aligned
  float* y = nullptr;         ///< [tokens, hidden] FP32, overwritten with the routed sum
  void* workspace = nullptr;  ///< moe_prefill_workspace_bytes(*this) bytes, 256-byte aligned
  /// Optional [tokens, top_k, I] BF16 bits: h of every (token, slot) (0 for an invalid id), for
  /// tests and debugging; nullptr in production.
  uint16_t* h_out = nullptr;
  MoePrefillPath path = MoePrefillPath::Auto;
  /// Fused path: tokens per chunk (0 = kMoePrefillChunkTokens). The workspace holds h and the
  /// per-(token, slot) FP32 down outputs of one chunk, so it grows linearly with this; larger
  /// chunks give more rows per expert (fewer weight decodes per row).
  int64_t chunk_tokens = 0;
  /// PerRow path: MoeDownParams::fixed_shape (KernelPlan::moe_down_fixed). Ignored by the Fused
  /// path.
  bool down_fixed = true;
  /// PerRow path: the gate+up on the bulk-copy kernel (MoeGateUpParams::bulk, KernelPlan::
  /// moe_gate_up_bulk: the decode step's kernel, so each row's h is bitwise decode's), every row's
  /// routes streamed through one grid; false: the FP32 kernel. Ignored by the Fused path.
  bool gate_up_bulk = false;
};

/// Default tokens per chunk of the Fused path.
inline constexpr int64_t kMoePrefillChunkTokens = 8192;

/// Workspace bytes for the shape in `shape_only` (gate_up/down rows, cols, num_experts, tokens,
/// top_k, path, chunk_tokens; pointers ignored). The bytes never shrink as
/// tokens grow, so a workspace sized for the largest M serves every smaller M.
///   Fused (Auto above 16 tokens): O(tokens * top_k) integers of routing tables plus, for one
///   chunk of C = min(tokens, chunk_tokens) tokens, h (C * top_k * I BF16) and the per-(token,
///   slot) down outputs (C * top_k * hidden FP32): 900 MiB at the real TP=1 shape and M = 8192
///   (850 MiB at TP=2; 450 / 425 MiB with chunk_tokens 4096).
///   PerRow: one token's h (top_k * I BF16).
///
/// The Fused path's GEMMs (cuda/kernels/moe_prefill.cu, "fused W4A16 path"): an expert's rows are
/// one row tile of up to 256 rows (64 where a CTA cannot have 199 KB of shared memory: below
/// sm_90), more rows ceil(rows / 256) equal tiles; one CTA per (row tile, 128 weight rows),
/// 4-stage (64 rows: 2-stage) cp.async pipeline of activation rows and raw NVFP4 codes, the codes
/// decoded to BF16 once per tile, one step ahead of the mma.sync m16n8k16 MMAs. At M = 8192, top_k
/// 10 and uniform routing (~160 rows per expert) every weight tile is decoded once per chunk.
/// Measured with the previous kernel (wmma, 64-row tiles, weights decoded once per 64 rows with a
/// one-stage register prefetch; H200, tests/test_cuda_moe_prefill.cpp FN_BENCH=1, 512 experts,
/// top_k 10, uniformly random routing, ms per layer including the host planning):
///   M = 8192, TP=1 (I 640): 7.99 (chunk 4096: 9.18);  TP=2 (I 320): 4.53 (chunk 4096: 5.23)
///   M = 512,  TP=1: 1.73;  TP=2: 0.96
/// The grouped-GEMM kernel (one H100, the same benchmark): M = 8192, TP=1: 4.75 ms, 169 TFLOP/s
/// (chunk 4096: 6.48); TP=2: 3.08 ms, 131 TFLOP/s (chunk 4096: 4.05); M = 512: 2.00 / 1.14 ms. In
/// an 8,192-token prefill the routed experts went from 358.8 to 243.9 ms (48 layers, one H100).
size_t moe_prefill_workspace_bytes(const MoePrefillParams& shape_only);

/// Runs on `stream`. Copies ids to the host and synchronises the stream (Fused plans its tiles
/// from the per-expert counts; once per call); the PerRow path does not synchronise.
/// Throws fn::Error(Internal) on null pointers, inconsistent shapes (gate_up.rows != 2 * down.cols,
/// gate_up.cols != down.rows, different num_experts), misalignment, a PerRow request the
/// decode kernels reject, or a Fused request on a device without 64,256 bytes of opt-in shared
/// memory per block (every sm_75+ device has them); fn::Error(Cuda) on a CUDA failure.
void launch_moe_prefill(const MoePrefillParams& params, cudaStream_t stream);

}  // namespace fn

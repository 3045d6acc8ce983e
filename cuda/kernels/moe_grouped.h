// Grouped routed experts for the batched decode step (docs/model.md §C.7 steps 2 and the routed
// part of step 4, §B.4 NVFP4): the routes of all tokens grouped by expert on the device, each
// selected expert's NVFP4 weights streamed from DRAM once per launch and applied to every route
// that selected it on the tensor cores. Invariants: no host synchronisation and no host read of
// the ids (legal during stream capture); deterministic, and each token's results are bitwise
// independent of the other tokens of the launch; sm_90+ (cp.async.bulk).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/kernels/moe_nvfp4.h"

namespace fn {

/// The routed experts of `tokens` tokens (docs/model.md §C.7; the contract of launch_moe_prefill,
/// cuda/kernels/moe_prefill.h). Route r = t * top_k + j (token t, slot j) with e = ids[r] in
/// [0, num_experts):
///   g = (W_gate[e] x_t) * gs_gate[e], u = (W_up[e] x_t) * gs_up[e]   (FP32),
///   h_r = bf16(silu(g) * u)   (FP32 math, one BF16 rounding: nvfp4_mma::store_gate_up),
///   yd_r = (dot(W_down[e], h_r) * 2^26) * gs_down[e]   (FP32; the dot of code * scale * 2^-26
///          products, nvfp4_mma::mma_unit),
///   y[t, d] = fma(weights[r_{k-1}], yd_{r_{k-1}}[d], ... fma(weights[r_0], yd_{r_0}[d], 0.0f))
///          over the valid slots j = 0..top_k-1 in order (r_j = t * top_k + j; FP32 fmaf),
/// y[t, :] = 0 when no slot is valid. Each dot is summed in a fixed order that depends only on the
/// shape (moe_grouped.cu: MMA chains per 128-column group, the groups of a warp in order, the
/// warps in order): bitwise reproducible, and a token's h and y are the same bits whatever other
/// tokens share the launch and in whatever order. Ids outside [0, num_experts) contribute 0 (their
/// h_out rows are 0); duplicates within a token are two routes.
struct MoeGroupedParams {
  Nvfp4Experts gate_up;            ///< rows = 2 * I (gate rows, then up rows), cols = hidden_size
  Nvfp4Experts down;               ///< rows = hidden_size, cols = I; same num_experts as gate_up
  const int32_t* ids = nullptr;    ///< [tokens, top_k] INT32 device (the router's choice)
  const float* weights = nullptr;  ///< [tokens, top_k] FP32 device routing weights
  int64_t tokens = 0;              ///< >= 0 (0 does nothing)
  int top_k = 0;                   ///< num_experts_per_tok, >= 1
  const uint16_t* x = nullptr;     ///< [tokens, hidden] BF16 bits, 16-byte aligned
  float* y = nullptr;              ///< [tokens, hidden] FP32, overwritten with the routed sum
  /// moe_grouped_workspace_bytes(*this) bytes of device memory, 256-byte aligned: the routing
  /// tables, h [tokens * top_k, I] BF16 and the per-route down outputs [tokens * top_k, hidden]
  /// FP32. Contents need no initialisation and are scratch after the launch.
  void* workspace = nullptr;
  /// Optional [tokens, top_k, I] BF16 bits: h of every route (0 for an invalid id), for tests and
  /// debugging; nullptr in production.
  uint16_t* h_out = nullptr;
};

/// Experts the grouping kernel takes (its per-expert counters live in shared memory).
inline constexpr int kMoeGroupedMaxExperts = 4096;

/// Workspace bytes for the shape in `shape_only` (gate_up / down rows and cols, num_experts,
/// tokens, top_k; pointers ignored): O(tokens * top_k) INT32 routing tables, h (tokens * top_k * I
/// BF16) and the down outputs (tokens * top_k * hidden FP32), each 256-byte aligned: 59.0 MB at
/// the real TP=1 shape and 512 tokens. Never shrinks as tokens grow, so a workspace sized for the
/// largest batch serves every smaller one. Pure host arithmetic; throws fn::Error(Internal) on a
/// negative token count, top_k < 1 or tokens * top_k > 2^24.
size_t moe_grouped_workspace_bytes(const MoeGroupedParams& shape_only);

/// Whether launch_moe_grouped runs experts of hidden_size `hidden` and moe_intermediate_size
/// `inter` (per rank) with `top_k` slots on the current device: an sm_90+ device running sm_90+
/// device code; hidden a multiple of 256 in [256, 2560]; inter a multiple of 32 in [32, 2560]
/// (the real 640 at TP=1, 320 at TP=2, 160 at TP=4); top_k >= 1. Throws fn::Error(Cuda) when a
/// device query fails.
bool moe_grouped_supported(int64_t hidden, int64_t inter, int top_k);

/// Enqueues the grouped routed experts on `stream`: four kernels (group the routes by expert;
/// grouped gate+up + SwiGLU; grouped down; the weighted combine in slot order). Throws
/// fn::Error(Internal) on null pointers (x, y, weights, ids, workspace and the experts' arrays;
/// none needed when tokens == 0), inconsistent shapes (gate_up.rows != 2 * down.cols,
/// gate_up.cols != down.rows, different num_experts, num_experts outside [1, 4096]), a shape or
/// device moe_grouped_supported refuses, misalignment (x, packed and scales 16 bytes, workspace
/// 256), tokens * top_k > 2^24; fn::Error(Cuda) on a failed launch. Legal during stream capture.
void launch_moe_grouped(const MoeGroupedParams& params, cudaStream_t stream);

}  // namespace fn

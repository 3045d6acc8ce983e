// NVFP4 W4A16 routed-expert GEMVs for one decode token (docs/model.md §B.4, §C.7): gate+up with
// SwiGLU, and the down projection summed over the selected experts with their routing weights.
// Called by the CUDA decode step after the router. Invariants: expert ids and routing weights are
// read from device memory (graph-capturable, no host sync); software E2M1 decode (sm_90 has no FP4
// conversion); two kernel families: FP32 FMA (moe_nvfp4.cu: the down projection everywhere, the
// gate+up on devices or shapes the bulk kernel does not take) and the bulk-copy gate+up (`bulk =
// true`, sm_90+, cuda/kernels/moe_nvfp4_bulk.cu: weights streamed into shared memory by the TMA
// engine, mma.sync BF16 x BF16 with FP32 accumulation; the E2M1 x E4M3 weights are exact in BF16);
// FP32 accumulation in a fixed order per kernel; the FP32 kernels issue all of a lane's 16-byte
// weight loads before use and stage the activation once per block in shared memory (<= 48 KB);
// deterministic (no atomics).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/common/l2_prefetch.h"

namespace fn {

/// Device layout of one layer's routed experts (the loader stacks the per-expert checkpoint
/// tensors, docs/model.md §B.2, in expert order). For gate+up, rows [0, I) of an expert are
/// gate_proj and rows [I, 2I) are up_proj (TP: the rank's I rows of each). Packed codes in the
/// decode layout: the checkpoint's layout (byte j of a row holds element 2j in its low nibble, 2j+1
/// in its high nibble) with the bits of every 32-bit word (8 elements) permuted by
/// nvfp4::to_decode_layout (cuda/common/nvfp4_bits.h; nvfp4_codes_to_decode_layout does it in place
/// at load time); block scales F8_E4M3, one per 16 elements of a row, linear row-major (not
/// swizzled). Every kernel that reads these codes (decode and prefill) expects that layout.
struct Nvfp4Experts {
  const uint8_t* packed = nullptr;  ///< [num_experts, rows, cols/2] U8, 16-byte aligned
  const uint8_t* scales = nullptr;  ///< [num_experts, rows, cols/16] F8_E4M3, 2-byte aligned
  /// weight_scale_2 (FP32 multipliers): gate+up: [num_experts, 2] = (gate, up); down:
  /// [num_experts].
  const float* global_scale = nullptr;
  int num_experts = 0;  ///< experts stored (512 for the real model)
  int64_t rows = 0;     ///< rows per expert: 2 * I for gate+up, hidden_size for down
  /// input length: hidden_size for gate+up, I for down; a multiple of 16 (one block scale). A
  /// multiple of 32 (every real shape) takes the 32-codes-per-unit fast path; otherwise (e.g. the
  /// tiny fixtures' I = 16 at TP=2) a 16-code path (8-byte loads).
  int64_t cols = 0;
};

/// Gate+up with SwiGLU for the selected experts:
///   g = (W_gate[e_j] x) * gs_gate[e_j], u = (W_up[e_j] x) * gs_up[e_j],
///   h[j, i] = silu(g_i) * u_i  (FP32, rounded to BF16 on store), j < top_k, i < I.
/// An expert id outside [0, num_experts) contributes h[j, :] = 0 (no read out of bounds).
struct MoeGateUpParams {
  Nvfp4Experts experts;                 ///< rows = 2 * I, cols = hidden_size (K)
  const int32_t* expert_ids = nullptr;  ///< [top_k] device, the router's choice
  int top_k = 0;                        ///< num_experts_per_tok (10), >= 1
  const uint16_t* x = nullptr;  ///< [K] BF16 bits (the MLP-side HC read m'), 16-byte aligned
  uint16_t* h = nullptr;        ///< [top_k, I] BF16 bits
  /// Optional [top_k, 2 * I] FP32: g and u before SwiGLU (gate rows then up rows), for tests and
  /// debugging; nullptr in production.
  float* gate_up_out = nullptr;
  /// Lanes per output row pair (8..256, power of 2) of the FP32 kernel; 0 = planned.
  int team_threads = 0;
  /// true: the bulk-copy kernel (cuda/kernels/moe_nvfp4_bulk.cu; sm_90+, cols a multiple of 256
  /// and at most 2,560): one CTA per SM streams its equal share of the row pairs into shared
  /// memory with cp.async.bulk while ten warps run the tensor cores on the stages already landed;
  /// another summation order than the FP32 kernel, so other bits. team_threads is ignored. The
  /// launcher throws fn::Error(Internal) where the device or the shape does not allow it
  /// (moe_gate_up_bulk_supported); false: the FP32 kernel (older devices, other shapes).
  bool bulk = false;
  /// Tokens side by side (a batched decode step), >= 1: token b takes x + b * cols, expert_ids
  /// + b * top_k and writes h + b * top_k * I (and gate_up_out + b * top_k * 2 * I); one launch,
  /// the grid's y dimension (bulk: the tokens' routes back to back in one grid, a few launches for
  /// many tokens). Each token's values are the single-token launch's bits (bulk: those of a bulk
  /// single-token launch).
  int64_t tokens = 1;
  /// Weight ranges of later kernels of the step to prefetch into L2 while this kernel leaves HBM
  /// partly idle (cuda/common/l2_prefetch.h): each CTA issues its share, first thing in the FP32
  /// kernel, once its own loads have landed in the bulk kernel. Empty by default; changes no
  /// result.
  L2Prefetch l2_prefetch{};
  /// Bulk kernel only, when down_prefetch.packed is set: the selected experts' down weights
  /// (codes and scales of the MoeDownParams::experts of the launch after this one; the ids are
  /// known here, so only the top_k experts' 9.2 MB at TP=1) prefetched into L2, each CTA its
  /// share once its own loads have landed (before l2_prefetch). A hint: changes no result. One
  /// token only (tokens > 1 with it set: fn::Error(Internal)).
  /// Shape: rows = hidden, cols = I (a multiple of 32, rows * I / 16 a multiple of 16), the same
  /// num_experts as experts; 16-byte aligned. Otherwise the launcher throws fn::Error(Internal).
  Nvfp4Experts down_prefetch{};
};

/// Down projection summed over the selected experts:
///   y[d] (+)= sum_{j < top_k, in order} routing_weights[j] * gs[e_j] * (W_down[e_j] h[j, :])[d]
/// (docs/model.md §C.7 step 4, FP32 accumulation). Ids outside [0, num_experts) contribute 0.
struct MoeDownParams {
  Nvfp4Experts experts;                    ///< rows = hidden_size (D), cols = I
  const int32_t* expert_ids = nullptr;     ///< [top_k] device
  const float* routing_weights = nullptr;  ///< [top_k] FP32 device (renormalised top-k probs)
  int top_k = 0;                           ///< >= 1
  const uint16_t* h = nullptr;             ///< [top_k, I] BF16 bits (MoeGateUpParams::h)
  float* y = nullptr;                      ///< [D] FP32
  bool accumulate = false;                 ///< true: y += sum (e.g. onto the shared expert's y)
  /// Tokens side by side, >= 1: token b takes expert_ids and routing_weights + b * top_k, h + b
  /// * top_k * I and writes y + b * D; one launch (the grid's y dimension), each token's values
  /// the single-token launch's bits.
  int64_t tokens = 1;
  /// Lanes per output row (8..256, power of 2); 0 = planned.
  int team_threads = 0;
  /// true: the kernel runs its compile-time-shape instance at the real TP=1 shape (top_k 10,
  /// cols 640, 32-lane teams); false: always the runtime-shape instance. The same bits either
  /// way.
  bool fixed_shape = true;
};

/// Launches gate+up+SwiGLU on `stream`. Throws fn::Error(Internal) on null pointers, cols not a
/// multiple of 16, odd rows, misalignment, a bad team size or cols > 12,288 (x is staged in shared
/// memory as FP32, padded, at most 61 KB; the real hidden_size is 2,560); fn::Error(Cuda) on a
/// failed launch.
/// Legal during stream capture.
void launch_moe_gate_up_nvfp4(const MoeGateUpParams& params, cudaStream_t stream);

/// Whether MoeGateUpParams::bulk runs top_k experts of [2 * intermediate, hidden] on the current
/// device (sm_90+ device and device code; hidden a multiple of 256, at most 2,560; the shared
/// memory of the planned shares within a CTA's 227 KB). Throws fn::Error(Cuda) when a device
/// query fails.
bool moe_gate_up_bulk_supported(int top_k, int64_t intermediate, int64_t hidden);

/// Launches the weighted down projection on `stream`. Errors as launch_moe_gate_up_nvfp4, with
/// top_k * cols > 12,288 rejected (all of h is staged; the real model: 10 x 640 at TP=1).
void launch_moe_down_nvfp4(const MoeDownParams& params, cudaStream_t stream);

/// Permutes the bits of every 32-bit word of NVFP4 codes in place, from the checkpoint's layout
/// into the decode layout of Nvfp4Experts::packed (nvfp4::to_decode_layout), on `stream`.
/// packed: [bytes] U8 on the device, 4-byte aligned; bytes a multiple of 4 (any [rows, cols / 2]
/// with cols % 16 == 0). Throws fn::Error(Internal) on a null pointer, misalignment or a bad
/// size; fn::Error(Cuda) on a failed launch. Not idempotent: run it exactly once per buffer.
void nvfp4_codes_to_decode_layout(uint8_t* packed, int64_t bytes, cudaStream_t stream);

/// The planned team size (lanes per output row or row pair, 8..256) of each FP32 kernel for
/// top_k experts of [2 * intermediate, hidden] (gate+up) or [hidden, intermediate] (down) on a
/// GPU with sm_count SMs (the launchers use these when team_threads is 0; exposed for the
/// benchmark and the model-load plan log). Pure host arithmetic.
int plan_moe_gate_up_team(int top_k, int64_t intermediate, int64_t hidden, int sm_count);
int plan_moe_down_team(int top_k, int64_t intermediate, int64_t hidden, int sm_count);

}  // namespace fn

// Fused launches of the decode step's MoE block around the NVFP4 experts (docs/model.md §C.7): the
// router logits + the shared expert's gate/up GEMV + the router top-k in one launch, and the
// shared expert's SwiGLU + down GEMV + the gated combine in another. Called by the CUDA decode
// step (cuda/model/cuda_model.cpp). Invariants: the same bits as the separate launches
// launch_gemv_bf16 x 2 + launch_router_topk and launch_swiglu_rows + launch_gemv_bf16 +
// launch_moe_combine_rows for one row (shared device code: cuda/kernels/gemv_bf16.cuh,
// cuda/kernels/moe_device.cuh), deterministic (integer atomics only), graph-capturable,
// programmatic dependent launches (cuda/common/pdl.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/common/l2_prefetch.h"

namespace fn {

/// Operands of launch_router_shared_gate_up. All pointers are device memory.
struct RouterSharedGateUpParams {
  const float* x = nullptr;  ///< m: [hidden] FP32 (the HC read's output), 16-byte aligned
  int64_t hidden = 0;        ///< D: hidden_size (2560), >= 8, multiple of 8
  /// [num_experts + 1, hidden] BF16 bits row-major: the router (mlp.gate) rows, then the
  /// shared_expert_gate row; 16-byte aligned.
  const uint16_t* router_weight = nullptr;
  /// [2 * inter, hidden] BF16 bits row-major: shared_expert gate_proj rows, then up_proj rows
  /// (this rank's slice); 16-byte aligned. A separate allocation from router_weight.
  const uint16_t* gate_up_weight = nullptr;
  int64_t inter = 0;           ///< I: shared_expert_intermediate_size / tp_size (640, 320), >= 1
  int num_experts = 0;         ///< E: num_experts, 1..1024 (512 real, 8 tiny)
  int top_k = 0;               ///< num_experts_per_tok: 1..min(E, 64) (10 real, 3 tiny)
  bool norm_topk_prob = true;  ///< renormalise the selected weights (config.json)
  float* logits = nullptr;     ///< out: [num_experts + 1] FP32 router logits, then the gate logit
  float* gate_up = nullptr;    ///< out: [2 * inter] FP32 shared-expert gate rows, then up rows
  int32_t* ids = nullptr;      ///< out: [top_k] expert ids, best first
  float* weights = nullptr;    ///< out: [top_k] FP32 routing weights, same order
  int32_t* error_flag = nullptr;  ///< optional device scalar; set to 4 on NaN probabilities
  /// [num_experts] FP32 device scratch, the router blocks' mailbox to the block that runs the
  /// top-k: every slot must hold all bits set (cudaMemset 0xFF, see router_mailbox_init) before
  /// the first launch; every launch leaves it so again. One mailbox may serve every launch of a
  /// stream (they run one after another), not two launches in flight at once.
  float* mailbox = nullptr;
  /// true: the kernel's compile-time-shape instance runs for the real router (E 512, k 10): the
  /// top-k's sizes are constants; false: the runtime-shape instance. Same bits.
  bool fixed_shape = true;
};

/// logits = W_router . x, gate_up = W_gate_up . x and the router top-k of logits[0, E)
/// (docs/model.md §C.7 steps 1-2), in one launch. The two matrices are the two row segments of one
/// grid of 512-thread blocks; each segment uses the team width that plan_gemv_bf16 picks for it
/// alone, so every row has the bits of launch_gemv_bf16 (planned, x F32, y F32). Each router row
/// is also posted to params.mailbox; the last router block, after its own rows, reads every slot
/// until it is posted (no fence, atomic or arrival ticket in any block), empties it again and runs
/// the top-k device code of launch_router_topk on those logits, so ids, weights and the error flag
/// have launch_router_topk's bits. Throws fn::Error(Internal) on null pointers, misalignment or
/// sizes out of range; fn::Error(Cuda) when the launch fails. Legal during stream capture.
void launch_router_shared_gate_up(const RouterSharedGateUpParams& params, cudaStream_t stream);

/// Empties a router mailbox of `num_experts` slots (all bits set, cudaMemsetAsync on `stream`):
/// once after allocating it, before the first launch_router_shared_gate_up that uses it. Throws
/// fn::Error(Cuda) when the memset fails. Legal during stream capture.
void router_mailbox_init(float* mailbox, int num_experts, cudaStream_t stream);

/// Operands of launch_shared_down_combine. All pointers are device memory.
struct SharedDownCombineParams {
  /// [hidden, inter] BF16 bits row-major: shared_expert down_proj (this rank's columns);
  /// 16-byte aligned.
  const uint16_t* weight = nullptr;
  int64_t hidden = 0;                 ///< D (2560), >= 1
  int64_t inter = 0;                  ///< I (640, 320): 8..8192, multiple of 8
  const float* gate_up = nullptr;     ///< [2 * inter] FP32: gate rows, then up rows (from above)
  const float* gate_logit = nullptr;  ///< device scalar: shared_expert_gate . m (logits + E)
  float* y = nullptr;  ///< [hidden] FP32: in the routed sum, out routed + gated shared expert
  /// Weight ranges of later kernels to prefetch into L2 (cuda/common/l2_prefetch.h): thread 0 of
  /// each block issues its part once the block's rows are done, before the programmatic wait. Empty
  /// by default; changes no result.
  L2Prefetch l2_prefetch{};
};

/// y[d] = fmaf(sigmoid(*gate_logit), ys[d], y[d]) with ys = W_down . h and
/// h[i] = bf16(silu(g[i]) * u[i]), g = gate_up[0, I), u = gate_up[I, 2I) (docs/model.md §C.7 steps
/// 2-4) in one launch: each block computes h into shared memory (dev::swiglu_bf16_bits, as
/// launch_swiglu_rows), the rows are launch_gemv_bf16's device code with its planned team width
/// (x BF16), and the epilogue is dev::sigmoid_2branch's fmaf (as launch_moe_combine_rows), so y
/// has the bits of launch_swiglu_rows + launch_gemv_bf16 + launch_moe_combine_rows for one row.
/// Runs after the kernel that writes the routed sum into y; gate_up and gate_logit must come from a
/// kernel at least two launches earlier on the stream (as in the decode step: the routed experts'
/// two launches sit in between), because the SwiGLU and the whole GEMV run before the
/// programmatic-dependent wait (cuda/common/pdl.cuh); only the combine waits for y. Throws
/// fn::Error(Internal) on null pointers, misalignment or sizes out of range; fn::Error(Cuda) when
/// the launch fails. Legal during stream capture.
void launch_shared_down_combine(const SharedDownCombineParams& params, cudaStream_t stream);

}  // namespace fn

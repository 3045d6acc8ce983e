// End-of-step bookkeeping of the CUDA decode graph (cuda/model/cuda_model.cpp): advancing the
// device position (and the sampling step) after every op of the step has read it, so replays of one
// captured graph walk through the sequence without host involvement.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn {

/// *position += 1; *sample_step += 1 when sample_step is not null. One thread.
struct StepAdvanceParams {
  int64_t* position = nullptr;     ///< device: the position of the token just processed
  int64_t* sample_step = nullptr;  ///< device: the sampler's step counter, or nullptr
};

/// Enqueues the advance on `stream`. Throws fn::Error(Internal) on a null position,
/// fn::Error(Cuda) when the launch fails.
void launch_step_advance(const StepAdvanceParams& params, cudaStream_t stream);

/// Tests only: replaces the router's choice with a reference's expert ids and recomputes their
/// weights from this engine's logits exactly as route_top_k does (p = softmax over all experts,
/// w = p_sel / sum p_sel when norm_topk_prob). One CTA.
struct RouterForceParams {
  const float* logits = nullptr;  ///< [num_experts] FP32 router logits
  int num_experts = 0;            ///< >= 1
  int top_k = 0;                  ///< 1..num_experts
  bool norm_topk_prob = true;
  const int32_t* forced_ids = nullptr;  ///< [top_k] device, ids in [0, num_experts)
  int32_t* ids = nullptr;               ///< [top_k] device (overwritten)
  float* weights = nullptr;             ///< [top_k] device (overwritten)
};

/// Enqueues the replacement. Throws fn::Error(Internal) on bad parameters.
void launch_router_force(const RouterForceParams& params, cudaStream_t stream);

}  // namespace fn

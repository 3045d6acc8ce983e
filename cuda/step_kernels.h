// End-of-step bookkeeping of the CUDA decode graph (cuda/cuda_model.cpp): advancing the device
// position (and the sampling step) after every op of the step has read it, so replays of one
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

}  // namespace fn

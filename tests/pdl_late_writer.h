// A test kernel that lets the next programmatic dependent launch start at once and only then, a
// while later, overwrites the routed experts' ids and weights: the race that
// MoeDownParams::ids_recheck must survive (tests/test_cuda_moe_nvfp4.cpp). Host C++ only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn::test {

/// Enqueues one 64-thread CTA on `stream` as a programmatic dependent launch (cuda/pdl.h): it
/// waits for its own predecessor, lets its dependent start, spins for about `delay_us`
/// microseconds (globaltimer), then copies k <= 64 ids and weights from src to dst (device
/// pointers). Throws fn::Error(Cuda) when the launch fails.
void launch_late_ids_writer(int32_t* ids, const int32_t* new_ids, float* weights,
                            const float* new_weights, int k, int delay_us, cudaStream_t stream);

}  // namespace fn::test

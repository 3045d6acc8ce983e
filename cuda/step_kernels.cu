// Step bookkeeping kernels (see step_kernels.h).
#include "comm/cuda_check.h"
#include "cuda/launch_check.h"
#include "cuda/step_kernels.h"

namespace fn {

namespace {
__global__ void step_advance_kernel(int64_t* position, int64_t* sample_step) {
  *position += 1;
  if (sample_step) *sample_step += 1;
}
}  // namespace

void launch_step_advance(const StepAdvanceParams& p, cudaStream_t stream) {
  FN_LAUNCH_REQUIRE(p.position != nullptr, "launch_step_advance");
  step_advance_kernel<<<1, 1, 0, stream>>>(p.position, p.sample_step);
  FN_CUDA_LAUNCH_CHECK("step_advance_kernel");
}

}  // namespace fn

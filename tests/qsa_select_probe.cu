// Kernels of tests/qsa_select_probe.h: each runs one of the QSA block selects of
// cuda/kernels/qsa_device.cuh as the decode and prefill kernels do (one 1024-thread CTA).
#include <cuda_runtime.h>

#include "cuda/common/cuda_check.h"
#include "cuda/kernels/qsa_device.cuh"
#include "tests/qsa_select_probe.h"

namespace fn::test {
namespace {

__global__ void __launch_bounds__(qsa_dev::kQsaSelectThreads, 1)
    select_reference_kernel(const float* scores, int B, int k, int32_t* selected) {
  qsa_dev::select_top_blocks(scores, B, k, selected);
}

__global__ void __launch_bounds__(qsa_dev::kQsaSelectThreads, 1)
    select_cg_kernel(const float* scores, int B, int k, int32_t* selected) {
  __shared__ __align__(16) uint32_t keys[qsa_dev::kQsaSelectCache];
  // The scores as a mailbox whose slots are all posted (no test score has the empty bits).
  qsa_dev::select_top_blocks_cg(scores, B, k, selected, keys);
}

}  // namespace

void qsa_select_blocks(bool reference, const float* scores, int B, int k, int32_t* selected,
                       cudaStream_t stream) {
  if (reference) {
    select_reference_kernel<<<1, qsa_dev::kQsaSelectThreads, 0, stream>>>(scores, B, k, selected);
    FN_CUDA_LAUNCH_CHECK("select_reference_kernel");
  } else {
    select_cg_kernel<<<1, qsa_dev::kQsaSelectThreads, 0, stream>>>(scores, B, k, selected);
    FN_CUDA_LAUNCH_CHECK("select_cg_kernel");
  }
}

}  // namespace fn::test

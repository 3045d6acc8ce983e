// See pdl_late_writer.h.
#include "tests/pdl_late_writer.h"

#include <cuda_runtime.h>

#include "comm/cuda_check.h"
#include "cuda/pdl.cuh"

namespace fn::test {
namespace {

__global__ void late_ids_writer_kernel(int32_t* ids, const int32_t* new_ids, float* weights,
                                       const float* new_weights, int k, int delay_us) {
  fn::dev::pdl_begin();
  uint64_t t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < static_cast<uint64_t>(delay_us) * 1000u);
  if (static_cast<int>(threadIdx.x) < k) {
    ids[threadIdx.x] = new_ids[threadIdx.x];
    weights[threadIdx.x] = new_weights[threadIdx.x];
  }
}

}  // namespace

void launch_late_ids_writer(int32_t* ids, const int32_t* new_ids, float* weights,
                            const float* new_weights, int k, int delay_us, cudaStream_t stream) {
  fn::launch_pdl("late_ids_writer_kernel", late_ids_writer_kernel, 1, 64, 0, stream, ids, new_ids,
                 weights, new_weights, k, delay_us);
  FN_CUDA_LAUNCH_CHECK("late_ids_writer_kernel");
}

}  // namespace fn::test

// Step bookkeeping kernels (see step_kernels.h).
#include "cuda/common/cuda_check.h"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/kernels/step_kernels.h"

namespace fn {

namespace {
__global__ void step_advance_kernel(int64_t* position, int64_t* sample_step) {
  dev::pdl_begin();  // the step's kernels read position before (cuda/common/pdl.cuh)
  *position += 1;
  if (sample_step) *sample_step += 1;
}
__global__ void router_force_kernel(RouterForceParams p) {
  dev::pdl_begin();  // logits and ids come from the previous kernels (cuda/common/pdl.cuh)
  if (threadIdx.x != 0) return;  // a test-only path: plain sequential sums in a fixed order
  float mx = -INFINITY;
  for (int e = 0; e < p.num_experts; ++e) mx = fmaxf(mx, p.logits[e]);
  double all = 0;
  for (int e = 0; e < p.num_experts; ++e) all += expf(p.logits[e] - mx);
  double sel = 0;
  for (int i = 0; i < p.top_k; ++i) sel += expf(p.logits[p.forced_ids[i]] - mx) / all;
  for (int i = 0; i < p.top_k; ++i) {
    const int32_t e = p.forced_ids[i];
    const double pe = expf(p.logits[e] - mx) / all;
    p.ids[i] = e;
    p.weights[i] = static_cast<float>(p.norm_topk_prob ? pe / sel : pe);
  }
}

}  // namespace

void launch_router_force(const RouterForceParams& p, cudaStream_t stream) {
  constexpr const char* op = "launch_router_force";
  FN_LAUNCH_REQUIRE(p.logits && p.forced_ids && p.ids && p.weights, op);
  FN_LAUNCH_REQUIRE(p.num_experts >= 1 && p.top_k >= 1 && p.top_k <= p.num_experts, op);
  launch_pdl("router_force_kernel", router_force_kernel, 1, 32, 0, stream, p);
  FN_CUDA_LAUNCH_CHECK("router_force_kernel");
}

void launch_step_advance(const StepAdvanceParams& p, cudaStream_t stream) {
  FN_LAUNCH_REQUIRE(p.position != nullptr, "launch_step_advance");
  launch_pdl("step_advance_kernel", step_advance_kernel, 1, 1, 0, stream, p.position,
             p.sample_step);
  FN_CUDA_LAUNCH_CHECK("step_advance_kernel");
}

}  // namespace fn

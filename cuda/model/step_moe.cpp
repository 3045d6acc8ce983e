// The MoE block of the decode step (CudaModel::Impl::step_moe; see step.cpp), four launches:
// the router + shared-expert gate/up rows + top-k, the routed NVFP4 gate+up (which prefetches
// into L2 the weights of the launches after it), the routed down, and the shared expert's SwiGLU +
// down + gated combine (which prefetches the next layer's input projection). y holds the block
// output (before the all-reduce).
#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "cuda/kernels/moe_nvfp4.h"
#include "cuda/kernels/moe_shared.h"
#include "cuda/kernels/step_kernels.h"
#include "cuda/model/cuda_model_impl.h"

namespace fn {

using namespace model_detail;

namespace {

// Bytes of the next layer's input projection (its first rows) that the shared expert's down
// launch prefetches into L2 for the bandwidth-bound GEMV after the next HC read (8 MB measured
// best at TP=1; docs/perf-history.md).
constexpr uint64_t kInProjPrefetchBytes = uint64_t{8} << 20;

}  // namespace

void CudaModel::Impl::step_moe(Step& st, const DevMoe& mo, int64_t layer_index,
                               const DevHc& next_hc, const DevLayer* next) {
  const ModelConfig& c = st.c;
  const int64_t D = c.hidden_size, W = c.hc_width(), E = c.num_experts;
  const int64_t k = c.num_experts_per_tok, Is_l = st.rd.shared_inter;
  mark(StepFamily::Router);
  RouterSharedGateUpParams rs;
  rs.x = m;
  rs.hidden = D;
  rs.router_weight = mo.router;
  rs.gate_up_weight = mo.s_gate_up;
  rs.inter = Is_l;
  rs.num_experts = static_cast<int>(E);
  rs.top_k = static_cast<int>(k);
  rs.norm_topk_prob = c.norm_topk_prob;
  rs.logits = rl;
  rs.gate_up = sgu;
  rs.ids = ids;
  rs.weights = rw;
  rs.error_flag = error_flag;
  rs.mailbox = router_mailbox;
  rs.fixed_shape = plan.router_fixed;
  launch_router_shared_gate_up(rs, stream);
  if (forced_router) {
    RouterForceParams rf;
    rf.logits = rl;
    rf.num_experts = static_cast<int>(E);
    rf.top_k = static_cast<int>(k);
    rf.norm_topk_prob = c.norm_topk_prob;
    rf.forced_ids = forced_router + layer_index * k;
    rf.ids = ids;
    rf.weights = rw;
    launch_router_force(rf, stream);
  }
  if (choice_log)
    FN_CUDA_CHECK(cudaMemcpyAsync(choice_log + layer_index * k, ids, sizeof(int32_t) * k,
                                  cudaMemcpyDeviceToDevice, stream));

  mark(StepFamily::RoutedMoe);
  MoeGateUpParams gu;
  gu.experts = mo.gate_up;
  gu.expert_ids = ids;
  gu.top_k = static_cast<int>(k);
  gu.x = m_bf16;  // W4A16: the experts take m rounded to BF16 (docs/design.md numerics)
  gu.h = h;
  gu.bulk = plan.moe_gate_up_bulk;
  // The next HC read's weights (W_dn with the inject rows, the norm, W_up) into L2, each CTA once
  // its own loads have landed; with the bulk kernel first the selected experts' down weights.
  gu.l2_prefetch.add(next_hc.down_inj,
                     static_cast<uint64_t>(next_hc.down_rows) * W * sizeof(uint16_t));
  gu.l2_prefetch.add(next_hc.norm, static_cast<uint64_t>(W) * sizeof(uint16_t));
  gu.l2_prefetch.add(next_hc.up, static_cast<uint64_t>(W) * c.hc_lowrank * sizeof(uint16_t));
  if (plan.moe_gate_up_bulk) gu.down_prefetch = mo.down;
  launch_moe_gate_up_nvfp4(gu, stream);
  MoeDownParams dn;
  dn.experts = mo.down;
  dn.expert_ids = ids;
  dn.routing_weights = rw;
  dn.top_k = static_cast<int>(k);
  dn.h = h;
  dn.y = y;
  dn.fixed_shape = plan.moe_down_fixed;
  launch_moe_down_nvfp4(dn, stream);

  mark(StepFamily::SharedExpert);
  SharedDownCombineParams sd;
  sd.weight = mo.s_down;
  sd.hidden = D;
  sd.inter = Is_l;
  sd.gate_up = sgu;
  sd.gate_logit = rl + E;
  sd.y = y;
  if (next != nullptr) {
    const uint16_t* w = next->qsa ? next->attn.in_proj : next->gdn.in_proj;
    const int64_t rows = next->qsa ? next->attn.in_rows : next->gdn.in_rows;
    const uint64_t bytes = std::min<uint64_t>(static_cast<uint64_t>(rows) * D * sizeof(uint16_t),
                                              kInProjPrefetchBytes);
    sd.l2_prefetch.add(w, bytes / 16 * 16);
  }
  launch_shared_down_combine(sd, stream);
}

}  // namespace fn

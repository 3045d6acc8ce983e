// The mixers of the decode step (CudaModel::Impl::step_qsa, step_gdn; see step.cpp): each runs
// its stacked input projection inside its own launcher, overlapped with the mixer kernels, and
// leaves the block output in y (before the all-reduce).
#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "cuda/kernels/gdn.h"
#include "cuda/kernels/gemv_bf16.h"
#include "cuda/kernels/qsa.h"
#include "cuda/model/cuda_model_impl.h"

namespace fn {

using namespace model_detail;

void CudaModel::Impl::step_qsa(Step& st, const DevQsa& a, int64_t qsa_index) {
  const ModelConfig& c = st.c;
  const int64_t D = c.hidden_size;
  const int64_t topk = c.indexer_budget / c.indexer_compress_ratio;
  mark(StepFamily::QsaMixer);
  // The projection runs inside the QSA launcher: the indexer's rows first, the query and KV rows
  // beside the block select (QsaDecodeParams::in_proj).
  QsaDecodeParams q = qsa_layer(c, st.o, a);
  q.proj = proj;
  q.in_proj = a.in_proj;
  q.x = m;
  q.hidden = D;
  q.position = position;
  q.workspace = a.workspace;
  q.out = mix_out;
  if (forced_blocks) q.forced_blocks = forced_blocks + qsa_index * topk;
  launch_qsa_decode(q, stream);
  if (choice_log) {  // the selected blocks, then the counters {count, B, tokens, 0}
    const QsaWorkspaceLayout wl = qsa_workspace_layout(q);
    const int64_t n_sel = std::min(topk, st.o.ctx_size / c.indexer_compress_ratio);
    int32_t* log =
        choice_log + c.num_hidden_layers * c.num_experts_per_tok + qsa_index * (topk + 4);
    const auto* ws = static_cast<const std::byte*>(a.workspace);
    if (n_sel > 0)
      FN_CUDA_CHECK(cudaMemcpyAsync(log, ws + wl.selected, sizeof(int32_t) * n_sel,
                                    cudaMemcpyDeviceToDevice, stream));
    FN_CUDA_CHECK(cudaMemcpyAsync(log + topk, ws + wl.counters, sizeof(int32_t) * 4,
                                  cudaMemcpyDeviceToDevice, stream));
  }
  launch_gemv_bf16(a.o, D, st.rd.q_heads * c.head_dim, mix_out, DType::BF16, y, DType::F32, stream);
}

void CudaModel::Impl::step_gdn(Step& st, const DevGdn& g) {
  const ModelConfig& c = st.c;
  mark(StepFamily::GdnMixer);
  GdnDecodeParams gp;
  set_gdn_layer(gp, c, st.rd, g);
  gp.proj = proj;
  gp.out = mix_out;
  gp.o_scratch = g.o_scratch;
  gp.head_counters = g.counters;
  gp.fixed_shape = plan.gdn_fixed;
  gp.cluster = plan.gdn_cluster;
  // The projections inside the GDN launcher: the rows but z, then z beside the recurrence,
  // out_proj after both (GdnDecodeParams::in_proj).
  gp.in_proj = g.in_proj;
  gp.x = m;
  gp.hidden = c.hidden_size;
  gp.out_weight = g.out;
  gp.y = y;
  gp.join = g.counters + st.rd.linear_v_heads + st.rd.linear_k_heads;
  launch_gdn_decode(gp, stream);
}

}  // namespace fn

// The decode step of docs/model.md §C.10 as a chain of cuda/ launches
// (CudaModel::Impl::encode_step): the driver over the per-block encoders, and the blocks around the
// mixers — embedding, PLE, the HC read and inject, lm_head with sampling. The mixers are in
// step_mixers.cpp, the MoE block in step_moe.cpp. Which variant of each kernel runs is the
// load-time KernelPlan (kernel_plan.h).
//
// Per token (one graph): embed -> for each layer { [PLE: n-gram gather, all-reduce, key/value
// GEMV, apply] ; HC read ; GDN or QSA (projections, mixer kernels, output GEMV) ; all-reduce ;
// HC inject ; HC read ; MoE (router + shared gate/up + top-k, NVFP4 gate-up, down, shared down +
// combine) ; all-reduce ; HC inject } -> final mixer -> lm_head (vocab slice) -> scatter +
// all-reduce (= all-gather) -> [sample -> next token id [-> its top log-probs]] -> n-gram context
// and position advance.
//
// With the n-gram table in pinned host memory (--ngram-table host), the gather reads its 16 rows
// (2.5 KiB at the real geometry) over PCIe / C2C: a round trip of a few microseconds that no other
// work of the step needs. Its inputs are final when the step starts: the token id is the last
// thing the step before wrote (its sample, or the host's copy), and the n-gram context was
// advanced before that sample. So the step forks a side stream at its start (step_ngram_fork):
// there the gather runs beside the embedding and the whole first decoder layer (HC reads, mixer,
// MoE: tens of microseconds at the real geometry), and the PLE layer (the second one of the real
// model, ple_layer_ids [2]; the first PLE layer in general) joins it before its all-reduce or GEMV.
// The device-resident table keeps its gather inside the PLE layer, where its device-memory read
// costs less than an extra graph branch. The join's kernel waits (pdl_wait) for every predecessor,
// the gather included, before it reads the gathered rows (cuda/common/pdl.cuh's contract).
#include "comm/device_all_reduce.h"
#include "cuda/common/cuda_check.h"
#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/gemv_bf16.h"
#include "cuda/kernels/hc.h"
#include "cuda/kernels/logit_stats.h"
#include "cuda/kernels/ple.h"
#include "cuda/kernels/sample.h"
#include "cuda/kernels/step_kernels.h"
#include "cuda/model/cuda_model_impl.h"

namespace fn {

using namespace model_detail;

void CudaModel::Impl::encode_step(const ModelConfig& c, const CudaModelOptions& o,
                                  const DeviceSamplingParams* sampling, int64_t top_logprobs) {
  Step st{c, o, rank_dims(c, o.tp_size, o.tp_rank)};
  st.H = H;
  step_ngram_fork(st);
  step_embed(st);
  int64_t qsa_index = 0;
  for (std::size_t li = 0; li < layers.size(); ++li) {
    const DevLayer& L = layers[li];
    const DevLayer* next = li + 1 < layers.size() ? &layers[li + 1] : nullptr;
    if (L.has_ple) step_ple(st, L.ple);
    step_hc_read(st, L.attn_hc, iota, nullptr);
    if (L.qsa) {
      step_qsa(st, L.attn, qsa_index++);
    } else {
      step_gdn(st, L.gdn);
    }
    step_all_reduce(st, y, c.hidden_size);
    step_inject(st);
    step_hc_read(st, L.mlp_hc, iota, m_bf16);
    step_moe(st, L.moe, static_cast<int64_t>(li), next ? next->attn_hc : final_hc, next);
    step_all_reduce(st, y, c.hidden_size);
    step_inject(st);
  }
  step_hc_read(st, final_hc, nullptr, nullptr);
  step_logits(st, sampling, top_logprobs);
  mark_end();
}

void CudaModel::Impl::step_all_reduce(Step& st, float* buf, int64_t count) {
  if (st.o.tp_size == 1) return;
  mark(StepFamily::AllReduce);
  st.o.all_reduce->all_reduce_sum(buf, buf, static_cast<std::size_t>(count), DType::F32, stream);
}

void CudaModel::Impl::step_keep_residual(Step& st, int64_t slot) {
  if (residuals == nullptr) return;
  const int64_t W = st.c.hc_width();
  FN_CUDA_CHECK(cudaMemcpyAsync(residuals + slot * W, st.H, sizeof(float) * W,
                                cudaMemcpyDeviceToDevice, stream));
}

void CudaModel::Impl::step_embed(Step& st) {
  mark(StepFamily::Other);
  EmbedParams ep;
  ep.table = embed;
  ep.vocab = st.c.vocab_size;
  ep.hidden = st.c.hidden_size;
  ep.token = token;
  ep.H = st.H;
  ep.hc_count = static_cast<int>(st.c.hc_count);
  ep.error_flag = error_flag;
  launch_embed(ep, stream);
}

void CudaModel::Impl::step_ngram_fork(Step& st) {
  if (ngram_stream == nullptr) return;
  FN_CUDA_CHECK(cudaEventRecord(ngram_fork, stream));
  FN_CUDA_CHECK(cudaStreamWaitEvent(ngram_stream, ngram_fork, 0));
  for (const DevLayer& L : layers) {
    if (!L.has_ple || !L.ple.on_host) continue;
    NgramGatherParams ng = ngram_gather_params(st.c, L.ple);
    ng.token = token;
    ng.context = context;
    ng.out = L.ple.staged;
    launch_ngram_gather(ng, ngram_stream);
  }
  FN_CUDA_CHECK(cudaEventRecord(ngram_join, ngram_stream));
  st.ngram_joined = false;
}

void CudaModel::Impl::step_ple(Step& st, const DevPle& pl) {
  const ModelConfig& c = st.c;
  step_settle(st);  // the residual the PLE adds to must hold the last block's inject
  mark(StepFamily::Ple);
  float* e = e_ng;
  if (pl.on_host) {  // gathered at the step's start (step_ngram_fork)
    if (!st.ngram_joined) FN_CUDA_CHECK(cudaStreamWaitEvent(stream, ngram_join, 0));
    st.ngram_joined = true;
    e = pl.staged;
  } else {
    NgramGatherParams ng = ngram_gather_params(c, pl);
    ng.token = token;
    ng.context = context;
    ng.out = e_ng;
    launch_ngram_gather(ng, stream);
  }
  step_all_reduce(st, e, c.ple_embed_dim);
  mark(StepFamily::Ple);
  launch_gemv_bf16(pl.kv_proj, c.hc_count * c.ple_embed_dim + c.hidden_size, c.ple_embed_dim, e,
                   DType::F32, kvp, DType::F32, stream);
  PleApplyParams pa = ple_apply_params(c, pl);
  pa.kv = kvp;
  pa.H = st.H;
  launch_ple_apply(pa, stream);
  step_keep_residual(st, st.injects++);
}

void CudaModel::Impl::step_hc_read(Step& st, const DevHc& hc, float* iota_out,
                                   uint16_t* m_out_bf16) {
  const ModelConfig& c = st.c;
  const int64_t D = c.hidden_size, S = c.hc_count;
  mark(StepFamily::Hc);
  HcDownParams down;
  down.H = st.H;
  down.norm = hc.norm;
  down.weight = hc.down_inj;
  down.rows = hc.down_rows;
  down.hc_count = static_cast<int>(S);
  down.hidden = D;
  down.t_partial = t;
  down.sumsq = sumsq;
  if (st.pending) {  // the last block's inject, folded into this pass
    down.inject_iota = iota;
    down.inject_y = y;
    down.H_out = st.H == H ? H_alt : H;
  }
  down.fixed_shape = plan.hc_down_fixed;
  launch_hc_down(down, stream);
  if (st.pending) {
    st.H = down.H_out;
    st.pending = false;
    step_keep_residual(st, st.pending_slot);
  }
  HcMixParams mx;
  mx.w_up = hc.up;
  mx.t = t;
  mx.sumsq = sumsq;
  mx.t_splits = hc_down_splits(S, D);
  mx.t_stride = hc.down_rows;
  mx.H = st.H;
  mx.norm = hc.norm;
  mx.eps = static_cast<float>(c.rms_norm_eps);
  mx.m = m;
  mx.m_bf16 = m_out_bf16;
  mx.iota = iota_out;
  mx.hc_count = static_cast<int>(S);
  mx.hidden = D;
  mx.rank = c.hc_lowrank;
  mx.fixed_shape = plan.hc_mix_fixed;
  launch_hc_mix(mx, stream);
}

void CudaModel::Impl::step_inject(Step& st) {
  st.pending = true;
  st.pending_slot = st.injects++;
  if (!plan.fold_hc_inject) step_settle(st);
}

void CudaModel::Impl::step_settle(Step& st) {
  if (!st.pending) return;
  mark(StepFamily::Hc);
  HcInjectParams hi;
  hi.H = st.H;
  hi.iota = iota;
  hi.y = y;
  hi.hc_count = static_cast<int>(st.c.hc_count);
  hi.hidden = st.c.hidden_size;
  launch_hc_inject(hi, stream);
  st.pending = false;
  step_keep_residual(st, st.pending_slot);
}

void CudaModel::Impl::step_logits(Step& st, const DeviceSamplingParams* sampling,
                                  int64_t top_logprobs) {
  const ModelConfig& c = st.c;
  const int64_t D = c.hidden_size, V = c.vocab_size;
  mark(StepFamily::LmHead);
  if (st.o.tp_size > 1) {
    launch_gemv_bf16(lm_head, v_local, D, m, DType::F32, logits_local, DType::F32, stream);
    ScatterLogitsParams sc;
    sc.local = logits_local;
    sc.full = logits;
    sc.v_local = v_local;
    sc.v_first = v_first;
    sc.vocab = V;
    launch_scatter_logits(sc, stream);
    step_all_reduce(st, logits, V);
    mark(StepFamily::LmHead);
  } else {
    launch_gemv_bf16(lm_head, V, D, m, DType::F32, logits, DType::F32, stream);
  }
  if (c.has_ple()) {
    NgramContextAdvanceParams ca;
    ca.context = context;
    ca.ngram_size = static_cast<int>(c.ngram_size);
    ca.token = token;
    launch_ngram_context_advance(ca, stream);
  }
  if (sampling) {
    SampleParams sp;
    sp.logits = logits;
    sp.vocab = V;
    sp.sampling = *sampling;
    sp.step = sample_step;
    sp.token_out = token;
    sp.history = history;
    sp.history_capacity = history_capacity;
    sp.workspace = sample_ws;
    sp.workspace_bytes = sample_ws_bytes;
    sp.error_flag = error_flag;
    launch_sample(sp, stream);
    if (top_logprobs >= 0) {
      TopLogprobsParams tp;
      tp.logits = logits;
      tp.vocab = V;
      tp.chosen = token;
      tp.k = top_logprobs;
      tp.workspace = top_lp_ws;
      tp.workspace_bytes = top_lp_ws_bytes;
      tp.out = top_lp;
      launch_top_logprobs(tp, stream);
    }
  }
  StepAdvanceParams adv;
  adv.position = position;
  adv.sample_step = sampling ? sample_step : nullptr;
  launch_step_advance(adv, stream);
}

}  // namespace fn

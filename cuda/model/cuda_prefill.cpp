// CudaModel::prefill (see cuda_model.h): the batched prefill (docs/model.md §D). One pass
// runs M prompt tokens through every layer at once, in the order of the decode step (§C.10):
//
//   embed rows -> for each layer { [PLE: n-gram gather rows, all-reduce, key/value GEMM, apply
//   rows] ; HC read rows (norm, down/inject GEMM, act, up GEMM, mix) ; GDN (in GEMM, scan, out
//   GEMM) or QSA (in GEMM, prefill with each row's own selection, o GEMM) ; all-reduce ; inject ;
//   HC read rows ; router GEMM + top-k rows ; routed experts grouped by expert ; shared expert
//   GEMMs ; combine ; all-reduce ; inject } -> final mixer + lm_head on the rows whose logits are
//   wanted -> n-gram context and position advance.
//
// Dense projections go through cuBLAS. The block input m and the n-gram embedding enter as BF16
// hi + lo pairs (cuda/kernels/gemm.h), the decode GEMVs' FP32-activation numerics up to summation
// order; a prompt pass's HC read gives N and u as BF16 (docs/numerics.md "The batched prefill": the
// KL against the reference is unchanged without their lo halves, not without m's). A batched
// decode step (decode_rows) of fewer than kHcGemmRows rows runs its HC reads through the decode
// step's launch_hc_down + launch_hc_mix (cuda/kernels/hc.h) with the rows as their tokens
// instead (bitwise the decode step's read per row), and its routed experts through the decode
// kernels per row; from kMoeGroupedFromRows rows on, the routed experts go through
// launch_moe_grouped (cuda/kernels/moe_grouped.h: each selected expert read once per step). The
// pass buffers live in their own arena, allocated on the first call for
// CudaModelOptions::prefill_chunk rows.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/device_all_reduce.h"
#include "core/error.h"
#include "core/flops.h"
#include "core/log.h"
#include "core/shard_plan.h"
#include "cuda/common/cuda_check.h"
#include "cuda/kernels/decode_ops.h"
#include "cuda/kernels/gdn.h"
#include "cuda/kernels/gdn_prefill.h"
#include "cuda/kernels/gemm.h"
#include "cuda/kernels/hc.h"
#include "cuda/kernels/logit_stats.h"
#include "cuda/kernels/moe_grouped.h"
#include "cuda/kernels/moe_prefill.h"
#include "cuda/kernels/ple.h"
#include "cuda/kernels/prefill_ops.h"
#include "cuda/kernels/qsa.h"
#include "cuda/kernels/qsa_prefill.h"
#include "cuda/kernels/sample.h"
#include "cuda/model/cuda_model.h"
#include "cuda/model/cuda_model_impl.h"

namespace fn {

using model_detail::Carver;
using model_detail::DevHc;
using model_detail::DevLayer;

namespace {
// Final-mixer + lm_head rows per launch group (bounds the [rows, vocab] logit buffers).
constexpr int64_t kLogitRows = 32;
// Rows per HC read launch pair of a batched step (launch_hc_down + launch_hc_mix with `tokens`
// rows; bounds their partial-dot scratch): the most slots a step has unless --max-batch asks
// for more, which then takes a pair per 64 rows.
constexpr int64_t kHcReadRows = 64;
// A batched step of at least this many rows reads HC through the prompt pass's GEMMs (weights
// read once for all rows on the tensor cores); fewer rows through the decode step's two HC kernels
// (each row's FP32 dots on the CUDA cores, cost growing with the rows). Measured on one H100
// (docs/perf-history.md): the kernels faster at 2 and 4 rows, the GEMMs at 8 and 16; 6 lies
// between the measured points (not measured itself).
constexpr int64_t kHcGemmRows = 6;
// Rows per block of those two kernels below kHcGemmRows (HcDownParams::tokens_per_block): a read
// of 4 rows runs two copies of the grid, each looping over 2 rows. Measured on one H100
// (docs/perf-history.md): 2 rows per block 19.2 against 21.4 µs per read at 4 rows.
constexpr int kHcTokensPerBlock = 2;
// A batched step of at least this many rows runs its routed experts grouped by expert
// (launch_moe_grouped: each selected expert read once per step); fewer rows through the decode
// kernels per row (their PDL launches cost less than the grouped path's four plain launches
// where few routes share an expert). Measured on one H100 (docs/perf-history.md): equal at 8 rows
// in the step, 10 % faster at 16.
constexpr int64_t kMoeGroupedFromRows = 8;
// Rows per launch_moe_grouped of a batched step (bounds its workspace); more rows take more
// launches, with the same bits per row (each row's results are independent of the others').
constexpr int64_t kMoeGroupedRows = 64;
}  // namespace

// The pass buffers of the batched prefill (cuda_model_impl.h declares it).
struct CudaPrefillState {
  model_detail::DeviceArena arena;
  std::unique_ptr<CublasHandle> blas;
  int64_t rows = 0;     // tokens per pass (capacity)
  int64_t proj_ld = 0;  // floats per row of proj
  int64_t mix_ld = 0;   // BF16 values per row of mix
  int32_t* tokens = nullptr;
  float* H = nullptr;      // [rows, W] FP32 residual rows
  float* scale = nullptr;  // [rows, S] HC norm scales
  // The BF16 GEMM inputs (gemm.h). m and e are hi + lo pairs: a call's m rows of hi, then its m
  // rows of lo right below them (gemm_rows' stacked form), so their buffers hold 2 * rows rows; N
  // and u have lo rows only for a batched step of up to kGemmStackMaxRows rows (hc_read).
  uint16_t* n_hi = nullptr;  // [rows + min(rows, kGemmStackMaxRows), W] N as BF16 (hi, lo)
  float* t = nullptr;        // [rows, R + S] HC down/inject GEMM
  uint16_t* u_hi = nullptr;  // [rows + min(rows, kGemmStackMaxRows), R] u as BF16 (hi, lo)
  float* g = nullptr;        // [rows, W] HC up GEMM (pre-sigmoid); a batched step: m [rows, D]
  uint16_t* m_hi = nullptr;  // [2 * rows, D] block input hi (= the experts' BF16 input), lo
  float* iota = nullptr;     // [rows, S]
  // A batched step's HC read (hc.h) over hc_rows rows at a time: the down pass's partial dots
  // and partial squares, [hc_rows, hc_down_splits(S, D), R + S] and [hc_rows, splits] FP32.
  int64_t hc_rows = 0;
  float* hc_tp = nullptr;
  float* hc_sumsq = nullptr;
  float* proj = nullptr;     // [rows, proj_ld] mixer / shared-expert / PLE projections
  uint16_t* mix = nullptr;   // [rows, mix_ld] BF16 mixer outputs
  float* y = nullptr;        // [rows, D]
  float* ys = nullptr;       // [rows, D] shared expert
  float* rl = nullptr;       // [rows, E + 1] router logits + shared gate logit
  int32_t* ids = nullptr;    // [rows, k]
  float* rw = nullptr;       // [rows, k]
  uint16_t* sh = nullptr;    // [rows, Is] shared expert hidden
  float* e_ng = nullptr;     // [rows, P] n-gram embeddings
  uint16_t* e_hi = nullptr;  // [2 * rows, P]
  float* ple_scratch = nullptr;
  void* gdn_ws = nullptr;
  void* qsa_ws = nullptr;
  void* moe_ws = nullptr;
  // sample_batch(): each row's RNG step and sampled id, and the sampler's workspace (allocated
  // at its first call).
  int64_t* sample_steps = nullptr;  // [rows]
  int32_t* sample_ids = nullptr;    // [rows]
  // The batched step: each row's position (device, read by the QSA decode kernels) and its host
  // source, alive until the pass's end synchronises the stream.
  int64_t* row_pos = nullptr;  // [rows]
  std::vector<int64_t> host_row_pos;
  // The batched step's GDN and QSA rows in one launch (group) per layer (launch_gdn_decode and
  // launch_qsa_decode over rows): each row's slot (device, beside row_pos), and the kernels'
  // per-row scratch, GDN arrival counters (zeroed once) and QSA workspaces, allocated at the
  // first batched step for slot_count() rows.
  int32_t* row_slot = nullptr;  // [rows]
  std::vector<int32_t> host_row_slot;
  // A prompt pass over several slots (prefill_slots): its runs' first rows (and the pass's end)
  // and slots, read by the GDN prefill's one launch for all runs (GdnPrefillParams::runs).
  int32_t* run_start = nullptr;  // [rows + 1]
  int32_t* run_slot = nullptr;   // [rows]
  std::vector<int32_t> host_run_start, host_run_slot;
  float* gdn_o = nullptr;                // [slots, Hv*dv]
  unsigned int* gdn_counters = nullptr;  // [slots, Hv + Hk]
  void* qsa_rows_ws = nullptr;           // [slots] QSA decode workspaces
  // The batched step's layers as a CUDA graph per batch size B, captured for one list of slots
  // (the PLE ops' state pointers are the graph's parameters) and updated in place when the list
  // changes; the tokens, positions and row slots are read from P.tokens, P.row_pos and
  // P.row_slot.
  struct BatchGraph {
    std::vector<int64_t> slots;
    cudaGraphExec_t exec = nullptr;
  };
  struct BatchGraphs {
    std::vector<BatchGraph> by_size;  // [B]
    BatchGraphs() = default;
    BatchGraphs(const BatchGraphs&) = delete;
    BatchGraphs& operator=(const BatchGraphs&) = delete;
    ~BatchGraphs() {
      for (BatchGraph& g : by_size)
        if (g.exec) cudaGraphExecDestroy(g.exec);
    }
  } batch_graphs;
  void* sample_ws = nullptr;
  std::size_t sample_ws_bytes = 0;
  float* logits_local = nullptr;  // [kLogitRows, v_local] (TP > 1)
  float* logits = nullptr;        // [kLogitRows, V]
  float* stack = nullptr;         // [stack_floats]: gemm_rows' stacked form (gemm.h)
  int64_t stack_floats = 0;
  std::vector<float> host_logits;
  std::vector<int32_t> batch_ids;  // sample_batch()'s ids
  // prefill_rows(): the query's ids and the per-row results on the device, grown as needed.
  struct RowBuffers {
    std::byte* base = nullptr;
    std::size_t bytes = 0;
    int32_t* targets = nullptr;  // [rows]
    int32_t* gather = nullptr;   // [rows, gather_k]
    double* lse = nullptr;       // [rows]
    double* tlp = nullptr;       // [rows]
    int32_t* argmax = nullptr;   // [rows]
    double* glp = nullptr;       // [rows, gather_k]
    RowBuffers() = default;
    RowBuffers(const RowBuffers&) = delete;
    RowBuffers& operator=(const RowBuffers&) = delete;
    ~RowBuffers() {
      if (base) cudaFree(base);
    }
  } row_buf;
  int64_t host_position = 0;  // source of the device position update
  // record_choices: each QSA layer's per-row selection (device), and every row's choices on the
  // host in the decode step's log layout (choice_log_ints() ints per row).
  int32_t* sel_log = nullptr;  // [rows, sel_max]
  int32_t* cnt_log = nullptr;  // [rows, 4]
  int64_t sel_max = 0;
  std::vector<int32_t> choice_rows;
};

namespace {

// Carves (or, with base == nullptr, sizes) every pass buffer for `rows` tokens.
std::size_t carve_prefill(CudaPrefillState& P, std::byte* base, const ModelConfig& c,
                          const CudaModelOptions& o, const std::vector<DevLayer>& layers,
                          int64_t v_local, int64_t rows) {
  const RankDims rd = rank_dims(c, o.tp_size, o.tp_rank);
  const int64_t D = c.hidden_size, R = c.hc_lowrank, S = c.hc_count, W = c.hc_width();
  const int64_t E = c.num_experts, k = c.num_experts_per_tok, P_ = c.ple_embed_dim;
  const int64_t Is = rd.shared_inter;
  int64_t proj_ld = std::max<int64_t>(E + 1, 2 * Is);
  if (c.has_ple()) proj_ld = std::max(proj_ld, S * P_ + D);
  for (const DevLayer& L : layers)
    proj_ld = std::max(proj_ld, L.qsa ? L.attn.in_rows : L.gdn.in_rows);
  const int64_t mix_ld =
      std::max(rd.linear_v_heads * c.linear_value_head_dim, rd.q_heads * c.head_dim);
  Carver cv(base);
  P.rows = rows;
  P.proj_ld = proj_ld;
  P.mix_ld = mix_ld;
  P.tokens = cv.take<int32_t>(rows);
  P.H = cv.take<float>(rows * W);
  P.scale = cv.take<float>(rows * S);
  const int64_t split_rows = rows + std::min(rows, kGemmStackMaxRows);  // hc_read's lo rows
  P.n_hi = cv.take<uint16_t>(split_rows * W);
  P.t = cv.take<float>(rows * (R + S));
  P.u_hi = cv.take<uint16_t>(split_rows * R);
  P.g = cv.take<float>(rows * W);
  P.m_hi = cv.take<uint16_t>(2 * rows * D);
  P.iota = cv.take<float>(rows * S);
  const int64_t splits = hc_down_splits(S, D);
  P.hc_rows = std::min(rows, kHcReadRows);
  P.hc_tp = cv.take<float>(P.hc_rows * splits * (R + S));
  P.hc_sumsq = cv.take<float>(P.hc_rows * splits);
  P.proj = cv.take<float>(rows * proj_ld);
  P.mix = cv.take<uint16_t>(rows * mix_ld);
  P.y = cv.take<float>(rows * D);
  P.ys = cv.take<float>(rows * D);
  P.rl = cv.take<float>(rows * (E + 1));
  P.ids = cv.take<int32_t>(rows * k);
  P.rw = cv.take<float>(rows * k);
  P.sh = cv.take<uint16_t>(rows * Is);
  P.row_pos = cv.take<int64_t>(rows);
  P.row_slot = cv.take<int32_t>(rows);
  P.run_start = cv.take<int32_t>(rows + 1);
  P.run_slot = cv.take<int32_t>(rows);
  if (c.has_ple()) {
    P.e_ng = cv.take<float>(rows * P_);
    P.e_hi = cv.take<uint16_t>(2 * rows * P_);
    PleApplyRowsParams pr;
    pr.rows = rows;
    pr.base.hc_count = static_cast<int>(S);
    P.ple_scratch = cv.take<float>(ple_apply_rows_scratch_floats(pr));
  }
  GdnPrefillParams gp;
  gp.tokens = rows;
  gp.num_k_heads = static_cast<int>(rd.linear_k_heads);
  gp.num_v_heads = static_cast<int>(rd.linear_v_heads);
  gp.k_head_dim = static_cast<int>(c.linear_key_head_dim);
  gp.v_head_dim = static_cast<int>(c.linear_value_head_dim);
  gp.conv_kernel = static_cast<int>(c.linear_conv_kernel_dim);
  P.gdn_ws = cv.take<std::byte>(static_cast<int64_t>(gdn_prefill_workspace_bytes(gp)));
  QsaPrefillParams qp;
  qp.shape = model_detail::qsa_shape(c, o);
  qp.tokens = rows;
  P.qsa_ws = cv.take<std::byte>(static_cast<int64_t>(qsa_prefill_workspace_bytes(qp)));
  if (!layers.empty()) {  // every layer has the same expert shapes
    MoePrefillParams mp;
    mp.gate_up = layers.front().moe.gate_up;
    mp.down = layers.front().moe.down;
    mp.tokens = rows;
    mp.top_k = static_cast<int>(k);
    MoeGroupedParams mg;
    mg.gate_up = mp.gate_up;
    mg.down = mp.down;
    mg.tokens = std::min(rows, kMoeGroupedRows);
    mg.top_k = mp.top_k;
    P.moe_ws = cv.take<std::byte>(static_cast<int64_t>(
        std::max(moe_prefill_workspace_bytes(mp), moe_grouped_workspace_bytes(mg))));
  }
  if (o.record_choices) {
    P.sel_max = qsa_prefill_layout(qp).sel_max;
    P.sel_log = cv.take<int32_t>(rows * P.sel_max);
    P.cnt_log = cv.take<int32_t>(rows * 4);
  }
  const int64_t lr = std::min(rows, kLogitRows);
  if (o.tp_size > 1) P.logits_local = cv.take<float>(lr * v_local);
  P.logits = cv.take<float>(lr * c.vocab_size);
  // gemm_rows' stacked form for the batched step (up to kGemmStackMaxRows rows): the widest GEMM
  // output of a layer, and lm_head's rows.
  const int64_t sr = std::min(rows, kGemmStackMaxRows);
  P.stack_floats =
      std::max({2 * sr * std::max({proj_ld, W, R + S, D}),
                2 * std::min(sr, kLogitRows) * (o.tp_size > 1 ? v_local : c.vocab_size)});
  P.stack = cv.take<float>(P.stack_floats);
  return cv.used();
}

// A CUDA event at every op-family boundary of a prefill call when CudaModel::set_prefill_profile
// or FN_PREFILL_PROFILE=1 asks for it; the per-family times of the whole call are kept as the
// model's last PrefillProfile (and logged on rank 0 with FN_PREFILL_PROFILE=1). Off: no events,
// no cost.
class PrefillProfiler {
 public:
  PrefillProfiler(cudaStream_t s, bool on) : stream_(s) {
    const char* env = std::getenv("FN_PREFILL_PROFILE");
    log_ = env != nullptr && env[0] == '1';
    on_ = on || log_;
  }
  ~PrefillProfiler() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  PrefillProfiler(const PrefillProfiler&) = delete;
  PrefillProfiler& operator=(const PrefillProfiler&) = delete;
  void mark(StepFamily f) { mark_index(static_cast<int>(f)); }
  // Adds the marked segments (the stream must be synchronised) and starts over.
  void collect() {
    if (!on_) return;
    mark_index(kStepFamilyCount);
    FN_CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
    for (std::size_t i = 0; i + 1 < used_; ++i) {
      float ms = 0;
      FN_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
      ms_[static_cast<std::size_t>(family_[i])] += ms;
    }
    used_ = 0;
    family_.clear();
  }
  // The call's profile: each family's time with its share of `flops` (the whole model's,
  // core/flops.h). With FN_PREFILL_PROFILE=1 also logged with the rates: "gdn 283.1 (35.78
  // TFLOP, 126.4 TFLOP/s)".
  PrefillProfile result(const char* what, int64_t tokens, int64_t passes,
                        const PrefillFlops& flops) const {
    PrefillProfile r;
    r.tokens = tokens;
    r.passes = passes;
    std::string line;
    double total = 0;
    for (int f = 0; f < kStepFamilyCount; ++f) {
      const auto i = static_cast<std::size_t>(f);
      const double ms = ms_[i];
      const char* name = step_family_name(static_cast<StepFamily>(f));
      const double fl = flops.of(name);
      r.ms[i] = ms;
      r.flops[i] = fl;
      total += ms;
      if (ms <= 0) continue;
      line += fl > 0 ? fmt::format(" {} {:.1f} ({:.2f} TFLOP, {:.1f} TFLOP/s)", name, ms,
                                   fl * 1e-12, fl / (ms * 1e-3) * 1e-12)
                     : fmt::format(" {} {:.1f}", name, ms);
    }
    if (log_)
      FN_LOG_INFO(
          "{} profile ({} tokens, {} passes), ms:{}; sum {:.1f} ({:.2f} TFLOP, {:.1f} "
          "TFLOP/s)",
          what, tokens, passes, line, total, flops.total() * 1e-12,
          total > 0 ? flops.total() / (total * 1e-3) * 1e-12 : 0.0);
    return r;
  }
  bool on() const noexcept { return on_; }

 private:
  void mark_index(int f) {
    if (!on_ || (!family_.empty() && family_.back() == f)) return;
    if (used_ == events_.size()) {
      cudaEvent_t e = nullptr;
      FN_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    FN_CUDA_CHECK(cudaEventRecord(events_[used_++], stream_));
    family_.push_back(f);
  }
  cudaStream_t stream_;
  bool on_ = false, log_ = false;
  std::vector<cudaEvent_t> events_;
  std::size_t used_ = 0;
  std::vector<int> family_;
  std::array<double, kStepFamilyCount> ms_{};
};

}  // namespace

std::size_t model_detail::prefill_buffer_bytes(const ModelConfig& c, const CudaModelOptions& o,
                                               const std::vector<DevLayer>& layers,
                                               int64_t v_local) {
  CudaPrefillState sizing;
  return carve_prefill(sizing, nullptr, c, o, layers, v_local, pass_rows(o));
}

int64_t model_detail::pass_rows(const CudaModelOptions& o) {
  const int64_t chunk = std::max<int64_t>(o.prefill_chunk, 1);
  if (o.slots == 0) return chunk;  // as many slots as fit: not known before the buffers are
  // A pass never holds more than every slot's context.
  return o.ctx_size > chunk / o.slots ? chunk : std::min(chunk, o.ctx_size * o.slots);
}

void model_detail::require_prefill_fits(const ModelConfig& c, const CudaModelOptions& o,
                                        const std::vector<DevLayer>& layers, int64_t v_local) {
  FN_REQUIRE(o.prefill_chunk >= 1, Usage, "--prefill-chunk must be >= 1 token, got {}",
             o.prefill_chunk);
  const std::size_t need = prefill_buffer_bytes(c, o, layers, v_local);
  std::size_t free_b = 0, total_b = 0;
  FN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const int64_t rows = pass_rows(o);
  if (o.tp_rank == 0)
    FN_LOG_INFO(
        "prefill: {:.2f} GiB of pass buffers for {} tokens per pass (--prefill-chunk), "
        "allocated at the first prompt; {:.2f} GiB free now",
        static_cast<double>(need) / 1073741824.0, rows, static_cast<double>(free_b) / 1073741824.0);
  FN_REQUIRE(need <= free_b, Usage,
             "the batched prefill needs {:.2f} GiB of pass buffers for {} tokens per pass, but "
             "only {:.2f} GiB of device memory are free after the weights and the {}-token "
             "context: give a smaller --prefill-chunk (the buffers scale with it) or -c/--ctx-size",
             static_cast<double>(need) / 1073741824.0, rows,
             static_cast<double>(free_b) / 1073741824.0, o.ctx_size);
}

std::vector<StepChoices> CudaModel::prefill_choices() const {
  const Impl& I = *impl_;
  FN_REQUIRE(opt_.record_choices, Usage, "prefill_choices needs CudaModelOptions::record_choices");
  if (!I.prefill) return {};
  int64_t n_qsa = 0;
  for (const DevLayer& L : I.layers) n_qsa += L.qsa ? 1 : 0;
  const int64_t per_row = model_detail::choice_log_ints(cfg_, n_qsa);
  const std::vector<int32_t>& log = I.prefill->choice_rows;
  std::vector<StepChoices> out;
  for (std::size_t at = 0; at + per_row <= log.size(); at += static_cast<std::size_t>(per_row))
    out.push_back(model_detail::choices_from_log(cfg_, n_qsa, log.data() + at));
  return out;
}

// One prefill() call: the pass buffers, the stream and the rows of the pass in flight, with the
// per-block encoders of a pass (the decode step's order, docs/model.md §C.10, over M rows at once).
struct CudaModel::Impl::PrefillRun {
  Impl& I;
  CudaPrefillState& P;
  const ModelConfig& c;
  const CudaModelOptions& o;
  const RankDims rd;
  cudaStream_t s;
  cublasHandle_t blas;
  PrefillProfiler& prof;
  int64_t per_row = 0;  // ints of the choice log per row (record_choices)
  // The pass in flight: rows c0 .. c0 + M - 1 of the prompt (a batched step: c0 0, M slots).
  int64_t c0 = 0, M = 0;
  int64_t layer_index = 0, qsa_index = 0;
  // The pass's rows by sequence: runs of consecutive rows of one slot at its positions (a prompt
  // chunk: one run; a batched decode step: one row per slot). The GDN, QSA and PLE ops run per
  // run on that slot's states; everything else over all M rows at once.
  struct Run {
    int64_t slot = 0, row0 = 0, rows = 0, position = 0;
  };
  std::vector<Run> runs{};
  // A batched decode step (every run one row): the GDN and QSA rows go through the decode
  // kernels (gdn_rows, qsa_rows after the pass's projection GEMM), all rows in one launch
  // (group), each reading its slot from P.row_slot and its position from P.row_pos; a prompt
  // pass runs the prefill kernels over each run.
  bool decode_rows = false;
  int64_t cur_layer = 0;  // the layer being encoded
  const model_detail::DevSlotLayer& state(const Run& r) const {
    return I.slots[static_cast<std::size_t>(r.slot)].layers[static_cast<std::size_t>(cur_layer)];
  }
  int64_t* context(const Run& r) const { return I.slots[static_cast<std::size_t>(r.slot)].context; }
  // PrefillLogits::Rows: the query, its row results (host) and whether the rows are kept.
  const RowQuery* rq = nullptr;
  RowResults* rout = nullptr;

  void all_reduce(float* buf, int64_t count) {
    if (o.tp_size == 1) return;
    prof.mark(StepFamily::AllReduce);
    o.all_reduce->all_reduce_sum(buf, buf, static_cast<std::size_t>(count), DType::F32, s);
  }
  // record_choices: `width` ints of every row of the pass from `src` (row stride src_ld) into the
  // host log at `offset` of each row (the decode step's choice-log layout).
  void log_rows(int64_t offset, const int32_t* src, int64_t width, int64_t src_ld) {
    FN_CUDA_CHECK(cudaMemcpy2DAsync(P.choice_rows.data() + c0 * per_row + offset,
                                    sizeof(int32_t) * per_row, src, sizeof(int32_t) * src_ld,
                                    sizeof(int32_t) * width, M, cudaMemcpyDeviceToHost, s));
  }
  void gemm(const uint16_t* w, int64_t rows_w, int64_t cols_w, const uint16_t* x_hi,
            const uint16_t* x_lo, int64_t ldx, int64_t m, float* y, int64_t ldy) {
    GemmRowsParams g;
    g.w = w;
    g.n = rows_w;
    g.k = cols_w;
    g.x_hi = x_hi;
    g.x_lo = x_lo;
    g.ldx = ldx;
    g.m = m;
    g.y = y;
    g.ldy = ldy;
    if (decode_rows) {  // a batched step: the weights' read is the step's cost
      g.stack = P.stack;
      g.stack_floats = P.stack_floats;
    }
    gemm_rows(blas, g);
  }
  // The block input's lo rows (set by hc_read: its m rows below P.m_hi's).
  const uint16_t* m_lo = nullptr;
  // HC read of `m` rows of H starting at Hrows: m_hi rows 0..m-1, m_lo and iota (when given).
  // A prompt pass, or a batched step of kHcGemmRows rows or more: norm rows, the down/inject
  // GEMM, act rows, the up GEMM, mix rows. A smaller batched step: the decode step's two kernels
  // (hc.h) over the rows (hc_read_rows), bitwise the decode step's read per row.
  void hc_read(const DevHc& hc, const float* Hrows, int64_t m, float* iota_out) {
    const int64_t D = c.hidden_size, R = c.hc_lowrank, S = c.hc_count, W = c.hc_width();
    const float eps = static_cast<float>(c.rms_norm_eps);
    prof.mark(StepFamily::Hc);
    uint16_t* mlo = P.m_hi + m * D;
    m_lo = mlo;
    if (decode_rows && m < kHcGemmRows) {
      hc_read_rows(hc, Hrows, m, iota_out, mlo);
      return;
    }
    // A prompt pass gives N and u to their GEMMs as BF16 (docs/numerics.md "The batched
    // prefill"); a batched step keeps their lo halves while the stacked GEMM reads each weight
    // once for both (kGemmStackMaxRows), where they cost no weight bytes.
    const bool split = decode_rows && m <= kGemmStackMaxRows;
    uint16_t* n_lo = split ? P.n_hi + m * W : nullptr;
    uint16_t* u_lo = split ? P.u_hi + m * R : nullptr;
    launch_hc_norm_rows(Hrows, hc.norm, static_cast<int>(S), D, eps, m, P.scale, P.n_hi, n_lo, s);
    gemm(hc.down_inj, hc.down_rows, W, P.n_hi, n_lo, W, m, P.t, hc.down_rows);
    launch_hc_act_rows(P.t, hc.down_rows, R, static_cast<int>(S), m, P.u_hi, u_lo, iota_out, s);
    gemm(hc.up, W, R, P.u_hi, u_lo, R, m, P.g, W);
    launch_hc_mix_rows(P.g, Hrows, P.scale, hc.norm, static_cast<int>(S), D, m, P.m_hi, mlo, s);
  }
  // hc_read of a batched step: launch_hc_down + launch_hc_mix with the rows as their tokens (up
  // to P.hc_rows per pair: each block stages its weight tile once for all of them), m FP32 into
  // P.g (scratch: every reader takes the BF16 pair), its hi + lo pair (launch_split_bf16's) into
  // P.m_hi and mlo (the m rows below), iota into iota_out. Per row the same kernels' operations
  // on the same operands as the decode step's read (step.cpp step_hc_read; each token of a
  // several-token launch has a one-token launch's bits, hc.h): the same bits per row. The inject
  // after each block stays its own launch (inject()), bitwise launch_hc_inject's.
  void hc_read_rows(const DevHc& hc, const float* Hrows, int64_t m, float* iota_out,
                    uint16_t* mlo) {
    const int64_t D = c.hidden_size, S = c.hc_count, W = c.hc_width();
    for (int64_t r0 = 0; r0 < m; r0 += P.hc_rows) {
      const int n = static_cast<int>(std::min(P.hc_rows, m - r0));
      HcDownParams down;
      down.H = Hrows + r0 * W;
      down.norm = hc.norm;
      down.weight = hc.down_inj;
      down.rows = hc.down_rows;
      down.hc_count = static_cast<int>(S);
      down.hidden = D;
      down.t_partial = P.hc_tp;
      down.sumsq = P.hc_sumsq;
      down.fixed_shape = I.plan.hc_down_fixed;
      down.tokens = n;
      down.tokens_per_block = kHcTokensPerBlock;
      launch_hc_down(down, s);
      HcMixParams mx;
      mx.w_up = hc.up;
      mx.t = P.hc_tp;
      mx.sumsq = P.hc_sumsq;
      mx.t_splits = hc_down_splits(S, D);
      mx.t_stride = hc.down_rows;
      mx.H = Hrows + r0 * W;
      mx.norm = hc.norm;
      mx.eps = static_cast<float>(c.rms_norm_eps);
      mx.m = P.g + r0 * D;
      mx.m_bf16 = P.m_hi + r0 * D;
      mx.m_lo = mlo + r0 * D;
      mx.iota = iota_out != nullptr ? iota_out + r0 * S : nullptr;
      mx.hc_count = static_cast<int>(S);
      mx.hidden = D;
      mx.rank = c.hc_lowrank;
      mx.fixed_shape = I.plan.hc_mix_fixed;
      mx.tokens = n;
      mx.tokens_per_block = kHcTokensPerBlock;
      launch_hc_mix(mx, s);
    }
  }
  void inject() {
    prof.mark(StepFamily::Hc);
    launch_hc_inject_rows(P.H, P.iota, P.y, static_cast<int>(c.hc_count), c.hidden_size, M, s);
  }
  void ple(const model_detail::DevPle& pl);
  void qsa(const model_detail::DevQsa& a);
  void gdn(const model_detail::DevGdn& g);
  // A batched step's QSA / GDN mixers: every row in one decode launch (group), each on its slot's
  // caches or states (P.row_slot and the slot table).
  void qsa_rows(const model_detail::DevQsa& a, int64_t topk);
  void gdn_rows(const model_detail::DevGdn& g);
  void moe(const model_detail::DevMoe& mo);
  // The embedding rows and every layer of the pass.
  void layers();
  // layers() of a batched step (every run one row of `slots`) through P.batch_graphs: captured
  // for the batch size and slot list, replayed while they stay, updated when the slots change.
  void layers_graph(std::span<const int64_t> slots);
  // Final mixer + lm_head for the pass's rows whose logits are wanted (every row for All, the
  // prompt's last for Last), copied into P.host_logits (row c0 + r at (c0 + r) * V for All).
  void logits(PrefillLogits want, int64_t n);
  // sample_batch(): per row of the pass its sampling settings; the logits rows are sampled on
  // the device into P.sample_ids instead of being copied out.
  const DeviceSamplingParams* sample = nullptr;
  // The end of a pass: each run's n-gram context and position advanced (slot 0's also on the
  // device, which the decode graph reads) and the error flag read back; synchronises the
  // stream, then throws what the all-reduce reports or a kernel flagged (check_step_errors,
  // naming `last_token`).
  void finish(CudaModel& m, int32_t last_token);
};

void CudaModel::Impl::PrefillRun::ple(const model_detail::DevPle& pl) {
  const int64_t D = c.hidden_size, S = c.hc_count, Pd = c.ple_embed_dim;
  prof.mark(StepFamily::Ple);
  // The rows of every token of the pass in one launch; with the table in pinned host memory
  // (pl.on_host, --ngram-table host) pl.rows is its mapped pointer and the same kernel reads them
  // over PCIe / C2C (M * num_heads rows of ngram_head_dim bytes, 2.5 KiB per token at the real
  // geometry: ~20 MiB for an 8192-token pass, far below the pass's GEMMs).
  for (const Run& r : runs) {
    NgramGatherRowsParams ng;
    ng.base = model_detail::ngram_gather_params(c, pl);
    ng.base.context = context(r);
    ng.tokens = P.tokens + r.row0;
    ng.rows = r.rows;
    ng.out = P.e_ng + r.row0 * Pd;
    launch_ngram_gather_rows(ng, s);
  }
  all_reduce(P.e_ng, M * Pd);
  prof.mark(StepFamily::Ple);
  uint16_t* e_lo = P.e_hi + M * Pd;
  launch_split_bf16(P.e_ng, M * Pd, P.e_hi, e_lo, s);
  const int64_t kv_rows = S * Pd + D;
  gemm(pl.kv_proj, kv_rows, Pd, P.e_hi, e_lo, Pd, M, P.proj, kv_rows);
  for (const Run& r : runs) {
    PleApplyRowsParams pa;
    pa.base = model_detail::ple_apply_params(c, pl);
    pa.base.conv_state = state(r).ple_conv;
    pa.kv = P.proj + r.row0 * kv_rows;
    pa.kv_stride = kv_rows;
    pa.H = P.H + r.row0 * c.hc_width();
    pa.rows = r.rows;
    pa.scratch = P.ple_scratch;
    launch_ple_apply_rows(pa, s);
  }
}

void CudaModel::Impl::PrefillRun::qsa(const model_detail::DevQsa& a) {
  const int64_t D = c.hidden_size;
  prof.mark(StepFamily::QsaMixer);
  gemm(a.in_proj, a.in_rows, D, P.m_hi, m_lo, D, M, P.proj, P.proj_ld);
  const int64_t topk = c.indexer_budget / c.indexer_compress_ratio;
  if (decode_rows) {
    qsa_rows(a, topk);
  } else {
    for (const Run& r : runs) {
      const model_detail::DevSlotLayer& st = state(r);
      QsaPrefillParams qp;
      qp.shape = model_detail::qsa_layer(c, o, a);
      qp.shape.k_cache = st.k_cache;
      qp.shape.v_cache = st.v_cache;
      qp.shape.raw_keys = st.raw_keys;
      qp.shape.block_keys = st.block_keys;
      qp.proj = P.proj + r.row0 * P.proj_ld;
      qp.proj_stride = P.proj_ld;
      qp.tokens = r.rows;
      qp.first_position = r.position;
      qp.out = P.mix + r.row0 * rd.q_heads * c.head_dim;  // packed rows, as o_proj reads them
      qp.workspace = P.qsa_ws;
      qp.selected_log = P.sel_log ? P.sel_log + r.row0 * P.sel_max : nullptr;
      qp.counters_log = P.cnt_log ? P.cnt_log + r.row0 * 4 : nullptr;
      launch_qsa_prefill(qp, s);
    }
  }
  if (o.record_choices) {
    const int64_t at = c.num_hidden_layers * c.num_experts_per_tok + qsa_index * (topk + 4);
    log_rows(at, P.sel_log, std::min(P.sel_max, topk), P.sel_max);
    log_rows(at + topk, P.cnt_log, 4, 4);
  }
  ++qsa_index;
  const int64_t width = rd.q_heads * c.head_dim;
  gemm(a.o, D, width, P.mix, nullptr, width, M, P.y, D);
}

void CudaModel::Impl::PrefillRun::gdn(const model_detail::DevGdn& g) {
  const int64_t D = c.hidden_size;
  prof.mark(StepFamily::GdnMixer);
  gemm(g.in_proj, g.in_rows, D, P.m_hi, m_lo, D, M, P.proj, P.proj_ld);
  if (decode_rows) {
    gdn_rows(g);
  } else {
    GdnPrefillParams gp;
    model_detail::set_gdn_layer(gp, c, rd, g);
    gp.proj = P.proj;
    gp.proj_stride = P.proj_ld;
    gp.tokens = M;
    gp.out = P.mix;  // packed rows
    gp.workspace = P.gdn_ws;
    if (runs.size() == 1) {
      gp.conv_state = state(runs.front()).gdn_conv;
      gp.state = state(runs.front()).gdn_state;
    } else {  // every slot's run in one launch (P.run_start / P.run_slot, set by the pass)
      gp.runs = static_cast<int>(runs.size());
      gp.run_start = P.run_start;
      gp.run_slot = P.run_slot;
      gp.slot_state = I.slot_pointers<float>(cur_layer, Impl::kSlotGdnState);
      gp.slot_conv = I.slot_pointers<float>(cur_layer, Impl::kSlotGdnConv);
    }
    launch_gdn_prefill(gp, s);
  }
  const int64_t width = rd.linear_v_heads * c.linear_value_head_dim;
  gemm(g.out, D, width, P.mix, nullptr, width, M, P.y, D);
}

void CudaModel::Impl::PrefillRun::qsa_rows(const model_detail::DevQsa& a, int64_t topk) {
  QsaDecodeParams q = model_detail::qsa_layer(c, o, a);
  q.rows = static_cast<int>(M);
  q.row_slot = P.row_slot;
  q.slot_k_cache = I.slot_pointers<uint16_t>(cur_layer, Impl::kSlotKCache);
  q.slot_v_cache = I.slot_pointers<uint16_t>(cur_layer, Impl::kSlotVCache);
  q.slot_raw_keys = I.slot_pointers<float>(cur_layer, Impl::kSlotRawKeys);
  q.slot_block_keys = I.slot_pointers<float>(cur_layer, Impl::kSlotBlockKeys);
  q.proj = P.proj;
  q.proj_stride = P.proj_ld;
  q.position = P.row_pos;
  q.workspace = P.qsa_rows_ws;
  q.out = P.mix;
  q.out_stride = rd.q_heads * c.head_dim;
  launch_qsa_decode(q, s);
  if (P.sel_log == nullptr) return;
  // The decode step's choice log: each row's selection, then its counters.
  const QsaWorkspaceLayout wl = qsa_workspace_layout(q);
  const int64_t n_sel = std::min({topk, P.sel_max, o.ctx_size / c.indexer_compress_ratio});
  for (int64_t r = 0; r < M; ++r) {
    const auto* ws = static_cast<const std::byte*>(P.qsa_rows_ws) + r * wl.total;
    if (n_sel > 0)
      FN_CUDA_CHECK(cudaMemcpyAsync(P.sel_log + r * P.sel_max, ws + wl.selected,
                                    sizeof(int32_t) * n_sel, cudaMemcpyDeviceToDevice, s));
    FN_CUDA_CHECK(cudaMemcpyAsync(P.cnt_log + r * 4, ws + wl.counters, sizeof(int32_t) * 4,
                                  cudaMemcpyDeviceToDevice, s));
  }
}

void CudaModel::Impl::PrefillRun::gdn_rows(const model_detail::DevGdn& g) {
  GdnDecodeParams gp;
  model_detail::set_gdn_layer(gp, c, rd, g);
  gp.rows = static_cast<int>(M);
  gp.row_slot = P.row_slot;
  gp.slot_state = I.slot_pointers<float>(cur_layer, Impl::kSlotGdnState);
  gp.slot_conv = I.slot_pointers<float>(cur_layer, Impl::kSlotGdnConv);
  gp.proj = P.proj;
  gp.proj_stride = P.proj_ld;
  gp.out = P.mix;
  gp.out_stride = rd.linear_v_heads * c.linear_value_head_dim;
  gp.o_scratch = P.gdn_o;
  gp.head_counters = P.gdn_counters;
  gp.fixed_shape = I.plan.gdn_fixed;
  gp.cluster = I.plan.gdn_cluster;
  launch_gdn_decode(gp, s);
}

void CudaModel::Impl::PrefillRun::moe(const model_detail::DevMoe& mo) {
  const int64_t D = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok;
  const int64_t Is = rd.shared_inter;
  prof.mark(StepFamily::Router);
  gemm(mo.router, E + 1, D, P.m_hi, m_lo, D, M, P.rl, E + 1);
  RouterRowsParams rr;
  rr.logits = P.rl;
  rr.logits_stride = E + 1;
  rr.rows = M;
  rr.num_experts = static_cast<int>(E);
  rr.top_k = static_cast<int>(k);
  rr.norm_topk_prob = c.norm_topk_prob;
  rr.ids = P.ids;
  rr.weights = P.rw;
  rr.error_flag = I.error_flag;
  launch_router_topk_rows(rr, s);
  if (o.record_choices) log_rows(layer_index * k, P.ids, k, k);
  ++layer_index;
  prof.mark(StepFamily::RoutedMoe);
  MoePrefillParams mp;
  mp.gate_up = mo.gate_up;
  mp.down = mo.down;
  mp.ids = P.ids;
  mp.weights = P.rw;
  mp.tokens = M;
  mp.top_k = static_cast<int>(k);
  mp.x = P.m_hi;  // W4A16: the experts take m rounded to BF16, as decode
  mp.y = P.y;
  mp.workspace = P.moe_ws;
  if (decode_rows && M >= kMoeGroupedFromRows && I.plan.moe_grouped) {
    for (int64_t r0 = 0; r0 < M; r0 += kMoeGroupedRows) {
      MoeGroupedParams gp;
      gp.gate_up = mo.gate_up;
      gp.down = mo.down;
      gp.ids = P.ids + r0 * k;
      gp.weights = P.rw + r0 * k;
      gp.tokens = std::min(kMoeGroupedRows, M - r0);
      gp.top_k = static_cast<int>(k);
      gp.x = P.m_hi + r0 * D;
      gp.y = P.y + r0 * D;
      gp.workspace = P.moe_ws;
      launch_moe_grouped(gp, s);
    }
  } else {
    if (decode_rows) {  // the decode kernels over the rows: no host synchronisation (graphs)
      mp.path = MoePrefillPath::PerRow;
      mp.down_fixed = I.plan.moe_down_fixed;
      mp.gate_up_bulk = I.plan.moe_gate_up_bulk;
    }
    launch_moe_prefill(mp, s);
  }
  prof.mark(StepFamily::SharedExpert);
  gemm(mo.s_gate_up, 2 * Is, D, P.m_hi, m_lo, D, M, P.proj, 2 * Is);
  launch_swiglu_rows(P.proj, Is, M, P.sh, s);
  gemm(mo.s_down, D, Is, P.sh, nullptr, Is, M, P.ys, D);
  launch_moe_combine_rows(P.y, P.ys, P.rl + E, E + 1, D, M, s);
}

void CudaModel::Impl::PrefillRun::finish(CudaModel& m, int32_t last_token) {
  prof.mark(StepFamily::Other);
  for (const Run& r : runs) {
    if (c.has_ple()) {
      NgramContextAdvanceRowsParams ca;
      ca.context = context(r);
      ca.ngram_size = static_cast<int>(c.ngram_size);
      ca.tokens = P.tokens + r.row0;
      ca.rows = r.rows;
      launch_ngram_context_advance_rows(ca, s);
    }
    const int64_t end = r.position + r.rows;
    if (r.slot == m.slot_) {
      m.position_ = end;
    } else {
      I.slots[static_cast<std::size_t>(r.slot)].position = end;
    }
    if (r.slot == 0) {
      P.host_position = end;
      FN_CUDA_CHECK(cudaMemcpyAsync(I.position, &P.host_position, sizeof(int64_t),
                                    cudaMemcpyHostToDevice, s));
    }
  }
  FN_CUDA_CHECK(
      cudaMemcpyAsync(I.host_flag, I.error_flag, sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  FN_CUDA_CHECK(cudaStreamSynchronize(s));
  if (o.all_reduce) o.all_reduce->check_health();
  m.check_step_errors(last_token);
  prof.collect();
}

void CudaModel::Impl::PrefillRun::layers() {
  const int64_t D = c.hidden_size;
  layer_index = 0;
  qsa_index = 0;
  prof.mark(StepFamily::Other);
  launch_embed_rows(I.embed, c.vocab_size, D, static_cast<int>(c.hc_count), P.tokens, M, P.H,
                    I.error_flag, s);
  cur_layer = 0;
  for (const DevLayer& L : I.layers) {
    if (L.has_ple) ple(L.ple);
    hc_read(L.attn_hc, P.H, M, P.iota);
    if (L.qsa) {
      qsa(L.attn);
    } else {
      gdn(L.gdn);
    }
    all_reduce(P.y, M * D);
    inject();
    hc_read(L.mlp_hc, P.H, M, P.iota);
    moe(L.moe);
    all_reduce(P.y, M * D);
    inject();
    ++cur_layer;
  }
}

void CudaModel::Impl::PrefillRun::logits(PrefillLogits want, int64_t n) {
  const int64_t D = c.hidden_size, V = c.vocab_size, W = c.hc_width();
  int64_t r_begin = M, r_end = M;
  if (want == PrefillLogits::All) r_begin = 0;
  if (want == PrefillLogits::Last && c0 + M == n) r_begin = M - 1;
  if (want == PrefillLogits::Rows) r_begin = std::clamp(rq->first - c0, int64_t{0}, M);
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kLogitRows) {
    const int64_t m = std::min(kLogitRows, r_end - r0);
    hc_read(I.final_hc, P.H + r0 * W, m, nullptr);
    prof.mark(StepFamily::LmHead);
    if (o.tp_size > 1) {
      gemm(I.lm_head, I.v_local, D, P.m_hi, m_lo, D, m, P.logits_local, I.v_local);
      for (int64_t j = 0; j < m; ++j) {
        ScatterLogitsParams sc;
        sc.local = P.logits_local + j * I.v_local;
        sc.full = P.logits + j * V;
        sc.v_local = I.v_local;
        sc.v_first = I.v_first;
        sc.vocab = V;
        launch_scatter_logits(sc, s);
      }
      all_reduce(P.logits, m * V);
      prof.mark(StepFamily::LmHead);
    } else {
      gemm(I.lm_head, V, D, P.m_hi, m_lo, D, m, P.logits, V);
    }
    if (want == PrefillLogits::Rows) {
      // Reported row of prompt row c0 + r0: g0 (the query's rows start at rq->first).
      const int64_t g0 = c0 + r0 - rq->first, k = rq->gather_k;
      const CudaPrefillState::RowBuffers& b = P.row_buf;
      LogitStatsParams ls;
      ls.logits = P.logits;
      ls.rows = m;
      ls.vocab = V;
      ls.ld = V;
      ls.targets = rq->targets.empty() ? nullptr : b.targets + g0;
      ls.gather = k > 0 ? b.gather + g0 * k : nullptr;
      ls.gather_k = k;
      ls.lse = b.lse + g0;
      ls.target_logprob = b.tlp + g0;
      ls.argmax = b.argmax + g0;
      ls.gather_logprob = k > 0 ? b.glp + g0 * k : nullptr;
      launch_logit_stats(ls, s);
      if (rq->keep_logits) {
        FN_CUDA_CHECK(cudaMemcpyAsync(rout->logits.data() + g0 * V, P.logits, sizeof(float) * m * V,
                                      cudaMemcpyDeviceToHost, s));
      }
      continue;
    }
    if (sample != nullptr) {
      for (int64_t j = 0; j < m; ++j) {
        SampleParams sp;
        sp.logits = P.logits + j * V;
        sp.vocab = V;
        sp.sampling = sample[r0 + j];
        sp.step = P.sample_steps + r0 + j;
        sp.token_out = P.sample_ids + r0 + j;
        sp.workspace = P.sample_ws;
        sp.workspace_bytes = P.sample_ws_bytes;
        sp.error_flag = I.error_flag;
        launch_sample(sp, s);
      }
      continue;
    }
    const int64_t dst = want == PrefillLogits::All ? (c0 + r0) * V : 0;
    FN_CUDA_CHECK(cudaMemcpyAsync(P.host_logits.data() + dst, P.logits, sizeof(float) * m * V,
                                  cudaMemcpyDeviceToHost, s));
  }
}

std::span<const float> CudaModel::prefill(std::span<const int32_t> tokens, PrefillLogits want) {
  FN_CHECK(want != PrefillLogits::Rows, "PrefillLogits::Rows is prefill_rows()'s");
  return run_prefill(tokens, want, nullptr, nullptr);
}

namespace {
// Bytes of a 256-aligned piece of `count` T.
template <typename T>
std::size_t piece_bytes(int64_t count) {
  return (static_cast<std::size_t>(std::max<int64_t>(count, 1)) * sizeof(T) + 255) &
         ~std::size_t{255};
}
}  // namespace

RowResults CudaModel::prefill_rows(std::span<const int32_t> tokens, const RowQuery& q) {
  const auto n = static_cast<int64_t>(tokens.size());
  FN_REQUIRE(n >= 1, Usage, "the prompt is empty (0 tokens): give at least one token");
  check_row_query(q, n, cfg_.vocab_size);
  RowResults out;
  const int64_t rows = n - q.first, k = q.gather_k;
  resize_row_results(out, rows, k, q.keep_logits, cfg_.vocab_size);
  run_prefill(tokens, PrefillLogits::Rows, &q, &out);
  return out;
}

void CudaModel::ensure_prefill_buffers() {
  Impl& I = *impl_;
  if (I.prefill) return;
  const ModelConfig& c = cfg_;
  const CudaModelOptions& o = opt_;
  auto st = std::make_shared<CudaPrefillState>();
  const int64_t rows = model_detail::pass_rows(o);
  const std::size_t bytes = carve_prefill(*st, nullptr, c, o, I.layers, I.v_local, rows);
  void* base = nullptr;
  try {
    base = st->arena.alloc(bytes, "the batched prefill's pass buffers");
  } catch (const Error& e) {
    FN_THROW(Cuda, "{} — the prefill needs {:.2f} GiB for --prefill-chunk {}; give a smaller one",
             e.what(), static_cast<double>(bytes) / 1073741824.0, rows);
  }
  carve_prefill(*st, static_cast<std::byte*>(base), c, o, I.layers, I.v_local, rows);
  st->blas = std::make_unique<CublasHandle>(I.stream);
  I.prefill = std::move(st);
}

std::span<const float> CudaModel::forward_batch(std::span<const int64_t> slots,
                                                std::span<const int32_t> tokens) {
  run_batch(slots, tokens, {}, {});
  return {impl_->prefill->host_logits.data(), impl_->prefill->host_logits.size()};
}

std::vector<int32_t> CudaModel::sample_batch(std::span<const int64_t> slots,
                                             std::span<const int32_t> tokens,
                                             std::span<const DeviceSamplingParams> sampling,
                                             std::span<const int64_t> steps) {
  FN_CHECK(sampling.size() == slots.size() && steps.size() == slots.size(),
           "sample_batch: {} slots, {} settings, {} steps", slots.size(), sampling.size(),
           steps.size());
  for (std::size_t i = 0; i < steps.size(); ++i)
    FN_CHECK(steps[i] >= 0, "sample_batch: slot {} at RNG step {}", slots[i], steps[i]);
  run_batch(slots, tokens, sampling, steps);
  const CudaPrefillState& P = *impl_->prefill;
  return P.batch_ids;
}

void CudaModel::Impl::PrefillRun::layers_graph(std::span<const int64_t> slots) {
  const auto B = static_cast<std::size_t>(slots.size());
  if (P.batch_graphs.by_size.size() <= B) P.batch_graphs.by_size.resize(B + 1);
  CudaPrefillState::BatchGraph& g = P.batch_graphs.by_size[B];
  if (g.exec == nullptr ||
      !std::equal(slots.begin(), slots.end(), g.slots.begin(), g.slots.end())) {
    cudaGraph_t graph = model_detail::capture_stream(s, [this] { layers(); });
    cudaError_t rc = cudaErrorUnknown;
    if (g.exec) {  // the same launches with other slots' pointers: an update in place
      cudaGraphExecUpdateResultInfo info{};
      rc = cudaGraphExecUpdate(g.exec, graph, &info);
      if (rc != cudaSuccess) {
        (void)cudaGetLastError();
        cudaGraphExecDestroy(g.exec);
        g.exec = nullptr;
      }
    }
    if (g.exec == nullptr) rc = cudaGraphInstantiate(&g.exec, graph, 0);
    cudaGraphDestroy(graph);
    if (rc != cudaSuccess) g.exec = nullptr;
    FN_CUDA_CHECK(rc);
    g.slots.assign(slots.begin(), slots.end());
    ++I.captures;
  }
  FN_CUDA_CHECK(cudaGraphLaunch(g.exec, s));
}

void CudaModel::run_batch(std::span<const int64_t> slots, std::span<const int32_t> tokens,
                          std::span<const DeviceSamplingParams> sampling,
                          std::span<const int64_t> steps) {
  Impl& I = *impl_;
  const ModelConfig& c = cfg_;
  const CudaModelOptions& o = opt_;
  const auto B = static_cast<int64_t>(slots.size());
  FN_CHECK(B >= 1 && slots.size() == tokens.size(),
           "forward_batch: {} slots for {} tokens (need the same number, at least one)",
           slots.size(), tokens.size());
  FN_CHECK(B <= model_detail::pass_rows(o),
           "forward_batch: {} slots in one pass of at most {} rows", B, model_detail::pass_rows(o));
  FN_REQUIRE(I.forced_router == nullptr && I.residuals == nullptr, Usage,
             "the batched step neither replays choices nor keeps residuals (tests only)");
  std::vector<bool> seen(I.slots.size(), false);
  std::vector<int64_t> pos(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const int64_t sl = slots[i];
    FN_CHECK(sl >= 0 && sl < slot_count(), "forward_batch: slot {} outside [0, {})", sl,
             slot_count());
    FN_CHECK(!seen[static_cast<std::size_t>(sl)], "forward_batch: slot {} given twice", sl);
    seen[static_cast<std::size_t>(sl)] = true;
    FN_REQUIRE(tokens[i] >= 0 && tokens[i] < c.vocab_size, Usage,
               "token id {} is outside the vocabulary [0, {})", tokens[i], c.vocab_size);
    pos[i] = sl == slot_ ? position_ : I.slots[static_cast<std::size_t>(sl)].position;
    FN_REQUIRE(pos[i] + 1 <= o.ctx_size, Usage,
               "sequence slot {} is at position {}: the context -c/--ctx-size {} is full", sl,
               pos[i], o.ctx_size);
  }
  ensure_prefill_buffers();
  CudaPrefillState& P = *I.prefill;
  const int64_t V = c.vocab_size;
  cudaStream_t s = I.stream;
  PrefillProfiler prof(s, false);
  Impl::PrefillRun run{I, P, c, o, rank_dims(c, o.tp_size, o.tp_rank), s, P.blas->get(), prof};
  int64_t n_qsa = 0;
  for (const DevLayer& L : I.layers) n_qsa += L.qsa ? 1 : 0;
  run.per_row = model_detail::choice_log_ints(c, n_qsa);
  if (o.record_choices) P.choice_rows.assign(static_cast<std::size_t>(B * run.per_row), 0);
  run.c0 = 0;
  run.M = B;
  run.decode_rows = true;
  P.host_row_pos = pos;
  FN_CUDA_CHECK(cudaMemcpyAsync(P.row_pos, P.host_row_pos.data(), sizeof(int64_t) * B,
                                cudaMemcpyHostToDevice, s));
  P.host_row_slot.resize(static_cast<std::size_t>(B));
  for (std::size_t i = 0; i < slots.size(); ++i)
    P.host_row_slot[i] = static_cast<int32_t>(slots[i]);
  FN_CUDA_CHECK(cudaMemcpyAsync(P.row_slot, P.host_row_slot.data(), sizeof(int32_t) * B,
                                cudaMemcpyHostToDevice, s));
  if (P.gdn_o == nullptr) {
    const RankDims rd = rank_dims(c, o.tp_size, o.tp_rank);
    const int64_t n = slot_count();
    P.gdn_o = P.arena.alloc_n<float>(n * rd.linear_v_heads * c.linear_value_head_dim,
                                     "batched GDN scratch");
    const int64_t nc = n * (rd.linear_v_heads + rd.linear_k_heads);
    P.gdn_counters = P.arena.alloc_n<unsigned int>(nc, "batched GDN arrival counters");
    FN_CUDA_CHECK(cudaMemsetAsync(P.gdn_counters, 0, sizeof(unsigned int) * nc, s));
    const QsaDecodeParams shape = model_detail::qsa_shape(c, o);
    P.qsa_rows_ws = P.arena.alloc(static_cast<std::size_t>(n) * qsa_decode_workspace_bytes(shape),
                                  "batched QSA workspaces");
  }
  for (int64_t i = 0; i < B; ++i)
    run.runs.push_back(
        {slots[static_cast<std::size_t>(i)], i, 1, pos[static_cast<std::size_t>(i)]});
  const bool sampled = !sampling.empty();
  if (sampled) {
    if (P.sample_steps == nullptr) {
      P.sample_steps = P.arena.alloc_n<int64_t>(P.rows, "batched sampling steps");
      P.sample_ids = P.arena.alloc_n<int32_t>(P.rows, "batched sampled ids");
      // Sized for filtered sampling, which needs the most (greedy needs less).
      DeviceSamplingParams filtered;
      filtered.top_k = 40;
      filtered.top_p = 0.9f;
      P.sample_ws_bytes = sample_workspace_bytes(V, filtered);
      P.sample_ws = P.arena.alloc(P.sample_ws_bytes, "batched sampling workspace");
    }
    FN_CUDA_CHECK(cudaMemcpyAsync(P.sample_steps, steps.data(), sizeof(int64_t) * B,
                                  cudaMemcpyHostToDevice, s));
    run.sample = sampling.data();
  } else {
    P.host_logits.assign(static_cast<std::size_t>(B * V), 0.0f);
  }
  FN_CUDA_CHECK(
      cudaMemcpyAsync(P.tokens, tokens.data(), sizeof(int32_t) * B, cudaMemcpyHostToDevice, s));
  const auto enqueue_start = std::chrono::steady_clock::now();
  if (prof.on() || o.record_choices) {  // events and host copies between the layers' launches
    run.layers();
  } else {
    run.layers_graph(slots);
  }
  run.logits(PrefillLogits::All, B);
  const double enqueue_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - enqueue_start)
          .count();
  if (sampled) {
    P.batch_ids.resize(static_cast<std::size_t>(B));
    FN_CUDA_CHECK(cudaMemcpyAsync(P.batch_ids.data(), P.sample_ids, sizeof(int32_t) * B,
                                  cudaMemcpyDeviceToHost, s));
  }
  run.finish(*this, tokens.back());
  // FLOPs as B rows from the first slot's position (each row attends its own context); the
  // host's time to enqueue the step beside it (a step longer on the host than on the GPU leaves
  // the GPU idle between launches).
  if (prof.on()) {
    prof.result("batched step", B, 1, prefill_flops(c, pos.front(), B, B));
    FN_LOG_INFO("batched step: {:.2f} ms to enqueue on the host", enqueue_ms);
  }
  if (sampled) return;  // the sampler flagged a non-finite row (check_step_errors)
  for (std::size_t i = 0; i < P.host_logits.size(); ++i) {
    FN_REQUIRE(std::isfinite(P.host_logits[i]), Format,
               "the model produced a non-finite logit ({} for token {}) in the batched step of "
               "sequence slot {}: the checkpoint's weights hold NaN/Inf or overflow",
               P.host_logits[i], static_cast<int64_t>(i) % V,
               slots[i / static_cast<std::size_t>(V)]);
  }
}

RowResults CudaModel::prefill_slots(std::span<const SlotTokens> pieces, const RowQuery* q) {
  FN_CHECK(!pieces.empty(), "prefill_slots: no pieces");
  std::vector<bool> seen(impl_->slots.size(), false);
  std::vector<int32_t> all;
  for (const SlotTokens& p : pieces) {
    FN_CHECK(p.slot >= 0 && p.slot < slot_count(), "prefill_slots: slot {} outside [0, {})", p.slot,
             slot_count());
    FN_CHECK(!seen[static_cast<std::size_t>(p.slot)], "prefill_slots: slot {} given twice", p.slot);
    seen[static_cast<std::size_t>(p.slot)] = true;
    FN_REQUIRE(!p.tokens.empty(), Usage, "prefill_slots: slot {} has no tokens", p.slot);
    all.insert(all.end(), p.tokens.begin(), p.tokens.end());
  }
  RowResults out;
  if (q == nullptr) {
    run_prefill(all, PrefillLogits::None, nullptr, nullptr, pieces);
    return out;
  }
  FN_REQUIRE(q->first == 0, Usage, "prefill_slots: the query's rows start at {}, not 0", q->first);
  const auto n = static_cast<int64_t>(all.size());
  check_row_query(*q, n, cfg_.vocab_size);
  resize_row_results(out, n, q->gather_k, q->keep_logits, cfg_.vocab_size);
  run_prefill(all, PrefillLogits::Rows, q, &out, pieces);
  return out;
}

std::span<const float> CudaModel::run_prefill(std::span<const int32_t> tokens, PrefillLogits want,
                                              const RowQuery* rq, RowResults* rout,
                                              std::span<const SlotTokens> pieces) {
  Impl& I = *impl_;
  const ModelConfig& c = cfg_;
  const CudaModelOptions& o = opt_;
  const auto n = static_cast<int64_t>(tokens.size());
  FN_REQUIRE(n >= 1, Usage, "the prompt is empty (0 tokens): give at least one token");
  for (int64_t i = 0; i < n; ++i)
    FN_REQUIRE(tokens[i] >= 0 && tokens[i] < c.vocab_size, Usage,
               "prompt token {} (id {}) is outside the vocabulary [0, {})", i, tokens[i],
               c.vocab_size);
  // The sequences of the call: rows g0 .. g0 + rows - 1 of `tokens` on `slot` from `position`.
  struct Seq {
    int64_t slot = 0, g0 = 0, rows = 0, position = 0;
  };
  std::vector<Seq> seqs;
  if (pieces.empty()) {
    seqs.push_back({slot_, 0, n, position_});
  } else {
    FN_CHECK(want == PrefillLogits::None || want == PrefillLogits::Rows,
             "a prefill of several slots returns no logits rows");
    int64_t g = 0;
    for (const SlotTokens& p : pieces) {
      const int64_t pos =
          p.slot == slot_ ? position_ : I.slots[static_cast<std::size_t>(p.slot)].position;
      seqs.push_back({p.slot, g, static_cast<int64_t>(p.tokens.size()), pos});
      g += static_cast<int64_t>(p.tokens.size());
    }
    FN_CHECK(g == n, "prefill_slots: {} tokens for pieces of {}", n, g);
  }
  for (const Seq& q : seqs)
    FN_REQUIRE(q.position + q.rows <= o.ctx_size, Usage,
               "prefilling {} tokens from position {} needs {} tokens of context, more than "
               "-c/--ctx-size {}",
               q.rows, q.position, q.position + q.rows, o.ctx_size);
  const int64_t first_position = seqs.front().position;
  FN_REQUIRE(I.forced_router == nullptr && I.residuals == nullptr, Usage,
             "the batched prefill neither replays choices nor keeps residuals (tests only): "
             "run those prompts through forward()");
  // o.prefill_chunk >= 1: the load checked it (require_prefill_fits).

  ensure_prefill_buffers();
  CudaPrefillState& P = *I.prefill;
  const int64_t V = c.vocab_size;
  PrefillProfiler prof(I.stream, I.prefill_profile);
  Impl::PrefillRun run{I,   P, c, o, rank_dims(c, o.tp_size, o.tp_rank), I.stream, P.blas->get(),
                       prof};
  run.rq = rq;
  run.rout = rout;
  if (want == PrefillLogits::Rows) {
    // The query's ids in, the per-row results out: one grow-only device block.
    const int64_t rows = n - rq->first, k = rq->gather_k;
    CudaPrefillState::RowBuffers& b = P.row_buf;
    const std::size_t need = 3 * piece_bytes<double>(rows * std::max<int64_t>(k, 1)) +
                             3 * piece_bytes<int32_t>(rows * std::max<int64_t>(k, 1));
    if (need > b.bytes) {
      if (b.base) FN_CUDA_CHECK(cudaFree(b.base));
      b.base = nullptr;
      b.bytes = 0;
      void* p = nullptr;
      FN_CUDA_CHECK(cudaMalloc(&p, need));
      b.base = static_cast<std::byte*>(p);
      b.bytes = need;
    }
    std::size_t at = 0;
    const auto take = [&]<typename T>(T*& ptr, int64_t count) {
      ptr = reinterpret_cast<T*>(b.base + at);
      at += piece_bytes<T>(count);
    };
    take(b.targets, rows);
    take(b.gather, rows * k);
    take(b.lse, rows);
    take(b.tlp, rows);
    take(b.argmax, rows);
    take(b.glp, rows * k);
    if (!rq->targets.empty())
      FN_CUDA_CHECK(cudaMemcpyAsync(b.targets, rq->targets.data(), sizeof(int32_t) * rows,
                                    cudaMemcpyHostToDevice, I.stream));
    if (k > 0)
      FN_CUDA_CHECK(cudaMemcpyAsync(b.gather, rq->gather.data(), sizeof(int32_t) * rows * k,
                                    cudaMemcpyHostToDevice, I.stream));
  }
  cudaStream_t s = I.stream;
  // record_choices: every row's router ids and QSA selections, laid out per row as the decode
  // step's choice log (model_detail::choice_log_ints).
  int64_t n_qsa = 0;
  for (const DevLayer& L : I.layers) n_qsa += L.qsa ? 1 : 0;
  run.per_row = model_detail::choice_log_ints(c, n_qsa);
  if (o.record_choices) P.choice_rows.assign(static_cast<std::size_t>(n * run.per_row), 0);
  if (want == PrefillLogits::All)
    P.host_logits.assign(static_cast<std::size_t>(n * V), 0.0f);
  else if (want == PrefillLogits::Last)
    P.host_logits.assign(static_cast<std::size_t>(V), 0.0f);

  int64_t passes = 0;
  for (int64_t c0 = 0; c0 < n; c0 += P.rows) {
    ++passes;
    run.c0 = c0;
    run.M = std::min(P.rows, n - c0);
    run.runs.clear();
    for (const Seq& q : seqs) {  // the sequences' rows in this pass
      const int64_t a = std::max(c0, q.g0), b = std::min(c0 + run.M, q.g0 + q.rows);
      if (a < b) run.runs.push_back({q.slot, a - c0, b - a, q.position + (a - q.g0)});
    }
    const int64_t M = run.M;
    if (run.runs.size() > 1) {  // the runs' rows and slots for the kernels that take them all
      P.host_run_start.clear();
      P.host_run_slot.clear();
      for (const Impl::PrefillRun::Run& r : run.runs) {
        P.host_run_start.push_back(static_cast<int32_t>(r.row0));
        P.host_run_slot.push_back(static_cast<int32_t>(r.slot));
      }
      P.host_run_start.push_back(static_cast<int32_t>(M));
      FN_CUDA_CHECK(cudaMemcpyAsync(P.run_start, P.host_run_start.data(),
                                    sizeof(int32_t) * P.host_run_start.size(),
                                    cudaMemcpyHostToDevice, s));
      FN_CUDA_CHECK(cudaMemcpyAsync(P.run_slot, P.host_run_slot.data(),
                                    sizeof(int32_t) * P.host_run_slot.size(),
                                    cudaMemcpyHostToDevice, s));
    }
    FN_CUDA_CHECK(cudaMemcpyAsync(P.tokens, tokens.data() + c0, sizeof(int32_t) * M,
                                  cudaMemcpyHostToDevice, s));
    run.layers();
    run.logits(want, n);
    run.finish(*this, tokens[c0 + M - 1]);
  }
  if (prof.on()) {
    const int64_t logit_rows = want == PrefillLogits::None   ? 0
                               : want == PrefillLogits::Last ? 1
                               : want == PrefillLogits::All  ? n
                                                             : n - rq->first;
    I.last_prefill_profile =
        prof.result("prefill", n, passes, prefill_flops(c, first_position, n, logit_rows));
  }

  if (want == PrefillLogits::None) return {};
  if (want == PrefillLogits::Rows) {
    const int64_t rows = n - rq->first, k = rq->gather_k;
    const CudaPrefillState::RowBuffers& b = P.row_buf;
    FN_CUDA_CHECK(
        cudaMemcpyAsync(rout->lse.data(), b.lse, sizeof(double) * rows, cudaMemcpyDeviceToHost, s));
    FN_CUDA_CHECK(cudaMemcpyAsync(rout->target_logprob.data(), b.tlp, sizeof(double) * rows,
                                  cudaMemcpyDeviceToHost, s));
    FN_CUDA_CHECK(cudaMemcpyAsync(rout->argmax.data(), b.argmax, sizeof(int32_t) * rows,
                                  cudaMemcpyDeviceToHost, s));
    if (k > 0)
      FN_CUDA_CHECK(cudaMemcpyAsync(rout->gather_logprob.data(), b.glp, sizeof(double) * rows * k,
                                    cudaMemcpyDeviceToHost, s));
    FN_CUDA_CHECK(cudaStreamSynchronize(s));
    // Only targets of -1 leave NaN in target_logprob: the kernel's NaN for a non-finite row is
    // its lse.
    for (int64_t r = 0; r < rows; ++r) {
      FN_REQUIRE(std::isfinite(rout->lse[static_cast<std::size_t>(r)]), Format,
                 "the model produced a non-finite logit in row {} of a prefill of {} tokens "
                 "from position {}: the checkpoint's weights hold NaN/Inf or overflow",
                 rq->first + r, n, first_position);
    }
    return {};
  }
  for (std::size_t i = 0; i < P.host_logits.size(); ++i) {
    FN_REQUIRE(std::isfinite(P.host_logits[i]), Format,
               "the model produced a non-finite logit ({} for token {}) in the prefill of "
               "positions {}..{}: the checkpoint's weights hold NaN/Inf or overflow",
               P.host_logits[i], static_cast<int64_t>(i) % V, position_ - n, position_ - 1);
  }
  return {P.host_logits.data(), P.host_logits.size()};
}
}  // namespace fn

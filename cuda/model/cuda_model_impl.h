// Internal to cuda/model (not a public header): the device-side state of one CudaModel — its
// arena, kernel plan, per-layer weight views, sequence state and activation buffers — shared by
// load.cpp (weights, arena, states), step*.cpp (the decode step), decode.cpp (its graphs and the
// decode loop), profile.cpp, testing.cpp and cuda_prefill.cpp (the batched prefill). The
// invariants are CudaModel's (cuda_model.h): everything the decode graph touches is allocated
// before its first capture; prefill buffers live apart and are never captured.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "core/device_layout.h"
#include "core/error.h"
#include "core/ngram.h"
#include "core/shard_plan.h"
#include "cuda/common/cuda_check.h"
#include "cuda/kernels/logit_stats.h"
#include "cuda/kernels/moe_nvfp4.h"
#include "cuda/kernels/ple.h"
#include "cuda/kernels/qsa.h"
#include "cuda/kernels/sample.h"
#include "cuda/model/cuda_model.h"
#include "cuda/model/cuda_model_testing.h"
#include "cuda/model/kernel_plan.h"

namespace fn {
namespace model_detail {

class WeightSource;      // load.cpp: where load()/random() take the weights from
class CheckpointSource;  // load.cpp
struct Builder;          // load.cpp: loads one weight or group of weights into the arena

/// The QSA kernels' shape fields for this rank (local heads, RoPE, indexer; no pointers).
QsaDecodeParams qsa_shape(const ModelConfig& c, const CudaModelOptions& o);

// ---- device memory -----------------------------------------------------------------------------

// Every device allocation of the model: weights and (in one block) states + activations. All of
// it is allocated before the first capture and freed with the model.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() {
    for (void* p : blocks_) cudaFree(p);
  }
  // A fresh zeroed block of `bytes` (256-byte aligned). Throws fn::Error(Cuda) naming the size.
  void* alloc(std::size_t bytes, const char* what) {
    void* p = nullptr;
    const std::size_t n = std::max<std::size_t>(bytes, 256);
    const cudaError_t rc = cudaMalloc(&p, n);
    if (rc != cudaSuccess) {
      cudaGetLastError();
      std::size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      FN_THROW(Cuda,
               "out of device memory allocating {:.2f} MiB for {} ({:.2f} GiB held by the model, "
               "{:.2f} GiB free of {:.2f} GiB): {}",
               n / 1048576.0, what, held_ / 1073741824.0, free_b / 1073741824.0,
               total_b / 1073741824.0, cudaGetErrorString(rc));
    }
    FN_CUDA_CHECK(cudaMemset(p, 0, n));
    blocks_.push_back(p);
    held_ += n;
    return p;
  }
  // alloc for per-sequence state and scratch (counted apart from the weights).
  void* alloc_state(std::size_t bytes, const char* what) {
    const uint64_t before = held_;
    void* p = alloc(bytes, what);
    state_held_ += held_ - before;
    return p;
  }
  template <typename T>
  T* alloc_n(int64_t count, const char* what) {
    return static_cast<T*>(alloc(static_cast<std::size_t>(count) * sizeof(T), what));
  }
  uint64_t held() const noexcept { return held_; }
  uint64_t state_held() const noexcept { return state_held_; }

 private:
  std::vector<void*> blocks_;
  uint64_t held_ = 0;
  uint64_t state_held_ = 0;
};

// Carves one allocation into 256-byte aligned pieces: sized in a first pass (base == nullptr),
// assigned in the second.
class Carver {
 public:
  explicit Carver(std::byte* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    const std::size_t bytes =
        (static_cast<std::size_t>(std::max<int64_t>(count, 1)) * sizeof(T) + 255) &
        ~std::size_t{255};
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += bytes;
    return p;
  }
  std::size_t used() const noexcept { return used_; }

 private:
  std::byte* base_;
  std::size_t used_ = 0;
};

// ---- device weights and states of one layer ----------------------------------------------------

struct DevHc {
  const uint16_t* norm = nullptr;      // [W] BF16
  const uint16_t* down_inj = nullptr;  // [R (+ S), W] BF16
  int64_t down_rows = 0;               // R + S, or R for the final mixer
  const uint16_t* up = nullptr;        // [W, R] BF16
};

struct DevGdn {
  const uint16_t* in_proj = nullptr;  // [conv_l + Hv*dv + 2*Hv, D]: qkv | z | a | b
  int64_t in_rows = 0;
  const uint16_t* out = nullptr;  // [D, Hv*dv]
  float *conv = nullptr, *A_log = nullptr, *dt_bias = nullptr, *norm = nullptr;
  float* conv_state = nullptr;  // [conv_l, K-1]
  float* S = nullptr;           // [Hv, dk, dv]
  unsigned int* counters = nullptr;
  float* o_scratch = nullptr;
};

struct DevQsa {
  const uint16_t* in_proj = nullptr;  // [Hq*2hd + 2*Hkv*hd + (ni+1)*ihd, D]
  int64_t in_rows = 0;
  const uint16_t* o = nullptr;  // [D, Hq*hd]
  float *q_norm = nullptr, *k_norm = nullptr, *iq_norm = nullptr, *ik_norm = nullptr;
  uint16_t *k_cache = nullptr, *v_cache = nullptr;
  float *raw_keys = nullptr, *block_keys = nullptr;
  void* workspace = nullptr;
};

struct DevMoe {
  const uint16_t* router = nullptr;     // [E + 1, D]: router rows, then shared_expert_gate
  const uint16_t* s_gate_up = nullptr;  // [2*Is, D]
  const uint16_t* s_down = nullptr;     // [D, Is]
  Nvfp4Experts gate_up, down;
};

struct DevPle {
  const uint16_t* kv_proj = nullptr;  // [S*P + D, P]: key_proj | value_proj
  float *norm_key = nullptr, *norm_query = nullptr, *norm_conv = nullptr, *conv = nullptr;
  float* conv_state = nullptr;
  // This rank's n-gram rows: device memory, or with on_host the device-mapped pointer of pinned
  // host memory (--ngram-table host).
  const uint8_t* rows = nullptr;
  bool on_host = false;
  // on_host: FP32 [ple_embed_dim], the n-gram embedding the decode step gathers at its start on
  // the side stream (Impl::step_ngram_fork), read by the PLE layer after the join.
  float* staged = nullptr;
  int64_t first_row = 0, row_count = 0;
  bool fp8 = true;
  float scale = 1.0f;
  NgramConstants consts;
};

struct DevLayer {
  bool qsa = false;
  bool has_ple = false;
  DevPle ple;
  DevHc attn_hc, mlp_hc;
  DevGdn gdn;
  DevQsa attn;
  DevMoe moe;
};

// One sequence slot's caches and states, per layer (slot 0's are the layers' own, which the
// decode graph captures; a further slot's are allocated for it at load), its n-gram context and
// what reset() zeroes.
struct DevSlotLayer {
  float* ple_conv = nullptr;    // PLE layers: [W, (K-1)*dilation]
  float* gdn_conv = nullptr;    // GDN layers: [conv_l, K-1]
  float* gdn_state = nullptr;   // GDN layers: [Hv, dk, dv]
  uint16_t* k_cache = nullptr;  // QSA layers: the caches of qsa_layer
  uint16_t* v_cache = nullptr;
  float* raw_keys = nullptr;
  float* block_keys = nullptr;
};

struct DevSlot {
  std::vector<DevSlotLayer> layers;  // [num_hidden_layers]
  int64_t* context = nullptr;        // device [max(ngram_size - 1, 1)]
  int64_t position = 0;              // host: the slot's position while it is not selected
  std::vector<std::pair<void*, std::size_t>> blocks;  // zeroed by its reset (slots >= 1)
  // The sampler's penalty window (ctx_size + 1 ids), allocated at the slot's first sample with
  // penalties (CudaModel::penalty_window); loaded at each sequence's first sample, not part of
  // the sequence state that reset, snapshot and copy_slot handle.
  DevicePenaltyWindow penalty;
};

/// qsa_shape plus QSA layer `a`'s norms and caches (what launch_qsa_decode and
/// launch_qsa_prefill share; projections, position, workspace and output left for the caller).
QsaDecodeParams qsa_layer(const ModelConfig& c, const CudaModelOptions& o, const DevQsa& a);

/// The fields launch_gdn_decode and launch_gdn_prefill share (GdnDecodeParams /
/// GdnPrefillParams): layer `g`'s weights and states and this rank's GDN shape.
template <class Params>
void set_gdn_layer(Params& p, const ModelConfig& c, const RankDims& rd, const DevGdn& g) {
  p.conv_weight = g.conv;
  p.A_log = g.A_log;
  p.dt_bias = g.dt_bias;
  p.norm_weight = g.norm;
  p.conv_state = g.conv_state;
  p.state = g.S;
  p.num_k_heads = static_cast<int>(rd.linear_k_heads);
  p.num_v_heads = static_cast<int>(rd.linear_v_heads);
  p.k_head_dim = static_cast<int>(c.linear_key_head_dim);
  p.v_head_dim = static_cast<int>(c.linear_value_head_dim);
  p.conv_kernel = static_cast<int>(c.linear_conv_kernel_dim);
  p.eps = static_cast<float>(c.rms_norm_eps);
}

/// The n-gram gather's constants and table view for the PLE layer `pl` (token, context and out
/// left for the caller).
NgramGatherParams ngram_gather_params(const ModelConfig& c, const DevPle& pl);
/// The PLE apply's weights, state and sizes for `pl` (kv and H left for the caller).
PleApplyParams ple_apply_params(const ModelConfig& c, const DevPle& pl);

/// Ints per step (or prefill row) of the choice log: the router's top-k ids of every layer, then
/// per QSA layer the selected blocks (block_topk slots) and the counters {count, B, tokens, 0}.
int64_t choice_log_ints(const ModelConfig& c, int64_t qsa_layers);
/// Decodes one step's choice log (choice_log_ints ints) into StepChoices. Throws
/// fn::Error(Internal) on a selected-block count outside [0, block_topk].
StepChoices choices_from_log(const ModelConfig& c, int64_t qsa_layers, const int32_t* log);

/// Captures what `encode` enqueues on `stream` into a graph (decode.cpp; the caller destroys
/// it). Ends the capture when `encode` throws and rethrows; fn::Error(Cuda) when capture fails.
cudaGraph_t capture_stream(cudaStream_t stream, const std::function<void()>& encode);

/// capture_stream, instantiated (the graph itself destroyed). fn::Error(Cuda) when capture or
/// instantiation fails.
cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& encode);

/// The token fed first must be in the vocabulary and `count` steps from `position` must fit the
/// cache (fn::Error(Usage) otherwise, naming -c/--ctx-size; `doing` and `unit` word the message,
/// e.g. "decoding", "tokens"); `count_ok` is the caller's lower bound on count.
void require_steps(const ModelConfig& c, int32_t token, bool count_ok, int64_t count,
                   const char* doing, const char* unit, int64_t position, int64_t ctx_size);

/// Rows of one batched prefill pass: --prefill-chunk, capped at -c/--ctx-size times the slots
/// (a pass holds pieces of at most every slot's sequence, each within -c: prefill_slots, the
/// batched step); with as many slots as fit (o.slots 0) the chunk alone.
int64_t pass_rows(const CudaModelOptions& o);
/// Device bytes of the batched prefill's pass buffers (cuda_prefill.cpp, allocated at the first
/// prefill()) for pass_rows(o) tokens per pass.
std::size_t prefill_buffer_bytes(const ModelConfig& c, const CudaModelOptions& o,
                                 const std::vector<DevLayer>& layers, int64_t v_local);
/// Logs prefill_buffer_bytes on rank 0 and refuses (fn::Error(Usage), naming the bytes, the
/// free memory and --prefill-chunk) when they exceed the device's free memory now, so a model
/// that loads never fails later at its first prompt for want of pass buffers.
void require_prefill_fits(const ModelConfig& c, const CudaModelOptions& o,
                          const std::vector<DevLayer>& layers, int64_t v_local);

}  // namespace model_detail

struct CudaPrefillState;

struct CudaModel::Impl {
  model_detail::DeviceArena arena;
  KernelPlan plan;  // decided at load (build)
  cudaStream_t stream = nullptr;
  bool own_stream = false;
  bool prefill_profile = false;                        // set_prefill_profile
  std::optional<PrefillProfile> last_prefill_profile;  // the last profiled prefill call's
  std::vector<model_detail::DevLayer> layers;
  model_detail::DevHc final_hc;
  const uint16_t* embed = nullptr;    // [V, D]
  const uint16_t* lm_head = nullptr;  // [V/tp, D]
  int64_t v_local = 0, v_first = 0;

  // Activations and step scalars (one block).
  float* H = nullptr;           // [W] FP32 residual (embed writes it at every step)
  float* H_alt = nullptr;       // [W] FP32 the other residual buffer of the fused HC inject
  float* t = nullptr;           // [hc_down_splits(S, D), R + S] partial dots of the HC down pass
  float* sumsq = nullptr;       // [hc_down_splits(S, D)] partial sums of H^2 (HC down pass)
  float* m = nullptr;           // [D] FP32 block input (every BF16 GEMV reads it as FP32)
  uint16_t* m_bf16 = nullptr;   // [D] BF16 copy of the MLP-side m for the NVFP4 experts (W4A16)
  float* iota = nullptr;        // [S]
  float* proj = nullptr;        // [max in rows] FP32
  uint16_t* mix_out = nullptr;  // [max(Hv*dv, Hq*hd)] BF16
  float* y = nullptr;           // [D] FP32
  float* rl = nullptr;          // [E + 1] router logits + shared gate logit
  int32_t* ids = nullptr;       // [k]
  float* rw = nullptr;          // [k]
  uint16_t* h = nullptr;        // [k, I_l] BF16
  float* sgu = nullptr;         // [2 Is] FP32
  float* e_ng = nullptr;        // [P] FP32
  float* kvp = nullptr;         // [S*P + D] FP32
  float* logits_local = nullptr;
  float* logits = nullptr;          // [V] full
  int32_t* token = nullptr;         // device: the step's input id
  int64_t* position = nullptr;      // device: its position
  int64_t host_slot0_position = 0;  // copy_slot's source of a position update of slot 0
  int64_t* context = nullptr;       // device [ngram_size - 1]
  int32_t* error_flag = nullptr;
  float* router_mailbox = nullptr;  // launch_router_shared_gate_up's mailbox (empty: reset_state)
  int64_t* sample_step = nullptr;
  // Test-only buffers (CudaModelTestOptions; nullptr otherwise).
  float* residuals = nullptr;        // [2 * layers + PLE layers, W] (keep_residuals)
  int32_t* forced_router = nullptr;  // [layers, k] (replay_choices)
  int32_t* forced_blocks = nullptr;  // [QSA layers, block_topk] (replay_choices)
  int32_t* choice_log = nullptr;  // [layers * k + QSA layers * (block_topk + 4)] (record_choices)
  int32_t* history = nullptr;
  int64_t history_capacity = 0;
  void* sample_ws = nullptr;
  std::size_t sample_ws_bytes = 0;
  // decode()'s top log-probs (launch_top_logprobs after the sampler), allocated by the first
  // decode() that asks for them.
  void* top_lp_ws = nullptr;
  std::size_t top_lp_ws_bytes = 0;
  TopLogprobsOut* top_lp = nullptr;       // device: the step's sampled id's log-probs
  TopLogprobsOut* host_top_lp = nullptr;  // pinned [2]: per decode() slot

  float* host_logits = nullptr;   // pinned [V]
  int32_t* host_token = nullptr;  // pinned [3]: the fed id, then decode()'s two id slots
  int32_t* host_flag = nullptr;   // pinned [2]: the error flag, per decode() slot

  cudaGraphExec_t logits_graph = nullptr;
  cudaGraphExec_t sample_graph = nullptr;
  cudaGraphExec_t profile_graph = nullptr;  // sample_graph with event record nodes
  // sample_graph plus the top log-probs of logprobs_graph_k alternatives (decode() with
  // top_logprobs >= 0); sample_graph itself never holds them.
  cudaGraphExec_t logprobs_graph = nullptr;
  int64_t logprobs_graph_k = -1;

  // profile_steps: a CUDA event at every family boundary of a step while `marks` is set.
  struct Marks {
    std::vector<cudaEvent_t> events;
    std::vector<int> family;  // family of the segment that starts at events[i]; last: end
    std::size_t used = 0;
    bool external = false;  // recorded inside a capture (event record nodes)
  };
  Marks* marks = nullptr;
  Marks eager_marks, graph_marks;
  // Records the start of a `family` segment (nothing unless profiling; a repeated family
  // continues its segment).
  void mark(StepFamily family) { mark_index(static_cast<int>(family)); }
  void mark_end() { mark_index(kStepFamilyCount); }
  void mark_index(int family) {
    if (marks == nullptr) return;
    Marks& mk = *marks;
    if (mk.used > 0 && mk.family[mk.used - 1] == family) return;
    FN_CHECK(mk.used < mk.events.size(), "more than {} family boundaries in a step",
             mk.events.size());
    cudaEvent_t e = mk.events[mk.used];
    if (mk.external) {
      FN_CUDA_CHECK(cudaEventRecordWithFlags(e, stream, cudaEventRecordExternal));
    } else {
      FN_CUDA_CHECK(cudaEventRecord(e, stream));
    }
    mk.family[mk.used++] = family;
  }
  DeviceSamplingParams sample_graph_params{};
  uint64_t weight_bytes = 0;
  int64_t captures = 0;

  // Plans the kernels, loads every weight from `src` and allocates the states, activations and
  // the test-only buffers of `test` (load.cpp).
  // `ngram_on_host`: the n-gram tables in pinned, mapped host memory (place_ngram_table).
  void build(const ModelConfig& c, const CudaModelOptions& o, const CudaModelTestOptions& test,
             model_detail::WeightSource& src, model_detail::CheckpointSource* ck, bool ngram_fp8,
             bool ngram_on_host);
  // build's parts: layer li's weights and states (at the layout's sizes), the activation block
  // carved at the layout's offsets, the test-only buffers.
  void build_layer(model_detail::Builder& b, const DeviceLayout& lay, int64_t li);
  void carve_activations(const DeviceLayout& lay);
  void alloc_test_buffers(const ModelConfig& c, const CudaModelTestOptions& test);
  // Enqueues one decode step on `stream` (the token at *token, position *position); with
  // `sampling`, also samples the next id into *token and records it in history, and with
  // top_logprobs >= 0 (and sampling) reduces the logits to that id's log-probs and the
  // top_logprobs best alternatives into *top_lp (step.cpp).
  void encode_step(const ModelConfig& c, const CudaModelOptions& o,
                   const DeviceSamplingParams* sampling, int64_t top_logprobs = -1);

  // ---- the blocks of encode_step (step.cpp, step_mixers.cpp, step_moe.cpp) ----
  // Where one step's encoding stands: the residual lives in H or H_alt (the folded HC inject
  // writes the injected residual to the other buffer); `pending`: an inject waits for the next
  // HC read (its debug-residual slot in pending_slot).
  struct Step {
    const ModelConfig& c;
    const CudaModelOptions& o;
    RankDims rd;
    float* H = nullptr;
    bool pending = false;
    int64_t injects = 0, pending_slot = 0;
    bool ngram_joined = true;  // false from step_ngram_fork until the first PLE layer joins
  };
  void step_embed(Step& st);
  // Host-resident n-gram tables: forks ngram_stream off the step's start and gathers every such
  // PLE layer's rows into its `staged` buffer there; step_ple joins before the first use.
  void step_ngram_fork(Step& st);
  // PLE (docs/model.md §C.4): n-gram gather, all-reduce, key/value GEMV, apply onto the residual.
  void step_ple(Step& st, const model_detail::DevPle& pl);
  // The HC read (hc.h): the split-K down (+ pending inject) pass, then the mix into m (and its
  // BF16 copy m_out_bf16, MLP side only) and iota_out (nullptr for the final mixer).
  void step_hc_read(Step& st, const model_detail::DevHc& hc, float* iota_out, uint16_t* m_out_bf16);
  // Marks the block output y for injection: folded into the next HC read (plan.fold_hc_inject)
  // or launched now.
  void step_inject(Step& st);
  // Launches a pending inject alone (before a PLE apply, which adds to the injected residual).
  void step_settle(Step& st);
  // The QSA mixer (projection beside the indexer select, attention, o_proj) into y.
  void step_qsa(Step& st, const model_detail::DevQsa& a, int64_t qsa_index);
  // The GDN mixer (projections around the recurrence, out_proj) into y.
  void step_gdn(Step& st, const model_detail::DevGdn& g);
  // The MoE block into y: router + top-k + shared gate/up, routed gate+up (prefetching the next
  // HC read's weights into L2) and down, shared down + combine (prefetching the next layer's
  // input projection). `next_hc`: the HC read after this block; `next`: the next layer or null.
  void step_moe(Step& st, const model_detail::DevMoe& mo, int64_t layer_index,
                const model_detail::DevHc& next_hc, const model_detail::DevLayer* next);
  // lm_head (vocab slice, scatter + all-reduce at TP > 1), n-gram context advance, sampling, the
  // top log-probs (top_logprobs >= 0) and the position advance.
  void step_logits(Step& st, const DeviceSamplingParams* sampling, int64_t top_logprobs);
  void step_all_reduce(Step& st, float* buf, int64_t count);
  void step_keep_residual(Step& st, int64_t slot);
  // Zeroes the states, fills the n-gram context with EOS, position 0.
  void reset_state(const ModelConfig& c);
  std::vector<std::pair<void*, std::size_t>> state_blocks;  // zeroed by reset_state
  // Sequence slots (CudaModelOptions::slots): [0] points at the layers' own states and
  // `context`; the others own theirs (alloc_slots, load.cpp).
  std::vector<model_detail::DevSlot> slots;
  int64_t usable_slots = 0;  // CudaModel::limit_slots (0: every slot)
  void alloc_slots(const ModelConfig& c, const CudaModelOptions& o, const DeviceLayout& lay);
  // The slots' state pointers on the device, for kernels that run several slots' rows in one
  // launch (the batched step): [layer][SlotField][slot], made after alloc_slots.
  enum SlotField {
    kSlotGdnState,
    kSlotGdnConv,
    kSlotKCache,
    kSlotVCache,
    kSlotRawKeys,
    kSlotBlockKeys,
    kSlotFields
  };
  void** slot_table = nullptr;
  void build_slot_table();
  template <typename T>
  T* const* slot_pointers(int64_t layer, SlotField f) const {
    return reinterpret_cast<T* const*>(slot_table + (layer * kSlotFields + f) *
                                                        static_cast<int64_t>(slots.size()));
  }
  DeviceLayout slot_layout;  // the per-layer state sizes every slot has (copy_slot)
  // Zeroes slot `slot`'s states and fills its n-gram context with EOS (slot 0: reset_state).
  void reset_slot(const ModelConfig& c, int64_t slot);
  // snapshot()'s slot (decode.cpp): the state blocks and the n-gram context, back to back;
  // allocated at the first snapshot. snap_position < 0: none taken yet.
  std::byte* snap = nullptr;
  int64_t snap_position = -1;

  // Host-resident n-gram tables (CudaModelOptions::ngram_table): the pinned allocations, the
  // side stream of their decode gathers, and its fork and join events (none without them).
  std::vector<void*> ngram_host;
  uint64_t ngram_host_bytes = 0;
  cudaStream_t ngram_stream = nullptr;
  cudaEvent_t ngram_fork = nullptr, ngram_join = nullptr;

  // The batched prefill's buffers and cuBLAS handle (cuda_prefill.cpp), made on first use;
  // shared_ptr because CudaPrefillState is complete only there.
  std::shared_ptr<CudaPrefillState> prefill;
  // One prefill() call's pass encoders (cuda_prefill.cpp).
  struct PrefillRun;

  ~Impl() {
    prefill.reset();  // its cuBLAS handle is bound to `stream`
    if (logits_graph) cudaGraphExecDestroy(logits_graph);
    if (sample_graph) cudaGraphExecDestroy(sample_graph);
    if (profile_graph) cudaGraphExecDestroy(profile_graph);
    if (logprobs_graph) cudaGraphExecDestroy(logprobs_graph);
    for (Marks* mk : {&eager_marks, &graph_marks}) {
      for (cudaEvent_t e : mk->events) cudaEventDestroy(e);
    }
    if (snap) cudaFree(snap);
    if (host_logits) cudaFreeHost(host_logits);
    if (host_token) cudaFreeHost(host_token);
    if (host_flag) cudaFreeHost(host_flag);
    if (host_top_lp) cudaFreeHost(host_top_lp);
    if (ngram_stream) cudaStreamSynchronize(ngram_stream);
    for (void* block : ngram_host) cudaFreeHost(block);
    if (ngram_fork) cudaEventDestroy(ngram_fork);
    if (ngram_join) cudaEventDestroy(ngram_join);
    if (ngram_stream) cudaStreamDestroy(ngram_stream);
    if (stream && own_stream) cudaStreamDestroy(stream);
  }
};

}  // namespace fn

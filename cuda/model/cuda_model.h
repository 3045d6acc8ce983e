// CudaModel: the CUDA decode backend (docs/model.md §C, tensor-parallel per §E.2) of one TP rank —
// its weights in device memory, the per-sequence state (KV and indexer-key caches, GDN conv and
// recurrent states, PLE conv states and n-gram context) sized from the context length, and one
// decode step captured once as a CUDA graph and replayed per token. Called by `fngen generate`,
// `fngen eval` and `fngen bench` (random weights, profile_steps) with `--backend cuda`. Invariants:
// everything is allocated before capture; the graph reads the token id and the position from device
// memory, so replays never re-capture; every rank runs the same launches and all-reduces in the
// same order; forward() returns the same full-vocabulary FP32 logits on every rank.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/config.h"
#include "core/memory_plan.h"
#include "core/row_stats.h"
#include "core/sampler.h"
#include "cuda/kernels/sample.h"

namespace fn {

class DeviceAllReduce;

struct CudaModelTestOptions;

/// How the CUDA model is set up: the choices a user makes. Which kernel variant runs each op is
/// not an option: the model decides it once at load from the device and the shapes
/// (cuda/model/kernel_plan.h).
struct CudaModelOptions {
  int64_t ctx_size = 4096;  ///< tokens of KV / indexer cache per sequence (-c/--ctx-size)
  bool use_graph = true;    ///< false: run the step eagerly (`--no-graph`); same results
  int tp_rank = 0;          ///< this rank
  int tp_size = 1;          ///< ranks of the group (1, 2, 4, 8)
  /// Sum all-reduce over the group; required when tp_size > 1 (not owned; must outlive the
  /// model). Called in the same order on every rank.
  DeviceAllReduce* all_reduce = nullptr;
  /// The stream every step runs on; nullptr: the model creates its own. An all-reduce instance
  /// serves one stream, so models sharing `all_reduce` must share the stream (not owned).
  cudaStream_t stream = nullptr;
  /// Debug (`--check-choices`): copy every layer's router expert ids and every QSA layer's
  /// selected block ids out of each step into a log that last_choices() reads.
  bool record_choices = false;
  /// Tokens per batched prefill pass (`--prefill-chunk`): prefill() splits a longer
  /// prompt into passes of at most this many tokens, each continuing from the states the last
  /// one left. Capped at ctx_size times the slots (model_detail::pass_rows); the pass
  /// buffers (allocated on the first prefill()) scale with it: about 0.3 MB per token at the real
  /// TP=1 geometry. >= 1.
  int64_t prefill_chunk = 8192;
  /// Where the PLE n-gram table lives (`--ngram-table`, core/memory_plan.h place_ngram_table):
  /// Host keeps this rank's rows in pinned, device-mapped host memory that the gather kernels read
  /// over PCIe / C2C (decode: a forked branch at the start of the step; prefill: one pass per
  /// chunk); Auto picks Host when the model with the table does not fit gpu_memory_utilization
  /// of the free device memory. Same logits either way.
  NgramTable ngram_table = NgramTable::Auto;
  /// `--gpu-memory-utilization`: the fraction of the free device memory (at load) Auto lets the
  /// model use with the table on the device, in (0, 1].
  double gpu_memory_utilization = kDefaultGpuMemoryUtilization;
  /// Sequence slots (`--max-batch`): slot 0 is the sequence of the decode graph; each further
  /// slot holds its own caches and states (the per-sequence bytes of core/memory_plan.h again)
  /// for forward_batch(). At most prefill_chunk (a batched step is one pass);
  /// 0: as many as fit the free memory after the weights and the prefill's pass buffers, with
  /// 1 GiB left over, at most 64 (slot_count() tells).
  int64_t slots = 1;
};

/// Which logits CudaModel::prefill returns.
enum class PrefillLogits {
  None,  ///< none (the caller decodes from the last token itself)
  Last,  ///< the last token's [vocab_size]
  All,   ///< every token's, [n, vocab_size] row-major (tests; n * vocab_size floats of host memory)
  Rows,  ///< prefill_rows(): per-row reductions on the device (nothing returned as a span)
};

/// The discrete choices of one decode step (the layout of CpuModel::Choices): router = per
/// decoder layer, the top-k expert ids best first; indexer = per QSA layer in layer order, the
/// selected block ids ascending, empty while every complete block is selected (B <= block_topk).
struct StepChoices {
  std::vector<std::vector<int32_t>> router;
  std::vector<std::vector<int32_t>> indexer;
};

/// The op families of one decode step, for CudaModel::profile_steps (the per-op breakdown of
/// `fngen bench`). Each launch of the step belongs to exactly one family.
enum class StepFamily : int {
  Hc,        ///< HC read (fused norm + down/inject pass, mix) and HC inject; final mixer
  GdnMixer,  ///< GDN: stacked input projection GEMV, the GDN decode kernel, out_proj GEMV
  QsaMixer,  ///< QSA: stacked q/k/v/indexer projection GEMV, the QSA kernels, o_proj GEMV
  /// router (+ shared_expert_gate row) GEMV, top-k (and forced choices) and the shared
  /// expert's gate/up rows: one launch (cuda/kernels/moe_shared.h)
  Router,
  RoutedMoe,  ///< NVFP4 gate-up and down of the top-k experts
  /// the shared expert's SwiGLU, down GEMV and gated combine: one launch
  SharedExpert,
  AllReduce,  ///< every all-reduce of the step (TP > 1; PLE, mixer, MoE, logits)
  LmHead,     ///< lm_head GEMV, logit scatter, sampling, n-gram context and position advance
  /// PLE: n-gram gather, key/value GEMV, apply (its all-reduce is AllReduce); with the table
  /// in host memory the gather runs on a side stream from the step's start, timed in no family
  Ple,
  Other,  ///< the embedding row and anything else
};
inline constexpr int kStepFamilyCount = 10;
/// "hc", "gdn", "qsa", "router", "moe_routed", "shared_expert", "all_reduce", "lm_head",
/// "ple", "other".
const char* step_family_name(StepFamily f) noexcept;

/// What CudaModel::profile_steps measured: milliseconds per step, by family.
struct StepProfile {
  std::array<double, kStepFamilyCount> ms{};  ///< per step, indexed by StepFamily
  double step_ms = 0;                         ///< per step, first to last event (the sum of `ms`)
  int64_t steps = 0;                          ///< steps averaged
  bool in_graph = false;  ///< timed inside a CUDA graph (event nodes) instead of eagerly
  /// Event-delimited segments of each family in one step (a family's launches between two
  /// boundaries form one segment; each costs one event record).
  std::array<int64_t, kStepFamilyCount> segments{};
  int64_t events = 0;  ///< events recorded per step (segments + 1)
};

/// What one profiled prefill call measured (CudaModel::set_prefill_profile): each family's
/// milliseconds over the whole call (events at every family boundary, every pass summed) and its
/// FLOPs (core/flops.h prefill_flops, rank 0's model-wide count; 0 where none is counted).
struct PrefillProfile {
  std::array<double, kStepFamilyCount> ms{};     ///< indexed by StepFamily
  std::array<double, kStepFamilyCount> flops{};  ///< indexed by StepFamily
  int64_t tokens = 0;                            ///< prompt tokens of the call
  int64_t passes = 0;                            ///< passes it took (--prefill-chunk)
};

/// Loading statistics.
struct CudaLoadStats {
  uint64_t bytes = 0;         ///< weight bytes copied to (or generated on) the device
  double seconds = 0;         ///< wall time of the weight load
  uint64_t weight_bytes = 0;  ///< device bytes held by weights
  uint64_t state_bytes = 0;   ///< device bytes of caches, states and activations
  /// Pinned host bytes of the n-gram table (CudaModelOptions::ngram_table resolved to Host),
  /// else 0.
  uint64_t ngram_host_bytes = 0;
  /// Where the n-gram table went and why (place_ngram_table's reason), e.g. "--ngram-table host".
  std::string ngram_placement;
};

/// The device sampler's settings (cuda/kernels/sample.h) for `sampling` with RNG seed `seed`:
/// temperature, top-k/p, min-p and the penalties as the host sampler holds them (FP32 for the
/// filters, FP64 for the penalties); the penalty window is left unset.
DeviceSamplingParams device_sampling_params(const SamplingParams& sampling, uint64_t seed);

/// One TP rank's CUDA model and sequence state.
class CudaModel {
 public:
  /// Loads checkpoint directory `dir` for options.tp_rank of options.tp_size (validated as
  /// open_model does, core/rank_slices.h), reading only this rank's slices, onto the current
  /// CUDA device. Throws fn::Error: Io/Format for bad files (naming file and tensor), Usage for
  /// a TP size that does not divide the model or a context beyond max_position_embeddings,
  /// Format for models this backend does not run (BF16 experts, ple_embed_dim != hidden_size,
  /// hc_count != 4, hidden_size > 2560, a per-rank shared-expert intermediate size that is not a
  /// multiple of 8 in [8, 8192]), Cuda when device memory runs out (naming the bytes needed).
  /// Logs the kernel plan (cuda/model/kernel_plan.h) at debug level on rank 0, and where the
  /// n-gram table goes and why (options.ngram_table, place_ngram_table) at info level on rank 0.
  /// With the table in host memory: Usage when the host's MemAvailable is below this rank's share
  /// of the table (checked before allocating anything),
  /// Cuda when the pinned allocation fails.
  /// Rank 0 shows a progress line on stderr while the weights stream in (core/progress.h).
  static std::unique_ptr<CudaModel> load(const std::filesystem::path& dir,
                                         const CudaModelOptions& options);

  /// The full geometry of `config` (e.g. configs/qwen3.8-flash-next.json) with random weights
  /// generated directly in device memory, in exactly the layout load() produces (core/synth.h's
  /// distributions; NVFP4 experts with random codes). For benchmarks without a 130 GB file.
  /// Deterministic in `seed`; a host-resident n-gram table (options.ngram_table) holds the same
  /// bytes the device table would (generated on the device shard by shard and copied out), so
  /// both placements give the same logits. Throws as load().
  /// `quant` is the checkpoint's quantization description (config.json's quantization_config):
  /// it decides which tensors are NVFP4 and whether the n-gram table is FP8.
  static std::unique_ptr<CudaModel> random(const ModelConfig& config, const QuantConfig& quant,
                                           uint64_t seed, const CudaModelOptions& options);

  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  /// One decode step for `token` at position(): updates every state and returns the vocab_size
  /// FP32 logits (identical on every rank; valid until the next call). Replays the step graph
  /// (captured on the first call) unless use_graph is false. Throws fn::Error(Usage) for a token
  /// outside the vocabulary or a full context (naming -c/--ctx-size), fn::Error(Format) when
  /// the logits are not finite. On a selected slot other than 0 it is forward_batch() of that
  /// slot alone (the graph holds slot 0's states).
  std::span<const float> forward(int32_t token);

  /// Batched prefill (docs/model.md §D): runs `tokens` at positions position() ..
  /// position() + n - 1 as forward() would one by one, in passes of at most
  /// CudaModelOptions::prefill_chunk tokens: per layer, cuBLAS GEMMs for the dense projections
  /// (FP32 activations as BF16 hi + lo, cuda/kernels/gemm.h), the GDN scan, the QSA prefill with
  /// each row's own block selection, PLE over the rows with the EOS-aware n-gram shift, and the
  /// routed experts grouped by expert. Leaves every state (KV and indexer caches, GDN state and
  /// conv context, PLE conv history, n-gram context, position) as n forward() calls would, so
  /// forward()/decode() continue from it. Returns `logits` (see PrefillLogits; valid until the
  /// next call), identical on every rank. Not graph-captured; synchronises the stream. Every
  /// rank must call it alike. Throws fn::Error(Usage) for an empty list, a token outside the
  /// vocabulary or more tokens than -c/--ctx-size leaves room for (naming both numbers),
  /// fn::Error(Format) when a returned logit is not finite, fn::Error(Cuda) when the pass
  /// buffers do not fit the device (naming the bytes and --prefill-chunk).
  std::span<const float> prefill(std::span<const int32_t> tokens,
                                 PrefillLogits logits = PrefillLogits::Last);

  /// prefill() of `tokens` that reduces each row of q.first .. n-1 on the device
  /// (cuda/kernels/logit_stats.h, after each group of lm_head rows) and returns the RowResults
  /// of core/row_stats.h: only the per-row values cross to the host, plus the full rows with
  /// q.keep_logits. The lm_head runs only for those rows. Throws as prefill(), fn::Error(Usage)
  /// for a query that does not fit (check_row_query) and fn::Error(Format) for a row holding a
  /// non-finite logit.
  RowResults prefill_rows(std::span<const int32_t> tokens, const RowQuery& q);

  /// Backend::prefill_slots: every piece's tokens in shared passes of the batched prefill (the
  /// pieces' rows one after another, cut into passes of prefill_chunk rows; each row's GDN, QSA
  /// and PLE on its own slot's state, so each piece's rows equal a prefill on its slot alone up
  /// to cuBLAS's choice of GEMM algorithm for the pass's row count), with q's rows reduced on
  /// the device as prefill_rows() does. Throws as Backend::prefill_slots and prefill_rows().
  RowResults prefill_slots(std::span<const SlotTokens> pieces, const RowQuery* q);

  /// Backend::copy_slot: device-to-device copies of slot `from`'s GDN, convolution and PLE
  /// states, n-gram context and the KV and indexer cache rows before its position into slot
  /// `to`'s; the position follows (on the device too for slot 0, which the decode graph reads).
  /// Synchronises the stream. Throws fn::Error(Internal) for slots outside [0, slot_count()) or
  /// from == to.
  void copy_slot(int64_t from, int64_t to);

  /// Copies the sequence state (the GDN and PLE states, the n-gram context and the position)
  /// into the model's one snapshot slot on the device (allocated at the first call), replacing
  /// what it held. The KV and indexer caches are position-addressed and rewritten by every
  /// step, so the position restored covers them. Synchronises the stream. Throws
  /// fn::Error(Cuda) when the slot cannot be allocated.
  void snapshot();

  /// Returns the sequence state to the last snapshot() (device-to-device copies; synchronises).
  /// Throws fn::Error(Internal) before any snapshot().
  void restore();

  /// Debug/tests (CudaModelOptions::record_choices): the router and indexer choices of every row
  /// of the last prefill() call, in order (StepChoices' layout, as last_choices() gives them for
  /// a forward() step). Throws fn::Error(Usage) without record_choices.
  std::vector<StepChoices> prefill_choices() const;

  /// Greedy or sampled generation entirely on the device (docs/design.md step 8): feeds `token` at
  /// position(), then for each of `count` steps samples the next id on the device (identical on
  /// every rank) and feeds it back inside the same graph; the host only replays and copies ids
  /// out. `on_token(id)` is called for every sampled id as soon as its copy lands and may
  /// return false to stop early (a stop id). With the step graph (use_graph) step i + 1 is
  /// queued before the host waits for step i's id, so the GPU does not idle between steps: on
  /// a stop the step queued ahead has already fed the stop id, and position() counts it (ids
  /// after the stop id are never fed; a fault in that step is reported by the next call's
  /// check). Eagerly (use_graph false) one step runs at a time and the stop id is not fed.
  /// Returns the ids up to the stop. With top_logprobs >= 0 (at most kMaxTopLogprobs) each step's
  /// graph also reduces the logits row to the sampled id's TokenLogprobs (core/row_stats.h;
  /// cuda/kernels/logit_stats.h launch_top_logprobs), copied out beside the id and appended to
  /// *logprobs before on_token(id); the graph without it is the one captured for -1, so the
  /// default costs nothing. The penalties of `sampling` (fn::Sampler's) run in the graph over
  /// slot 0's penalty window (penalty_window), loaded from `history` first: the ids accepted
  /// before the first sampled one, oldest first (the prompt, `token` its last); each sampled id
  /// joins it on the device. Throws as forward(); fn::Error(Internal) for top_logprobs outside
  /// [-1, kMaxTopLogprobs] or a null logprobs with top_logprobs >= 0.
  std::vector<int32_t> decode(int32_t token, int64_t count, const SamplingParams& sampling,
                              uint64_t seed, const std::function<bool(int32_t)>& on_token,
                              int64_t top_logprobs = -1,
                              std::vector<TokenLogprobs>* logprobs = nullptr,
                              std::span<const int32_t> history = {});

  /// Sequence slot `slot`'s penalty window for the device sampler (cuda/kernels/sample.h
  /// DevicePenaltyWindow: an int32 ring of ctx_size + 1 ids and its int64 count, so a window of
  /// the whole context fits), allocated (empty) at the first call for the slot. The sampler
  /// reads it when the penalties are on and adds each id it samples with it. Throws
  /// fn::Error(Internal) for a slot outside [0, slot_count()), fn::Error(Cuda) when the
  /// allocation fails.
  DevicePenaltyWindow penalty_window(int64_t slot);

  /// Makes slot `slot`'s penalty window hold `tokens` (accepted ids, oldest first; the last
  /// ctx_size + 1 of them are kept), enqueued on the model's stream before whatever comes next
  /// (`tokens` may be reused on return). Throws as penalty_window(), and fn::Error(Cuda) on a
  /// failed copy.
  void load_penalty_window(int64_t slot, std::span<const int32_t> tokens);

  /// Benchmarks only: the per-family time of the real greedy decode step (sampling on the
  /// device, the id fed back as decode() does). Runs `count` steps from position(), feeding
  /// `token` first, with a CUDA event recorded at every family boundary; returns the per-step
  /// mean of each family's time. in_graph false: the step runs eagerly (host launch gaps
  /// included, so the sum exceeds a graph replay); true: the step with its event record nodes
  /// is captured once as its own graph and replayed (the closest to the decode graph; the
  /// event nodes add a little). Every rank must call it alike (the all-reduces). Advances the
  /// position by `count`. Throws as decode(), and fn::Error(Cuda) when the device cannot time
  /// events in a graph.
  StepProfile profile_steps(int32_t token, int64_t count, bool in_graph);

  /// Benchmarks: with `on`, every later prefill() records a CUDA event at each family boundary
  /// (a few microseconds per boundary) and keeps its PrefillProfile for last_prefill_profile();
  /// FN_PREFILL_PROFILE=1 also turns it on (and logs each call on rank 0). Every rank alike.
  void set_prefill_profile(bool on);
  /// The last profiled prefill call's times, or nullopt when none ran since the load.
  std::optional<PrefillProfile> last_prefill_profile() const;

  /// The router and indexer choices of the last step (forward() or the last token of decode()),
  /// read from the log of CudaModelOptions::record_choices (waits for the stream). Throws
  /// fn::Error(Usage) when the model was built without record_choices.
  StepChoices last_choices() const;

  /// Forgets the selected slot's sequence: position 0, zero states, n-gram context all EOS.
  void reset();

  /// Sequence slots (CudaModelOptions::slots). forward(), decode(), prefill(), prefill_rows(),
  /// reset(), position(), snapshot() and restore() act on the selected slot (0 after the load);
  /// the decode graph and the device sampling loop run slot 0 only.
  int64_t slot_count() const noexcept;
  /// Uses only the first `count` slots from now on (slot_count() returns it; the others stay
  /// allocated, unused): the TP ranks of a group agree on the fewest any of them fit
  /// (--max-batch 0 sizes the slots from each GPU's own free memory). Throws
  /// fn::Error(Internal) unless 1 <= count <= slot_count() and slot 0 is selected.
  void limit_slots(int64_t count);
  int64_t selected_slot() const noexcept { return slot_; }
  /// Makes `slot` the selected one (the others keep their sequences). Throws
  /// fn::Error(Internal) outside [0, slot_count()).
  void select_slot(int64_t slot);

  /// One decode step for several slots in one pass of the batched prefill's kernels (the dense
  /// projections, router and experts over all rows at once; each slot's GDN, QSA and PLE on its
  /// own state): feeds tokens[i] to slot slots[i] at that slot's position and returns the
  /// [B, vocab_size] FP32 logits, row i for slots[i] (identical on every rank, valid until the
  /// next call). Each row equals a one-token prefill() of that slot (so forward()'s logits up to
  /// the summation orders of docs/numerics.md). Synchronises the stream; not graph-captured.
  /// Every rank calls it alike. Throws fn::Error(Internal) for mismatched or empty lists, a slot
  /// outside [0, slot_count()) or given twice, more slots than prefill_chunk; Usage for a token
  /// outside the vocabulary or a slot whose context is full (naming -c/--ctx-size); Format for a
  /// non-finite logit.
  std::span<const float> forward_batch(std::span<const int64_t> slots,
                                       std::span<const int32_t> tokens);

  /// forward_batch() that samples each row on the device instead of returning it: row i with
  /// sampling[i] (penalties over sampling[i].window, then greedy or the filtered draw of
  /// cuda/kernels/sample.h) at RNG step steps[i], as decode() samples its step `steps[i]` with
  /// that seed; returns the ids, row i for slots[i].
  /// Only the ids cross to the host. Throws as forward_batch(), fn::Error(Internal) for lists
  /// of other lengths or a negative step, and fn::Error(Format) for a non-finite row.
  std::vector<int32_t> sample_batch(std::span<const int64_t> slots, std::span<const int32_t> tokens,
                                    std::span<const DeviceSamplingParams> sampling,
                                    std::span<const int64_t> steps);

  /// Benchmarks only: moves the position to `position` without processing tokens, so a decode
  /// step costs what it costs at that depth (the caches keep whatever they hold — zeros after
  /// reset()). Throws fn::Error(Usage) outside [0, ctx_size).
  void set_position_for_benchmark(int64_t position);

  int64_t position() const noexcept { return position_; }
  /// CUDA graphs captured since load (one per mode; a new one only when decode() is called with
  /// other sampling settings, or another top_logprobs >= 0). A long run must see this stay flat.
  int64_t graph_captures() const noexcept;
  const ModelConfig& config() const noexcept { return cfg_; }
  const CudaLoadStats& load_stats() const noexcept { return stats_; }

 private:
  struct Impl;
  friend struct CudaModelTesting;  // the test hooks (cuda/model/cuda_model_testing.h)
  CudaModel(ModelConfig cfg, const CudaModelOptions& options);
  // load() and random() with the test-only buffers of `test` (cuda_model_testing.h).
  static std::unique_ptr<CudaModel> load_with(const std::filesystem::path& dir,
                                              const CudaModelOptions& options,
                                              const CudaModelTestOptions& test);
  static std::unique_ptr<CudaModel> random_with(const ModelConfig& config, const QuantConfig& quant,
                                                uint64_t seed, const CudaModelOptions& options,
                                                const CudaModelTestOptions& test);
  // forward_batch() (empty `sampling`: the logits rows to the host) and sample_batch().
  void run_batch(std::span<const int64_t> slots, std::span<const int32_t> tokens,
                 std::span<const DeviceSamplingParams> sampling, std::span<const int64_t> steps);
  // Allocates the batched prefill's pass buffers and cuBLAS handle at the first use.
  void ensure_prefill_buffers();
  // prefill() and prefill_rows(): `rows` and `out` non-null for PrefillLogits::Rows.
  // With `pieces` (prefill_slots) the tokens are the pieces' concatenated, each run on its slot;
  // without, all of them on the selected slot.
  std::span<const float> run_prefill(std::span<const int32_t> tokens, PrefillLogits want,
                                     const RowQuery* rows, RowResults* out,
                                     std::span<const SlotTokens> pieces = {});
  // Throws the error a kernel flagged in the step whose flag was copied to host_flag[slot] (then
  // clears the device flag).
  void check_step_errors(int32_t token, int slot = 0);
  // Allocates what the sampling step needs for `sampling` (and, with top_logprobs >= 0, the top
  // log-probs' buffers) and drops the sampling graphs captured with other settings (the top
  // log-probs graph also when captured for another top_logprobs).
  void prepare_sampling(const SamplingParams& sampling, uint64_t seed, int64_t top_logprobs = -1);
  ModelConfig cfg_;
  CudaModelOptions opt_;
  int64_t position_ = 0;  // the selected slot's position
  int64_t slot_ = 0;      // the selected slot
  // Throws fn::Error(Internal) naming `what` unless slot 0 is selected.
  void require_slot0(const char* what) const;
  CudaLoadStats stats_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fn

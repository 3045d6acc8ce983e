// CudaModel: the CUDA decode backend (MODEL.md §C, tensor-parallel per §E.2) of one TP rank —
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
#include <span>
#include <vector>

#include "core/config.h"
#include "core/sampler.h"

namespace fn {

class DeviceAllReduce;

/// How the CUDA model is set up.
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
  /// Tests only: allocate the buffers for set_forced_choices() (router ids and indexer blocks
  /// replayed from a reference, so a comparison is not dominated by near-tie flips).
  bool replay_choices = false;
  /// Tests only: keep the residual H after every HC inject (debug_residuals()).
  bool keep_residuals = false;
  /// Debug (`--check-choices`): copy every layer's router expert ids and every QSA layer's
  /// selected block ids out of each step into a log that last_choices() reads.
  bool record_choices = false;
  /// Tokens per batched prefill pass (`--prefill-chunk`, issue 7): prefill() splits a longer
  /// prompt into passes of at most this many tokens, each continuing from the states the last
  /// one left. Capped at ctx_size; the pass buffers (allocated on the first prefill()) scale with
  /// it: about 0.3 MB per token at the real TP=1 geometry. >= 1.
  int64_t prefill_chunk = 8192;
  /// Decode step launch fusion (issue 8), same bits as the separate launches: the HC inject
  /// folded into the next HC read's down pass behind an all-reduce (TP > 1; the residual
  /// ping-pongs between two buffers), the router + shared gate/up + top-k launch and the SwiGLU +
  /// shared down + combine launch (cuda/kernels/moe_shared.h). false: the separate launches, kept for
  /// A/B benches and for the test that the fused step gives the same bits.
  bool fused_step = true;
  /// Where fused_step folds the HC inject into the next down pass: -1 behind an all-reduce only
  /// (TP > 1; measured best, see cuda_model.cpp), 1 everywhere, 0 nowhere (A/B benches).
  int fold_hc_inject = -1;
  /// L2 prefetch of weights a few launches ahead by the routed gate+up, once each CTA's own loads
  /// have landed (cuda/common/l2_prefetch.h; no bits change), a mask: bit 0 the next HC read's W_dn
  /// (+ inject rows) and norm (the next layer's attention side, or the final mixer), bit 1 its
  /// W_up, bit 2 the shared expert's down matrix. Default 3 since session 20: -0.009 ms/token at
  /// TP=1 on H200 (1: -0.006, 7: -0.005; cuda/bench/RESULTS.md). Issued at the start of the
  /// gate+up (before session 20) the same ranges cost +0.03 to +0.04 (session 19); the same
  /// prefetch for the MLP-side HC read from the GDN recurrence and the QSA attention measured
  /// +0.01 to +0.02 (session 20), from the recurrence / QSA / routed down of other ranges slower
  /// too (sessions 9 and 11). 0: A/B benches.
  int l2_prefetch = 3;
  /// The routed gate+up on the bulk-copy kernel (MoeGateUpParams::bulk: sm_90+, hidden_size a
  /// multiple of 256 up to 2,560; elsewhere the FP32 kernel runs whatever this says): -0.06 to
  /// -0.09 ms/token at TP=1 on H200 (cuda/bench/RESULTS.md, session 10). Another summation order
  /// than the FP32 kernel, so other bits. false: the FP32 kernel (A/B benches).
  bool moe_bulk = true;
  /// The routed down projection on the bulk-copy kernel (MoeDownParams::bulk). Off: 4.4 us faster
  /// alone at TP=1, but +0.16 to +0.28 ms/token in the step (its whole-SM CTAs hold 105 KB of
  /// shared memory until they exit, and the shared-expert, router and HC launches around it
  /// measured slower; RESULTS.md, session 10). true: A/B benches.
  bool moe_bulk_down = false;
  /// The GDN recurrence in thread-block clusters of one key head's CTAs where it can
  /// (GdnDecodeParams::cluster: sm_90+, the real head shape; the same bits). false: the arrival
  /// counters (A/B benches).
  bool gdn_cluster = true;
  /// The routed gate+up (bulk kernel) prefetches the selected experts' down weights into L2 for
  /// the routed down after it, each CTA once its own loads have landed
  /// (MoeGateUpParams::down_prefetch): -0.048 ms/token at TP=1 on H200 (cuda/bench/RESULTS.md,
  /// session 20; -0.023 with the prefetch issued right after the CTA's last copy). No bits
  /// change. false: A/B benches.
  bool moe_down_prefetch = true;
  /// MB of the next layer's input projection (GDN or QSA in_proj, its first rows) the shared
  /// expert's down launch prefetches into L2 once its rows are done
  /// (SharedDownCombineParams::l2_prefetch), for the bandwidth-bound GEMV after the HC read. No
  /// bits change. 0: none. TP=1 on H200 (cuda/bench/RESULTS.md, session 21): 4 and 8 MB -0.01 to
  /// -0.016 ms/token, 12 MB and more slower (+0.02 to +0.06).
  int in_proj_prefetch_mb = 8;
  /// decode() queues step i + 1's graph before it waits for step i's id (the id stays on the
  /// device), so the GPU does not idle while the host wakes, takes the id and launches again.
  /// When on_token stops early the step queued ahead has already fed the stop id: it counts in
  /// position() (its own id is dropped) and decode() returns without waiting for it (a fault in
  /// it is reported by the next step's check). false: one step at a time (A/B benches).
  bool decode_lookahead = true;
  /// The QSA select takes the block scores from mailbox slots as they are posted
  /// (QsaDecodeParams::select_mailbox) instead of after an arrival ticket. The same bits. false:
  /// the ticket (A/B benches).
  bool qsa_select_mailbox = true;
  /// The QSA layers' input projection runs inside the QSA launcher, overlapped with the
  /// indexer's scores and select (QsaDecodeParams::in_proj): the indexer's rows first, the query
  /// and KV rows beside the select. The same bits. Needs qsa_select_mailbox. false: the
  /// projection as one GEMV before the QSA launches (A/B benches).
  bool qsa_overlap_in_proj = true;
  /// The GDN layers' input projection and out_proj run inside the GDN launcher
  /// (GdnDecodeParams::in_proj): the rows but z, the recurrence, the z rows beside it, out_proj
  /// after both. The same bits. false: the three launches in a row (A/B benches).
  bool gdn_overlap_z = true;
  /// Kernels at the real model's compile-time shape (cuda/common/real_shape.h) where it applies (their
  /// params' fixed_shape; the same bits): bit FixedShapeKernel k set = kernel k's fixed
  /// instance. 0: the runtime-shape instances everywhere (A/B benches).
  int fixed_shape_kernels = 31;
  /// Knockout benchmarks only (cuda_model_bench --skip): bit StepLaunch k set leaves every launch
  /// of that kind out of the decode step, so the step's time without it can be measured; the
  /// results are then wrong. 0 in production.
  uint32_t bench_skip = 0;
  /// Benchmarks only (cuda_model_bench --empty-launches): this many empty launches
  /// (launch_bench_empty) between each layer's router and its routed gate+up, to measure what one
  /// launch boundary costs in the step. 0 in production.
  int bench_empty_launches = 0;
};

/// The kernels with a compile-time-shape instance (bit numbers of
/// CudaModelOptions::fixed_shape_kernels, cuda_model_bench --fixed-shape).
enum class FixedShapeKernel : int {
  HcDown = 0,       ///< HcDownParams::fixed_shape
  HcMix = 1,        ///< HcMixParams::fixed_shape
  Recurrence = 2,   ///< GdnDecodeParams::fixed_shape
  ExpertsDown = 3,  ///< MoeDownParams::fixed_shape (FP32 kernel)
  Router = 4,       ///< RouterSharedGateUpParams::fixed_shape (the top-k)
};

/// The launch kinds of the decode step that CudaModelOptions::bench_skip can leave out (bit
/// numbers). Router and SharedDown are the fused_step launches (the default); the separate
/// launches of fused_step = false are never left out.
enum class StepLaunch : int {
  HcInject = 0,       ///< launch_hc_inject (TP=1; folded into HcDown behind an all-reduce)
  HcDown = 1,         ///< launch_hc_down
  HcMix = 2,          ///< launch_hc_mix
  InProj = 3,         ///< the mixer's input GEMV (GDN in_proj, QSA q/k/v/indexer)
  Recurrence = 4,     ///< launch_gdn_decode
  Attention = 5,      ///< launch_qsa_decode (its four launches)
  OutProj = 6,        ///< the mixer's out / o GEMV
  Router = 7,         ///< launch_router_shared_gate_up (router + top-k + shared gate/up)
  ExpertsGateUp = 8,  ///< launch_moe_gate_up_nvfp4
  ExpertsDown = 9,    ///< launch_moe_down_nvfp4
  SharedDown = 10,    ///< launch_shared_down_combine
  // Parts of a launch (probes: the launch runs, this part of it does not):
  RouterTopK = 11,        ///< the router launch's top-k block (the previous layer's ids stay)
  GateUpMath = 12,        ///< the bulk gate+up's tensor-core math (its loads stay: loads only)
  QsaSelect = 13,         ///< the QSA scores launch's top-k block select (the last selection stays)
  RouterSharedRows = 14,  ///< the router launch's shared-expert gate/up rows (blocks only wait)
  /// The router launch's router rows (the top-k ranks stale logits). Confounded: it measured
  /// +0.49 ms/token, probably because the never-written logits all tie and the top-k takes its
  /// slower block-wide path (cuda/bench/RESULTS.md, session 13).
  RouterRows = 15,
  DownMath = 16,  ///< the FP32 routed down's arithmetic (its loads stay)
};

/// Which logits CudaModel::prefill returns.
enum class PrefillLogits {
  None,  ///< none (the caller decodes from the last token itself)
  Last,  ///< the last token's [vocab_size]
  All,   ///< every token's, [n, vocab_size] row-major (tests; n * vocab_size floats of host memory)
};

/// The discrete choices of one decode step (the layout of CpuModel::Choices): router = per
/// decoder layer, the top-k expert ids best first; indexer = per QSA layer in layer order, the
/// selected block ids ascending, empty while every complete block is selected (B <= block_topk).
struct StepChoices {
  std::vector<std::vector<int32_t>> router;
  std::vector<std::vector<int32_t>> indexer;
};

/// The op families of one decode step, for CudaModel::profile_steps (issue 8 "per-op
/// breakdown"). Each launch of encode_step belongs to exactly one family.
enum class StepFamily : int {
  Hc,        ///< HC read (fused norm + down/inject pass, mix) and HC inject; final mixer
  GdnMixer,  ///< GDN: stacked input projection GEMV, the GDN decode kernel, out_proj GEMV
  QsaMixer,  ///< QSA: stacked q/k/v/indexer projection GEMV, the QSA kernels, o_proj GEMV
  /// router (+ shared_expert_gate row) GEMV, top-k (and forced choices); with fused_step also
  /// the shared expert's gate/up rows (one launch, cuda/kernels/moe_shared.h)
  Router,
  RoutedMoe,  ///< NVFP4 gate-up and down of the top-k experts
  /// shared expert gate/up GEMV, SwiGLU, down GEMV, the gated combine (fused_step: SwiGLU + down
  /// + combine in one launch)
  SharedExpert,
  AllReduce,  ///< every all-reduce of the step (TP > 1; PLE, mixer, MoE, logits)
  LmHead,     ///< lm_head GEMV, logit scatter, sampling, n-gram context and position advance
  Ple,        ///< PLE: n-gram gather, key/value GEMV, apply (its all-reduce is AllReduce)
  Other,      ///< the embedding row and anything else
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

/// Loading statistics.
struct CudaLoadStats {
  uint64_t bytes = 0;         ///< weight bytes copied to (or generated on) the device
  double seconds = 0;         ///< wall time of the weight load
  uint64_t weight_bytes = 0;  ///< device bytes held by weights
  uint64_t state_bytes = 0;   ///< device bytes of caches, states and activations
};

/// One TP rank's CUDA model and sequence state.
class CudaModel {
 public:
  /// Loads checkpoint directory `dir` for options.tp_rank of options.tp_size (validated as
  /// open_model does, core/rank_slices.h), reading only this rank's slices, onto the current
  /// CUDA device. Throws fn::Error: Io/Format for bad files (naming file and tensor), Usage for
  /// a TP size that does not divide the model or a context beyond max_position_embeddings,
  /// Format for models this backend does not run (BF16 experts, ple_embed_dim != hidden_size),
  /// Cuda when device memory runs out (naming the bytes needed).
  /// Rank 0 shows a progress line on stderr while the weights stream in (core/progress.h).
  static std::unique_ptr<CudaModel> load(const std::filesystem::path& dir,
                                         const CudaModelOptions& options);

  /// The full geometry of `config` (e.g. configs/qwen3.8-flash-next.json) with random weights
  /// generated directly in device memory, in exactly the layout load() produces (core/synth.h's
  /// distributions; NVFP4 experts with random codes). For benchmarks without a 130 GB file.
  /// Deterministic in `seed`. Throws as load().
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
  /// the logits are not finite.
  std::span<const float> forward(int32_t token);

  /// Batched prefill (MODEL.md §D, issue 7): runs `tokens` at positions position() ..
  /// position() + n - 1 as forward() would one by one, in passes of at most
  /// CudaModelOptions::prefill_chunk tokens: per layer, cuBLAS GEMMs for the dense projections
  /// (FP32 activations as BF16 hi + lo, cuda/kernels/gemm.h), the GDN scan, the QSA prefill with each
  /// row's own block selection, PLE over the rows with the EOS-aware n-gram shift, and the routed
  /// experts grouped by expert. Leaves every state (KV and indexer caches, GDN state and conv
  /// context, PLE conv history, n-gram context, position) as n forward() calls would, so
  /// forward()/decode() continue from it. Returns `logits` (see PrefillLogits; valid until the
  /// next call), identical on every rank. Not graph-captured; synchronises the stream. Every
  /// rank must call it alike. Throws fn::Error(Usage) for an empty list, a token outside the
  /// vocabulary or more tokens than -c/--ctx-size leaves room for (naming both numbers),
  /// fn::Error(Format) when a returned logit is not finite, fn::Error(Cuda) when the pass
  /// buffers do not fit the device (naming the bytes and --prefill-chunk).
  std::span<const float> prefill(std::span<const int32_t> tokens,
                                 PrefillLogits logits = PrefillLogits::Last);

  /// Debug/tests (CudaModelOptions::record_choices): the router and indexer choices of every row
  /// of the last prefill() call, in order (StepChoices' layout, as last_choices() gives them for
  /// a forward() step). Throws fn::Error(Usage) without record_choices.
  std::vector<StepChoices> prefill_choices() const;

  /// Greedy or sampled generation entirely on the device (DESIGN.md step 8): feeds `token` at
  /// position(), then for each of `count` steps samples the next id on the device (identical on
  /// every rank) and feeds it back inside the same graph; the host only replays and copies ids
  /// out. `on_token(id)` is called for every sampled id as soon as its copy lands and may
  /// return false to stop early (a stop id). Without CudaModelOptions::decode_lookahead the stop
  /// id is not fed; with it (the default) the step queued ahead has fed it, and position()
  /// counts that step (ids after the stop id are never fed). Returns the ids up to the stop.
  /// Throws as forward().
  std::vector<int32_t> decode(int32_t token, int64_t count, const SamplingParams& sampling,
                              uint64_t seed, const std::function<bool(int32_t)>& on_token);

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

  /// Tests only (replay_choices): the reference's choices for the NEXT forward(): per decoder
  /// layer the top-k expert ids (best first), per QSA layer the selected blocks (ascending; an
  /// empty list while every complete block is selected). Throws fn::Error(Usage) on a shape
  /// mismatch or without replay_choices.
  void set_forced_choices(const std::vector<std::vector<int32_t>>& router,
                          const std::vector<std::vector<int32_t>>& indexer);

  /// Tests only (keep_residuals): H after every HC inject of the last step, two per layer, as
  /// CpuModel::last_residuals() lays them out.
  std::vector<std::vector<float>> debug_residuals() const;
  /// The router and indexer choices of the last step (forward() or the last token of decode()),
  /// read from the log of CudaModelOptions::record_choices (waits for the stream). Throws
  /// fn::Error(Usage) when the model was built without record_choices.
  StepChoices last_choices() const;

  /// Forgets the sequence: position 0, zero states, n-gram context all EOS.
  void reset();

  /// Benchmarks only: moves the position to `position` without processing tokens, so a decode
  /// step costs what it costs at that depth (the caches keep whatever they hold — zeros after
  /// reset()). Throws fn::Error(Usage) outside [0, ctx_size).
  void set_position_for_benchmark(int64_t position);

  int64_t position() const noexcept { return position_; }
  /// CUDA graphs captured since load (one per mode; a new one only when decode() is called with
  /// other sampling settings). A long run must see this stay flat.
  int64_t graph_captures() const noexcept;
  const ModelConfig& config() const noexcept { return cfg_; }
  const CudaLoadStats& load_stats() const noexcept { return stats_; }

 private:
  struct Impl;
  CudaModel(ModelConfig cfg, const CudaModelOptions& options);
  // Throws the error a kernel flagged in the step whose flag was copied to host_flag[slot] (then
  // clears the device flag).
  void check_step_errors(int32_t token, int slot = 0);
  // Allocates what the sampling step needs for `sampling` and drops a sampling graph captured
  // with other settings.
  void prepare_sampling(const SamplingParams& sampling, uint64_t seed);
  ModelConfig cfg_;
  CudaModelOptions opt_;
  int64_t position_ = 0;
  CudaLoadStats stats_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fn

// CpuModel: the FP32 CPU reference backend of docs/model.md §C — one decode step at a time, tensor-
// parallel over a Collectives group exactly per the shard plan (docs/model.md §E.2). Called by the
// generation loop (`fngen generate --backend cpu`), `fngen eval` and the golden tests; it is the
// oracle the CUDA backend is compared with. Invariants: weights stay in their checkpoint dtypes
// (BF16 as uint16, NVFP4 packed codes + E4M3 block scales + FP32 global scale, FP8 n-gram rows)
// and are dequantised one row at a time on use; small 1-D weights (norms, conv taps, A_log,
// dt_bias) are converted to FP32 at load. All activations, caches and states are FP32 (no BF16
// rounding anywhere; see core/cpu_ops.h). Every rank performs the same collectives in the same
// order; forward() returns the same full-vocabulary logits on every rank.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "core/collectives.h"
#include "core/config.h"

namespace fn {

class Checkpoint;
class ShardPlan;

/// The loaded model of one TP rank plus the per-sequence state of docs/model.md §C.0.
class CpuModel {
 public:
  /// Loads the checkpoint directory `dir` (config.json, quantization config, safetensors via the
  /// index) for rank coll.rank() of coll.size(): builds the shard plan, validates every text
  /// tensor's name, dtype and shape against docs/model.md §B.2 (skipping vision/MTP; the bare
  /// `model.*` layout is accepted as well as `model.language_model.*`), checks the stored n-gram
  /// I64 buffers against the config, then reads only this rank's slices. Throws fn::Error:
  /// Io/Format for unreadable or invalid files (naming file and tensor), Usage when the TP size
  /// does not divide the model (naming the constraint), Format for ple_embed_dim != hidden_size
  /// (unsupported). Collective-free: ranks load independently. `coll` must outlive the model.
  static std::unique_ptr<CpuModel> load(const std::filesystem::path& dir, Collectives& coll);

  ~CpuModel();
  CpuModel(const CpuModel&) = delete;
  CpuModel& operator=(const CpuModel&) = delete;

  /// One decode step (docs/model.md §C.10) for `token` at position position(): updates every state
  /// (KV and indexer caches, pooled block keys, GDN conv + recurrent states, PLE conv state,
  /// n-gram context), advances the position, and returns the vocab_size FP32 logits (no masking
  /// of padding rows), identical on every rank. The span stays valid until the next forward() or
  /// reset(). Prefill is forward() over the prompt tokens in order (docs/model.md §D: the same
  /// function, token by token). Collectives per call at TP > 1: one all-reduce per PLE layer
  /// (2560), two per decoder layer (2560 each), one all-gather of the logits.
  /// Throws fn::Error(Usage) for a token outside [0, vocab_size), fn::Error(Format) with
  /// on_every_rank() set for a non-finite logit (NaN/Inf weights; every rank holds the same
  /// logits, so every rank throws it).
  std::span<const float> forward(int32_t token);

  /// Prefill: forward() over `tokens` in order (docs/model.md §D; token by token, so prefill(T) is
  /// prefill(T-1) followed by one decode step by construction). Returns the logits of the last
  /// token (valid until the next call). Throws fn::Error(Usage) for an empty span or a bad id
  /// (the tokens before a bad id have been processed).
  std::span<const float> prefill(std::span<const int32_t> tokens);

  /// Forgets the sequence: position 0, empty caches, zero GDN/PLE states, n-gram context all EOS.
  void reset();

  /// Copies the sequence state (position, KV and indexer-key caches, GDN and PLE states, n-gram
  /// context) into the model's one snapshot slot, replacing what it held.
  void snapshot();

  /// Returns the sequence state to the last snapshot(). Throws fn::Error(Internal) before any
  /// snapshot().
  void restore();

  /// Holds `count` sequence slots (>= 1; the load holds 1): slots beyond the old count start as
  /// after reset() when first selected, slots past the new count are dropped. The selected slot
  /// must stay below `count`. Throws fn::Error(Internal) for count < 1 or one that would drop
  /// the selected slot.
  void set_slot_count(int64_t count);
  /// Slot `to` becomes a copy of slot `from`'s sequence (position, caches, states, n-gram
  /// context); the selected slot stays. Throws fn::Error(Internal) for slots outside
  /// [0, slot_count()) or from == to.
  void copy_slot(int64_t from, int64_t to);
  int64_t slot_count() const noexcept;
  int64_t selected_slot() const noexcept { return slot_; }
  /// Makes `slot` the sequence forward(), prefill(), reset(), snapshot() and restore() act on;
  /// the others keep their state (swapped, not copied). Throws fn::Error(Internal) outside
  /// [0, slot_count()).
  void select_slot(int64_t slot);

  /// Number of tokens processed since load()/reset() (the position of the next token).
  int64_t position() const noexcept { return position_; }
  const ModelConfig& config() const noexcept { return cfg_; }
  int tp_rank() const noexcept { return tp_rank_; }
  int tp_size() const noexcept { return tp_size_; }
  /// Bytes of weights this rank holds in memory (checkpoint dtypes).
  uint64_t weight_bytes() const noexcept { return weight_bytes_; }
  /// Bytes of per-sequence state this rank holds now (caches grow with position()).
  uint64_t state_bytes() const noexcept;

  /// How close the discrete choices of the last forward() came to a tie (for tests that compare
  /// a BF16 engine with this FP32 reference: a choice within rounding of a tie may legitimately
  /// flip there). Relative gaps, smallest over all layers: router = (k-th - (k+1)-th largest
  /// router logit) / max |router logit|; indexer = the same at the block_topk boundary of the
  /// indexer scores (only when more blocks than block_topk are complete). +inf when no such
  /// choice was made.
  /// Two continuous ops are ill-conditioned at points a BF16 engine cannot resolve either:
  /// ple_gamma = min |gamma| over PLE streams (sign(gamma)·sqrt|gamma| has an infinite slope at
  /// 0, docs/model.md §C.4 step 5); gdn_head_rms = min over GDN layers and value heads of
  /// rms(o_h) / mean_h rms(o_h) before the gated RMSNorm (a near-zero head is rescaled to unit
  /// RMS, its rounding noise with it, docs/model.md §C.5 step 7).
  struct DecisionMargins {
    double router = HUGE_VAL;
    double indexer = HUGE_VAL;
    double ple_gamma = HUGE_VAL;
    double gdn_head_rms = HUGE_VAL;
  };
  const DecisionMargins& last_margins() const noexcept { return margins_; }

  /// The discrete choices of the last forward(), for tests that replay them in another engine:
  /// router = per decoder layer, the top-k expert ids best first; indexer = per QSA layer (in
  /// layer order), the selected block ids ascending (empty while every complete block is
  /// selected, i.e. B <= block_topk).
  struct Choices {
    std::vector<std::vector<int32_t>> router;
    std::vector<std::vector<int32_t>> indexer;
  };
  const Choices& last_choices() const noexcept { return choices_; }

  /// Tests only: the residual H ([hc_count * hidden_size] FP32) after every update of the last
  /// forward(), in order: per decoder layer, after the PLE (PLE layers only), after the mixer's
  /// HC inject, after the MoE's HC inject.
  const std::vector<std::vector<float>>& last_residuals() const noexcept { return residuals_; }

 private:
  struct Layer;
  struct Hc;
  CpuModel(ModelConfig cfg, Collectives& coll);
  void load_weights(const Checkpoint& ck, const ShardPlan& plan, bool bare_layout,
                    bool experts_nvfp4, bool ngram_fp8);
  void ple_step(Layer& L, int32_t token, float* H);
  void gdn_step(Layer& L, const float* m, float* y);
  void qsa_step(Layer& L, const float* m, float* y);
  void moe_step(Layer& L, const float* m, float* y);

  ModelConfig cfg_;
  Collectives& coll_;
  int tp_rank_ = 0;
  int tp_size_ = 1;
  int64_t position_ = 0;
  uint64_t weight_bytes_ = 0;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<Hc> final_mixer_;
  struct Matrices;
  std::unique_ptr<Matrices> top_;  // embedding, lm_head
  DecisionMargins margins_;
  Choices choices_;
  std::vector<std::vector<float>> residuals_;
  std::vector<float> logits_local_;
  std::vector<float> logits_;
  struct Saved;  // snapshot() slot: per-layer state copies and the position
  std::unique_ptr<Saved> saved_;
  // Sequence slots: slots_[i] holds slot i's state while it is not selected (the selected one's
  // lives in the layers; its entry is empty), `fresh` until first selected.
  struct Slot;
  std::vector<Slot> slots_;
  int64_t slot_ = 0;
  void swap_state(Saved& st);
  void save_state(Saved& st) const;  // copies of the selected slot's state
  void load_state(const Saved& st);  // the selected slot's state from copies
};

}  // namespace fn

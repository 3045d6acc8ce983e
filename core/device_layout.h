// The device buffers of one TP rank of the CUDA backend besides its weights: the per-sequence
// state of every layer (KV and indexer caches, GDN recurrent and conv states, PLE conv state), the
// decode scratch (QSA workspaces, GDN counters and output, the router mailbox), the one activation
// block of the decode step piece by piece, and the device-sampling buffers — sizes and offsets
// from the config, the TP geometry and the context size. One description for both readers: the
// CUDA model's arena build (cuda/model/load.cpp) allocates exactly these buffers and carves the
// activation block at these offsets, and core/memory_plan sums them for `fngen inspect` and for
// the refusal of a context that does not fit. No CUDA here.
#pragma once

#include <array>
#include <cstdint>

#include "core/config.h"

namespace fn {

/// The pieces of the decode step's activation block, in carve order (each 256-byte aligned).
/// Names and shapes at this rank (D hidden, W = hc_count * D, R hc_lowrank, S hc_count, k top-k,
/// E experts, V vocab; "max in rows" the largest stacked mixer projection, "max mix" the largest
/// mixer output, Hv*dv or Hq*hd):
enum class Activation : int {
  H,               ///< FP32 [W] the residual
  HAlt,            ///< FP32 [W] the other residual buffer (the HC inject folded into a read)
  HcPartials,      ///< FP32 [hc_down_splits, R + S] partial dots of the HC down pass
  HcSumSq,         ///< FP32 [hc_down_splits] partial sums of H^2
  M,               ///< FP32 [D] the block input
  MBf16,           ///< BF16 [D] the MLP-side block input for the NVFP4 experts
  Iota,            ///< FP32 [S] the HC inject weights
  Proj,            ///< FP32 [max in rows] the mixer's stacked projection
  MixOut,          ///< BF16 [max mix] the mixer output
  Y,               ///< FP32 [D] the block output
  RouterLogits,    ///< FP32 [E + 1] router logits, then the shared-expert gate logit
  ExpertIds,       ///< int32 [k]
  RoutingWeights,  ///< FP32 [k]
  ExpertH,         ///< BF16 [k, moe_inter / tp] the routed experts' SwiGLU outputs
  SharedGateUp,    ///< FP32 [2 * shared_inter / tp] the shared expert's gate and up rows
  PleEmbedding,    ///< FP32 [ple_embed_dim] (1 without PLE) the gathered n-gram embedding
  PleKv,           ///< FP32 [S * ple_embed_dim + D] (1 without PLE) the PLE key/value rows
  LogitsLocal,     ///< FP32 [V / tp] this rank's vocabulary slice
  Logits,          ///< FP32 [V] the full logits
  Token,           ///< int32 [1] the step's input id
  Position,        ///< int64 [1] its position
  Context,         ///< int64 [max(ngram_size - 1, 1)] the n-gram context
  ErrorFlag,       ///< int32 [1]
  SampleStep,      ///< int64 [1] the sampler's step counter
};
inline constexpr int kActivationCount = 24;

/// One piece of the activation block.
struct ActivationPiece {
  const char* name = "";      ///< the Activation's name, e.g. "H", "logits"
  int64_t count = 0;          ///< elements, >= 1
  int64_t element_bytes = 0;  ///< 2 (BF16), 4 (FP32, int32) or 8 (int64)
  uint64_t offset = 0;        ///< bytes from the block's start, a multiple of 256
  uint64_t bytes = 0;         ///< count * element_bytes rounded up to a multiple of 256
};

/// The non-weight device buffers of one rank, in bytes (each a separate allocation unless said).
struct DeviceLayout {
  int tp_size = 1;
  int tp_rank = 0;
  int64_t ctx_size = 0;
  int64_t qsa_layers = 0, gdn_layers = 0, ple_layers = 0;
  // Per QSA layer (docs/model.md §C.0, §C.6): the caches and the decode workspace.
  uint64_t k_cache = 0;        ///< BF16 [ctx, Hkv_l * head_dim]
  uint64_t v_cache = 0;        ///< BF16 [ctx, Hkv_l * head_dim]
  uint64_t raw_keys = 0;       ///< FP32 [ctx, indexer_head_dim]
  uint64_t block_keys = 0;     ///< FP32 [max(ctx / ratio, 1), indexer_head_dim]
  uint64_t qsa_workspace = 0;  ///< qsa_workspace_estimate (core/memory_plan.h)
  // Per GDN layer (§C.5).
  uint64_t gdn_conv_state = 0;  ///< FP32 [conv_l, K - 1]
  uint64_t gdn_state = 0;       ///< FP32 [Hv_l, dk, dv]
  uint64_t gdn_counters = 0;    ///< uint32 [Hv_l + Hk_l + 2]: head counters, two join words
  uint64_t gdn_output = 0;      ///< FP32 [Hv_l * dv] the recurrence output scratch
  // Per PLE layer (§C.4).
  uint64_t ple_conv_state = 0;  ///< FP32 [W, (ple_conv_kernel_size - 1) * dilation]
  uint64_t router_mailbox = 0;  ///< FP32 [E], one for the model
  /// Rows of the largest stacked mixer projection (the Proj piece) and the largest mixer output
  /// (MixOut) at this rank.
  int64_t max_in_rows = 0, max_mix = 0;
  std::array<ActivationPiece, kActivationCount> activations{};  ///< indexed by Activation
  uint64_t activation_bytes = 0;  ///< the whole block (one allocation)
  /// The decode loop's token history, int32 [ctx + 1] (allocated at the first decode()).
  uint64_t history = 0;
  /// ESTIMATE of the sampling workspace (allocated at the first decode(); its size depends on
  /// the sampling settings): 24 B x vocab + 1 MiB (four vocabulary-sized key/value arrays and the
  /// sort temporaries).
  uint64_t sampling_estimate = 0;

  const ActivationPiece& piece(Activation a) const {
    return activations[static_cast<std::size_t>(a)];
  }
  /// Sums over the layers: qsa_layers * (k_cache + v_cache), qsa_layers * (raw_keys +
  /// block_keys), gdn_layers * gdn_state, gdn_layers * gdn_conv_state, ple_layers *
  /// ple_conv_state.
  uint64_t kv_cache_total() const;
  uint64_t indexer_cache_total() const;
  uint64_t gdn_state_total() const;
  uint64_t gdn_conv_state_total() const;
  uint64_t ple_conv_state_total() const;
  /// Everything else: the activation block, the QSA workspaces, the GDN counters and output
  /// scratch, the router mailbox, the token history and the sampling estimate.
  uint64_t scratch_total() const;
};

/// Column chunks of the HC down pass for hc_count streams of `hidden` columns: hc_count *
/// ceil(hidden / 1280) (8 at the real shape); the leading dimension of its partials (cuda/kernels/
/// hc.h hc_down_splits, which the CUDA model checks against this).
int64_t hc_down_partials(int64_t hc_count, int64_t hidden);

/// The layout of rank `tp_rank` of `tp_size` for a `ctx_size`-token context (rank_dims of
/// core/shard_plan.h for the local sizes). Throws fn::Error(Usage) when ctx_size < 1;
/// fn::Error(Internal) on a bad tp_rank.
DeviceLayout device_layout(const ModelConfig& config, int tp_size, int tp_rank, int64_t ctx_size);

}  // namespace fn

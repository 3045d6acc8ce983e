// Tensor-parallel shard plan (docs/model.md §E.2 as docs/design.md decides it): for every expected
// tensor and TP rank, the blocks of the stored tensor that rank owns, plus per-rank weight bytes
// and the bytes read per decoded token. Called by the loader (which reads only these byte ranges),
// `fngen inspect` and both backends. Invariant: for each tensor the ranks' blocks cover every
// element exactly `replication` times (1 for split tensors, tp_size for replicated ones).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/config.h"
#include "core/model_tensors.h"

namespace fn {

/// A rectangle of a tensor viewed as 2-D [rows, cols]: rows = product of all dims but the last,
/// cols = the last dim (1-D [n] is [n, 1]; a scalar is [1, 1]). Units are stored elements: a
/// packed NVFP4 byte for U8 expert weights, one scale for block scales.
struct SliceBlock {
  int64_t row_begin = 0;
  int64_t row_count = 0;
  int64_t col_begin = 0;
  int64_t col_count = 0;
  int64_t elements() const { return row_count * col_count; }
};

/// How a tensor is divided among ranks.
enum class SplitKind {
  Replicated,       ///< every rank holds all of it
  Rows,             ///< rows [R/tp·r, +R/tp)
  Cols,             ///< cols [C/tp·r, +C/tp)
  GdnQkvRows,       ///< q, k, v row segments by key/value head (in_proj_qkv, conv1d)
  KvHeadRows,       ///< QSA k/v: rows of the rank's KV heads; replicated over tp/Hkv ranks
  FusedGateUpRows,  ///< BF16 [E, 2I, D]: gate rows and up rows [I/tp·r, +I/tp) of every expert
  NgramShard,       ///< whole n-gram shard i on rank ⌊i / (parts/tp)⌋, nothing elsewhere
};

/// The part of one tensor a rank owns.
struct TensorShard {
  SplitKind split = SplitKind::Replicated;
  bool replicated = false;         ///< true when every rank holds the whole tensor
  int replication = 1;             ///< how many ranks hold each element (tp_size when replicated)
  std::vector<SliceBlock> blocks;  ///< disjoint; empty when the rank owns none of it
  int64_t elements() const;
};

/// The shard plan of one model at one TP size.
class ShardPlan {
 public:
  /// Builds the plan. tp_size must be 1, 2, 4 or 8 and divide num_attention_heads,
  /// linear_num_key/value_heads, shared_expert_intermediate_size, moe_intermediate_size (with
  /// moe_intermediate_size/tp a multiple of 16 when NVFP4), vocab_size and split_ngram_parts;
  /// num_key_value_heads and tp_size must divide one another. Throws Usage naming the
  /// constraint ("tp_size 8 must divide linear_num_key_heads (4)"), Format via expected_tensors.
  static ShardPlan build(const ModelConfig& cfg, const QuantConfig& quant, int tp_size);
  ShardPlan(ShardPlan&&) = default;
  ShardPlan& operator=(ShardPlan&&) = default;
  ShardPlan(const ShardPlan&) = delete;  // by_name_ views the names in tensors_
  ShardPlan& operator=(const ShardPlan&) = delete;

  int tp_size() const { return tp_size_; }
  const std::vector<ExpectedTensor>& tensors() const { return tensors_; }
  /// Index of `name` in tensors(); throws Format when the name is not a text tensor.
  std::size_t index(std::string_view name) const;
  SplitKind split(std::size_t tensor_index) const { return splits_.at(tensor_index); }
  /// The blocks rank `tp_rank` owns of tensor `tensor_index`. Throws Internal on a bad rank.
  TensorShard shard(std::size_t tensor_index, int tp_rank) const;
  TensorShard shard(std::string_view name, int tp_rank) const {
    return shard(index(name), tp_rank);
  }
  /// shard(tensor_index, tp_rank).elements(), without building the blocks.
  int64_t shard_elements(std::size_t tensor_index, int tp_rank) const;
  /// Bytes of weights rank `tp_rank` holds.
  uint64_t weight_bytes(int tp_rank) const;
  /// The same, by tensor_family() ("hc", "gdn", "moe.experts", ...).
  std::map<std::string, uint64_t> weight_bytes_by_family(int tp_rank) const;

 private:
  ShardPlan() = default;
  int tp_size_ = 1;
  int64_t kv_heads_ = 1;
  int64_t head_dim_ = 0;
  int64_t gdn_key_dim_ = 0;
  int64_t gdn_value_dim_ = 0;
  int64_t moe_intermediate_ = 0;
  int64_t ngram_parts_ = 1;
  std::vector<ExpectedTensor> tensors_;
  std::vector<SplitKind> splits_;
  std::unordered_map<std::string_view, std::size_t> by_name_;
  std::vector<std::map<std::string, uint64_t>> family_bytes_;  ///< per rank, computed in build
};

/// Bytes one rank reads (and writes, for states) per decoded token (batch 1), by family.
/// Model: every dense weight slice the rank holds is read once; routed experts: only
/// num_experts_per_tok of num_experts experts' slices; embedding: one row; n-gram table:
/// ngram_heads rows × the fraction of the table on this rank (16/tp rows expected) + its scale;
/// QSA KV cache (BF16 K and V of the rank's KV heads): one row written, and min(ctx, budget +
/// ratio − 1) rows read (every selected token once); indexer (replicated, BF16): one raw key
/// written, ⌊ctx/ratio⌋ cached pooled block keys and the ≤ ratio−1 tail raw keys read, plus the
/// amortized block completion (ratio raw keys read + 1 pooled key written every ratio tokens);
/// GDN recurrent state (FP32) read and written; conv states as ring buffers: K−1 past values read
/// and 1 written per channel (GDN: local channels, kernel linear_conv_kernel_dim; PLE: all
/// hc_width channels, 3 dilated taps). Activations and collectives are not counted.
struct TokenBytes {
  std::map<std::string, uint64_t> weights;  ///< by tensor_family
  uint64_t kv_cache = 0;
  uint64_t indexer_cache = 0;
  uint64_t gdn_state = 0;
  uint64_t conv_state = 0;
  uint64_t weight_total() const;
  uint64_t state_total() const { return kv_cache + indexer_cache + gdn_state + conv_state; }
  uint64_t total() const { return weight_total() + state_total(); }
};

/// What one batched decode step of `batch` sequences reads on a rank (bytes_per_step): the
/// weights every token shares, read once; the routed experts' expected union; and per sequence
/// its embedding row, n-gram rows and states.
struct StepBytes {
  int64_t batch = 1;
  uint64_t shared_weights = 0;  ///< dense weights (everything but experts, embedding, n-gram rows)
  uint64_t experts = 0;         ///< routed experts: the expected distinct ones of the step
  double distinct_experts = 0;  ///< expected distinct routed experts per layer
  uint64_t per_sequence = 0;    ///< embedding row + n-gram rows + states of one sequence
  uint64_t total() const { return shared_weights + experts + per_sequence * batch; }
};

/// The bytes of one decode step over `batch` sequences, each with `ctx_size` visible tokens, on
/// rank r, from bytes_per_token: under uniform routing a layer's step touches
/// num_experts · (1 − (1 − k / num_experts)^batch) distinct experts in expectation (k =
/// num_experts_per_tok), each read once; batch 1 gives bytes_per_token's total. Throws Usage
/// when batch < 1 or ctx_size < 1.
StepBytes bytes_per_step(const ShardPlan& plan, const ModelConfig& cfg, int tp_rank,
                         int64_t ctx_size, int64_t batch);

/// The per-rank sizes the shard plan implies (docs/model.md §E.2), shared by every backend and the
/// memory plan so that they never derive them differently. Counts are heads or rows of this rank.
struct RankDims {
  int64_t linear_k_heads = 0;  ///< GDN key heads (linear_num_key_heads / tp)
  int64_t linear_v_heads = 0;  ///< GDN value heads (linear_num_value_heads / tp)
  int64_t gdn_conv_dim = 0;    ///< 2 * k_heads * key_head_dim + v_heads * value_head_dim
  int64_t q_heads = 0;         ///< QSA query heads (num_attention_heads / tp)
  int64_t kv_heads = 0;        ///< QSA KV heads (num_key_value_heads / tp; 1 when replicated)
  int64_t q_head_first = 0;    ///< global index of local query head 0
  int64_t kv_head_first = 0;   ///< global index of local KV head 0
  int64_t q_per_kv = 0;        ///< query heads per KV head (global)
  int64_t moe_inter = 0;       ///< routed expert rows (moe_intermediate_size / tp)
  int64_t shared_inter = 0;    ///< shared expert rows (shared_expert_intermediate_size / tp)
};

/// RankDims of rank `tp_rank` of `tp_size` (no validation: ShardPlan::build checks divisibility).
RankDims rank_dims(const ModelConfig& cfg, int tp_size, int tp_rank);

/// Bytes read per decoded token by rank `tp_rank` with `ctx_size` visible tokens (including the
/// new one). Throws Usage when ctx_size < 1.
TokenBytes bytes_per_token(const ShardPlan& plan, const ModelConfig& cfg, int tp_rank,
                           int64_t ctx_size);

}  // namespace fn

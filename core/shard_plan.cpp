#include "core/shard_plan.h"

#include <cmath>

#include "core/error.h"

namespace fn {
namespace {

/// The 2-D view of a shape (see SliceBlock).
std::pair<int64_t, int64_t> view_2d(const std::vector<int64_t>& shape) {
  if (shape.empty()) return {1, 1};
  if (shape.size() == 1) return {shape[0], 1};
  int64_t rows = 1;
  for (std::size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return {rows, shape.back()};
}

SplitKind split_of(const ExpectedTensor& t, int64_t kv_heads, int tp) {
  switch (t.role) {
    case TensorRole::GdnInProjQkv:
    case TensorRole::GdnConv:
      return SplitKind::GdnQkvRows;
    case TensorRole::GdnInProjZ:
    case TensorRole::GdnInProjA:
    case TensorRole::GdnInProjB:
    case TensorRole::GdnALog:
    case TensorRole::GdnDtBias:
    case TensorRole::QsaQProj:
    case TensorRole::SharedGate:
    case TensorRole::SharedUp:
    case TensorRole::LmHead:
      return SplitKind::Rows;
    case TensorRole::GdnOutProj:
    case TensorRole::QsaOProj:
    case TensorRole::SharedDown:
    case TensorRole::ExpertFusedDown:
      return SplitKind::Cols;
    case TensorRole::QsaKProj:
    case TensorRole::QsaVProj:
      return tp <= kv_heads ? SplitKind::Rows : SplitKind::KvHeadRows;
    case TensorRole::ExpertWeight:
    case TensorRole::ExpertBlockScale:
      // gate/up: output rows; down: input columns (packed bytes / block scales).
      return t.projection == "down_proj" ? SplitKind::Cols : SplitKind::Rows;
    case TensorRole::ExpertFusedGateUp:
      return SplitKind::FusedGateUpRows;
    case TensorRole::PleNgramShard:
      return SplitKind::NgramShard;
    default:
      return SplitKind::Replicated;
  }
}

void require_divides(int tp, int64_t value, std::string_view what) {
  FN_REQUIRE(value % tp == 0, Usage, "tp_size {} must divide {} ({})", tp, what, value);
}

}  // namespace

int64_t TensorShard::elements() const {
  int64_t n = 0;
  for (const auto& b : blocks) n += b.elements();
  return n;
}

ShardPlan ShardPlan::build(const ModelConfig& cfg, const QuantConfig& quant, int tp) {
  FN_REQUIRE(tp == 1 || tp == 2 || tp == 4 || tp == 8, Usage,
             "tp_size must be 1, 2, 4 or 8, got {}", tp);
  require_divides(tp, cfg.num_attention_heads, "num_attention_heads");
  if (cfg.num_gdn_layers() > 0) {
    require_divides(tp, cfg.linear_num_key_heads, "linear_num_key_heads");
    require_divides(tp, cfg.linear_num_value_heads, "linear_num_value_heads");
  }
  FN_REQUIRE(cfg.num_key_value_heads % tp == 0 || tp % cfg.num_key_value_heads == 0, Usage,
             "tp_size {} and num_key_value_heads ({}) must divide one another", tp,
             cfg.num_key_value_heads);
  require_divides(tp, cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size");
  require_divides(tp, cfg.moe_intermediate_size, "moe_intermediate_size");
  if (quant.quantized()) {
    FN_REQUIRE((cfg.moe_intermediate_size / tp) % 16 == 0, Usage,
               "moe_intermediate_size / tp_size ({} / {}) must be a multiple of 16 (one NVFP4 "
               "scale block)",
               cfg.moe_intermediate_size, tp);
  }
  require_divides(tp, cfg.vocab_size, "vocab_size");
  if (cfg.has_ple()) require_divides(tp, cfg.split_ngram_parts, "split_ngram_parts");

  ShardPlan plan;
  plan.tp_size_ = tp;
  plan.kv_heads_ = cfg.num_key_value_heads;
  plan.head_dim_ = cfg.head_dim;
  plan.gdn_key_dim_ = cfg.gdn_key_dim();
  plan.gdn_value_dim_ = cfg.gdn_value_dim();
  plan.moe_intermediate_ = cfg.moe_intermediate_size;
  plan.ngram_parts_ = cfg.split_ngram_parts;
  plan.tensors_ = expected_tensors(cfg, quant);
  plan.splits_.reserve(plan.tensors_.size());
  plan.by_name_.reserve(plan.tensors_.size() * 2);
  for (std::size_t i = 0; i < plan.tensors_.size(); ++i) {
    plan.splits_.push_back(split_of(plan.tensors_[i], plan.kv_heads_, tp));
    plan.by_name_.emplace(plan.tensors_[i].name, i);
  }
  // Per-rank bytes by family, summed per role first (families of roles that occur only).
  const std::size_t n_roles = static_cast<std::size_t>(TensorRole::PleNgramScale) + 1;
  std::vector<bool> present(n_roles, false);
  for (const auto& t : plan.tensors_) present[static_cast<std::size_t>(t.role)] = true;
  plan.family_bytes_.resize(static_cast<std::size_t>(tp));
  for (int r = 0; r < tp; ++r) {
    std::vector<uint64_t> by_role(n_roles, 0);
    for (std::size_t i = 0; i < plan.tensors_.size(); ++i) {
      const ExpectedTensor& t = plan.tensors_[i];
      by_role[static_cast<std::size_t>(t.role)] +=
          static_cast<uint64_t>(plan.shard_elements(i, r)) * dtype_size(t.dtype);
    }
    auto& fam = plan.family_bytes_[static_cast<std::size_t>(r)];
    for (std::size_t k = 0; k < n_roles; ++k) {
      if (present[k]) fam[std::string(tensor_family(static_cast<TensorRole>(k)))] += by_role[k];
    }
  }
  return plan;
}

std::size_t ShardPlan::index(std::string_view name) const {
  auto it = by_name_.find(name);
  FN_REQUIRE(it != by_name_.end(), Format, "'{}' is not a text tensor of this model", name);
  return it->second;
}

TensorShard ShardPlan::shard(std::size_t i, int r) const {
  FN_CHECK(i < tensors_.size(), "tensor index {} of {}", i, tensors_.size());
  FN_CHECK(r >= 0 && r < tp_size_, "tp_rank {} of tp_size {}", r, tp_size_);
  const ExpectedTensor& t = tensors_[i];
  const auto [rows, cols] = view_2d(t.shape);
  const int64_t tp = tp_size_;
  TensorShard s;
  s.split = splits_[i];
  switch (s.split) {
    case SplitKind::Replicated:
      s.replicated = true;
      s.replication = tp_size_;
      s.blocks.push_back({0, rows, 0, cols});
      break;
    case SplitKind::Rows:
      s.blocks.push_back({rows / tp * r, rows / tp, 0, cols});
      break;
    case SplitKind::Cols:
      s.blocks.push_back({0, rows, cols / tp * r, cols / tp});
      break;
    case SplitKind::GdnQkvRows: {
      const int64_t kq = gdn_key_dim_ / tp, vq = gdn_value_dim_ / tp;
      s.blocks.push_back({kq * r, kq, 0, cols});                     // q heads
      s.blocks.push_back({gdn_key_dim_ + kq * r, kq, 0, cols});      // k heads
      s.blocks.push_back({2 * gdn_key_dim_ + vq * r, vq, 0, cols});  // v heads
      break;
    }
    case SplitKind::KvHeadRows: {
      const int64_t head = kv_heads_ * r / tp;
      s.replication = static_cast<int>(tp / kv_heads_);
      s.blocks.push_back({head * head_dim_, head_dim_, 0, cols});
      break;
    }
    case SplitKind::FusedGateUpRows: {
      const int64_t e_n = t.shape[0], in = moe_intermediate_, part = in / tp;
      for (int64_t e = 0; e < e_n; ++e) {
        s.blocks.push_back({e * 2 * in + part * r, part, 0, cols});       // gate rows
        s.blocks.push_back({e * 2 * in + in + part * r, part, 0, cols});  // up rows
      }
      break;
    }
    case SplitKind::NgramShard: {
      const int64_t per_rank = ngram_parts_ / tp;
      if (t.shard / per_rank == r) s.blocks.push_back({0, rows, 0, cols});
      break;
    }
  }
  return s;
}

uint64_t ShardPlan::weight_bytes(int r) const {
  uint64_t total = 0;
  for (const auto& [family, bytes] : weight_bytes_by_family(r)) total += bytes;
  return total;
}

std::map<std::string, uint64_t> ShardPlan::weight_bytes_by_family(int r) const {
  FN_CHECK(r >= 0 && r < tp_size_, "tp_rank {} of tp_size {}", r, tp_size_);
  return family_bytes_[static_cast<std::size_t>(r)];
}

int64_t ShardPlan::shard_elements(std::size_t i, int r) const {
  FN_CHECK(i < tensors_.size(), "tensor index {} of {}", i, tensors_.size());
  FN_CHECK(r >= 0 && r < tp_size_, "tp_rank {} of tp_size {}", r, tp_size_);
  const ExpectedTensor& t = tensors_[i];
  const auto [rows, cols] = view_2d(t.shape);
  switch (splits_[i]) {
    case SplitKind::Replicated:
      return rows * cols;
    case SplitKind::Rows:
    case SplitKind::Cols:
    case SplitKind::GdnQkvRows:
    case SplitKind::FusedGateUpRows:
      return rows * cols / tp_size_;
    case SplitKind::KvHeadRows:
      return head_dim_ * cols;
    case SplitKind::NgramShard:
      return t.shard / (ngram_parts_ / tp_size_) == r ? rows * cols : 0;
  }
  return 0;
}

uint64_t TokenBytes::weight_total() const {
  uint64_t n = 0;
  for (const auto& [family, bytes] : weights) n += bytes;
  return n;
}

TokenBytes bytes_per_token(const ShardPlan& plan, const ModelConfig& cfg, int r, int64_t ctx_size) {
  FN_REQUIRE(ctx_size >= 1, Usage, "ctx_size must be >= 1, got {}", ctx_size);
  const int64_t tp = plan.tp_size();
  TokenBytes tb;
  uint64_t expert_bytes = 0;
  uint64_t ngram_owned_parts = 0;
  uint64_t ngram_row_bytes = 0;
  for (std::size_t i = 0; i < plan.tensors().size(); ++i) {
    const ExpectedTensor& t = plan.tensors()[i];
    const uint64_t bytes = static_cast<uint64_t>(plan.shard_elements(i, r)) * dtype_size(t.dtype);
    switch (t.role) {
      case TensorRole::Embedding:
        tb.weights[std::string(tensor_family(t.role))] +=
            static_cast<uint64_t>(t.shape[1]) * dtype_size(t.dtype);
        break;
      case TensorRole::ExpertWeight:
      case TensorRole::ExpertBlockScale:
      case TensorRole::ExpertGlobalScale:
      case TensorRole::ExpertInputScale:
      case TensorRole::ExpertFusedGateUp:
      case TensorRole::ExpertFusedDown:
        expert_bytes += bytes;
        break;
      case TensorRole::PleNgramShard:
        if (bytes > 0) ++ngram_owned_parts;
        ngram_row_bytes = static_cast<uint64_t>(t.shape[1]) * dtype_size(t.dtype);
        break;
      default:
        tb.weights[std::string(tensor_family(t.role))] += bytes;
    }
  }
  // Experts are identical in size, so the top-k share of the rank's expert bytes is exact.
  tb.weights["moe.experts"] += expert_bytes * static_cast<uint64_t>(cfg.num_experts_per_tok) /
                               static_cast<uint64_t>(cfg.num_experts);
  if (cfg.has_ple()) {
    tb.weights["ple.ngram"] += static_cast<uint64_t>(cfg.ngram_heads()) * ngram_row_bytes *
                               ngram_owned_parts / static_cast<uint64_t>(cfg.split_ngram_parts);
  }
  // States.
  const int64_t qsa = cfg.num_qsa_layers(), gdn = cfg.num_gdn_layers();
  if (qsa > 0) {
    const int64_t local_kv = tp <= cfg.num_key_value_heads ? cfg.num_key_value_heads / tp : 1;
    const int64_t attended = std::min(ctx_size, cfg.qsa_max_attended());
    const int64_t row = local_kv * cfg.head_dim * 2 /*K,V*/ * 2 /*BF16*/;
    tb.kv_cache = static_cast<uint64_t>(qsa * (attended + 1) * row);
    const int64_t ratio = cfg.indexer_compress_ratio;
    const double key = static_cast<double>(cfg.indexer_kv_heads * cfg.indexer_head_dim * 2);
    const double per_layer = key * static_cast<double>(ctx_size / ratio + ctx_size % ratio + 1) +
                             key * static_cast<double>(ratio + 1) / static_cast<double>(ratio);
    tb.indexer_cache = static_cast<uint64_t>(std::llround(per_layer * static_cast<double>(qsa)));
  }
  if (gdn > 0) {
    const int64_t local_v = cfg.linear_num_value_heads / tp;
    tb.gdn_state = static_cast<uint64_t>(gdn * local_v * cfg.linear_key_head_dim *
                                         cfg.linear_value_head_dim * 4 * 2);
    const int64_t channels = cfg.gdn_conv_dim() / tp;
    tb.conv_state += static_cast<uint64_t>(gdn * channels * cfg.linear_conv_kernel_dim * 2);
  }
  if (cfg.has_ple()) {
    tb.conv_state += static_cast<uint64_t>(static_cast<int64_t>(cfg.ple_layer_ids.size()) *
                                           cfg.hc_width() * cfg.ple_conv_kernel_size * 2);
  }
  return tb;
}

StepBytes bytes_per_step(const ShardPlan& plan, const ModelConfig& cfg, int r, int64_t ctx_size,
                         int64_t batch) {
  FN_REQUIRE(batch >= 1, Usage, "batch must be >= 1, got {}", batch);
  const TokenBytes tb = bytes_per_token(plan, cfg, r, ctx_size);
  const auto of = [&tb](std::string_view family) {
    const auto it = tb.weights.find(std::string(family));
    return it == tb.weights.end() ? uint64_t{0} : it->second;
  };
  StepBytes sb;
  sb.batch = batch;
  const uint64_t token_experts = of("moe.experts");
  const uint64_t per_token_rows = of(tensor_family(TensorRole::Embedding)) + of("ple.ngram");
  sb.shared_weights = tb.weight_total() - token_experts - per_token_rows;
  sb.per_sequence = per_token_rows + tb.state_total();
  const double E = static_cast<double>(cfg.num_experts);
  const double k = static_cast<double>(cfg.num_experts_per_tok);
  const double touched = 1.0 - std::pow(1.0 - k / E, static_cast<double>(batch));
  sb.distinct_experts = E * touched;
  // token_experts is k / E of the rank's expert bytes (bytes_per_token): all of them * touched.
  sb.experts =
      static_cast<uint64_t>(std::llround(static_cast<double>(token_experts) * E / k * touched));
  return sb;
}

RankDims rank_dims(const ModelConfig& c, int tp, int r) {
  RankDims d;
  d.linear_k_heads = c.linear_num_key_heads / tp;
  d.linear_v_heads = c.linear_num_value_heads / tp;
  d.gdn_conv_dim =
      2 * d.linear_k_heads * c.linear_key_head_dim + d.linear_v_heads * c.linear_value_head_dim;
  d.q_heads = c.num_attention_heads / tp;
  const int64_t kv = c.num_key_value_heads;
  d.kv_heads = tp <= kv ? kv / tp : 1;
  d.q_head_first = int64_t{r} * d.q_heads;
  d.kv_head_first = tp <= kv ? r * d.kv_heads : (int64_t{r} * kv) / tp;
  d.q_per_kv = kv > 0 ? c.num_attention_heads / kv : 0;
  d.moe_inter = c.moe_intermediate_size / tp;
  d.shared_inter = c.shared_expert_intermediate_size / tp;
  return d;
}

}  // namespace fn

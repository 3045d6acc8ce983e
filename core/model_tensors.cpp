#include "core/model_tensors.h"

#include <fmt/format.h>

#include <unordered_map>

#include "core/error.h"
#include "core/ngram.h"

namespace fn {
namespace {

constexpr std::string_view kPrefix = "model.language_model.";

struct RoleInfo {
  TensorRole role;
  std::string_view name;
  std::string_view family;
};

constexpr RoleInfo kRoles[] = {
    {TensorRole::Embedding, "embed_tokens", "embed"},
    {TensorRole::LmHead, "lm_head", "lm_head"},
    {TensorRole::HcNorm, "hc.norm", "hc"},
    {TensorRole::HcDown, "hc.down", "hc"},
    {TensorRole::HcUp, "hc.up", "hc"},
    {TensorRole::HcInject, "hc.inject", "hc"},
    {TensorRole::Router, "moe.router", "moe.router"},
    {TensorRole::SharedGate, "moe.shared.gate_proj", "moe.shared"},
    {TensorRole::SharedUp, "moe.shared.up_proj", "moe.shared"},
    {TensorRole::SharedDown, "moe.shared.down_proj", "moe.shared"},
    {TensorRole::SharedExpertGate, "moe.shared_expert_gate", "moe.shared"},
    {TensorRole::ExpertWeight, "moe.experts.weight", "moe.experts"},
    {TensorRole::ExpertBlockScale, "moe.experts.weight_scale", "moe.experts"},
    {TensorRole::ExpertGlobalScale, "moe.experts.weight_scale_2", "moe.experts"},
    {TensorRole::ExpertInputScale, "moe.experts.input_scale", "moe.experts"},
    {TensorRole::ExpertFusedGateUp, "moe.experts.gate_up_proj", "moe.experts"},
    {TensorRole::ExpertFusedDown, "moe.experts.down_proj", "moe.experts"},
    {TensorRole::GdnInProjQkv, "gdn.in_proj_qkv", "gdn"},
    {TensorRole::GdnInProjZ, "gdn.in_proj_z", "gdn"},
    {TensorRole::GdnInProjA, "gdn.in_proj_a", "gdn"},
    {TensorRole::GdnInProjB, "gdn.in_proj_b", "gdn"},
    {TensorRole::GdnOutProj, "gdn.out_proj", "gdn"},
    {TensorRole::GdnALog, "gdn.A_log", "gdn"},
    {TensorRole::GdnDtBias, "gdn.dt_bias", "gdn"},
    {TensorRole::GdnConv, "gdn.conv1d", "gdn"},
    {TensorRole::GdnNorm, "gdn.norm", "gdn"},
    {TensorRole::QsaQProj, "qsa.q_proj", "qsa"},
    {TensorRole::QsaKProj, "qsa.k_proj", "qsa"},
    {TensorRole::QsaVProj, "qsa.v_proj", "qsa"},
    {TensorRole::QsaOProj, "qsa.o_proj", "qsa"},
    {TensorRole::QsaQNorm, "qsa.q_norm", "qsa"},
    {TensorRole::QsaKNorm, "qsa.k_norm", "qsa"},
    {TensorRole::IndexerQkProj, "qsa.indexer.index_qk_proj", "qsa"},
    {TensorRole::IndexerQNorm, "qsa.indexer.q_layernorm", "qsa"},
    {TensorRole::IndexerKNorm, "qsa.indexer.k_layernorm", "qsa"},
    {TensorRole::PleKeyProj, "ple.key_proj", "ple"},
    {TensorRole::PleValueProj, "ple.value_proj", "ple"},
    {TensorRole::PleNormKey, "ple.norm_key", "ple"},
    {TensorRole::PleNormQuery, "ple.norm_query", "ple"},
    {TensorRole::PleNormConv, "ple.norm_conv", "ple"},
    {TensorRole::PleConv, "ple.conv1d", "ple"},
    {TensorRole::PleMultipliers, "ple.layer_multipliers", "ple"},
    {TensorRole::PleHeadSizes, "ple.ngram_heads_vocab_sizes", "ple"},
    {TensorRole::PleHeadOffsets, "ple.ngram_heads_offsets", "ple"},
    {TensorRole::PleNgramShard, "ple.ngram_embedding.shard", "ple.ngram"},
    {TensorRole::PleNgramScale, "ple.ngram_embedding.weight_scale", "ple.ngram"},
};

class Builder {
 public:
  explicit Builder(std::vector<ExpectedTensor>& out) : out_(out) {}
  ExpectedTensor& add(std::string name, TensorRole role, int layer, DType dtype,
                      std::vector<int64_t> shape) {
    out_.push_back(
        ExpectedTensor{std::move(name), role, layer, -1, -1, "", dtype, std::move(shape)});
    return out_.back();
  }

 private:
  std::vector<ExpectedTensor>& out_;
};

/// Throws unless `module` has the dtype fngen expects (never NVFP4: only routed experts are).
void require_not_nvfp4(const QuantConfig& q, const std::string& module) {
  FN_REQUIRE(!q.is_nvfp4(module), Format,
             "{}: quantization marks '{}' as NVFP4; fngen supports NVFP4 for routed experts only "
             "(add it to exclude_modules/ignore)",
             q.source, module);
}

void add_hc(Builder& b, const ModelConfig& c, const QuantConfig& q, const std::string& base,
            int layer, bool inject) {
  const int64_t w = c.hc_width(), r = c.hc_lowrank;
  require_not_nvfp4(q, base + ".input_mix_weight_down");
  require_not_nvfp4(q, base + ".input_mix_weight_up");
  b.add(base + ".hc_norm.weight", TensorRole::HcNorm, layer, DType::BF16, {w});
  b.add(base + ".input_mix_weight_down.weight", TensorRole::HcDown, layer, DType::BF16, {r, w});
  b.add(base + ".input_mix_weight_up.weight", TensorRole::HcUp, layer, DType::BF16, {w, r});
  if (inject) {
    require_not_nvfp4(q, base + ".block_inject_weight");
    b.add(base + ".block_inject_weight.weight", TensorRole::HcInject, layer, DType::BF16,
          {c.hc_count, w});
  }
}

void add_ple(Builder& b, std::vector<ExpectedTensor>& out, const ModelConfig& c,
             const QuantConfig& q, const std::string& lp, int layer, int rank) {
  const int64_t w = c.hc_width(), p = c.ple_embed_dim, d = c.hidden_size;
  const std::string pp = lp + "ple.";
  require_not_nvfp4(q, pp + "key_proj");
  require_not_nvfp4(q, pp + "value_proj");
  require_not_nvfp4(q, pp + "ple_embedding.ngram_embedding");
  b.add(pp + "key_proj.weight", TensorRole::PleKeyProj, layer, DType::BF16, {w, p});
  b.add(pp + "value_proj.weight", TensorRole::PleValueProj, layer, DType::BF16, {d, p});
  b.add(pp + "norm_key.weight", TensorRole::PleNormKey, layer, DType::BF16, {w});
  b.add(pp + "norm_query.weight", TensorRole::PleNormQuery, layer, DType::BF16, {w});
  b.add(pp + "norm_conv.weight", TensorRole::PleNormConv, layer, DType::BF16, {w});
  b.add(pp + "conv1d.weight", TensorRole::PleConv, layer, DType::BF16,
        {w, 1, c.ple_conv_kernel_size});
  const std::string ep = pp + "ple_embedding.";
  b.add(ep + "layer_multipliers", TensorRole::PleMultipliers, layer, DType::I64, {c.ngram_size});
  b.add(ep + "ngram_heads_vocab_sizes", TensorRole::PleHeadSizes, layer, DType::I64,
        {c.ngram_heads()});
  b.add(ep + "ngram_heads_offsets", TensorRole::PleHeadOffsets, layer, DType::I64,
        {c.ngram_heads()});
  const bool fp8 = q.ngram_fp8(c);
  const int64_t rows = c.ngram_table_rows(rank) / c.split_ngram_parts;
  for (int64_t s = 0; s < c.split_ngram_parts; ++s) {
    b.add(fmt::format("{}ngram_embedding.shard_{}.weight", ep, s), TensorRole::PleNgramShard, layer,
          fp8 ? DType::F8_E4M3 : DType::BF16, {rows, c.ngram_head_dim()});
    out.back().shard = static_cast<int>(s);
  }
  if (fp8) {
    b.add(ep + "ngram_embedding.weight_scale", TensorRole::PleNgramScale, layer, DType::BF16, {1});
  }
}

void add_experts(Builder& b, std::vector<ExpectedTensor>& out, const ModelConfig& c,
                 const QuantConfig& q, const std::string& lp, int layer) {
  const int64_t d = c.hidden_size, in = c.moe_intermediate_size, e_n = c.num_experts;
  const std::string mp = lp + "mlp.experts.";
  if (!q.quantized()) {
    b.add(mp + "gate_up_proj", TensorRole::ExpertFusedGateUp, layer, DType::BF16, {e_n, 2 * in, d});
    b.add(mp + "down_proj", TensorRole::ExpertFusedDown, layer, DType::BF16, {e_n, d, in});
    return;
  }
  FN_REQUIRE(d % 16 == 0 && in % 16 == 0, Format,
             "{}: NVFP4 experts need hidden_size ({}) and moe_intermediate_size ({}) to be "
             "multiples of 16",
             c.source, d, in);
  static const char* kProj[] = {"gate_proj", "up_proj", "down_proj"};
  for (int64_t e = 0; e < e_n; ++e) {
    for (const char* proj : kProj) {
      const std::string module = fmt::format("{}{}.{}", mp, e, proj);
      FN_REQUIRE(q.is_nvfp4(module), Format,
                 "{}: quantization leaves routed expert module '{}' unquantized; fngen needs "
                 "every routed expert NVFP4 in a quantized checkpoint",
                 q.source, module);
      const bool down = std::string_view(proj) == "down_proj";
      const int64_t rows = down ? d : in, k = down ? in : d;
      auto add = [&](std::string suffix, TensorRole role, DType dt, std::vector<int64_t> shape) {
        b.add(module + suffix, role, layer, dt, std::move(shape));
        out.back().expert = static_cast<int>(e);
        out.back().projection = proj;
      };
      add(".weight", TensorRole::ExpertWeight, DType::U8, {rows, k / 2});
      add(".weight_scale", TensorRole::ExpertBlockScale, DType::F8_E4M3, {rows, k / 16});
      add(".weight_scale_2", TensorRole::ExpertGlobalScale, DType::F32, {});
      add(".input_scale", TensorRole::ExpertInputScale, DType::F32, {});
    }
  }
}

}  // namespace

std::string_view role_name(TensorRole role) noexcept {
  return kRoles[static_cast<std::size_t>(role)].name;
}
std::string_view tensor_family(TensorRole role) noexcept {
  return kRoles[static_cast<std::size_t>(role)].family;
}

int64_t ExpectedTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}
uint64_t ExpectedTensor::nbytes() const {
  return static_cast<uint64_t>(numel()) * dtype_size(dtype);
}

std::vector<ExpectedTensor> expected_tensors(const ModelConfig& c, const QuantConfig& q) {
  for (std::size_t i = 0; i < std::size(kRoles); ++i) {
    FN_CHECK(static_cast<std::size_t>(kRoles[i].role) == i, "role table out of order at {}", i);
  }
  // Tied embeddings would make lm_head the embedding matrix (transformers' tie_weights), which
  // this list and every loader do not model: refuse rather than use a checkpoint's own lm_head.
  FN_REQUIRE(!c.tie_word_embeddings, Format,
             "config.json sets tie_word_embeddings = true: tied input and output embeddings are "
             "not supported (the Qwen3.8-Flash-Next checkpoints have their own lm_head.weight; "
             "docs/model.md §A.1)");
  std::vector<ExpectedTensor> out;
  out.reserve(static_cast<std::size_t>(8 + c.num_hidden_layers * (32 + 12 * c.num_experts) +
                                       c.split_ngram_parts * c.ple_layer_ids.size()));
  Builder b(out);
  const std::string p(kPrefix);
  const int64_t d = c.hidden_size, v = c.vocab_size;
  require_not_nvfp4(q, p + "embed_tokens");
  b.add(p + "embed_tokens.weight", TensorRole::Embedding, -1, DType::BF16, {v, d});
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string lp = fmt::format("{}layers.{}.", p, layer);
    const int rank = c.ple_rank(layer);
    if (rank >= 0) add_ple(b, out, c, q, lp, layer, rank);
    add_hc(b, c, q, lp + "attn_hyper_connection", layer, true);
    add_hc(b, c, q, lp + "mlp_hyper_connection", layer, true);
    if (c.is_qsa(layer)) {
      const std::string ap = lp + "self_attn.";
      for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj", "indexer.index_qk_proj"}) {
        require_not_nvfp4(q, ap + m);
      }
      b.add(ap + "q_proj.weight", TensorRole::QsaQProj, layer, DType::BF16, {c.q_proj_rows(), d});
      b.add(ap + "k_proj.weight", TensorRole::QsaKProj, layer, DType::BF16, {c.kv_proj_rows(), d});
      b.add(ap + "v_proj.weight", TensorRole::QsaVProj, layer, DType::BF16, {c.kv_proj_rows(), d});
      b.add(ap + "o_proj.weight", TensorRole::QsaOProj, layer, DType::BF16, {d, c.o_proj_cols()});
      b.add(ap + "q_norm.weight", TensorRole::QsaQNorm, layer, DType::BF16, {c.head_dim});
      b.add(ap + "k_norm.weight", TensorRole::QsaKNorm, layer, DType::BF16, {c.head_dim});
      b.add(ap + "indexer.index_qk_proj.weight", TensorRole::IndexerQkProj, layer, DType::BF16,
            {c.indexer_proj_rows(), d});
      b.add(ap + "indexer.q_layernorm.weight", TensorRole::IndexerQNorm, layer, DType::BF16,
            {c.indexer_head_dim});
      b.add(ap + "indexer.k_layernorm.weight", TensorRole::IndexerKNorm, layer, DType::BF16,
            {c.indexer_head_dim});
    } else {
      const std::string gp = lp + "linear_attn.";
      for (const char* m : {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}) {
        require_not_nvfp4(q, gp + m);
      }
      const int64_t hv = c.linear_num_value_heads;
      b.add(gp + "in_proj_qkv.weight", TensorRole::GdnInProjQkv, layer, DType::BF16,
            {c.gdn_conv_dim(), d});
      b.add(gp + "in_proj_z.weight", TensorRole::GdnInProjZ, layer, DType::BF16,
            {c.gdn_value_dim(), d});
      b.add(gp + "in_proj_a.weight", TensorRole::GdnInProjA, layer, DType::BF16, {hv, d});
      b.add(gp + "in_proj_b.weight", TensorRole::GdnInProjB, layer, DType::BF16, {hv, d});
      b.add(gp + "out_proj.weight", TensorRole::GdnOutProj, layer, DType::BF16,
            {d, c.gdn_value_dim()});
      b.add(gp + "A_log", TensorRole::GdnALog, layer, DType::BF16, {hv});
      b.add(gp + "dt_bias", TensorRole::GdnDtBias, layer, DType::BF16, {hv});
      b.add(gp + "conv1d.weight", TensorRole::GdnConv, layer, DType::BF16,
            {c.gdn_conv_dim(), 1, c.linear_conv_kernel_dim});
      b.add(gp + "norm.weight", TensorRole::GdnNorm, layer, DType::BF16, {c.linear_value_head_dim});
    }
    const std::string mp = lp + "mlp.";
    for (const char* m : {"gate", "shared_expert.gate_proj", "shared_expert.up_proj",
                          "shared_expert.down_proj", "shared_expert_gate"}) {
      require_not_nvfp4(q, mp + m);
    }
    const int64_t is = c.shared_expert_intermediate_size;
    b.add(mp + "gate.weight", TensorRole::Router, layer, DType::BF16, {c.num_experts, d});
    b.add(mp + "shared_expert.gate_proj.weight", TensorRole::SharedGate, layer, DType::BF16,
          {is, d});
    b.add(mp + "shared_expert.up_proj.weight", TensorRole::SharedUp, layer, DType::BF16, {is, d});
    b.add(mp + "shared_expert.down_proj.weight", TensorRole::SharedDown, layer, DType::BF16,
          {d, is});
    b.add(mp + "shared_expert_gate.weight", TensorRole::SharedExpertGate, layer, DType::BF16,
          {1, d});
    add_experts(b, out, c, q, lp, layer);
  }
  add_hc(b, c, q, p + "hyper_connection_mixer", -1, false);
  require_not_nvfp4(q, "lm_head");
  b.add("lm_head.weight", TensorRole::LmHead, -1, DType::BF16, {v, d});
  return out;
}

SkipReason skipped_tensor(std::string_view name) noexcept {
  if (name.starts_with("model.visual.")) return SkipReason::Vision;
  if (name.starts_with("mtp.") || name.starts_with("model.mtp.")) return SkipReason::Mtp;
  return SkipReason::None;
}

std::string shape_string(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

ValidationReport validate_tensors(const std::vector<ExpectedTensor>& expected,
                                  const std::vector<FoundTensor>& found) {
  ValidationReport r;
  r.expected = expected.size();
  r.found = found.size();
  std::unordered_map<std::string_view, std::size_t> index;
  index.reserve(expected.size() * 2);
  for (std::size_t i = 0; i < expected.size(); ++i) index.emplace(expected[i].name, i);
  std::vector<uint8_t> seen(expected.size(), 0);
  for (const FoundTensor& t : found) {
    switch (skipped_tensor(t.name)) {
      case SkipReason::Vision:
        ++r.skipped_vision;
        continue;
      case SkipReason::Mtp:
        ++r.skipped_mtp;
        continue;
      case SkipReason::None:
        break;
    }
    auto it = index.find(t.name);
    if (it == index.end()) {
      ++r.unexpected;
      r.problems.push_back(fmt::format("unexpected tensor '{}' ({} {})", t.name,
                                       dtype_name(t.dtype), shape_string(t.shape)));
      continue;
    }
    const ExpectedTensor& e = expected[it->second];
    if (seen[it->second]++) {
      ++r.duplicates;
      r.problems.push_back(fmt::format("tensor '{}' appears more than once", t.name));
      continue;
    }
    bool good = true;
    if (t.dtype != e.dtype) {
      ++r.wrong_dtype;
      good = false;
      r.problems.push_back(fmt::format("tensor '{}' has dtype {}, expected {}", t.name,
                                       dtype_name(t.dtype), dtype_name(e.dtype)));
    }
    if (!std::equal(t.shape.begin(), t.shape.end(), e.shape.begin(), e.shape.end())) {
      ++r.wrong_shape;
      good = false;
      r.problems.push_back(fmt::format("tensor '{}' has shape {}, expected {}", t.name,
                                       shape_string(t.shape), shape_string(e.shape)));
    }
    if (good) ++r.matched;
  }
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (seen[i]) continue;
    ++r.missing;
    r.problems.push_back(fmt::format("missing tensor '{}' ({} {})", expected[i].name,
                                     dtype_name(expected[i].dtype),
                                     shape_string(expected[i].shape)));
  }
  return r;
}

void require_valid(const ValidationReport& r, std::string_view checkpoint_dir) {
  if (r.ok()) return;
  std::string list;
  for (std::size_t i = 0; i < r.problems.size() && i < kValidationProblemsShown; ++i) {
    list += (i ? "; " : "") + r.problems[i];
  }
  if (r.problems.size() > kValidationProblemsShown) {
    list += fmt::format("; ... and {} more", r.problems.size() - kValidationProblemsShown);
  }
  FN_THROW(Format,
           "{}: {} tensor problem{} ({} missing, {} unexpected, {} wrong dtype, {} wrong shape, {} "
           "duplicated): {}",
           checkpoint_dir, r.problems.size(), r.problems.size() == 1 ? "" : "s", r.missing,
           r.unexpected, r.wrong_dtype, r.wrong_shape, r.duplicates, list);
}

}  // namespace fn

#include "core/config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "core/error.h"
#include "core/ngram.h"
#include "core/paths.h"

namespace fn {
namespace {

using nlohmann::json;

const char* json_type(const json& v) {
  return v.type_name();
}

/// Reads fields of one JSON object; every message names "<source>: <prefix><field>".
class Fields {
 public:
  Fields(const json& obj, std::string source, std::string prefix)
      : obj_(obj), source_(std::move(source)), prefix_(std::move(prefix)) {}

  std::string name(std::string_view field) const { return fmt::format("{}{}", prefix_, field); }
  const std::string& source() const { return source_; }

  /// The value, or nullptr when absent or JSON null.
  const json* get(std::string_view field) const {
    auto it = obj_.find(std::string(field));
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  const json& need(std::string_view field) const {
    const json* v = get(field);
    FN_REQUIRE(v != nullptr, Format, "{}: missing required field {}", source_, name(field));
    return *v;
  }

  int64_t as_int(const json& v, std::string_view field) const {
    FN_REQUIRE(v.is_number_integer(), Format, "{}: {} must be an integer, got {} ({})", source_,
               name(field), v.dump(), json_type(v));
    if (v.is_number_unsigned()) {
      FN_REQUIRE(v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX), Format,
                 "{}: {} is out of range: {}", source_, name(field), v.dump());
    }
    return v.get<int64_t>();
  }
  double as_double(const json& v, std::string_view field) const {
    FN_REQUIRE(v.is_number(), Format, "{}: {} must be a number, got {} ({})", source_, name(field),
               v.dump(), json_type(v));
    return v.get<double>();
  }
  bool as_bool(const json& v, std::string_view field) const {
    FN_REQUIRE(v.is_boolean(), Format, "{}: {} must be a boolean, got {} ({})", source_,
               name(field), v.dump(), json_type(v));
    return v.get<bool>();
  }
  std::string as_string(const json& v, std::string_view field) const {
    FN_REQUIRE(v.is_string(), Format, "{}: {} must be a string, got {} ({})", source_, name(field),
               v.dump(), json_type(v));
    return v.get<std::string>();
  }

  void int_field(std::string_view field, int64_t& out, bool required = false) const {
    const json* v = required ? &need(field) : get(field);
    if (v) out = as_int(*v, field);
  }
  void double_field(std::string_view field, double& out) const {
    if (const json* v = get(field)) out = as_double(*v, field);
  }
  void bool_field(std::string_view field, bool& out) const {
    if (const json* v = get(field)) out = as_bool(*v, field);
  }
  void string_field(std::string_view field, std::string& out) const {
    if (const json* v = get(field)) out = as_string(*v, field);
  }
  std::optional<int64_t> opt_int(std::string_view field) const {
    if (const json* v = get(field)) return as_int(*v, field);
    return std::nullopt;
  }
  std::optional<double> opt_double(std::string_view field) const {
    if (const json* v = get(field)) return as_double(*v, field);
    return std::nullopt;
  }
  /// An int or a list of ints (eos_token_id).
  std::vector<int64_t> int_or_list(std::string_view field) const {
    std::vector<int64_t> out;
    const json* v = get(field);
    if (!v) return out;
    if (v->is_array()) {
      for (std::size_t i = 0; i < v->size(); ++i) {
        out.push_back(as_int((*v)[i], fmt::format("{}[{}]", field, i)));
      }
    } else {
      FN_REQUIRE(v->is_number_integer(), Format,
                 "{}: {} must be an integer or a list of integers, got {} ({})", source_,
                 name(field), v->dump(), json_type(*v));
      out.push_back(as_int(*v, field));
    }
    return out;
  }

 private:
  const json& obj_;
  std::string source_;
  std::string prefix_;
};

/// Throws "source: field must be <what>, got value" unless cond holds.
#define FN_CONFIG_RULE(cond, f, field, what, value) \
  FN_REQUIRE(cond, Format, "{}: {} must be {}, got {}", (f).source(), (f).name(field), what, value)

json read_json_file(const std::filesystem::path& path) {
  std::error_code ec;
  FN_REQUIRE(!std::filesystem::is_directory(path, ec), Format,
             "{}: is a directory, not a JSON file", path.string());
  const std::string text = read_regular_file(path, kMaxCheckpointJsonBytes, "");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    FN_THROW(Format, "{}: not valid JSON: {}", path.string(), e.what());
  }
  FN_REQUIRE(j.is_object(), Format, "{}: the top level must be a JSON object, got {}",
             path.string(), json_type(j));
  return j;
}

void parse_rope(const Fields& f, ModelConfig& c) {
  // Legacy top-level fields first; rope_parameters (transformers 5) wins where present.
  f.double_field("rope_theta", c.rope_theta);
  f.double_field("partial_rotary_factor", c.partial_rotary_factor);
  if (const json* rs = f.get("rope_scaling")) {
    FN_REQUIRE(rs->is_object(), Format, "{}: {} must be an object, got {}", f.source(),
               f.name("rope_scaling"), json_type(*rs));
    Fields r(*rs, f.source(), f.name("rope_scaling."));
    if (r.get("rope_type")) {
      r.string_field("rope_type", c.rope_type);
    } else if (r.get("type")) {
      r.string_field("type", c.rope_type);
    }
    FN_REQUIRE(c.rope_type == "default", Format, "{}: {} '{}' is not supported (only \"default\")",
               f.source(), f.name("rope_scaling.rope_type"), c.rope_type);
  }
  if (const json* rp = f.get("rope_parameters")) {
    FN_REQUIRE(rp->is_object(), Format, "{}: {} must be an object, got {}", f.source(),
               f.name("rope_parameters"), json_type(*rp));
    Fields r(*rp, f.source(), f.name("rope_parameters."));
    r.string_field("rope_type", c.rope_type);
    FN_REQUIRE(c.rope_type == "default", Format,
               "{}: {} '{}' is not supported (only \"default\"; YaRN and other scalings are "
               "rejected)",
               f.source(), r.name("rope_type"), c.rope_type);
    r.double_field("rope_theta", c.rope_theta);
    r.double_field("partial_rotary_factor", c.partial_rotary_factor);
  }
}

// Upper bounds on the sizes, checked before anything is sized from them (layer_types is built
// from num_hidden_layers): a hostile config (num_hidden_layers 10^6, hidden_size 2^62) took all
// host memory or overflowed the 64-bit byte counts of inspect and the loaders. The real model
// sits far inside each bound (docs/model.md A.2); every product of bounded sizes fits in 64 bits.
void check_size_bounds(const Fields& f, const ModelConfig& c) {
  constexpr int64_t kMaxDim = int64_t{1} << 20;  // a width, head count or head dimension
  constexpr int64_t kMaxSmall = 1024;            // layers, kernel sizes, per-n-gram counts
  const std::pair<const char*, int64_t> dims[] = {
      {"hidden_size", c.hidden_size},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"linear_key_head_dim", c.linear_key_head_dim},
      {"linear_value_head_dim", c.linear_value_head_dim},
      {"linear_num_key_heads", c.linear_num_key_heads},
      {"linear_num_value_heads", c.linear_num_value_heads},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"shared_expert_intermediate_size", c.shared_expert_intermediate_size},
      {"hc_lowrank", c.hc_lowrank},
      {"indexer_n_heads", c.indexer_n_heads},
      {"indexer_kv_heads", c.indexer_kv_heads},
      {"indexer_head_dim", c.indexer_head_dim},
      {"indexer_budget", c.indexer_budget},
      {"ple_embed_dim", c.ple_embed_dim},
      {"make_ngram_vocab_size_divisible_by", c.make_ngram_vocab_size_divisible_by},
      {"split_ngram_parts", c.split_ngram_parts}};
  for (const auto& [name, v] : dims)
    FN_CONFIG_RULE(v <= kMaxDim, f, name, fmt::format("at most {} (2^20)", kMaxDim), v);
  const std::pair<const char*, int64_t> small[] = {
      {"num_hidden_layers", c.num_hidden_layers},
      {"full_attention_interval", c.full_attention_interval},
      {"linear_conv_kernel_dim", c.linear_conv_kernel_dim},
      {"hc_count", c.hc_count},
      {"indexer_compress_ratio", c.indexer_compress_ratio},
      {"ple_conv_kernel_size", c.ple_conv_kernel_size},
      {"ngram_size", c.ngram_size},
      {"heads_per_ngram", c.heads_per_ngram}};
  for (const auto& [name, v] : small)
    FN_CONFIG_RULE(v <= kMaxSmall, f, name, fmt::format("at most {}", kMaxSmall), v);
  FN_CONFIG_RULE(c.max_position_embeddings <= (int64_t{1} << 24), f, "max_position_embeddings",
                 "at most 16777216 (2^24)", c.max_position_embeddings);
  FN_CONFIG_RULE(c.ngram_vocab_size_base <= std::numeric_limits<int32_t>::max(), f,
                 "ngram_vocab_size_base", "at most 2^31 - 1", c.ngram_vocab_size_base);
}

void parse_layer_types(const Fields& f, ModelConfig& c) {
  c.layer_types.clear();
  // Before the list is built from or matched against it, so that a count of 0 or less is named
  // as such (validate() runs after this; it does not check the count again).
  FN_CONFIG_RULE(c.num_hidden_layers > 0, f, "num_hidden_layers", "> 0", c.num_hidden_layers);
  const json* v = f.get("layer_types");
  if (!v) {
    FN_CONFIG_RULE(c.full_attention_interval > 0, f, "full_attention_interval", "> 0",
                   c.full_attention_interval);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      c.layer_types.push_back((i + 1) % c.full_attention_interval == 0
                                  ? LayerType::QwenSparseAttention
                                  : LayerType::LinearAttention);
    }
    return;
  }
  FN_REQUIRE(v->is_array(), Format, "{}: {} must be a list of strings, got {}", f.source(),
             f.name("layer_types"), json_type(*v));
  for (std::size_t i = 0; i < v->size(); ++i) {
    std::string field = fmt::format("layer_types[{}]", i);
    std::string s = f.as_string((*v)[i], field);
    if (s == "linear_attention") {
      c.layer_types.push_back(LayerType::LinearAttention);
    } else if (s == "full_attention" || s == "qwen_sparse_attention") {
      c.layer_types.push_back(LayerType::QwenSparseAttention);
    } else {
      FN_THROW(Format,
               "{}: {} must be \"linear_attention\", \"full_attention\" or "
               "\"qwen_sparse_attention\", got \"{}\"",
               f.source(), f.name(field), s);
    }
  }
  FN_REQUIRE(static_cast<int64_t>(c.layer_types.size()) == c.num_hidden_layers, Format,
             "{}: {} has {} entries but num_hidden_layers is {}", f.source(), f.name("layer_types"),
             c.layer_types.size(), c.num_hidden_layers);
}

void validate(const Fields& f, ModelConfig& c) {
  auto positive = [&](std::string_view field, int64_t v) {
    FN_CONFIG_RULE(v > 0, f, field, "> 0", v);
  };
  // Token ids are int32 everywhere (prompts, sampler, kernels).
  FN_CONFIG_RULE(c.vocab_size > 0 && c.vocab_size <= std::numeric_limits<int32_t>::max(), f,
                 "vocab_size", "in [1, 2^31 - 1] (token ids are 32-bit)", c.vocab_size);
  positive("hidden_size", c.hidden_size);
  positive("num_attention_heads", c.num_attention_heads);
  positive("num_key_value_heads", c.num_key_value_heads);
  positive("head_dim", c.head_dim);
  positive("max_position_embeddings", c.max_position_embeddings);
  FN_CONFIG_RULE(c.num_attention_heads % c.num_key_value_heads == 0, f, "num_attention_heads",
                 fmt::format("a multiple of num_key_value_heads ({})", c.num_key_value_heads),
                 c.num_attention_heads);
  FN_CONFIG_RULE(c.rms_norm_eps > 0, f, "rms_norm_eps", "> 0", c.rms_norm_eps);
  FN_CONFIG_RULE(c.rope_theta > 0, f, "rope_parameters.rope_theta", "> 0", c.rope_theta);
  FN_CONFIG_RULE(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1, f,
                 "partial_rotary_factor", "in (0, 1]", c.partial_rotary_factor);
  double rot = static_cast<double>(c.head_dim) * c.partial_rotary_factor;
  FN_CONFIG_RULE(rot == std::floor(rot) && static_cast<int64_t>(rot) % 2 == 0, f,
                 "partial_rotary_factor",
                 fmt::format("such that head_dim ({}) x factor is an even integer", c.head_dim),
                 c.partial_rotary_factor);
  FN_CONFIG_RULE(c.hidden_act == "silu", f, "hidden_act", "\"silu\" (the only MLP activation)",
                 fmt::format("\"{}\"", c.hidden_act));
  positive("linear_conv_kernel_dim", c.linear_conv_kernel_dim);
  positive("linear_key_head_dim", c.linear_key_head_dim);
  positive("linear_value_head_dim", c.linear_value_head_dim);
  positive("linear_num_key_heads", c.linear_num_key_heads);
  positive("linear_num_value_heads", c.linear_num_value_heads);
  FN_CONFIG_RULE(c.linear_num_value_heads % c.linear_num_key_heads == 0, f,
                 "linear_num_value_heads",
                 fmt::format("a multiple of linear_num_key_heads ({})", c.linear_num_key_heads),
                 c.linear_num_value_heads);
  FN_CONFIG_RULE(c.hc_count > 1, f, "hc_count", "> 1", c.hc_count);
  positive("hc_lowrank", c.hc_lowrank);
  // The CUDA router's shared-memory limit (kMaxNumExperts); it also keeps a hostile count from
  // sizing host tables.
  FN_CONFIG_RULE(c.num_experts > 0 && c.num_experts <= kMaxNumExperts, f, "num_experts",
                 fmt::format("in [1, {}]", kMaxNumExperts), c.num_experts);
  FN_CONFIG_RULE(c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_experts, f,
                 "num_experts_per_tok", fmt::format("in [1, num_experts = {}]", c.num_experts),
                 c.num_experts_per_tok);
  positive("moe_intermediate_size", c.moe_intermediate_size);
  positive("shared_expert_intermediate_size", c.shared_expert_intermediate_size);

  // Indexer (docs/model.md §G.2): all or none; required when any layer is QSA.
  const int64_t idx[] = {c.indexer_n_heads, c.indexer_kv_heads, c.indexer_head_dim,
                         c.indexer_budget, c.indexer_compress_ratio};
  const char* idx_names[] = {"indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
                             "indexer_budget", "indexer_compress_ratio"};
  bool any_idx = false;
  for (int64_t v : idx) any_idx = any_idx || v != 0;
  if (any_idx || c.num_qsa_layers() > 0) {
    for (int i = 0; i < 5; ++i) {
      FN_REQUIRE(f.get(idx_names[i]) != nullptr, Format,
                 "{}: missing required field {} (every indexer field must be set when any is, "
                 "or when a layer is full_attention)",
                 f.source(), f.name(idx_names[i]));
      positive(idx_names[i], idx[i]);
    }
    FN_CONFIG_RULE(c.indexer_kv_heads == 1, f, "indexer_kv_heads", "1", c.indexer_kv_heads);
    FN_CONFIG_RULE(
        c.indexer_budget % c.indexer_compress_ratio == 0, f, "indexer_budget",
        fmt::format("a multiple of indexer_compress_ratio ({})", c.indexer_compress_ratio),
        c.indexer_budget);
    FN_CONFIG_RULE(c.rotary_dim() <= c.indexer_head_dim, f, "indexer_head_dim",
                   fmt::format(">= rotary_dim ({})", c.rotary_dim()), c.indexer_head_dim);
  }

  // PLE (docs/model.md §G.2, §C.4).
  if (c.has_ple()) {
    positive("ple_embed_dim", c.ple_embed_dim);
    FN_CONFIG_RULE(c.ngram_size >= 2, f, "ngram_size", ">= 2", c.ngram_size);
    positive("heads_per_ngram", c.heads_per_ngram);
    positive("ple_conv_kernel_size", c.ple_conv_kernel_size);
    FN_CONFIG_RULE(c.ngram_vocab_size_base >= 2, f, "ngram_vocab_size_base", ">= 2",
                   c.ngram_vocab_size_base);
    positive("make_ngram_vocab_size_divisible_by", c.make_ngram_vocab_size_divisible_by);
    positive("split_ngram_parts", c.split_ngram_parts);
    FN_CONFIG_RULE(
        c.ple_embed_dim % c.ngram_heads() == 0, f, "ple_embed_dim",
        fmt::format("a multiple of (ngram_size - 1) * heads_per_ngram = {}", c.ngram_heads()),
        c.ple_embed_dim);
    for (int64_t id : c.ple_layer_ids) {
      FN_CONFIG_RULE(id >= 1 && id <= c.num_hidden_layers, f, "ple_layer_ids",
                     fmt::format("one-indexed layer ids in [1, {}]", c.num_hidden_layers), id);
      FN_REQUIRE(c.layer_types[static_cast<std::size_t>(id - 1)] == LayerType::LinearAttention,
                 Format, "{}: {} names layer {} (index {}), which must be linear_attention",
                 f.source(), f.name("ple_layer_ids"), id, id - 1);
    }
    FN_REQUIRE(!c.eos_token_id.empty(), Format,
               "{}: missing required field {} (the PLE n-gram hash needs it)", f.source(),
               f.name("eos_token_id"));
    for (std::size_t r = 0; r < c.ple_layer_ids.size(); ++r) {
      int64_t rows = c.ngram_table_rows(static_cast<int>(r));
      FN_REQUIRE(rows % c.split_ngram_parts == 0, Format,
                 "{}: {} ({}) must divide the n-gram table rows ({})", f.source(),
                 f.name("split_ngram_parts"), c.split_ngram_parts, rows);
    }
  }
  // Token ids (eos, and bos and pad when not null) lie in the vocabulary.
  const auto token_id = [&](const char* field, int64_t id) {
    FN_CONFIG_RULE(id >= 0 && id < c.vocab_size, f, field,
                   fmt::format("in [0, vocab_size = {})", c.vocab_size), id);
  };
  for (int64_t id : c.eos_token_id) token_id("eos_token_id", id);
  if (c.bos_token_id) token_id("bos_token_id", *c.bos_token_id);
  if (c.pad_token_id) token_id("pad_token_id", *c.pad_token_id);
  if (c.ple_embedding_dtype) {
    FN_REQUIRE(*c.ple_embedding_dtype == "float8_e4m3fn" || *c.ple_embedding_dtype == "bfloat16",
               Format, "{}: {} must be \"float8_e4m3fn\" or \"bfloat16\", got \"{}\"", f.source(),
               f.name("ple_embedding_dtype"), *c.ple_embedding_dtype);
  }
}

}  // namespace

int64_t ModelConfig::rotary_dim() const {
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
}

int64_t ModelConfig::ngram_table_rows(int ple_layer_rank) const {
  return ngram_padded_rows(*this, ple_layer_rank);
}

bool ModelConfig::is_qsa(int64_t layer) const {
  FN_CHECK(layer >= 0 && layer < static_cast<int64_t>(layer_types.size()), "layer {} of {}", layer,
           layer_types.size());
  return layer_types[static_cast<std::size_t>(layer)] == LayerType::QwenSparseAttention;
}

int64_t ModelConfig::num_qsa_layers() const {
  return std::count(layer_types.begin(), layer_types.end(), LayerType::QwenSparseAttention);
}

std::vector<int64_t> ModelConfig::ple_layer_indices() const {
  std::vector<int64_t> out;
  for (int64_t id : ple_layer_ids) out.push_back(id - 1);
  return out;
}

int ModelConfig::ple_rank(int64_t layer) const {
  for (std::size_t i = 0; i < ple_layer_ids.size(); ++i) {
    if (ple_layer_ids[i] - 1 == layer) return static_cast<int>(i);
  }
  return -1;
}

int64_t ModelConfig::ple_eos() const {
  FN_REQUIRE(!eos_token_id.empty(), Format, "{}: eos_token_id is not set", source);
  return eos_token_id.front();
}

ModelConfig parse_model_config(const json& j, std::string_view source) {
  std::string src(source);
  FN_REQUIRE(j.is_object(), Format, "{}: the top level must be a JSON object, got {}", src,
             json_type(j));
  Fields top(j, src, "");
  std::string model_type = top.as_string(top.need("model_type"), "model_type");
  const json* text = &j;
  std::string prefix;
  if (model_type == "qwen4_exp") {
    const json& tc = top.need("text_config");
    FN_REQUIRE(tc.is_object(), Format, "{}: text_config must be an object, got {}", src,
               json_type(tc));
    text = &tc;
    prefix = "text_config.";
    Fields tf(tc, src, prefix);
    if (const json* mt = tf.get("model_type")) {
      std::string tmt = tf.as_string(*mt, "model_type");
      FN_REQUIRE(tmt == "qwen4_exp_text", Format,
                 "{}: text_config.model_type must be \"qwen4_exp_text\", got \"{}\"", src, tmt);
    }
  } else {
    FN_REQUIRE(model_type == "qwen4_exp_text", Format,
               "{}: model_type must be \"qwen4_exp\" or \"qwen4_exp_text\", got \"{}\"", src,
               model_type);
  }
  Fields f(*text, src, prefix);
  ModelConfig c;
  c.source = src;
  // Geometry fields are required: the class defaults (docs/model.md §G.1) describe no released
  // model, so a checkpoint whose config lacks them is broken rather than "default".
  f.int_field("vocab_size", c.vocab_size, true);
  f.int_field("hidden_size", c.hidden_size, true);
  f.int_field("num_hidden_layers", c.num_hidden_layers, true);
  f.int_field("num_attention_heads", c.num_attention_heads, true);
  f.int_field("num_key_value_heads", c.num_key_value_heads, true);
  f.int_field("head_dim", c.head_dim);
  f.int_field("full_attention_interval", c.full_attention_interval);
  f.string_field("hidden_act", c.hidden_act);
  f.int_field("max_position_embeddings", c.max_position_embeddings);
  f.double_field("rms_norm_eps", c.rms_norm_eps);
  parse_rope(f, c);
  f.int_field("linear_conv_kernel_dim", c.linear_conv_kernel_dim);
  f.int_field("linear_key_head_dim", c.linear_key_head_dim);
  f.int_field("linear_value_head_dim", c.linear_value_head_dim);
  f.int_field("linear_num_key_heads", c.linear_num_key_heads);
  f.int_field("linear_num_value_heads", c.linear_num_value_heads);
  std::string gate = c.hidden_act;  // F.1.21: absent output_gate_type falls back to hidden_act
  f.string_field("output_gate_type", gate);
  if (gate == "sigmoid") {
    c.output_gate_type = GateActivation::Sigmoid;
  } else if (gate == "silu") {
    c.output_gate_type = GateActivation::Silu;
  } else {
    FN_THROW(Format, "{}: {} must be \"sigmoid\" or \"silu\", got \"{}\"", src,
             f.name(f.get("output_gate_type") ? "output_gate_type" : "hidden_act"), gate);
  }
  f.int_field("num_experts", c.num_experts, true);
  f.int_field("num_experts_per_tok", c.num_experts_per_tok, true);
  f.int_field("moe_intermediate_size", c.moe_intermediate_size, true);
  f.int_field("shared_expert_intermediate_size", c.shared_expert_intermediate_size, true);
  f.bool_field("norm_topk_prob", c.norm_topk_prob);
  f.int_field("hc_count", c.hc_count);
  f.int_field("hc_lowrank", c.hc_lowrank);
  f.int_field("indexer_n_heads", c.indexer_n_heads);
  f.int_field("indexer_kv_heads", c.indexer_kv_heads);
  f.int_field("indexer_head_dim", c.indexer_head_dim);
  f.int_field("indexer_budget", c.indexer_budget);
  f.int_field("indexer_compress_ratio", c.indexer_compress_ratio);
  if (const json* ids = f.get("ple_layer_ids")) {
    FN_REQUIRE(ids->is_array(), Format, "{}: {} must be a list of integers, got {}", src,
               f.name("ple_layer_ids"), json_type(*ids));
    std::set<int64_t> uniq;
    for (std::size_t i = 0; i < ids->size(); ++i) {
      uniq.insert(f.as_int((*ids)[i], fmt::format("ple_layer_ids[{}]", i)));
    }
    c.ple_layer_ids.assign(uniq.begin(), uniq.end());
  }
  c.ple_embed_dim = c.hidden_size;
  f.int_field("ple_embed_dim", c.ple_embed_dim);
  f.int_field("ple_conv_kernel_size", c.ple_conv_kernel_size);
  f.int_field("ngram_size", c.ngram_size);
  f.int_field("heads_per_ngram", c.heads_per_ngram);
  f.int_field("ngram_vocab_size_base", c.ngram_vocab_size_base);
  f.int_field("make_ngram_vocab_size_divisible_by", c.make_ngram_vocab_size_divisible_by);
  f.int_field("split_ngram_parts", c.split_ngram_parts);
  f.int_field("seed", c.seed);
  // Token ids: text_config first, the top level as fallback (HF keeps them in both places).
  c.eos_token_id = f.int_or_list("eos_token_id");
  if (c.eos_token_id.empty() && text != &j) c.eos_token_id = top.int_or_list("eos_token_id");
  c.bos_token_id = f.opt_int("bos_token_id");
  if (!c.bos_token_id && text != &j) c.bos_token_id = top.opt_int("bos_token_id");
  c.pad_token_id = f.opt_int("pad_token_id");
  if (!c.pad_token_id && text != &j) c.pad_token_id = top.opt_int("pad_token_id");
  // The wrapper's tie_word_embeddings decides for Qwen4ExpForConditionalGeneration.
  f.bool_field("tie_word_embeddings", c.tie_word_embeddings);
  if (text != &j) top.bool_field("tie_word_embeddings", c.tie_word_embeddings);
  if (const json* d = f.get("ple_embedding_dtype")) {
    c.ple_embedding_dtype = f.as_string(*d, "ple_embedding_dtype");
  }
  check_size_bounds(f, c);
  parse_layer_types(f, c);
  validate(f, c);
  return c;
}

ModelConfig load_model_config(const std::filesystem::path& dir_or_file) {
  std::filesystem::path path = dir_or_file;
  if (std::filesystem::is_directory(path)) path /= "config.json";
  return parse_model_config(read_json_file(path), path.string());
}

// ---------------------------------------------------------------- quantization

bool glob_match(std::string_view p, std::string_view s) {
  // Fast paths for the shapes exclude lists use ("lm_head", "mtp.*", "*.ple.*", "*x"); checked
  // for every routed expert module at load, so they matter.
  const std::size_t first_wild = p.find_first_of("*?");
  if (first_wild == std::string_view::npos) return p == s;
  const std::string_view inner = p.substr(1, p.size() >= 2 ? p.size() - 2 : 0);
  if (p.size() >= 2 && p.front() == '*' && p.back() == '*' &&
      inner.find_first_of("*?") == std::string_view::npos) {
    return s.find(inner) != std::string_view::npos;
  }
  if (first_wild == p.size() - 1 && p.back() == '*') return s.starts_with(p.substr(0, first_wild));
  if (first_wild == 0 && p.front() == '*' && p.find_first_of("*?", 1) == std::string_view::npos) {
    return s.ends_with(p.substr(1));
  }
  std::size_t pi = 0, si = 0, star = std::string_view::npos, mark = 0;
  while (si < s.size()) {
    if (pi < p.size() && (p[pi] == '?' || p[pi] == s[si])) {
      ++pi;
      ++si;
    } else if (pi < p.size() && p[pi] == '*') {
      star = pi++;
      mark = si;
    } else if (star != std::string_view::npos) {
      pi = star + 1;
      si = ++mark;
    } else {
      return false;
    }
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

namespace {

bool is_fp8_algo(std::string_view a) {
  return a == "FP8";
}
bool is_mtp_only_algo(std::string_view a) {
  return a == "FP8_PB_WO" || a == "FP8_BLOCK_SCALES";
}

/// Module `m` is covered by quantized_layers key `k`: equal, a dotted ancestor, or a glob match.
bool layer_key_covers(std::string_view k, std::string_view m) {
  if (k == m) return true;
  if (m.size() > k.size() && m.substr(0, k.size()) == k && m[k.size()] == '.') return true;
  return k.find_first_of("*?") != std::string_view::npos && glob_match(k, m);
}

std::vector<std::string> string_list(const Fields& f, std::string_view field) {
  std::vector<std::string> out;
  const json* v = f.get(field);
  if (!v) return out;
  FN_REQUIRE(v->is_array(), Format, "{}: {} must be a list of strings, got {}", f.source(),
             f.name(field), json_type(*v));
  for (std::size_t i = 0; i < v->size(); ++i) {
    out.push_back(f.as_string((*v)[i], fmt::format("{}[{}]", field, i)));
  }
  return out;
}

void parse_quantized_layers(const Fields& f, QuantConfig& q) {
  const json& ql = f.need("quantized_layers");
  FN_REQUIRE(ql.is_object(), Format, "{}: {} must be an object, got {}", f.source(),
             f.name("quantized_layers"), json_type(ql));
  for (auto it = ql.begin(); it != ql.end(); ++it) {
    FN_REQUIRE(it->is_object(), Format, "{}: {} must be an object, got {}", f.source(),
               f.name("quantized_layers." + it.key()), json_type(*it));
    Fields e(*it, f.source(), f.name("quantized_layers." + it.key() + "."));
    QuantLayer layer;
    layer.quant_algo = e.as_string(e.need("quant_algo"), "quant_algo");
    e.int_field("group_size", layer.group_size);
    const bool mtp = it.key().rfind("mtp.", 0) == 0 || it.key().rfind("model.mtp.", 0) == 0;
    FN_REQUIRE(layer.quant_algo == "NVFP4" || is_fp8_algo(layer.quant_algo) ||
                   (mtp && is_mtp_only_algo(layer.quant_algo)),
               Format, "{}: {} '{}' is not supported (NVFP4 or FP8)", f.source(),
               e.name("quant_algo"), layer.quant_algo);
    if (layer.quant_algo == "NVFP4") {
      FN_REQUIRE(layer.group_size == 0 || layer.group_size == 16, Format,
                 "{}: {} must be 16 for NVFP4, got {}", f.source(), e.name("group_size"),
                 layer.group_size);
    }
    q.quantized_layers.emplace_back(it.key(), layer);
  }
}

void set_algo(const Fields& f, std::string_view field, QuantConfig& q) {
  if (q.quant_algo == "NVFP4") {
    q.algo = QuantConfig::Algo::Nvfp4;
  } else if (q.quant_algo == "MIXED_PRECISION") {
    q.algo = QuantConfig::Algo::MixedPrecision;
  } else {
    FN_THROW(Format, "{}: {} '{}' is not supported (NVFP4 or MIXED_PRECISION)", f.source(),
             f.name(field), q.quant_algo);
  }
}

std::string producer_string(const json& p) {
  if (p.is_string()) return p.get<std::string>();
  if (p.is_object()) {
    std::string s = p.value("name", std::string());
    if (p.contains("version") && p["version"].is_string())
      s += " " + p["version"].get<std::string>();
    return s;
  }
  return p.dump();
}

}  // namespace

bool QuantConfig::is_nvfp4(std::string_view module_name) const {
  switch (algo) {
    case Algo::None:
      return false;
    case Algo::Nvfp4:
      for (const auto& p : exclude_modules) {
        if (glob_match(p, module_name)) return false;
      }
      return true;
    case Algo::MixedPrecision:
      for (const auto& [key, layer] : quantized_layers) {
        if (layer_key_covers(key, module_name)) return layer.quant_algo == "NVFP4";
      }
      return false;
  }
  return false;
}

bool QuantConfig::ngram_fp8(const ModelConfig& model) const {
  if (model.ple_embedding_dtype && *model.ple_embedding_dtype == "float8_e4m3fn") return true;
  for (const auto& [key, layer] : quantized_layers) {
    if (key.find("ngram_embedding") != std::string::npos && is_fp8_algo(layer.quant_algo)) {
      return true;
    }
  }
  return false;
}

QuantConfig parse_hf_quant_config(const json& j, std::string_view source) {
  std::string src(source);
  FN_REQUIRE(j.is_object(), Format, "{}: the top level must be a JSON object", src);
  QuantConfig q;
  q.source = src;
  if (j.contains("producer")) q.producer = producer_string(j["producer"]);
  Fields top(j, src, "");
  const json& qb = top.need("quantization");
  FN_REQUIRE(qb.is_object(), Format, "{}: quantization must be an object, got {}", src,
             json_type(qb));
  Fields f(qb, src, "quantization.");
  q.quant_algo = f.as_string(f.need("quant_algo"), "quant_algo");
  set_algo(f, "quant_algo", q);
  f.int_field("group_size", q.group_size);
  FN_REQUIRE(q.group_size == 16, Format, "{}: quantization.group_size must be 16, got {}", src,
             q.group_size);
  q.exclude_modules = string_list(f, "exclude_modules");
  f.string_field("kv_cache_quant_algo", q.kv_cache_quant_algo);
  if (q.algo == QuantConfig::Algo::MixedPrecision) parse_quantized_layers(f, q);
  return q;
}

QuantConfig parse_quantization_config(const json& qc, std::string_view source) {
  std::string src(source);
  FN_REQUIRE(qc.is_object(), Format, "{}: quantization_config must be an object, got {}", src,
             json_type(qc));
  Fields f(qc, src, "quantization_config.");
  QuantConfig q;
  q.source = src;
  std::string method = f.as_string(f.need("quant_method"), "quant_method");
  FN_REQUIRE(method == "modelopt", Format,
             "{}: quantization_config.quant_method '{}' is not supported (only \"modelopt\")", src,
             method);
  if (qc.contains("producer")) q.producer = producer_string(qc["producer"]);
  q.quant_algo = f.as_string(f.need("quant_algo"), "quant_algo");
  set_algo(f, "quant_algo", q);
  f.int_field("group_size", q.group_size);
  q.exclude_modules = string_list(f, "ignore");
  if (q.exclude_modules.empty()) q.exclude_modules = string_list(f, "exclude_modules");
  f.string_field("kv_cache_quant_algo", q.kv_cache_quant_algo);
  if (const json* groups = f.get("config_groups")) {
    FN_REQUIRE(groups->is_object(), Format, "{}: {} must be an object", src,
               f.name("config_groups"));
    for (auto it = groups->begin(); it != groups->end(); ++it) {
      const json& w = (*it).contains("weights") ? (*it)["weights"] : json();
      if (!w.is_object()) continue;
      Fields wf(w, src, f.name("config_groups." + it.key() + ".weights."));
      if (const json* gs = wf.get("group_size")) q.group_size = wf.as_int(*gs, "group_size");
    }
  }
  FN_REQUIRE(q.algo != QuantConfig::Algo::Nvfp4 || q.group_size == 16, Format,
             "{}: quantization_config group_size must be 16 for NVFP4, got {}", src, q.group_size);
  if (q.algo == QuantConfig::Algo::MixedPrecision) parse_quantized_layers(f, q);
  return q;
}

QuantConfig load_quant_config(const std::filesystem::path& dir) {
  const std::filesystem::path hf = dir / "hf_quant_config.json";
  const std::filesystem::path cfg = dir / "config.json";
  if (std::filesystem::exists(hf)) {
    QuantConfig q = parse_hf_quant_config(read_json_file(hf), hf.string());
    // hf_quant_config.json wins, but a config.json that names another algorithm is a mixed-up
    // export: say so instead of loading one of the two silently.
    if (std::filesystem::exists(cfg)) {
      const json j = read_json_file(cfg);
      const auto it = j.find("quantization_config");
      if (it != j.end() && it->is_object() && it->contains("quant_algo") &&
          (*it)["quant_algo"].is_string()) {
        std::string a = (*it)["quant_algo"].get<std::string>(), b = q.quant_algo;
        for (std::string* s : {&a, &b})
          std::transform(s->begin(), s->end(), s->begin(),
                         [](unsigned char ch) { return static_cast<char>(std::toupper(ch)); });
        FN_REQUIRE(a == b, Format,
                   "{}: quantization_config.quant_algo '{}' disagrees with {}: "
                   "quantization.quant_algo '{}'",
                   cfg.string(), (*it)["quant_algo"].get<std::string>(), hf.string(), q.quant_algo);
      }
    }
    return q;
  }
  json j = read_json_file(cfg);
  auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return QuantConfig{};
  return parse_quantization_config(*it, cfg.string());
}

// ---------------------------------------------------------------- generation config

GenerationConfig parse_generation_config(const json& j, std::string_view source,
                                         int64_t vocab_size) {
  std::string src(source);
  FN_REQUIRE(j.is_object(), Format, "{}: the top level must be a JSON object, got {}", src,
             json_type(j));
  Fields f(j, src, "");
  GenerationConfig g;
  g.eos_token_id = f.int_or_list("eos_token_id");
  for (std::size_t i = 0; vocab_size > 0 && i < g.eos_token_id.size(); ++i) {
    FN_CONFIG_RULE(g.eos_token_id[i] >= 0 && g.eos_token_id[i] < vocab_size, f, "eos_token_id",
                   fmt::format("in [0, vocab_size = {})", vocab_size), g.eos_token_id[i]);
  }
  g.bos_token_id = f.opt_int("bos_token_id");
  g.pad_token_id = f.opt_int("pad_token_id");
  if (const json* v = f.get("do_sample")) g.do_sample = f.as_bool(*v, "do_sample");
  g.temperature = f.opt_double("temperature");
  g.top_k = f.opt_int("top_k");
  g.top_p = f.opt_double("top_p");
  g.min_p = f.opt_double("min_p");
  g.repetition_penalty = f.opt_double("repetition_penalty");
  g.presence_penalty = f.opt_double("presence_penalty");
  if (g.temperature) FN_CONFIG_RULE(*g.temperature >= 0, f, "temperature", ">= 0", *g.temperature);
  if (g.top_k) FN_CONFIG_RULE(*g.top_k >= 0, f, "top_k", ">= 0", *g.top_k);
  if (g.top_p) FN_CONFIG_RULE(*g.top_p > 0 && *g.top_p <= 1, f, "top_p", "in (0, 1]", *g.top_p);
  if (g.min_p) FN_CONFIG_RULE(*g.min_p >= 0 && *g.min_p <= 1, f, "min_p", "in [0, 1]", *g.min_p);
  return g;
}

GenerationConfig load_generation_config(const std::filesystem::path& dir, int64_t vocab_size) {
  std::filesystem::path path = dir / "generation_config.json";
  if (!std::filesystem::exists(path)) return GenerationConfig{};
  return parse_generation_config(read_json_file(path), path.string(), vocab_size);
}

std::vector<int64_t> stop_token_ids(const ModelConfig& model, const GenerationConfig& gen) {
  std::vector<int64_t> out;
  for (const auto* list : {&model.eos_token_id, &gen.eos_token_id}) {
    for (int64_t id : *list) {
      if (std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
    }
  }
  return out;
}

}  // namespace fn

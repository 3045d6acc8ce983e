// Model, quantization and generation configuration of a qwen4_exp checkpoint directory
// (config.json, hf_quant_config.json, generation_config.json), parsed and validated once at load.
// Called by the checkpoint loader, the shard plan, `fngen inspect`/`synth` and both backends.
// Invariant: a ModelConfig that load/parse returned satisfies every rule of docs/model.md §G.2 plus
// fngen's own limits; derived quantities (docs/model.md §A.3) are pure functions of its fields.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fn {

/// Decoder layer kinds. `full_attention` in config.json means QwenSparseAttention (docs/model.md
/// §A.2).
enum class LayerType { LinearAttention, QwenSparseAttention };

/// Activation of the GDN output gate (docs/model.md §F.1.2: the real model says sigmoid).
enum class GateActivation { Sigmoid, Silu };

/// The most routed experts a config may declare (validate refuses more): the CUDA router's top-k
/// keeps every expert's score in shared memory, sized by this (dev::kMaxExperts,
/// cuda/kernels/moe_device.cuh); the real model has 512.
inline constexpr int64_t kMaxNumExperts = 1024;

/// The text_config of a qwen4_exp checkpoint (docs/model.md §A.2), config.json names as member
/// names. Fields absent from the file take the transformers 5.17 defaults of docs/model.md §G.1.
struct ModelConfig {
  std::string source;  ///< the file it came from (for messages)
  int64_t vocab_size = 248320;
  int64_t hidden_size = 2048;
  int64_t num_hidden_layers = 40;
  std::vector<LayerType> layer_types;  ///< num_hidden_layers entries
  int64_t full_attention_interval = 4;
  int64_t num_attention_heads = 16;
  int64_t num_key_value_heads = 2;
  int64_t head_dim = 256;
  std::string hidden_act = "silu";
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;
  std::string rope_type = "default";  ///< only "default" is accepted
  int64_t linear_conv_kernel_dim = 4;
  int64_t linear_key_head_dim = 128;
  int64_t linear_value_head_dim = 128;
  int64_t linear_num_key_heads = 16;
  int64_t linear_num_value_heads = 32;
  GateActivation output_gate_type = GateActivation::Silu;  ///< absent -> hidden_act
  int64_t num_experts = 512;
  int64_t num_experts_per_tok = 10;
  int64_t moe_intermediate_size = 512;
  int64_t shared_expert_intermediate_size = 512;
  bool norm_topk_prob = true;
  int64_t hc_count = 4;
  int64_t hc_lowrank = 320;
  /// Indexer fields: 0 when absent (allowed only when no layer is QSA).
  int64_t indexer_n_heads = 0;
  int64_t indexer_kv_heads = 0;
  int64_t indexer_head_dim = 0;
  int64_t indexer_budget = 0;
  int64_t indexer_compress_ratio = 0;
  std::vector<int64_t> ple_layer_ids;  ///< one-indexed as in the file, sorted, deduplicated
  int64_t ple_embed_dim = 0;           ///< absent -> hidden_size
  int64_t ple_conv_kernel_size = 4;
  int64_t ngram_size = 3;
  int64_t heads_per_ngram = 8;
  int64_t ngram_vocab_size_base = 20000000;
  int64_t make_ngram_vocab_size_divisible_by = 128;
  int64_t split_ngram_parts = 512;
  int64_t seed = 1234;
  std::vector<int64_t> eos_token_id;  ///< int or list in the file; empty when absent
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;
  bool tie_word_embeddings = false;
  std::optional<std::string> ple_embedding_dtype;  ///< "float8_e4m3fn" marks an FP8 n-gram table

  // ---- derived quantities (docs/model.md §A.3) ----
  /// head_dim · partial_rotary_factor (64 for the real model).
  int64_t rotary_dim() const;
  /// num_attention_heads · 2 · head_dim: query and gate rows interleaved per head (12288).
  int64_t q_proj_rows() const { return num_attention_heads * 2 * head_dim; }
  /// num_key_value_heads · head_dim (512).
  int64_t kv_proj_rows() const { return num_key_value_heads * head_dim; }
  /// num_attention_heads · head_dim, the o_proj input width (6144).
  int64_t o_proj_cols() const { return num_attention_heads * head_dim; }
  /// linear_num_key_heads · linear_key_head_dim (2048).
  int64_t gdn_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  /// linear_num_value_heads · linear_value_head_dim (6144).
  int64_t gdn_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  /// 2 · key_dim + value_dim: q, k, v conv channels (10240).
  int64_t gdn_conv_dim() const { return 2 * gdn_key_dim() + gdn_value_dim(); }
  /// hc_count · hidden_size, width of the multi-stream residual (10240).
  int64_t hc_width() const { return hc_count * hidden_size; }
  /// (indexer_n_heads + indexer_kv_heads) · indexer_head_dim (640).
  int64_t indexer_proj_rows() const {
    return (indexer_n_heads + indexer_kv_heads) * indexer_head_dim;
  }
  /// (ngram_size − 1) · heads_per_ngram (16).
  int64_t ngram_heads() const { return (ngram_size - 1) * heads_per_ngram; }
  /// ple_embed_dim / ngram_heads (160): width of one n-gram table row.
  int64_t ngram_head_dim() const { return ple_embed_dim / ngram_heads(); }
  /// Rows of the n-gram table of the PLE layer of rank `ple_layer_rank`: sum of its 16 prime
  /// head sizes padded to make_ngram_vocab_size_divisible_by (320,001,536; docs/model.md §C.4).
  int64_t ngram_table_rows(int ple_layer_rank = 0) const;
  /// True for a QSA layer (0-based index). Throws Internal when out of range.
  bool is_qsa(int64_t layer) const;
  int64_t num_qsa_layers() const;
  int64_t num_gdn_layers() const { return num_hidden_layers - num_qsa_layers(); }
  /// 0-based decoder layer indices of the PLE layers (ple_layer_ids − 1), ascending.
  std::vector<int64_t> ple_layer_indices() const;
  /// Rank of 0-based `layer` in ple_layer_indices(), or -1 when it has no PLE.
  int ple_rank(int64_t layer) const;
  bool has_ple() const { return !ple_layer_ids.empty(); }
  /// EOS used by the n-gram hash: the first eos_token_id (docs/model.md §C.4). Throws when unset.
  int64_t ple_eos() const;
  /// PLE conv dilation = ngram_size (docs/model.md §A.3).
  int64_t ple_conv_dilation() const { return ngram_size; }
  /// max attended tokens per query: indexer_budget + indexer_compress_ratio − 1 (2051).
  int64_t qsa_max_attended() const { return indexer_budget + indexer_compress_ratio - 1; }
};

/// Parses and validates a config.json object, either top-level `qwen4_exp` (with `text_config`)
/// or bare `qwen4_exp_text`. `source` names the file in messages. A top-level
/// tie_word_embeddings (and bos/eos/pad when text_config lacks them) applies as in HF.
/// Throws Format naming the field: "config.json: text_config.num_experts must be > 0, got 0".
ModelConfig parse_model_config(const nlohmann::json& j, std::string_view source);

/// Reads `dir_or_file` (a checkpoint directory containing config.json, or the file itself).
/// Throws Io when unreadable, Format when not JSON or invalid.
ModelConfig load_model_config(const std::filesystem::path& dir_or_file);

/// One quantized_layers entry of a MIXED_PRECISION config.
struct QuantLayer {
  std::string quant_algo;  ///< "NVFP4", "FP8", or (MTP only) "FP8_PB_WO"/"FP8_BLOCK_SCALES"
  int64_t group_size = 0;  ///< 0 when absent
};

/// How the checkpoint is quantized (docs/model.md §A.4). Default-constructed = BF16 checkpoint.
struct QuantConfig {
  enum class Algo { None, Nvfp4, MixedPrecision };
  std::string source;  ///< "hf_quant_config.json", "config.json" or "" when none
  Algo algo = Algo::None;
  std::string quant_algo;   ///< as in the file ("NVFP4", "MIXED_PRECISION"), "" when none
  std::string producer;     ///< e.g. "modelopt 0.46.0"
  int64_t group_size = 16;  ///< NVFP4 block size; fngen supports 16 only
  std::vector<std::string> exclude_modules;  ///< fnmatch globs (exclude_modules / ignore)
  std::vector<std::pair<std::string, QuantLayer>> quantized_layers;  ///< MIXED_PRECISION
  std::string kv_cache_quant_algo;                                   ///< "" when none

  bool quantized() const { return algo != Algo::None; }
  /// True if the Linear module `module_name` (no ".weight") is stored as NVFP4: under NVFP4,
  /// when no exclude pattern matches; under MIXED_PRECISION, when its quantized_layers entry
  /// (the module or a dotted ancestor) says NVFP4.
  bool is_nvfp4(std::string_view module_name) const;
  /// True if the n-gram table is FP8 E4M3 (+ one BF16 weight_scale): model.ple_embedding_dtype
  /// is "float8_e4m3fn", or a quantized_layers FP8 entry covers the ngram_embedding.
  bool ngram_fp8(const ModelConfig& model) const;
};

/// fnmatch-style glob (`*` any run, `?` one character, everything else literal; `*` also
/// crosses dots, as Python fnmatch does).
bool glob_match(std::string_view pattern, std::string_view text);

/// Parses the quantization description of `dir`: hf_quant_config.json when present, else
/// config.json's quantization_config, else none (BF16). Throws Format naming the file and field
/// (unknown quant_algo / quant_method, wrong types) or Io.
QuantConfig load_quant_config(const std::filesystem::path& dir);
/// Parses hf_quant_config.json content.
QuantConfig parse_hf_quant_config(const nlohmann::json& j, std::string_view source);
/// Parses config.json's `quantization_config` object.
QuantConfig parse_quantization_config(const nlohmann::json& qc, std::string_view source);

/// generation_config.json (optional): every field optional.
struct GenerationConfig {
  std::vector<int64_t> eos_token_id;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;
  std::optional<bool> do_sample;
  std::optional<double> temperature;
  std::optional<int64_t> top_k;
  std::optional<double> top_p;
  std::optional<double> min_p;
  std::optional<double> repetition_penalty;
  std::optional<double> presence_penalty;
};

/// Parses generation_config.json content. Throws Format naming the field on a wrong type or a
/// value out of range, and (when vocab_size > 0) on an eos_token_id outside [0, vocab_size), as
/// config.json's own eos ids are checked.
GenerationConfig parse_generation_config(const nlohmann::json& j, std::string_view source,
                                         int64_t vocab_size = 0);
/// Reads dir/generation_config.json (checked as parse_generation_config does); an absent file
/// gives an empty GenerationConfig. Throws Io when the file cannot be read.
GenerationConfig load_generation_config(const std::filesystem::path& dir, int64_t vocab_size = 0);

/// Union of the model's and the generation config's eos ids, in first-seen order (model first).
std::vector<int64_t> stop_token_ids(const ModelConfig& model, const GenerationConfig& gen);

}  // namespace fn

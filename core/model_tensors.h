// The expected text-tensor table of a qwen4_exp checkpoint (docs/model.md §B.2): every name, role,
// dtype and shape the config and quantization imply, which names to skip (vision, MTP; §B.3),
// and the validation of a checkpoint's tensor list against it. Called by the loader,
// `fngen inspect`, `fngen synth` and the shard plan. Invariant: expected_tensors() is
// deterministic (embedding, layers in order, final mixer, lm_head) with unique names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/config.h"
#include "core/dtype.h"

namespace fn {

/// What a tensor is for. Family names (tensor_family) group them for reports.
enum class TensorRole {
  Embedding,          ///< embed_tokens.weight [V, D]
  LmHead,             ///< lm_head.weight [V, D]
  HcNorm,             ///< *.hc_norm.weight [S·D]
  HcDown,             ///< *.input_mix_weight_down.weight [r, S·D]
  HcUp,               ///< *.input_mix_weight_up.weight [S·D, r]
  HcInject,           ///< *.block_inject_weight.weight [S, S·D]
  Router,             ///< mlp.gate.weight [E, D]
  SharedGate,         ///< mlp.shared_expert.gate_proj.weight [Is, D]
  SharedUp,           ///< mlp.shared_expert.up_proj.weight [Is, D]
  SharedDown,         ///< mlp.shared_expert.down_proj.weight [D, Is]
  SharedExpertGate,   ///< mlp.shared_expert_gate.weight [1, D]
  ExpertWeight,       ///< NVFP4 packed codes U8 [rows, K/2]
  ExpertBlockScale,   ///< F8_E4M3 [rows, K/16]
  ExpertGlobalScale,  ///< weight_scale_2 F32 []
  ExpertInputScale,   ///< input_scale F32 []
  ExpertFusedGateUp,  ///< BF16 mlp.experts.gate_up_proj [E, 2I, D]
  ExpertFusedDown,    ///< BF16 mlp.experts.down_proj [E, D, I]
  GdnInProjQkv,
  GdnInProjZ,
  GdnInProjA,
  GdnInProjB,
  GdnOutProj,
  GdnALog,
  GdnDtBias,
  GdnConv,
  GdnNorm,
  QsaQProj,
  QsaKProj,
  QsaVProj,
  QsaOProj,
  QsaQNorm,
  QsaKNorm,
  IndexerQkProj,
  IndexerQNorm,
  IndexerKNorm,
  PleKeyProj,
  PleValueProj,
  PleNormKey,
  PleNormQuery,
  PleNormConv,
  PleConv,
  PleMultipliers,  ///< I64 [ngram_size]
  PleHeadSizes,    ///< I64 [ngram_heads]
  PleHeadOffsets,  ///< I64 [ngram_heads]
  PleNgramShard,   ///< shard_i.weight [rows/parts, head_dim], F8_E4M3 or BF16
  PleNgramScale,   ///< ngram_embedding.weight_scale BF16 [1] (FP8 table only)
};

/// Short name of the role ("gdn.in_proj_qkv", "moe.experts.weight", ...).
std::string_view role_name(TensorRole role) noexcept;
/// Report family: "embed", "lm_head", "hc", "moe.router", "moe.shared", "moe.experts", "gdn",
/// "qsa", "ple" (n-gram table shards are "ple.ngram").
std::string_view tensor_family(TensorRole role) noexcept;

/// One tensor the checkpoint must hold.
struct ExpectedTensor {
  std::string name;  ///< full name ("model.language_model.layers.3...", "lm_head.weight")
  TensorRole role;
  int layer = -1;          ///< decoder layer, -1 for embed/mixer/lm_head
  int expert = -1;         ///< per-expert tensors only
  int shard = -1;          ///< n-gram table shard index
  std::string projection;  ///< "gate_proj" | "up_proj" | "down_proj" for expert tensors, else ""
  DType dtype;
  std::vector<int64_t> shape;  ///< [] for scalars
  /// Number of elements (1 for a scalar).
  int64_t numel() const;
  /// numel · dtype_size.
  uint64_t nbytes() const;
};

/// The exact text-tensor list of docs/model.md §B.2 for this config. NVFP4 quantized checkpoints
/// have per-expert U8/F8_E4M3/F32 tensors; unquantized ones the fused BF16 experts. The n-gram
/// table is split_ngram_parts shards: FP8 (+ BF16 weight_scale [1]) when quant.ngram_fp8(cfg), BF16
/// otherwise. Throws Format when the quantization marks a non-expert linear NVFP4, or leaves only
/// some experts quantized, or the config ties the embeddings (tie_word_embeddings; layouts fngen
/// does not support).
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& cfg, const QuantConfig& quant);

/// Why a checkpoint tensor is skipped.
enum class SkipReason { None, Vision, Mtp };
/// Vision for `model.visual.*`, Mtp for `mtp.*` and `model.mtp.*`, None otherwise.
SkipReason skipped_tensor(std::string_view name) noexcept;

/// One tensor as found in a checkpoint (views; the caller owns the storage).
struct FoundTensor {
  std::string_view name;
  DType dtype;
  std::span<const int64_t> shape;
};

/// Result of validate_tensors.
struct ValidationReport {
  std::size_t expected = 0;  ///< entries of the expectation
  std::size_t found = 0;     ///< entries given
  std::size_t matched = 0;   ///< present with the right dtype and shape
  std::size_t skipped_vision = 0;
  std::size_t skipped_mtp = 0;
  std::size_t missing = 0;
  std::size_t unexpected = 0;
  std::size_t wrong_dtype = 0;
  std::size_t wrong_shape = 0;
  std::size_t duplicates = 0;
  std::vector<std::string> problems;  ///< one line per problem, every problem listed
  bool ok() const { return problems.empty(); }
};

/// Compares a checkpoint's tensors with the expectation: each missing, unexpected (not skipped),
/// duplicated, wrong-dtype or wrong-shape tensor is one problem line naming the tensor and the
/// expected and found dtype/shape. Never throws.
ValidationReport validate_tensors(const std::vector<ExpectedTensor>& expected,
                                  const std::vector<FoundTensor>& found);

/// Problems require_valid's message lists; it counts the rest ("... and N more").
inline constexpr std::size_t kValidationProblemsShown = 10;

/// Throws Format "<checkpoint_dir>: N tensor problems (M missing, ...): <first 10>; ..." unless
/// report.ok().
void require_valid(const ValidationReport& report, std::string_view checkpoint_dir);

/// "[640, 1280]" (for messages).
std::string shape_string(std::span<const int64_t> shape);

}  // namespace fn

// `fngen inspect`: validates a checkpoint directory against its config (every text tensor of
// docs/model.md §B.2 present with the right dtype and shape, nothing unexpected, the PLE I64
// buffers equal to the values recomputed from the config) and summarizes it: layers by type,
// tensors and bytes per module family and dtype, weights per TP rank and bytes read per decoded
// token per rank — the input to every roofline figure — and the CUDA backend's device memory per
// rank (core/memory_plan.h) at several context sizes. Called by apps/cmd_inspect.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/memory_plan.h"
#include "core/shard_plan.h"

namespace fn {

/// Default InspectReport::gpu_bytes: 79 GiB, the total an H100 80 GB reports (79.1 GiB) rounded
/// down.
inline constexpr uint64_t kInspectDefaultGpuBytes = uint64_t{79} << 30;

/// Tensors and bytes of one (family, dtype) group.
struct TensorGroupStats {
  uint64_t tensors = 0;
  uint64_t bytes = 0;
};

/// Everything `fngen inspect` prints.
struct InspectReport {
  std::string dir;
  ModelConfig config;
  std::string quant_algo;  ///< "NVFP4", "MIXED_PRECISION" or "none"
  uint64_t files = 0;
  uint64_t checkpoint_bytes = 0;  ///< all tensor bytes in the files (skipped ones included)
  ValidationReport validation;
  /// key "family/dtype", e.g. "moe.experts/U8"; skipped tensors under "skipped.mtp/..." etc.
  std::map<std::string, TensorGroupStats> groups;
  int tp_size = 1;
  int64_t ctx_size = 8192;
  std::vector<uint64_t> weight_bytes_per_rank;                          ///< [tp_size]
  std::vector<std::map<std::string, uint64_t>> weight_bytes_by_family;  ///< [tp_size]
  std::vector<TokenBytes> token_bytes;                                  ///< [tp_size]
  /// Context sizes of the device-memory table: ctx_size plus 8192, 65536 and 262144 (those not
  /// above max_position_embeddings), ascending, unique.
  std::vector<int64_t> memory_ctx_sizes;
  std::vector<std::vector<MemoryPlan>> device_memory;  ///< [memory_ctx_sizes index][tp_size]
  /// The same plans with the n-gram table in pinned host memory (`--ngram-table host`,
  /// plan_device_memory's ngram_on_host); empty when the model has no PLE.
  std::vector<std::vector<MemoryPlan>> device_memory_host_ngram;
  /// Device memory per GPU the "sequences that fit" figures assume (sequences_fit), bytes;
  /// `fngen inspect --gpu-memory` (GiB; default kInspectDefaultGpuBytes).
  uint64_t gpu_bytes = kInspectDefaultGpuBytes;
  bool plan_only = false;  ///< true when given a config file: nothing was validated
};

/// Opens `dir` (config.json, generation_config.json, quantization, index or single file; every
/// JSON file through read_regular_file, core/paths.h), validates every tensor, the PLE I64
/// buffers and the tensors' values (core/weight_checks.h: every quantisation scale whole, as a
/// load checks it; unquantised float tensors for non-finite values, whole up to 1 MiB, else in
/// evenly spaced 16 KiB windows: 256 for the embedding and lm_head, 16 for the others), and
/// computes the report for `tp_size` ranks at `ctx_size` tokens. When `dir`
/// is a config.json file instead, reports the figures of the checkpoint it describes (from
/// expected_tensors; plan_only is set and nothing is validated) — e.g. the full real geometry.
/// Throws Format listing the problems when the checkpoint does not match its config (every
/// problem is also logged at ERROR), Usage for a TP size the model cannot use or a ctx_size
/// outside [1, max_position_embeddings] (0 means min(8192, max_position_embeddings)),
/// Io when files are missing or unreadable.
InspectReport inspect_checkpoint(const std::filesystem::path& dir, int tp_size, int64_t ctx_size);

/// Human-readable summary (several aligned tables; sizes in GiB/MiB).
std::string format_inspect_text(const InspectReport& report);

/// Machine-readable summary: {dir, config: {...}, files, checkpoint_bytes, validation: {...},
/// groups: {"family/dtype": {tensors, bytes}}, tp_size, ctx_size, ranks: [{rank,
/// weight_bytes, weight_bytes_by_family, token_bytes: {weights, kv_cache, indexer_cache,
/// gdn_state, conv_state, total}}], device_memory: [{ctx_size, ranks: [memory_plan_json(...)],
/// sequences_fit: [per rank], and with PLE ranks_ngram_host: [memory_plan_json(...)],
/// sequences_fit_ngram_host: [per rank]}], gpu_bytes}.
/// Byte counts are integers (bytes).
nlohmann::json inspect_json(const InspectReport& report);

}  // namespace fn

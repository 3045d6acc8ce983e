// Per-rank device-memory plan of the CUDA backend: the bytes one TP rank's CudaModel allocates
// for weights (by shard-plan family), the QSA KV and indexer caches, the GDN and PLE states and
// its activations/workspace, at a given context size. The states and the workspace are the sums
// of core/device_layout.h, the description the CUDA model's arena build allocates from; the
// weights are the shard plan's tensors in their device dtypes. `fngen inspect` prints the table
// and the CUDA model refuses a context that does not fit (require_fits with cudaMemGetInfo)
// before allocating anything. No CUDA here.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/config.h"
#include "core/shard_plan.h"

namespace fn {

/// Device bytes of one TP rank of the CUDA backend at one context size. Every figure is in
/// bytes; all but `workspace` are exact sums of the tensor/state sizes CudaModel allocates
/// (allocator rounding — cudaMalloc granularity, the arena's 256-byte minimum — is not counted).
struct MemoryPlan {
  int tp_size = 1;
  int tp_rank = 0;
  int64_t ctx_size = 0;  ///< tokens the caches are sized for (CudaModelOptions::ctx_size)
  /// Weights by tensor_family ("embed", "lm_head", "hc", "moe.router", "moe.shared",
  /// "moe.experts", "gdn", "qsa", "ple", "ple.ngram"), as the CUDA model holds them: checkpoint
  /// dtypes, except that 1-D norm / conv / A_log / dt_bias weights are FP32 and NVFP4 global
  /// scales FP32; input_scale, the PLE I64 buffers and the n-gram weight_scale are not on the
  /// device (docs/model.md §B.2, §E.2). Fused BF16 experts (a BF16 checkpoint, which the CUDA
  /// backend refuses) are counted in their checkpoint dtype.
  std::map<std::string, uint64_t> weights;
  uint64_t kv_cache = 0;        ///< QSA K and V, BF16 (docs/model.md §C.0, §C.6 step 4, §E.2)
  uint64_t indexer_cache = 0;   ///< QSA indexer raw keys + pooled block keys, FP32 (§C.0, §C.6)
  uint64_t gdn_state = 0;       ///< GDN recurrent state S, FP32 (§C.0, §C.5 step 6)
  uint64_t gdn_conv_state = 0;  ///< GDN conv state, FP32 (§C.0, §C.5 step 2)
  uint64_t ple_conv_state = 0;  ///< PLE dilated-conv state, FP32 (§C.0, §C.4 step 7)
  /// The decode activation block, the QSA decode workspaces, GDN scratch, the router mailbox,
  /// the token history and an ESTIMATE of the sampling workspace (DeviceLayout::scratch_total).
  uint64_t workspace = 0;
  /// Bytes a caller adds (e.g. prefill buffers); 0 from plan_device_memory. Counted in total().
  uint64_t reserve = 0;
  /// Bytes of pinned host memory holding this rank's PLE n-gram table rows when the plan keeps
  /// the table in host memory (`--ngram-table host`, docs/design.md); then "ple.ngram" is absent
  /// from `weights`. 0 when the table is on the device or the model has no PLE. Not in total().
  uint64_t ngram_host = 0;

  uint64_t weight_total() const;
  /// kv_cache + indexer_cache + gdn_state + gdn_conv_state + ple_conv_state.
  uint64_t state_total() const;
  /// weight_total() + state_total() + workspace + reserve.
  uint64_t total() const;
};

/// The device memory rank `tp_rank` of the CUDA backend needs for a `ctx_size`-token context.
/// `plan` is the model's shard plan at the TP size the CUDA model runs (tp_size = plan.tp_size()).
/// Formulas (L_qsa / L_gdn / L_ple = number of QSA / GDN / PLE layers; Hkv_l = Hkv/tp when
/// tp <= Hkv, else 1; Hv_l = Hv/tp, Hk_l = Hk/tp; conv_l = (2·Hk_l·dk + Hv_l·dv)):
/// - weights: Σ over the plan's tensors of shard_elements(tensor, rank) × device dtype size
///   (docs/model.md §B.2 shapes, §E.2 splits; see MemoryPlan::weights);
/// - kv_cache = L_qsa · 2 (K, V) · ctx · Hkv_l · head_dim · 2 B (§C.0, §E.2 "QSA KV cache");
/// - indexer_cache = L_qsa · (ctx + max(⌊ctx/ratio⌋, 1)) · indexer_head_dim · 4 B: raw keys of
///   every row and the pooled block keys, both FP32 and replicated (§C.0, §C.6 step 5, §E.2);
/// - gdn_state = L_gdn · Hv_l · dk · dv · 4 B (§C.0, §C.5 step 6);
/// - gdn_conv_state = L_gdn · conv_l · (K − 1) · 4 B, K = linear_conv_kernel_dim (§C.5 step 2);
/// - ple_conv_state = L_ple · hc_width · (ple_conv_kernel_size − 1) · dilation · 4 B, dilation =
///   ngram_size (§A.3, §C.4 step 7; replicated, §E.2);
/// - workspace: DeviceLayout::scratch_total() (core/device_layout.h): the activation block,
///   per QSA layer qsa_workspace_estimate (below), per GDN layer its counters and output scratch,
///   the router mailbox, the token history (ctx + 1 int32) and the sampling workspace (an
///   ESTIMATE, ≈ 24 B × vocab_size + 1 MiB: four vocab-sized key/value arrays and the sort
///   temporaries). Not counted: the CUDA context, NCCL buffers, CUDA graphs, prefill buffers
///   (add them to `reserve`), test-only buffers, the choice log of --check-choices.
/// `ngram_on_host`: the n-gram table rows (family "ple.ngram") are counted in
/// MemoryPlan::ngram_host instead of `weights` (`--ngram-table host`).
/// Throws Usage when ctx_size < 1; Internal on a bad tp_rank.
MemoryPlan plan_device_memory(const ModelConfig& cfg, const ShardPlan& plan, int tp_rank,
                              int64_t ctx_size, bool ngram_on_host = false);

/// Sequences of plan.ctx_size tokens whose per-sequence state (MemoryPlan::state_total: KV and
/// indexer caches, GDN and PLE states) fits `gpu_bytes` of device memory beside one copy of the
/// weights, the workspace and the reserve: floor((gpu_bytes - weight_total - workspace -
/// reserve) / state_total), 0 when even the weights do not fit. A capacity figure for batched
/// decoding (`fngen inspect`); the decode step itself runs one sequence.
int64_t sequences_fit(const MemoryPlan& plan, uint64_t gpu_bytes);

/// Where the CUDA backend keeps the PLE n-gram table (`--ngram-table`, docs/design.md "The n-gram
/// table in host memory"). The CPU backend ignores it.
enum class NgramTable {
  Device,  ///< device memory, as every other weight
  Host,    ///< pinned, device-mapped host memory read by the gather kernels over PCIe / C2C
  Auto,    ///< Host when the model with the table on the device exceeds the budget, else Device
};

/// "device", "host", "auto".
const char* ngram_table_name(NgramTable t) noexcept;
/// The inverse of ngram_table_name. Throws fn::Error(Usage) naming --ngram-table otherwise.
NgramTable parse_ngram_table(std::string_view name);

/// Default of `--gpu-memory-utilization`: the fraction of the device's free memory (at load) that
/// `--ngram-table auto` lets the model use with the table on the device.
inline constexpr double kDefaultGpuMemoryUtilization = 0.9;

/// Where the table goes and why (one line for the load log).
struct NgramPlacement {
  bool host = false;   ///< true: pinned host memory
  std::string reason;  ///< e.g. "auto: 121.5 GiB with the table on the device > 70.4 GiB = ..."
};

/// The placement rule of `--ngram-table` (pure; the CUDA model calls it with cudaMemGetInfo's
/// free bytes). `device_plan`: this rank's plan with the table on the device
/// (plan_device_memory(..., false)); its weights["ple.ngram"] are the table's bytes.
/// - no n-gram table (no PLE layer, or no rows on this rank): device, "no n-gram table";
/// - Device / Host: as requested;
/// - Auto: budget = floor(utilization * free_bytes); Device when device_plan.total() <= budget,
///   else Host (the headroom 1 - utilization is left for the CUDA context, cuBLAS, NCCL, graphs
///   and the prefill buffers that the plan does not count).
/// Throws fn::Error(Usage) when utilization is outside (0, 1] (naming --gpu-memory-utilization).
NgramPlacement place_ngram_table(NgramTable requested, const MemoryPlan& device_plan,
                                 uint64_t free_bytes, double utilization);

/// MemAvailable of a /proc/meminfo text ("MemAvailable:   123456 kB"), in bytes (kB x 1024).
/// Throws fn::Error(Format) when the line is absent or not a number.
uint64_t parse_mem_available(std::string_view meminfo);
/// This host's MemAvailable (parse_mem_available of /proc/meminfo). Throws fn::Error(Io) when
/// the file cannot be read, Format as parse_mem_available.
uint64_t host_mem_available();
/// Throws fn::Error(Usage) unless need_bytes <= available_bytes: "<what>: the n-gram table in host
/// memory (--ngram-table host) needs X GiB of pinned host memory, Y GiB available (MemAvailable,
/// /proc/meminfo): use --ngram-table device or more GPUs (--tp)". Checked before anything large
/// is allocated.
void require_host_fits(uint64_t need_bytes, uint64_t available_bytes, const std::string& what);

/// Bytes of one QSA layer's decode workspace at TP `tp_size` and `ctx_size` tokens: the layout
/// of cuda/kernels/qsa.h's qsa_workspace_layout recomputed without CUDA (the same for every rank;
/// q, indexer q, ⌊ctx/ratio⌋ scores, selected blocks, per-chunk partial outputs; docs/model.md
/// §C.6). Part of MemoryPlan::workspace. Throws Usage when ctx_size < 1.
uint64_t qsa_workspace_estimate(const ModelConfig& cfg, int tp_size, int64_t ctx_size);

/// A human table: one row per category (weights by family, weight total, KV cache, indexer
/// keys, GDN state, GDN conv state, PLE conv state, workspace (est.), reserve when non-zero,
/// total, then "n-gram table (host)" when some plan keeps it in host memory), one column per plan
/// headed "ctx <ctx_size>" ("<ctx_size>@TP<n>r<rank>" when the plans differ in TP size or rank).
/// Sizes in GiB/MiB/KiB. Empty string for no plans.
std::string format_memory_table(const std::vector<MemoryPlan>& plans);

/// {tp_size, tp_rank, ctx_size, weights: {family: bytes}, weight_total, kv_cache,
/// indexer_cache, gdn_state, gdn_conv_state, ple_conv_state, workspace_estimate, reserve, total,
/// ngram_host}
/// (integers, bytes).
nlohmann::json memory_plan_json(const MemoryPlan& plan);

/// Throws fn::Error(Usage) unless plan.total() <= free_bytes, with the message
/// "<what>: a <ctx>-token context at TP=<tp> needs X GiB per GPU (weights A, KV cache B, indexer
/// keys C, GDN states D, PLE conv E, workspace ~F), Y GiB free (Z short): lower -c/--ctx-size
/// or use more GPUs (--tp)" (GDN states = recurrent + conv; PLE conv only when the model has PLE),
/// followed by ", or keep the n-gram table in host memory (--ngram-table host)" when the plan
/// holds the table on the device.
/// `what` names the device ("rank 1 (GPU 1)"). The CUDA model calls it with cudaMemGetInfo's free
/// bytes before allocating.
void require_fits(const MemoryPlan& plan, uint64_t free_bytes, const std::string& what);

}  // namespace fn

// QSA prefill (docs/model.md §C.6 steps 2-7 without o_proj, §D) for M tokens of one QSA layer on
// one TP rank at positions p0..p0+M-1 on top of p0 populated cache rows. Called by the CUDA prefill
// between the stacked QSA GEMM and o_proj. Each row gets its own indexer selection, identical to
// decode's (same FP64 scores, same select); the caches end bitwise as M launch_qsa_decode steps
// leave them. Output rows: the fused attentions differ from decode's only in the FP32 summation
// order and (tensor cores) operands carried to 2^-18 relative (docs/numerics.md); the
// kDecodeChunks variant is bitwise decode's. No host sync (except when timing); rows in groups.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/kernels/qsa.h"

namespace fn {

/// How launch_qsa_prefill runs the attention of its rows.
enum class QsaPrefillAttention {
  /// Tensor cores over groups of rows: one CTA per (up to 128 / G consecutive rows, local KV head),
  /// G = local q heads per KV head, over the union of the rows' attended tokens in 64-token K/V
  /// tiles with a per-(row, token) mask; S = Q K^T and O += P V by BF16 MMAs (FP32 sums) with the
  /// FP32 q split into three BF16 pieces (exact) and p into two (2^-16 relative), K and V exact,
  /// online softmax in FP32, gate, BF16 out. Needs what kFusedCudaCores needs plus ctx_size /
  /// ratio < 32 * 6144 (the union's block bitmap); other shapes run kDecodeChunks. On a device
  /// below sm_80 or with less opt-in shared memory per block than the kernel's (199 KB at
  /// head_dim 256) it runs kFusedCudaCores. Outputs equal decode's up to the FP32 summation order
  /// and the split of p (docs/numerics.md "The batched prefill"); a row's bits depend on the
  /// rows that share its sub-group.
  kFused,
  /// One CTA per (row, local KV head) over all its attended tokens on the FP32 CUDA cores: K/V
  /// tiles of 64 tokens shared by the KV head's query heads, online softmax, gate, BF16 out (no
  /// per-chunk partials). Needs head_dim % 32 == 0, at most 16 local q heads per KV head and
  /// 16-byte aligned caches; other shapes run kDecodeChunks. Outputs equal decode's up to the FP32
  /// summation order.
  kFusedCudaCores,
  /// Decode's chunked attention + combine, operation for operation: outputs bitwise decode's.
  /// Slower (per-chunk partials through memory); for tests and debugging.
  kDecodeChunks,
};

/// Per-kernel GPU time of one launch_qsa_prefill, summed over its groups (bench/profiling only).
struct QsaPrefillTiming {
  double prep_ms = 0;        ///< norms, RoPE, cache rows, raw keys
  double block_keys_ms = 0;  ///< block keys completed in each group
  double scores_ms = 0;      ///< indexer scores (rows with B > block_topk)
  double select_ms = 0;      ///< counters + top-k select
  double attention_ms = 0;   ///< attention (fused: including the gate; kFused: and the union)
  double combine_ms = 0;     ///< kDecodeChunks' combine + gate (0 for kFused)
  int64_t groups = 0;        ///< row groups launched
};

/// Inputs, caches and outputs of one QSA prefill chunk (docs/model.md §C.6, §D). Device pointers.
struct QsaPrefillParams {
  /// Every shape field, the norms and the cache pointers exactly as for decode. shape.proj,
  /// shape.position, shape.out, shape.workspace and shape.forced_blocks are ignored.
  QsaDecodeParams shape;
  /// [tokens, proj_stride] FP32: row p = the stacked projection of token p0+p (decode's layout).
  const float* proj = nullptr;
  int64_t proj_stride = 0;     ///< floats between rows, >= decode's projection size
  int64_t tokens = 0;          ///< M >= 1
  int64_t first_position = 0;  ///< p0 (host value), >= 0 with p0 + M <= shape.ctx_size
  uint16_t* out = nullptr;     ///< [tokens, Hq*hd] BF16 bits: row p = decode's out at p0+p
  void* workspace = nullptr;   ///< qsa_prefill_workspace_bytes(params) bytes, 256-byte aligned
  /// Tests only: when > 0, at most this many rows per group (exercises the group hand-off on
  /// small shapes). 0 = automatic (workspace near kQsaPrefillWorkspaceBudget).
  int64_t max_group_rows = 0;
  /// Debug log of the indexer's choices (the engine's --check-choices), optional device outputs
  /// written by device-to-device copies from each group's workspace right after its select:
  /// [tokens, sel_max] (qsa_prefill_layout(...).sel_max): row p's selected blocks ascending, as
  /// the workspace holds them after the select kernel (entries past the count unspecified).
  int32_t* selected_log = nullptr;
  /// [tokens, 4]: row p's {selected block count, B, attended tokens, 0} as decode's workspace
  /// counters after the step at p0 + p.
  int32_t* counters_log = nullptr;
  /// Attention variant (see QsaPrefillAttention); affects the workspace size.
  QsaPrefillAttention attention = QsaPrefillAttention::kFused;
  /// Bench only (host pointer): when set, every kernel is bracketed by CUDA events, the launcher
  /// synchronises `stream` at the end and adds each kernel type's time into *timing.
  QsaPrefillTiming* timing = nullptr;
};

/// Bytes of workspace the automatic group size aims for (the group has at least one row).
inline constexpr size_t kQsaPrefillWorkspaceBudget = size_t{128} << 20;

/// Where the launcher keeps one group's intermediates (byte offsets from the workspace start,
/// each 256-byte aligned; per-row arrays are [group_rows, ...]). Exposed for tests/debugging.
struct QsaPrefillLayout {
  QsaWorkspaceLayout decode;  ///< decode's layout of the same shape (its chunk, max_chunks)
  int64_t group_rows = 0;     ///< rows per group (the last group may be shorter)
  int64_t max_blocks = 0;     ///< ctx_size / ratio: scores per row
  int64_t sel_max = 0;        ///< min(block_topk, max_blocks) (>= 1): selected blocks per row
  size_t q = 0;               ///< [rows, Hq, hd] FP32 q after norm + RoPE
  size_t qi = 0;              ///< [rows, indexer_heads, ihd] FP32 indexer q after norm + RoPE
  size_t scores = 0;          ///< [rows, max_blocks] FP32 (only rows with B > block_topk)
  size_t selected = 0;        ///< [rows, sel_max] int32 selected blocks ascending
  size_t counters = 0;        ///< [rows, 4] int32 {selected blocks, B, attended tokens, 0}
  size_t part_out = 0;  ///< [rows, Hq, max_chunks, hd] FP32 per-chunk outputs (0 bytes: fused)
  size_t part_max = 0;  ///< [rows, Hq, max_chunks] FP32 (0 bytes when fused)
  size_t part_sum = 0;  ///< [rows, Hq, max_chunks] FP32 (0 bytes when fused)
  /// kFused's row groups: tc_rows = 128 / (most local q heads of a KV head) rows per sub-group,
  /// ceil(group_rows / tc_rows) sub-groups; union_cap = min(tc_rows * (sel_max + 1),
  /// max_blocks + 1) blocks, union_words = ceil(union_cap / 32). Zero bytes unless tensor_cores.
  int64_t tc_rows = 0;
  int64_t union_cap = 0;
  int64_t union_words = 0;
  size_t union_count = 0;     ///< [subs] int32 union blocks of each sub-group
  size_t union_blocks = 0;    ///< [subs, union_cap] int32 union blocks ascending
  size_t union_mask = 0;      ///< [subs, tc_rows, union_words] uint32: bit i = row uses block i
  bool fused = false;         ///< a fused attention runs (kFused/kFusedCudaCores, shape allows)
  bool tensor_cores = false;  ///< kFused's tensor-core kernel may run (device permitting)
  size_t total = 0;           ///< bytes in all
};

/// The layout for the shape fields, tokens and max_group_rows of `shape_only` (pointers ignored).
/// Pure function (no device query). Throws fn::Error(Internal) on an invalid shape or tokens < 1.
QsaPrefillLayout qsa_prefill_layout(const QsaPrefillParams& shape_only);

/// Workspace bytes launch_qsa_prefill needs (qsa_prefill_layout(...).total): bounded by about
/// max(kQsaPrefillWorkspaceBudget, one row's scratch) whatever the token count.
size_t qsa_prefill_workspace_bytes(const QsaPrefillParams& shape_only);

/// QSA prefill of params.tokens rows on `stream`: per group of rows the kernels prep (norms,
/// RoPE, K/V/raw-key rows), block keys of the blocks completed in the group, indexer scores and
/// top-k select for rows with more than block_topk complete blocks (identity selection
/// otherwise), then attention: fused (kFused: the union of each sub-group's blocks, then the
/// tensor-core attention + gate; kFusedCudaCores: attention + gate) or decode's chunked attention +
/// combine. Caches and selections are bitwise those of tokens successive launch_qsa_decode calls
/// at positions p0, p0+1, ... on the same caches; outputs too with kDecodeChunks, up to the FP32
/// summation order with kFusedCudaCores, and within docs/numerics.md's bound with kFused (one
/// device query per call picks its kernel). With selected_log /
/// counters_log set, each group's choices are copied out after its select (two extra copies per
/// group). No host sync.
/// Throws fn::Error(Internal) on null pointers, a bad shape (as launch_qsa_decode), tokens < 1,
/// p0 < 0, p0 + tokens > ctx_size, a short proj_stride, a misaligned workspace or (fused)
/// caches not 16-byte aligned;
/// fn::Error(Cuda) when a launch or the device query fails.
void launch_qsa_prefill(const QsaPrefillParams& params, cudaStream_t stream);

}  // namespace fn

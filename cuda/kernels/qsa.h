// QSA decode (docs/model.md §C.6 steps 2-7 without o_proj, §C.9 RoPE) for one token on one TP rank:
// q/k norm + RoPE, KV-cache append, the lightning indexer (block keys, scores, deterministic
// top-k block selection) and flash-decoding attention over the selected tokens with the sigmoid
// output gate. Called by the CUDA decode step after the HC read and before o_proj; it runs the
// stacked QSA GEMV itself, beside the indexer's select (seven launches), or follows the caller's
// GEMV (four launches). No host sync, position read from device memory: legal inside CUDA graph
// capture.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fn {

/// Inputs, caches and outputs of one QSA decode step (docs/model.md §C.6). All pointers are device
/// pointers. Semantics are those of CpuModel::qsa_step (core/cpu_model.cpp) between the
/// projections and o_proj, op by op the fn::cpu functions rms_norm_1p, rope_neox,
/// indexer_block_key, indexer_scores, qsa_selected_tokens (top_k's tie rule: higher score first,
/// equal scores -> lower block index), gqa_attention and sigmoid_gate_mul.
struct QsaDecodeParams {
  /// FP32, the output of ONE stacked GEMV: [ q|gate per local query head interleaved
  /// (Hq * 2 * hd: head i has q at i*2*hd, gate at i*2*hd+hd) | k (Hkv*hd) | v (Hkv*hd) |
  /// indexer (indexer_heads query heads * ihd, then 1 key * ihd) ]. Written by the launcher
  /// itself when in_proj is set, else read only.
  float* proj = nullptr;
  /// The overlapped projection (the decode step's default): when non-null, the launcher computes
  /// proj = in_proj . x itself (BF16 GEMV, FP32 sums, the same bits as one launch_gemv_bf16 over
  /// all rows) in two parts. The indexer's rows go first, then its prep and the scores + select;
  /// the query and KV rows run beside the select (GemvBf16Params::no_pdl_wait), then their prep,
  /// and the attention waits for the select's done flag in the workspace. Seven launches. in_proj:
  /// BF16 bits [proj rows, hidden], row-major, 16-byte aligned; x: FP32 [hidden], written at least
  /// one launch before this call by a kernel that waited for its predecessor (the HC mix); hidden a
  /// multiple of 8, 8..8192. nullptr: the caller wrote proj (four launches).
  const uint16_t* in_proj = nullptr;
  const float* x = nullptr;        ///< FP32 [hidden], the projection's input (with in_proj)
  int64_t hidden = 0;              ///< the projection's input length (with in_proj)
  const float* q_norm = nullptr;   ///< [hd] FP32 q_norm weight w (the kernel uses 1 + w)
  const float* k_norm = nullptr;   ///< [hd] FP32 k_norm weight w (1 + w)
  const float* iq_norm = nullptr;  ///< [ihd] FP32 indexer q_layernorm weight w (1 + w)
  const float* ik_norm = nullptr;  ///< [ihd] FP32 indexer k_layernorm weight w (1 + w)
  /// Device scalar t, the 0-based position of this token; read by the kernels. A t outside
  /// [0, ctx_size) writes no cache row and fills `out` with BF16 NaN (0x7FC0).
  const int64_t* position = nullptr;
  uint16_t* k_cache =
      nullptr;  ///< [ctx_size, Hkv*hd] BF16 bits (K after k_norm + RoPE); row t written
  uint16_t* v_cache = nullptr;  ///< [ctx_size, Hkv*hd] BF16 bits; row t written
  float* raw_keys =
      nullptr;  ///< [ctx_size, ihd] FP32 raw indexer keys (no norm/RoPE); row t written
  /// [ctx_size/ratio, ihd] FP32 pooled + normed + roped block keys; block b = (t+1)/ratio - 1 is
  /// written when (t+1) % ratio == 0 (from raw_keys rows ratio*b .. t-1 and the current key).
  float* block_keys = nullptr;
  void* workspace = nullptr;  ///< qsa_decode_workspace_bytes(...) bytes, 256-byte aligned
  uint16_t* out = nullptr;    ///< [Hq*hd] BF16 bits: attention output * sigmoid(gate)
  int64_t ctx_size = 0;       ///< capacity in tokens (positions 0..ctx_size-1), >= 1
  int num_q_heads = 0;        ///< Hq local (24 at TP=1, 12 at TP=2)
  int num_kv_heads = 0;       ///< Hkv local (1 when TP > num_key_value_heads)
  int q_head_first = 0;       ///< global index of local query head 0 (tp_rank * Hq)
  int q_per_kv = 0;           ///< num_attention_heads / num_key_value_heads (global)
  /// Global index of local KV head 0; local q head i uses local KV head
  /// (q_head_first + i) / q_per_kv - kv_head_first, which must lie in [0, Hkv).
  int kv_head_first = 0;
  int head_dim = 0;          ///< hd: even, 2..256 (256 real; 16/32 tiny)
  int rotary_dim = 0;        ///< partial RoPE dims (64 real): even, <= hd and <= ihd
  double rope_theta = 0;     ///< rope_theta (1e7)
  int indexer_heads = 0;     ///< indexer_n_heads (4), >= 1
  int indexer_head_dim = 0;  ///< ihd (128): 1..256
  int ratio = 4;             ///< indexer_compress_ratio
  int block_topk = 0;        ///< indexer_budget / ratio (512 real), >= 1
  float eps = 1e-6f;         ///< rms_norm_eps
  /// Tests only (replaying a reference's choices): when non-null, device [block_topk] block ids
  /// ascending that replace the indexer's own top-k whenever more than block_topk blocks are
  /// complete (the scores are still computed). nullptr in production.
  const int32_t* forced_blocks = nullptr;
  /// Several sequences in one launch (the batched decode step): `rows` tokens, row r of sequence
  /// slot row_slot[r], each row exactly the one-row launch on its own operands (the same bits).
  /// rows > 1 needs row_slot. With row_slot set (any rows): position is device [rows] (row r's t at
  /// position[r]), proj row r at proj + r * proj_stride (floats, >= the width above), out row r at
  /// out + r * out_stride (BF16 values, >= Hq*hd), slot s's caches at slot_k_cache[s],
  /// slot_v_cache[s], slot_raw_keys[s] and slot_block_keys[s] (k_cache .. block_keys then only set
  /// the alignment the attention kernel is chosen by: every slot's caches must share it), the
  /// workspace rows * qsa_decode_workspace_bytes bytes (row r's at r times that), in_proj and
  /// forced_blocks null. row_slot and the slot arrays are device arrays ([rows], [slots]); no two
  /// rows name one slot.
  int rows = 1;
  const int32_t* row_slot = nullptr;
  uint16_t* const* slot_k_cache = nullptr;
  uint16_t* const* slot_v_cache = nullptr;
  float* const* slot_raw_keys = nullptr;
  float* const* slot_block_keys = nullptr;
  int64_t proj_stride = 0;
  int64_t out_stride = 0;
};

/// Where the launcher keeps its intermediates inside the workspace (byte offsets from the
/// workspace start, each 256-byte aligned) and how attention is split. Exposed for tests and
/// for debugging; the engine only needs qsa_decode_workspace_bytes.
struct QsaWorkspaceLayout {
  size_t q = 0;   ///< [Hq, hd] FP32: q after q_norm + RoPE
  size_t qi = 0;  ///< [indexer_heads, ihd] FP32: indexer queries after norm + RoPE
  /// [ctx_size/ratio] FP32: indexer_scores of blocks 0..B-1, a mailbox (the prep launch empties
  /// slots [0, B), the scoring CTAs post them, the select CTA reads each once posted), so the
  /// workspace needs no initialisation.
  size_t scores = 0;
  size_t selected = 0;  ///< [min(block_topk, ctx/ratio)] int32: selected blocks, ascending
  size_t counters = 0;  ///< int32 [4]: {selected block count, B, attended token count, 0}
  /// int32: the select's done flag of the overlapped projection (QsaDecodeParams::in_proj): the
  /// indexer prep zeroes it, the select CTA sets it to 1 after its results, the attention waits
  /// for 1. Inside the counters' slot (counters + 64).
  size_t select_done = 0;
  size_t part_out = 0;     ///< [Hq, max_chunks, hd] FP32: per-chunk unnormalised outputs
  size_t part_max = 0;     ///< [Hq, max_chunks] FP32: per-chunk score maxima
  size_t part_sum = 0;     ///< [Hq, max_chunks] FP32: per-chunk sums of exp(s - max)
  size_t total = 0;        ///< bytes in all
  int chunk = 0;           ///< attended tokens per attention CTA (a multiple of 16, <= 64)
  int max_chunks = 0;      ///< ceil(max attended tokens / chunk)
  int64_t max_tokens = 0;  ///< min(ctx_size, ratio*min(block_topk, ctx/ratio) + ratio - 1)
};

/// The workspace layout for the shape fields of `shape_only` (pointers ignored). Pure function of
/// the shape (no device query). Throws fn::Error(Internal) on an invalid shape (see launcher).
QsaWorkspaceLayout qsa_workspace_layout(const QsaDecodeParams& shape_only);

/// Workspace bytes launch_qsa_decode needs for this shape (qsa_workspace_layout(...).total).
size_t qsa_decode_workspace_bytes(const QsaDecodeParams& shape_only);

/// FP32 values of one token's stacked projection row (QsaDecodeParams::proj's layout):
/// Hq*2*hd + 2*Hkv*hd + (indexer_heads + 1)*ihd. No check of the shape.
int64_t qsa_proj_size(const QsaDecodeParams& shape_only);

/// One QSA decode step (docs/model.md §C.6 steps 2-7 minus o_proj) on `stream`, four kernels:
/// prep (norms, RoPE, cache rows, block key; RoPE angles and earlier cache rows read before the
/// programmatic wait), indexer scores (FP64 dot products as the CPU op; block keys of earlier
/// steps loaded before the wait) whose last CTA runs the top-k block select (radix select on the
/// scores as they are posted to the workspace's mailbox, ties to the lower block index), chunked
/// attention (FP32 partial softmax per chunk of selected tokens) and a fixed-order combine with
/// the sigmoid gate -> BF16 split over head-dim slices. Deterministic (no atomics),
/// graph-capturable. With params.in_proj the launcher also runs the stacked projection, overlapped
/// with the select (seven launches, see QsaDecodeParams::in_proj; the same bits as the projection
/// GEMV followed by the four launches). Throws fn::Error(Internal) on null pointers, bad shapes
/// (including more than 16 local q heads per local KV head), a q head mapped outside the local KV
/// heads or a misaligned workspace; fn::Error(Internal) also on an in_proj without x, with a bad
/// hidden size or a misaligned in_proj or x; fn::Error(Cuda) when a launch fails. NaN scores
/// (NaN/Inf weights) are ranked above +inf rather than reported (the CPU's top_k throws on them).
void launch_qsa_decode(const QsaDecodeParams& params, cudaStream_t stream);

}  // namespace fn

// PLE (per-layer n-gram embedding, docs/model.md §C.4, §B.5) kernels for one decode token: the
// n-gram row gather of this rank's table rows, the n-gram context shift, and steps 2-8 (norms,
// signed-sqrt gate, dilated causal conv, residual add) after the key/value GEMV. Called by the CUDA
// decode step at layer 1, in order: gather -> all-reduce E -> GEMV [key_proj; value_proj] ->
// ple_apply -> context advance. Token and context are read from device memory (graph-capturable);
// no atomics. The *_rows versions do the same for M prompt tokens at once (batched prefill,
// docs/model.md §D): gather_rows -> all-reduce E rows -> GEMM -> ple_apply_rows ->
// context_advance_rows, leaving the n-gram context and the PLE conv state exactly as M decode steps
// would; no host sync.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn {

/// Step 1 of docs/model.md §C.4: the n-gram ids of x_t (core/ngram.h ngram_ids, exact int64
/// wrap-around multiply and floor-mod) and the rows of those ids this rank holds.
struct NgramGatherParams {
  const int32_t* token = nullptr;  ///< device [1]: x_t (raw token id)
  const int64_t* context =
      nullptr;         ///< device [ngram_size-1]: last raw ids, oldest first (EOS-filled at start)
  int ngram_size = 3;  ///< 2..8
  int64_t multipliers[8] = {};    ///< NgramConstants::multipliers
  int num_multipliers = 0;        ///< == ngram_size
  int64_t head_sizes[32] = {};    ///< NgramConstants::head_sizes (primes)
  int64_t head_offsets[32] = {};  ///< NgramConstants::head_offsets
  int num_heads = 0;              ///< (ngram_size-1) * heads_per_ngram, 1..32 (16 real)
  int heads_per_ngram = 0;        ///< NgramConstants::heads_per_ngram (8 real)
  /// This rank's contiguous table rows [row_count, head_dim]: F8_E4M3 codes (1 byte) or BF16 bits
  /// (2 bytes, 2-byte aligned), see fp8. Device memory, or the device pointer of pinned, mapped
  /// host memory (cudaHostGetDevicePointer; `--ngram-table host`): the kernels only read it.
  const uint8_t* rows = nullptr;
  int64_t first_row = 0;  ///< full-table index of rows[0] (shard_index * rows_per_shard)
  int64_t row_count = 0;  ///< rows held here, >= 0
  bool fp8 = true;        ///< true: E4M3 codes; false: BF16 bits
  float scale = 1.0f;     ///< FP8: the table's BF16 weight_scale as float; BF16 table: 1
  int head_dim = 0;       ///< ngram_head_dim = ple_embed_dim / num_heads (160 real, 8 tiny)
  /// [num_heads * head_dim] FP32: out[h*head_dim + j] = value(row id_h, j) * scale, where value
  /// is the exact FP8 (or BF16) number; 0 where id_h is not in [first_row, first_row+row_count).
  float* out = nullptr;
  int64_t eos = -1;  ///< NgramConstants::eos (cfg.ple_eos(), 248044 real), >= 0
};

/// Launches the gather (one block per head). Throws fn::Error(Internal) on null pointers, sizes
/// outside the ranges above, num_multipliers != ngram_size, num_heads != (ngram_size-1) *
/// heads_per_ngram, non-positive head sizes, eos < 0; fn::Error(Cuda) on a failed launch.
void launch_ngram_gather(const NgramGatherParams& params, cudaStream_t stream);

/// Context shift after the token (docs/model.md §C.4): context[i] <- context[i+1] for i <
/// ngram_size-2, context[ngram_size-2] <- token (raw id, EOS included).
struct NgramContextAdvanceParams {
  int64_t* context = nullptr;      ///< device [ngram_size-1], updated in place
  int ngram_size = 3;              ///< 2..8
  const int32_t* token = nullptr;  ///< device [1]: x_t
};

/// Launches the shift (one thread). Run it after every gather of the token (stream order).
/// Throws fn::Error(Internal) on null pointers or a bad ngram_size.
void launch_ngram_context_advance(const NgramContextAdvanceParams& params, cudaStream_t stream);

/// Steps 2-8 of docs/model.md §C.4 (cpu::ple_apply after its two GEMVs), per stream s < S:
///   K_s = GroupRMSNorm1p(kv[s*P..]; norm_key), V = kv[S*P..S*P+D),
///   Q_s = GroupRMSNorm1p(H_s; norm_query), gamma = <K_s, Q_s>/sqrt(P),
///   Gv_s = sigmoid(sign(gamma) sqrt(max(|gamma|, 1e-6))) * V,
///   Nc_s = GroupRMSNorm1p(Gv_s; norm_conv), conv = silu(dilated causal conv step of Nc),
///   H_s += Gv_s + conv_s. All FP32; every norm computes (1 + w) from the given w in FP32.
struct PleApplyParams {
  const float* kv = nullptr;          ///< FP32 [S*P + D]: key_proj(E) then value_proj(E)
  float* H = nullptr;                 ///< FP32 [S*D] residual (stream-major), updated in place
  const float* norm_key = nullptr;    ///< FP32 [S*P] norm_key.weight w (applied as 1 + w)
  const float* norm_query = nullptr;  ///< FP32 [S*D] norm_query.weight w (applied as 1 + w)
  const float* norm_conv = nullptr;   ///< FP32 [S*P] norm_conv.weight w (applied as 1 + w)
  const float* conv = nullptr;        ///< FP32 [S*P, K] conv1d.weight taps (tap K-1: current)
  /// FP32 [S*P, (K-1)*dilation]: per channel the last (K-1)*dilation Nc values, oldest first
  /// (cpu::causal_conv_step layout; zeros before the first token); updated in place.
  float* conv_state = nullptr;
  int hc_count = 4;     ///< S, 1..64
  int64_t dim = 0;      ///< P (= D = hidden_size), 1..2^20
  int conv_kernel = 4;  ///< K (ple_conv_kernel_size), 1..16
  int dilation = 3;     ///< ngram_size, 1..16
  float eps = 1e-6f;    ///< rms_norm_eps
};

/// Launches one block per stream (the residual is read and written in place, so each stream's
/// reductions and updates stay in one block). Deterministic (fixed reduction order). Throws
/// fn::Error(Internal) on null pointers or sizes outside the ranges above; fn::Error(Cuda) on a
/// failed launch.
void launch_ple_apply(const PleApplyParams& params, cudaStream_t stream);

/// n-gram ids + gather for tokens[0..rows) (batched prefill, docs/model.md §C.4 and §D): row p uses
/// the context formed by the device context (the raw ids before token 0) followed by
/// tokens[0..p-1], with the EOS-aware shift, exactly what `rows` successive launch_ngram_gather +
/// launch_ngram_context_advance calls would see. The device context is only read.
struct NgramGatherRowsParams {
  NgramGatherParams base;  ///< everything but token/out as for decode; base.token, base.out ignored
  const int32_t* tokens = nullptr;  ///< device [rows]: raw token ids
  int64_t rows = 0;                 ///< M >= 0 (0: nothing is launched)
  float* out = nullptr;  ///< [rows, num_heads*head_dim] FP32; row p as decode's out for token p
};

/// Launches the gather (one block per (head, row)); bitwise the decode gather row by row. Throws
/// fn::Error(Internal) on what launch_ngram_gather rejects, null tokens/out or rows < 0;
/// fn::Error(Cuda) on a failed launch.
void launch_ngram_gather_rows(const NgramGatherRowsParams& params, cudaStream_t stream);

/// Context shift after tokens[0..rows): the device context becomes the last ngram_size-1 raw ids
/// of (context, tokens), as `rows` launch_ngram_context_advance calls leave it (docs/model.md §D
/// item 3).
struct NgramContextAdvanceRowsParams {
  int64_t* context = nullptr;       ///< device [ngram_size-1], updated in place
  int ngram_size = 3;               ///< 2..8
  const int32_t* tokens = nullptr;  ///< device [rows]
  int64_t rows = 0;                 ///< M >= 0 (0: nothing is launched)
};

/// Launches the shift (one thread). Run it after the gather of the same tokens (stream order).
/// Throws fn::Error(Internal) on null pointers, a bad ngram_size or rows < 0.
void launch_ngram_context_advance_rows(const NgramContextAdvanceRowsParams& params,
                                       cudaStream_t stream);

/// Steps 2-8 of docs/model.md §C.4 for `rows` consecutive tokens (batched prefill). Row p: kv row p
/// is decode's kv for token p, H row p is updated in place (H[p] += Gv + conv); the dilated causal
/// conv of row p reads the Nc of earlier rows of this batch and, before row 0, the history in
/// base.conv_state, which is left holding the last (K-1)*dilation Nc values, oldest first, as
/// after `rows` launch_ple_apply calls (history included when rows is short). Same FP32
/// operations in the same order as launch_ple_apply; deterministic.
struct PleApplyRowsParams {
  PleApplyParams base;        ///< norms, conv, conv_state, sizes as decode; base.kv/base.H ignored
  const float* kv = nullptr;  ///< FP32 [rows, kv_stride]: key_proj(E_p) [S*P] then value_proj [P]
  int64_t kv_stride = 0;      ///< floats between rows of kv, >= S*P + P
  float* H = nullptr;         ///< FP32 [rows, S*P] residual rows (stream-major), in place
  int64_t rows = 0;           ///< M >= 0 (0: nothing is launched)
  float* scratch = nullptr;   ///< device, ple_apply_rows_scratch_floats(params) floats
};

/// Scratch floats launch_ple_apply_rows needs for this shape (reads rows and base.hc_count only):
/// the per-(row, stream) gate and conv-norm scale, 2 * rows * hc_count.
int64_t ple_apply_rows_scratch_floats(const PleApplyRowsParams& shape_only);

/// Launches three kernels: per (row, stream) the norms and gate (one block each, as decode); per
/// (row, channel) the conv and residual add; per channel the conv_state update. Throws
/// fn::Error(Internal) on what launch_ple_apply rejects, null kv/H/scratch, rows < 0 or a short
/// kv_stride; fn::Error(Cuda) on a failed launch.
void launch_ple_apply_rows(const PleApplyRowsParams& params, cudaStream_t stream);

}  // namespace fn

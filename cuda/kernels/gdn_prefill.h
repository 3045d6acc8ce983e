// Gated DeltaNet prefill for M tokens of one GDN layer on one TP rank (docs/model.md §C.5 steps
// 2-7, §D): the same function as M successive launch_gdn_decode calls (cuda/kernels/gdn.h), leaving
// the same recurrent state and conv state up to rounding, with the token-parallel parts (conv,
// gates, L2 norms, gated norm) run over all tokens at once and the recurrence as a chunked scan
// (64-token chunks in the WY form, 3xTF32 tensor-core products; sm_80+, dk <= 128) or else a
// sequential scan. Called by the CUDA prefill path once per GDN layer and prompt chunk. No host
// sync, graph-safe, deterministic (fixed reduction order, no float atomics); tokens past M never
// touch the state.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fn {

/// Operands of one GDN prefill of `tokens` tokens on one rank (its TP slice of heads). All
/// pointers are device memory. conv_dim = 2 * Hk * dk + Hv * dv. Math: the meaning of
/// launch_gdn_decode once per token p = 0..tokens-1 with proj row p (docs/model.md §C.5 steps 2-7),
/// FP32 throughout (the chunked scan's tensor-core products in 3xTF32, about 2^-22 relative per
/// product), BF16 only at the output store. The conv state is bitwise decode's; the state and
/// outputs differ from decode's by rounding (docs/numerics.md, "The batched prefill").
struct GdnPrefillParams {
  /// [tokens, proj_stride] FP32: row p is the stacked projection of token p, laid out as
  /// GdnDecodeParams::proj: [ qkv (q [Hk*dk], k [Hk*dk], v [Hv*dv]) | z [Hv*dv] | a [Hv] | b [Hv]
  /// ].
  const float* proj = nullptr;
  int64_t proj_stride = 0;             ///< floats between rows, >= conv_dim + Hv*dv + 2*Hv
  int64_t tokens = 0;                  ///< M >= 1
  const float* conv_weight = nullptr;  ///< [conv_dim, conv_kernel] FP32 (conv1d.weight squeezed)
  const float* A_log = nullptr;        ///< [Hv] FP32
  const float* dt_bias = nullptr;      ///< [Hv] FP32
  const float* norm_weight = nullptr;  ///< [dv] FP32, plain weight (not 1 + w), shared by heads
  /// [conv_dim, conv_kernel - 1] FP32 pre-conv inputs, oldest first (GdnDecodeParams layout):
  /// read as the history before token 0, left holding the last conv_kernel - 1 pre-conv inputs
  /// (the oldest of them still from the old history when tokens < conv_kernel - 1).
  float* conv_state = nullptr;
  /// [Hv, dk, dv] FP32 recurrent state oriented [k, v]: read as the state before token 0, left as
  /// the state after token tokens - 1.
  float* state = nullptr;
  uint16_t* out = nullptr;  ///< [tokens, Hv*dv] BF16 bits: row p = what decode writes for token p
  int num_k_heads = 0;      ///< Hk (local TP slice), >= 1
  int num_v_heads = 0;      ///< Hv (local), a multiple of Hk; value head h uses key head h/(Hv/Hk)
  int k_head_dim = 0;       ///< dk: multiple of 4, 4..1024
  int v_head_dim = 0;       ///< dv: multiple of 4, 4..1024
  int conv_kernel = 4;      ///< linear_conv_kernel_dim, 2..8
  float eps = 1e-6f;        ///< rms_norm_eps of the gated norm (the L2 norm uses 1e-6)
  /// gdn_prefill_workspace_bytes(*this) bytes of device scratch, 256-byte aligned, owned by the
  /// caller; overwritten by every launch (no state lives in it between launches).
  void* workspace = nullptr;
  /// Several sequences side by side in one launch (a pass over several slots' prompts or
  /// choices): with runs >= 1 the rows are cut into `runs` sequences, run r being rows
  /// run_start[r] .. run_start[r + 1] - 1, each on its own states slot_state[run_slot[r]] and
  /// slot_conv[run_slot[r]] (the per-slot tables of GdnDecodeParams::slot_state / slot_conv);
  /// `state` and `conv_state` are then ignored. Each run's outputs and states are bitwise those of
  /// a launch of its rows alone. 0 (default): one sequence on `state` / `conv_state`.
  int runs = 0;
  /// [runs + 1] int32 (device): run_start[0] = 0, strictly increasing, run_start[runs] = tokens.
  /// Not checked on the device: the caller builds it.
  const int32_t* run_start = nullptr;
  /// [runs] int32 (device): each run's slot, all distinct (two runs of one slot would race on its
  /// states), indices into slot_state / slot_conv.
  const int32_t* run_slot = nullptr;
  float* const* slot_state = nullptr;  ///< [slots] device pointers to [Hv, dk, dv] FP32 states
  float* const* slot_conv = nullptr;   ///< [slots] device pointers to [conv_dim, K - 1] FP32
  /// dv columns per CTA of the scan kernel: 0 lets the launcher choose (plan_gdn_prefill_slice);
  /// else, for the chunked scan (sm_80+, dk <= 128, enough shared memory), 32 or 64 (64 only where
  /// the device gives a CTA 194,048 bytes of shared memory; dv need not be a multiple: the last
  /// slice is partial); for the sequential scan a power of two from 4 to 128 dividing dv. For
  /// benchmarks/tests; results are bitwise the same for every width.
  int slice_columns = 0;
};

/// Bytes of workspace launch_gdn_prefill needs: a pure function of the shape fields (tokens,
/// num_k_heads, num_v_heads, k_head_dim, v_head_dim; not runs: any runs <= tokens fit), about
/// 4 * tokens * (2*Hk*dk + Hv*dv + 2*Hv + Hk) bytes, plus 4 * tokens * Hv * (dk + 64) where
/// dk <= 128 (the chunked scan's W and P rows): 641 MB at tokens = 8192, Hk = 16, Hv = 48,
/// dk = dv = 128. Pointers are not read. Throws fn::Error(Internal) on non-positive sizes.
size_t gdn_prefill_workspace_bytes(const GdnPrefillParams& shape_only);

/// Enqueues the prefill on `stream` (no host sync): a conv + gates + L2-norm kernel over
/// (token, channel), the conv state update (per run), the recurrence, and the gated RMSNorm over
/// (token, head). The recurrence: on sm_80+ with dk <= 128 (and 161,280 bytes of shared memory
/// per CTA) the chunked scan, one kernel over (64-token chunk of a run, value head) for the
/// chunk's WY factors and one over (value head, slice of dv columns, run) walking the chunks with
/// the state slice in registers; otherwise the sequential scan (one CTA per value head, slice of
/// dv columns and run, tokens staged through shared memory). Throws fn::Error(Internal) on a null
/// pointer (with runs >= 1: the run and slot tables, not state / conv_state), a misaligned
/// workspace, bad sizes (see the field comments), runs > tokens or runs > 65535; fn::Error(Cuda)
/// on a failed device query or launch.
void launch_gdn_prefill(const GdnPrefillParams& params, cudaStream_t stream);

/// dv columns per CTA of the scan kernel launch_gdn_prefill uses for these params on the current
/// device (slice_columns when set; 32 or 64 for the chunked scan). Same preconditions/throws as
/// launch_gdn_prefill.
int plan_gdn_prefill_slice(const GdnPrefillParams& params);

}  // namespace fn

// Gated DeltaNet decode for one token (docs/model.md §C.5 steps 2-7): causal conv + SiLU with the
// conv state shift, gates, q/k L2 norm, the delta-rule recurrence on the FP32 state, and the gated
// RMSNorm, from the FP32 output of the stacked projection GEMV to the BF16 input of out_proj.
// Called by the CUDA decode step once per GDN layer. One launch (four with the overlapped
// projections); deterministic (fixed reduction order, no float atomics), graph-capturable (no
// host sync).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn {

/// Operands of one GDN decode step of one rank (its TP slice of heads). All pointers are device
/// memory. Sizes: conv_dim = 2 * Hk * dk + Hv * dv. Math: exactly fn::CpuModel::gdn_step steps
/// 2-7 (cpu::causal_conv_step with dilation 1, cpu::gdn_gates, cpu::gdn_recurrent_step,
/// cpu::gated_rms_norm per head), FP32 throughout, BF16 only at the output store.
struct GdnDecodeParams {
  /// [conv_dim + Hv*dv + 2*Hv] FP32: the output of one stacked GEMV, laid out as
  /// [ qkv (q [Hk*dk], k [Hk*dk], v [Hv*dv]) | z [Hv*dv] | a [Hv] | b [Hv] ]. Written by the
  /// launcher itself when in_proj is set, else read only.
  float* proj = nullptr;
  const float* conv_weight = nullptr;  ///< [conv_dim, conv_kernel] FP32 (conv1d.weight squeezed)
  const float* A_log = nullptr;        ///< [Hv] FP32
  const float* dt_bias = nullptr;      ///< [Hv] FP32
  const float* norm_weight = nullptr;  ///< [dv] FP32, plain weight (not 1 + w), shared by heads
  /// [conv_dim, conv_kernel - 1] FP32 pre-conv inputs, oldest first (cpu::causal_conv_step's
  /// layout); shifted in place. Zeros before the first token.
  float* conv_state = nullptr;
  /// [Hv, dk, dv] FP32 recurrent state oriented [k, v] (cpu::gdn_recurrent_step); updated in
  /// place. 16-byte aligned.
  float* state = nullptr;
  uint16_t* out = nullptr;  ///< [Hv*dv] BF16 bits: gated_rms_norm(o_h; norm_weight, z_h) per head
  int num_k_heads = 0;      ///< Hk (local TP slice), >= 1
  int num_v_heads = 0;      ///< Hv (local), a multiple of Hk; value head h uses key head h/(Hv/Hk)
  int k_head_dim = 0;       ///< dk: multiple of 4, 4..1024 (128 real; 8/16 in the fixtures)
  int v_head_dim = 0;       ///< dv: multiple of 4, 4..1024
  int conv_kernel = 4;      ///< linear_conv_kernel_dim, 2..8
  float eps = 1e-6f;        ///< rms_norm_eps (the gated norm; the L2 norm uses 1e-6 as the CPU op)
  // Scratch (device memory owned by the caller, e.g. the engine arena; never read by the host):
  float* o_scratch = nullptr;  ///< [Hv*dv] FP32: the un-normalised recurrence output o
  /// [Hv + Hk] zero-initialised ONCE after allocation (cudaMemset); every launch leaves them zero.
  /// Arrival counters: the last CTA of value head h (entry h) applies the gated norm to the
  /// whole head; the last CTA of key head i (entry Hv + i) shifts its q/k conv history.
  unsigned int* head_counters = nullptr;
  /// dv columns per CTA: 0 lets plan_gdn_decode_slice choose; else 4, 8, 16 or 32, dividing dv,
  /// with dk * slice_columns <= 4096 (the state tile fits the registers). For benchmarks/tests.
  int slice_columns = 0;
  /// true: the compile-time-shape instance of the recurrence kernel runs when the shape is the
  /// real layer's (dk = dv = 128, 32-column slices, conv kernel 4); false: always the
  /// runtime-shape instance. The same bits either way.
  bool fixed_shape = true;
  /// true (default): where the compile-time-shape instance runs on an sm_90+ device, it runs in
  /// thread-block clusters of one key head's (Hv / Hk) * (dv / slice) CTAs (12 at the real shape,
  /// at most 16): a cluster barrier and distributed shared memory instead of the arrival counters
  /// and o_scratch (which stay untouched). false: the arrival counters (devices or shapes
  /// without clusters). The same bits either way.
  bool cluster = true;
  /// The overlapped projection (the decode step's default): when non-null, the
  /// launcher also runs the layer's input projection and out_proj, four launches: the
  /// projection's rows but z (in_proj . x into proj), the z rows (a GEMV without a programmatic
  /// wait), the recurrence beside them (it waits for the first rows through join word 0, and
  /// its gated norm for the z rows through join word 1), then out_proj (y = out_weight . out).
  /// The same bits as the three launches in a row; without programmatic dependent launches the
  /// four run one after another. in_proj: BF16 [conv_dim + Hv*dv + 2*Hv, hidden] (the rows
  /// of proj); x: FP32 [hidden], written at least one launch before by a kernel that waited for
  /// its predecessor (the HC mix); hidden a multiple of 8, 8..8192. nullptr: the caller runs
  /// both GEMVs (one launch here).
  const uint16_t* in_proj = nullptr;
  const float* x = nullptr;              ///< FP32 [hidden] (with in_proj)
  int64_t hidden = 0;                    ///< the projection's input length (with in_proj)
  const uint16_t* out_weight = nullptr;  ///< BF16 [hidden, Hv*dv] out_proj (with in_proj)
  float* y = nullptr;                    ///< FP32 [hidden]: out_proj's output (with in_proj)
  /// [2] join words (with in_proj): zeroed once after allocation; every launch leaves them 0.
  unsigned int* join = nullptr;
  /// Several sequences in one launch (the batched decode step): `rows` tokens, row r of sequence
  /// slot row_slot[r], each row exactly the one-row launch on its own operands (the same bits).
  /// rows > 1 needs row_slot. With row_slot set (any rows): proj row r at proj + r * proj_stride
  /// (floats, >= the width above), out row r at out + r * out_stride (BF16 values, >= Hv*dv), the
  /// states of slot s at slot_state[s] and slot_conv[s] (state and conv_state then unread),
  /// o_scratch [rows, Hv*dv] and head_counters [rows, Hv + Hk] (zeroed once, as above), in_proj
  /// null. row_slot, slot_state and slot_conv are device arrays ([rows], [slots], [slots]); no two
  /// rows name one slot.
  int rows = 1;
  const int32_t* row_slot = nullptr;
  float* const* slot_state = nullptr;
  float* const* slot_conv = nullptr;
  int64_t proj_stride = 0;
  int64_t out_stride = 0;
};

/// Launches the recurrence kernel: one CTA of 256 threads per (value head, slice of dv columns)
/// and row,
/// each computing the causal conv of the channels it reads from the old conv state; the state
/// slice stays in registers, loaded and stored once with coalesced 16-byte accesses (with
/// in_proj, the projections around it, four launches). Throws fn::Error(Internal) on a null
/// pointer, bad sizes (see the field comments) or a misaligned state, in_proj, x or out_weight;
/// fn::Error(Cuda) on a failed launch.
void launch_gdn_decode(const GdnDecodeParams& params, cudaStream_t stream);

/// Columns of dv per CTA of the recurrence kernel that launch_gdn_decode uses for these params
/// on the current device (4, 8, 16 or 32; slice_columns when set). Same preconditions/throws.
int plan_gdn_decode_slice(const GdnDecodeParams& params);

}  // namespace fn

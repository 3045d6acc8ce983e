// Row-parallel kernels of the batched prefill (docs/model.md §C.1-§C.3, §C.7, §D): the same
// element-wise math as the decode step's kernels (decode_ops.h, hc.h) applied to M token rows at
// once, around the cuBLAS GEMMs of gemm.h. Called by CudaModel::prefill. Each launch is
// independent per row (no state), deterministic, and never synchronises the host.
// Layouts: row p of an [M, n] matrix starts at p * n (row-major, densely packed) unless a stride
// is given. BF16 values are uint16_t bits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fn {

/// FP32 x -> BF16 pair (hi = bf16(x), lo = bf16(x - hi)), so that hi + lo carries ~16 mantissa
/// bits: the GEMM input format of gemm_rows for FP32 activations. lo may be nullptr (hi only).
/// Throws fn::Error(Internal) on null pointers or count < 1; fn::Error(Cuda) on launch failure.
void launch_split_bf16(const float* x, int64_t count, uint16_t* hi, uint16_t* lo,
                       cudaStream_t stream);

/// Embedding and widening (docs/model.md §C.1) for M tokens: H[p, s*D + i] = E[tokens[p], i] for
/// every stream s. A token outside [0, vocab) gives a zero row and sets *error_flag = 1.
/// table [vocab, D] BF16; H [M, hc_count*D] FP32. Throws as launch_split_bf16.
void launch_embed_rows(const uint16_t* table, int64_t vocab, int64_t hidden, int hc_count,
                       const int32_t* tokens, int64_t rows, float* H, int32_t* error_flag,
                       cudaStream_t stream);

/// HC read, part 1 (docs/model.md §C.2 GroupRMSNorm1p, §C.3 step 1) for M rows of H [M, S*D] FP32:
/// scale[p, s] = rsqrt(mean_i H[p, s*D+i]^2 + eps) (FP32), N = H * scale * (1 + w) written as
/// the BF16 pair (n_hi, n_lo) [M, S*D] for the down/inject GEMM (n_lo may be nullptr: hi alone,
/// a prompt pass's form). norm: [S*D] BF16 weight w.
/// One CTA per (row, stream), fixed reduction order. Throws as launch_split_bf16.
void launch_hc_norm_rows(const float* H, const uint16_t* norm, int hc_count, int64_t hidden,
                         float eps, int64_t rows, float* scale, uint16_t* n_hi, uint16_t* n_lo,
                         cudaStream_t stream);

/// HC read, part 2 (docs/model.md §C.3 steps 2 and 5) from t = N · [W_dn; W_inj]ᵀ [M, ld_t] FP32:
/// u = silu(t[:, 0:R] / S) as the BF16 pair (u_hi, u_lo) [M, R] (u_lo may be nullptr) for the
/// W_up GEMM and, when iota != nullptr, iota[p, s] = 2 * sigmoid(t[p, R + s] / S) [M, S] FP32.
/// Throws as launch_split_bf16.
void launch_hc_act_rows(const float* t, int64_t ld_t, int64_t rank, int hc_count, int64_t rows,
                        uint16_t* u_hi, uint16_t* u_lo, float* iota, cudaStream_t stream);

/// HC read, part 3 (docs/model.md §C.3 steps 3-4) from g = u · W_upᵀ [M, S*D] FP32 (pre-sigmoid):
/// m[p, i] = (1/S) sum_s sigmoid(g[p, s*D+i]) * N[p, s*D+i] with N recomputed from H, scale and
/// norm as in launch_hc_norm_rows (FP32, ascending s); written as the BF16 pair (m_hi, m_lo)
/// [M, D] (m_hi = bf16(m) is also the routed experts' W4A16 input). Throws as launch_split_bf16.
void launch_hc_mix_rows(const float* g, const float* H, const float* scale, const uint16_t* norm,
                        int hc_count, int64_t hidden, int64_t rows, uint16_t* m_hi, uint16_t* m_lo,
                        cudaStream_t stream);

/// HC inject (docs/model.md §C.3, after the block) for M rows: H[p, s*D+i] += iota[p, s] * y[p, i]
/// (product and sum rounded separately, as the decode kernel). iota [M, S], y [M, D] FP32.
/// Throws as launch_split_bf16.
void launch_hc_inject_rows(float* H, const float* iota, const float* y, int hc_count,
                           int64_t hidden, int64_t rows, cudaStream_t stream);

/// Shared-expert SwiGLU (docs/model.md §C.7 step 3) for M rows: h[p, i] = bf16(silu(gu[p, i]) *
/// gu[p, I + i]) (dev::swiglu_bf16_bits, as the decode step's launch_shared_down_combine); gu
/// [M, 2I] FP32 (gate columns, then up), h [M, I] BF16. Throws as above.
void launch_swiglu_rows(const float* gate_up, int64_t inter, int64_t rows, uint16_t* h,
                        cudaStream_t stream);

/// MoE combine (docs/model.md §C.7 step 4) for M rows: y[p, i] += sigmoid(gate[p * ld_gate]) *
/// ys[p, i] (fmaf, two-branch sigmoid: dev::sigmoid_2branch, as the decode step's
/// launch_shared_down_combine). y, ys [M, D] FP32. Throws as above.
void launch_moe_combine_rows(float* y, const float* ys, const float* gate, int64_t ld_gate,
                             int64_t hidden, int64_t rows, cudaStream_t stream);

/// The second half of gemm_rows' stacked form: y[p, :] = s[p, :] + s[m + p, :] for p < m, or
/// with accumulate y[p, :] = (y[p, :] + s[p, :]) + s[m + p, :] (the order of the two-GEMM form's
/// beta = 1 sums). stacked: [2m, n] FP32 densely packed (the hi rows' products, then the lo
/// rows'); y: [m, ldy] FP32. Throws as launch_split_bf16 (also on ldy < n).
void launch_sum_stacked_halves(const float* stacked, int64_t m, int64_t n, float* y, int64_t ldy,
                               bool accumulate, cudaStream_t stream);

}  // namespace fn

// Dense BF16 GEMMs of the batched prefill through cuBLAS: Y = X · Wᵀ for a BF16 weight
// W stored row-major [n, k] (the checkpoint's [out, in] layout, as every decode GEMV reads it)
// and M activation rows. FP32 activations (the HC read's N and m, DESIGN/numerics.md) are passed
// as two BF16 rows hi + lo (x ≈ hi + lo to ~2^-16 relative; products are exact on the tensor
// cores and sums are FP32), so the GEMM keeps the decode GEMV's FP32-activation numerics up to
// summation order. Called by CudaModel::prefill. Deterministic for a given device and shape.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fn {

/// Owns one cuBLAS handle bound to a stream (cublasCreate / cublasSetStream) with its own
/// workspace (kCublasWorkspaceBytes of device memory, cublasSetWorkspace), so that its GEMMs can
/// be captured into a CUDA graph (no allocation during a capture). Not copyable.
class CublasHandle {
 public:
  /// Throws fn::Error(Cuda) naming the cuBLAS status when cublasCreate fails (no device, or out
  /// of memory), or the failed cudaMalloc of the workspace.
  explicit CublasHandle(cudaStream_t stream);
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const noexcept { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

/// The workspace of a CublasHandle (cuBLAS' recommendation for Hopper).
inline constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;

/// Y[m, n] (FP32, row stride ldy) = X[m, k] · W[n, k]ᵀ, X = x_hi (+ x_lo when not null), each a
/// BF16-bits row-major matrix with row stride ldx. accumulate: Y += instead of Y =.
struct GemmRowsParams {
  const uint16_t* w = nullptr;     ///< [n, k] BF16 bits, row-major (ld k)
  int64_t n = 0;                   ///< output columns (weight rows), >= 1
  int64_t k = 0;                   ///< inner dimension, >= 1
  const uint16_t* x_hi = nullptr;  ///< [m, ldx] BF16 bits
  const uint16_t* x_lo = nullptr;  ///< [m, ldx] BF16 bits: x - hi rounded to BF16, or nullptr
  int64_t ldx = 0;                 ///< >= k
  int64_t m = 0;                   ///< rows, >= 1
  float* y = nullptr;              ///< [m, ldy] FP32
  int64_t ldy = 0;                 ///< >= n
  bool accumulate = false;
  /// The stacked form, for skinny passes (a batched decode step) whose weight read dominates:
  /// when x_lo == x_hi + m * ldx (the lo rows right below the hi rows), m <= kGemmStackMaxRows
  /// and 2 * m * n <= stack_floats, one GEMM of 2m rows into stack ([2m, n] FP32 device
  /// scratch) reads W once, and launch_sum_stacked_halves (prefill_ops.h) adds the halves into
  /// y. Otherwise (or with stack nullptr) two GEMMs, each reading W.
  float* stack = nullptr;
  int64_t stack_floats = 0;
};

/// Rows up to which gemm_rows takes the stacked form.
inline constexpr int64_t kGemmStackMaxRows = 64;

/// Enqueues one cublasGemmEx (two with x_lo, or one and the halves' sum in the stacked form) on
/// the handle's stream: BF16 inputs, FP32 output and compute (CUBLAS_COMPUTE_32F). Throws
/// fn::Error(Internal) on null pointers or bad sizes (every dimension must fit int32),
/// fn::Error(Cuda) naming the cuBLAS status or the failed launch.
void gemm_rows(cublasHandle_t handle, const GemmRowsParams& params);

}  // namespace fn

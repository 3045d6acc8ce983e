// cuBLAS GEMMs of the batched prefill (see gemm.h).
#include "cuda/kernels/gemm.h"

#include <climits>

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "cuda/kernels/prefill_ops.h"

namespace fn {
namespace {

#define FN_CUBLAS_CHECK(expr)                                                         \
  do {                                                                                \
    const cublasStatus_t fn_cublas_rc_ = (expr);                                      \
    if (fn_cublas_rc_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                          \
      FN_THROW(Cuda, "{} failed: {} ({})", #expr, cublasGetStatusName(fn_cublas_rc_), \
               cublasGetStatusString(fn_cublas_rc_));                                 \
  } while (0)

bool fits_int(int64_t v) {
  return v >= 1 && v <= INT_MAX;
}

}  // namespace

CublasHandle::CublasHandle(cudaStream_t stream) {
  FN_CUBLAS_CHECK(cublasCreate(&handle_));
  FN_CUBLAS_CHECK(cublasSetStream(handle_, stream));
  // cuBLAS keeps its results reproducible unless atomics are allowed; say so explicitly.
  FN_CUBLAS_CHECK(cublasSetAtomicsMode(handle_, CUBLAS_ATOMICS_NOT_ALLOWED));
  const cudaError_t rc = cudaMalloc(&workspace_, kCublasWorkspaceBytes);
  if (rc != cudaSuccess) {
    cublasDestroy(handle_);
    FN_THROW(Cuda, "allocating the cuBLAS workspace ({} MiB): {}", kCublasWorkspaceBytes >> 20,
             cudaGetErrorString(rc));
  }
  try {
    FN_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, kCublasWorkspaceBytes));
  } catch (...) {
    cublasDestroy(handle_);
    cudaFree(workspace_);
    throw;
  }
}

CublasHandle::~CublasHandle() {
  if (handle_) cublasDestroy(handle_);
  if (workspace_) cudaFree(workspace_);
}

void gemm_rows(cublasHandle_t handle, const GemmRowsParams& p) {
  FN_CHECK(handle != nullptr && p.w != nullptr && p.x_hi != nullptr && p.y != nullptr,
           "gemm_rows: null pointer");
  FN_CHECK(fits_int(p.n) && fits_int(p.k) && fits_int(p.m) && fits_int(p.ldx) && fits_int(p.ldy) &&
               p.ldx >= p.k && p.ldy >= p.n,
           "gemm_rows: bad shape n={} k={} m={} ldx={} ldy={}", p.n, p.k, p.m, p.ldx, p.ldy);
  // Column-major view: Yᵀ [n, m] = W [k, n]ᵀ · Xᵀ [k, m] (W row-major [n, k] is column-major
  // [k, n]; X row-major [m, ldx] is column-major [ldx, m]).
  const float one = 1.0f, zero = 0.0f;
  const int n = static_cast<int>(p.n), m = static_cast<int>(p.m), k = static_cast<int>(p.k);
  if (p.x_lo != nullptr && p.stack != nullptr && p.x_lo == p.x_hi + p.m * p.ldx &&
      p.m <= kGemmStackMaxRows && 2 * p.m * p.n <= p.stack_floats) {
    FN_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, 2 * m, k, &one, p.w,
                                 CUDA_R_16BF, k, p.x_hi, CUDA_R_16BF, static_cast<int>(p.ldx),
                                 &zero, p.stack, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
    cudaStream_t stream = nullptr;
    FN_CUBLAS_CHECK(cublasGetStream(handle, &stream));
    launch_sum_stacked_halves(p.stack, p.m, p.n, p.y, p.ldy, p.accumulate, stream);
    return;
  }
  const uint16_t* parts[2] = {p.x_hi, p.x_lo};
  for (int i = 0; i < 2; ++i) {
    if (parts[i] == nullptr) continue;
    const float* beta = (i == 0 && !p.accumulate) ? &zero : &one;
    FN_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, p.w, CUDA_R_16BF,
                                 k, parts[i], CUDA_R_16BF, static_cast<int>(p.ldx), beta, p.y,
                                 CUDA_R_32F, static_cast<int>(p.ldy), CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
  }
}

}  // namespace fn

// FN_CUDA_CHECK, FN_CUDA_LAUNCH_CHECK and FN_NCCL_CHECK: turn a failing CUDA runtime or NCCL
// call into fn::Error (Cuda / Nccl) naming the file, line, the call's text and the library's
// own error string. Used by comm/ and cuda/ (DESIGN.md "Errors": the lowest folder that sees
// the CUDA runtime). CUDA runtime API only: nothing here needs libcuda at link time.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/error.h"

namespace fn::detail {
[[noreturn]] void throw_cuda_error(cudaError_t code, const char* expr, const char* file, int line);
[[noreturn]] void throw_nccl_error(ncclResult_t code, const char* expr, const char* file, int line);
}  // namespace fn::detail

/// Calls a CUDA runtime function; throws fn::Error(Cuda) with cudaGetErrorName/String on failure.
#define FN_CUDA_CHECK(expr)                                                   \
  do {                                                                        \
    const cudaError_t fn_cuda_rc_ = (expr);                                   \
    if (fn_cuda_rc_ != cudaSuccess) [[unlikely]]                              \
      ::fn::detail::throw_cuda_error(fn_cuda_rc_, #expr, __FILE__, __LINE__); \
  } while (0)

/// After a kernel launch (<<<>>> or cudaLaunchKernel): throws fn::Error(Cuda) naming `what`
/// when the launch failed. Legal during stream capture (cudaGetLastError only).
#define FN_CUDA_LAUNCH_CHECK(what)                                                        \
  do {                                                                                    \
    const cudaError_t fn_cuda_rc_ = cudaGetLastError();                                   \
    if (fn_cuda_rc_ != cudaSuccess) [[unlikely]]                                          \
      ::fn::detail::throw_cuda_error(fn_cuda_rc_, "launch of " what, __FILE__, __LINE__); \
  } while (0)

/// Calls an NCCL function; throws fn::Error(Nccl) with ncclGetErrorString and
/// ncclGetLastError on failure. ncclInProgress counts as success (non-blocking communicators).
#define FN_NCCL_CHECK(expr)                                                       \
  do {                                                                            \
    const ncclResult_t fn_nccl_rc_ = (expr);                                      \
    if (fn_nccl_rc_ != ncclSuccess && fn_nccl_rc_ != ncclInProgress) [[unlikely]] \
      ::fn::detail::throw_nccl_error(fn_nccl_rc_, #expr, __FILE__, __LINE__);     \
  } while (0)

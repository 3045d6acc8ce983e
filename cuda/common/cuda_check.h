// FN_CUDA_CHECK and FN_CUDA_LAUNCH_CHECK: turn a failing CUDA runtime call or kernel launch into
// fn::Error(Cuda) naming the file, line, the call's text and the runtime's own error string.
// Used by every CUDA folder (cuda/common is the lowest one; comm/nccl_check.h adds NCCL's).
// CUDA runtime API only: nothing here needs libcuda at link time.
#pragma once

// cuda_runtime.h (not only _api): its typed cudaMalloc/cudaMallocHost overloads are used by
// host code that includes this header alone.
#include <cuda_runtime.h>

#include "core/error.h"

namespace fn::detail {
[[noreturn]] void throw_cuda_error(cudaError_t code, const char* expr, const char* file, int line);
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

// FN_NCCL_CHECK: turns a failing NCCL call into fn::Error(Nccl) naming the file, line, the
// call's text, NCCL's error string and its last-error detail. Used by comm/ (gpu_comm, the
// custom all-reduce's NCCL fallback); FN_CUDA_CHECK lives in cuda/common/cuda_check.h.
#pragma once

#include <nccl.h>

#include "core/error.h"

namespace fn::detail {
[[noreturn]] void throw_nccl_error(ncclResult_t code, const char* expr, const char* file, int line);
}  // namespace fn::detail

/// Calls an NCCL function; throws fn::Error(Nccl) with ncclGetErrorString and
/// ncclGetLastError on failure. ncclInProgress counts as success (non-blocking communicators).
#define FN_NCCL_CHECK(expr)                                                       \
  do {                                                                            \
    const ncclResult_t fn_nccl_rc_ = (expr);                                      \
    if (fn_nccl_rc_ != ncclSuccess && fn_nccl_rc_ != ncclInProgress) [[unlikely]] \
      ::fn::detail::throw_nccl_error(fn_nccl_rc_, #expr, __FILE__, __LINE__);     \
  } while (0)

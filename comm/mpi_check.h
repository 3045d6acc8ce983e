// FN_MPI_CHECK: turns a failing MPI call into fn::Error(Mpi) with MPI_Error_string's text.
// Used by comm/ and by anything that calls MPI directly (tests, apps).
#pragma once

#include <mpi.h>

#include "core/error.h"

namespace fn::detail {
[[noreturn]] void throw_mpi_error(int code, const char* expr, const char* file, int line);
}  // namespace fn::detail

/// Calls an MPI function and throws fn::Error(Mpi) naming the call when it does not succeed.
#define FN_MPI_CHECK(expr)                                                  \
  do {                                                                      \
    const int fn_mpi_rc_ = (expr);                                          \
    if (fn_mpi_rc_ != MPI_SUCCESS) [[unlikely]]                             \
      ::fn::detail::throw_mpi_error(fn_mpi_rc_, #expr, __FILE__, __LINE__); \
  } while (0)

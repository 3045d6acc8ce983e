// Precondition checks for the kernel launchers in cuda/*.cu. nvcc cannot compile fmt's
// compile-time format strings in C++20 mode, so .cu files throw through this non-template entry
// point (defined in launch_check.cpp, compiled by the host compiler) instead of FN_CHECK.
// Called before a launch, so it is legal during stream capture.
#pragma once

#include <cstdint>

namespace fn::detail {
/// Whether p is a multiple of n bytes (n a power of two): the launchers' alignment checks.
inline bool aligned(const void* p, uintptr_t n) {
  return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0;
}
/// Throws fn::Error(Internal): "<op>: precondition failed: <cond> (<file>:<line>)".
[[noreturn]] void throw_launch_precondition(const char* op, const char* cond, const char* file,
                                            int line);
/// Multiprocessor count of the current device, queried once per device and cached (so launchers
/// make no attribute query while a stream is being captured after the first call).
/// Throws fn::Error(Cuda) when the query fails.
int current_sm_count();
}  // namespace fn::detail

/// Throws fn::Error(Internal) naming the launcher `op` and the failed condition unless cond holds.
#define FN_LAUNCH_REQUIRE(cond, op)                                           \
  do {                                                                        \
    if (!(cond)) [[unlikely]]                                                 \
      ::fn::detail::throw_launch_precondition(op, #cond, __FILE__, __LINE__); \
  } while (0)

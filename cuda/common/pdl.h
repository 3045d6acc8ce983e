// Programmatic dependent launch (PDL, sm_90+): the process-wide switch that every kernel launcher
// of the decode step (cuda/kernels/*.cu) and of the custom all-reduce (comm/), through
// cuda/common/pdl.cuh, reads when it enqueues a kernel. FN_PDL=0 in the environment turns it off
// (read once, here only); tests and benches set it to compare both. Host code only (C++20 or
// CUDA); no CUDA runtime call here.
#pragma once

namespace fn {

/// Turns programmatic dependent launch on or off for every later launch of the decode and
/// all-reduce kernels (already captured graphs keep what they were captured with). Thread-safe.
void set_pdl_enabled(bool enabled);

/// Whether launchers add the programmatic-stream-serialization attribute: the last
/// set_pdl_enabled() value, else false when the environment variable FN_PDL is "0" at the first
/// call, else true. Launchers also leave the attribute off on devices below sm_90.
bool pdl_enabled();

}  // namespace fn

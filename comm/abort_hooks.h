// Abort hooks: what must run before a fatal MPI_Abort (ncclCommAbort, so that NCCL's proxy
// threads and peers are not left waiting). Registered by comm/ objects that own such state
// (GpuComm); run once by MpiContext::abort_all, the end of main()'s error funnel.
// Thread-safe; hooks must not throw and must not call MPI.
#pragma once

#include <functional>

namespace fn {

/// Registers `hook` to run on a fatal abort; returns an id for unregister_abort_hook().
int register_abort_hook(std::function<void()> hook);
/// Removes a hook (no-op for an unknown id). Called from the owner's destructor.
void unregister_abort_hook(int id) noexcept;
/// Runs every registered hook once, newest first, then forgets them. Never throws.
void run_abort_hooks() noexcept;

}  // namespace fn

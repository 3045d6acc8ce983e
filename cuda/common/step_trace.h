// Step timeline (diagnostics): when each CTA of each decode-step launch reaches its
// programmatic-dependent wait and when the wait releases it, on the GPU's global nanosecond timer.
// Compiled in only with the CMake option FN_STEP_TRACE=ON (the compile definition FN_STEP_TRACE
// on fngen_cuda's .cu files); production builds record nothing and pay nothing. Read by
// `cuda_model_bench --trace FILE` and summarised by scripts/step_timeline.py.
//
// How: dev::pdl_wait() (cuda/common/pdl.cuh), which every decode-step kernel calls before it reads
// what an earlier kernel wrote, has thread 0 of each CTA read %globaltimer before and after
// griddepcontrol.wait and append one StepTraceRecord (%gridid identifies the launch). The
// release of launch k minus that of launch k-1 is launch k-1's cost on the step's critical path
// (its run after its own release, its completion and the wait's latency); the records of one step
// add up to the step. A CTA that arrives after its launch's first release was not resident when
// the predecessor finished (it waited for room on an SM).
#pragma once

#include <cstdint>

namespace fn {

/// One CTA's pass through dev::pdl_wait(): 40 bytes, the same layout on host and device.
struct StepTraceRecord {
  uint64_t grid_id;    ///< %gridid: one per launch; a CUDA graph's replays of a node share it
  uint64_t t_arrive;   ///< ns (%globaltimer) when thread 0 reached the wait
  uint64_t t_release;  ///< ns when the wait returned in thread 0
  uint32_t block;      ///< blockIdx.x
  uint32_t grid;       ///< gridDim.x
  uint32_t threads;    ///< blockDim.x
  uint32_t sm;         ///< %smid
};
static_assert(sizeof(StepTraceRecord) == 40, "host and device layouts must match");

/// Sets one translation unit's device-side trace pointers (records, count, capacity); nullptr
/// records turns its recording off.
using StepTraceSetter = void (*)(StepTraceRecord* records, uint32_t* count, uint32_t capacity);

/// Adds a translation unit's setter (called from static initialisers in cuda/common/pdl.cuh when
/// FN_STEP_TRACE is defined). Returns true. Thread-safe.
bool step_trace_register(StepTraceSetter setter);

/// Whether any translation unit of this build records (the build had FN_STEP_TRACE=ON).
bool step_trace_compiled();

/// Points every registered translation unit at `records` (device memory, `capacity` records) and
/// `count` (a device uint32, which the caller zeroes; CTAs past the capacity still count but
/// write nothing). nullptr records detaches. Throws fn::Error(Cuda) when a symbol copy fails.
/// Not during graph capture.
void step_trace_attach(StepTraceRecord* records, uint32_t* count, uint32_t capacity);

}  // namespace fn

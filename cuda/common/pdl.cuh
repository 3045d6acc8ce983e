// Programmatic dependent launch for the decode kernels (cuda/kernels/*.cu) and the custom
// all-reduce kernels (comm/custom_all_reduce_kernels.cu): launch_pdl() enqueues a kernel with the
// programmatic-stream-serialization attribute when fn::pdl_enabled() and the device runs sm_90+
// code, and the device helpers every such kernel calls. Included by .cu files only.
// Contract of a kernel launched through launch_pdl (it may start while its predecessor in the
// stream still runs): every thread calls dev::pdl_wait() before it reads anything an earlier
// kernel wrote, writes anything an earlier kernel reads, or exits; before the wait it only reads
// weights (data no kernel of the stream writes), prefetches into L2 (always memory-safe), or reads
// through L2 (ld.global.cg) what a kernel at least two launches back wrote (complete: see the
// next rule); it calls dev::pdl_launch_dependents() only after its own pdl_wait(), so a kernel
// never runs ahead of more than one unfinished predecessor. The exceptions are the overlapped
// projections of the QSA and GDN launchers (QsaDecodeParams::in_proj, GdnDecodeParams::in_proj):
// a GEMV that never waits (GemvBf16Params::no_pdl_wait), whose x is complete by the chain before
// it, and a launch that lets it start at once (the QSA scores + select) or follows it and waits
// for its other predecessor through a join word instead (the GDN recurrence); results cross
// between launches that do not wait for each other through a done flag or join words
// (cuda/common/device_util.cuh), each written by a launch that comes first in stream order, so they
// are met on arrival when the launches run one after another.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "cuda/common/cuda_check.h"
#include "cuda/common/l2_prefetch.h"
#include "cuda/common/pdl.h"
#include "cuda/common/step_trace.h"

namespace fn {

namespace detail {
/// Whether the current device runs programmatic dependent launches (compute capability >= 9, and
/// the build's device code is sm_90+ code, which has the PDL waits), cached per device (no
/// attribute query during capture after the first call). Throws fn::Error(Cuda) when the query
/// fails.
bool current_device_has_pdl();

/// The launch configuration of kernel<<<grid, block, smem, stream>>> with the first `n` of
/// `attrs` (which must outlive the launch).
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, std::size_t smem,
                                        cudaStream_t stream, cudaLaunchAttribute* attrs,
                                        unsigned n) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cfg;
}

/// The programmatic-stream-serialization attribute (PDL).
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

/// Thread-block clusters of `cluster` CTAs along x.
inline cudaLaunchAttribute cluster_attribute(int cluster) {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = static_cast<unsigned>(cluster);
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

/// cudaLaunchKernelEx(&cfg, kernel, args...); throws fn::Error(Cuda) naming `what` when the
/// launch is refused (the error is cleared, so the next launch check does not report it again).
template <typename... KArgs, typename... Args>
void launch_ex(const cudaLaunchConfig_t& cfg, const char* what, void (*kernel)(KArgs...),
               Args&&... args) {
  const cudaError_t rc = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (rc != cudaSuccess) [[unlikely]] {
    (void)cudaGetLastError();
    throw_cuda_error(rc, what, __FILE__, __LINE__);
  }
}
}  // namespace detail

/// Enqueues kernel<<<grid, block, smem, stream>>>(args...) through cudaLaunchKernelEx, with the
/// programmatic-stream-serialization attribute when pdl_enabled() and
/// detail::current_device_has_pdl(). Throws fn::Error(Cuda) naming `what` when the launch is
/// refused (the error is cleared). Legal during capture.
template <typename... KArgs, typename... Args>
void launch_pdl(const char* what, void (*kernel)(KArgs...), dim3 grid, dim3 block, std::size_t smem,
                cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1] = {detail::pdl_attribute()};
  const bool on = pdl_enabled() && detail::current_device_has_pdl();
  detail::launch_ex(detail::launch_config(grid, block, smem, stream, attr, on ? 1 : 0), what,
                    kernel, std::forward<Args>(args)...);
}

/// The largest thread-block cluster launch_cluster_pdl takes (the non-portable limit of sm_90).
inline constexpr int kMaxClusterSize = 16;

/// Whether `kernel` can run in clusters of `cluster` CTAs (1-D, along x) of `block` threads and
/// `smem` dynamic shared-memory bytes on the current device: at least one such cluster fits at
/// once (cudaOccupancyMaxActiveClusters). Allows cluster sizes above the portable 8 on the kernel
/// first. Only for sm_90+ code on an sm_90+ device (detail::current_device_has_pdl()); 1 <=
/// cluster <= kMaxClusterSize. Throws fn::Error(Cuda) when a query fails.
template <typename... KArgs>
bool cluster_launch_fits(void (*kernel)(KArgs...), dim3 block, std::size_t smem, int cluster) {
  if (cluster > 8)
    FN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchAttribute attr[1] = {detail::cluster_attribute(cluster)};
  const cudaLaunchConfig_t cfg =
      detail::launch_config(dim3(static_cast<unsigned>(cluster)), block, smem, nullptr, attr, 1);
  int clusters = 0;
  FN_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
  return clusters >= 1;
}

/// As launch_pdl, with the grid in clusters of `cluster` CTAs along x (gridDim.x a multiple of
/// it). Only after cluster_launch_fits(kernel, block, smem, cluster) returned true. Throws
/// fn::Error(Cuda) naming `what` when the launch is refused. Legal during capture.
template <typename... KArgs, typename... Args>
void launch_cluster_pdl(const char* what, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                        std::size_t smem, int cluster, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[2] = {detail::cluster_attribute(cluster), detail::pdl_attribute()};
  detail::launch_ex(detail::launch_config(grid, block, smem, stream, attr, pdl_enabled() ? 2 : 1),
                    what, kernel, std::forward<Args>(args)...);
}

#if defined(FN_STEP_TRACE)
namespace dev {
// This translation unit's trace pointers (no relocatable device code: one copy per .cu file),
// set through the registry of cuda/common/step_trace.h.
static __device__ StepTraceRecord* g_step_trace_records = nullptr;
static __device__ uint32_t* g_step_trace_count = nullptr;
static __device__ uint32_t g_step_trace_capacity = 0;
}  // namespace dev
namespace detail {
static void step_trace_set_this_unit(StepTraceRecord* records, uint32_t* count, uint32_t capacity) {
  FN_CUDA_CHECK(cudaMemcpyToSymbol(dev::g_step_trace_records, &records, sizeof records));
  FN_CUDA_CHECK(cudaMemcpyToSymbol(dev::g_step_trace_count, &count, sizeof count));
  FN_CUDA_CHECK(cudaMemcpyToSymbol(dev::g_step_trace_capacity, &capacity, sizeof capacity));
}
[[maybe_unused]] static const bool g_step_trace_registered =
    step_trace_register(&step_trace_set_this_unit);
}  // namespace detail
#endif

namespace dev {

#if defined(FN_STEP_TRACE) && defined(__CUDA_ARCH__)
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Thread 0 of the CTA appends its record (cuda/common/step_trace.h).
__device__ __forceinline__ void step_trace_record(uint64_t t_arrive) {
  const uint64_t t_release = global_timer_ns();
  StepTraceRecord* records = g_step_trace_records;
  if (records == nullptr || threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0) return;
  uint64_t grid_id;
  uint32_t sm;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid_id));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const uint32_t at = atomicAdd(g_step_trace_count, 1u);
  if (at < g_step_trace_capacity)
    records[at] =
        StepTraceRecord{grid_id, t_arrive, t_release, blockIdx.x, gridDim.x, blockDim.x, sm};
}
#endif

/// Waits until every prerequisite grid has completed and its memory is visible
/// (griddepcontrol.wait). A no-op when the kernel was not launched as a programmatic dependent,
/// and compiled to nothing below sm_90. With FN_STEP_TRACE, thread 0 of each CTA also records
/// when it arrived and when it was released (cuda/common/step_trace.h).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if defined(FN_STEP_TRACE)
  const uint64_t t_arrive = global_timer_ns();
#endif
  asm volatile("griddepcontrol.wait;" ::: "memory");
#if defined(FN_STEP_TRACE)
  step_trace_record(t_arrive);
#endif
#endif
}

/// Lets the next programmatic dependent grid be scheduled once every CTA of this grid has called
/// it or exited (griddepcontrol.launch_dependents). Memory-safe anywhere (the dependent still
/// waits for this grid's completion in pdl_wait); by the contract above, call it after pdl_wait().
/// Compiled to nothing below sm_90.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Both, in the usual order: the start of a kernel that reads nothing before its wait.
__device__ __forceinline__ void pdl_begin() {
  pdl_wait();
  pdl_launch_dependents();
}

/// Prefetches the 128-byte line holding p into L2 (prefetch.global.L2; a hint, memory-safe
/// whatever other kernels do with the line).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

/// Issues part `part` of `parts` of the ranges of l (fn::for_each_l2_prefetch_chunk,
/// cuda/common/l2_prefetch.h) as bulk L2 prefetches, one cp.async.bulk.prefetch.L2 per chunk
/// (sm_90+; nothing below). Called by one thread per CTA (part = the CTA's index, parts = the
/// grid's CTAs), anywhere in a kernel (a prefetch is memory-safe: the contract above); it does not
/// wait.
__device__ __forceinline__ void l2_prefetch_part(const L2Prefetch& l, unsigned part,
                                                 unsigned parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for_each_l2_prefetch_chunk(l, part, parts, [](const char* p, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
  });
#else
  (void)l;
  (void)part;
  (void)parts;
#endif
}

}  // namespace dev
}  // namespace fn

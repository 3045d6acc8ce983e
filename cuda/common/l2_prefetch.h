// Weight ranges a decode kernel prefetches into L2 for a later kernel of the same step. The routed
// gate+up launch leaves HBM partly idle while the HC read a few launches later is latency bound on
// its weights' first HBM round trip: the gate+up launch carries an L2Prefetch
// (MoeGateUpParams::l2_prefetch) of the next HC read's matrices, and thread 0 of each CTA issues
// its share as bulk L2 prefetches (cp.async.bulk.prefetch.L2, sm_90+; nothing on older devices):
// the FP32 kernel first thing, the bulk-copy kernel once its own loads have landed (after the
// selected experts' down weights, MoeGateUpParams::down_prefetch). The shared expert's down launch
// carries one too (SharedDownCombineParams::l2_prefetch), for the first megabytes of the next
// input projection (a bandwidth-bound GEMV): small ranges only, as bursts slow the latency-bound
// launches beside them. A prefetch is a hint: it changes no result and is memory-safe whatever
// other kernels do. Which ranges pay off was measured on H200 (docs/perf-history.md).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FN_L2_PREFETCH_HD __host__ __device__
#else
#define FN_L2_PREFETCH_HD
#endif

namespace fn {

/// Bytes per bulk prefetch instruction (for_each_l2_prefetch_chunk).
constexpr uint32_t kL2PrefetchChunk = 64 * 1024;

/// Up to kMaxRanges device ranges [ptr, ptr + bytes) to prefetch into L2. Host code fills it with
/// add(); kernels receive it by value (a POD of 104 bytes).
struct L2Prefetch {
  static constexpr int kMaxRanges = 6;
  const void* ptr[kMaxRanges] = {};
  uint64_t bytes[kMaxRanges] = {};
  int count = 0;

  /// Appends [p, p + n) when p is non-null, 16-byte aligned, n > 0 and n a multiple of 16 (the bulk
  /// prefetch's granule; every weight matrix of the model qualifies) and a slot is free; returns
  /// whether it was added. A range that does not qualify is skipped: a missed prefetch only costs
  /// time.
  bool add(const void* p, uint64_t n) {
    if (p == nullptr || n == 0 || n % 16 != 0 || reinterpret_cast<uintptr_t>(p) % 16 != 0 ||
        count >= kMaxRanges)
      return false;
    ptr[count] = p;
    bytes[count] = n;
    ++count;
    return true;
  }
};

/// Part `part` of `parts` (part < parts) of the ranges of l: the ranges cut into chunks of
/// kL2PrefetchChunk bytes (the last chunk of a range shorter), numbered across the ranges in
/// order, and chunk c belongs to part c % parts. Calls f(const char* begin, uint32_t bytes) for
/// each chunk of the part, in increasing order. The parts together cover every byte of every range
/// exactly once. Host and device (the device issuer is dev::l2_prefetch_part, cuda/common/pdl.cuh).
template <class F>
FN_L2_PREFETCH_HD inline void for_each_l2_prefetch_chunk(const L2Prefetch& l, unsigned part,
                                                         unsigned parts, F&& f) {
  uint64_t c0 = 0;  // number of the first chunk of range r
  for (int r = 0; r < l.count && r < L2Prefetch::kMaxRanges; ++r) {
    const uint64_t n = (l.bytes[r] + kL2PrefetchChunk - 1) / kL2PrefetchChunk;
    const char* base = static_cast<const char*>(l.ptr[r]);
    for (uint64_t c = c0 + (part + parts - c0 % parts) % parts; c < c0 + n; c += parts) {
      const uint64_t off = (c - c0) * kL2PrefetchChunk;
      const uint64_t left = l.bytes[r] - off;
      f(base + off, left < kL2PrefetchChunk ? static_cast<uint32_t>(left) : kL2PrefetchChunk);
    }
    c0 += n;
  }
}

}  // namespace fn

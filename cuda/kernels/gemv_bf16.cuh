// Device code of the BF16 GEMV row dot (cuda/kernels/gemv_bf16.h), shared by gemv_bf16.cu and the
// fused MoE shared-expert kernels of moe_shared.cu so that a row computed by either gives the same
// bits. Included by .cu files only. Invariant: a row's FP32 sum depends only on the team width
// (lane l sums vectors l, l + T, l + 2T, ... in ascending order, then dev::team_reduce), never on
// the rows per team, the block size or the block index, and not on where x comes from as long as
// the XSource yields the same floats.
#pragma once

#include <cstdint>

#include "cuda/common/device_util.cuh"
#include "cuda/common/pdl.cuh"

namespace fn::dev {

/// The weight side of a GEMV launch: W BF16 row-major with row stride ld (elements), nvec = cols/8
/// 16-byte vectors per row, teams of (1 << team_log2) lanes.
struct GemvRows {
  const uint16_t* weight;
  int64_t rows;
  int64_t ld;
  int nvec;
  int team_log2;
  int64_t skip_at = 0;  ///< with skip > 0: rows r >= skip_at are W's (and y's) rows r + skip
  int64_t skip = 0;
};

/// The row of W (and y) that computed row r is: r, or r + skip from skip_at on.
__device__ __forceinline__ int64_t gemv_row(const GemvRows& a, int64_t r) {
  return a.skip > 0 && r >= a.skip_at ? r + a.skip : r;
}

/// xf = the eight floats of a, then b (an x source's 16-byte vector pair).
__device__ __forceinline__ void unpack8(float4 a, float4 b, float (&xf)[8]) {
  xf[0] = a.x, xf[1] = a.y, xf[2] = a.z, xf[3] = a.w;
  xf[4] = b.x, xf[5] = b.y, xf[6] = b.z, xf[7] = b.w;
}

/// x read from global memory, FP32 (kXF32) or BF16 bits: eight values of 16-byte vector v
/// (columns 8v .. 8v+7) as floats. prepare() is a no-op.
template <bool kXF32>
struct GemvXGlobal {
  const void* x;
  __device__ __forceinline__ void prepare() const {}
  __device__ __forceinline__ void load8(int v, float (&xf)[8]) const {
    if constexpr (kXF32) {
      const float4* p = static_cast<const float4*>(x) + 2 * v;
      unpack8(__ldg(p), __ldg(p + 1), xf);
    } else {
      const uint4 u = ld_cached16(static_cast<const uint4*>(x) + v);
      xf[0] = bf16_lo(u.x), xf[1] = bf16_hi(u.x);
      xf[2] = bf16_lo(u.y), xf[3] = bf16_hi(u.y);
      xf[4] = bf16_lo(u.z), xf[5] = bf16_hi(u.z);
      xf[6] = bf16_lo(u.w), xf[7] = bf16_hi(u.w);
    }
  }
};

// The kUnroll x kRows weight vectors of one step: vectors base + u * team of each row (zeros past
// the row's end, never used).
template <int kRows, int kUnroll>
__device__ __forceinline__ void gemv_load_tile(const uint4* const (&wrow)[kRows], int base,
                                               int team, int nvec, uint4 (&w)[kUnroll][kRows]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int v = base + u * team;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      w[u][r] = v < nvec ? ld_stream16(wrow[r] + v) : make_uint4(0, 0, 0, 0);
  }
}

/// One team of (1 << a.team_log2) lanes computes kRows consecutive rows of group `block` (rows
/// block * kRows * (kBlockThreads >> team_log2) + team * kRows + r). Lane l reads vectors l, l + T,
/// l + 2T, ... of each row (coalesced), kUnroll steps at a time so that kRows * kUnroll = 8
/// independent 16-byte weight loads are in flight per thread before the first FMA (latency
/// hiding at batch 1). The first kUnroll vectors of each row go into registers and the
/// next ones into L2 before dev::pdl_wait() (W is a weight; x comes from earlier kernels); then
/// pdl_wait, pdl_launch_dependents, xs.prepare() (every thread of the block), the dot. With
/// kXBeforeWait, x comes from a kernel at least two launches back (xs reads it through L2,
/// cuda/common/pdl.cuh): xs.prepare() and the whole dot run before the wait, which this function
/// does not do: the caller calls dev::pdl_wait() and dev::pdl_launch_dependents() itself before its
/// epilogue reads anything the previous kernel wrote. Returns the team's first row; acc[r]
/// holds row r's sum in the team's lane 0 (*lane_out == 0). Rows past a.rows re-read the last row
/// (in bounds) and must not be stored. Every thread of the block must call it with the same
/// team_log2 (dev::team_reduce may __syncthreads).
template <int kRows, int kBlockThreads, class XSource, bool kXBeforeWait = false>
__device__ __forceinline__ int64_t gemv_bf16_team_rows(const GemvRows& a, int64_t block,
                                                       const XSource& xs, float (&acc)[kRows],
                                                       int* lane_out) {
  constexpr int kUnroll = 8 / kRows;
  const int team = 1 << a.team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int team_in_block = threadIdx.x >> a.team_log2;
  const int teams_per_block = kBlockThreads >> a.team_log2;
  const int64_t row0 = (block * teams_per_block + team_in_block) * kRows;
  const uint4* wrow[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = gemv_row(a, min(row0 + r, a.rows - 1));
    wrow[r] = reinterpret_cast<const uint4*>(a.weight + row * a.ld);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;

  const int step = kUnroll * team;
  uint4 w[kUnroll][kRows];
  gemv_load_tile<kRows, kUnroll>(wrow, lane, team, a.nvec, w);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int v = lane + step + u * team;
    if (v < a.nvec && (lane & 7) == 0) {  // one prefetch per 128-byte line (8 vectors)
#pragma unroll
      for (int r = 0; r < kRows; ++r) prefetch_l2(wrow[r] + v);
    }
  }
  if constexpr (!kXBeforeWait) {
    pdl_wait();
    pdl_launch_dependents();
  }
  xs.prepare();

  for (int base = lane;;) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = base + u * team;
      if (v < a.nvec) {
        float xf[8];
        xs.load8(v, xf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] = fma8_bf16(w[u][r], xf, acc[r]);
      }
    }
    base += step;
    if (base >= a.nvec) break;
    gemv_load_tile<kRows, kUnroll>(wrow, base, team, a.nvec, w);
  }

  team_reduce<kRows, kBlockThreads>(acc, team, lane);
  *lane_out = lane;
  return row0;
}

}  // namespace fn::dev

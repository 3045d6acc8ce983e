// The grouped routed experts (moe_grouped.h), sm_90+: four launches per call.
//
// 1. moe_group_routes_kernel (one CTA): counts the valid routes r = t * top_k + j per expert,
//    scans the counts, and writes the distinct experts ascending (id, first sorted position,
//    count), their number, and the sorted route list: each expert's routes ascending by r. The
//    slots come from shared-memory atomics in any order, then every route takes its rank among
//    its expert's routes by counting the smaller ones, so the list does not depend on the order
//    of the atomics (deterministic).
// 2. moe_grouped_mma_kernel<true> (gate+up + SwiGLU) and 3. <false> (down): a persistent grid of
//    min(SMs, units) CTAs. A work unit is (distinct expert q, row chunk c) of `ut` tiles of 16 A
//    rows (gate+up tile T: gate rows 8T..8T+7 as A rows 0-7, the same up rows as A rows 8-15;
//    down tile T: W_down rows 16T..16T+15); there are n_distinct * units_per_expert units, the
//    count read from the device, and CTA b takes units [U b / G, U (b + 1) / G). A producer warp
//    streams each unit's rows with cp.async.bulk into a ring of shared-memory stages completing
//    on mbarriers (unpadded rows, so a unit is one copy of codes and one of block scales per
//    contiguous half: 2 for the down, 4 for the gate+up's gate and up rows; the distinct
//    expert's tables are read once per expert, not per unit); ten consumer warps decode NVFP4
//    straight into BF16 A fragments
//    (nvfp4_mma::mma_unit: exact code * scale * 2^-26 products) and run mma.sync m16n8k16 with B
//    column n = the n-th route of the expert's current batch of 8 (an expert with more routes
//    loops over batches with the stage held). The K columns are cut into 128-column groups
//    (4 lanes x 32 codes); consumer warp w = team * gw + wg takes the tiles team + s * tw
//    (s < sp) of the unit and the groups wg, wg + gw (gw warps per tile, tw = 10 / gw teams,
//    sp doubled up to 4 while a unit of sp * tw tiles is under 48 KB, ut = tw * sp: plan_gemm;
//    at the real shape 2 gate+up tiles or 8 down tiles, 46 KB, so the consumers' barrier and
//    epilogue of a unit are spread over that many bytes), one
//    independent MMA chain per (tile, group), and keeps its B fragments (x, or h for the down, of
//    the batch's routes) in registers across consecutive units of the same expert.
// 4. moe_grouped_combine_kernel: y[t, d] = the weighted per-route down outputs in slot order.
//
// Summation (fixed and per output element, so bitwise reproducible and column independent: the
// MMA computes D[m][n] from row m of A and column n of B only, and nothing else depends on which
// routes share a batch, a unit or a CTA): per (route, output row), per 128-column group one MMA
// chain from 0 over the group's 8 MMAs (the tensor core's sum of 16 exact products + C per MMA),
// the warp's groups (at most kMaxGroups) added in increasing order, then the gw warps of the tile
// in increasing order in FP32, then * 2^26 and * the global scale (gate+up: SwiGLU and one BF16
// rounding, store_gate_up; down: yd = (sum * 2^26) * gs_down). The combine then sums fmaf(w, yd,
// acc) over the valid slots in order. The order depends on the shape only (K, hence gw), never on
// the tokens. Range: exact products for 2^-90 <= |x| < 2^100 (and 0), as the bulk kernel.
#include "cuda/kernels/moe_grouped.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/launch_check.h"
#include "cuda/common/nvfp4_mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/kernels/moe_nvfp4_bulk.h"

namespace fn {
namespace {

using nvfp4_mma::e4m3_bf16x2_scaled;
using nvfp4_mma::kMmaUnscale;
using nvfp4_mma::mma_unit;
using nvfp4_mma::permute_word;

constexpr int kWarps = 10;                   // consumer warps
constexpr int kThreads = 32 * (kWarps + 1);  // + the producer warp
constexpr int kMaxGroups = 2;                // 128-column groups per consumer warp: K <= 2,560
constexpr int kMaxStages = 8;                // ring depth (fewer where the stages are larger)
constexpr int kMaxSub = 4;                   // tiles per team and unit (sp: plan_gemm)
constexpr int kMinUnitBytes = 49152;         // plan_gemm doubles sp below this unit size
constexpr int kBatch = 8;                    // routes per MMA (the n of m16n8k16)
constexpr int kGroupThreads = 1024;          // the grouping kernel's CTA
constexpr int kCombineThreads = 256;
constexpr int kCombineChunk = 8;                  // slots whose loads the combine issues together
constexpr int64_t kMaxRoutes = int64_t{1} << 24;  // tokens * top_k (INT32 tables, sorted ranks)
// Shared memory besides the ring: the E4M3 table (256 x 4 bytes), the double-buffered partials
// ([2][kMaxSub][kWarps][16 rows][8 routes] FP32) and the 2 x kMaxStages mbarriers.
constexpr size_t kFixedSmem = 256 * 4 + 2 * kMaxSub * kWarps * 16 * kBatch * 4 + 2 * kMaxStages * 8;

// The routing tables in the workspace (256-byte aligned pieces; see workspace_layout).
struct Tables {
  int* n_distinct;  // [1]
  int* dexp;        // [max_distinct] expert id of distinct expert q (ascending)
  int* dstart;      // [max_distinct] its first position in `sorted`
  int* dcount;      // [max_distinct] its routes
  int* sorted;      // [routes] route indices grouped by expert, ascending within an expert
  int* slots;       // [routes] scratch: the routes in atomic order
};

struct GroupArgs {
  const int32_t* ids;
  int routes;
  int num_experts;
  Tables tab;
  uint16_t* h_out;  // optional [routes, inter]: rows of invalid routes zeroed here
  int inter;
};

// One grouped GEMM launch (gate+up or down) of the plan below.
struct MmaArgs {
  const uint8_t* packed;  // [num_experts, rows, k / 2] decode layout
  const uint8_t* scales;  // [num_experts, rows, k / 16] E4M3
  const float* global_scale;
  const int* n_distinct;
  const int* dexp;
  const int* dstart;
  const int* dcount;
  const int* sorted;
  const uint16_t* act;  // B source: gate+up x [tokens, k]; down h [routes, k]
  int act_div;          // the B row of route r: r / act_div (top_k for gate+up, 1 for down)
  int64_t rows;         // rows per expert: 2 * inter or hidden
  int k;                // K: hidden (gate+up) or inter (down)
  int ngroups;          // ceil(k / 128)
  int gw;               // consumer warps per tile (they split the groups)
  int tw;               // teams (kWarps / gw), each sp tiles of the unit
  int sp;               // tiles per team and unit
  int ut;               // tiles per unit: tw * sp
  int tiles;            // tiles per expert: inter / 8 (gate+up) or hidden / 16 (down)
  int upe;              // units per expert: ceil(tiles / ut)
  int row_stride;       // shared-memory bytes per code row (padded: see plan_gemm)
  int stage_bytes;
  int stages;
  int inter;        // gate+up: the up rows' offset and h's row length
  uint16_t* h;      // gate+up: [routes, inter] BF16 (the workspace)
  uint16_t* h_out;  // gate+up, optional: [routes, inter] BF16
  float* yd;        // down: [routes, hidden] FP32 (the workspace)
};

struct CombineArgs {
  const int32_t* ids;
  const float* weights;
  const float* yd;
  float* y;
  int64_t tokens;
  int top_k;
  int64_t hidden;
  int num_experts;
};

__global__ void __launch_bounds__(kGroupThreads) moe_group_routes_kernel(GroupArgs a) {
  extern __shared__ int gsm[];
  int* cnt = gsm;                   // [num_experts] valid routes per expert
  int* fill = gsm + a.num_experts;  // [num_experts] next free slot, then the end of the range
  __shared__ int warp_c[32], warp_d[32];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int E = a.num_experts;
  for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int r = tid; r < a.routes; r += blockDim.x) {
    const int e = a.ids[r];
    if (e >= 0 && e < E) atomicAdd(cnt + e, 1);  // a count: the same whatever the order
  }
  __syncthreads();
  // Exclusive scans of the counts and of "count > 0" over the experts: each thread a run of
  // `per` consecutive experts, then a warp scan and a scan of the warp totals.
  const int per = (E + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int lc = 0, ld = 0;
  for (int e = e0; e < e1; ++e) {
    lc += cnt[e];
    ld += cnt[e] > 0 ? 1 : 0;
  }
  int ic = lc, id = ld;  // inclusive within the warp
  for (int off = 1; off < 32; off <<= 1) {
    const int c = __shfl_up_sync(0xffffffffu, ic, off), d = __shfl_up_sync(0xffffffffu, id, off);
    if (lane >= off) {
      ic += c;
      id += d;
    }
  }
  if (lane == 31) {
    warp_c[warp] = ic;
    warp_d[warp] = id;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = static_cast<int>(blockDim.x) / 32;
    int c = lane < nw ? warp_c[lane] : 0, d = lane < nw ? warp_d[lane] : 0;
    for (int off = 1; off < 32; off <<= 1) {
      const int c2 = __shfl_up_sync(0xffffffffu, c, off);
      const int d2 = __shfl_up_sync(0xffffffffu, d, off);
      if (lane >= off) {
        c += c2;
        d += d2;
      }
    }
    if (lane < nw) {  // exclusive prefix of each warp
      warp_c[lane] = c - warp_c[lane];
      warp_d[lane] = d - warp_d[lane];
    }
    if (lane == nw - 1) *a.tab.n_distinct = d;
  }
  __syncthreads();
  int pos = warp_c[warp] + ic - lc, q = warp_d[warp] + id - ld;
  for (int e = e0; e < e1; ++e) {
    const int n = cnt[e];
    if (n > 0) {
      a.tab.dexp[q] = e;
      a.tab.dstart[q] = pos;
      a.tab.dcount[q] = n;
      ++q;
    }
    fill[e] = pos;
    pos += n;
  }
  __syncthreads();
  for (int r = tid; r < a.routes; r += blockDim.x) {
    const int e = a.ids[r];
    if (e >= 0 && e < E) a.tab.slots[atomicAdd(fill + e, 1)] = r;  // any order ...
  }
  __syncthreads();  // (global writes of the CTA are visible to it after the barrier)
  for (int r = tid; r < a.routes; r += blockDim.x) {
    const int e = a.ids[r];
    if (e < 0 || e >= E) continue;
    // ... then each route's rank among its expert's routes: the number of smaller ones.
    const int n = cnt[e], s0 = fill[e] - n;
    int rank = 0;
    for (int p = s0; p < s0 + n; ++p) rank += a.tab.slots[p] < r ? 1 : 0;
    a.tab.sorted[s0 + rank] = r;
  }
  if (a.h_out != nullptr) {       // invalid routes: h = 0 (the valid ones are the gate+up's)
    const int vec = a.inter / 8;  // 16-byte vectors per row
    for (int64_t v = tid; v < static_cast<int64_t>(a.routes) * vec; v += blockDim.x) {
      const int r = static_cast<int>(v / vec);
      const int e = a.ids[r];
      if (e < 0 || e >= E) reinterpret_cast<uint4*>(a.h_out)[v] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1) moe_grouped_mma_kernel(MmaArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using bulk::bulk_copy;
  using bulk::mbar_arrive;
  using bulk::mbar_arrive_expect_tx;
  using bulk::mbar_wait;
  const int nst = a.stages;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;  // [nst][stage_bytes], 128-byte aligned
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + nst * a.stage_bytes);
  uint64_t* empty = full + nst;
  uint32_t* lut = reinterpret_cast<uint32_t*>(empty + nst);  // [256] E4M3 * 2^100, BF16x2
  float* part = reinterpret_cast<float*>(lut + 256);         // [2][kMaxSub][kWarps][16][kBatch]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kb = a.k / 16;         // scale bytes per row
  const int units_row = a.k / 32;  // 32-code units per row
  const int rs = a.row_stride;
  const int scale_off = a.ut * 16 * rs;  // the stage's scales after its codes
  bulk::init_ring(full, empty, nst, 32 * kWarps);
  if (threadIdx.x < 256) lut[threadIdx.x] = e4m3_bf16x2_scaled(threadIdx.x);
  __syncthreads();
  const int64_t units = static_cast<int64_t>(*a.n_distinct) * a.upe;
  const int64_t u0 = units * blockIdx.x / gridDim.x, u1 = units * (blockIdx.x + 1) / gridDim.x;

  // The unit's first distinct expert and chunk (one 64-bit division per CTA; then stepped).
  const int q0 = static_cast<int>(u0 / a.upe), cu0 = static_cast<int>(u0 - int64_t{q0} * a.upe);
  // Stage layout: the unit's A rows as 16 * ut rows of rs bytes, then their block scales (kb
  // bytes per row) in the same row order. Down: tile tau's rows at 16 tau .. 16 tau + 15 (W_down
  // rows 16 T .. 16 T + 15, contiguous in global memory). Gate+up: the gate rows 8 T .. 8 T + 7
  // of the unit's tiles at 8 tau .., then their up rows at 8 ut + 8 tau .. (each half contiguous
  // in global memory). So a unit is one copy per half of codes and one per half of scales.
  if (warp == kWarps) {  // the producer
    constexpr int kCopies = kGateUp ? 4 : 2;
    int stage = 0;
    uint32_t parity = 0;
    int q = q0, cu = cu0, mq = -1;
    int64_t e = 0;
    for (int64_t u = u0, c = 0; u < u1; ++u, ++c) {
      if (c >= nst) mbar_wait(empty + stage, parity ^ 1u);  // the consumers' previous round
      if (q != mq) {
        e = __ldg(a.dexp + q);
        mq = q;
      }
      const int t0 = cu * a.ut, nt = min(a.ut, a.tiles - t0);
      if (lane == 0)
        mbar_arrive_expect_tx(full + stage, static_cast<uint32_t>(nt * 16 * (a.k / 2 + kb)));
      __syncwarp();
      uint8_t* st = ring + stage * a.stage_bytes;
      if (lane < kCopies) {
        // Lane 0: the codes, lane 1: the scales (of the gate half; down: of all the rows),
        // lanes 2 and 3: the up half's.
        const int half = lane >> 1;
        const int64_t row0 = kGateUp ? (half == 0 ? 8 * t0 : a.inter + 8 * t0) : int64_t{16} * t0;
        const int hrows = kGateUp ? 8 * nt : 16 * nt;  // rows in this copy
        const int srow = half * 8 * a.ut;              // its first row in the stage
        if ((lane & 1) == 0)
          bulk_copy(st + srow * rs, a.packed + (e * a.rows + row0) * (a.k / 2),
                    static_cast<uint32_t>(hrows * (a.k / 2)), full + stage);
        else
          bulk_copy(st + scale_off + srow * kb, a.scales + (e * a.rows + row0) * kb,
                    static_cast<uint32_t>(hrows * kb), full + stage);
      }
      bulk::next_stage(stage, parity, nst);
      if (++cu == a.upe) {
        cu = 0;
        ++q;
      }
    }
  } else {  // a consumer warp
    const int g = lane >> 2, t = lane & 3;
    const int team = warp / a.gw, wg = warp - team * a.gw;
    const int ct = threadIdx.x;  // 0 .. 32 * kWarps - 1
    // B fragments: x (or h) of route g of the batch for this lane's units u = 4 ug + t of the
    // groups ug = wg + r * gw, each 8 elements permuted to (x0, x4) (x1, x5) (x2, x6) (x3, x7).
    uint4 xr[kMaxGroups][4];
    int xq = -1, xb = -1;  // the distinct expert and batch xr holds
    int buf = 0;
    int stage = 0;
    uint32_t parity = 0;
    int q = q0, cu = cu0;
    int e = 0, start = 0, n = 0;  // the distinct expert q's id, first sorted position, routes
    int mq = -1;                  // the q they belong to
    for (int64_t u = u0; u < u1; ++u) {
      if (q != mq) {  // warp-uniform
        e = __ldg(a.dexp + q);
        start = __ldg(a.dstart + q);
        n = __ldg(a.dcount + q);
        mq = q;
      }
      const int t0 = cu * a.ut, nt = min(a.ut, a.tiles - t0);
      mbar_wait(full + stage, parity);
      const uint8_t* st = ring + stage * a.stage_bytes;
      // Bank conflicts: a 128-bit load is served per quarter warp, lanes (g, t) with g = 2p,
      // 2p + 1 and t = 0..3: rows g and g + 1 each read 64 contiguous bytes at the same column
      // offset, the row stride is K / 2 bytes (unpadded, so that a unit is a few large copies):
      // conflict free where that is 64 modulo 128 (the down of K = 640), else at most two-way
      // (a few loads per warp and unit next to its MMAs).
      for (int b0 = 0; b0 < n; b0 += kBatch) {
        if (q != xq || b0 != xb) {  // warp-uniform
          const int slot = b0 + g;
          const bool live = slot < n;
          const int route = live ? __ldg(a.sorted + start + slot) : 0;
          const uint16_t* src = a.act + static_cast<int64_t>(route / a.act_div) * a.k;
#pragma unroll
          for (int r = 0; r < kMaxGroups; ++r) {
            const int ug = wg + r * a.gw, un = 4 * ug + t;
            const bool ok = live && ug < a.ngroups && un < units_row;
#pragma unroll
            for (int wi = 0; wi < 4; ++wi) {
              uint4 v = make_uint4(0u, 0u, 0u, 0u);
              if (ok) v = __ldg(reinterpret_cast<const uint4*>(src + 32 * un + 8 * wi));
              xr[r][wi] = permute_word(v);
            }
          }
          xq = q;
          xb = b0;
        }
        // The team's tiles tau = s * tw + team (s < sp), one MMA chain per (tile, column group):
        // independent chains, issued without branches between the tiles (a tile past the
        // expert's last, tau >= nt, reads zeros and its partials are never read).
        float d[kMaxSub][kMaxGroups][4] = {};
#pragma unroll
        for (int r = 0; r < kMaxGroups; ++r) {
          const int ug = wg + r * a.gw;
          if (ug >= a.ngroups) break;  // warp-uniform
          const int un = 4 * ug + t;
#pragma unroll
          for (int s = 0; s < kMaxSub; ++s) {
            if (s >= a.sp) break;  // uniform
            const int tau = s * a.tw + team;
            // A rows g and g + 8 of tile tau in the stage (the layout above the producer).
            const int arow = kGateUp ? tau * 8 + g : tau * 16 + g;
            const int brow = arow + (kGateUp ? 8 * a.ut : 8);
            // Zeros past the tile's end and in a partial last group (K % 128 == 64 .. 96).
            const bool ok = tau < nt && un < units_row;
            uint4 wa = make_uint4(0u, 0u, 0u, 0u), wb = make_uint4(0u, 0u, 0u, 0u);
            uint32_t sca = 0, scb = 0;
            if (ok) {
              wa = *reinterpret_cast<const uint4*>(st + arow * rs + 16 * un);
              wb = *reinterpret_cast<const uint4*>(st + brow * rs + 16 * un);
              sca = *reinterpret_cast<const uint16_t*>(st + scale_off + arow * kb + 2 * un);
              scb = *reinterpret_cast<const uint16_t*>(st + scale_off + brow * kb + 2 * un);
            }
            mma_unit(wa, sca, wb, scb, xr[r], lut, d[s][r]);
          }
        }
        if (b0 + kBatch >= n) mbar_arrive(empty + stage);  // after the last read of the stage
#pragma unroll
        for (int s = 0; s < kMaxSub; ++s) {
          if (s >= a.sp) break;
          float v[4] = {d[s][0][0], d[s][0][1], d[s][0][2], d[s][0][3]};
#pragma unroll
          for (int r = 1; r < kMaxGroups; ++r) {  // the warp's groups in order
            if (wg + r * a.gw >= a.ngroups) break;
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] += d[s][r][i];
          }
          // D fragment of lane (g, t): rows g (v0, v1) and g + 8 (v2, v3), columns 2t, 2t + 1;
          // [s][warp] = [tau * gw + wg] (kWarps = tw * gw), so tile tau's gw partials adjoin.
          float* pw = part + ((buf * kMaxSub + s) * kWarps + warp) * 16 * kBatch;
          *reinterpret_cast<float2*>(pw + g * kBatch + 2 * t) = make_float2(v[0], v[1]);
          *reinterpret_cast<float2*>(pw + (g + 8) * kBatch + 2 * t) = make_float2(v[2], v[3]);
        }
        // The consumer warps only (the producer may be waiting on a stage): barrier 1.
        asm volatile("bar.sync 1, %0;" ::"r"(32 * kWarps) : "memory");
        const float* pb = part + buf * kMaxSub * kWarps * 16 * kBatch;
        const int nb = min(kBatch, n - b0);
        if constexpr (kGateUp) {
          // One thread per (tile, route, row pair): the gw warps' partials in order, SwiGLU.
          for (int idx = ct; idx < a.ut * 8 * kBatch; idx += 32 * kWarps) {
            const int tau = idx / (8 * kBatch), col = (idx / 8) % kBatch, i8 = idx % 8;
            if (tau >= nt || col >= nb) continue;
            const float* p0 = pb + tau * a.gw * 16 * kBatch;
            float sg = p0[i8 * kBatch + col], su = p0[(8 + i8) * kBatch + col];
            for (int w = 1; w < a.gw; ++w) {
              sg += p0[(w * 16 + i8) * kBatch + col];
              su += p0[(w * 16 + 8 + i8) * kBatch + col];
            }
            const int route = __ldg(a.sorted + start + b0 + col);
            const int i = 8 * (t0 + tau) + i8;
            nvfp4_mma::store_gate_up(sg, su, e, true, a.global_scale, route, i, a.inter, a.h,
                                     nullptr);
            if (a.h_out != nullptr) {
              const int64_t at = static_cast<int64_t>(route) * a.inter + i;
              a.h_out[at] = a.h[at];
            }
          }
        } else {
          // One thread per (route, tile, row), rows fastest (consecutive yd addresses).
          const float gs = __ldg(a.global_scale + e);
          for (int idx = ct; idx < kBatch * a.ut * 16; idx += 32 * kWarps) {
            const int col = idx / (a.ut * 16), tau = (idx / 16) % a.ut, row = idx % 16;
            if (tau >= nt || col >= nb) continue;
            const float* p0 = pb + tau * a.gw * 16 * kBatch;
            float s = p0[row * kBatch + col];
            for (int w = 1; w < a.gw; ++w) s += p0[(w * 16 + row) * kBatch + col];
            const int route = __ldg(a.sorted + start + b0 + col);
            a.yd[static_cast<int64_t>(route) * a.rows + 16 * (t0 + tau) + row] =
                (s * kMmaUnscale) * gs;
          }
        }
        buf ^= 1;
      }
      bulk::next_stage(stage, parity, nst);
      if (++cu == a.upe) {
        cu = 0;
        ++q;
      }
    }
  }
#else
  (void)a;  // never launched below sm_90 (launch_moe_grouped refuses)
#endif
}

__global__ void __launch_bounds__(kCombineThreads) moe_grouped_combine_kernel(CombineArgs a) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.tokens * a.hidden) return;
  const int64_t t = idx / a.hidden, d = idx - t * a.hidden;
  float acc = 0.0f;
  // Slot order; the loads of a chunk of kCombineChunk slots first (two dependent rounds per
  // chunk instead of one per slot), then their products added in order.
  for (int j0 = 0; j0 < a.top_k; j0 += kCombineChunk) {
    int e[kCombineChunk];
    float w[kCombineChunk], v[kCombineChunk];
#pragma unroll
    for (int i = 0; i < kCombineChunk; ++i)
      e[i] = j0 + i < a.top_k ? __ldg(a.ids + t * a.top_k + j0 + i) : -1;
#pragma unroll
    for (int i = 0; i < kCombineChunk; ++i) {
      const int64_t r = t * a.top_k + j0 + i;
      const bool ok = e[i] >= 0 && e[i] < a.num_experts;
      w[i] = ok ? __ldg(a.weights + r) : 0.0f;
      v[i] = ok ? a.yd[r * a.hidden + d] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kCombineChunk; ++i)
      if (e[i] >= 0 && e[i] < a.num_experts) acc = fmaf(w[i], v[i], acc);
  }
  a.y[idx] = acc;
}

// The shape of one grouped GEMM: K = k, tiles per expert.
struct GemmPlan {
  int ngroups, gw, tw, sp, ut, tiles, upe, row_stride, stage_bytes, stages;
  size_t smem;
};

int64_t round_up(int64_t v, int64_t m) {
  return (v + m - 1) / m * m;
}

GemmPlan plan_gemm(int64_t k, int64_t tiles) {
  GemmPlan p{};
  p.ngroups = static_cast<int>((k + 127) / 128);
  // gw: the largest divisor of kWarps not above the groups (each warp then takes at most two
  // groups for K <= 2,560); the tw = kWarps / gw teams take sp tiles of the unit each.
  p.gw = 1;
  for (int d : {10, 5, 2, 1})
    if (d <= p.ngroups && kWarps % d == 0) {
      p.gw = d;
      break;
    }
  p.tw = kWarps / p.gw;
  p.tiles = static_cast<int>(tiles);
  // Unpadded rows (K / 2 bytes, a multiple of 16 as the bulk copies need), so that each half of
  // a unit's rows is one copy (the kernel's comment; the bank conflicts there).
  p.row_stride = static_cast<int>(k / 2);
  const int64_t tile_bytes = 16 * (p.row_stride + k / 16);
  // sp: more tiles per team where the units would be small (the down of a small K), so the
  // per-unit fixed costs (barriers, epilogue) are spread over more bytes.
  p.sp = 1;
  while (p.sp < kMaxSub && p.sp * p.tw * tile_bytes < kMinUnitBytes) p.sp *= 2;
  p.ut = p.tw * p.sp;
  p.upe = static_cast<int>((tiles + p.ut - 1) / p.ut);
  p.stage_bytes = static_cast<int>(round_up(p.ut * tile_bytes, 128));
  p.stages = static_cast<int>(std::min<int64_t>(
      kMaxStages,
      (static_cast<int64_t>(detail::kMaxCtaSmem) - int64_t{kFixedSmem}) / p.stage_bytes));
  p.smem = static_cast<size_t>(p.stages) * p.stage_bytes + kFixedSmem;
  return p;
}

bool shape_ok(int64_t hidden, int64_t inter, int top_k) {
  if (top_k < 1 || hidden < 256 || hidden > 2560 || hidden % 256 != 0) return false;
  if (inter < 32 || inter > 2560 || inter % 32 != 0) return false;
  const GemmPlan gu = plan_gemm(hidden, inter / 8), dn = plan_gemm(inter, hidden / 16);
  for (const GemmPlan& p : {gu, dn})
    if ((p.ngroups + p.gw - 1) / p.gw > kMaxGroups || p.stages < 2) return false;
  return true;
}

struct Layout {
  size_t n_distinct, dexp, dstart, dcount, sorted, slots, h, yd, total;
};

Layout workspace_layout(int num_experts, int64_t routes, int64_t inter, int64_t hidden) {
  const int64_t nd = std::min<int64_t>(num_experts, routes);
  Layout l{};
  size_t off = 0;
  const auto take = [&](size_t bytes) {
    const size_t at = off;
    off += static_cast<size_t>(round_up(static_cast<int64_t>(std::max<size_t>(bytes, 1)), 256));
    return at;
  };
  l.n_distinct = take(sizeof(int));
  l.dexp = take(nd * sizeof(int));
  l.dstart = take(nd * sizeof(int));
  l.dcount = take(nd * sizeof(int));
  l.sorted = take(routes * sizeof(int));
  l.slots = take(routes * sizeof(int));
  l.h = take(routes * inter * 2);
  l.yd = take(routes * hidden * 4);
  l.total = off;
  return l;
}

}  // namespace

size_t moe_grouped_workspace_bytes(const MoeGroupedParams& p) {
  constexpr const char* kOp = "moe_grouped_workspace_bytes";
  FN_LAUNCH_REQUIRE(p.tokens >= 0 && p.top_k >= 1, kOp);
  FN_LAUNCH_REQUIRE(p.tokens <= kMaxRoutes && p.tokens * p.top_k <= kMaxRoutes, kOp);
  FN_LAUNCH_REQUIRE(p.gate_up.num_experts >= 0 && p.down.cols >= 0 && p.down.rows >= 0, kOp);
  return workspace_layout(p.gate_up.num_experts, p.tokens * p.top_k, p.down.cols, p.down.rows)
      .total;
}

bool moe_grouped_supported(int64_t hidden, int64_t inter, int top_k) {
  return shape_ok(hidden, inter, top_k) && detail::current_device_has_pdl();
}

void launch_moe_grouped(const MoeGroupedParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_grouped";
  FN_LAUNCH_REQUIRE(p.tokens >= 0 && p.top_k >= 1, kOp);
  if (p.tokens == 0) return;
  const Nvfp4Experts& gu = p.gate_up;
  const Nvfp4Experts& dn = p.down;
  FN_LAUNCH_REQUIRE(p.ids != nullptr && p.weights != nullptr && p.x != nullptr && p.y != nullptr &&
                        p.workspace != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(gu.packed != nullptr && gu.scales != nullptr && gu.global_scale != nullptr &&
                        dn.packed != nullptr && dn.scales != nullptr && dn.global_scale != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(gu.num_experts >= 1 && gu.num_experts <= kMoeGroupedMaxExperts &&
                        dn.num_experts == gu.num_experts,
                    kOp);
  const int64_t hidden = gu.cols, inter = dn.cols;
  FN_LAUNCH_REQUIRE(gu.rows == 2 * inter && dn.rows == hidden, kOp);
  FN_LAUNCH_REQUIRE(shape_ok(hidden, inter, p.top_k), kOp);
  FN_LAUNCH_REQUIRE(detail::current_device_has_pdl(), kOp);  // sm_90+ device and device code
  FN_LAUNCH_REQUIRE(p.tokens <= kMaxRoutes && p.tokens * p.top_k <= kMaxRoutes, kOp);
  const int64_t routes = p.tokens * p.top_k;
  FN_LAUNCH_REQUIRE(detail::aligned(gu.packed, 16) && detail::aligned(gu.scales, 16) &&
                        detail::aligned(dn.packed, 16) && detail::aligned(dn.scales, 16) &&
                        detail::aligned(p.x, 16) && detail::aligned(p.workspace, 256) &&
                        detail::aligned(p.h_out, 16),
                    kOp);

  const Layout l = workspace_layout(gu.num_experts, routes, inter, hidden);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  Tables tab{};
  tab.n_distinct = reinterpret_cast<int*>(ws + l.n_distinct);
  tab.dexp = reinterpret_cast<int*>(ws + l.dexp);
  tab.dstart = reinterpret_cast<int*>(ws + l.dstart);
  tab.dcount = reinterpret_cast<int*>(ws + l.dcount);
  tab.sorted = reinterpret_cast<int*>(ws + l.sorted);
  tab.slots = reinterpret_cast<int*>(ws + l.slots);
  uint16_t* h = reinterpret_cast<uint16_t*>(ws + l.h);
  float* yd = reinterpret_cast<float*>(ws + l.yd);

  GroupArgs ga{};
  ga.ids = p.ids;
  ga.routes = static_cast<int>(routes);
  ga.num_experts = gu.num_experts;
  ga.tab = tab;
  ga.h_out = p.h_out;
  ga.inter = static_cast<int>(inter);
  moe_group_routes_kernel<<<1, kGroupThreads, 2 * sizeof(int) * gu.num_experts, stream>>>(ga);
  FN_CUDA_LAUNCH_CHECK("moe_group_routes_kernel");

  const int sms = detail::current_sm_count();
  const int64_t max_distinct = std::min<int64_t>(gu.num_experts, routes);
  const auto launch_gemm = [&](auto kernel, const Nvfp4Experts& w, const GemmPlan& plan,
                               const uint16_t* act, int act_div) {
    MmaArgs a{};
    a.packed = w.packed;
    a.scales = w.scales;
    a.global_scale = w.global_scale;
    a.n_distinct = tab.n_distinct;
    a.dexp = tab.dexp;
    a.dstart = tab.dstart;
    a.dcount = tab.dcount;
    a.sorted = tab.sorted;
    a.act = act;
    a.act_div = act_div;
    a.rows = w.rows;
    a.k = static_cast<int>(w.cols);
    a.ngroups = plan.ngroups;
    a.gw = plan.gw;
    a.tw = plan.tw;
    a.sp = plan.sp;
    a.ut = plan.ut;
    a.tiles = plan.tiles;
    a.upe = plan.upe;
    a.row_stride = plan.row_stride;
    a.stage_bytes = plan.stage_bytes;
    a.stages = plan.stages;
    a.inter = static_cast<int>(inter);
    a.h = h;
    a.h_out = p.h_out;
    a.yd = yd;
    const int64_t max_units = max_distinct * plan.upe;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(sms, max_units));
    FN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(plan.smem)));
    kernel<<<grid, kThreads, plan.smem, stream>>>(a);
  };
  launch_gemm(moe_grouped_mma_kernel<true>, gu, plan_gemm(hidden, inter / 8), p.x, p.top_k);
  FN_CUDA_LAUNCH_CHECK("moe_grouped_mma_kernel<true>");
  launch_gemm(moe_grouped_mma_kernel<false>, dn, plan_gemm(inter, hidden / 16), h, 1);
  FN_CUDA_LAUNCH_CHECK("moe_grouped_mma_kernel<false>");

  CombineArgs ca{};
  ca.ids = p.ids;
  ca.weights = p.weights;
  ca.yd = yd;
  ca.y = p.y;
  ca.tokens = p.tokens;
  ca.top_k = p.top_k;
  ca.hidden = hidden;
  ca.num_experts = gu.num_experts;
  const int64_t elems = p.tokens * hidden;
  moe_grouped_combine_kernel<<<static_cast<unsigned>((elems + kCombineThreads - 1) /
                                                     kCombineThreads),
                               kCombineThreads, 0, stream>>>(ca);
  FN_CUDA_LAUNCH_CHECK("moe_grouped_combine_kernel");
}

}  // namespace fn

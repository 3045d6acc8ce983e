// HC down (split-K GEMV over H * (1 + w) with partial sums of squares) and HC mix kernels
// (see hc.h).
#include "cuda/kernels/hc.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/real_shape.h"

namespace fn {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kStreams = 4;     // hc_count of the model (docs/model.md §A.2); one accumulator each
constexpr int kMixPre = 3;      // W_up vectors per row and lane loaded before the PDL wait
constexpr int kMaxRank = 8192;  // u = silu(t / 4) lives in shared memory (32 KB at most)
// Staged kernels (weights in shared memory): blocks per SM the register budget must allow.
constexpr int kStagedMinBlocks = 4;
// The several-token down pass: 2 blocks per SM (128 registers), room for the next token's H in
// registers while the current token's dots run.
constexpr int kDownMultiMinBlocks = 2;
// Shared memory the staged mix may use without the opt-in attribute (W_up rows + u).
constexpr std::size_t kMixStageMaxBytes = 48 * 1024;

// Partial dots per t value the mix sums (4 groups x at most 2 chunks: hidden <= 2560); all of a
// thread's loads are in flight at once, so this bounds its registers.
constexpr int kMaxSplits = 8;

// Tokens per launch (HcDownParams::tokens, HcMixParams::tokens). Neither registers nor shared
// memory depend on the count (the blocks loop over the tokens); the bound only keeps one launch
// from running for milliseconds by mistake (the batched step passes at most 64).
constexpr int kMaxTokens = 4096;

// The tokens [b0, b1) of a block of a several-token launch: copy `copy` of the grid (its z for the
// down pass, its y for the mix) takes tpb of them. The one-token instance (the decode step's)
// takes token 0 only, so its code does not change with the copies.
template <bool kMulti>
__device__ __forceinline__ void block_tokens(unsigned copy, int tokens, int tpb, int& b0, int& b1) {
  b0 = kMulti ? static_cast<int>(copy) * tpb : 0;
  b1 = kMulti ? min(tokens, b0 + tpb) : 1;
}

// Tokens per block of a launch (HcDownParams::tokens_per_block: 0 means all of them), and the grid
// copies that cover the tokens with it.
int launch_tokens_per_block(int tokens, int per_block) {
  return per_block == 0 ? tokens : std::min(tokens, per_block);
}
unsigned grid_copies(int tokens, int tpb) {
  return static_cast<unsigned>((tokens + tpb - 1) / tpb);
}

// The real read's shape (docs/model.md §A.2: hc_lowrank 320, hidden 2560; the down pass's 2 chunks
// per group; 32-lane teams, as mix_team plans them on a 132-SM H200).
constexpr int kFixedRank = real_shape::kHcRank;
constexpr int kFixedHidden = real_shape::kHidden;
constexpr int kFixedTeamLog2 = 5;
constexpr int kFixedSplits = 8;

// HC down tiling: a warp owns kDownRows rows and the block's chunk of kDownChunkVec 16-byte
// vectors inside one group (lane l: vectors l, l + 32, ..., l + 128); at the real shape 8 chunks
// x 21 row blocks hold the whole matrix.
constexpr int kDownRows = 2;
constexpr int kDownVecPerLane = 5;
constexpr int kDownChunkVec = 32 * kDownVecPerLane;                  // 1280 columns
constexpr int kDownRowsPerBlock = (kBlockThreads / 32) * kDownRows;  // 16

struct DownArgs {
  const float* H;
  const uint16_t* norm;
  const uint16_t* w;
  int64_t rows;
  int64_t width;  // hc_count * hidden
  int64_t hidden;
  int gvec;  // hidden / 8: vectors per group
  int cpg;   // chunks per group
  float* tp;
  float* sumsq;
  const float* iota;  // inject (nullptr: none): H' = H + iota[g] * y, written to H_out
  const float* y;
  float* H_out;
  int hc;             // hc_count
  int tokens;         // >= 1 (HcDownParams::tokens)
  int64_t tp_stride;  // floats of t_partial per token: splits * rows
  int64_t sq_stride;  // floats of sumsq per token: splits
  int tpb;            // tokens per block: block z takes tokens [z * tpb, min(tokens, +tpb))
};

// The down pass's sizes: the launch's DownArgs in the runtime-shape instance (kHidden = 0);
// compile-time constants in the real read's instance (D = kHidden, 4 groups), so that the
// chunk bounds fold (2560 columns are exactly 2 chunks per group) and the row addresses are
// constant offsets. The same operations in the same order either way: the same bits.
struct DownDims {
  int64_t hidden;
  int64_t width;  // hc_count * hidden
  int gvec;       // hidden / 8
  int cpg;        // chunks per group
  bool whole;     // the groups are whole chunks (known at compile time only; false: check)
  int hc;         // hc_count
};

template <int kHidden>
__device__ __forceinline__ DownDims down_dims(const DownArgs& a) {
  static_assert(kHidden % 8 == 0);
  if constexpr (kHidden > 0)
    return {kHidden,
            int64_t{kStreams} * kHidden,
            kHidden / 8,
            (kHidden / 8 + kDownChunkVec - 1) / kDownChunkVec,
            kHidden / 8 % kDownChunkVec == 0,
            kStreams};
  else
    return {a.hidden, a.width, a.gvec, a.cpg, false, a.hc};
}

// Token b's operands (the layout of HcDownParams::tokens): the same DownArgs at fixed strides.
__device__ __forceinline__ DownArgs down_token(const DownArgs& a, const DownDims& d, int b) {
  DownArgs t = a;
  t.H = a.H + b * d.width;
  t.tp = a.tp + b * a.tp_stride;
  t.sumsq = a.sumsq + b * a.sq_stride;
  if (a.y != nullptr) {
    t.iota = a.iota + b * d.hc;
    t.y = a.y + b * d.hidden;
    t.H_out = a.H_out + b * d.width;
  }
  return t;
}

// Whether vector vl (< kDownChunkVec) of the chunk that starts at vector vbeg of its group lies
// inside the group: always when the groups are whole chunks (the fixed instance at D = 2560).
__device__ __forceinline__ bool down_in_group(const DownDims& d, int vbeg, int vl) {
  return d.whole || vbeg + vl < d.gvec;
}

// v[0..1] += the rows' dots with x = H * (1 + w) over one 16-byte vector of 8 columns
// (docs/model.md §C.2's N without its group scale; (1 + w) never rounded to BF16); v[2] += the
// vector's sum of H^2. Ascending columns per lane.
__device__ __forceinline__ void down_step(float (&v)[kDownRows + 1], const float4 (&hx)[2],
                                          uint4 nw, const uint4 (&w)[kDownRows]) {
  const float h[8] = {hx[0].x, hx[0].y, hx[0].z, hx[0].w, hx[1].x, hx[1].y, hx[1].z, hx[1].w};
  const uint32_t q[4] = {nw.x, nw.y, nw.z, nw.w};
  float xf[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    xf[2 * k] = h[2 * k] * (1.0f + dev::bf16_lo(q[k]));
    xf[2 * k + 1] = h[2 * k + 1] * (1.0f + dev::bf16_hi(q[k]));
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[kDownRows] = fmaf(h[k], h[k], v[kDownRows]);
#pragma unroll
  for (int r = 0; r < kDownRows; ++r) v[r] = dev::fma8_bf16(w[r], xf, v[r]);
}

// The warp's butterfly over its 32 lanes, then lane 0 stores the rows' partial dots (and the
// chunk's partial square from the block's first warp of the first row block).
__device__ __forceinline__ void down_finish(const DownArgs& a, float (&v)[kDownRows + 1], int p,
                                            int64_t row0, int warp, int lane) {
  dev::team_reduce<kDownRows + 1, kBlockThreads>(v, 32, lane);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < kDownRows; ++r)
    if (row0 + r < a.rows) a.tp[static_cast<int64_t>(p) * a.rows + row0 + r] = v[r];
  if (blockIdx.y == 0 && warp == 0) a.sumsq[p] = v[kDownRows];
}

// x + iota * y per component (dev::hc_inject_value: the bits of hc_inject_kernel).
__device__ __forceinline__ float4 inject4(float4 h, float iota, float4 y) {
  return make_float4(dev::hc_inject_value(h.x, iota, y.x), dev::hc_inject_value(h.y, iota, y.y),
                     dev::hc_inject_value(h.z, iota, y.z), dev::hc_inject_value(h.w, iota, y.w));
}

// H at the lane's kDownVecPerLane vectors of the chunk (zeros past the group): the only load of
// the down pass after the PDL wait, all in flight at once. With the inject folded in (a.y), H' =
// H + iota[g] * y instead, and the first row block writes H' to H_out.
__device__ __forceinline__ void down_load_h(const DownArgs& a, const DownDims& d, int64_t col0,
                                            int vbeg, int lane, float4 (&hx)[kDownVecPerLane][2]) {
#pragma unroll
  for (int u = 0; u < kDownVecPerLane; ++u) {
    const int vl = lane + 32 * u;
    const float4* hp = reinterpret_cast<const float4*>(a.H + col0 + 8 * static_cast<int64_t>(vl));
    const bool ok = down_in_group(d, vbeg, vl);
    hx[u][0] = ok ? __ldg(hp) : make_float4(0, 0, 0, 0);
    hx[u][1] = ok ? __ldg(hp + 1) : make_float4(0, 0, 0, 0);
  }
  if (a.y == nullptr) return;
  const int g = static_cast<int>(col0 / d.hidden);
  const int64_t i0 = col0 - g * d.hidden;  // column of the chunk's first vector within the group
  const float iota = __ldg(a.iota + g);
#pragma unroll
  for (int u = 0; u < kDownVecPerLane; ++u) {
    const int vl = lane + 32 * u;
    if (!down_in_group(d, vbeg, vl)) continue;
    const float4* yp = reinterpret_cast<const float4*>(a.y + i0 + 8 * static_cast<int64_t>(vl));
    hx[u][0] = inject4(hx[u][0], iota, __ldg(yp));
    hx[u][1] = inject4(hx[u][1], iota, __ldg(yp + 1));
    if (blockIdx.y == 0) {
      float4* op = reinterpret_cast<float4*>(a.H_out + col0 + 8 * static_cast<int64_t>(vl));
      op[0] = hx[u][0];
      op[1] = hx[u][1];
    }
  }
}

// Shared-memory staging of the down pass: the block's 16 rows x kDownChunkVec vectors of W, then
// the chunk's kDownChunkVec vectors of the norm weight (43,520 bytes).
constexpr int kDownStageVec = kDownRowsPerBlock * kDownChunkVec;
constexpr std::size_t kDownStageBytes = (kDownStageVec + kDownChunkVec) * sizeof(uint4);

// Block (chunk p, row block): rows [16 * blockIdx.y, +16) x the chunk's vectors. Chunk p is
// chunk p % cpg of group p / cpg; it never crosses a group, so its dot needs no norm scale. The
// weights (W and the norm weight: no kernel writes them) go to shared memory with cp.async before
// the PDL wait, so the whole matrix is in flight while the previous kernel finishes
// (cuda/common/pdl.cuh); ~64 registers, so up to 4 blocks fit an SM and the whole grid (and the
// mix launched behind it) is resident while the previous kernel drains.
//
// kMulti (a.tokens > 1): the staged tile serves every token in order, each token's H loaded while
// the token before it computes. kMulti false is the one-token instance (the decode step's): the
// loop runs once and no register holds a second token's H. The same operations per token either
// way: the same bits.
template <int kHidden = 0, bool kMulti = false>
__global__ void __launch_bounds__(kBlockThreads, kMulti ? kDownMultiMinBlocks : kStagedMinBlocks)
    hc_down_staged_kernel(DownArgs a) {
  extern __shared__ uint4 stage4[];  // [kDownRowsPerBlock][kDownChunkVec] W, [kDownChunkVec] w
  uint4* nw_s = stage4 + kDownStageVec;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const DownDims d = down_dims<kHidden>(a);
  const int p = static_cast<int>(blockIdx.x);
  const int g = p / d.cpg;
  const int vbeg = (p - g * d.cpg) * kDownChunkVec;
  const int64_t col0 = g * d.hidden + 8 * static_cast<int64_t>(vbeg);
  const int64_t rowb = static_cast<int64_t>(blockIdx.y) * kDownRowsPerBlock;
  // Weights only before the wait (cuda/common/pdl.cuh); zeros where the chunk or the rows end.
  static_assert(kDownStageVec % kBlockThreads == 0 && kDownChunkVec <= kBlockThreads);
#pragma unroll 5
  for (int rd = 0; rd < kDownStageVec / kBlockThreads; ++rd) {
    const int q = static_cast<int>(threadIdx.x) + rd * kBlockThreads;
    const int rr = q / kDownChunkVec, vl = q - rr * kDownChunkVec;
    if (down_in_group(d, vbeg, vl) && rowb + rr < a.rows)
      dev::cp_async16(stage4 + q, a.w + (rowb + rr) * d.width + col0 + 8 * vl);
    else
      stage4[q] = make_uint4(0, 0, 0, 0);
  }
  if (const int vl = static_cast<int>(threadIdx.x); vl < kDownChunkVec) {
    if (down_in_group(d, vbeg, vl))
      dev::cp_async16(nw_s + vl, a.norm + col0 + 8 * vl);
    else
      nw_s[vl] = make_uint4(0, 0, 0, 0);
  }
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  int b0, b1;
  block_tokens<kMulti>(blockIdx.z, a.tokens, a.tpb, b0, b1);
  float4 hx[kDownVecPerLane][2];
  down_load_h(down_token(a, d, b0), d, col0, vbeg, lane, hx);
  dev::cp_async_wait_all();
  __syncthreads();
  // The staged tile serves every token (shared memory is only read from here on): per token the
  // same operations in the same order as a one-token launch, so each token's outputs have its
  // bits.
  float4 hn[kDownVecPerLane][2];  // token b + 1's H (kMulti), loaded before token b's dots
  for (int b = b0; b < b1; ++b) {
    if (b > b0) {
#pragma unroll
      for (int u = 0; u < kDownVecPerLane; ++u) {
        hx[u][0] = hn[u][0];
        hx[u][1] = hn[u][1];
      }
    }
    if (kMulti && b + 1 < b1) down_load_h(down_token(a, d, b + 1), d, col0, vbeg, lane, hn);
    float v[kDownRows + 1] = {0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int u = 0; u < kDownVecPerLane; ++u) {
      const int vl = lane + 32 * u;
      if (!down_in_group(d, vbeg, vl)) continue;
      uint4 w[kDownRows];
#pragma unroll
      for (int r = 0; r < kDownRows; ++r)
        w[r] = stage4[(warp * kDownRows + r) * kDownChunkVec + vl];
      down_step(v, hx[u], nw_s[vl], w);
    }
    down_finish(down_token(a, d, b), v, p, rowb + warp * kDownRows, warp, lane);
  }
}

struct MixArgs {
  const uint16_t* w_up;
  const float* t;
  const float* sumsq;
  int64_t t_stride;
  const float* H;
  const uint16_t* norm;
  float eps;
  float* m;
  uint16_t* m_bf16;
  float* iota;
  int64_t hidden;
  int rank;
  int nvec;  // rank / 8
  int team_log2;
  int splits;
  int cpg;  // splits / 4: chunks per group
  uint16_t* m_lo;
  int tokens;        // >= 1 (HcMixParams::tokens)
  int64_t t_tokens;  // floats of t per token: splits * t_stride
  int tpb;           // tokens per block: block y takes tokens [y * tpb, min(tokens, +tpb))
};

constexpr float kInvStreams = 1.0f / kStreams;  // 0.25: exact

// The mix's sizes. The launch's MixArgs in the runtime-shape instances (template arguments 0);
// compile-time constants in the real read's instance (every argument > 0), so that its loops
// have fixed trip counts, its predicates fold and its addresses are constant offsets. The same
// operations in the same order either way: the same bits.
struct MixDims {
  int rank;
  int nvec;  // rank / 8
  int team_log2;
  int splits;
  int cpg;  // splits / 4
  int64_t hidden;
};

template <int kRank, int kHidden, int kTeamLog2, int kSplits>
__device__ __forceinline__ MixDims mix_dims(const MixArgs& a) {
  static_assert(kRank % 8 == 0 && kSplits % kStreams == 0 && kSplits <= kMaxSplits);
  return {kRank > 0 ? kRank : a.rank,
          kRank > 0 ? kRank / 8 : a.nvec,
          kTeamLog2 > 0 ? kTeamLog2 : a.team_log2,
          kSplits > 0 ? kSplits : a.splits,
          kSplits > 0 ? kSplits / kStreams : a.cpg,
          kHidden > 0 ? kHidden : a.hidden};
}

// Token b's operands (the layout of HcMixParams::tokens): the same MixArgs at fixed strides.
__device__ __forceinline__ MixArgs mix_token(const MixArgs& a, const MixDims& d, int b) {
  MixArgs t = a;
  t.t = a.t + b * a.t_tokens;
  t.sumsq = a.sumsq + b * d.splits;
  t.H = a.H + b * (kStreams * d.hidden);
  t.m = a.m + b * d.hidden;
  if (a.m_bf16 != nullptr) t.m_bf16 = a.m_bf16 + b * d.hidden;
  if (a.m_lo != nullptr) t.m_lo = a.m_lo + b * d.hidden;
  if (a.iota != nullptr) t.iota = a.iota + b * kStreams;
  return t;
}

// acc[s] += W_up[row i + s*D, vector v] . u[vector v] for the 4 streams (FP32 fmaf chain in
// ascending column order).
__device__ __forceinline__ void mix_accumulate(float (&acc)[kStreams], const uint4 (&w)[kStreams],
                                               const float4* u_s4, int v) {
  const float4 t0 = u_s4[2 * v], t1 = u_s4[2 * v + 1];
  const float u[8] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z, t1.w};
#pragma unroll
  for (int s = 0; s < kStreams; ++s) {
    const uint32_t q[4] = {w[s].x, w[s].y, w[s].z, w[s].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      acc[s] = fmaf(dev::bf16_lo(q[k]), u[2 * k], acc[s]);
      acc[s] = fmaf(dev::bf16_hi(q[k]), u[2 * k + 1], acc[s]);
    }
  }
}

// The stream a lane of a team finishes in mix_finish: lane s < 4 stream s (teams have >= 8
// lanes; lanes 4.. repeat streams 0-3 and their results are not used).
__device__ __forceinline__ int mix_lane_stream(int lane) {
  return lane & (kStreams - 1);
}

// The mix's work right after the PDL wait (no barrier inside): every load of the thread at once
// (H of its stream at output ic, the partial squares, its first two t values' partials) before
// any math that depends on them; the group scales into scale[]; u = silu(t / 4) into u_s (and
// iota from block 0). The caller syncs the block before reading u_s.
__device__ __forceinline__ void mix_after_wait(const MixArgs& a, const MixDims& d, int64_t ic,
                                               int lane, float* u_s, float& hv,
                                               float (&scale)[kStreams]) {
  hv = __ldg(a.H + ic + mix_lane_stream(lane) * d.hidden);
  float sq[kMaxSplits];
#pragma unroll
  for (int p = 0; p < kMaxSplits; ++p) sq[p] = p < d.splits ? __ldg(a.sumsq + p) : 0.0f;
  const int nt = d.rank + (a.iota != nullptr ? kStreams : 0);  // t values this kernel needs
  float v0[kMaxSplits], v1[kMaxSplits];
  // In the first round j = threadIdx.x < 256 <= nt when rank >= 256 (a constant in the fixed
  // instance): no predicate.
  auto load = [&](int j, bool first) {
#pragma unroll
    for (int p = 0; p < kMaxSplits; ++p) {
      v0[p] = p < d.splits && ((first && d.rank >= kBlockThreads) || j < nt)
                  ? __ldg(a.t + p * a.t_stride + j)
                  : 0.0f;
      v1[p] = p < d.splits && j + kBlockThreads < nt
                  ? __ldg(a.t + p * a.t_stride + j + kBlockThreads)
                  : 0.0f;
    }
  };
  int j = threadIdx.x;
  load(j, true);
  // scale_g = rsqrt(mean(H_g^2) + eps) from the group's partial squares, ascending chunks
  // (docs/model.md §C.2); sp[p]: the scale of chunk p's group.
#pragma unroll
  for (int g = 0; g < kStreams; ++g) {
    float s = 0.0f;
#pragma unroll
    for (int p = 0; p < kMaxSplits; ++p)
      if (p >= g * d.cpg && p < (g + 1) * d.cpg) s += sq[p];
    scale[g] = rsqrtf(s / static_cast<float>(d.hidden) + a.eps);
  }
  float sp[kMaxSplits];
#pragma unroll
  for (int p = 0; p < kMaxSplits; ++p)
    sp[p] = p < d.cpg ? scale[0] : p < 2 * d.cpg ? scale[1] : p < 3 * d.cpg ? scale[2] : scale[3];
  // t[jj] = sum_p scale_g(p) * partial (fmaf, ascending p), then u or iota.
  auto finish = [&](int jj, const float(&v)[kMaxSplits]) {
    float tv = 0.0f;
#pragma unroll
    for (int p = 0; p < kMaxSplits; ++p)
      if (p < d.splits) tv = fmaf(sp[p], v[p], tv);
    const float x = tv * kInvStreams;
    if (jj < d.rank)
      u_s[jj] = dev::silu(x);
    else if (blockIdx.x == 0)
      a.iota[jj - d.rank] = 2.0f / (1.0f + expf(-x));
  };
  for (bool first = true;; first = false) {
    if ((first && d.rank >= kBlockThreads) || j < nt) finish(j, v0);
    if (j + kBlockThreads < nt) finish(j + kBlockThreads, v1);
    // Two rounds cover every t value when nt <= 512 (rank 320: a constant in the fixed instance).
    if (d.rank + kStreams <= 2 * kBlockThreads) break;
    j += 2 * kBlockThreads;
    if (j >= nt) break;
    load(j, false);
  }
}

// The team's butterfly; then lane s < 4 of the team computes stream s's G_s = sigmoid(acc_s) and
// N_s = H * scale_s * (1 + w) (docs/model.md §C.2, FP32), and lane 0 of an in-range team gathers
// them: m = (1/4) sum_s G_s N_s (fmaf chain over the streams, ascending). hv and one_w: the lane's
// stream's H and 1 + w at the output.
__device__ __forceinline__ void mix_finish(const MixArgs& a, const MixDims& d,
                                           float (&acc)[kStreams], int lane, bool store, float hv,
                                           const float (&scale)[kStreams], float one_w, int64_t i) {
  const int team = 1 << d.team_log2;
  dev::team_reduce<kStreams, kBlockThreads>(acc, team, lane);
  if (team > 32) {  // the sums are in the team's lane 0 only: give them to its warp
#pragma unroll
    for (int s = 0; s < kStreams; ++s) acc[s] = __shfl_sync(0xffffffffu, acc[s], 0);
  }
  const int ls = mix_lane_stream(lane);
  const float acc_s = ls == 0 ? acc[0] : ls == 1 ? acc[1] : ls == 2 ? acc[2] : acc[3];
  const float scale_s = ls == 0 ? scale[0] : ls == 1 ? scale[1] : ls == 2 ? scale[2] : scale[3];
  const float g_s = 1.0f / (1.0f + expf(-acc_s));
  const float n_s = hv * scale_s * one_w;  // N (docs/model.md §C.2), FP32
  const int width = team < 32 ? team : 32;
  float g[kStreams], n[kStreams];
#pragma unroll
  for (int s = 0; s < kStreams; ++s) {
    g[s] = __shfl_sync(0xffffffffu, g_s, s, width);
    n[s] = __shfl_sync(0xffffffffu, n_s, s, width);
  }
  if (lane != 0 || !store) return;
  float m = 0.0f;
#pragma unroll
  for (int s = 0; s < kStreams; ++s) m = fmaf(g[s], n[s], m);
  m *= kInvStreams;
  a.m[i] = m;
  if (a.m_bf16 == nullptr && a.m_lo == nullptr) return;
  // hi = bf16(m), lo = bf16(m - hi): launch_split_bf16's pair (cuda/kernels/prefill_ops.h).
  const uint16_t hi = dev::float_to_bf16_bits(m);
  if (a.m_bf16 != nullptr) a.m_bf16[i] = hi;
  if (a.m_lo != nullptr)
    a.m_lo[i] = dev::float_to_bf16_bits(m - __uint_as_float(static_cast<uint32_t>(hi) << 16));
}

// 1 + w at output ic of the lane's stream (FP32, never rounded to BF16): a weight, read before
// the wait.
__device__ __forceinline__ float mix_one_w(const MixArgs& a, const MixDims& d, int64_t ic,
                                           int lane) {
  return 1.0f +
         dev::bf16_lo(static_cast<uint32_t>(__ldg(a.norm + ic + mix_lane_stream(lane) * d.hidden)));
}

// One team per output i: rows i + s*D (s < 4) of W_up against u = silu(t / 4), which every block
// first reduces from the partials into shared memory. The W_up vectors stay in registers: the
// fallback for ranks whose staged rows do not fit 48 KB (hc_mix_uses_staging). kMulti
// (a.tokens > 1): the steps after the wait once per token; false: the one-token instance.
// The several-token instance runs one block per SM (its loop needs more than 128 registers).
template <bool kMulti = false>
__global__ void __launch_bounds__(kBlockThreads, kMulti ? 1 : 2) hc_mix_kernel(MixArgs a) {
  extern __shared__ float4 u_s4[];  // [rank / 4]
  float* u_s = reinterpret_cast<float*>(u_s4);
  const MixDims d = mix_dims<0, 0, 0, 0>(a);
  const int team = 1 << d.team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (kBlockThreads >> d.team_log2) +
                    (threadIdx.x >> d.team_log2);
  const int64_t ic = i < d.hidden ? i : d.hidden - 1;  // out-of-range teams compute, never store
  // The lane's first kMixPre vectors of each W_up row and the norm weight of output i (weights:
  // no kernel writes them) load before the programmatic-dependent wait, so the whole matrix
  // streams while the previous kernel finishes (rank 320: at most 3 vectors per lane); t, the
  // partial squares and H come from earlier kernels (cuda/common/pdl.cuh). Vectors are summed in
  // ascending order either way.
  uint4 pre[kMixPre][kStreams];
#pragma unroll
  for (int j = 0; j < kMixPre; ++j) {
    const int v = lane + j * team;
#pragma unroll
    for (int s = 0; s < kStreams; ++s)
      pre[j][s] = v < d.nvec ? dev::ld_stream16(a.w_up + (ic + s * d.hidden) * d.rank + 8 * v)
                             : make_uint4(0, 0, 0, 0);
  }
  const float one_w = mix_one_w(a, d, ic, lane);
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  // Per token the same operations in the same order as a one-token launch. The vectors past
  // kMixPre per lane are loaded again for each token (from L2 after the first).
  int b0, b1;
  block_tokens<kMulti>(blockIdx.y, a.tokens, a.tpb, b0, b1);
  for (int b = b0; b < b1; ++b) {
    const MixArgs at = mix_token(a, d, b);
    if (b > b0) __syncthreads();  // every team is done with the last token's u
    float hv, scale[kStreams];
    mix_after_wait(at, d, ic, lane, u_s, hv, scale);
    __syncthreads();
    float acc[kStreams] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int jv = 0; jv < kMixPre; ++jv)
      if (lane + jv * team < d.nvec) mix_accumulate(acc, pre[jv], u_s4, lane + jv * team);
    for (int v = lane + kMixPre * team; v < d.nvec; v += team) {
      uint4 w[kStreams];
#pragma unroll
      for (int s = 0; s < kStreams; ++s)
        w[s] = dev::ld_stream16(a.w_up + (ic + s * d.hidden) * d.rank + 8 * v);
      mix_accumulate(acc, w, u_s4, v);
    }
    mix_finish(at, d, acc, lane, i < d.hidden, hv, scale, one_w, i);
  }
}

// Shared memory of the staged mix: the block's 4 x (256 / team) W_up rows, then u (FP32).
std::size_t mix_stage_bytes(int64_t rank, int team) {
  return static_cast<std::size_t>(kStreams) * (kBlockThreads / team) * rank * 2 +
         static_cast<std::size_t>(rank) * sizeof(float);
}

// The staged mix: the same teams, outputs and summation order as hc_mix_kernel (so the same
// bits), but the block's W_up rows (rows i0 .. i0 + outs - 1 of each stream: 4 contiguous runs)
// go to shared memory with cp.async before the PDL wait, so the kernel holds ~64 registers, up to
// 4 blocks fit an SM and the whole grid is resident (its weights in flight) while the down pass
// runs; after the wait only t, the partial squares and H are read from memory. The instance
// <kFixedRank, kFixedHidden, kFixedTeamLog2, kFixedSplits> is the real read at compile-time
// shape (ncu: the runtime-shape instance ran ~1,170 instructions per warp at this
// shape, most of them address arithmetic, predicates and loop control on runtime sizes). kMulti
// (a.tokens > 1): the steps after the wait once per token; false: the one-token instance.
template <int kRank = 0, int kHidden = 0, int kTeamLog2 = 0, int kSplits = 0, bool kMulti = false>
__global__ void __launch_bounds__(kBlockThreads, kStagedMinBlocks) hc_mix_staged_kernel(MixArgs a) {
  extern __shared__ uint4 stage4[];  // [kStreams][outs][nvec] W_up, then u [rank] FP32
  const MixDims d = mix_dims<kRank, kHidden, kTeamLog2, kSplits>(a);
  const int team = 1 << d.team_log2;
  const int outs = kBlockThreads >> d.team_log2;
  const int k = threadIdx.x >> d.team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * outs;
  const int64_t i = i0 + k;
  // Every block is full when outs divides D (the grid is D / outs blocks): a constant in the
  // fixed instance. Otherwise the last block's out-of-range teams compute and never store.
  const bool full = d.hidden % outs == 0;
  const bool in_range = full || i < d.hidden;
  const int64_t ic = in_range ? i : d.hidden - 1;
  const int per_stream = outs * d.nvec;  // vectors per stream
  const int n_ok =
      full ? per_stream : static_cast<int>(min(static_cast<int64_t>(outs), d.hidden - i0)) * d.nvec;
#pragma unroll
  for (int s = 0; s < kStreams; ++s) {
    const uint16_t* src = a.w_up + (i0 + s * d.hidden) * d.rank;
    uint4* dst = stage4 + s * per_stream;
    // A loop over rounds, not over q, so that the fixed instance's trip count is a constant.
    const int rounds = (per_stream + kBlockThreads - 1) / kBlockThreads;
#pragma unroll 4
    for (int rd = 0; rd < rounds; ++rd) {
      const int q = static_cast<int>(threadIdx.x) + rd * kBlockThreads;
      if (q >= per_stream) break;
      if (q < n_ok)
        dev::cp_async16(dst + q, src + 8 * static_cast<int64_t>(q));
      else
        dst[q] = make_uint4(0, 0, 0, 0);  // rows past D: read by teams that never store
    }
  }
  float4* u_s4 = reinterpret_cast<float4*>(stage4 + kStreams * per_stream);
  const float one_w = mix_one_w(a, d, ic, lane);
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  // The staged rows serve every token: per token the same operations in the same order as a
  // one-token launch (u of the token into u_s, then the teams' dots), so each token's outputs
  // have its bits.
  int b0, b1;
  block_tokens<kMulti>(blockIdx.y, a.tokens, a.tpb, b0, b1);
  for (int b = b0; b < b1; ++b) {
    const MixArgs at = mix_token(a, d, b);
    if (b > b0) __syncthreads();  // every team is done with the last token's u
    float hv, scale[kStreams];
    mix_after_wait(at, d, ic, lane, reinterpret_cast<float*>(u_s4), hv, scale);
    if (b == b0) dev::cp_async_wait_all();
    __syncthreads();
    float acc[kStreams] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int v = lane; v < d.nvec; v += team) {
      uint4 w[kStreams];
#pragma unroll
      for (int s = 0; s < kStreams; ++s) w[s] = stage4[(s * outs + k) * d.nvec + v];
      mix_accumulate(acc, w, u_s4, v);
    }
    mix_finish(at, d, acc, lane, in_range, hv, scale, one_w, i);
  }
}

using detail::aligned;

// Mix blocks for `team` lanes per output: ceil(hidden / (256 / team)).
int64_t mix_blocks(int64_t hidden, int team) {
  return (hidden + (kBlockThreads / team) - 1) / (kBlockThreads / team);
}

// Team: the narrowest power of two with <= 16 vectors per lane, widened while the grid has fewer
// than 2 blocks per SM and lanes keep >= 2 vectors (rank 320 on 132 SMs: 32 lanes, 320 blocks).
int mix_team(int64_t hidden, int64_t rank) {
  const int64_t nvec = rank / 8, target = 2 * static_cast<int64_t>(detail::current_sm_count());
  int team = 8;
  while (team < kBlockThreads && team * 16 < nvec) team *= 2;
  while (mix_blocks(hidden, team) < target && team < kBlockThreads && nvec >= 2 * team) team *= 2;
  return team;
}

}  // namespace

bool hc_mix_uses_staging(const HcMixParams& p) {
  if (p.rank < 8 || p.rank > kMaxRank || p.hidden < 1) return false;
  return mix_stage_bytes(p.rank, mix_team(p.hidden, p.rank)) <= kMixStageMaxBytes;
}

int64_t hc_down_chunks(int64_t hidden) {
  return (hidden / 8 + kDownChunkVec - 1) / kDownChunkVec;
}

int64_t hc_down_splits(int64_t hc_count, int64_t hidden) {
  return hc_count * hc_down_chunks(hidden);
}

void launch_hc_down(const HcDownParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_down";
  FN_LAUNCH_REQUIRE(p.H != nullptr && p.norm != nullptr && p.weight != nullptr &&
                        p.t_partial != nullptr && p.sumsq != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.rows >= 1 && p.hc_count >= 1 && p.hc_count <= 64, kOp);
  FN_LAUNCH_REQUIRE(p.tokens >= 1 && p.tokens <= kMaxTokens, kOp);
  FN_LAUNCH_REQUIRE(p.hidden >= 8 && p.hidden % 8 == 0 && p.hidden / 8 <= INT32_MAX / 2, kOp);
  const int64_t width = p.hc_count * p.hidden;
  FN_LAUNCH_REQUIRE(aligned(p.H, 16) && aligned(p.norm, 16) && aligned(p.weight, 16) &&
                        aligned(p.t_partial, 4) && aligned(p.sumsq, 4),
                    kOp);
  const bool inject = p.inject_y != nullptr || p.inject_iota != nullptr || p.H_out != nullptr;
  FN_LAUNCH_REQUIRE(!inject || (p.inject_y != nullptr && p.inject_iota != nullptr &&
                                p.H_out != nullptr && p.H_out != p.H && aligned(p.inject_y, 16) &&
                                aligned(p.H_out, 16) && aligned(p.inject_iota, 4)),
                    kOp);
  FN_LAUNCH_REQUIRE(p.tokens_per_block >= 0, kOp);
  const int tpb = launch_tokens_per_block(p.tokens, p.tokens_per_block);
  const int64_t splits = hc_down_splits(p.hc_count, p.hidden);
  const int64_t row_blocks = (p.rows + kDownRowsPerBlock - 1) / kDownRowsPerBlock;
  FN_LAUNCH_REQUIRE(splits <= INT32_MAX && row_blocks <= 65535, kOp);
  DownArgs a{p.H,
             p.norm,
             p.weight,
             p.rows,
             width,
             p.hidden,
             static_cast<int>(p.hidden / 8),
             static_cast<int>(hc_down_chunks(p.hidden)),
             p.t_partial,
             p.sumsq,
             inject ? p.inject_iota : nullptr,
             inject ? p.inject_y : nullptr,
             inject ? p.H_out : nullptr,
             p.hc_count,
             p.tokens,
             splits * p.rows,
             splits,
             tpb};
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(row_blocks),
                  grid_copies(p.tokens, tpb));
  const bool fixed = p.fixed_shape && p.hc_count == kStreams && p.hidden == kFixedHidden;
  void (*kernel)(DownArgs) =
      p.tokens > 1
          ? (fixed ? hc_down_staged_kernel<kFixedHidden, true> : hc_down_staged_kernel<0, true>)
          : (fixed ? hc_down_staged_kernel<kFixedHidden> : hc_down_staged_kernel<>);
  launch_pdl("hc_down_staged_kernel", kernel, grid, dim3(kBlockThreads), kDownStageBytes, stream,
             a);
  FN_CUDA_LAUNCH_CHECK("hc_down_staged_kernel");
}

void launch_hc_mix(const HcMixParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_mix";
  FN_LAUNCH_REQUIRE(p.w_up != nullptr && p.t != nullptr && p.sumsq != nullptr && p.H != nullptr &&
                        p.norm != nullptr && p.m != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.hc_count == kStreams && p.hidden >= 1, kOp);
  FN_LAUNCH_REQUIRE(p.tokens >= 1 && p.tokens <= kMaxTokens, kOp);
  FN_LAUNCH_REQUIRE(p.rank >= 8 && p.rank % 8 == 0 && p.rank <= kMaxRank, kOp);
  FN_LAUNCH_REQUIRE(p.t_splits >= kStreams && p.t_splits <= kMaxSplits &&
                        p.t_splits % kStreams == 0 &&
                        p.t_stride >= p.rank + (p.iota != nullptr ? kStreams : 0),
                    kOp);
  FN_LAUNCH_REQUIRE(aligned(p.w_up, 16) && aligned(p.t, 4) && aligned(p.sumsq, 4) &&
                        aligned(p.H, 4) && aligned(p.norm, 2) && aligned(p.m, 4) &&
                        aligned(p.m_bf16, 2) && aligned(p.m_lo, 2) && aligned(p.iota, 4),
                    kOp);
  FN_LAUNCH_REQUIRE(p.tokens_per_block >= 0, kOp);
  const int tpb = launch_tokens_per_block(p.tokens, p.tokens_per_block);
  const int64_t nvec = p.rank / 8;
  const int team = mix_team(p.hidden, p.rank);
  MixArgs a{p.w_up,
            p.t,
            p.sumsq,
            p.t_stride,
            p.H,
            p.norm,
            p.eps,
            p.m,
            p.m_bf16,
            p.iota,
            p.hidden,
            static_cast<int>(p.rank),
            static_cast<int>(nvec),
            __builtin_ctz(static_cast<unsigned>(team)),
            static_cast<int>(p.t_splits),
            static_cast<int>(p.t_splits / kStreams),
            p.m_lo,
            p.tokens,
            p.t_splits * p.t_stride,
            tpb};
  const dim3 grid(static_cast<unsigned>(mix_blocks(p.hidden, team)), grid_copies(p.tokens, tpb));
  if (hc_mix_uses_staging(p)) {
    const bool fixed = p.fixed_shape && p.rank == kFixedRank && p.hidden == kFixedHidden &&
                       team == (1 << kFixedTeamLog2) && p.t_splits == kFixedSplits;
    void (*kernel)(MixArgs) =
        p.tokens > 1
            ? (fixed ? hc_mix_staged_kernel<kFixedRank, kFixedHidden, kFixedTeamLog2, kFixedSplits,
                                            true>
                     : hc_mix_staged_kernel<0, 0, 0, 0, true>)
            : (fixed ? hc_mix_staged_kernel<kFixedRank, kFixedHidden, kFixedTeamLog2, kFixedSplits>
                     : hc_mix_staged_kernel<>);
    launch_pdl("hc_mix_staged_kernel", kernel, grid, dim3(kBlockThreads),
               mix_stage_bytes(p.rank, team), stream, a);
    FN_CUDA_LAUNCH_CHECK("hc_mix_staged_kernel");
  } else {
    void (*kernel)(MixArgs) = p.tokens > 1 ? hc_mix_kernel<true> : hc_mix_kernel<>;
    launch_pdl("hc_mix_kernel", kernel, grid, dim3(kBlockThreads),
               static_cast<std::size_t>(p.rank) * sizeof(float), stream, a);
    FN_CUDA_LAUNCH_CHECK("hc_mix_kernel");
  }
}

}  // namespace fn

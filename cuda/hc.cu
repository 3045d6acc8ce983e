// HC down (fused grouped RMSNorm + split-K GEMV) and HC mix kernels (see hc.h).
#include "cuda/hc.h"

#include <cuda_runtime.h>

#include "comm/cuda_check.h"
#include "cuda/device_util.cuh"
#include "cuda/launch_check.h"
#include "cuda/pdl.cuh"

namespace fn {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kStreams = 4;     // hc_count of the model (MODEL.md §A.2); one accumulator each
constexpr int kMixPre = 4;      // W_up vectors per row and lane loaded before the PDL wait
constexpr int kMaxRank = 8192;  // u = silu(t / 4) lives in shared memory (32 KB at most)

constexpr int kMaxSplits = 16;  // partial dots per t value the mix sums (loads all in flight)

// HC down tiling: a warp owns kDownRows rows and the block's chunk of kDownChunkVec 16-byte
// vectors (lane l: vectors l, l + 32, l + 64, l + 96), so every thread has 16 weight loads in
// flight; at the real shape 10 chunks x 11 row blocks hold the whole matrix.
constexpr int kDownRows = 4;
constexpr int kDownVecPerLane = 4;
constexpr int kDownChunkVec = 32 * kDownVecPerLane;                  // 1024 columns
constexpr int kDownRowsPerBlock = (kBlockThreads / 32) * kDownRows;  // 32
constexpr int kDownMaxGroups = kDownChunkVec + 1;  // groups one chunk can touch (hidden >= 8)

// Block-wide FP32 sum in a fixed order (butterfly per warp, then warps ascending); every thread
// returns the total. May be called repeatedly (the barriers order the reuse of the scratch).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kBlockThreads / 32];
  __shared__ float total;
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = warp_sums[0];
    for (int i = 1; i < kBlockThreads / 32; ++i) s += warp_sums[i];
    total = s;
  }
  __syncthreads();
  return total;
}

// acc += dot(8 BF16 weights, 8 x values), ascending column order.
__device__ __forceinline__ float fma8(uint4 w, const float (&xf)[8], float acc) {
  acc = fmaf(dev::bf16_lo(w.x), xf[0], acc);
  acc = fmaf(dev::bf16_hi(w.x), xf[1], acc);
  acc = fmaf(dev::bf16_lo(w.y), xf[2], acc);
  acc = fmaf(dev::bf16_hi(w.y), xf[3], acc);
  acc = fmaf(dev::bf16_lo(w.z), xf[4], acc);
  acc = fmaf(dev::bf16_hi(w.z), xf[5], acc);
  acc = fmaf(dev::bf16_lo(w.w), xf[6], acc);
  acc = fmaf(dev::bf16_hi(w.w), xf[7], acc);
  return acc;
}

struct DownArgs {
  const float* H;
  const uint16_t* norm;
  const uint16_t* w;
  int64_t rows;
  int64_t width;  // hc_count * hidden
  int64_t hidden;
  int nvec;  // width / 8
  float eps;
  float* n;
  float* tp;
};

// Block (split, row block): rows [32 * blockIdx.y, +32) x vectors [128 * blockIdx.x, +128).
__global__ void __launch_bounds__(kBlockThreads) hc_down_kernel(DownArgs a) {
  __shared__ float s_scale[kDownMaxGroups];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int v0 = static_cast<int>(blockIdx.x) * kDownChunkVec;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kDownRowsPerBlock + warp * kDownRows;
  // Weights (W and the norm weight: no kernel writes them) load before the dependency wait, so
  // the whole matrix is in flight while the previous kernel finishes (cuda/pdl.cuh).
  uint4 w[kDownVecPerLane][kDownRows];
  uint2 nw[kDownVecPerLane][2];
#pragma unroll
  for (int u = 0; u < kDownVecPerLane; ++u) {
    const int v = v0 + lane + 32 * u;
#pragma unroll
    for (int r = 0; r < kDownRows; ++r)
      w[u][r] = v < a.nvec && row0 + r < a.rows
                    ? dev::ld_stream16(a.w + (row0 + r) * a.width + 8 * static_cast<int64_t>(v))
                    : make_uint4(0, 0, 0, 0);
    const uint2* np = reinterpret_cast<const uint2*>(a.norm + 8 * static_cast<int64_t>(v));
    nw[u][0] = v < a.nvec ? __ldg(np) : make_uint2(0, 0);
    nw[u][1] = v < a.nvec ? __ldg(np + 1) : make_uint2(0, 0);
  }
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  // H at the lane's columns, then the statistic of every group the chunk touches: every block
  // sums a group's squares in the same order, so all blocks get the same scale bits.
  float4 hx[kDownVecPerLane][2];
#pragma unroll
  for (int u = 0; u < kDownVecPerLane; ++u) {
    const int v = v0 + lane + 32 * u;
    const float4* hp = reinterpret_cast<const float4*>(a.H) + 2 * static_cast<int64_t>(v);
    hx[u][0] = v < a.nvec ? __ldg(hp) : make_float4(0, 0, 0, 0);
    hx[u][1] = v < a.nvec ? __ldg(hp + 1) : make_float4(0, 0, 0, 0);
  }
  const int64_t c0 = 8 * static_cast<int64_t>(v0);
  const int64_t c1 = min(c0 + 8 * kDownChunkVec, a.width);
  const int g0 = static_cast<int>(c0 / a.hidden), g1 = static_cast<int>((c1 - 1) / a.hidden);
  // Two groups per pass (a 1024-column chunk touches at most 2 groups of 2560), so their loads
  // overlap; each group's sum has the same order whether it is first or second of a pair.
  const int64_t nv4 = a.hidden / 4;
  for (int g = g0; g <= g1; g += 2) {
    const bool two = g + 1 <= g1;
    const float4* xa = reinterpret_cast<const float4*>(a.H + g * a.hidden);
    const float4* xb = two ? xa + nv4 : xa;
    float sa = 0.0f, sb = 0.0f;
    for (int64_t q = threadIdx.x; q < nv4; q += kBlockThreads) {
      const float4 ha = __ldg(xa + q), hb = __ldg(xb + q);
      sa = fmaf(ha.x, ha.x, sa);
      sa = fmaf(ha.y, ha.y, sa);
      sa = fmaf(ha.z, ha.z, sa);
      sa = fmaf(ha.w, ha.w, sa);
      sb = fmaf(hb.x, hb.x, sb);
      sb = fmaf(hb.y, hb.y, sb);
      sb = fmaf(hb.z, hb.z, sb);
      sb = fmaf(hb.w, hb.w, sb);
    }
    const float ta = block_sum(sa);
    const float tb = block_sum(sb);
    if (threadIdx.x == 0) {
      s_scale[g - g0] = rsqrtf(ta / static_cast<float>(a.hidden) + a.eps);
      if (two) s_scale[g + 1 - g0] = rsqrtf(tb / static_cast<float>(a.hidden) + a.eps);
    }
  }
  __syncthreads();

  float acc[kDownRows] = {0.0f, 0.0f, 0.0f, 0.0f};
  const bool write_n = blockIdx.y == 0 && warp == 0;
#pragma unroll
  for (int u = 0; u < kDownVecPerLane; ++u) {
    const int v = v0 + lane + 32 * u;
    if (v >= a.nvec) continue;
    const float scale = s_scale[static_cast<int>(8 * static_cast<int64_t>(v) / a.hidden) - g0];
    // N = H * scale * (1 + w) in FP32 (MODEL.md §C.2; (1 + w) never rounded to BF16).
    const float h[8] = {hx[u][0].x, hx[u][0].y, hx[u][0].z, hx[u][0].w,
                        hx[u][1].x, hx[u][1].y, hx[u][1].z, hx[u][1].w};
    const uint32_t q[4] = {nw[u][0].x, nw[u][0].y, nw[u][1].x, nw[u][1].y};
    float xf[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      xf[2 * k] = h[2 * k] * scale * (1.0f + dev::bf16_lo(q[k]));
      xf[2 * k + 1] = h[2 * k + 1] * scale * (1.0f + dev::bf16_hi(q[k]));
    }
    if (write_n) {
      float4* np = reinterpret_cast<float4*>(a.n) + 2 * static_cast<int64_t>(v);
      np[0] = make_float4(xf[0], xf[1], xf[2], xf[3]);
      np[1] = make_float4(xf[4], xf[5], xf[6], xf[7]);
    }
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) acc[r] = fma8(w[u][r], xf, acc[r]);
  }
  dev::team_reduce<kDownRows, kBlockThreads>(acc, 32, lane);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < kDownRows; ++r)
    if (row0 + r < a.rows) a.tp[static_cast<int64_t>(blockIdx.x) * a.rows + row0 + r] = acc[r];
}

struct MixArgs {
  const uint16_t* w_up;
  const float* t;
  int t_splits;
  int64_t t_stride;
  const float* n;
  float* m;
  uint16_t* m_bf16;
  float* iota;
  int64_t hidden;
  int rank;
  int nvec;  // rank / 8
  int team_log2;
};

// t[j] summed over the splits in ascending order (all loads issued before the first add).
__device__ __forceinline__ float sum_splits(const MixArgs& a, int64_t j) {
  float v[kMaxSplits];
#pragma unroll
  for (int p = 0; p < kMaxSplits; ++p) v[p] = p < a.t_splits ? __ldg(a.t + p * a.t_stride + j) : 0;
  float s = 0.0f;
#pragma unroll
  for (int p = 0; p < kMaxSplits; ++p)
    if (p < a.t_splits) s += v[p];
  return s;
}

// One team per output i: rows i + s*D (s < 4) of W_up against u = silu(t / 4), which every block
// first reduces from the partials into shared memory.
__global__ void __launch_bounds__(kBlockThreads) hc_mix_kernel(MixArgs a) {
  extern __shared__ float4 u_s4[];  // [rank / 4]
  float* u_s = reinterpret_cast<float*>(u_s4);
  const int team = 1 << a.team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (kBlockThreads >> a.team_log2) +
                    (threadIdx.x >> a.team_log2);
  const int64_t ic = i < a.hidden ? i : a.hidden - 1;  // out-of-range teams compute, never store
  constexpr float kInvStreams = 1.0f / kStreams;       // 0.25: exact
  float acc[kStreams] = {0.0f, 0.0f, 0.0f, 0.0f};
  // acc[s] += W_up[row i + s*D, vector v] . u[vector v] for the 4 streams.
  auto accumulate = [&](const uint4(&w)[kStreams], int v) {
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
  };
  // The lane's first kMixPre vectors of each W_up row (a weight: no kernel writes it) load
  // before the programmatic-dependent wait, so the whole matrix streams while the previous
  // kernel finishes (rank 320: at most 3 vectors per lane); t and n come from earlier kernels
  // (cuda/pdl.cuh). Vectors are summed in ascending order either way.
  uint4 pre[kMixPre][kStreams];
#pragma unroll
  for (int j = 0; j < kMixPre; ++j) {
    const int v = lane + j * team;
#pragma unroll
    for (int s = 0; s < kStreams; ++s)
      pre[j][s] = v < a.nvec ? dev::ld_stream16(a.w_up + (ic + s * a.hidden) * a.rank + 8 * v)
                             : make_uint4(0, 0, 0, 0);
  }
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  for (int j = threadIdx.x; j < a.rank; j += kBlockThreads)
    u_s[j] = dev::silu(sum_splits(a, j) * kInvStreams);
  if (blockIdx.x == 0 && threadIdx.x < kStreams && a.iota != nullptr)
    a.iota[threadIdx.x] = 2.0f / (1.0f + expf(-sum_splits(a, a.rank + threadIdx.x) * kInvStreams));
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kMixPre; ++j)
    if (lane + j * team < a.nvec) accumulate(pre[j], lane + j * team);
  for (int v = lane + kMixPre * team; v < a.nvec; v += team) {
    uint4 w[kStreams];
#pragma unroll
    for (int s = 0; s < kStreams; ++s)
      w[s] = dev::ld_stream16(a.w_up + (ic + s * a.hidden) * a.rank + 8 * v);
    accumulate(w, v);
  }
  dev::team_reduce<kStreams, kBlockThreads>(acc, team, lane);
  if (lane != 0 || i >= a.hidden) return;
  float m = 0.0f;
#pragma unroll
  for (int s = 0; s < kStreams; ++s) {
    const float g = 1.0f / (1.0f + expf(-acc[s]));
    m = fmaf(g, a.n[i + s * a.hidden], m);
  }
  m *= kInvStreams;
  a.m[i] = m;
  if (a.m_bf16 != nullptr) a.m_bf16[i] = dev::float_to_bf16_bits(m);
}

bool aligned(const void* p, uintptr_t n) {
  return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0;
}

}  // namespace

int64_t hc_down_splits(int64_t width) {
  const int64_t nvec = width / 8;
  return (nvec + kDownChunkVec - 1) / kDownChunkVec;
}

void launch_hc_down(const HcDownParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_down";
  FN_LAUNCH_REQUIRE(p.H != nullptr && p.norm != nullptr && p.weight != nullptr && p.n != nullptr &&
                        p.t_partial != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.rows >= 1 && p.hc_count >= 1 && p.hc_count <= 64, kOp);
  FN_LAUNCH_REQUIRE(p.hidden >= 8 && p.hidden % 8 == 0, kOp);
  const int64_t width = p.hc_count * p.hidden;
  FN_LAUNCH_REQUIRE(width / 8 <= INT32_MAX - kDownChunkVec, kOp);
  FN_LAUNCH_REQUIRE(aligned(p.H, 16) && aligned(p.norm, 16) && aligned(p.weight, 16) &&
                        aligned(p.n, 16) && aligned(p.t_partial, 4),
                    kOp);
  const int64_t splits = hc_down_splits(width);
  const int64_t row_blocks = (p.rows + kDownRowsPerBlock - 1) / kDownRowsPerBlock;
  FN_LAUNCH_REQUIRE(splits <= INT32_MAX && row_blocks <= 65535, kOp);
  DownArgs a{p.H,   p.norm, p.weight,   p.rows, width, p.hidden, static_cast<int>(width / 8),
             p.eps, p.n,    p.t_partial};
  launch_pdl("hc_down_kernel", hc_down_kernel,
             dim3(static_cast<unsigned>(splits), static_cast<unsigned>(row_blocks)),
             dim3(kBlockThreads), 0, stream, a);
  FN_CUDA_LAUNCH_CHECK("hc_down_kernel");
}

void launch_hc_mix(const HcMixParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_mix";
  FN_LAUNCH_REQUIRE(p.w_up != nullptr && p.t != nullptr && p.n != nullptr && p.m != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.hc_count == kStreams && p.hidden >= 1, kOp);
  FN_LAUNCH_REQUIRE(p.rank >= 8 && p.rank % 8 == 0 && p.rank <= kMaxRank, kOp);
  FN_LAUNCH_REQUIRE(p.t_splits >= 1 && p.t_splits <= kMaxSplits &&
                        p.t_stride >= p.rank + (p.iota != nullptr ? kStreams : 0),
                    kOp);
  FN_LAUNCH_REQUIRE(aligned(p.w_up, 16) && aligned(p.t, 4) && aligned(p.n, 4), kOp);
  // Team: the narrowest power of two with <= 16 vectors per lane, widened while the grid has
  // fewer than 2 blocks per SM and lanes keep >= 2 vectors (rank 320: 16 lanes, 160 blocks).
  const int64_t nvec = p.rank / 8, target = 2 * static_cast<int64_t>(detail::current_sm_count());
  auto blocks = [&](int t) { return (p.hidden + (kBlockThreads / t) - 1) / (kBlockThreads / t); };
  int team = 8;
  while (team < kBlockThreads && team * 16 < nvec) team *= 2;
  while (blocks(team) < target && team < kBlockThreads && nvec >= 2 * team) team *= 2;
  MixArgs a{p.w_up,
            p.t,
            static_cast<int>(p.t_splits),
            p.t_stride,
            p.n,
            p.m,
            p.m_bf16,
            p.iota,
            p.hidden,
            static_cast<int>(p.rank),
            static_cast<int>(nvec),
            __builtin_ctz(static_cast<unsigned>(team))};
  launch_pdl("hc_mix_kernel", hc_mix_kernel, static_cast<unsigned>(blocks(team)), kBlockThreads,
             static_cast<std::size_t>(p.rank) * sizeof(float), stream, a);
  FN_CUDA_LAUNCH_CHECK("hc_mix_kernel");
}

}  // namespace fn

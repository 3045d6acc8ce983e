// Grouped RMSNorm and HC mix kernels (see hc.h).
#include "cuda/hc.h"

#include <cuda_runtime.h>

#include "comm/cuda_check.h"
#include "cuda/device_util.cuh"
#include "cuda/launch_check.h"
#include "cuda/pdl.cuh"

namespace fn {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kStreams = 4;  // hc_count of the model (MODEL.md §A.2); one accumulator each
constexpr int kMixPre = 4;   // W_up vectors per row and lane loaded before the PDL wait

// Block-wide FP32 sum in a fixed order (butterfly per warp, then warps ascending); every thread
// returns the total.
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

// One block per group; 4 elements per step (16-byte x loads, 8-byte weight/out accesses).
__global__ void __launch_bounds__(kBlockThreads)
    group_rms_norm_1p_kernel(const float* x, const uint16_t* w, uint16_t* out, int64_t n,
                             float eps) {
  dev::pdl_begin();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  const float4* xv = reinterpret_cast<const float4*>(x + base);
  const int64_t nv = n / 4;
  float ss = 0.0f;
  for (int64_t v = threadIdx.x; v < nv; v += kBlockThreads) {
    const float4 a = __ldg(xv + v);
    ss = fmaf(a.x, a.x, ss);
    ss = fmaf(a.y, a.y, ss);
    ss = fmaf(a.z, a.z, ss);
    ss = fmaf(a.w, a.w, ss);
  }
  const float scale = rsqrtf(block_sum(ss) / static_cast<float>(n) + eps);
  const uint2* wv = reinterpret_cast<const uint2*>(w + base);
  uint2* ov = reinterpret_cast<uint2*>(out + base);
  for (int64_t v = threadIdx.x; v < nv; v += kBlockThreads) {
    const float4 a = __ldg(xv + v);
    const uint2 wb = __ldg(wv + v);
    // (1 + w) in FP32 inside the kernel (MODEL.md §C.2: never materialised in BF16).
    const float y0 = a.x * scale * (1.0f + dev::bf16_lo(wb.x));
    const float y1 = a.y * scale * (1.0f + dev::bf16_hi(wb.x));
    const float y2 = a.z * scale * (1.0f + dev::bf16_lo(wb.y));
    const float y3 = a.w * scale * (1.0f + dev::bf16_hi(wb.y));
    uint2 o;
    o.x = dev::float_to_bf16_bits(y0) | (static_cast<uint32_t>(dev::float_to_bf16_bits(y1)) << 16);
    o.y = dev::float_to_bf16_bits(y2) | (static_cast<uint32_t>(dev::float_to_bf16_bits(y3)) << 16);
    ov[v] = o;
  }
}

struct MixArgs {
  const uint16_t* w_up;
  const float* t;
  const uint16_t* n;
  uint16_t* m;
  float* iota;
  int64_t hidden;
  int rank;
  int nvec;  // rank / 8
  int team_log2;
};

// One team per output i: rows i + s*D (s < 4) of W_up against u = silu(t / 4), computed on the
// fly from t (r = 320 values, L1-resident) so no intermediate buffer or extra launch is needed.
__global__ void __launch_bounds__(kBlockThreads) hc_mix_kernel(MixArgs a) {
  const int team = 1 << a.team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (kBlockThreads >> a.team_log2) +
                    (threadIdx.x >> a.team_log2);
  const int64_t ic = i < a.hidden ? i : a.hidden - 1;  // out-of-range teams compute, never store
  constexpr float kInvStreams = 1.0f / kStreams;       // 0.25: exact
  float acc[kStreams] = {0.0f, 0.0f, 0.0f, 0.0f};
  // acc[s] += W_up[row i + s*D, vector v] . silu(t[vector v] / 4) for the 4 streams.
  auto accumulate = [&](const uint4(&w)[kStreams], int v) {
    const float4 t0 = __ldg(reinterpret_cast<const float4*>(a.t) + 2 * v);
    const float4 t1 = __ldg(reinterpret_cast<const float4*>(a.t) + 2 * v + 1);
    const float u[8] = {dev::silu(t0.x * kInvStreams), dev::silu(t0.y * kInvStreams),
                        dev::silu(t0.z * kInvStreams), dev::silu(t0.w * kInvStreams),
                        dev::silu(t1.x * kInvStreams), dev::silu(t1.y * kInvStreams),
                        dev::silu(t1.z * kInvStreams), dev::silu(t1.w * kInvStreams)};
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
  if (blockIdx.x == 0 && threadIdx.x < kStreams && a.iota != nullptr)
    a.iota[threadIdx.x] = 2.0f / (1.0f + expf(-a.t[a.rank + threadIdx.x] * kInvStreams));
  if (lane != 0 || i >= a.hidden) return;
  float m = 0.0f;
#pragma unroll
  for (int s = 0; s < kStreams; ++s) {
    const float g = 1.0f / (1.0f + expf(-acc[s]));
    const uint16_t nb = a.n[i + s * a.hidden];
    m = fmaf(g, __uint_as_float(static_cast<uint32_t>(nb) << 16), m);
  }
  a.m[i] = dev::float_to_bf16_bits(m * kInvStreams);
}

bool aligned(const void* p, uintptr_t n) {
  return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0;
}

}  // namespace

void launch_group_rms_norm_1p(const GroupRmsNormParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_group_rms_norm_1p";
  FN_LAUNCH_REQUIRE(p.x != nullptr && p.weight != nullptr && p.out != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.num_groups >= 1 && p.group_size >= 4 && p.group_size % 4 == 0, kOp);
  FN_LAUNCH_REQUIRE(aligned(p.x, 16) && aligned(p.weight, 8) && aligned(p.out, 8), kOp);
  launch_pdl("group_rms_norm_1p_kernel", group_rms_norm_1p_kernel, p.num_groups, kBlockThreads, 0,
             stream, p.x, p.weight, p.out, p.group_size, p.eps);
  FN_CUDA_LAUNCH_CHECK("group_rms_norm_1p_kernel");
}

void launch_hc_mix(const HcMixParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_mix";
  FN_LAUNCH_REQUIRE(p.w_up != nullptr && p.t != nullptr && p.n != nullptr && p.m != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.hc_count == kStreams && p.hidden >= 1, kOp);
  FN_LAUNCH_REQUIRE(p.rank >= 8 && p.rank % 8 == 0 && p.rank <= (1 << 20), kOp);
  FN_LAUNCH_REQUIRE(aligned(p.w_up, 16) && aligned(p.t, 16), kOp);
  // Team: the narrowest power of two with <= 16 vectors per lane, widened while the grid has
  // fewer than 2 blocks per SM and lanes keep >= 4 vectors (as plan_gemv_bf16).
  const int64_t nvec = p.rank / 8, target = 2 * static_cast<int64_t>(detail::current_sm_count());
  auto blocks = [&](int t) { return (p.hidden + (kBlockThreads / t) - 1) / (kBlockThreads / t); };
  int team = 8;
  while (team < kBlockThreads && team * 16 < nvec) team *= 2;
  while (blocks(team) < target && team < kBlockThreads && nvec >= 4 * team) team *= 2;
  MixArgs a{p.w_up,
            p.t,
            p.n,
            p.m,
            p.iota,
            p.hidden,
            static_cast<int>(p.rank),
            static_cast<int>(nvec),
            __builtin_ctz(static_cast<unsigned>(team))};
  launch_pdl("hc_mix_kernel", hc_mix_kernel, static_cast<unsigned>(blocks(team)), kBlockThreads, 0,
             stream, a);
  FN_CUDA_LAUNCH_CHECK("hc_mix_kernel");
}

}  // namespace fn

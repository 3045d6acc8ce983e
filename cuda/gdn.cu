// Gated DeltaNet decode kernels (see gdn.h). Two launches: the conv must shift every channel's
// state exactly once, after every CTA that needs the channel's old state has read it, and q/k
// channels are read by all (Hv/Hk) * slices CTAs of a key head: the launch boundary is that
// ordering. The gated norm needs all of a head's dv columns, which several CTAs produce: the last
// CTA of the head to finish (integer arrival counter) normalises the whole head, so no third
// launch is needed and the summation order stays fixed.
#include "cuda/gdn.h"

#include <cuda_runtime.h>

#include <atomic>
#include <climits>

#include "comm/cuda_check.h"
#include "cuda/device_util.cuh"
#include "cuda/launch_check.h"

namespace fn {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRows = 4;  // state rows per thread (registers: kMaxRows float4)
constexpr int kMaxHeadDim = 1024;
constexpr int kMaxSlice = 32;  // dv columns per CTA
constexpr int kMaxConvKernel = 8;

// The CPU op's two-branch sigmoid (cpu::sigmoid): exp never overflows.
__device__ __forceinline__ float sigmoid2(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

__device__ __forceinline__ float softplus(float x) {
  return x > 20.0f ? x : log1pf(expf(x));
}

// Step 2: one thread per channel c: out = silu(w[K-1] * x + sum_j w[j] * hist[j]), then the
// pre-conv input is shifted into the history (oldest first; dilation 1 so L = K - 1).
__global__ void __launch_bounds__(kThreads)
    gdn_conv_kernel(const float* __restrict__ proj, const float* __restrict__ w,
                    float* __restrict__ conv_state, float* __restrict__ conv_out, int conv_dim,
                    int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The recurrence kernel (a programmatic dependent launch) may start streaming its state now;
  // it waits for this grid's completion before it reads conv_out.
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= conv_dim) return;
  const int L = K - 1;
  float* hist = conv_state + static_cast<int64_t>(c) * L;
  const float* wc = w + static_cast<int64_t>(c) * K;
  const float x = proj[c];
  float h[kMaxConvKernel - 1];
  float acc = wc[K - 1] * x;  // the CPU op's order: the current tap first, then oldest first
#pragma unroll
  for (int j = 0; j < kMaxConvKernel - 1; ++j) {
    if (j < L) {
      h[j] = hist[j];
      acc = fmaf(wc[j], h[j], acc);
    }
  }
#pragma unroll
  for (int j = 0; j + 1 < kMaxConvKernel - 1; ++j)
    if (j + 1 < L) hist[j] = h[j + 1];
  hist[L - 1] = x;
  conv_out[c] = dev::silu(acc);
}

struct RecArgs {
  const float* proj;
  const float* A_log;
  const float* dt_bias;
  const float* norm_w;
  const float* conv_out;
  float* state;
  float* o_scratch;
  unsigned int* counters;
  uint16_t* out;
  int Hk, Hv, dk, dv;
  int vc;     // dv columns per CTA
  int ratio;  // Hv / Hk
  int conv_dim;
  float eps;
};

// Sum of two values over the block in a fixed order (butterfly per warp, warps ascending); every
// thread gets both totals.
__device__ __forceinline__ void block_sum2(float& a, float& b) {
  __shared__ float part[2][kWarps];
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, off);
    b += __shfl_xor_sync(0xffffffffu, b, off);
  }
  if ((threadIdx.x & 31) == 0) {
    part[0][threadIdx.x >> 5] = a;
    part[1][threadIdx.x >> 5] = b;
  }
  __syncthreads();
  a = part[0][0];
  b = part[1][0];
  for (int w = 1; w < kWarps; ++w) {
    a += part[0][w];
    b += part[1][w];
  }
  __syncthreads();  // part may be reused
}

// Sums acc[c] (column cg*4 + c of the slice) over the row groups: butterfly over the lanes of a
// warp with the same cg (thread = rg * CG + cg), then warps ascending. col[t] for t < vc.
__device__ __forceinline__ void column_sum(float (&acc)[4], int CG, int vc,
                                           float (*part)[kMaxSlice], float* col) {
  for (int off = CG; off < 32; off <<= 1) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], off);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane < CG) {
#pragma unroll
    for (int c = 0; c < 4; ++c) part[warp][lane * 4 + c] = acc[c];
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < vc) {
    float s = part[0][threadIdx.x];
    for (int w = 1; w < kWarps; ++w) s += part[w][threadIdx.x];
    col[threadIdx.x] = s;
  }
  __syncthreads();
}

// Steps 3-7 for one (value head h, slice of vc columns): the CTA's state tile [dk, vc] lives in
// registers, thread (rg, cg) holding rows rg, rg + RG, ... and columns cg*4 .. cg*4+3.
__global__ void __launch_bounds__(kThreads) gdn_recurrent_kernel(RecArgs a) {
  __shared__ float qs[kMaxHeadDim], ks[kMaxHeadDim];
  __shared__ float part[kWarps][kMaxSlice];
  __shared__ float col[kMaxSlice], delta[kMaxSlice];
  __shared__ int is_last;
  const int slices = a.dv / a.vc;
  const int h = blockIdx.x / slices, sl = blockIdx.x - h * slices;
  const int i = h / a.ratio;  // repeat-interleave: value head h reads key head h / (Hv/Hk)
  const int tid = threadIdx.x;
  const int CG = a.vc >> 2, RG = kThreads / CG;
  const int cg = tid % CG, rg = tid / CG;
  const int col0 = sl * a.vc + cg * 4;
  float* S = a.state + static_cast<int64_t>(h) * a.dk * a.dv + col0;

  // The state tile first: its loads are the kernel's cost and overlap everything below.
  float4 s[kMaxRows];
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) {
    const int row = rg + j * RG;
    s[j] = row < a.dk ? *reinterpret_cast<const float4*>(S + static_cast<int64_t>(row) * a.dv)
                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Everything below reads what the conv kernel (or earlier work) wrote: wait for the conv grid
  // to complete and its writes to be visible (a no-op when not launched as a dependent).
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

  // Step 5: L2 norms of q_i and k_i (eps inside the rsqrt of the sum), q scaled by 1/sqrt(dk).
  float sq = 0.0f, sk = 0.0f;
  const float* q = a.conv_out + static_cast<int64_t>(i) * a.dk;
  const float* k = q + static_cast<int64_t>(a.Hk) * a.dk;
  for (int t = tid; t < a.dk; t += kThreads) {
    const float qv = q[t], kv = k[t];
    qs[t] = qv;
    ks[t] = kv;
    sq = fmaf(qv, qv, sq);
    sk = fmaf(kv, kv, sk);
  }
  block_sum2(sq, sk);  // also the barrier for qs / ks
  const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
  const float q_scale = 1.0f / sqrtf(static_cast<float>(a.dk));

  // Step 4: gates of head h.
  const float* ab = a.proj + a.conv_dim + static_cast<int64_t>(a.Hv) * a.dv;
  const float beta = sigmoid2(ab[a.Hv + h]);
  const float g = -expf(a.A_log[h]) * softplus(ab[h] + a.dt_bias[h]);
  const float decay = expf(g);

  // Step 6: S *= exp(g); r = S^T kh; delta = beta (v - r); S += kh delta^T; o = S^T qh.
  float kh[kMaxRows], qh[kMaxRows];
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) {
    const int row = rg + j * RG;
    kh[j] = row < a.dk ? ks[row] * rk : 0.0f;
    qh[j] = row < a.dk ? qs[row] * rq * q_scale : 0.0f;
    s[j].x *= decay;
    s[j].y *= decay;
    s[j].z *= decay;
    s[j].w *= decay;
    acc[0] = fmaf(s[j].x, kh[j], acc[0]);
    acc[1] = fmaf(s[j].y, kh[j], acc[1]);
    acc[2] = fmaf(s[j].z, kh[j], acc[2]);
    acc[3] = fmaf(s[j].w, kh[j], acc[3]);
  }
  column_sum(acc, CG, a.vc, part, col);
  if (tid < a.vc) {
    const float v = a.conv_out[2 * static_cast<int64_t>(a.Hk) * a.dk +
                               static_cast<int64_t>(h) * a.dv + sl * a.vc + tid];
    delta[tid] = beta * (v - col[tid]);
  }
  __syncthreads();
  const float d0 = delta[cg * 4], d1 = delta[cg * 4 + 1], d2 = delta[cg * 4 + 2],
              d3 = delta[cg * 4 + 3];
  acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) {
    const int row = rg + j * RG;
    s[j].x = fmaf(kh[j], d0, s[j].x);
    s[j].y = fmaf(kh[j], d1, s[j].y);
    s[j].z = fmaf(kh[j], d2, s[j].z);
    s[j].w = fmaf(kh[j], d3, s[j].w);
    if (row < a.dk) *reinterpret_cast<float4*>(S + static_cast<int64_t>(row) * a.dv) = s[j];
    acc[0] = fmaf(s[j].x, qh[j], acc[0]);
    acc[1] = fmaf(s[j].y, qh[j], acc[1]);
    acc[2] = fmaf(s[j].z, qh[j], acc[2]);
    acc[3] = fmaf(s[j].w, qh[j], acc[3]);
  }
  column_sum(acc, CG, a.vc, part, col);
  float* o = a.o_scratch + static_cast<int64_t>(h) * a.dv;
  if (tid < a.vc) {
    o[sl * a.vc + tid] = col[tid];
    __threadfence();  // visible to the head's last CTA before the arrival below
  }
  __syncthreads();
  if (tid == 0) {
    const unsigned int prev = atomicAdd(a.counters + h, 1u);
    is_last = prev == static_cast<unsigned int>(slices - 1);
    if (is_last) {
      a.counters[h] = 0u;  // ready for the next launch (stream order)
      __threadfence();
    }
  }
  __syncthreads();
  if (!is_last) return;

  // Step 7 (last CTA of head h): o * rsqrt(mean(o^2) + eps) * w * sigmoid(z) -> BF16.
  float ss = 0.0f, unused = 0.0f;
  for (int t = tid; t < a.dv; t += kThreads) {
    const float ov = __ldcg(o + t);
    ss = fmaf(ov, ov, ss);
  }
  block_sum2(ss, unused);
  const float mean = ss / static_cast<float>(a.dv);
  const float rs = 1.0f / sqrtf(mean + a.eps);
  const float* z = a.proj + a.conv_dim + static_cast<int64_t>(h) * a.dv;
  uint16_t* out = a.out + static_cast<int64_t>(h) * a.dv;
  for (int t = tid; t < a.dv; t += kThreads) {
    const float y = __ldcg(o + t) * rs * a.norm_w[t] * sigmoid2(z[t]);
    out[t] = dev::float_to_bf16_bits(y);
  }
}

void check_params(const GdnDecodeParams& p) {
  constexpr const char* kOp = "launch_gdn_decode";
  FN_LAUNCH_REQUIRE(p.proj != nullptr && p.conv_weight != nullptr && p.A_log != nullptr &&
                        p.dt_bias != nullptr && p.norm_weight != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.conv_state != nullptr && p.state != nullptr && p.out != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.conv_out != nullptr && p.o_scratch != nullptr && p.head_counters != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(
      p.num_k_heads >= 1 && p.num_v_heads >= p.num_k_heads && p.num_v_heads % p.num_k_heads == 0,
      kOp);
  FN_LAUNCH_REQUIRE(p.k_head_dim >= 4 && p.k_head_dim <= kMaxHeadDim && p.k_head_dim % 4 == 0, kOp);
  FN_LAUNCH_REQUIRE(p.v_head_dim >= 4 && p.v_head_dim <= kMaxHeadDim && p.v_head_dim % 4 == 0, kOp);
  FN_LAUNCH_REQUIRE(p.conv_kernel >= 2 && p.conv_kernel <= kMaxConvKernel, kOp);
  const int64_t conv_dim =
      2 * int64_t{p.num_k_heads} * p.k_head_dim + int64_t{p.num_v_heads} * p.v_head_dim;
  FN_LAUNCH_REQUIRE(conv_dim + 2 * int64_t{p.num_v_heads} * (p.v_head_dim + 1) < INT_MAX, kOp);
  FN_LAUNCH_REQUIRE((reinterpret_cast<uintptr_t>(p.state) & 15u) == 0, kOp);
  FN_LAUNCH_REQUIRE(p.eps >= 0.0f, kOp);
}

// Whether the current device supports programmatic dependent launch (sm_90+), cached per
// device so launches during stream capture make no query after the first.
bool device_has_pdl() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
  int dev = 0;
  FN_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return false;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0;
    FN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    v = major >= 9 ? 2 : 1;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

}  // namespace

int plan_gdn_decode_slice(const GdnDecodeParams& p) {
  check_params(p);
  const int dk = p.k_head_dim, dv = p.v_head_dim;
  int vc = kMaxSlice;
  while (dv % vc != 0) vc /= 2;  // dv % 4 == 0, so this stops at 4 at the latest
  // Rows per thread: dk / (kThreads / (vc / 4)) must be <= kMaxRows.
  while (vc > 4 && dk * vc > kMaxRows * kThreads * 4) vc /= 2;
  // Enough CTAs to have every SM stream (>= 2 per SM), keeping >= 32-byte row segments.
  const int64_t target = 2 * static_cast<int64_t>(detail::current_sm_count());
  while (vc > 8 && int64_t{p.num_v_heads} * (dv / vc) < target) vc /= 2;
  FN_LAUNCH_REQUIRE(dk * vc <= kMaxRows * kThreads * 4, "plan_gdn_decode_slice");
  return vc;
}

void launch_gdn_decode(const GdnDecodeParams& p, cudaStream_t stream) {
  const int vc = plan_gdn_decode_slice(p);  // also checks the parameters
  const int Hk = p.num_k_heads, Hv = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
  const int conv_dim = 2 * Hk * dk + Hv * dv;
  gdn_conv_kernel<<<(conv_dim + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      p.proj, p.conv_weight, p.conv_state, p.conv_out, conv_dim, p.conv_kernel);
  FN_CUDA_LAUNCH_CHECK("gdn_conv_kernel");
  RecArgs a{p.proj,     p.A_log, p.dt_bias,   p.norm_weight,
            p.conv_out, p.state, p.o_scratch, p.head_counters,
            p.out,      Hk,      Hv,          dk,
            dv,         vc,      Hv / Hk,     conv_dim,
            p.eps};
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(Hv * (dv / vc)));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.overlap_launch && device_has_pdl() ? 1 : 0;
  FN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gdn_recurrent_kernel, a));
  FN_CUDA_LAUNCH_CHECK("gdn_recurrent_kernel");
}

}  // namespace fn

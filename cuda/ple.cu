// PLE kernels (see ple.h): n-gram gather, context shift, and the fused steps 2-8 of MODEL.md §C.4.
// The ids replicate core/ngram.cpp exactly (wrap-around uint64 products, floor-mod). The apply
// kernel keeps one block per stream: three fixed-order block reductions (sum of squares of K and
// H, the K.Q dot, the sum of squares of Gv), then the elementwise conv step and residual add.
#include "cuda/ple.h"

#include <cuda_runtime.h>

#include <cmath>

#include "comm/cuda_check.h"
#include "cuda/device_util.cuh"
#include "cuda/launch_check.h"
#include "cuda/pdl.cuh"

namespace fn {
namespace {

constexpr int kGatherThreads = 128;
constexpr int kApplyThreads = 1024;

__device__ __forceinline__ int64_t wrap_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

__device__ __forceinline__ int64_t floor_mod(int64_t a, int64_t m) {
  const int64_t r = a % m;
  return r < 0 ? r + m : r;
}

// float8_e4m3fn code -> float, exact (bias 7, no infinities, 0x7f/0xff NaN, exponent 0
// subnormal: m * 2^-9), as core/codecs.h e4m3_to_float.
__device__ __forceinline__ float e4m3_value(uint32_t b) {
  const uint32_t sign = (b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  if (e == 15u && m == 7u) return __uint_as_float(sign | 0x7fc00000u);
  if (e == 0u) return __uint_as_float(sign | __float_as_uint(static_cast<float>(m) * 0.001953125f));
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// One block per head h: every thread hashes (a handful of int64 ops, no sync needed), then the
// block copies the row.
__global__ void __launch_bounds__(kGatherThreads) ngram_gather_kernel(const NgramGatherParams p) {
  dev::pdl_begin();  // token, context, kv, H: from earlier kernels (cuda/pdl.cuh)
  const int h = blockIdx.x;
  const int64_t token = static_cast<int64_t>(__ldg(p.token));
  const int ctx_len = p.ngram_size - 1;
  const int order = h / p.heads_per_ngram + 1;  // head h mixes s_0 .. s_order
  // s[0] = the token, s[j] = the token j back, EOS once an EOS has been met looking back.
  int64_t mix = wrap_mul(token, p.multipliers[0]);
  bool behind_eos = false;
  for (int j = 1; j <= order; ++j) {
    const int64_t s = behind_eos ? p.eos : __ldg(p.context + (ctx_len - j));
    if (s == p.eos) behind_eos = true;
    mix ^= wrap_mul(s, p.multipliers[j]);
  }
  const int64_t id = floor_mod(mix, p.head_sizes[h]) + p.head_offsets[h];
  const int64_t r = id - p.first_row;
  const bool held = r >= 0 && r < p.row_count;
  float* out = p.out + static_cast<int64_t>(h) * p.head_dim;
  for (int j = threadIdx.x; j < p.head_dim; j += kGatherThreads) {
    float v = 0.0f;
    if (held) {
      const int64_t k = r * p.head_dim + j;
      if (p.fp8) {
        v = e4m3_value(__ldg(p.rows + k)) * p.scale;
      } else {
        const uint16_t bits = __ldg(reinterpret_cast<const uint16_t*>(p.rows) + k);
        v = __uint_as_float(static_cast<uint32_t>(bits) << 16) * p.scale;
      }
    }
    out[j] = v;
  }
}

__global__ void ngram_context_advance_kernel(int64_t* context, int n, const int32_t* token) {
  dev::pdl_begin();  // token, context, kv, H: from earlier kernels (cuda/pdl.cuh)
  for (int i = 0; i + 1 < n; ++i) context[i] = context[i + 1];
  context[n - 1] = static_cast<int64_t>(*token);
}

// Block-wide FP32 sums of kN values in a fixed order (butterfly per warp, then the warps
// ascending); every thread receives the totals. `slots` and `totals` are distinct per call site.
template <int kN>
__device__ __forceinline__ void block_sum(float (&v)[kN], float (&slots)[kApplyThreads / 32][kN],
                                          float (&totals)[kN]) {
#pragma unroll
  for (int r = 0; r < kN; ++r)
    for (int off = 16; off > 0; off >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], off);
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int r = 0; r < kN; ++r) slots[threadIdx.x >> 5][r] = v[r];
  }
  __syncthreads();
  if (threadIdx.x < kN) {
    float s = slots[0][threadIdx.x];
    for (int w = 1; w < kApplyThreads / 32; ++w) s += slots[w][threadIdx.x];
    totals[threadIdx.x] = s;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kN; ++r) v[r] = totals[r];
}

// 1 / sqrt(mean + eps) of a sum of squares over n values (as cpu inv_rms, in FP32).
__device__ __forceinline__ float inv_rms(float sum_sq, float n, float eps) {
  return 1.0f / sqrtf(sum_sq / n + eps);
}

// One block per stream s (blockIdx.x).
__global__ void __launch_bounds__(kApplyThreads)
    ple_apply_kernel(const PleApplyParams p, float inv_sqrt_p) {
  dev::pdl_begin();  // token, context, kv, H: from earlier kernels (cuda/pdl.cuh)
  __shared__ float slots1[kApplyThreads / 32][2], slots2[kApplyThreads / 32][1],
      slots3[kApplyThreads / 32][1];
  __shared__ float tot1[2], tot2[1], tot3[1];
  const int64_t P = p.dim;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * P;
  const float* kraw = p.kv + base;
  const float* V = p.kv + static_cast<int64_t>(p.hc_count) * P;
  float* H = p.H + base;
  const float* wk = p.norm_key + base;
  const float* wq = p.norm_query + base;
  const float* wc = p.norm_conv + base;
  const float n = static_cast<float>(P);

  // Step 2-3 norms: sums of squares of the raw key projection and of H (before the addition).
  float r1[2] = {0.0f, 0.0f};
  for (int64_t i = threadIdx.x; i < P; i += kApplyThreads) {
    const float k = kraw[i], h = H[i];
    r1[0] = fmaf(k, k, r1[0]);
    r1[1] = fmaf(h, h, r1[1]);
  }
  block_sum<2>(r1, slots1, tot1);
  const float sk = inv_rms(r1[0], n, p.eps), sq = inv_rms(r1[1], n, p.eps);

  // Step 4: gamma = <K, Q> / sqrt(P) with K, Q rounded as the CPU op rounds them.
  float r2[1] = {0.0f};
  for (int64_t i = threadIdx.x; i < P; i += kApplyThreads) {
    const float k = kraw[i] * sk * (1.0f + wk[i]);
    const float q = H[i] * sq * (1.0f + wq[i]);
    r2[0] = fmaf(k, q, r2[0]);
  }
  block_sum<1>(r2, slots2, tot2);
  const float gamma = r2[0] * inv_sqrt_p;
  const float sign = gamma > 0.0f ? 1.0f : (gamma < 0.0f ? -1.0f : 0.0f);
  const float gt = sign * sqrtf(fmaxf(fabsf(gamma), 1e-6f));
  const float gate = 1.0f / (1.0f + expf(-gt));

  // Step 6 norm: sum of squares of Gv = gate * V.
  float r3[1] = {0.0f};
  for (int64_t i = threadIdx.x; i < P; i += kApplyThreads) {
    const float g = gate * V[i];
    r3[0] = fmaf(g, g, r3[0]);
  }
  block_sum<1>(r3, slots3, tot3);
  const float sc = inv_rms(r3[0], n, p.eps);

  // Steps 6-8 per channel c = s*P + i: Nc, the dilated conv over the state, shift, H += Gv + conv.
  const int K = p.conv_kernel, d = p.dilation, L = (K - 1) * d;
  for (int64_t i = threadIdx.x; i < P; i += kApplyThreads) {
    const int64_t c = base + i;
    const float g = gate * V[i];
    const float nc = g * sc * (1.0f + wc[i]);
    const float* w = p.conv + c * K;
    float* st = p.conv_state + c * L;
    float acc = w[K - 1] * nc;
    for (int j = 0; j + 1 < K; ++j) acc = fmaf(w[j], st[L - d * (K - 1 - j)], acc);
    if (L > 0) {
      for (int m = 0; m + 1 < L; ++m) st[m] = st[m + 1];
      st[L - 1] = nc;
    }
    const float conv = dev::silu(acc);
    H[i] = H[i] + (g + conv);
  }
}

}  // namespace

void launch_ngram_gather(const NgramGatherParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_ngram_gather";
  FN_LAUNCH_REQUIRE(p.token != nullptr && p.context != nullptr && p.out != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.row_count >= 0 && (p.row_count == 0 || p.rows != nullptr), kOp);
  FN_LAUNCH_REQUIRE(p.ngram_size >= 2 && p.ngram_size <= 8, kOp);
  FN_LAUNCH_REQUIRE(p.num_multipliers == p.ngram_size, kOp);
  FN_LAUNCH_REQUIRE(p.heads_per_ngram >= 1 && p.num_heads >= 1 && p.num_heads <= 32, kOp);
  FN_LAUNCH_REQUIRE(p.num_heads == (p.ngram_size - 1) * p.heads_per_ngram, kOp);
  FN_LAUNCH_REQUIRE(p.head_dim >= 1 && p.eos >= 0, kOp);
  FN_LAUNCH_REQUIRE(p.fp8 || (reinterpret_cast<uintptr_t>(p.rows) & 1) == 0, kOp);
  for (int h = 0; h < p.num_heads; ++h) FN_LAUNCH_REQUIRE(p.head_sizes[h] >= 1, kOp);
  launch_pdl("ngram_gather_kernel", ngram_gather_kernel, static_cast<unsigned>(p.num_heads),
             kGatherThreads, 0, stream, p);
  FN_CUDA_LAUNCH_CHECK("ngram_gather_kernel");
}

void launch_ngram_context_advance(const NgramContextAdvanceParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_ngram_context_advance";
  FN_LAUNCH_REQUIRE(p.context != nullptr && p.token != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.ngram_size >= 2 && p.ngram_size <= 8, kOp);
  launch_pdl("ngram_context_advance_kernel", ngram_context_advance_kernel, 1, 1, 0, stream,
             p.context, p.ngram_size - 1, p.token);
  FN_CUDA_LAUNCH_CHECK("ngram_context_advance_kernel");
}

void launch_ple_apply(const PleApplyParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_ple_apply";
  FN_LAUNCH_REQUIRE(p.kv != nullptr && p.H != nullptr && p.conv != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.norm_key != nullptr && p.norm_query != nullptr && p.norm_conv != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.hc_count >= 1 && p.hc_count <= 64, kOp);
  FN_LAUNCH_REQUIRE(p.dim >= 1 && p.dim <= (int64_t{1} << 20), kOp);
  FN_LAUNCH_REQUIRE(p.conv_kernel >= 1 && p.conv_kernel <= 16, kOp);
  FN_LAUNCH_REQUIRE(p.dilation >= 1 && p.dilation <= 16, kOp);
  FN_LAUNCH_REQUIRE(p.conv_kernel == 1 || p.conv_state != nullptr, kOp);
  const float inv_sqrt_p = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.dim)));
  launch_pdl("ple_apply_kernel", ple_apply_kernel, static_cast<unsigned>(p.hc_count), kApplyThreads,
             0, stream, p, inv_sqrt_p);
  FN_CUDA_LAUNCH_CHECK("ple_apply_kernel");
}

}  // namespace fn

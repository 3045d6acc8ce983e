// Row-parallel kernels of the batched prefill (see prefill_ops.h).
#include "cuda/kernels/prefill_ops.h"

#include <cuda_runtime.h>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/kernels/moe_device.cuh"

namespace fn {
namespace {

constexpr int kThreads = 256;

dim3 grid_rows(int64_t cols, int64_t rows) {
  const int64_t b = (cols + kThreads - 1) / kThreads;
  return dim3(static_cast<unsigned>(b < 1 ? 1 : b), static_cast<unsigned>(rows));
}

__device__ __forceinline__ float bf16f(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ void split(float x, uint16_t* hi, uint16_t* lo, int64_t i) {
  const uint16_t h = dev::float_to_bf16_bits(x);
  hi[i] = h;
  if (lo != nullptr) lo[i] = dev::float_to_bf16_bits(x - bf16f(h));
}

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

__global__ void __launch_bounds__(kThreads)
    split_kernel(const float* x, int64_t n, uint16_t* hi, uint16_t* lo) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    split(x[i], hi, lo, i);
}

__global__ void __launch_bounds__(kThreads)
    embed_rows_kernel(const uint16_t* table, int64_t vocab, int64_t D, int hc,
                      const int32_t* tokens, float* H, int32_t* flag) {
  const int64_t p = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int32_t t = tokens[p];
  const bool ok = t >= 0 && static_cast<int64_t>(t) < vocab;
  if (!ok && i == 0) *flag = 1;
  if (i >= D) return;
  const float v = ok ? bf16f(table[static_cast<int64_t>(t) * D + i]) : 0.0f;
  float* row = H + p * hc * D;
  for (int s = 0; s < hc; ++s) row[s * D + i] = v;
}

// One CTA per (stream s = blockIdx.x, row p = blockIdx.y).
__global__ void __launch_bounds__(kThreads)
    hc_norm_rows_kernel(const float* H, const uint16_t* norm, int hc, int64_t D, float eps,
                        float* scale, uint16_t* n_hi, uint16_t* n_lo) {
  const int s = blockIdx.x;
  const int64_t p = blockIdx.y;
  const int64_t W = hc * D;
  const float* h = H + p * W + s * D;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += kThreads) acc = fmaf(h[i], h[i], acc);
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  __shared__ float warp_sum[kThreads / 32];
  __shared__ float sc;
  if ((threadIdx.x & 31) == 0) warp_sum[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) t += warp_sum[w];
    sc = rsqrtf(t / static_cast<float>(D) + eps);
    scale[p * hc + s] = sc;
  }
  __syncthreads();
  const float f = sc;
  for (int64_t i = threadIdx.x; i < D; i += kThreads) {
    const float n = h[i] * f * (1.0f + bf16f(norm[s * D + i]));
    split(n, n_hi, n_lo, p * W + s * D + i);
  }
}

__global__ void __launch_bounds__(kThreads)
    hc_act_rows_kernel(const float* t, int64_t ld_t, int64_t R, int hc, uint16_t* u_hi,
                       uint16_t* u_lo, float* iota) {
  const int64_t p = blockIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const float inv = 1.0f / static_cast<float>(hc);
  if (j < R) {
    split(dev::silu(t[p * ld_t + j] * inv), u_hi, u_lo, p * R + j);
  } else if (iota != nullptr && j < R + hc) {
    const float x = t[p * ld_t + j] * inv;
    iota[p * hc + (j - R)] = 2.0f / (1.0f + expf(-x));
  }
}

__global__ void __launch_bounds__(kThreads)
    hc_mix_rows_kernel(const float* g, const float* H, const float* scale, const uint16_t* norm,
                       int hc, int64_t D, uint16_t* m_hi, uint16_t* m_lo) {
  const int64_t p = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= D) return;
  const int64_t W = hc * D;
  float m = 0.0f;
  for (int s = 0; s < hc; ++s) {
    const float n = H[p * W + s * D + i] * scale[p * hc + s] * (1.0f + bf16f(norm[s * D + i]));
    m = fmaf(sigmoid(g[p * W + s * D + i]), n, m);
  }
  m *= 1.0f / static_cast<float>(hc);
  split(m, m_hi, m_lo, p * D + i);
}

__global__ void __launch_bounds__(kThreads)
    hc_inject_rows_kernel(float* H, const float* iota, const float* y, int hc, int64_t D) {
  const int64_t p = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= D) return;
  const float yi = y[p * D + i];
  float* row = H + p * hc * D;
  for (int s = 0; s < hc; ++s)
    row[s * D + i] = __fadd_rn(row[s * D + i], __fmul_rn(iota[p * hc + s], yi));
}

__global__ void __launch_bounds__(kThreads)
    swiglu_rows_kernel(const float* gu, int64_t I, uint16_t* h) {
  const int64_t p = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= I) return;
  const float* r = gu + p * 2 * I;
  h[p * I + i] = dev::swiglu_bf16_bits(r[i], r[I + i]);
}

__global__ void __launch_bounds__(kThreads)
    combine_rows_kernel(float* y, const float* ys, const float* gate, int64_t ld_gate, int64_t D) {
  const int64_t p = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= D) return;
  const float gamma = dev::sigmoid_2branch(gate[p * ld_gate]);
  y[p * D + i] = fmaf(gamma, ys[p * D + i], y[p * D + i]);
}

// y[p, i] (+)= s[p, i] + s[m + p, i]: the hi and lo halves of a stacked GEMM (gemm_rows).
__global__ void __launch_bounds__(kThreads)
    sum_halves_kernel(const float* s, int64_t m, int64_t n, float* y, int64_t ldy, bool acc) {
  const int64_t p = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const float hi = s[p * n + i], lo = s[(m + p) * n + i];
  float* out = y + p * ldy + i;
  *out = acc ? (*out + hi) + lo : hi + lo;
}

constexpr int64_t kMaxGridY = 65535;

// Launches `body(first_row, rows)` over row groups that fit gridDim.y.
template <class F>
void for_row_groups(int64_t rows, F&& body) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxGridY) {
    const int64_t n = rows - r0 < kMaxGridY ? rows - r0 : kMaxGridY;
    body(r0, n);
  }
}

}  // namespace

void launch_split_bf16(const float* x, int64_t count, uint16_t* hi, uint16_t* lo,
                       cudaStream_t stream) {
  constexpr const char* kOp = "launch_split_bf16";
  FN_LAUNCH_REQUIRE(x != nullptr && hi != nullptr && count >= 1, kOp);
  const int64_t b = (count + kThreads - 1) / kThreads;
  split_kernel<<<static_cast<unsigned>(b < 4096 ? b : 4096), kThreads, 0, stream>>>(x, count, hi,
                                                                                    lo);
  FN_CUDA_LAUNCH_CHECK("split_kernel");
}

void launch_embed_rows(const uint16_t* table, int64_t vocab, int64_t hidden, int hc_count,
                       const int32_t* tokens, int64_t rows, float* H, int32_t* error_flag,
                       cudaStream_t stream) {
  constexpr const char* kOp = "launch_embed_rows";
  FN_LAUNCH_REQUIRE(table != nullptr && tokens != nullptr && H != nullptr && error_flag != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(vocab >= 1 && hidden >= 1 && hc_count >= 1 && rows >= 1, kOp);
  for_row_groups(rows, [&](int64_t r0, int64_t n) {
    embed_rows_kernel<<<grid_rows(hidden, n), kThreads, 0, stream>>>(
        table, vocab, hidden, hc_count, tokens + r0, H + r0 * hc_count * hidden, error_flag);
    FN_CUDA_LAUNCH_CHECK("embed_rows_kernel");
  });
}

void launch_hc_norm_rows(const float* H, const uint16_t* norm, int hc_count, int64_t hidden,
                         float eps, int64_t rows, float* scale, uint16_t* n_hi, uint16_t* n_lo,
                         cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_norm_rows";
  FN_LAUNCH_REQUIRE(H != nullptr && norm != nullptr && scale != nullptr && n_hi != nullptr, kOp);
  FN_LAUNCH_REQUIRE(hc_count >= 1 && hidden >= 1 && rows >= 1, kOp);
  const int64_t W = hc_count * hidden;
  for_row_groups(rows, [&](int64_t r0, int64_t n) {
    hc_norm_rows_kernel<<<dim3(static_cast<unsigned>(hc_count), static_cast<unsigned>(n)), kThreads,
                          0, stream>>>(H + r0 * W, norm, hc_count, hidden, eps,
                                       scale + r0 * hc_count, n_hi + r0 * W,
                                       n_lo ? n_lo + r0 * W : nullptr);
    FN_CUDA_LAUNCH_CHECK("hc_norm_rows_kernel");
  });
}

void launch_hc_act_rows(const float* t, int64_t ld_t, int64_t rank, int hc_count, int64_t rows,
                        uint16_t* u_hi, uint16_t* u_lo, float* iota, cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_act_rows";
  FN_LAUNCH_REQUIRE(t != nullptr && u_hi != nullptr, kOp);
  FN_LAUNCH_REQUIRE(rank >= 1 && hc_count >= 1 && rows >= 1, kOp);
  FN_LAUNCH_REQUIRE(ld_t >= rank + (iota != nullptr ? hc_count : 0), kOp);
  for_row_groups(rows, [&](int64_t r0, int64_t n) {
    hc_act_rows_kernel<<<grid_rows(rank + hc_count, n), kThreads, 0, stream>>>(
        t + r0 * ld_t, ld_t, rank, hc_count, u_hi + r0 * rank, u_lo ? u_lo + r0 * rank : nullptr,
        iota ? iota + r0 * hc_count : nullptr);
    FN_CUDA_LAUNCH_CHECK("hc_act_rows_kernel");
  });
}

void launch_hc_mix_rows(const float* g, const float* H, const float* scale, const uint16_t* norm,
                        int hc_count, int64_t hidden, int64_t rows, uint16_t* m_hi, uint16_t* m_lo,
                        cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_mix_rows";
  FN_LAUNCH_REQUIRE(
      g != nullptr && H != nullptr && scale != nullptr && norm != nullptr && m_hi != nullptr, kOp);
  FN_LAUNCH_REQUIRE(hc_count >= 1 && hidden >= 1 && rows >= 1, kOp);
  const int64_t W = hc_count * hidden;
  for_row_groups(rows, [&](int64_t r0, int64_t n) {
    hc_mix_rows_kernel<<<grid_rows(hidden, n), kThreads, 0, stream>>>(
        g + r0 * W, H + r0 * W, scale + r0 * hc_count, norm, hc_count, hidden, m_hi + r0 * hidden,
        m_lo ? m_lo + r0 * hidden : nullptr);
    FN_CUDA_LAUNCH_CHECK("hc_mix_rows_kernel");
  });
}

void launch_hc_inject_rows(float* H, const float* iota, const float* y, int hc_count,
                           int64_t hidden, int64_t rows, cudaStream_t stream) {
  constexpr const char* kOp = "launch_hc_inject_rows";
  FN_LAUNCH_REQUIRE(H != nullptr && iota != nullptr && y != nullptr, kOp);
  FN_LAUNCH_REQUIRE(hc_count >= 1 && hidden >= 1 && rows >= 1, kOp);
  const int64_t W = hc_count * hidden;
  for_row_groups(rows, [&](int64_t r0, int64_t n) {
    hc_inject_rows_kernel<<<grid_rows(hidden, n), kThreads, 0, stream>>>(
        H + r0 * W, iota + r0 * hc_count, y + r0 * hidden, hc_count, hidden);
    FN_CUDA_LAUNCH_CHECK("hc_inject_rows_kernel");
  });
}

void launch_swiglu_rows(const float* gate_up, int64_t inter, int64_t rows, uint16_t* h,
                        cudaStream_t stream) {
  constexpr const char* kOp = "launch_swiglu_rows";
  FN_LAUNCH_REQUIRE(gate_up != nullptr && h != nullptr && inter >= 1 && rows >= 1, kOp);
  for_row_groups(rows, [&](int64_t r0, int64_t n) {
    swiglu_rows_kernel<<<grid_rows(inter, n), kThreads, 0, stream>>>(gate_up + r0 * 2 * inter,
                                                                     inter, h + r0 * inter);
    FN_CUDA_LAUNCH_CHECK("swiglu_rows_kernel");
  });
}

void launch_moe_combine_rows(float* y, const float* ys, const float* gate, int64_t ld_gate,
                             int64_t hidden, int64_t rows, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_combine_rows";
  FN_LAUNCH_REQUIRE(y != nullptr && ys != nullptr && gate != nullptr, kOp);
  FN_LAUNCH_REQUIRE(ld_gate >= 1 && hidden >= 1 && rows >= 1, kOp);
  for_row_groups(rows, [&](int64_t r0, int64_t n) {
    combine_rows_kernel<<<grid_rows(hidden, n), kThreads, 0, stream>>>(
        y + r0 * hidden, ys + r0 * hidden, gate + r0 * ld_gate, ld_gate, hidden);
    FN_CUDA_LAUNCH_CHECK("combine_rows_kernel");
  });
}

void launch_sum_stacked_halves(const float* stacked, int64_t m, int64_t n, float* y, int64_t ldy,
                               bool accumulate, cudaStream_t stream) {
  constexpr const char* kOp = "launch_sum_stacked_halves";
  FN_LAUNCH_REQUIRE(stacked != nullptr && y != nullptr && m >= 1 && n >= 1 && ldy >= n, kOp);
  for_row_groups(m, [&](int64_t r0, int64_t rows) {
    sum_halves_kernel<<<grid_rows(n, rows), kThreads, 0, stream>>>(stacked + r0 * n, m, n,
                                                                   y + r0 * ldy, ldy, accumulate);
    FN_CUDA_LAUNCH_CHECK("sum_halves_kernel");
  });
}

}  // namespace fn

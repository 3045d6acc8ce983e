// PLE kernels (see ple.h): n-gram gather, context shift, and the fused steps 2-8 of docs/model.md
// §C.4. The ids replicate core/ngram.cpp exactly (wrap-around uint64 products, floor-mod). The
// apply kernel keeps one block per stream: three fixed-order block reductions (sum of squares of K
// and H, the K.Q dot, the sum of squares of Gv), then the elementwise conv step and residual add.
// The rows versions run the same per-stream reductions per (row, stream), keep only each row's gate
// and conv-norm scale, and recompute Gv and Nc of earlier rows from kv where the conv needs them
// (scratch of 2 floats per row and stream instead of two [rows, S*P] buffers).
#include "cuda/kernels/ple.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"

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

// The n-gram id of head h for `token`; back(j) gives the raw id j positions before the token
// (j = 1..ngram_size-1). s[0] = the token, s[j] = the token j back, EOS once an EOS has been met
// looking back (docs/model.md §C.4).
template <typename Back>
__device__ __forceinline__ int64_t ngram_head_id(const NgramGatherParams& p, int h, int64_t token,
                                                 Back back) {
  const int order = h / p.heads_per_ngram + 1;  // head h mixes s_0 .. s_order
  int64_t mix = wrap_mul(token, p.multipliers[0]);
  bool behind_eos = false;
  for (int j = 1; j <= order; ++j) {
    const int64_t s = behind_eos ? p.eos : back(j);
    if (s == p.eos) behind_eos = true;
    mix ^= wrap_mul(s, p.multipliers[j]);
  }
  return floor_mod(mix, p.head_sizes[h]) + p.head_offsets[h];
}

// The block copies row `id` (value * scale, 0 when not held here) to out[0..head_dim).
__device__ __forceinline__ void ngram_copy_row(const NgramGatherParams& p, int64_t id, float* out) {
  const int64_t r = id - p.first_row;
  const bool held = r >= 0 && r < p.row_count;
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

// One block per head h: every thread hashes (a handful of int64 ops, no sync needed), then the
// block copies the row.
__global__ void __launch_bounds__(kGatherThreads) ngram_gather_kernel(const NgramGatherParams p) {
  dev::pdl_begin();  // token, context, kv, H: from earlier kernels (cuda/common/pdl.cuh)
  const int h = blockIdx.x;
  const int64_t token = static_cast<int64_t>(__ldg(p.token));
  const int ctx_len = p.ngram_size - 1;
  const int64_t id =
      ngram_head_id(p, h, token, [&](int j) { return __ldg(p.context + (ctx_len - j)); });
  ngram_copy_row(p, id, p.out + static_cast<int64_t>(h) * p.head_dim);
}

// One block per (row, head), blockIdx.x = row * num_heads + h. Row p looks back through
// tokens[p-1], tokens[p-2], ... and then the device context (newest last).
__global__ void __launch_bounds__(kGatherThreads)
    ngram_gather_rows_kernel(const NgramGatherParams p, const int32_t* tokens, float* out) {
  dev::pdl_begin();  // tokens, context: from earlier kernels (cuda/common/pdl.cuh)
  const int64_t row = blockIdx.x / p.num_heads;
  const int h = static_cast<int>(blockIdx.x % p.num_heads);
  const int64_t token = static_cast<int64_t>(__ldg(tokens + row));
  const int ctx_len = p.ngram_size - 1;
  const int64_t id = ngram_head_id(p, h, token, [&](int j) -> int64_t {
    const int64_t q = row - j;  // index into tokens; negative: into the context
    return q >= 0 ? static_cast<int64_t>(__ldg(tokens + q)) : __ldg(p.context + (ctx_len + q));
  });
  ngram_copy_row(p, id, out + (row * p.num_heads + h) * static_cast<int64_t>(p.head_dim));
}

__global__ void ngram_context_advance_kernel(int64_t* context, int n, const int32_t* token) {
  dev::pdl_begin();  // token, context, kv, H: from earlier kernels (cuda/common/pdl.cuh)
  for (int i = 0; i + 1 < n; ++i) context[i] = context[i + 1];
  context[n - 1] = static_cast<int64_t>(*token);
}

// The context after `rows` tokens: the last n ids of (context, tokens). Reads all before writing.
__global__ void ngram_context_advance_rows_kernel(int64_t* context, int n, const int32_t* tokens,
                                                  int64_t rows) {
  dev::pdl_begin();  // tokens, context: from earlier kernels (cuda/common/pdl.cuh)
  int64_t next[8];
  for (int i = 0; i < n; ++i) {
    const int64_t q = rows - n + i;  // index into tokens; negative: into the old context
    next[i] = q >= 0 ? static_cast<int64_t>(tokens[q]) : context[n + q];
  }
  for (int i = 0; i < n; ++i) context[i] = next[i];
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

// Steps 2-6 of one stream in one block: the gate sigmoid(signed-sqrt gamma) and the conv-norm
// scale 1/rms(gate * V). kraw, H, wk, wq: the stream's P values; V: the P value_proj values.
// Shared by the decode and the rows kernels, so both round identically.
struct GateScale {
  float gate, sc;
};

__device__ __forceinline__ GateScale ple_gate_scale(const float* kraw, const float* H,
                                                    const float* V, const float* wk,
                                                    const float* wq, int64_t P, float eps,
                                                    float inv_sqrt_p) {
  __shared__ float slots1[kApplyThreads / 32][2], slots2[kApplyThreads / 32][1],
      slots3[kApplyThreads / 32][1];
  __shared__ float tot1[2], tot2[1], tot3[1];
  const float n = static_cast<float>(P);

  // Step 2-3 norms: sums of squares of the raw key projection and of H (before the addition).
  float r1[2] = {0.0f, 0.0f};
  for (int64_t i = threadIdx.x; i < P; i += kApplyThreads) {
    const float k = kraw[i], h = H[i];
    r1[0] = fmaf(k, k, r1[0]);
    r1[1] = fmaf(h, h, r1[1]);
  }
  block_sum<2>(r1, slots1, tot1);
  const float sk = inv_rms(r1[0], n, eps), sq = inv_rms(r1[1], n, eps);

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
  return {gate, inv_rms(r3[0], n, eps)};
}

// One block per stream s (blockIdx.x).
__global__ void __launch_bounds__(kApplyThreads)
    ple_apply_kernel(const PleApplyParams p, float inv_sqrt_p) {
  dev::pdl_begin();  // token, context, kv, H: from earlier kernels (cuda/common/pdl.cuh)
  const int64_t P = p.dim;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * P;
  const float* kraw = p.kv + base;
  const float* V = p.kv + static_cast<int64_t>(p.hc_count) * P;
  float* H = p.H + base;
  const float* wc = p.norm_conv + base;
  const GateScale gs =
      ple_gate_scale(kraw, H, V, p.norm_key + base, p.norm_query + base, P, p.eps, inv_sqrt_p);
  const float gate = gs.gate, sc = gs.sc;

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

// Rows, phase 1: one block per (row, stream), blockIdx.x = row * S + s; the decode kernel's gate
// and scale of that row into gates/scales [rows, S].
__global__ void __launch_bounds__(kApplyThreads)
    ple_rows_gate_kernel(const PleApplyParams p, const float* kv, int64_t kv_stride, const float* H,
                         float* gates, float* scales, float inv_sqrt_p) {
  dev::pdl_begin();  // kv, H: from earlier kernels (cuda/common/pdl.cuh)
  const int S = p.hc_count;
  const int64_t P = p.dim, row = blockIdx.x / S;
  const int s = static_cast<int>(blockIdx.x % S);
  const int64_t base = static_cast<int64_t>(s) * P;
  const float* kvr = kv + row * kv_stride;
  const GateScale gs = ple_gate_scale(kvr + base, H + row * S * P + base, kvr + S * P,
                                      p.norm_key + base, p.norm_query + base, P, p.eps, inv_sqrt_p);
  if (threadIdx.x == 0) {
    gates[blockIdx.x] = gs.gate;
    scales[blockIdx.x] = gs.sc;
  }
}

// Nc of row q >= 0 at channel c = s*P + i, as the decode kernel computes it (same operations).
__device__ __forceinline__ float ple_rows_nc(const PleApplyParams& p, const float* kv,
                                             int64_t kv_stride, const float* gates,
                                             const float* scales, int64_t q, int s, int64_t i,
                                             int64_t c) {
  const int64_t r = q * p.hc_count + s;
  const float g = gates[r] * kv[q * kv_stride + p.hc_count * p.dim + i];
  return g * scales[r] * (1.0f + p.norm_conv[c]);
}

// Rows, phase 2: one thread per (row, channel) (grid-stride): the dilated conv over this batch's
// earlier rows and the conv_state history (read only), then H += Gv + conv.
__global__ void ple_rows_conv_kernel(const PleApplyParams p, const float* kv, int64_t kv_stride,
                                     float* H, const float* gates, const float* scales,
                                     int64_t rows) {
  dev::pdl_begin();  // scratch, kv, H, conv_state: from earlier kernels (cuda/common/pdl.cuh)
  const int S = p.hc_count;
  const int64_t P = p.dim, W = S * P, n = rows * W;
  const int K = p.conv_kernel, d = p.dilation, L = (K - 1) * d;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / W, c = idx % W;
    const int s = static_cast<int>(c / P);
    const int64_t i = c % P;
    // Nc at row q: this batch's for q >= 0, else the history (q >= -L: the oldest tap is L back).
    auto nc_at = [&](int64_t q) -> float {
      return q >= 0 ? ple_rows_nc(p, kv, kv_stride, gates, scales, q, s, i, c)
                    : p.conv_state[c * L + L + q];
    };
    const float* w = p.conv + c * K;
    float acc = w[K - 1] * nc_at(row);
    for (int j = 0; j + 1 < K; ++j) acc = fmaf(w[j], nc_at(row - d * (K - 1 - j)), acc);
    const float g = gates[row * S + s] * kv[row * kv_stride + W + i];
    const float conv = dev::silu(acc);
    H[idx] = H[idx] + (g + conv);
  }
}

// Rows, phase 3: one thread per channel (grid-stride): the conv_state becomes the last L values of
// (history, Nc rows), oldest first. In place in ascending order: slot m reads slot m + rows of the
// old history, which no earlier iteration has overwritten.
__global__ void ple_rows_state_kernel(const PleApplyParams p, const float* kv, int64_t kv_stride,
                                      const float* gates, const float* scales, int64_t rows) {
  dev::pdl_begin();  // conv_state (read by phase 2), scratch: from earlier kernels
  const int S = p.hc_count;
  const int64_t P = p.dim, W = S * P;
  const int L = (p.conv_kernel - 1) * p.dilation;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < W;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int s = static_cast<int>(c / P);
    const int64_t i = c % P;
    float* st = p.conv_state + c * L;
    for (int m = 0; m < L; ++m) {
      const int64_t q = rows - L + m;
      st[m] = q >= 0 ? ple_rows_nc(p, kv, kv_stride, gates, scales, q, s, i, c) : st[m + rows];
    }
  }
}

}  // namespace

namespace {

// The gather's checks except token/out (shared by the decode and rows launchers).
void check_gather(const NgramGatherParams& p, const char* kOp) {
  FN_LAUNCH_REQUIRE(p.context != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.row_count >= 0 && (p.row_count == 0 || p.rows != nullptr), kOp);
  FN_LAUNCH_REQUIRE(p.ngram_size >= 2 && p.ngram_size <= 8, kOp);
  FN_LAUNCH_REQUIRE(p.num_multipliers == p.ngram_size, kOp);
  FN_LAUNCH_REQUIRE(p.heads_per_ngram >= 1 && p.num_heads >= 1 && p.num_heads <= 32, kOp);
  FN_LAUNCH_REQUIRE(p.num_heads == (p.ngram_size - 1) * p.heads_per_ngram, kOp);
  FN_LAUNCH_REQUIRE(p.head_dim >= 1 && p.eos >= 0, kOp);
  FN_LAUNCH_REQUIRE(p.fp8 || (reinterpret_cast<uintptr_t>(p.rows) & 1) == 0, kOp);
  for (int h = 0; h < p.num_heads; ++h) FN_LAUNCH_REQUIRE(p.head_sizes[h] >= 1, kOp);
}

// ple_apply's checks except kv/H (shared by the decode and rows launchers).
void check_apply(const PleApplyParams& p, const char* kOp) {
  FN_LAUNCH_REQUIRE(p.conv != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.norm_key != nullptr && p.norm_query != nullptr && p.norm_conv != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.hc_count >= 1 && p.hc_count <= 64, kOp);
  FN_LAUNCH_REQUIRE(p.dim >= 1 && p.dim <= (int64_t{1} << 20), kOp);
  FN_LAUNCH_REQUIRE(p.conv_kernel >= 1 && p.conv_kernel <= 16, kOp);
  FN_LAUNCH_REQUIRE(p.dilation >= 1 && p.dilation <= 16, kOp);
  FN_LAUNCH_REQUIRE(p.conv_kernel == 1 || p.conv_state != nullptr, kOp);
}

constexpr int kRowsThreads = 256;            // phases 2 and 3 of ple_apply_rows
constexpr int64_t kMaxRowsBlocks = 1 << 20;  // grid-stride beyond

unsigned rows_blocks(int64_t n) {
  return static_cast<unsigned>(
      std::min<int64_t>((n + kRowsThreads - 1) / kRowsThreads, kMaxRowsBlocks));
}

}  // namespace

void launch_ngram_gather(const NgramGatherParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_ngram_gather";
  FN_LAUNCH_REQUIRE(p.token != nullptr && p.out != nullptr, kOp);
  check_gather(p, kOp);
  launch_pdl("ngram_gather_kernel", ngram_gather_kernel, static_cast<unsigned>(p.num_heads),
             kGatherThreads, 0, stream, p);
  FN_CUDA_LAUNCH_CHECK("ngram_gather_kernel");
}

void launch_ngram_gather_rows(const NgramGatherRowsParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_ngram_gather_rows";
  FN_LAUNCH_REQUIRE(p.tokens != nullptr && p.out != nullptr && p.rows >= 0, kOp);
  check_gather(p.base, kOp);
  FN_LAUNCH_REQUIRE(p.rows * p.base.num_heads <= int64_t{0x7fffffff}, kOp);
  if (p.rows == 0) return;
  launch_pdl("ngram_gather_rows_kernel", ngram_gather_rows_kernel,
             static_cast<unsigned>(p.rows * p.base.num_heads), kGatherThreads, 0, stream, p.base,
             p.tokens, p.out);
  FN_CUDA_LAUNCH_CHECK("ngram_gather_rows_kernel");
}

void launch_ngram_context_advance(const NgramContextAdvanceParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_ngram_context_advance";
  FN_LAUNCH_REQUIRE(p.context != nullptr && p.token != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.ngram_size >= 2 && p.ngram_size <= 8, kOp);
  launch_pdl("ngram_context_advance_kernel", ngram_context_advance_kernel, 1, 1, 0, stream,
             p.context, p.ngram_size - 1, p.token);
  FN_CUDA_LAUNCH_CHECK("ngram_context_advance_kernel");
}

void launch_ngram_context_advance_rows(const NgramContextAdvanceRowsParams& p,
                                       cudaStream_t stream) {
  constexpr const char* kOp = "launch_ngram_context_advance_rows";
  FN_LAUNCH_REQUIRE(p.context != nullptr && p.tokens != nullptr && p.rows >= 0, kOp);
  FN_LAUNCH_REQUIRE(p.ngram_size >= 2 && p.ngram_size <= 8, kOp);
  if (p.rows == 0) return;
  launch_pdl("ngram_context_advance_rows_kernel", ngram_context_advance_rows_kernel, 1, 1, 0,
             stream, p.context, p.ngram_size - 1, p.tokens, p.rows);
  FN_CUDA_LAUNCH_CHECK("ngram_context_advance_rows_kernel");
}

void launch_ple_apply(const PleApplyParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_ple_apply";
  FN_LAUNCH_REQUIRE(p.kv != nullptr && p.H != nullptr, kOp);
  check_apply(p, kOp);
  const float inv_sqrt_p = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.dim)));
  launch_pdl("ple_apply_kernel", ple_apply_kernel, static_cast<unsigned>(p.hc_count), kApplyThreads,
             0, stream, p, inv_sqrt_p);
  FN_CUDA_LAUNCH_CHECK("ple_apply_kernel");
}

int64_t ple_apply_rows_scratch_floats(const PleApplyRowsParams& p) {
  return 2 * std::max<int64_t>(p.rows, 0) * p.base.hc_count;
}

void launch_ple_apply_rows(const PleApplyRowsParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_ple_apply_rows";
  FN_LAUNCH_REQUIRE(p.kv != nullptr && p.H != nullptr && p.scratch != nullptr && p.rows >= 0, kOp);
  const PleApplyParams& b = p.base;
  check_apply(b, kOp);
  const int64_t S = b.hc_count, W = S * b.dim;
  FN_LAUNCH_REQUIRE(p.kv_stride >= W + b.dim, kOp);
  FN_LAUNCH_REQUIRE(p.rows * S <= int64_t{0x7fffffff}, kOp);
  if (p.rows == 0) return;
  float* gates = p.scratch;
  float* scales = p.scratch + p.rows * S;
  const float inv_sqrt_p = static_cast<float>(1.0 / std::sqrt(static_cast<double>(b.dim)));
  launch_pdl("ple_rows_gate_kernel", ple_rows_gate_kernel, static_cast<unsigned>(p.rows * S),
             kApplyThreads, 0, stream, b, p.kv, p.kv_stride, static_cast<const float*>(p.H), gates,
             scales, inv_sqrt_p);
  FN_CUDA_LAUNCH_CHECK("ple_rows_gate_kernel");
  launch_pdl("ple_rows_conv_kernel", ple_rows_conv_kernel, rows_blocks(p.rows * W), kRowsThreads, 0,
             stream, b, p.kv, p.kv_stride, p.H, static_cast<const float*>(gates),
             static_cast<const float*>(scales), p.rows);
  FN_CUDA_LAUNCH_CHECK("ple_rows_conv_kernel");
  if (b.conv_kernel == 1) return;  // no history to keep
  launch_pdl("ple_rows_state_kernel", ple_rows_state_kernel, rows_blocks(W), kRowsThreads, 0,
             stream, b, p.kv, p.kv_stride, static_cast<const float*>(gates),
             static_cast<const float*>(scales), p.rows);
  FN_CUDA_LAUNCH_CHECK("ple_rows_state_kernel");
}

}  // namespace fn

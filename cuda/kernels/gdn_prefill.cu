// Gated DeltaNet prefill kernels (see gdn_prefill.h). In stream order:
// 1. The causal conv + SiLU of every channel (taps before token 0 from the conv state; the same
//    FMA chain as the decode kernel, so the conv outputs are bitwise decode's), q/k L2-normalised
//    per key head (q also by 1/sqrt(dk)) into the workspace, v into the workspace, and the gates
//    beta = sigmoid(b) and g (the log of the decay) per (head, token):
//    gdn_prefill_conv_tile_kernel (dk <= 128, conv kernel 2..4: one warp per key head, 128 v
//    channels or the gates over 32 tokens, the conv window in registers) or
//    gdn_prefill_conv_kernel (one CTA per token; the other shapes), with the same bits.
// 2. gdn_prefill_conv_state_kernel: the conv state <- the last K-1 pre-conv inputs (after 1 has
//    read the old history).
// 3. The recurrence (docs/model.md §C.5 step 6), o overwriting v in the workspace:
//    sm_80+ with dk <= 128: the chunked (WY) form on the tensor cores in 3xTF32 (derivation and
//    fragment layouts above gdn_prefill_chunk_kernel): gdn_prefill_chunk_kernel per (64-token
//    chunk, value head) computes the chunk's cumulative log-decay G, T = (I + A)^-1 diag(beta),
//    W, U and P; gdn_prefill_chunk_scan_kernel per (value head, slice of 32 or 64 dv columns)
//    walks the chunks in order with the state slice in registers.
//    Otherwise: gdn_prefill_scan_kernel, the sequential scan over the tokens. One CTA per
//    (value head, slice of vc dv columns); a column's state [dk] is split over P consecutive
//    lanes (R rows each, in registers), so S^T k and S^T q are per-thread FMA chains plus a
//    butterfly over P lanes: no barrier per token. Tiles of T tokens (k, q, v, beta, g) are
//    staged into shared memory with cp.async, double buffered. Only the M real tokens are
//    scanned: a partial last tile never touches the state.
// 4. gdn_prefill_norm_kernel, one warp per (token, value head): the gated RMSNorm -> BF16.
// With several runs (GdnPrefillParams::runs) each row belongs to one sequence with its own
// states: 1 takes the history before a run's first row from that run's conv state, 2 and 3 run
// per run (the chunks of 3 start at each run's first row), 4 is per row anyway. A run's
// arithmetic is that of a launch of its rows alone, so its bits are too.
// Everything is FP32 with a fixed reduction order (no atomics): deterministic. The sequential
// scan is independent of the tiling (prefill(a) + prefill(b) is bitwise prefill(a + b)); the
// chunked scan is where a is a multiple of 64 (the chunks are the same), and within rounding
// otherwise. Both are independent of the slice width.
// Measured on one H200, dk = dv = 128, M = 8192, sequential scan: Hk/Hv = 16/48 5.7 ms per launch
// (conv 1.58, conv state 0.005, scan 3.60, norm 0.52); 8/24 about 4.1 ms (conv 0.82, scan 3.10,
// norm 0.26). With the tiled conv and the chunked scan (one H100, tests/test_cuda_gdn_prefill.cpp
// FN_BENCH=1, the whole launch): 16/48 3.64 ms (slice 64; slice 32 4.86), 8/24 2.49 ms (slice 32);
// in an 8,192-token prefill the GDN family went from 292.6 to 211.5 ms (36 layers, one H100).
#include "cuda/kernels/gdn_prefill.h"

#include <cuda_runtime.h>

#include <climits>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/kernels/gdn_common.cuh"

namespace fn {
namespace {

constexpr int kMaxHeadDim = 1024;
constexpr int kMaxConvKernel = 8;
constexpr int kConvThreads = 256;
constexpr int kNormThreads = 256;
constexpr int kScanMaxThreads = 256;
constexpr int kScanMaxSmem = 48 * 1024;  // dynamic shared memory without an opt-in attribute
// The chunked scan: tokens per chunk (the form of flash-linear-attention's chunk_gated_delta_rule)
// and the key dims its tiles hold (dk <= 128 zero-padded to 128; larger dk take the sequential
// scan).
constexpr int kChunk = 64;
constexpr int kChunkDk = 128;

using dev::cp_async_commit;
using dev::sigmoid2;

// ---- cp.async (sm_80+; below, plain loads and shared stores: a copy that lands at once) ----
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async4(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
#else
// Through L2 (as .cg): v is overwritten by o in this kernel, so no non-coherent load.
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem) {
  *reinterpret_cast<float4*>(smem) = __ldcg(reinterpret_cast<const float4*>(gmem));
}
__device__ __forceinline__ void cp_async4(float* smem, const float* gmem) {
  *smem = *gmem;
}
#endif

// The workspace sections (byte offsets, each 256-byte aligned).
struct Layout {
  size_t qk, vo, beta, decay, kq, w, pm, total;
};

size_t round256(size_t b) {
  return (b + 255) & ~size_t{255};
}

Layout layout_of(const GdnPrefillParams& p) {
  const size_t M = static_cast<size_t>(p.tokens);
  const size_t Hk = static_cast<size_t>(p.num_k_heads), Hv = static_cast<size_t>(p.num_v_heads);
  const size_t dk = static_cast<size_t>(p.k_head_dim), dv = static_cast<size_t>(p.v_head_dim);
  Layout l;
  l.qk = 0;
  l.vo = l.qk + round256(M * 2 * Hk * dk * sizeof(float));
  l.beta = l.vo + round256(M * Hv * dv * sizeof(float));
  l.decay = l.beta + round256(Hv * M * sizeof(float));
  l.kq = l.decay + round256(Hv * M * sizeof(float));
  l.w = l.kq + round256(Hk * M * sizeof(float));
  // The chunked scan's W and P rows (only where it can run: dk <= kChunkDk).
  const bool chunked = dk <= static_cast<size_t>(kChunkDk);
  l.pm = l.w + (chunked ? round256(Hv * M * dk * sizeof(float)) : 0);
  l.total = l.pm + (chunked ? round256(Hv * M * kChunk * sizeof(float)) : 0);
  return l;
}

// The sequences of a launch (GdnPrefillParams::runs): run r's rows [begin, end) and its states.
struct Runs {
  int count;             // >= 1
  const int32_t* start;  // [count + 1] (device), or nullptr: one run on one_state / one_conv
  const int32_t* slot;   // [count] (device)
  float* const* state;   // [slots] (device)
  float* const* conv;    // [slots] (device)
  float* one_state;
  float* one_conv;
  int64_t tokens;
};

struct RunRange {
  int64_t begin, end;
  float* state;
  float* conv;
};

__device__ __forceinline__ RunRange run_range(const Runs& r, int i) {
  if (r.start == nullptr) return {0, r.tokens, r.one_state, r.one_conv};
  const int slot = __ldg(r.slot + i);
  return {__ldg(r.start + i), __ldg(r.start + i + 1), r.state[slot], r.conv[slot]};
}

// The run holding row p: the last i with start[i] <= p (binary search over count + 1 entries).
__device__ __forceinline__ RunRange run_of_row(const Runs& r, int64_t p) {
  if (r.start == nullptr) return run_range(r, 0);
  int lo = 0, hi = r.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(r.start + mid) <= p)
      lo = mid;
    else
      hi = mid - 1;
  }
  return run_range(r, lo);
}

struct ConvArgs {
  Runs runs;
  const float* proj;
  int64_t stride;
  int64_t tokens;
  const float* conv_w;
  const float* A_log;
  const float* dt_bias;
  float* qk;     // [tokens, 2*Hk*dk]: q^ then k^
  float* vo;     // [tokens, Hv*dv]: v
  float* beta;   // [Hv, tokens]
  float* decay;  // [Hv, tokens]: g (the log of the decay)
  float* kq;     // [Hk, tokens]: k^ . q^
  int Hk, Hv, dk, dv, K;
};

// Step 2 for token p, channel c: silu(w[K-1] * x_p + sum_{j<L} w[j] * x_{p-L+j}) with the taps
// in the decode kernel's order (current first, then oldest first; FMA chain), inputs before
// the run's first row `begin` from its conv state (entry L + t holds the run's token t < 0).
__device__ __forceinline__ float conv_token(const ConvArgs& a, int64_t p, int64_t c, int64_t begin,
                                            const float* conv_state) {
  const int K = a.K, L = K - 1;
  const float* wc = a.conv_w + c * K;
  // Read-only loads (nothing this kernel writes aliases them), so the calls' loads can overlap.
  float acc = __ldg(wc + K - 1) * __ldg(a.proj + p * a.stride + c);
#pragma unroll
  for (int j = 0; j < kMaxConvKernel - 1; ++j) {
    if (j < L) {
      const int64_t t = p - L + j;
      const float x = t >= begin ? __ldg(a.proj + t * a.stride + c)
                                 : __ldg(conv_state + c * L + L + (t - begin));
      acc = fmaf(__ldg(wc + j), x, acc);
    }
  }
  return dev::silu(acc);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Step 5 for key head i of token p from the conv outputs of its q and k channels (J per lane,
// channel lane + 32 j; 0 past dk): the L2 norms with eps inside the rsqrt of the sum (§C.5 step
// 5), q^ = (q * rq) * q_scale and k^ = k * rk into the workspace, and k^.q^, as the decode kernel.
template <int J>
__device__ __forceinline__ void store_qk_head(const ConvArgs& a, int64_t p, int i, int lane,
                                              const float (&xq)[J], const float (&xk)[J]) {
  float sq = 0.0f, sk = 0.0f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    if (lane + 32 * j < a.dk) {
      sq = fmaf(xq[j], xq[j], sq);
      sk = fmaf(xk[j], xk[j], sk);
    }
  }
  sq = warp_sum(sq);
  sk = warp_sum(sk);
  const float q_scale = 1.0f / sqrtf(static_cast<float>(a.dk));
  const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
  const int64_t qk_stride = 2 * int64_t{a.Hk} * a.dk;
  float* dq = a.qk + p * qk_stride + int64_t{i} * a.dk;
  float* dkp = a.qk + p * qk_stride + int64_t{a.Hk + i} * a.dk;
  float kq = 0.0f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int d = lane + 32 * j;
    if (d < a.dk) {
      const float qh = xq[j] * rq * q_scale, kh = xk[j] * rk;
      dq[d] = qh;
      dkp[d] = kh;
      kq = fmaf(kh, qh, kq);
    }
  }
  kq = warp_sum(kq);
  if (lane == 0) a.kq[int64_t{i} * a.tokens + p] = kq;
}

// Step 4 for token p, value heads first, first + step, ...: beta = sigmoid(b) and g itself
// (dev::gdn_decay's exponent, the same operations: the sequential scan takes its expf, bitwise
// gdn_decay; the chunked scan sums it over a chunk first), head-major so the scans stage a tile
// of them with one contiguous copy.
__device__ __forceinline__ void store_gates(const ConvArgs& a, int64_t p, int first, int step) {
  const int64_t vd = int64_t{a.Hv} * a.dv;
  const float* ab = a.proj + p * a.stride + 2 * int64_t{a.Hk} * a.dk + 2 * vd;
  for (int h = first; h < a.Hv; h += step) {
    a.beta[int64_t{h} * a.tokens + p] = sigmoid2(ab[a.Hv + h]);
    a.decay[int64_t{h} * a.tokens + p] = -expf(a.A_log[h]) * dev::softplus(ab[h] + a.dt_bias[h]);
  }
}

// Steps 2, 4 and 5 for token blockIdx.x. J: per-lane entries of a head, >= dk / 32.
template <int J>
__global__ void __launch_bounds__(kConvThreads) gdn_prefill_conv_kernel(ConvArgs a) {
  const int64_t p = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const RunRange run = run_of_row(a.runs, p);
  const int64_t begin = run.begin;
  const float* hist = run.conv;
  const int64_t qk_stride = 2 * int64_t{a.Hk} * a.dk;
  // q_i and k_i (dk channels each) of key head i: one warp per key head.
  for (int i = warp; i < a.Hk; i += kConvThreads / 32) {
    float xq[J], xk[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int d = lane + 32 * j;
      xq[j] = xk[j] = 0.0f;
      if (d < a.dk) {
        xq[j] = conv_token(a, p, int64_t{i} * a.dk + d, begin, hist);
        xk[j] = conv_token(a, p, int64_t{a.Hk + i} * a.dk + d, begin, hist);
      }
    }
    store_qk_head(a, p, i, lane, xq, xk);
  }
  // v channels.
  const int64_t vd = int64_t{a.Hv} * a.dv, v0 = qk_stride;
  constexpr int kUnroll = 4;  // independent channels per thread in flight
  for (int64_t c0 = tid; c0 < vd; c0 += kUnroll * kConvThreads) {
    float y[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kConvThreads;
      y[u] = c < vd ? conv_token(a, p, v0 + c, begin, hist) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kConvThreads;
      if (c < vd) a.vo[p * vd + c] = y[u];
    }
  }
  store_gates(a, p, tid, kConvThreads);
}

// The same steps 2, 4 and 5 over a tile of kConvTileTokens tokens per warp, for dk <= 32 J and a
// conv kernel of K taps: each lane keeps its channels' K weights and their last K - 1 inputs in
// registers and slides over the tile, so every input is loaded once (gdn_prefill_conv_kernel
// loads each K times and its weights once per token). Warp w of the launch (blockIdx.y * 8 +
// warp) takes key head w (its q and k channels, the L2 norms and k^.q^) for w < Hk, then the
// 32 J-channel groups of v, then one warp the gates. Per (token, channel) the FMA chain, the
// norms' sums and the gates are gdn_prefill_conv_kernel's, so the results are its bits.
constexpr int kConvTileTokens = 32;
constexpr int kConvTileWarps = kConvThreads / 32;

template <int NC, int K>
struct ConvLanes {  // NC channels of one lane
  float w[NC][K];
  float win[NC][K > 1 ? K - 1 : 1];  // x_{p-L} .. x_{p-1} of the token p about to be computed
  int64_t c[NC];                     // channel index, or -1 past the last channel
};

template <int NC, int K>
__device__ __forceinline__ void conv_lanes_init_weights(ConvLanes<NC, K>& cl, const float* conv_w) {
#pragma unroll
  for (int n = 0; n < NC; ++n)
#pragma unroll
    for (int j = 0; j < K; ++j) cl.w[n][j] = cl.c[n] >= 0 ? __ldg(conv_w + cl.c[n] * K + j) : 0.0f;
}

// Refills the window for token p (taps before the run's first row from its conv state).
template <int NC, int K>
__device__ __forceinline__ void conv_lanes_fill(ConvLanes<NC, K>& cl, const ConvArgs& a, int64_t p,
                                                int64_t begin, const float* hist) {
  constexpr int L = K - 1;
#pragma unroll
  for (int n = 0; n < NC; ++n) {
#pragma unroll
    for (int j = 0; j < L; ++j) {
      const int64_t t = p - L + j;
      cl.win[n][j] = cl.c[n] < 0  ? 0.0f
                     : t >= begin ? __ldg(a.proj + t * a.stride + cl.c[n])
                                  : __ldg(hist + cl.c[n] * L + L + (t - begin));
    }
  }
}

// silu of token p's conv for every channel of the lane (conv_token's FMA chain), then the window
// slides to p + 1.
template <int NC, int K>
__device__ __forceinline__ void conv_lanes_step(ConvLanes<NC, K>& cl, const ConvArgs& a, int64_t p,
                                                float (&y)[NC]) {
  constexpr int L = K - 1;
  float x[NC];
#pragma unroll
  for (int n = 0; n < NC; ++n) x[n] = cl.c[n] >= 0 ? __ldg(a.proj + p * a.stride + cl.c[n]) : 0.0f;
#pragma unroll
  for (int n = 0; n < NC; ++n) {
    float acc = cl.w[n][K - 1] * x[n];
#pragma unroll
    for (int j = 0; j < L; ++j) acc = fmaf(cl.w[n][j], cl.win[n][j], acc);
    y[n] = dev::silu(acc);
#pragma unroll
    for (int j = 0; j + 1 < L; ++j) cl.win[n][j] = cl.win[n][j + 1];
    if (L > 0) cl.win[n][L > 0 ? L - 1 : 0] = x[n];
  }
}

template <int J, int K>
__global__ void __launch_bounds__(kConvThreads)
    gdn_prefill_conv_tile_kernel(ConvArgs a, int v_groups) {
  const int lane = threadIdx.x & 31;
  const int w = static_cast<int>(blockIdx.y) * kConvTileWarps + (threadIdx.x >> 5);
  const int64_t p0 = int64_t{blockIdx.x} * kConvTileTokens;
  const int64_t p1 = p0 + kConvTileTokens < a.tokens ? p0 + kConvTileTokens : a.tokens;
  const int64_t qk_stride = 2 * int64_t{a.Hk} * a.dk, vd = int64_t{a.Hv} * a.dv;
  if (w < a.Hk) {  // key head i = w: q channels then k channels
    const int i = w;
    ConvLanes<2 * J, K> cl;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int d = lane + 32 * j;
      cl.c[j] = d < a.dk ? int64_t{i} * a.dk + d : -1;
      cl.c[J + j] = d < a.dk ? int64_t{a.Hk + i} * a.dk + d : -1;
    }
    conv_lanes_init_weights(cl, a.conv_w);
    for (int64_t p = p0; p < p1; ++p) {
      const RunRange run = run_of_row(a.runs, p);
      if (p == p0 || p == run.begin) conv_lanes_fill(cl, a, p, run.begin, run.conv);
      float y[2 * J], xq[J], xk[J];
      conv_lanes_step(cl, a, p, y);
#pragma unroll
      for (int j = 0; j < J; ++j) {
        xq[j] = y[j];
        xk[j] = y[J + j];
      }
      store_qk_head(a, p, i, lane, xq, xk);
    }
  } else if (w < a.Hk + v_groups) {  // v channels g*32J .. g*32J + 32J - 1
    const int64_t first = int64_t{w - a.Hk} * 32 * J;
    ConvLanes<J, K> cl;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int64_t e = first + lane + 32 * j;
      cl.c[j] = e < vd ? qk_stride + e : -1;
    }
    conv_lanes_init_weights(cl, a.conv_w);
    for (int64_t p = p0; p < p1; ++p) {
      const RunRange run = run_of_row(a.runs, p);
      if (p == p0 || p == run.begin) conv_lanes_fill(cl, a, p, run.begin, run.conv);
      float y[J];
      conv_lanes_step(cl, a, p, y);
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (cl.c[j] >= 0) a.vo[p * vd + cl.c[j] - qk_stride] = y[j];
    }
  } else if (w == a.Hk + v_groups) {  // the gates (step 4)
    for (int64_t p = p0; p < p1; ++p) store_gates(a, p, lane, 32);
  }
}

// Each run's conv state <- its last L pre-conv inputs, oldest first; entries older than the run's
// first row come from the old history. One thread per channel, blockIdx.y the run.
__global__ void __launch_bounds__(256)
    gdn_prefill_conv_state_kernel(Runs runs, const float* __restrict__ proj_all, int64_t stride,
                                  int conv_dim, int K) {
  const int64_t c = int64_t{blockIdx.x} * 256 + threadIdx.x;
  if (c >= conv_dim) return;
  const RunRange run = run_range(runs, static_cast<int>(blockIdx.y));
  const int64_t tokens = run.end - run.begin;
  const float* proj = proj_all + run.begin * stride;
  const int L = K - 1;
  float* hist = run.conv + c * L;
  float old[kMaxConvKernel - 1];
#pragma unroll
  for (int j = 0; j < kMaxConvKernel - 1; ++j)
    if (j < L) old[j] = hist[j];
#pragma unroll
  for (int j = 0; j < kMaxConvKernel - 1; ++j) {
    if (j < L) {
      const int64_t t = tokens - L + j;  // the token whose input lands in entry j
      hist[j] = t >= 0 ? proj[t * stride + c] : old[tokens + j];
    }
  }
}

struct ScanArgs {
  Runs runs;
  const float* qk;
  float* vo;
  const float* beta;
  const float* decay;
  const float* kq;
  int64_t tokens;  // rows of the launch (the stride of beta, decay, kq)
  int Hk, Hv, dk, dv;
  int ratio;  // Hv / Hk
  int P;      // lanes per column
  int vc;     // columns per CTA
  int T;      // tokens per tile
};

// Shared memory of one tile buffer, in floats: k [T][Dp], q [T][Dp], v [T][vc], beta [T4],
// g [T4], k^.q^ [T4] (T4 = T rounded up to 4 so every section stays 16-byte aligned).
__host__ __device__ inline int tile_floats(int T, int Dp, int vc) {
  const int T4 = (T + 3) & ~3;
  return 2 * T * Dp + T * vc + 3 * T4;
}

// Step 6 for (value head h, columns sl*vc .. sl*vc+vc-1) over the rows of run blockIdx.y (its
// state from the run's slot). Thread tid = cl*P + p
// holds column cl's rows (m*P + p)*4 + jj (m < R/4, jj < 4): 16-byte chunks interleaved over
// the P lanes, so the lanes' float4 reads of k and q hit distinct banks.
template <int R>
__global__ void __launch_bounds__(kScanMaxThreads) gdn_prefill_scan_kernel(ScanArgs a) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int P = a.P, Dp = R * P, T = a.T, vc = a.vc;
  const int T4 = (T + 3) & ~3;
  const int kOff = 0, qOff = T * Dp, vOff = 2 * T * Dp, bOff = vOff + T * vc, dOff = bOff + T4;
  const int cOff = dOff + T4;
  const int B = tile_floats(T, Dp, vc);
  const int slices = a.dv / vc;
  const int h = blockIdx.x / slices, sl = blockIdx.x - h * slices;
  const int i = h / a.ratio;  // repeat-interleave: value head h reads key head h / (Hv/Hk)
  const int tid = threadIdx.x, nthr = blockDim.x;
  const int p = tid % P, cl = tid / P;
  const bool valid = cl < vc;  // threads past vc * P only fill the last warp
  const int my_cl = valid ? cl : 0;

  // Zero both buffers once: the rows dk..Dp-1 of k and q stay zero (padding rows hold no state).
  for (int e = tid; e < 2 * B; e += nthr) sm[e] = 0.0f;
  __syncthreads();

  const RunRange run = run_range(a.runs, static_cast<int>(blockIdx.y));
  float* S = run.state + int64_t{h} * a.dk * a.dv + sl * vc + my_cl;
  float s[R];
#pragma unroll
  for (int m = 0; m < R / 4; ++m) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int row = (m * P + p) * 4 + jj;
      s[m * 4 + jj] = valid && row < a.dk ? S[int64_t{row} * a.dv] : 0.0f;
    }
  }

  const int64_t qk_stride = 2 * int64_t{a.Hk} * a.dk, vo_stride = int64_t{a.Hv} * a.dv;
  const float* qsrc = a.qk + int64_t{i} * a.dk;
  const float* ksrc = a.qk + int64_t{a.Hk + i} * a.dk;
  float* vcol = a.vo + int64_t{h} * a.dv + sl * vc;
  const float* bsrc = a.beta + int64_t{h} * a.tokens;
  const float* dsrc = a.decay + int64_t{h} * a.tokens;
  const float* csrc = a.kq + int64_t{i} * a.tokens;
  const int dk4 = a.dk / 4, vc4 = vc / 4;
  const int64_t ntiles = (run.end - run.begin + T - 1) / T;
  auto tile_len = [&](int64_t tile) {
    const int64_t left = run.end - run.begin - tile * T;
    return left < T ? static_cast<int>(left) : T;
  };
  auto issue = [&](int64_t tile, int buf) {
    const int64_t t0 = run.begin + tile * T;
    const int n = tile_len(tile);
    float* base = sm + buf * B;
    for (int e = tid; e < n * dk4; e += nthr) {
      const int tt = e / dk4, c4 = e - tt * dk4;
      const int64_t g = (t0 + tt) * qk_stride + c4 * 4;
      cp_async16(base + kOff + tt * Dp + c4 * 4, ksrc + g);
      cp_async16(base + qOff + tt * Dp + c4 * 4, qsrc + g);
    }
    for (int e = tid; e < n * vc4; e += nthr) {
      const int tt = e / vc4, c4 = e - tt * vc4;
      cp_async16(base + vOff + tt * vc + c4 * 4, vcol + (t0 + tt) * vo_stride + c4 * 4);
    }
    for (int e = tid; e < n; e += nthr) {
      cp_async4(base + bOff + e, bsrc + t0 + e);
      cp_async4(base + dOff + e, dsrc + t0 + e);
      cp_async4(base + cOff + e, csrc + t0 + e);
    }
    cp_async_commit();
  };

  issue(0, 0);
  for (int64_t tile = 0; tile < ntiles; ++tile) {
    // The next tile's buffer was last read in the previous iteration (barrier at its end).
    if (tile + 1 < ntiles) {
      issue(tile + 1, static_cast<int>((tile + 1) & 1));
      dev::cp_async_wait_group<1>();
    } else {
      dev::cp_async_wait_group<0>();
    }
    __syncthreads();
    const float* base = sm + (tile & 1) * B;
    const int64_t t0 = run.begin + tile * T;
    const int n = tile_len(tile);
    for (int tt = 0; tt < n; ++tt) {
      const float* kk = base + kOff + tt * Dp;
      const float* qq = base + qOff + tt * Dp;
      const float decay = expf(base[dOff + tt]), beta = base[bOff + tt];
      const float v = base[vOff + tt * vc + my_cl];
      const float kq = base[cOff + tt];
      // With a = S^T k^ and b = S^T q^ of the state before the token (one pass, one butterfly):
      // r = (exp(g) S)^T k^ = exp(g) a; delta = beta (v - r); S' = exp(g) S + k^ delta^T;
      // o = S'^T q^ = exp(g) b + (k^.q^) delta. Only the update of S is left after the butterfly.
      float kf[R];
      float acc_a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int m = 0; m < R / 4; ++m) {
        const float4 k4 = *reinterpret_cast<const float4*>(kk + (m * P + p) * 4);
        const float4 q4 = *reinterpret_cast<const float4*>(qq + (m * P + p) * 4);
        const float qf[4] = {q4.x, q4.y, q4.z, q4.w};
        kf[m * 4 + 0] = k4.x;
        kf[m * 4 + 1] = k4.y;
        kf[m * 4 + 2] = k4.z;
        kf[m * 4 + 3] = k4.w;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          acc_a[jj] = fmaf(s[m * 4 + jj], kf[m * 4 + jj], acc_a[jj]);
          acc_b[jj] = fmaf(s[m * 4 + jj], qf[jj], acc_b[jj]);
        }
      }
      float sa = (acc_a[0] + acc_a[1]) + (acc_a[2] + acc_a[3]);
      float sb = (acc_b[0] + acc_b[1]) + (acc_b[2] + acc_b[3]);
      for (int off = 1; off < P; off <<= 1) {  // the same sums on all P lanes (commutative)
        sa += __shfl_xor_sync(0xffffffffu, sa, off);
        sb += __shfl_xor_sync(0xffffffffu, sb, off);
      }
      const float delta = beta * (v - decay * sa);
      const float o = fmaf(kq, delta, decay * sb);
#pragma unroll
      for (int j = 0; j < R; ++j) s[j] = fmaf(kf[j], delta, s[j] * decay);
      if (valid && p == 0) vcol[(t0 + tt) * vo_stride + cl] = o;
    }
    __syncthreads();
  }

#pragma unroll
  for (int m = 0; m < R / 4; ++m) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int row = (m * P + p) * 4 + jj;
      if (valid && row < a.dk) S[int64_t{row} * a.dv] = s[m * 4 + jj];
    }
  }
}

// ---- The chunked scan (sm_80+, dk <= kChunkDk) ----
//
// Derivation (docs/model.md §C.5 step 6, one value head, one chunk of n <= 64 tokens from the state
// S_0 before it). Token t: S_t = a_t S_{t-1} + k_t d_t^T with a_t = exp(g_t) and
// d_t = beta_t (v_t - a_t S_{t-1}^T k_t); o_t = S_t^T q_t. With G_t = g_1 + ... + g_t,
//   S_t = e^{G_t} S_0 + sum_{s<=t} e^{G_t - G_s} k_s d_s^T, so
//   d_t + beta_t sum_{s<t} e^{G_t - G_s} (k_t . k_s) d_s = beta_t (v_t - e^{G_t} S_0^T k_t):
//   (I + A) D = diag(beta) (V - (K o e^G) S_0), A_ts = beta_t (k_t . k_s) e^{G_t - G_s} (s < t);
//   D = U - W S_0 with T = (I + A)^-1 diag(beta), U = T V, W = T (K o e^G);
//   O = (Q o e^G) S_0 + P D, P_ts = (q_t . k_s) e^{G_t - G_s} (s <= t);
//   S_n = e^{G_n} S_0 + (K o e^{G_n - G})^T D.
// Every exponent is <= 0 (G does not increase: g <= 0, and the FP32 running sum of non-positive
// terms does not increase either), so no factor exceeds 1. A partial chunk has zero k, q, v,
// beta past its n tokens: their rows of D, O and their terms of S_n are zero.
//
// Tensor-core products are 3xTF32: x = hi + lo with hi = tf32(x), lo = tf32(x - hi) (x to about
// 2^-22 relative), a*b = lo_a hi_b + hi_a lo_b + hi_a hi_b accumulated in FP32 (the dropped
// lo_a lo_b is below 2^-22 |a b|). mma.sync m16n8k8 .tf32 fragments (PTX ISA, "Matrix Fragments
// for mma.m16n8k8"), g = lane / 4, t = lane % 4: A (16x8, row) a0 (g, t), a1 (g + 8, t),
// a2 (g, t + 4), a3 (g + 8, t + 4); B (8x8, col) b0 (k = t, n = g), b1 (k = t + 4, n = g);
// C (16x8) c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
//
// Kernel 1, gdn_prefill_chunk_kernel, one CTA per (chunk, value head): G, A and P by the tensor
// cores, T by forward substitution, then W and U; G overwrites g, U overwrites v in the
// workspace, W and P go to their own sections. Kernel 2, gdn_prefill_chunk_scan_kernel, one CTA
// per (value head, slice of dv columns, run): the chunks in order, the state slice in registers
// (and in shared memory as the B operand), D = U - W S, O = (Q o e^G) S + P D, S <- e^{G_n} S +
// (K o e^{G_n - G})^T D; O overwrites U.

// Shared-memory row strides in floats. A-operand rows read as (row g, col t): a stride = 4 mod 32
// puts the 32 lanes on 32 banks; B-operand rows read as (row t, col g): a stride = 8 mod 32.
constexpr int kRowA = kChunkDk + 4;   // q^, k^ (kernel 1), W, q^ (kernel 2)
constexpr int kRowKt = kChunkDk + 8;  // k^ in kernel 2 (read as the transposed A operand)
constexpr int kRowT = kChunk + 4;     // A, T, P (64 x 64)
constexpr int kRowV = kChunk + 8;     // v blocks of 64 columns in kernel 1
constexpr int kChunkThreads = 128;    // kernel 1: 4 warps, 16 rows of the chunk each

// Kernel 1's shared memory in floats: k^ and q^ [64][kRowA] (q^'s space then holds v blocks
// [64][kRowV]), A and T [64][kRowT], G and beta [64].
constexpr int kChunkSmemFloats = 2 * kChunk * kRowA + 2 * kChunk * kRowT + 2 * kChunk;
static_assert(kChunk * kRowV <= kChunk * kRowA, "a v block of 64 columns fits q^'s space");

// Kernel 2's shared memory in floats for NV columns per CTA: W, q^ [64][kRowA], U [64][NV + 8],
// G [2][64], k^ [64][kRowKt], P [64][kRowT], S [kChunkDk][NV + 8], D [64][NV + 8].
__host__ __device__ constexpr int scan_smem_floats(int nv) {
  return 2 * kChunk * kRowA + kChunk * (nv + 8) + 2 * kChunk + kChunk * kRowKt + kChunk * kRowT +
         kChunkDk * (nv + 8) + kChunk * (nv + 8);
}

struct ChunkArgs {
  Runs runs;
  const float* qk;    // [tokens, 2*Hk*dk]: q^ then k^
  float* vo;          // [tokens, Hv*dv]: v in, U out (kernel 1); U in, o out (kernel 2)
  const float* beta;  // [Hv, tokens]
  float* G;           // [Hv, tokens]: g in, G (per chunk of each run) out (kernel 1)
  float* W;           // [Hv, tokens, dk]
  float* P;           // [Hv, tokens, 64]: row t holds P_ts of its chunk, s = 0..63
  int64_t tokens;
  int Hk, Hv, dk, dv;
  int ratio;  // Hv / Hk
};

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// The run and chunk of kernel 1's CTA x. One run: x is the chunk. Several: run r's chunks c take
// x = floor(start_r / 64) + r + c, distinct over the runs and below floor(tokens / 64) + runs
// (floor(s/64) + ceil(len/64) <= floor((s + len)/64) + 1); x past a run's last chunk is idle.
__device__ __forceinline__ bool chunk_of_block(const Runs& r, int64_t x, RunRange& run,
                                               int64_t& c) {
  if (r.start == nullptr) {
    run = run_range(r, 0);
    c = x;
    return true;
  }
  int lo = 0, hi = r.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(r.start + mid) / kChunk + mid <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  run = run_range(r, lo);
  c = x - (run.begin / kChunk + lo);
  return c >= 0 && c * kChunk < run.end - run.begin;
}

// x = hi + lo, both TF32 (round to nearest, ties away).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
  const float r = x - __uint_as_float(hi);
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(r));
}

struct Frag4 {  // an A fragment split into hi and lo
  uint32_t hi[4], lo[4];
};
struct Frag2 {  // a B fragment split into hi and lo
  uint32_t hi[2], lo[2];
};

__device__ __forceinline__ Frag4 split4(float a0, float a1, float a2, float a3) {
  Frag4 f;
  split_tf32(a0, f.hi[0], f.lo[0]);
  split_tf32(a1, f.hi[1], f.lo[1]);
  split_tf32(a2, f.hi[2], f.lo[2]);
  split_tf32(a3, f.hi[3], f.lo[3]);
  return f;
}

__device__ __forceinline__ Frag2 split2(float b0, float b1) {
  Frag2 f;
  split_tf32(b0, f.hi[0], f.lo[0]);
  split_tf32(b1, f.hi[1], f.lo[1]);
  return f;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a * b in 3xTF32, the small terms first.
__device__ __forceinline__ void mma3(float (&d)[4], const Frag4& a, const Frag2& b) {
  mma_tf32(d, a.lo, b.hi);
  mma_tf32(d, a.hi, b.lo);
  mma_tf32(d, a.hi, b.hi);
}

// The A fragment at (row0, col0) of a row-major shared tile with row stride ld.
__device__ __forceinline__ Frag4 load_a(const float* s, int ld, int row0, int col0, int g, int t) {
  const float* p = s + (row0 + g) * ld + col0 + t;
  return split4(p[0], p[8 * ld], p[4], p[8 * ld + 4]);
}
#endif

// Kernel 1 for chunk blockIdx.x (chunk_of_block) of value head blockIdx.y.
__global__ void __launch_bounds__(kChunkThreads, 1) gdn_prefill_chunk_kernel(ChunkArgs a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  extern __shared__ float4 smem4[];
  float* sK = reinterpret_cast<float*>(smem4);
  float* sQ = sK + kChunk * kRowA;  // later the v blocks
  float* sA = sQ + kChunk * kRowA;
  float* sT = sA + kChunk * kRowT;
  float* sG = sT + kChunk * kRowT;
  float* sB = sG + kChunk;
  RunRange run;
  int64_t c;
  if (!chunk_of_block(a.runs, blockIdx.x, run, c)) return;  // the whole CTA: no barrier skipped
  const int h = blockIdx.y, hk = h / a.ratio;
  const int64_t t0 = run.begin + c * kChunk;
  const int n = static_cast<int>(run.end - t0 < kChunk ? run.end - t0 : kChunk);
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int dk = a.dk, dv = a.dv;
  const int64_t qk_stride = 2 * int64_t{a.Hk} * dk, vo_stride = int64_t{a.Hv} * dv;

  // q^, k^ rows (zero past n tokens and dk columns), g and beta (zero past n).
  for (int e = tid; e < kChunk * (kChunkDk / 4); e += kChunkThreads) {
    const int row = e / (kChunkDk / 4), c4 = (e % (kChunkDk / 4)) * 4;
    float* dq = sQ + row * kRowA + c4;
    float* dkk = sK + row * kRowA + c4;
    if (row < n && c4 < dk) {
      const float* src = a.qk + (t0 + row) * qk_stride + int64_t{hk} * dk + c4;
      cp_async16(dq, src);
      cp_async16(dkk, src + int64_t{a.Hk} * dk);
    } else {
      *reinterpret_cast<float4*>(dq) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      *reinterpret_cast<float4*>(dkk) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  cp_async_commit();
  float* Grow = a.G + int64_t{h} * a.tokens + t0;
  if (tid < kChunk) {
    sG[tid] = tid < n ? Grow[tid] : 0.0f;  // a padded token decays by exp(0): G stays G_n
    sB[tid] = tid < n ? a.beta[int64_t{h} * a.tokens + t0 + tid] : 0.0f;
  }
  __syncthreads();
  if (tid == 0) {  // G_t = g_1 + ... + g_t, left to right
    float acc = 0.0f;
    for (int i = 0; i < kChunk; ++i) {
      acc += sG[i];
      sG[i] = acc;
    }
  }
  dev::cp_async_wait_group<0>();
  __syncthreads();
  if (tid < n) Grow[tid] = sG[tid];  // every read of g was before the barrier

  {  // A = strict_lower(beta_i (k_i . k_j) e^{G_i - G_j}) -> sA; P -> global. Warp w: rows
     // 16w..16w+15, columns j <= 16w + 15 (n-tiles 0..2w+1; the rest is zero).
    float kk[8][4], qk[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) kk[nt][r] = qk[nt][r] = 0.0f;
#pragma unroll 4
    for (int ks = 0; ks < kChunkDk / 8; ++ks) {
      const Frag4 fk = load_a(sK, kRowA, 16 * w, 8 * ks, g, t);
      const Frag4 fq = load_a(sQ, kRowA, 16 * w, 8 * ks, g, t);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        if (nt <= 2 * w + 1) {  // B = K^T: b0 = k^[8nt + g][8ks + t]
          const float* p = sK + (8 * nt + g) * kRowA + 8 * ks + t;
          const Frag2 fb = split2(p[0], p[4]);
          mma3(kk[nt], fk, fb);
          mma3(qk[nt], fq, fb);
        }
      }
    }
    float* Prow = a.P + (int64_t{h} * a.tokens + t0) * kChunk;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * w + g + 8 * hr, j = 8 * nt + 2 * t;
        float av[2], pv[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          // Masked by selection, never by a product: e^{G_i - G_j} may overflow for j > i.
          const float dec = j + u <= i ? expf(sG[i] - sG[j + u]) : 0.0f;
          av[u] = j + u < i ? sB[i] * kk[nt][2 * hr + u] * dec : 0.0f;
          pv[u] = j + u <= i ? qk[nt][2 * hr + u] * dec : 0.0f;
        }
        *reinterpret_cast<float2*>(sA + i * kRowT + j) = make_float2(av[0], av[1]);
        if (i < n) *reinterpret_cast<float2*>(Prow + i * kChunk + j) = make_float2(pv[0], pv[1]);
      }
    }
  }
  __syncthreads();  // sA complete; q^ no longer needed

  constexpr int kVBlock = kChunk;  // v columns per block ([64][kRowV] in q^'s space)
  const int vblocks = (dv + kVBlock - 1) / kVBlock;
  float* sV = sQ;
  auto load_v = [&](int cb) {
    for (int e = tid; e < kChunk * (kVBlock / 4); e += kChunkThreads) {
      const int row = e / (kVBlock / 4), c4 = (e % (kVBlock / 4)) * 4;
      const int col = cb * kVBlock + c4;
      float* dst = sV + row * kRowV + c4;
      if (row < n && col < dv)
        cp_async16(dst, a.vo + (t0 + row) * vo_stride + int64_t{h} * dv + col);
      else
        *reinterpret_cast<float4*>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    cp_async_commit();
  };
  load_v(0);  // lands during the substitution

  if (tid < kChunk) {
    // T = (I + A)^-1 diag(beta): column k = tid by forward substitution,
    // x_i = [i == k] beta_i - sum_{j<i} A_ij x_j (x_i = 0 for i < k follows). Registers only,
    // A rows broadcast from shared memory.
    const int k = tid;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const float* arow = sA + i * kRowT;
      float acc = 0.0f;
#pragma unroll
      for (int j4 = 0; j4 < i; j4 += 4) {
        const float4 a4 = *reinterpret_cast<const float4*>(arow + j4);
        acc = fmaf(a4.x, x[j4], acc);
        if (j4 + 1 < i) acc = fmaf(a4.y, x[j4 + 1], acc);
        if (j4 + 2 < i) acc = fmaf(a4.z, x[j4 + 2], acc);
        if (j4 + 3 < i) acc = fmaf(a4.w, x[j4 + 3], acc);
      }
      x[i] = (i == k ? sB[i] : 0.0f) - acc;
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) sT[i * kRowT + k] = x[i];
  }
  __syncthreads();

  {  // W = T (K o e^G): warp w rows 16w.., all kChunkDk columns, k = tokens j <= 16w + 15.
    float acc[kChunkDk / 8][4];
#pragma unroll
    for (int nt = 0; nt < kChunkDk / 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
    for (int ks = 0; ks <= 2 * w + 1; ++ks) {
      const Frag4 fa = load_a(sT, kRowT, 16 * w, 8 * ks, g, t);
      const float e0 = expf(sG[8 * ks + t]), e1 = expf(sG[8 * ks + t + 4]);  // <= 1
#pragma unroll
      for (int nt = 0; nt < kChunkDk / 8; ++nt) {
        const float* p = sK + (8 * ks + t) * kRowA + 8 * nt + g;
        const Frag2 fb = split2(p[0] * e0, p[4 * kRowA] * e1);
        mma3(acc[nt], fa, fb);
      }
    }
    float* Wrow = a.W + (int64_t{h} * a.tokens + t0) * dk;
#pragma unroll
    for (int nt = 0; nt < kChunkDk / 8; ++nt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * w + g + 8 * hr, col = 8 * nt + 2 * t;
        if (i < n && col < dk)  // dk % 4 == 0: col + 1 < dk too
          *reinterpret_cast<float2*>(Wrow + int64_t{i} * dk + col) =
              make_float2(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
      }
    }
  }

  // U = T V per block of 64 columns, over v in place.
  for (int cb = 0; cb < vblocks; ++cb) {
    if (cb > 0) {
      __syncthreads();  // every read of the previous block is done
      load_v(cb);
    }
    dev::cp_async_wait_group<0>();
    __syncthreads();
    float acc[kVBlock / 8][4];
#pragma unroll
    for (int nt = 0; nt < kVBlock / 8; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
    for (int ks = 0; ks <= 2 * w + 1; ++ks) {
      const Frag4 fa = load_a(sT, kRowT, 16 * w, 8 * ks, g, t);
#pragma unroll
      for (int nt = 0; nt < kVBlock / 8; ++nt) {
        const float* p = sV + (8 * ks + t) * kRowV + 8 * nt + g;
        mma3(acc[nt], fa, split2(p[0], p[4 * kRowV]));
      }
    }
#pragma unroll
    for (int nt = 0; nt < kVBlock / 8; ++nt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = 16 * w + g + 8 * hr, col = cb * kVBlock + 8 * nt + 2 * t;
        if (i < n && col < dv)
          *reinterpret_cast<float2*>(a.vo + (t0 + i) * vo_stride + int64_t{h} * dv + col) =
              make_float2(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
      }
    }
  }
#else
  __trap();  // the launcher runs the sequential scan below sm_80
#endif
}

// Kernel 2 for (value head, slice of NV dv columns) blockIdx.x and run blockIdx.y. NV / 8 warps;
// warp w: D and O rows 16 (w % 4).., state rows 32 (w % 4).., columns 32 (w / 4)..+31 of the
// slice. Per chunk, two barriers; the copies of the next operands overlap the other phase:
// top: [wait W, q^, U, G of c] sync, issue k^, P of c; phase A (D, O partial) -> D to shared;
// [wait k^, P] sync, issue W, q^, U, G of c + 1; phase B (O += P D, S update) -> S to shared.
template <int NV>
__global__ void __launch_bounds__(NV * 4, 1) gdn_prefill_chunk_scan_kernel(ChunkArgs a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kThreads = NV * 4;
  constexpr int kRowN = NV + 8;  // U, S, D rows
  extern __shared__ float4 smem4[];
  float* sW = reinterpret_cast<float*>(smem4);
  float* sQ = sW + kChunk * kRowA;
  float* sU = sQ + kChunk * kRowA;
  float* sG = sU + kChunk * kRowN;  // [2][64], by chunk parity
  float* sK = sG + 2 * kChunk;
  float* sP = sK + kChunk * kRowKt;
  float* sS = sP + kChunk * kRowT;
  float* sD = sS + kChunkDk * kRowN;

  const int dk = a.dk, dv = a.dv;
  const int slices = (dv + NV - 1) / NV;
  const int h = blockIdx.x / slices, sl = blockIdx.x - h * slices, hk = h / a.ratio;
  const int col0 = sl * NV;  // the slice's first dv column
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int mt = w & 3, cw = 32 * (w >> 2);  // row tile; the warp's first column in the slice
  const RunRange run = run_range(a.runs, static_cast<int>(blockIdx.y));
  const int64_t qk_stride = 2 * int64_t{a.Hk} * dk, vo_stride = int64_t{a.Hv} * dv;
  const int64_t nchunks = (run.end - run.begin + kChunk - 1) / kChunk;
  float* state = run.state + int64_t{h} * dk * dv;
  const float* Wh = a.W + int64_t{h} * a.tokens * dk;
  const float* Ph = a.P + int64_t{h} * a.tokens * kChunk;
  const float* Gh = a.G + int64_t{h} * a.tokens;
  auto chunk_len = [&](int64_t c) {
    const int64_t left = run.end - run.begin - c * kChunk;
    return static_cast<int>(left < kChunk ? left : kChunk);
  };
  auto zero4 = [](float* p) { *reinterpret_cast<float4*>(p) = make_float4(0.f, 0.f, 0.f, 0.f); };
  auto issue_a = [&](int64_t c) {  // W, q^, U, G of chunk c
    const int64_t t0 = run.begin + c * kChunk;
    const int n = chunk_len(c);
    for (int e = tid; e < kChunk * (kChunkDk / 4); e += kThreads) {
      const int row = e / (kChunkDk / 4), c4 = (e % (kChunkDk / 4)) * 4;
      if (row < n && c4 < dk) {
        cp_async16(sW + row * kRowA + c4, Wh + (t0 + row) * dk + c4);
        cp_async16(sQ + row * kRowA + c4, a.qk + (t0 + row) * qk_stride + int64_t{hk} * dk + c4);
      } else {
        zero4(sW + row * kRowA + c4);
        zero4(sQ + row * kRowA + c4);
      }
    }
    for (int e = tid; e < kChunk * (NV / 4); e += kThreads) {
      const int row = e / (NV / 4), c4 = (e % (NV / 4)) * 4;
      if (row < n && col0 + c4 < dv)
        cp_async16(sU + row * kRowN + c4,
                   a.vo + (t0 + row) * vo_stride + int64_t{h} * dv + col0 + c4);
      else
        zero4(sU + row * kRowN + c4);
    }
    float* gbuf = sG + (c & 1) * kChunk;
    for (int e = tid; e < kChunk; e += kThreads) {
      if (e < n)
        cp_async4(gbuf + e, Gh + t0 + e);
      else
        gbuf[e] = 0.0f;  // never read (masked by n below)
    }
    cp_async_commit();
  };
  auto issue_b = [&](int64_t c) {  // k^, P of chunk c
    const int64_t t0 = run.begin + c * kChunk;
    const int n = chunk_len(c);
    for (int e = tid; e < kChunk * (kChunkDk / 4); e += kThreads) {
      const int row = e / (kChunkDk / 4), c4 = (e % (kChunkDk / 4)) * 4;
      if (row < n && c4 < dk)
        cp_async16(sK + row * kRowKt + c4,
                   a.qk + (t0 + row) * qk_stride + int64_t{a.Hk + hk} * dk + c4);
      else
        zero4(sK + row * kRowKt + c4);
    }
    for (int e = tid; e < kChunk * (kChunk / 4); e += kThreads) {
      const int row = e / (kChunk / 4), c4 = (e % (kChunk / 4)) * 4;
      if (row < n)
        cp_async16(sP + row * kRowT + c4, Ph + (t0 + row) * kChunk + c4);
      else
        zero4(sP + row * kRowT + c4);
    }
    cp_async_commit();
  };

  // The state slice: shared memory (zero past dk rows and dv columns), then this warp's C
  // fragments in registers: s[mi][nt] rows 32 mt + 16 mi + g (+8), columns cw + 8 nt + 2t (+1).
  for (int e = tid; e < kChunkDk * NV; e += kThreads) {
    const int row = e / NV, col = e % NV;
    sS[row * kRowN + col] =
        row < dk && col0 + col < dv ? state[int64_t{row} * dv + col0 + col] : 0.0f;
  }
  __syncthreads();
  float s[2][4][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const float2 v = *reinterpret_cast<const float2*>(
            sS + (32 * mt + 16 * mi + g + 8 * hr) * kRowN + cw + 8 * nt + 2 * t);
        s[mi][nt][2 * hr] = v.x;
        s[mi][nt][2 * hr + 1] = v.y;
      }
  issue_a(0);

  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t t0 = run.begin + c * kChunk;
    const int n = chunk_len(c);
    const float* sGc = sG + (c & 1) * kChunk;
    dev::cp_async_wait_group<0>();
    __syncthreads();  // W, q^, U, G of c and S in place; phase B of c - 1 done everywhere
    issue_b(c);

    // Phase A: D = U - W S and O = (Q o e^G) S over the kChunkDk key rows (zero past dk).
    float d[4][4], o[4][4];
    const int r0 = 16 * mt + g;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const float2 u =
            *reinterpret_cast<const float2*>(sU + (r0 + 8 * hr) * kRowN + cw + 8 * nt + 2 * t);
        d[nt][2 * hr] = u.x;
        d[nt][2 * hr + 1] = u.y;
        o[nt][2 * hr] = o[nt][2 * hr + 1] = 0.0f;
      }
    }
    const float eq0 = r0 < n ? expf(sGc[r0]) : 0.0f;  // <= 1
    const float eq1 = r0 + 8 < n ? expf(sGc[r0 + 8]) : 0.0f;
#pragma unroll 2
    for (int ks = 0; ks < kChunkDk / 8; ++ks) {
      const float* pw = sW + r0 * kRowA + 8 * ks + t;
      const float* pq = sQ + r0 * kRowA + 8 * ks + t;
      const Frag4 fw = split4(-pw[0], -pw[8 * kRowA], -pw[4], -pw[8 * kRowA + 4]);
      const Frag4 fq =
          split4(pq[0] * eq0, pq[8 * kRowA] * eq1, pq[4] * eq0, pq[8 * kRowA + 4] * eq1);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float* ps = sS + (8 * ks + t) * kRowN + cw + 8 * nt + g;
        const Frag2 fs = split2(ps[0], ps[4 * kRowN]);
        mma3(d[nt], fw, fs);
        mma3(o[nt], fq, fs);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<float2*>(sD + (r0 + 8 * hr) * kRowN + cw + 8 * nt + 2 * t) =
            make_float2(d[nt][2 * hr], d[nt][2 * hr + 1]);
    dev::cp_async_wait_group<0>();
    __syncthreads();  // D, k^, P in place; every read of W, q^, U, S done
    if (c + 1 < nchunks) issue_a(c + 1);

    // Phase B: O += P D (tokens j <= 16 mt + 15), then the state update.
    for (int ks = 0; ks <= 2 * mt + 1; ++ks) {
      const Frag4 fp = load_a(sP, kRowT, 16 * mt, 8 * ks, g, t);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float* pd = sD + (8 * ks + t) * kRowN + cw + 8 * nt + g;
        mma3(o[nt], fp, split2(pd[0], pd[4 * kRowN]));
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = r0 + 8 * hr, col = col0 + cw + 8 * nt + 2 * t;
        if (i < n && col < dv)  // dv % 4 == 0: col + 1 < dv too
          *reinterpret_cast<float2*>(a.vo + (t0 + i) * vo_stride + int64_t{h} * dv + col) =
              make_float2(o[nt][2 * hr], o[nt][2 * hr + 1]);
      }
    }
    const float Gn = sGc[n - 1];
    const float gam = expf(Gn);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) s[mi][nt][r] *= gam;
#pragma unroll 1
    for (int ks = 0; ks < kChunk / 8; ++ks) {
      const int j0 = 8 * ks + t, j1 = j0 + 4;
      const float ek0 = j0 < n ? expf(Gn - sGc[j0]) : 0.0f;  // <= 1
      const float ek1 = j1 < n ? expf(Gn - sGc[j1]) : 0.0f;
      Frag2 fd[4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float* pd = sD + j0 * kRowN + cw + 8 * nt + g;
        fd[nt] = split2(pd[0], pd[4 * kRowN]);
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        // A = (K o e^{G_n - G})^T: a0 = k^[j0][32 mt + 16 mi + g], rows of k^ are tokens.
        const float* pk = sK + j0 * kRowKt + 32 * mt + 16 * mi + g;
        const Frag4 fk =
            split4(pk[0] * ek0, pk[8] * ek0, pk[4 * kRowKt] * ek1, pk[4 * kRowKt + 8] * ek1);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma3(s[mi][nt], fk, fd[nt]);
      }
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          *reinterpret_cast<float2*>(sS + (32 * mt + 16 * mi + g + 8 * hr) * kRowN + cw + 8 * nt +
                                     2 * t) = make_float2(s[mi][nt][2 * hr], s[mi][nt][2 * hr + 1]);
  }

#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = 32 * mt + 16 * mi + g + 8 * hr, col = col0 + cw + 8 * nt + 2 * t;
        if (row < dk && col < dv)
          *reinterpret_cast<float2*>(state + int64_t{row} * dv + col) =
              make_float2(s[mi][nt][2 * hr], s[mi][nt][2 * hr + 1]);
      }
#else
  __trap();  // the launcher runs the sequential scan below sm_80
#endif
}

// Step 7 for (token, value head) = warp index / Hv, % Hv: o * rsqrt(mean(o^2) + eps) * w *
// sigmoid(z) -> BF16, the decode kernel's expression.
__global__ void __launch_bounds__(kNormThreads)
    gdn_prefill_norm_kernel(const float* __restrict__ vo, const float* __restrict__ proj,
                            int64_t stride, int64_t tokens, const float* __restrict__ norm_w,
                            uint16_t* __restrict__ out, int Hv, int dv, int64_t z_off, float eps) {
  const int64_t gw = int64_t{blockIdx.x} * (kNormThreads / 32) + (threadIdx.x >> 5);
  if (gw >= tokens * Hv) return;
  const int lane = threadIdx.x & 31;
  const int64_t p = gw / Hv;
  const int h = static_cast<int>(gw - p * Hv);
  const int64_t off = p * Hv * int64_t{dv} + int64_t{h} * dv;
  const float* o = vo + off;
  const float* z = proj + p * stride + z_off + int64_t{h} * dv;
  float ov[kMaxHeadDim / 32];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxHeadDim / 32; ++j) {
    const int d = lane + 32 * j;
    ov[j] = d < dv ? o[d] : 0.0f;
    ss = fmaf(ov[j], ov[j], ss);
  }
  ss = warp_sum(ss);
  const float mean = ss / static_cast<float>(dv);
  const float rs = 1.0f / sqrtf(mean + eps);
#pragma unroll
  for (int j = 0; j < kMaxHeadDim / 32; ++j) {
    const int d = lane + 32 * j;
    if (d < dv) out[off + d] = dev::float_to_bf16_bits(ov[j] * rs * norm_w[d] * sigmoid2(z[d]));
  }
}

void check_shape(const GdnPrefillParams& p, const char* op) {
  FN_LAUNCH_REQUIRE(p.tokens >= 1 && p.tokens <= INT_MAX, op);
  FN_LAUNCH_REQUIRE(
      p.num_k_heads >= 1 && p.num_v_heads >= p.num_k_heads && p.num_v_heads % p.num_k_heads == 0,
      op);
  FN_LAUNCH_REQUIRE(p.k_head_dim >= 4 && p.k_head_dim <= kMaxHeadDim && p.k_head_dim % 4 == 0, op);
  FN_LAUNCH_REQUIRE(p.v_head_dim >= 4 && p.v_head_dim <= kMaxHeadDim && p.v_head_dim % 4 == 0, op);
  const int64_t conv_dim =
      2 * int64_t{p.num_k_heads} * p.k_head_dim + int64_t{p.num_v_heads} * p.v_head_dim;
  FN_LAUNCH_REQUIRE(conv_dim + 2 * int64_t{p.num_v_heads} * (p.v_head_dim + 1) < INT_MAX, op);
}

// The scan's lanes per column and rows per lane for dk: P the smallest power of two with
// dk <= 32 P, R in {8, 16, 32} covering ceil(dk / P).
void scan_rows(int dk, int& P, int& R) {
  P = 1;
  while (P * 32 < dk) P *= 2;
  const int rows = (dk + P - 1) / P;
  R = rows <= 8 ? 8 : rows <= 16 ? 16 : 32;
}

int scan_tile_tokens(int Dp, int vc) {
  int T = 2048 / Dp;
  if (T > 16) T = 16;
  if (T < 1) T = 1;
  while (T > 1 && tile_floats(T, Dp, vc) * 2 * static_cast<int>(sizeof(float)) > kScanMaxSmem)
    T /= 2;
  return T;
}

// The current device's compute capability major and opt-in shared memory per block (queried per
// launch, as the other prefill launchers do).
struct DeviceCaps {
  int major, smem_optin;
};

DeviceCaps device_caps() {
  int dev = 0;
  DeviceCaps c{};
  FN_CUDA_CHECK(cudaGetDevice(&dev));
  FN_CUDA_CHECK(cudaDeviceGetAttribute(&c.major, cudaDevAttrComputeCapabilityMajor, dev));
  FN_CUDA_CHECK(
      cudaDeviceGetAttribute(&c.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return c;
}

constexpr size_t kChunkSmemBytes = size_t{kChunkSmemFloats} * sizeof(float);

size_t chunk_scan_smem_bytes(int nv) {
  return static_cast<size_t>(scan_smem_floats(nv)) * sizeof(float);
}

// Whether this device gives a CTA the shared memory of kernel 1 and of kernel 2 with nv columns.
bool chunk_scan_fits(int nv) {
  const DeviceCaps c = device_caps();
  const size_t optin = static_cast<size_t>(c.smem_optin);
  return c.major >= 8 && optin >= kChunkSmemBytes && optin >= chunk_scan_smem_bytes(nv);
}

// The recurrence runs as the chunked scan (tensor cores, sm_80+, dk <= kChunkDk, the shared memory
// of 32-column slices) for any token count, runs and lengths (a one-token run is a partial
// chunk); else (sm_75, dk > kChunkDk, e.g. 99 KB of shared memory on sm_86/89) as the sequential
// scan, the decode kernel's arithmetic token by token.
bool chunked_scan(const GdnPrefillParams& p) {
  return p.k_head_dim <= kChunkDk && p.num_v_heads <= 65535 && chunk_scan_fits(32);
}

void check_params(const GdnPrefillParams& p) {
  constexpr const char* kOp = "launch_gdn_prefill";
  FN_LAUNCH_REQUIRE(p.proj != nullptr && p.conv_weight != nullptr && p.A_log != nullptr &&
                        p.dt_bias != nullptr && p.norm_weight != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.out != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.runs >= 0 && p.runs <= 65535 && p.runs <= p.tokens, kOp);
  if (p.runs == 0) {
    FN_LAUNCH_REQUIRE(p.conv_state != nullptr && p.state != nullptr, kOp);
  } else {
    FN_LAUNCH_REQUIRE(p.run_start != nullptr && p.run_slot != nullptr && p.slot_state != nullptr &&
                          p.slot_conv != nullptr,
                      kOp);
  }
  FN_LAUNCH_REQUIRE(
      p.workspace != nullptr && (reinterpret_cast<uintptr_t>(p.workspace) & 255u) == 0, kOp);
  check_shape(p, kOp);
  FN_LAUNCH_REQUIRE(p.conv_kernel >= 2 && p.conv_kernel <= kMaxConvKernel, kOp);
  const int64_t conv_dim =
      2 * int64_t{p.num_k_heads} * p.k_head_dim + int64_t{p.num_v_heads} * p.v_head_dim;
  FN_LAUNCH_REQUIRE(
      p.proj_stride >= conv_dim + int64_t{p.num_v_heads} * p.v_head_dim + 2 * p.num_v_heads, kOp);
  FN_LAUNCH_REQUIRE(p.eps >= 0.0f, kOp);
  const int f = p.slice_columns;
  if (chunked_scan(p)) {
    FN_LAUNCH_REQUIRE(f == 0 || f == 32 || (f == 64 && chunk_scan_fits(64)), kOp);
  } else {
    int P, R;
    scan_rows(p.k_head_dim, P, R);
    FN_LAUNCH_REQUIRE(f == 0 || (f >= 4 && f <= 128 && (f & (f - 1)) == 0 &&
                                 p.v_head_dim % f == 0 && f * P <= kScanMaxThreads),
                      kOp);
  }
}

}  // namespace

size_t gdn_prefill_workspace_bytes(const GdnPrefillParams& p) {
  check_shape(p, "gdn_prefill_workspace_bytes");
  return layout_of(p).total;
}

int plan_gdn_prefill_slice(const GdnPrefillParams& p) {
  check_params(p);
  if (p.slice_columns != 0) return p.slice_columns;
  if (chunked_scan(p)) {
    // 64-column slices (8 warps, half the redundant reads of W, q^, k^, P per head) unless that
    // leaves SMs idle that 32-column slices would fill: kernel 2 holds one CTA per SM (its
    // shared memory), so at most one wave. Hv = 48, dv = 128 on 132 SMs: 96 CTAs of 64 columns
    // (192 of 32 would take two waves); Hv = 24: 96 CTAs of 32 columns.
    const int64_t runs = p.runs > 0 ? p.runs : 1;
    const int64_t ctas32 = int64_t{p.num_v_heads} * ((p.v_head_dim + 31) / 32) * runs;
    const bool wide =
        ctas32 > detail::current_sm_count() && p.v_head_dim > 32 && chunk_scan_fits(64);
    return wide ? 64 : 32;
  }
  int P, R;
  scan_rows(p.k_head_dim, P, R);
  int vc = 128 / P;  // >= 4: P <= 32
  while (p.v_head_dim % vc != 0) vc /= 2;
  // Narrower slices until about two CTAs per SM, but not below 16 columns. Measured on one H200
  // at dk = dv = 128, M = 8192 (test_cuda_gdn_prefill bench, whole launch): Hv = 48: 8 / 16 /
  // 32 columns 6.00 / 5.70 / 6.01 ms; Hv = 24: 4.19 / 4.06 / 3.91 ms.
  // Each run scans its own rows: the runs multiply the CTAs.
  const int64_t target = 2 * static_cast<int64_t>(detail::current_sm_count());
  const int64_t runs = p.runs > 0 ? p.runs : 1;
  const int floor = vc < 16 ? vc : 16;
  while (vc > floor && int64_t{p.num_v_heads} * (p.v_head_dim / vc) * runs < target) vc /= 2;
  return vc;
}

void launch_gdn_prefill(const GdnPrefillParams& p, cudaStream_t stream) {
  const int vc = plan_gdn_prefill_slice(p);  // also checks the parameters
  const int Hk = p.num_k_heads, Hv = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
  const int conv_dim = 2 * Hk * dk + Hv * dv;
  const Layout l = layout_of(p);
  char* ws = static_cast<char*>(p.workspace);
  float* qk = reinterpret_cast<float*>(ws + l.qk);
  float* vo = reinterpret_cast<float*>(ws + l.vo);
  float* beta = reinterpret_cast<float*>(ws + l.beta);
  float* decay = reinterpret_cast<float*>(ws + l.decay);
  float* kq = reinterpret_cast<float*>(ws + l.kq);
  Runs runs;
  runs.count = p.runs > 0 ? p.runs : 1;
  runs.start = p.runs > 0 ? p.run_start : nullptr;
  runs.slot = p.run_slot;
  runs.state = p.slot_state;
  runs.conv = p.slot_conv;
  runs.one_state = p.state;
  runs.one_conv = p.conv_state;
  runs.tokens = p.tokens;

  {  // conv + gates + L2 norms
    ConvArgs ca;
    ca.runs = runs;
    ca.proj = p.proj;
    ca.stride = p.proj_stride;
    ca.tokens = p.tokens;
    ca.conv_w = p.conv_weight;
    ca.A_log = p.A_log;
    ca.dt_bias = p.dt_bias;
    ca.qk = qk;
    ca.vo = vo;
    ca.beta = beta;
    ca.decay = decay;
    ca.kq = kq;
    ca.Hk = Hk;
    ca.Hv = Hv;
    ca.dk = dk;
    ca.dv = dv;
    ca.K = p.conv_kernel;
    const int K = p.conv_kernel;
    if (dk <= 128 && K >= 2 && K <= 4) {  // the token tiles (every input loaded once)
      const int v_groups = static_cast<int>((int64_t{Hv} * dv + 127) / 128);
      const int warps = Hk + v_groups + 1;
      const dim3 grid(static_cast<unsigned>((p.tokens + kConvTileTokens - 1) / kConvTileTokens),
                      static_cast<unsigned>((warps + kConvTileWarps - 1) / kConvTileWarps));
      if (K == 2)
        gdn_prefill_conv_tile_kernel<4, 2><<<grid, kConvThreads, 0, stream>>>(ca, v_groups);
      if (K == 3)
        gdn_prefill_conv_tile_kernel<4, 3><<<grid, kConvThreads, 0, stream>>>(ca, v_groups);
      if (K == 4)
        gdn_prefill_conv_tile_kernel<4, 4><<<grid, kConvThreads, 0, stream>>>(ca, v_groups);
      FN_CUDA_LAUNCH_CHECK("gdn_prefill_conv_tile_kernel");
    } else {
      const unsigned grid = static_cast<unsigned>(p.tokens);
      if (dk <= 128) {
        gdn_prefill_conv_kernel<4><<<grid, kConvThreads, 0, stream>>>(ca);
      } else {
        gdn_prefill_conv_kernel<kMaxHeadDim / 32><<<grid, kConvThreads, 0, stream>>>(ca);
      }
      FN_CUDA_LAUNCH_CHECK("gdn_prefill_conv_kernel");
    }
  }

  {  // conv state update, per run
    const dim3 grid(static_cast<unsigned>((conv_dim + 255) / 256),
                    static_cast<unsigned>(runs.count));
    gdn_prefill_conv_state_kernel<<<grid, 256, 0, stream>>>(runs, p.proj, p.proj_stride, conv_dim,
                                                            p.conv_kernel);
    FN_CUDA_LAUNCH_CHECK("gdn_prefill_conv_state_kernel");
  }

  if (chunked_scan(p)) {  // the recurrence, chunked
    ChunkArgs ca;
    ca.runs = runs;
    ca.qk = qk;
    ca.vo = vo;
    ca.beta = beta;
    ca.G = decay;
    ca.W = reinterpret_cast<float*>(ws + l.w);
    ca.P = reinterpret_cast<float*>(ws + l.pm);
    ca.tokens = p.tokens;
    ca.Hk = Hk;
    ca.Hv = Hv;
    ca.dk = dk;
    ca.dv = dv;
    ca.ratio = Hv / Hk;
    const int64_t slots =
        p.runs > 0 ? p.tokens / kChunk + p.runs : (p.tokens + kChunk - 1) / kChunk;
    FN_CUDA_CHECK(cudaFuncSetAttribute(gdn_prefill_chunk_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kChunkSmemBytes)));
    gdn_prefill_chunk_kernel<<<dim3(static_cast<unsigned>(slots), static_cast<unsigned>(Hv)),
                               kChunkThreads, kChunkSmemBytes, stream>>>(ca);
    FN_CUDA_LAUNCH_CHECK("gdn_prefill_chunk_kernel");
    const dim3 grid(static_cast<unsigned>(Hv * ((dv + vc - 1) / vc)),
                    static_cast<unsigned>(runs.count));
    const size_t smem = chunk_scan_smem_bytes(vc);
    if (vc == 64) {
      FN_CUDA_CHECK(cudaFuncSetAttribute(gdn_prefill_chunk_scan_kernel<64>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
      gdn_prefill_chunk_scan_kernel<64><<<grid, 64 * 4, smem, stream>>>(ca);
    } else {
      FN_CUDA_CHECK(cudaFuncSetAttribute(gdn_prefill_chunk_scan_kernel<32>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
      gdn_prefill_chunk_scan_kernel<32><<<grid, 32 * 4, smem, stream>>>(ca);
    }
    FN_CUDA_LAUNCH_CHECK("gdn_prefill_chunk_scan_kernel");
  } else {  // the recurrence, sequential
    int P, R;
    scan_rows(dk, P, R);
    const int T = scan_tile_tokens(R * P, vc);
    const size_t smem = size_t{2} * tile_floats(T, R * P, vc) * sizeof(float);
    FN_LAUNCH_REQUIRE(smem <= size_t{kScanMaxSmem}, "launch_gdn_prefill");
    ScanArgs sa;
    sa.runs = runs;
    sa.qk = qk;
    sa.vo = vo;
    sa.beta = beta;
    sa.decay = decay;
    sa.kq = kq;
    sa.tokens = p.tokens;
    sa.Hk = Hk;
    sa.Hv = Hv;
    sa.dk = dk;
    sa.dv = dv;
    sa.ratio = Hv / Hk;
    sa.P = P;
    sa.vc = vc;
    sa.T = T;
    const int threads = (vc * P + 31) / 32 * 32;
    const dim3 grid(static_cast<unsigned>(Hv * (dv / vc)), static_cast<unsigned>(runs.count));
    if (R == 8) {
      gdn_prefill_scan_kernel<8><<<grid, threads, smem, stream>>>(sa);
    } else if (R == 16) {
      gdn_prefill_scan_kernel<16><<<grid, threads, smem, stream>>>(sa);
    } else {
      gdn_prefill_scan_kernel<32><<<grid, threads, smem, stream>>>(sa);
    }
    FN_CUDA_LAUNCH_CHECK("gdn_prefill_scan_kernel");
  }

  {  // gated norm
    const int64_t warps = p.tokens * Hv;
    const int64_t blocks = (warps + kNormThreads / 32 - 1) / (kNormThreads / 32);
    gdn_prefill_norm_kernel<<<static_cast<unsigned>(blocks), kNormThreads, 0, stream>>>(
        vo, p.proj, p.proj_stride, p.tokens, p.norm_weight, p.out, Hv, dv, conv_dim, p.eps);
    FN_CUDA_LAUNCH_CHECK("gdn_prefill_norm_kernel");
  }
}

}  // namespace fn

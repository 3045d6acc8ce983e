// Gated DeltaNet prefill kernels (see gdn_prefill.h). Four launches in stream order:
// 1. gdn_prefill_conv_kernel, one CTA per token: the causal conv + SiLU of every channel (taps
//    before token 0 from the conv state; the same FMA chain as the decode kernel, so the conv
//    outputs are bitwise decode's), q/k L2-normalised per key head (q also by 1/sqrt(dk)) into the
//    workspace, v into the workspace, and the gates beta = sigmoid(b), exp(g) per (head, token).
// 2. gdn_prefill_conv_state_kernel: the conv state <- the last K-1 pre-conv inputs (after 1 has
//    read the old history).
// With several runs (GdnPrefillParams::runs) each row belongs to one sequence with its own
// states: 1 takes the history before a run's first row from that run's conv state, 2 and 3 run
// per run (the grid's y), 4 is per row anyway. A run's arithmetic is that of a launch of its rows
// alone, so its bits are too.
// 3. gdn_prefill_scan_kernel: the recurrence as a sequential scan over the tokens. One CTA per
//    (value head, slice of vc dv columns); a column's state [dk] is split over P consecutive lanes
//    (R rows each, in registers), so S^T k and S^T q are per-thread FMA chains plus a butterfly
//    over P lanes: no barrier per token. Tiles of T tokens (k, q, v, beta, exp(g)) are staged into
//    shared memory with cp.async, double buffered; o overwrites v in the workspace (each (token,
//    column) belongs to one CTA, and its v is in shared memory before its o is written). Only the
//    M real tokens are scanned: a partial last tile never touches the state.
// 4. gdn_prefill_norm_kernel, one warp per (token, value head): the gated RMSNorm -> BF16.
// Everything is FP32 with a fixed reduction order (no atomics): deterministic, and independent of
// the tiling, so prefill(a) + prefill(b) is bitwise prefill(a + b).
// Measured on one H200, dk = dv = 128, M = 8192: Hk/Hv = 16/48 5.7 ms per launch (conv 1.58,
// conv state 0.005, scan 3.60, norm 0.52); 8/24 about 4.1 ms (conv 0.82, scan 3.10, norm 0.26).
// The scan is bound by shared-memory wavefronts (every lane reads all of its k and q rows per
// token, 4 lanes per 16-byte word) and latency; next steps: several columns per thread to reuse
// each k/q load, or the chunked (WY) form on tensor cores; a sliding-window conv over token
// blocks (one load per input instead of K); the gated norm fused into a whole-head scan CTA.
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
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#else
// Through L2 (as .cg): v is overwritten by o in this kernel, so no non-coherent load.
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem) {
  *reinterpret_cast<float4*>(smem) = __ldcg(reinterpret_cast<const float4*>(gmem));
}
__device__ __forceinline__ void cp_async4(float* smem, const float* gmem) {
  *smem = *gmem;
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N>
__device__ __forceinline__ void cp_async_wait() {}
#endif

// The workspace sections (byte offsets, each 256-byte aligned).
struct Layout {
  size_t qk, vo, beta, decay, kq, total;
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
  l.total = l.kq + round256(Hk * M * sizeof(float));
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
  float* decay;  // [Hv, tokens]: exp(g)
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

// Steps 2, 4 and 5 for token blockIdx.x. J: per-lane entries of a head, >= dk / 32.
template <int J>
__global__ void __launch_bounds__(kConvThreads) gdn_prefill_conv_kernel(ConvArgs a) {
  const int64_t p = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const RunRange run = run_of_row(a.runs, p);
  const int64_t begin = run.begin;
  const float* hist = run.conv;
  const int64_t qk_stride = 2 * int64_t{a.Hk} * a.dk;
  const float q_scale = 1.0f / sqrtf(static_cast<float>(a.dk));
  // q_i and k_i (dk channels each) of key head i: one warp per key head.
  for (int i = warp; i < a.Hk; i += kConvThreads / 32) {
    float xq[J], xk[J];
    float sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int d = lane + 32 * j;
      xq[j] = xk[j] = 0.0f;
      if (d < a.dk) {
        xq[j] = conv_token(a, p, int64_t{i} * a.dk + d, begin, hist);
        xk[j] = conv_token(a, p, int64_t{a.Hk + i} * a.dk + d, begin, hist);
        sq = fmaf(xq[j], xq[j], sq);
        sk = fmaf(xk[j], xk[j], sk);
      }
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    // eps inside the rsqrt of the sum (§C.5 step 5); q^ = (q * rq) * q_scale as the decode kernel.
    const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
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
  // Gates (step 4), head-major so the scan stages a tile of them with one contiguous copy.
  const float* ab = a.proj + p * a.stride + qk_stride + 2 * vd;
  for (int h = tid; h < a.Hv; h += kConvThreads) {
    a.beta[int64_t{h} * a.tokens + p] = sigmoid2(ab[a.Hv + h]);
    a.decay[int64_t{h} * a.tokens + p] = dev::gdn_decay(ab[h], a.A_log[h], a.dt_bias[h]);
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
// exp(g) [T4], k^.q^ [T4] (T4 = T rounded up to 4 so every section stays 16-byte aligned).
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
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const float* base = sm + (tile & 1) * B;
    const int64_t t0 = run.begin + tile * T;
    const int n = tile_len(tile);
    for (int tt = 0; tt < n; ++tt) {
      const float* kk = base + kOff + tt * Dp;
      const float* qq = base + qOff + tt * Dp;
      const float decay = base[dOff + tt], beta = base[bOff + tt];
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
  int P, R;
  scan_rows(p.k_head_dim, P, R);
  const int f = p.slice_columns;
  FN_LAUNCH_REQUIRE(f == 0 || (f >= 4 && f <= 128 && (f & (f - 1)) == 0 && p.v_head_dim % f == 0 &&
                               f * P <= kScanMaxThreads),
                    kOp);
}

}  // namespace

size_t gdn_prefill_workspace_bytes(const GdnPrefillParams& p) {
  check_shape(p, "gdn_prefill_workspace_bytes");
  return layout_of(p).total;
}

int plan_gdn_prefill_slice(const GdnPrefillParams& p) {
  check_params(p);
  if (p.slice_columns != 0) return p.slice_columns;
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
    const unsigned grid = static_cast<unsigned>(p.tokens);
    if (dk <= 128) {
      gdn_prefill_conv_kernel<4><<<grid, kConvThreads, 0, stream>>>(ca);
    } else {
      gdn_prefill_conv_kernel<kMaxHeadDim / 32><<<grid, kConvThreads, 0, stream>>>(ca);
    }
    FN_CUDA_LAUNCH_CHECK("gdn_prefill_conv_kernel");
  }

  {  // conv state update, per run
    const dim3 grid(static_cast<unsigned>((conv_dim + 255) / 256),
                    static_cast<unsigned>(runs.count));
    gdn_prefill_conv_state_kernel<<<grid, 256, 0, stream>>>(runs, p.proj, p.proj_stride, conv_dim,
                                                            p.conv_kernel);
    FN_CUDA_LAUNCH_CHECK("gdn_prefill_conv_state_kernel");
  }

  {  // recurrence scan
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

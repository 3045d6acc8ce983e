// Gated DeltaNet decode kernels (see gdn.h). Ordering without a grid barrier:
// - conv state: q/k channels are read by all (Hv/Hk) * slices CTAs of a key head, so each must
//   have read the old history before it is shifted. Every CTA computes the conv of what it
//   reads, and the key head's last CTA to arrive (integer counter) shifts the q/k history; v
//   channels belong to one CTA, which shifts them at once.
// - gated norm: a head's dv columns come from several CTAs; the head's last CTA to arrive
//   normalises the whole head. Sums keep a fixed order, so results never depend on arrival order.
// Measured on one H200 (graph of 36 layers, states beyond the L2; docs/perf-history.md): 8.85 us
// per layer at TP=1 at the planned 32-column slices (9.37 at 16), against 1.8 us for a
// state-sized D2D copy: a CTA's chain of dependent round trips (state load, fences, arrival
// atomic, the last CTA's reads) dominates, not bandwidth. With PDL (cuda/common/pdl.cuh) the
// state is prefetched into L2 while the projection GEMV before it finishes. On sm_90 the real
// shape runs in thread-block clusters of one key head's CTAs (the kCl instance): distributed
// shared memory and one cluster barrier instead of the fences, arrival counters and L2 round
// trips above; 6.86 us per layer alone, -0.02 ms/token in the step.
#include "cuda/kernels/gdn.h"

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/real_shape.h"
#include "cuda/kernels/gdn_common.cuh"
#include "cuda/kernels/gemv_bf16.h"

namespace fn {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRows = 4;  // state rows per thread (registers: kMaxRows float4)
constexpr int kMaxHeadDim = 1024;
constexpr int kMaxSlice = 32;  // dv columns per CTA
constexpr int kMaxConvKernel = 8;
// The real layer's shape (docs/model.md §A.2: linear key/value head dim 128, conv kernel 4) with
// the slice width plan_gdn_decode_slice picks for it: the compile-time-shape instance.
constexpr int kFixedDk = real_shape::kGdnHeadDim;
constexpr int kFixedSlice = 32;
constexpr int kFixedConv = real_shape::kGdnConvKernel;

using dev::sigmoid2;
using dev::softplus;

// Step 2 for channel c: silu(w[K-1] * x + sum_{j<L} w[j] * hist[j]) in the CPU op's order (the
// current tap first, then oldest first), FMA chain. With shift, the pre-conv input x is then
// shifted into the history (oldest first; dilation 1 so L = K - 1). The prefill's conv kernel
// (gdn_prefill.cu) runs the same FMA chain.
__device__ __forceinline__ float conv_channel(const float* __restrict__ proj,
                                              const float* __restrict__ w, float* conv_state,
                                              int64_t c, int K, bool shift) {
  const int L = K - 1;
  float* hist = conv_state + c * L;
  const float* wc = w + c * K;
  const float x = proj[c];
  float h[kMaxConvKernel - 1];
  float acc = wc[K - 1] * x;
#pragma unroll
  for (int j = 0; j < kMaxConvKernel - 1; ++j) {
    if (j < L) {
      h[j] = hist[j];
      acc = fmaf(wc[j], h[j], acc);
    }
  }
  if (shift) {
#pragma unroll
    for (int j = 0; j + 1 < kMaxConvKernel - 1; ++j)
      if (j + 1 < L) hist[j] = h[j + 1];
    hist[L - 1] = x;
  }
  return dev::silu(acc);
}

// The shift alone (history <- history[1:] + x) for channel c.
__device__ __forceinline__ void conv_shift(const float* __restrict__ proj, float* conv_state,
                                           int64_t c, int K) {
  const int L = K - 1;
  float* hist = conv_state + c * L;
  float h[kMaxConvKernel - 1];
#pragma unroll
  for (int j = 0; j < kMaxConvKernel - 1; ++j)
    if (j < L) h[j] = hist[j];
#pragma unroll
  for (int j = 0; j + 1 < kMaxConvKernel - 1; ++j)
    if (j + 1 < L) hist[j] = h[j + 1];
  hist[L - 1] = proj[c];
}

struct RecArgs {
  const float* proj;
  const float* A_log;
  const float* dt_bias;
  const float* norm_w;
  const float* conv_w;
  float* conv_state;
  float* state;
  float* o_scratch;
  unsigned int* counters;
  uint16_t* out;
  int Hk, Hv, dk, dv;
  int vc;     // dv columns per CTA
  int ratio;  // Hv / Hk
  int conv_dim;
  int K;
  float eps;
  // The overlapped projection: the join words of the rows but z (awaited instead of the
  // programmatic wait) and of the z rows (awaited by the gated norm), and their launches' blocks.
  unsigned int* aword = nullptr;
  unsigned int* zword = nullptr;
  unsigned int a_signals = 0, z_signals = 0;
  // Rows by slot (GdnDecodeParams::row_slot set; blockIdx.y is the row): each row's slot, the
  // slots' states, and the rows' strides of proj and out.
  const int32_t* row_slot = nullptr;
  float* const* slot_state = nullptr;
  float* const* slot_conv = nullptr;
  int64_t proj_stride = 0, out_stride = 0;
};

// Row blockIdx.y of a launch over several rows: its slot's states, its projection and output
// rows, and its own o_scratch and arrival counters.
__device__ __forceinline__ void select_row(RecArgs& a) {
  const int r = static_cast<int>(blockIdx.y);
  const int slot = a.row_slot[r];
  a.state = a.slot_state[slot];
  a.conv_state = a.slot_conv[slot];
  a.proj += r * a.proj_stride;
  a.out += r * a.out_stride;
  a.o_scratch += static_cast<int64_t>(r) * a.Hv * a.dv;
  a.counters += static_cast<int64_t>(r) * (a.Hv + a.Hk);
}

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

// barrier.cluster arrive (relaxed: no memory ordering) and wait: the first barrier phase of the
// cluster path, which only says that every CTA of the cluster has started (sm_90+; nothing
// below, where the cluster path is never launched).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}
#endif

// The gated norm's per-element operands of one head (thread t = tid + j * kThreads): the norm
// weight w[t] and the gate z[t] (0 past dv).
__device__ __forceinline__ void load_norm_operands(const RecArgs& a, const float* z, int dv,
                                                   float (&nw)[kMaxRows], float (&nz)[kMaxRows]) {
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) {
    const int t = static_cast<int>(threadIdx.x) + j * kThreads;
    nw[j] = t < dv ? a.norm_w[t] : 0.0f;
    nz[j] = t < dv ? __ldcg(z + t) : 0.0f;  // through L2: the overlapped z rows
  }
}

// Steps 3-7 for one (value head h, slice of vc columns): the CTA's state tile [dk, vc] lives in
// registers, thread (rg, cg) holding rows rg, rg + RG, ... and columns cg*4 .. cg*4+3.
// It also does step 2 for the channels it reads: q_i and k_i (2 dk channels, read by the
// ratio * slices CTAs of key head i: the last of them to arrive shifts their history) and its own
// vc channels of v (shifted at once: no other CTA reads them).
//
// The instance <kFixedDk, kFixedDk, kFixedSlice, kFixedConv> is the real layer (dk = dv = 128,
// 32-column slices, conv kernel 4) at compile-time shape: its loops have fixed trip counts and
// its row and column predicates fold. The runtime-shape instance <0, 0, 0, 0> runs every other
// shape; the same operations in the same order, so the same bits.
//
// kCl (sm_90+, fixed instance only; launch_gdn_decode picks it): the grid runs in clusters of
// ratio * slices CTAs, one key head each, and the arrivals become one cluster barrier: every CTA
// stores its o columns into the shared memory of its value head's slice-0 CTA (distributed
// shared memory), the barrier orders them and every CTA's q/k history reads before the key
// head's first CTA shifts that history, and the slice-0 CTA normalises the head from its own
// shared memory. No fence, atomic or L2 round trip after the o columns; the same operations on
// the same values in the same order, so the same bits as the arrival path.
template <int kDk = 0, int kDv = 0, int kVc = 0, int kK = 0, bool kCl = false>
__global__ void __launch_bounds__(kThreads, 4) gdn_recurrent_kernel(RecArgs a) {
  static_assert((kDk > 0) == (kDv > 0) && (kDk > 0) == (kVc > 0) && (kDk > 0) == (kK > 0));
  static_assert(!kCl || kDk > 0, "the cluster path is the fixed instance's");
  __builtin_assume(threadIdx.x < kThreads);  // the launcher's block size
  if (a.row_slot != nullptr) select_row(a);
  const int dk = kDk > 0 ? kDk : a.dk, dv = kDv > 0 ? kDv : a.dv;
  const int vc = kVc > 0 ? kVc : a.vc, K = kK > 0 ? kK : a.K;
  __shared__ float qs[kMaxHeadDim], ks[kMaxHeadDim];
  __shared__ float part[kWarps][kMaxSlice];
  __shared__ float col[kMaxSlice], delta[kMaxSlice];
  __shared__ int last_head, last_key;
  const int slices = dv / vc;
  const int h = blockIdx.x / slices, sl = blockIdx.x - h * slices;
  const int i = h / a.ratio;  // repeat-interleave: value head h reads key head h / (Hv/Hk)
  const int tid = threadIdx.x;
  const int CG = vc >> 2, RG = kThreads / CG;
  const int cg = tid % CG, rg = tid / CG;
  const int col0 = sl * vc + cg * 4;
  float* S = a.state + static_cast<int64_t>(h) * dk * dv + col0;
  // Cluster path: this CTA's arrival at the cluster's first barrier phase, waited for before the
  // first access to another CTA's shared memory (which must have started by then).
  if constexpr (kCl) cluster_arrive_relaxed();

  // The state tile first: its loads are the kernel's cost and overlap everything below. This
  // kernel may follow anything (e.g. itself), so the tile is only prefetched into L2 before the
  // programmatic-dependent wait (memory-safe whatever runs) and loaded after it
  // (cuda/common/pdl.cuh).
  float4 s[kMaxRows];
  auto load_state = [&] {
#pragma unroll
    for (int j = 0; j < kMaxRows; ++j) {
      const int row = rg + j * RG;
      s[j] = row < dk ? *reinterpret_cast<const float4*>(S + static_cast<int64_t>(row) * dv)
                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  if ((cg & 7) == 0) {  // one prefetch per 128 bytes of a row
#pragma unroll
    for (int j = 0; j < kMaxRows; ++j) {
      const int row = rg + j * RG;
      if (row < dk) dev::prefetch_l2(S + static_cast<int64_t>(row) * dv);
    }
  }
  if (a.aword != nullptr) {
    // The overlapped projection: this launch follows the z rows, which do not wait for the
    // rows before them; those rows' join word stands for the programmatic wait (out_proj,
    // after this launch, waits for it programmatically).
    dev::pdl_launch_dependents();
    if (threadIdx.x == 0) dev::join_wait(a.aword, a.a_signals, gridDim.x);
    __syncthreads();
  } else {
    dev::pdl_wait();
    dev::pdl_launch_dependents();
  }
  load_state();
  // Step 4: gates of head h (they depend only on the projection).
  const float* ab = a.proj + a.conv_dim + static_cast<int64_t>(a.Hv) * dv;
  const float beta = sigmoid2(ab[a.Hv + h]);
  const float g = -expf(a.A_log[h]) * softplus(ab[h] + a.dt_bias[h]);
  const float decay = expf(g);

  // Step 2: q_i, k_i and this CTA's v columns.
  const int64_t q_base = static_cast<int64_t>(i) * dk;
  const int64_t k_base = static_cast<int64_t>(a.Hk) * dk + q_base;
  const int64_t v_chan =
      2 * static_cast<int64_t>(a.Hk) * dk + static_cast<int64_t>(h) * dv + sl * vc + tid;
  float sq = 0.0f, sk = 0.0f, v = 0.0f;
  for (int t = tid; t < dk; t += kThreads) {
    const float qv = conv_channel(a.proj, a.conv_w, a.conv_state, q_base + t, K, false);
    const float kv = conv_channel(a.proj, a.conv_w, a.conv_state, k_base + t, K, false);
    qs[t] = qv;
    ks[t] = kv;
    sq = fmaf(qv, qv, sq);
    sk = fmaf(kv, kv, sk);
  }
  if (tid < vc) v = conv_channel(a.proj, a.conv_w, a.conv_state, v_chan, K, true);

  // Step 5: L2 norms of q_i and k_i (eps inside the rsqrt of the sum), q scaled by 1/sqrt(dk).
  block_sum2(sq, sk);  // also the barrier for qs / ks
  const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
  const float q_scale = 1.0f / sqrtf(static_cast<float>(dk));

  // Step 6: S *= exp(g); r = S^T kh; delta = beta (v - r); S += kh delta^T; o = S^T qh.
  float kh[kMaxRows], qh[kMaxRows];
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) {
    const int row = rg + j * RG;
    kh[j] = row < dk ? ks[row] * rk : 0.0f;
    qh[j] = row < dk ? qs[row] * rq * q_scale : 0.0f;
    s[j].x *= decay;
    s[j].y *= decay;
    s[j].z *= decay;
    s[j].w *= decay;
    acc[0] = fmaf(s[j].x, kh[j], acc[0]);
    acc[1] = fmaf(s[j].y, kh[j], acc[1]);
    acc[2] = fmaf(s[j].z, kh[j], acc[2]);
    acc[3] = fmaf(s[j].w, kh[j], acc[3]);
  }
  column_sum(acc, CG, vc, part, col);
  if (tid < vc) delta[tid] = beta * (v - col[tid]);
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
    if (row < dk) *reinterpret_cast<float4*>(S + static_cast<int64_t>(row) * dv) = s[j];
    acc[0] = fmaf(s[j].x, qh[j], acc[0]);
    acc[1] = fmaf(s[j].y, qh[j], acc[1]);
    acc[2] = fmaf(s[j].z, qh[j], acc[2]);
    acc[3] = fmaf(s[j].w, qh[j], acc[3]);
  }
  column_sum(acc, CG, vc, part, col);
  const float* z = a.proj + a.conv_dim + static_cast<int64_t>(h) * dv;
  float ov[kMaxRows], nw[kMaxRows], nz[kMaxRows];
  if constexpr (kCl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float o_head[kDv > 0 ? kDv : 1];  // the value head's o (slice-0 CTA's copy used)
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    const unsigned rank = cluster.block_rank();  // = blockIdx.x % (ratio * slices)
    if (sl == 0 && a.zword == nullptr)
      load_norm_operands(a, z, dv, nw, nz);  // before the barrier: off the chain
    cluster_wait();  // every CTA of the cluster has started (the arrival at the kernel's start)
    if (tid < vc) *cluster.map_shared_rank(o_head + sl * vc + tid, rank - sl) = col[tid];
    cluster.sync();  // release / acquire: o_head complete, every q/k history read done
    if (rank == 0) {
      for (int t = tid; t < dk; t += kThreads) {
        conv_shift(a.proj, a.conv_state, q_base + t, K);
        conv_shift(a.proj, a.conv_state, k_base + t, K);
      }
    }
    if (sl != 0) return;
#pragma unroll
    for (int j = 0; j < kMaxRows; ++j) {
      const int t = tid + j * kThreads;
      ov[j] = t < dv ? o_head[t] : 0.0f;
    }
#else
    return;  // not launched below sm_90 (launch_gdn_decode)
#endif
  } else {
    float* o = a.o_scratch + static_cast<int64_t>(h) * dv;
    if (tid < vc) {
      o[sl * vc + tid] = col[tid];
      __threadfence();  // visible to the head's last CTA before the arrival below
    }
    __syncthreads();
    // Arrivals (integer atomics; the order of arrival never changes a value): the head's last
    // CTA normalises the head; the key head's last CTA shifts the q_i / k_i
    // history, which every CTA of the key head has read by now.
    if (tid == 0) {
      __threadfence();
      const unsigned int prev = atomicAdd(a.counters + h, 1u);
      const unsigned int prev_k = atomicAdd(a.counters + a.Hv + i, 1u);
      last_head = prev == static_cast<unsigned int>(slices - 1);
      last_key = prev_k == static_cast<unsigned int>(a.ratio * slices - 1);
      if (last_head) a.counters[h] = 0u;  // ready for the next launch (stream order)
      if (last_key) a.counters[a.Hv + i] = 0u;
      __threadfence();
    }
    __syncthreads();
    if (last_key) {
      for (int t = tid; t < dk; t += kThreads) {
        conv_shift(a.proj, a.conv_state, q_base + t, K);
        conv_shift(a.proj, a.conv_state, k_base + t, K);
      }
    }
    if (!last_head) return;
      // o here, w and z below: independent loads, one round trip.
#pragma unroll
    for (int j = 0; j < kMaxRows; ++j) {
      const int t = tid + j * kThreads;
      ov[j] = t < dv ? __ldcg(o + t) : 0.0f;
    }
    if (a.zword == nullptr) load_norm_operands(a, z, dv, nw, nz);
  }
  if (a.zword != nullptr) {  // the z rows come from the launch beside this one
    if (tid == 0) dev::join_wait(a.zword, a.z_signals, static_cast<unsigned>(a.Hv));
    __syncthreads();
    load_norm_operands(a, z, dv, nw, nz);
  }

  // Step 7 (one CTA of head h): o * rsqrt(mean(o^2) + eps) * w * sigmoid(z) -> BF16.
  float ss = 0.0f, unused = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) ss = fmaf(ov[j], ov[j], ss);
  block_sum2(ss, unused);
  const float mean = ss / static_cast<float>(dv);
  const float rs = 1.0f / sqrtf(mean + a.eps);
  uint16_t* out = a.out + static_cast<int64_t>(h) * dv;
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) {
    const int t = tid + j * kThreads;
    if (t < dv) out[t] = dev::float_to_bf16_bits(ov[j] * rs * nw[j] * sigmoid2(nz[j]));
  }
}

// Whether the cluster instance fits in clusters of `cluster` CTAs on this device (cached per
// device and size: the query is not repeated during graph capture).
bool cluster_fits(void (*kernel)(RecArgs), int cluster) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices][kMaxClusterSize + 1] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  FN_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return false;
  std::atomic<int>& c = cache[device][cluster];
  int v = c.load(std::memory_order_relaxed);
  if (v == 0) {
    v = cluster_launch_fits(kernel, dim3(kThreads), 0, cluster) ? 2 : 1;
    c.store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

void check_params(const GdnDecodeParams& p) {
  constexpr const char* kOp = "launch_gdn_decode";
  FN_LAUNCH_REQUIRE(p.proj != nullptr && p.conv_weight != nullptr && p.A_log != nullptr &&
                        p.dt_bias != nullptr && p.norm_weight != nullptr,
                    kOp);
  FN_LAUNCH_REQUIRE(p.conv_state != nullptr && p.state != nullptr && p.out != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.o_scratch != nullptr && p.head_counters != nullptr, kOp);
  FN_LAUNCH_REQUIRE(
      p.num_k_heads >= 1 && p.num_v_heads >= p.num_k_heads && p.num_v_heads % p.num_k_heads == 0,
      kOp);
  FN_LAUNCH_REQUIRE(p.k_head_dim >= 4 && p.k_head_dim <= kMaxHeadDim && p.k_head_dim % 4 == 0, kOp);
  FN_LAUNCH_REQUIRE(p.v_head_dim >= 4 && p.v_head_dim <= kMaxHeadDim && p.v_head_dim % 4 == 0, kOp);
  FN_LAUNCH_REQUIRE(p.conv_kernel >= 2 && p.conv_kernel <= kMaxConvKernel, kOp);
  const int64_t conv_dim =
      2 * int64_t{p.num_k_heads} * p.k_head_dim + int64_t{p.num_v_heads} * p.v_head_dim;
  FN_LAUNCH_REQUIRE(conv_dim + 2 * int64_t{p.num_v_heads} * (p.v_head_dim + 1) < INT_MAX, kOp);
  FN_LAUNCH_REQUIRE(p.rows >= 1 && p.rows <= 65535, kOp);
  FN_LAUNCH_REQUIRE(p.rows == 1 || p.row_slot != nullptr, kOp);
  if (p.row_slot != nullptr) {  // proj rows of the stacked projection's width
    FN_LAUNCH_REQUIRE(p.slot_state != nullptr && p.slot_conv != nullptr && p.in_proj == nullptr,
                      kOp);
    const int64_t width = conv_dim + int64_t{p.num_v_heads} * p.v_head_dim + 2 * p.num_v_heads;
    FN_LAUNCH_REQUIRE(
        p.proj_stride >= width && p.out_stride >= int64_t{p.num_v_heads} * p.v_head_dim, kOp);
  }
  FN_LAUNCH_REQUIRE((reinterpret_cast<uintptr_t>(p.state) & 15u) == 0, kOp);
  FN_LAUNCH_REQUIRE(p.eps >= 0.0f, kOp);
  const int f = p.slice_columns;
  FN_LAUNCH_REQUIRE(f == 0 || ((f == 4 || f == 8 || f == 16 || f == 32) && p.v_head_dim % f == 0 &&
                               p.k_head_dim * f <= kMaxRows * kThreads * 4),
                    kOp);
}

}  // namespace

int plan_gdn_decode_slice(const GdnDecodeParams& p) {
  check_params(p);
  if (p.slice_columns != 0) return p.slice_columns;
  const int dk = p.k_head_dim, dv = p.v_head_dim;
  int vc = kMaxSlice;
  while (dv % vc != 0) vc /= 2;  // dv % 4 == 0, so this stops at 4 at the latest
  // Rows per thread: dk / (kThreads / (vc / 4)) must be <= kMaxRows.
  while (vc > 4 && dk * vc > kMaxRows * kThreads * 4) vc /= 2;
  // The widest slice that fits: on H200 the step and the kernel alone were fastest at 32 columns
  // at both real TP sizes (TP=1 48 x 4 CTAs: 8.85 us/layer alone, 5.383 vs 5.399 ms/token in
  // the model at 16; TP=2 24 x 4 CTAs: 7.71 vs 9.03 us at the 8 the earlier rule of >= 2 CTAs
  // per SM chose; docs/perf-history.md): fewer CTAs, fewer arrivals and barriers per
  // column, and the state still streams from L2 (it is prefetched before the wait).
  FN_LAUNCH_REQUIRE(dk * vc <= kMaxRows * kThreads * 4, "plan_gdn_decode_slice");
  return vc;
}

void launch_gdn_decode(const GdnDecodeParams& p, cudaStream_t stream) {
  const int vc = plan_gdn_decode_slice(p);  // also checks the parameters
  const int Hk = p.num_k_heads, Hv = p.num_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
  const int conv_dim = 2 * Hk * dk + Hv * dv;
  RecArgs a{p.proj,
            p.A_log,
            p.dt_bias,
            p.norm_weight,
            p.conv_weight,
            p.conv_state,
            p.state,
            p.o_scratch,
            p.head_counters,
            p.out,
            Hk,
            Hv,
            dk,
            dv,
            vc,
            Hv / Hk,
            conv_dim,
            p.conv_kernel,
            p.eps};
  if (p.row_slot != nullptr) {
    a.row_slot = p.row_slot;
    a.slot_state = p.slot_state;
    a.slot_conv = p.slot_conv;
    a.proj_stride = p.proj_stride;
    a.out_stride = p.out_stride;
  }
  const dim3 grid(static_cast<unsigned>(Hv * (dv / vc)), static_cast<unsigned>(p.rows));
  // The overlapped projection (with programmatic dependent launches; else the same four launches
  // run one after another and every join is met on arrival): the rows but z, the z rows beside
  // them and the recurrence, the recurrence waiting for the first through a join word and its
  // gated norm for the second; out_proj after the recurrence.
  const bool overlap = p.in_proj != nullptr;
  if (overlap) {
    constexpr const char* kOp = "launch_gdn_decode";
    FN_LAUNCH_REQUIRE(
        p.x != nullptr && p.out_weight != nullptr && p.y != nullptr && p.join != nullptr, kOp);
    FN_LAUNCH_REQUIRE(p.hidden >= 8 && p.hidden <= 8192 && p.hidden % 8 == 0, kOp);
    FN_LAUNCH_REQUIRE(detail::aligned(p.in_proj, 16) && detail::aligned(p.x, 16) &&
                          detail::aligned(p.out_weight, 16),
                      kOp);
    const int64_t zrows = int64_t{Hv} * dv, rows = conv_dim + zrows + 2 * int64_t{Hv};
    // Both parts at the team width of one GEMV over all rows: a row's sum depends only on it
    // (cuda/kernels/gemv_bf16.cuh), so the same bits as launch_gemv_bf16 over the stacked matrix.
    const GemvBf16Plan whole = plan_gemv_bf16(rows, p.hidden, detail::current_sm_count());
    GemvBf16Params g;
    g.weight = p.in_proj;
    g.rows = rows - zrows;
    g.cols = p.hidden;
    g.ld = p.hidden;
    g.x = p.x;
    g.x_dtype = DType::F32;
    g.y = p.proj;
    g.y_dtype = DType::F32;
    g.skip_at = conv_dim;
    g.skip = zrows;
    g.plan = plan_gemv_bf16_part(whole, g.rows, whole.rows_per_team);
    g.done_word = p.join;
    GemvBf16Params z = g;
    z.weight = p.in_proj + int64_t{conv_dim} * p.hidden;
    z.rows = zrows;
    z.y = p.proj + conv_dim;
    z.skip_at = z.skip = 0;
    z.plan = plan_gemv_bf16_part(whole, zrows, whole.rows_per_team);
    z.no_pdl_wait = true;  // x was complete before the rows above were let start
    z.done_word = p.join + 1;
    launch_gemv_bf16(g, stream);
    launch_gemv_bf16(z, stream);
    a.aword = p.join;
    a.zword = p.join + 1;
    a.a_signals = static_cast<unsigned>(g.plan.blocks);
    a.z_signals = static_cast<unsigned>(z.plan.blocks);
  }
  // After the recurrence (whichever instance ran): out_proj.
  auto finish = [&] {
    if (overlap)
      launch_gemv_bf16(p.out_weight, p.hidden, int64_t{Hv} * dv, p.out, DType::BF16, p.y,
                       DType::F32, stream);
  };
  const bool fixed = p.fixed_shape && dk == kFixedDk && dv == kFixedDk && vc == kFixedSlice &&
                     p.conv_kernel == kFixedConv;
  const int cluster = (Hv / Hk) * (dv / vc);  // a key head's CTAs
  if (fixed && p.cluster && cluster <= kMaxClusterSize && detail::current_device_has_pdl()) {
    constexpr auto kernel = gdn_recurrent_kernel<kFixedDk, kFixedDk, kFixedSlice, kFixedConv, true>;
    if (cluster_fits(kernel, cluster)) {
      launch_cluster_pdl("gdn_recurrent_kernel (clusters)", kernel, grid, kThreads, 0, cluster,
                         stream, a);
      FN_CUDA_LAUNCH_CHECK("gdn_recurrent_kernel (clusters)");
      finish();
      return;
    }
  }
  void (*kernel)(RecArgs) = fixed
                                ? gdn_recurrent_kernel<kFixedDk, kFixedDk, kFixedSlice, kFixedConv>
                                : gdn_recurrent_kernel<>;
  launch_pdl("gdn_recurrent_kernel", kernel, grid, kThreads, 0, stream, a);
  FN_CUDA_LAUNCH_CHECK("gdn_recurrent_kernel");
  finish();
}

}  // namespace fn

// NVFP4 W4A16 routed-expert kernels (see moe_nvfp4.h): one gate+up+SwiGLU kernel and one
// weighted down-projection kernel, FP32 FMA, each in two variants: 32 codes per lane unit
// (cols % 32 == 0, every real shape) and 16 codes (cols an odd multiple of 16: tiny fixtures' TP
// slices). On sm_90 the decode step's gate+up runs the bulk-copy kernel instead
// (moe_nvfp4_bulk.cu); this one is its fallback on older devices and shapes.
//
// Streaming: a team of lanes per output row (pair); each lane first issues the 16-byte
// code loads and the scale loads of all its units (up to kGateUpUnits per row / kDownUnits; more
// only for shapes wider than the real ones, in further rounds), then the block stages the
// activation (x, or all top_k rows of h) once in shared memory as FP32 * 2^64, and only then
// decodes: no load of a lane waits on another's use, and x is unpacked once per block, not once
// per unit. Summation order (fixed, so bitwise reproducible): per 16-code block a sequential FMA
// chain over the codes in element order; per unit b0 * s0 (16 codes) or fmaf(b1, s1, b0 * s0)
// with the blocks' E4M3 scales; per lane its units in increasing index, acc += unit (gate+up) or
// acc = fmaf(unit, routing_weight * gs, acc) (down); then the team's dev::team_reduce; then
// * 2^70 and (gate+up) * the global scale. Measured (H200, PDL off; docs/perf-history.md): TP=1
// gate+up 14.9 us, down 10.2 us: the kernels are instruction-issue bound (~4.6 instructions per
// code; the ALU time alone is about the byte floor), not load bound.
//
// Decoding without FP4 hardware (sm_90 has no cvt from e2m1): the
// codes of a 32-bit word (in the decode layout, Nvfp4Experts) become, two at a time with one
// rotation and one mask (pair 3: two of each; cuda/common/nvfp4_bits.h, checked for every code on
// the host), BF16 bit patterns worth exactly code * 2^-126, widened to FP32 by a shift or a mask --
// no conversion instruction per element (the earlier FP16 path spent
// a quarter-rate cvt per element and was instruction bound at 15-24% of the bandwidth). x is
// widened from BF16 and scaled by 2^64 (exact) so that every product code * 2^-126 * x * 2^64 is
// a normal FP32 number; E4M3 scale bytes become FP16 bit patterns worth scale * 2^-8 (NaN codes
// mapped to NaN explicitly). The powers of two are put back once per row (kUnscale = 2^70).
// Every e2m1 * bf16 product is exact in FP32 for 2^-63 <= |x| < 2^64 (and x = 0); only the FP32
// sums and scale multiplies round, in the order above.
#include "cuda/kernels/moe_nvfp4.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/nvfp4_bits.h"
#include "cuda/common/nvfp4_mma.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/common/real_shape.h"
#include "cuda/kernels/moe_nvfp4_bulk.h"

namespace fn {
namespace {

using nvfp4_mma::decode_layout_f32;
using nvfp4_mma::half_bits_to_float;
using nvfp4_mma::word_of;

constexpr int kBlockThreads = 256;
constexpr float kXScale = 18446744073709551616.0f;     // 2^64
constexpr float kUnscale = 1180591620717411303424.0f;  // 2^70 = 2^126 * 2^8 / 2^64

// E4M3 scale byte -> float value * 2^-8 (exact; NaN codes stay NaN).
__device__ __forceinline__ float e4m3_scaled(uint32_t s) {
  if (nvfp4::e4m3_is_nan(s)) return __int_as_float(0x7fc00000);
  return half_bits_to_float(nvfp4::e4m3_fp16_bits(s));
}

// acc + sum_{i<8} e2m1(code i of w) * 2^-126 * xs[i], in element order (w in the decode layout).
__device__ __forceinline__ float dot8_e2m1(uint32_t w, const float* xs, float acc) {
  float f[8];
  decode_layout_f32(w, f);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc = fmaf(f[i], xs[i], acc);
  return acc;
}

// 8-byte streaming load (the narrow path's 16 codes), as dev::ld_stream16.
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
  uint2 r;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// The unit of work of a lane: 32 codes (16 bytes, 2 scale blocks) on the fast path, 16 codes
// (8 bytes, 1 scale block) on the narrow path used when cols % 32 == 16 (tiny TP slices).
template <bool kNarrow>
struct Unit {
  static constexpr int kCodes = kNarrow ? 16 : 32;
  // The unit's codes (narrow: in x, y; z = w = 0) from a row of packed bytes.
  static __device__ __forceinline__ uint4 codes(const uint8_t* row, int v) {
    if constexpr (kNarrow) {
      const uint2 r = ld_stream8(row + 8 * static_cast<int64_t>(v));
      return make_uint4(r.x, r.y, 0u, 0u);
    } else {
      return dev::ld_stream16(row + 16 * static_cast<int64_t>(v));
    }
  }
  // The unit's scale bytes from a row of block scales (fast path: two, low byte first).
  static __device__ __forceinline__ uint32_t scales(const uint8_t* row, int v) {
    if constexpr (kNarrow) {
      return __ldg(row + v);
    } else {
      return __ldg(reinterpret_cast<const uint16_t*>(row) + v);
    }
  }
};

// Units a lane holds in registers at once: their loads are all issued before the first is used.
// Real shapes (K = 2560: 80 units per row; down: 10 x 20 units at TP=1, 10 x 10 at TP=2) need one
// round: gate+up team 16 (5 units per row, 10 x 16-byte loads in flight per lane), down team 32
// (7 units at TP=1, 4 at TP=2).
constexpr int kGateUpUnits = 5;
constexpr int kDownUnits = 7;
// The routed down's compile-time shape (docs/model.md §A.2 at TP=1: num_experts_per_tok 10,
// moe_intermediate_size 640 = 20 units of 32 codes, the planner's 32-lane teams).
constexpr int kFixedTopK = real_shape::kTopK;
constexpr int kFixedDownNvec = real_shape::kMoeInter / Unit<false>::kCodes;
constexpr int kFixedDownTeamLog2 = 5;
static_assert(kFixedTopK * kFixedDownNvec <= kDownUnits << kFixedDownTeamLog2, "one round");
// Resident blocks per SM each kernel is compiled for (__launch_bounds__; <= 128 and <= 85
// registers): the planner sizes grids to one wave of these where the shape allows.
constexpr int kGateUpMinBlocks = 2;
constexpr int kDownMinBlocks = 3;
/// At most kStageBytes / 4 = 12,288 staged activations (x for gate+up, all of h for down) per
/// block: FP32 with the padding of Stage, behind the scale table: at most 61 KB of shared memory.
constexpr int64_t kStageBytes = 48 * 1024;
/// Entries of gate+up's shared-memory table of E4M3 block scales, ahead of the staged x (one per
/// scale byte, filled by the block's 256 threads; the down kernel converts its scales in registers:
/// at its 80-register bound the table's address registers spill, and it measured slower).
constexpr int kScaleLut = 256;
static_assert(kScaleLut == kBlockThreads);

// The activation vector staged in shared memory as FP32 * 2^64 (exact for |v| < 2^64), read by
// every team of the block. Unit u (the kCodes elements one weight unit multiplies) lies at floats
// [kStride u, kStride u + kCodes): 16 bytes of padding per unit, so the lanes of a team, which read
// consecutive units with 16-byte loads, hit distinct banks (each unit starts 16 bytes further
// around the 128-byte bank cycle than the one before), and a word's two chunks sit at fixed
// offsets of its unit (no per-load address arithmetic).
template <bool kNarrow>
struct Stage {
  static constexpr int kCodes = Unit<kNarrow>::kCodes;
  static constexpr int kStride = kCodes + 4;  // floats per unit
  /// Shared-memory bytes of n staged values (n a multiple of kCodes).
  static constexpr int64_t bytes(int64_t n) { return n / kCodes * kStride * 4; }
  // Every thread of the block calls it: n BF16 values (a multiple of 16; src 16-byte aligned).
  // Each thread issues kBatch 16-byte loads before it stores any (one L2 round trip per kBatch
  // block-wide passes instead of one per pass; the same values land in the same slots).
  template <int kBatch>
  static __device__ __forceinline__ void fill(const uint16_t* src, int n, float* s) {
    const uint4* v = reinterpret_cast<const uint4*>(src);
    const int nv = n / 8;
    for (int i0 = threadIdx.x; i0 < nv; i0 += kBatch * kBlockThreads) {
      uint4 q[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int i = i0 + b * kBlockThreads;
        q[b] = i < nv ? __ldg(v + i) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int i = i0 + b * kBlockThreads;
        if (i >= nv) break;
        const int u = (8 * i) / kCodes, c = ((8 * i) % kCodes) / 4;
        float4* chunk = reinterpret_cast<float4*>(s + kStride * u) + c;
        chunk[0] = make_float4(dev::bf16_lo(q[b].x) * kXScale, dev::bf16_hi(q[b].x) * kXScale,
                               dev::bf16_lo(q[b].y) * kXScale, dev::bf16_hi(q[b].y) * kXScale);
        chunk[1] = make_float4(dev::bf16_lo(q[b].z) * kXScale, dev::bf16_hi(q[b].z) * kXScale,
                               dev::bf16_lo(q[b].w) * kXScale, dev::bf16_hi(q[b].w) * kXScale);
      }
    }
  }
  // Elements 8 wi .. 8 wi + 7 of unit u.
  static __device__ __forceinline__ void word(const float* s, int u, int wi, float (&xs)[8]) {
    const float4* unit = reinterpret_cast<const float4*>(s + kStride * u);
    const float4 p = unit[2 * wi];
    const float4 q = unit[2 * wi + 1];
    xs[0] = p.x;
    xs[1] = p.y;
    xs[2] = p.z;
    xs[3] = p.w;
    xs[4] = q.x;
    xs[5] = q.y;
    xs[6] = q.z;
    xs[7] = q.w;
  }
};

// The unit's value * 2^-70 against the staged activation: per 16-code block a sequential FMA
// chain over the codes in element order (every product exact), then the blocks' sums times their
// E4M3 scales, b0 * s0 (narrow) or fmaf(b1, s1, b0 * s0).
template <bool kNarrow>
__device__ __forceinline__ float unit_dot(const uint4& w, uint32_t s, const float* stage, int u) {
  float b[2] = {0.0f, 0.0f};
#pragma unroll
  for (int wi = 0; wi < Unit<kNarrow>::kCodes / 8; ++wi) {
    float xs[8];
    Stage<kNarrow>::word(stage, u, wi, xs);
    b[wi / 2] = dot8_e2m1(word_of(w, wi), xs, b[wi / 2]);
  }
  if constexpr (kNarrow) {
    return b[0] * e4m3_scaled(s & 0xffu);
  } else {
    return fmaf(b[1], e4m3_scaled(s >> 8), b[0] * e4m3_scaled(s & 0xffu));
  }
}

// As unit_dot for the gate and the up row of one unit at once (one read of the staged x).
template <bool kNarrow>
__device__ __forceinline__ void unit_dot2(const uint4& wg, const uint4& wu, uint32_t sg,
                                          uint32_t su, const float* stage, const float* lut, int u,
                                          float& acc_g, float& acc_u) {
  float g[2] = {0.0f, 0.0f}, p[2] = {0.0f, 0.0f};
#pragma unroll
  for (int wi = 0; wi < Unit<kNarrow>::kCodes / 8; ++wi) {
    float xs[8];
    Stage<kNarrow>::word(stage, u, wi, xs);
    g[wi / 2] = dot8_e2m1(word_of(wg, wi), xs, g[wi / 2]);
    p[wi / 2] = dot8_e2m1(word_of(wu, wi), xs, p[wi / 2]);
  }
  if constexpr (kNarrow) {
    acc_g += g[0] * lut[sg & 0xffu];
    acc_u += p[0] * lut[su & 0xffu];
  } else {
    acc_g += fmaf(g[1], lut[sg >> 8], g[0] * lut[sg & 0xffu]);
    acc_u += fmaf(p[1], lut[su >> 8], p[0] * lut[su & 0xffu]);
  }
}

struct GateUpArgs {
  const uint8_t* packed;
  const uint8_t* scales;
  const float* global_scale;
  const int32_t* ids;
  int num_experts;
  int top_k;
  int inter;  // I
  int nvec;   // K / Unit::kCodes
  int64_t k;  // K
  const uint16_t* x;
  uint16_t* h;
  float* gate_up_out;
  int team_log2;
  L2Prefetch l2_prefetch;
};

// One team per (selected expert j, row i): gate row i and up row I + i of expert ids[j]. Lane l of
// the team takes the units v = l, l + team, ... of both rows; it issues the loads of up to
// kGateUpUnits of them (codes and scales of both rows) before x is staged in shared memory, then
// accumulates its units in increasing v; the team sums its lanes with dev::team_reduce.
template <bool kNarrow>
__global__ void __launch_bounds__(kBlockThreads, kGateUpMinBlocks)
    moe_gate_up_nvfp4_kernel(GateUpArgs a) {
  extern __shared__ float4 stage4[];
  float* lut = reinterpret_cast<float*>(stage4);  // [kScaleLut]: e4m3_scaled of every scale byte
  float* stage = lut + kScaleLut;
  if (threadIdx.x == 0 && blockIdx.y == 0)
    dev::l2_prefetch_part(a.l2_prefetch, blockIdx.x, gridDim.x);
  // Every weight address depends on the router's expert ids, and x is the previous kernel's
  // output: nothing is read before the programmatic-dependent wait (cuda/common/pdl.cuh).
  dev::pdl_begin();
  {  // token blockIdx.y of a batched launch (GateUpArgs::tokens)
    const int64_t b = blockIdx.y;
    a.ids += b * a.top_k;
    a.x += b * a.k;
    a.h += b * a.top_k * a.inter;
    if (a.gate_up_out != nullptr) a.gate_up_out += b * a.top_k * 2 * a.inter;
  }
  using U = Unit<kNarrow>;
  const int team = 1 << a.team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * (kBlockThreads >> a.team_log2) +
                       (threadIdx.x >> a.team_log2);
  const bool in_range = pair < static_cast<int64_t>(a.top_k) * a.inter;
  const int j = in_range ? static_cast<int>(pair / a.inter) : 0;
  const int i = in_range ? static_cast<int>(pair % a.inter) : 0;
  const int e = __ldg(a.ids + j);
  const bool ok = in_range && e >= 0 && e < a.num_experts;
  const int mine = ok && lane < a.nvec ? (a.nvec - 1 - lane) / team + 1 : 0;  // units of the lane

  const int64_t g_row = static_cast<int64_t>(ok ? e : 0) * 2 * a.inter + i;
  const uint8_t* wg = a.packed + g_row * (a.k / 2);
  const uint8_t* wu = wg + static_cast<int64_t>(a.inter) * (a.k / 2);
  const uint8_t* sg = a.scales + g_row * (a.k / 16);
  const uint8_t* su = sg + static_cast<int64_t>(a.inter) * (a.k / 16);
  uint4 w[kGateUpUnits][2];
  uint32_t s[kGateUpUnits][2];
  float acc[2] = {0.0f, 0.0f};
  for (int n0 = 0; n0 == 0 || n0 < mine; n0 += kGateUpUnits) {
#pragma unroll
    for (int n = 0; n < kGateUpUnits; ++n) {
      const int v = lane + (n0 + n) * team;
      const bool live = n0 + n < mine;
      w[n][0] = live ? U::codes(wg, v) : make_uint4(0, 0, 0, 0);
      w[n][1] = live ? U::codes(wu, v) : make_uint4(0, 0, 0, 0);
      s[n][0] = live ? U::scales(sg, v) : 0u;
      s[n][1] = live ? U::scales(su, v) : 0u;
    }
    if (n0 == 0) {  // every thread: the loop runs at least once for all
      lut[threadIdx.x] = e4m3_scaled(threadIdx.x);
      Stage<kNarrow>::template fill<2>(a.x, static_cast<int>(a.k), stage);  // K 2560: one batch
      __syncthreads();
    }
#pragma unroll
    for (int n = 0; n < kGateUpUnits; ++n)
      if (n0 + n < mine)
        unit_dot2<kNarrow>(w[n][0], w[n][1], s[n][0], s[n][1], stage, lut, lane + (n0 + n) * team,
                           acc[0], acc[1]);
  }
  dev::team_reduce<2, kBlockThreads>(acc, team, lane);
  if (lane != 0 || !in_range) return;
  float g = 0.0f, u = 0.0f;
  if (ok) {
    g = acc[0] * kUnscale * __ldg(a.global_scale + 2 * e);
    u = acc[1] * kUnscale * __ldg(a.global_scale + 2 * e + 1);
  }
  const float hv = ok ? dev::silu(g) * u : 0.0f;
  a.h[pair] = dev::float_to_bf16_bits(hv);
  if (a.gate_up_out != nullptr) {
    a.gate_up_out[static_cast<int64_t>(j) * 2 * a.inter + i] = g;
    a.gate_up_out[static_cast<int64_t>(j) * 2 * a.inter + a.inter + i] = u;
  }
}

struct DownArgs {
  const uint8_t* packed;
  const uint8_t* scales;
  const float* global_scale;
  const int32_t* ids;
  const float* weights;
  int num_experts;
  int top_k;
  int64_t hidden;  // D (rows per expert)
  int inter;       // I (cols)
  int nvec;        // I / Unit::kCodes
  const uint16_t* h;
  float* y;
  bool accumulate;
  int team_log2;
};

// One team per output row d: lane l takes the flattened (expert j, unit v) indices
// idx = j * nvec + v = l, l + team, ...; it issues the loads of up to kDownUnits of them before h
// (all top_k rows) is staged in shared memory, then accumulates
// acc = fmaf(unit_dot, routing_weights[j] * gs[e_j], acc) in increasing idx; the team sums its
// lanes with dev::team_reduce. The instance <false, kFixedTopK, kFixedDownNvec, kFixedDownTeamLog2>
// is the real TP=1 shape at compile time (top_k 10, I = 640: 20 units per expert row, 32-lane
// teams, so one round of at most 7 units per lane): the flattened index's division by nvec is by
// a constant and the round loop and its predicates fold. The runtime-shape instances
// <kNarrow, 0, 0, 0> run every other shape; the same operations in the same order either way.
template <bool kNarrow, int kTopK = 0, int kNvec = 0, int kTeamLog2 = 0>
__global__ void __launch_bounds__(kBlockThreads, kDownMinBlocks) moe_down_nvfp4_kernel(DownArgs a) {
  static_assert((kTopK > 0) == (kNvec > 0) && (kTopK > 0) == (kTeamLog2 > 0));
  const int top_k = kTopK > 0 ? kTopK : a.top_k;
  const int nvec = kNvec > 0 ? kNvec : a.nvec;
  const int inter = kNvec > 0 ? kNvec * Unit<kNarrow>::kCodes : a.inter;
  {  // token blockIdx.y of a batched launch (MoeDownParams::tokens)
    const int64_t b = blockIdx.y;
    a.ids += b * top_k;
    a.weights += b * top_k;
    a.h += b * top_k * inter;
    a.y += b * a.hidden;
  }
  const int team_log2 = kTeamLog2 > 0 ? kTeamLog2 : a.team_log2;
  extern __shared__ float4 stage4[];
  float* stage = reinterpret_cast<float*>(stage4);
  // The first round's loads go out before the programmatic-dependent wait (cuda/common/pdl.cuh):
  // the weights, and the router's ids and routing weights, written two launches back (gate+up sits
  // in between) and read through L2; only h, gate+up's output, waits.
  using U = Unit<kNarrow>;
  const int team = 1 << team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t d =
      static_cast<int64_t>(blockIdx.x) * (kBlockThreads >> team_log2) + (threadIdx.x >> team_log2);
  const bool in_range = d < a.hidden;
  const int nflat = top_k * nvec;
  const int mine = in_range && lane < nflat ? (nflat - 1 - lane) / team + 1 : 0;
  uint4 w[kDownUnits];
  uint32_t s[kDownUnits];
  float f[kDownUnits];
  bool live[kDownUnits];
  float acc[1] = {0.0f};
  for (int n0 = 0; n0 == 0 || n0 < mine; n0 += kDownUnits) {
#pragma unroll
    for (int n = 0; n < kDownUnits; ++n) {
      const int idx = lane + (n0 + n) * team;
      const int jj = idx / nvec, v = idx - jj * nvec;
      const int e = n0 + n < mine ? __ldcg(a.ids + jj) : -1;
      live[n] = e >= 0 && e < a.num_experts;
      const int64_t row = static_cast<int64_t>(live[n] ? e : 0) * a.hidden + d;
      w[n] = live[n] ? U::codes(a.packed + row * (inter / 2), v) : make_uint4(0, 0, 0, 0);
      s[n] = live[n] ? U::scales(a.scales + row * (inter / 16), v) : 0u;
      f[n] = live[n] ? __ldcg(a.weights + jj) * __ldg(a.global_scale + e) : 0.0f;
    }
    if (n0 == 0) {  // every thread: the loop runs at least once for all
      dev::pdl_begin();
      Stage<kNarrow>::template fill<4>(a.h, top_k * inter, stage);  // 10 x 640: one batch
      __syncthreads();
    }
#pragma unroll
    for (int n = 0; n < kDownUnits; ++n)
      if (live[n])
        acc[0] = fmaf(unit_dot<kNarrow>(w[n], s[n], stage, lane + (n0 + n) * team), f[n], acc[0]);
  }
  dev::team_reduce<1, kBlockThreads>(acc, team, lane);
  if (lane != 0 || !in_range) return;
  const float v = acc[0] * kUnscale;
  a.y[d] = a.accumulate ? a.y[d] + v : v;
}

// Narrowest team with at most `per_lane` units per lane (all of a lane's loads in one round),
// widened while the doubled grid still fits in one wave (min_blocks resident blocks per SM, the
// kernel's launch bound) and each lane keeps at least 2 units after doubling: more lanes share
// the bytes, and no block waits for a second wave.
int plan_team(int64_t work_vectors, int64_t teams, int per_lane, int sm_count, int min_blocks) {
  const int64_t wave = static_cast<int64_t>(min_blocks) * (sm_count > 0 ? sm_count : 1);
  auto blocks = [&](int t) { return (teams + (kBlockThreads / t) - 1) / (kBlockThreads / t); };
  int team = 8;
  while (team < kBlockThreads && static_cast<int64_t>(team) * per_lane < work_vectors) team *= 2;
  while (team < kBlockThreads && blocks(2 * team) <= wave &&
         work_vectors >= 4 * static_cast<int64_t>(team))
    team *= 2;
  return team;
}

// The FP32 kernels stage up to 12,288 activations with 16 bytes of padding per unit (gate+up behind
// its 1 KB scale table): up to 61 KB of dynamic shared memory, past the default 48 KB only for
// shapes wider than the real ones; the opt-in is set where a launch needs it (every supported GPU
// allows at least 64 KB).
template <typename KArgs>
void allow_stage_smem(void (*kernel)(KArgs), size_t smem) {
  if (smem > 48 * 1024)
    FN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
}

using detail::aligned;

void check_experts(const Nvfp4Experts& w, const char* op) {
  FN_LAUNCH_REQUIRE(w.packed != nullptr && w.scales != nullptr && w.global_scale != nullptr, op);
  FN_LAUNCH_REQUIRE(w.num_experts >= 1 && w.rows >= 1, op);
  FN_LAUNCH_REQUIRE(w.cols >= 16 && w.cols % 16 == 0 && w.cols <= (int64_t{1} << 30), op);
  FN_LAUNCH_REQUIRE(aligned(w.packed, 16) && aligned(w.scales, 2), op);
}

// Codes per lane work unit: 32 (fast path) unless cols is an odd multiple of 16.
int64_t unit_codes(int64_t cols) {
  return cols % 32 == 0 ? 32 : 16;
}

bool valid_team(int t) {
  return t >= 8 && t <= kBlockThreads && (t & (t - 1)) == 0;
}

// One 32-bit word of codes per thread, grid-stride.
__global__ void __launch_bounds__(kBlockThreads)
    to_decode_layout_kernel(uint32_t* words, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlockThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kBlockThreads)
    words[i] = nvfp4::to_decode_layout(words[i]);
}

}  // namespace

void nvfp4_codes_to_decode_layout(uint8_t* packed, int64_t bytes, cudaStream_t stream) {
  constexpr const char* kOp = "nvfp4_codes_to_decode_layout";
  FN_LAUNCH_REQUIRE(packed != nullptr && aligned(packed, 4), kOp);
  FN_LAUNCH_REQUIRE(bytes > 0 && bytes % 4 == 0, kOp);
  const int64_t n = bytes / 4;
  const int64_t blocks = std::min<int64_t>((n + kBlockThreads - 1) / kBlockThreads, 65535);
  to_decode_layout_kernel<<<static_cast<unsigned>(blocks), kBlockThreads, 0, stream>>>(
      reinterpret_cast<uint32_t*>(packed), n);
  FN_CUDA_LAUNCH_CHECK("to_decode_layout_kernel");
}

int plan_moe_gate_up_team(int top_k, int64_t intermediate, int64_t hidden, int sm_count) {
  // Two rows (gate, up) per team: at most kGateUpUnits units per lane per row, all in flight.
  return plan_team(hidden / unit_codes(hidden), static_cast<int64_t>(top_k) * intermediate,
                   kGateUpUnits, sm_count, kGateUpMinBlocks);
}

int plan_moe_down_team(int top_k, int64_t intermediate, int64_t hidden, int sm_count) {
  return plan_team(static_cast<int64_t>(top_k) * (intermediate / unit_codes(intermediate)), hidden,
                   kDownUnits, sm_count, kDownMinBlocks);
}

bool moe_gate_up_bulk_supported(int top_k, int64_t intermediate, int64_t hidden) {
  return detail::current_device_has_pdl() &&
         detail::bulk_gate_up_shape_ok(top_k, intermediate, hidden, detail::current_sm_count());
}

void launch_moe_gate_up_nvfp4(const MoeGateUpParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_gate_up_nvfp4";
  check_experts(p.experts, kOp);
  FN_LAUNCH_REQUIRE(p.expert_ids != nullptr && p.x != nullptr && p.h != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.top_k >= 1 && p.experts.rows % 2 == 0, kOp);
  FN_LAUNCH_REQUIRE(p.experts.rows / 2 <= INT32_MAX / p.top_k, kOp);
  FN_LAUNCH_REQUIRE(aligned(p.x, 16), kOp);
  FN_LAUNCH_REQUIRE(p.experts.cols * 4 <= kStageBytes, kOp);  // x staged in shared memory
  FN_LAUNCH_REQUIRE(p.tokens >= 1 && p.tokens <= 65535, kOp);
  if (p.bulk) {
    detail::launch_moe_gate_up_bulk(p, stream);
    return;
  }
  const int64_t inter = p.experts.rows / 2;
  const int team = p.team_threads != 0 ? p.team_threads
                                       : plan_moe_gate_up_team(p.top_k, inter, p.experts.cols,
                                                               detail::current_sm_count());
  FN_LAUNCH_REQUIRE(valid_team(team), kOp);
  GateUpArgs a{};
  a.packed = p.experts.packed;
  a.scales = p.experts.scales;
  a.global_scale = p.experts.global_scale;
  a.ids = p.expert_ids;
  a.num_experts = p.experts.num_experts;
  a.top_k = p.top_k;
  a.inter = static_cast<int>(inter);
  const bool narrow = p.experts.cols % 32 != 0;
  a.nvec = static_cast<int>(p.experts.cols / unit_codes(p.experts.cols));
  a.k = p.experts.cols;
  a.x = p.x;
  a.h = p.h;
  a.gate_up_out = p.gate_up_out;
  a.l2_prefetch = p.l2_prefetch;
  a.team_log2 = __builtin_ctz(static_cast<unsigned>(team));
  const int64_t teams_per_block = kBlockThreads / team;
  const int64_t blocks =
      (static_cast<int64_t>(p.top_k) * inter + teams_per_block - 1) / teams_per_block;
  const size_t smem =
      kScaleLut * 4 + static_cast<size_t>(narrow ? Stage<true>::bytes(p.experts.cols)
                                                 : Stage<false>::bytes(p.experts.cols));
  auto* kernel = narrow ? moe_gate_up_nvfp4_kernel<true> : moe_gate_up_nvfp4_kernel<false>;
  allow_stage_smem(kernel, smem);
  launch_pdl("moe_gate_up_nvfp4_kernel", kernel,
             dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(p.tokens)), kBlockThreads,
             smem, stream, a);
  FN_CUDA_LAUNCH_CHECK("moe_gate_up_nvfp4_kernel");
}

void launch_moe_down_nvfp4(const MoeDownParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_down_nvfp4";
  check_experts(p.experts, kOp);
  FN_LAUNCH_REQUIRE(p.expert_ids != nullptr && p.routing_weights != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.h != nullptr && p.y != nullptr && p.top_k >= 1, kOp);
  FN_LAUNCH_REQUIRE(p.experts.cols * p.top_k <= INT32_MAX, kOp);
  FN_LAUNCH_REQUIRE(p.experts.rows <= INT32_MAX && aligned(p.h, 16), kOp);
  FN_LAUNCH_REQUIRE(p.experts.cols * p.top_k * 4 <= kStageBytes, kOp);  // h staged likewise
  FN_LAUNCH_REQUIRE(p.tokens >= 1 && p.tokens <= 65535, kOp);
  const int team = p.team_threads != 0 ? p.team_threads
                                       : plan_moe_down_team(p.top_k, p.experts.cols, p.experts.rows,
                                                            detail::current_sm_count());
  FN_LAUNCH_REQUIRE(valid_team(team), kOp);
  DownArgs a{};
  a.packed = p.experts.packed;
  a.scales = p.experts.scales;
  a.global_scale = p.experts.global_scale;
  a.ids = p.expert_ids;
  a.weights = p.routing_weights;
  a.num_experts = p.experts.num_experts;
  a.top_k = p.top_k;
  a.hidden = p.experts.rows;
  a.inter = static_cast<int>(p.experts.cols);
  const bool narrow = p.experts.cols % 32 != 0;
  a.nvec = static_cast<int>(p.experts.cols / unit_codes(p.experts.cols));
  a.h = p.h;
  a.y = p.y;
  a.accumulate = p.accumulate;
  a.team_log2 = __builtin_ctz(static_cast<unsigned>(team));
  const int64_t teams_per_block = kBlockThreads / team;
  const int64_t blocks = (p.experts.rows + teams_per_block - 1) / teams_per_block;
  const int64_t n = p.experts.cols * p.top_k;
  const size_t smem = static_cast<size_t>(narrow ? Stage<true>::bytes(n) : Stage<false>::bytes(n));
  const bool fixed = p.fixed_shape && !narrow && p.top_k == kFixedTopK &&
                     a.nvec == kFixedDownNvec && team == (1 << kFixedDownTeamLog2);
  auto* kernel = fixed
                     ? moe_down_nvfp4_kernel<false, kFixedTopK, kFixedDownNvec, kFixedDownTeamLog2>
                 : narrow ? moe_down_nvfp4_kernel<true>
                          : moe_down_nvfp4_kernel<false>;
  allow_stage_smem(kernel, smem);
  launch_pdl("moe_down_nvfp4_kernel", kernel,
             dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(p.tokens)), kBlockThreads,
             smem, stream, a);
  FN_CUDA_LAUNCH_CHECK("moe_down_nvfp4_kernel");
}

}  // namespace fn

// NVFP4 W4A16 routed-expert kernels (see moe_nvfp4.h): one gate+up+SwiGLU kernel and one
// weighted down-projection kernel, each in two variants: 32 codes per lane unit (cols % 32 == 0,
// every real shape) and 16 codes (cols an odd multiple of 16: tiny fixtures' TP slices).
//
// Decoding without FP4 hardware (sm_90 has no cvt from e2m1, performance-anchors.md §3): the
// codes of a 32-bit word become, two at a time with a few mask/shift operations, BF16 bit patterns
// worth exactly code * 2^-126 (cuda/nvfp4_bits.h, checked for every code on the host), widened to
// FP32 by a shift or a mask -- no conversion instruction per element (the earlier FP16 path spent
// a quarter-rate cvt per element and was instruction bound at 15-24% of the bandwidth). x is
// widened from BF16 and scaled by 2^64 (exact) so that every product code * 2^-126 * x * 2^64 is
// a normal FP32 number; E4M3 scale bytes become FP16 bit patterns worth scale * 2^-8 (NaN codes
// mapped to NaN explicitly). The powers of two are put back once per row (kUnscale = 2^70).
// Every e2m1 * bf16 product is exact in FP32 for 2^-63 <= |x| < 2^64 (and x = 0); only the FP32
// sums round, in the same order as before, so results equal the FP16 path's bitwise.
#include "cuda/moe_nvfp4.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "comm/cuda_check.h"
#include "cuda/device_util.cuh"
#include "cuda/launch_check.h"
#include "cuda/nvfp4_bits.h"
#include "cuda/pdl.cuh"

namespace fn {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kUnroll = 4;                             // 16-byte vectors per row in flight per lane
constexpr float kXScale = 18446744073709551616.0f;     // 2^64
constexpr float kUnscale = 1180591620717411303424.0f;  // 2^70 = 2^126 * 2^8 / 2^64

__device__ __forceinline__ float half_bits_to_float(uint32_t bits16) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
}

// E4M3 scale byte -> float value * 2^-8 (exact; NaN codes stay NaN).
__device__ __forceinline__ float e4m3_scaled(uint32_t s) {
  if (nvfp4::e4m3_is_nan(s)) return __int_as_float(0x7fc00000);
  return half_bits_to_float(nvfp4::e4m3_fp16_bits(s));
}

// The 8 BF16 x values of a 16-byte vector as FP32 * 2^64 (exact for |x| < 2^64).
__device__ __forceinline__ void load_x8(const uint4* xp, float* xs) {
  const uint4 u = __ldg(xp);
  xs[0] = dev::bf16_lo(u.x) * kXScale;
  xs[1] = dev::bf16_hi(u.x) * kXScale;
  xs[2] = dev::bf16_lo(u.y) * kXScale;
  xs[3] = dev::bf16_hi(u.y) * kXScale;
  xs[4] = dev::bf16_lo(u.z) * kXScale;
  xs[5] = dev::bf16_hi(u.z) * kXScale;
  xs[6] = dev::bf16_lo(u.w) * kXScale;
  xs[7] = dev::bf16_hi(u.w) * kXScale;
}

// acc + sum_{i<8} e2m1(code i of w) * 2^-126 * xs[i], in element order (code i in nibble i).
__device__ __forceinline__ float dot8_e2m1(uint32_t w, const float* xs, float acc) {
  float f[8];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t p = nvfp4::e2m1_bf16_pair(w, q);  // code q low half, code q + 4 high half
    f[q] = __uint_as_float(p << 16);
    f[q + 4] = __uint_as_float(p & 0xffff0000u);
  }
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
  // The unit's kCodes x values (16-byte aligned at xp) as FP32 * 2^64.
  static __device__ __forceinline__ void load_x(const uint4* xp, float (&xs)[kCodes]) {
#pragma unroll
    for (int i = 0; i < kCodes / 8; ++i) load_x8(xp + i, xs + 8 * i);
  }
  // Contribution * 2^-70 of the unit against its x values xs (from load_x).
  static __device__ __forceinline__ float dot(uint4 w, uint32_t s, const float (&xs)[kCodes]) {
    float b0 = dot8_e2m1(w.x, xs, 0.0f);
    b0 = dot8_e2m1(w.y, xs + 8, b0);
    if constexpr (kNarrow) {
      return b0 * e4m3_scaled(s & 0xffu);
    } else {
      float b1 = dot8_e2m1(w.z, xs + 16, 0.0f);
      b1 = dot8_e2m1(w.w, xs + 24, b1);
      return b0 * e4m3_scaled(s & 0xffu) + b1 * e4m3_scaled(s >> 8);
    }
  }
};

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
};

// One team per (selected expert j, row i): gate row i and up row I + i of expert ids[j].
template <bool kNarrow>
__global__ void __launch_bounds__(kBlockThreads) moe_gate_up_nvfp4_kernel(GateUpArgs a) {
  // Every weight address depends on the router's expert ids (the previous kernels' output):
  // nothing can be read before the programmatic-dependent wait (cuda/pdl.cuh).
  dev::pdl_begin();
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

  float acc[2] = {0.0f, 0.0f};
  if (ok) {
    const int64_t rows = 2 * static_cast<int64_t>(a.inter);
    const int64_t g_row = static_cast<int64_t>(e) * rows + i, u_row = g_row + a.inter;
    const uint8_t* wg = a.packed + g_row * (a.k / 2);
    const uint8_t* wu = a.packed + u_row * (a.k / 2);
    const uint8_t* sg = a.scales + g_row * (a.k / 16);
    const uint8_t* su = a.scales + u_row * (a.k / 16);
    const uint4* xv = reinterpret_cast<const uint4*>(a.x);
    for (int base = lane; base < a.nvec; base += kUnroll * team) {
      uint4 w[kUnroll][2];
      uint32_t s[kUnroll][2];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = base + u * team;
        const bool live = v < a.nvec;
        w[u][0] = live ? U::codes(wg, v) : make_uint4(0, 0, 0, 0);
        w[u][1] = live ? U::codes(wu, v) : make_uint4(0, 0, 0, 0);
        s[u][0] = live ? U::scales(sg, v) : 0u;
        s[u][1] = live ? U::scales(su, v) : 0u;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = base + u * team;
        if (v < a.nvec) {
          float xs[U::kCodes];  // shared by the gate and the up row
          U::load_x(xv + (U::kCodes / 8) * v, xs);
          acc[0] += U::dot(w[u][0], s[u][0], xs);
          acc[1] += U::dot(w[u][1], s[u][1], xs);
        }
      }
    }
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

// One team per output row d: lanes stride over the flattened (expert j, vector v) pairs.
template <bool kNarrow>
__global__ void __launch_bounds__(kBlockThreads) moe_down_nvfp4_kernel(DownArgs a) {
  // Every weight address depends on the router's expert ids (the previous kernels' output):
  // nothing can be read before the programmatic-dependent wait (cuda/pdl.cuh).
  dev::pdl_begin();
  using U = Unit<kNarrow>;
  const int team = 1 << a.team_log2;
  const int lane = threadIdx.x & (team - 1);
  const int64_t d = static_cast<int64_t>(blockIdx.x) * (kBlockThreads >> a.team_log2) +
                    (threadIdx.x >> a.team_log2);
  const bool in_range = d < a.hidden;
  const int nflat = a.top_k * a.nvec;
  float acc[1] = {0.0f};
  if (in_range) {
    for (int base = lane; base < nflat; base += kUnroll * team) {
      uint4 w[kUnroll];
      uint32_t s[kUnroll];
      float f[kUnroll];
      int hoff[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int idx = base + u * team;
        const int j = idx / a.nvec, v = idx - j * a.nvec;
        const int e = idx < nflat ? __ldg(a.ids + j) : -1;
        const bool live = e >= 0 && e < a.num_experts;
        const int64_t row = static_cast<int64_t>(live ? e : 0) * a.hidden + d;
        w[u] = live ? U::codes(a.packed + row * (a.inter / 2), v) : make_uint4(0, 0, 0, 0);
        s[u] = live ? U::scales(a.scales + row * (a.inter / 16), v) : 0u;
        f[u] = live ? __ldg(a.weights + j) * __ldg(a.global_scale + e) : 0.0f;
        hoff[u] = live ? j * a.inter + U::kCodes * v : -1;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (hoff[u] >= 0) {
          float xs[U::kCodes];
          U::load_x(reinterpret_cast<const uint4*>(a.h + hoff[u]), xs);
          acc[0] += U::dot(w[u], s[u], xs) * f[u];
        }
    }
  }
  dev::team_reduce<1, kBlockThreads>(acc, team, lane);
  if (lane != 0 || !in_range) return;
  const float v = acc[0] * kUnscale;
  a.y[d] = a.accumulate ? a.y[d] + v : v;
}

// Narrowest team with at most `per_lane` vectors per lane, widened while the grid has fewer than
// 2 blocks per SM and each lane keeps at least 2 vectors after doubling.
int plan_team(int64_t work_vectors, int64_t teams, int per_lane, int sm_count) {
  const int64_t target = 2 * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);
  auto blocks = [&](int t) { return (teams + (kBlockThreads / t) - 1) / (kBlockThreads / t); };
  int team = 8;
  while (team < kBlockThreads && static_cast<int64_t>(team) * per_lane < work_vectors) team *= 2;
  while (blocks(team) < target && team < kBlockThreads &&
         work_vectors >= 4 * static_cast<int64_t>(team))
    team *= 2;
  return team;
}

bool aligned(const void* p, uintptr_t n) {
  return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0;
}

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

}  // namespace

int plan_moe_gate_up_team(int top_k, int64_t intermediate, int64_t hidden, int sm_count) {
  // Two rows (gate, up) per team: at most 8 vectors per lane per row keeps 16 loads per lane.
  return plan_team(hidden / unit_codes(hidden), static_cast<int64_t>(top_k) * intermediate, 8,
                   sm_count);
}

int plan_moe_down_team(int top_k, int64_t intermediate, int64_t hidden, int sm_count) {
  return plan_team(static_cast<int64_t>(top_k) * (intermediate / unit_codes(intermediate)), hidden,
                   16, sm_count);
}

void launch_moe_gate_up_nvfp4(const MoeGateUpParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_gate_up_nvfp4";
  check_experts(p.experts, kOp);
  FN_LAUNCH_REQUIRE(p.expert_ids != nullptr && p.x != nullptr && p.h != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.top_k >= 1 && p.experts.rows % 2 == 0, kOp);
  FN_LAUNCH_REQUIRE(p.experts.rows / 2 <= INT32_MAX / p.top_k, kOp);
  FN_LAUNCH_REQUIRE(aligned(p.x, 16), kOp);
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
  a.team_log2 = __builtin_ctz(static_cast<unsigned>(team));
  const int64_t teams_per_block = kBlockThreads / team;
  const int64_t blocks =
      (static_cast<int64_t>(p.top_k) * inter + teams_per_block - 1) / teams_per_block;
  if (narrow)
    launch_pdl("moe_gate_up_nvfp4_kernel", moe_gate_up_nvfp4_kernel<true>,
               static_cast<unsigned>(blocks), kBlockThreads, 0, stream, a);
  else
    launch_pdl("moe_gate_up_nvfp4_kernel", moe_gate_up_nvfp4_kernel<false>,
               static_cast<unsigned>(blocks), kBlockThreads, 0, stream, a);
  FN_CUDA_LAUNCH_CHECK("moe_gate_up_nvfp4_kernel");
}

void launch_moe_down_nvfp4(const MoeDownParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_down_nvfp4";
  check_experts(p.experts, kOp);
  FN_LAUNCH_REQUIRE(p.expert_ids != nullptr && p.routing_weights != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.h != nullptr && p.y != nullptr && p.top_k >= 1, kOp);
  FN_LAUNCH_REQUIRE(p.experts.cols * p.top_k <= INT32_MAX, kOp);
  FN_LAUNCH_REQUIRE(p.experts.rows <= INT32_MAX && aligned(p.h, 16), kOp);
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
  if (narrow)
    launch_pdl("moe_down_nvfp4_kernel", moe_down_nvfp4_kernel<true>, static_cast<unsigned>(blocks),
               kBlockThreads, 0, stream, a);
  else
    launch_pdl("moe_down_nvfp4_kernel", moe_down_nvfp4_kernel<false>, static_cast<unsigned>(blocks),
               kBlockThreads, 0, stream, a);
  FN_CUDA_LAUNCH_CHECK("moe_down_nvfp4_kernel");
}

}  // namespace fn

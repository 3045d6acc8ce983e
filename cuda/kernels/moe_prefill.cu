// Batched routed experts (see moe_prefill.h).
//
// Router rows: launch_router_topk_rows (decode_ops.h) runs decode's router kernel once per row;
// tests/test_cuda_moe_prefill.cpp checks bitwise equality with launch_router_topk row by row.
//
// Per-row path (up to kMoePrefillPerRowMaxTokens tokens): the decode kernels (FP32 instances)
// for all rows in one launch each, the token in the grid's y dimension.
//
// Fused path (above that; see the section comment further down): a grouped GEMM per expert on
// mma.sync BF16, NVFP4 decoded once per tile into shared memory (no BF16 weight copy in global
// memory), fed by a multi-stage cp.async pipeline.
#include "cuda/kernels/moe_prefill.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/device_util.cuh"
#include "cuda/common/launch_check.h"
#include "cuda/common/nvfp4_bits.h"
#include "cuda/common/nvfp4_mma.cuh"

namespace fn {
namespace {

constexpr int kThreads = 256;
constexpr size_t kAlign = 256;

size_t align_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

bool use_per_row(const MoePrefillParams& p) {
  const bool fits = p.gate_up.cols * 4 <= 48 * 1024 && p.down.cols * p.top_k * 4 <= 48 * 1024;
  if (p.path == MoePrefillPath::PerRow) return true;
  if (p.path == MoePrefillPath::Fused) return false;
  return fits && p.tokens <= kMoePrefillPerRowMaxTokens;
}

void check_shapes(const MoePrefillParams& p, const char* op) {
  FN_LAUNCH_REQUIRE(p.tokens >= 0 && p.top_k >= 1, op);
  FN_LAUNCH_REQUIRE(p.gate_up.num_experts >= 1 && p.gate_up.num_experts == p.down.num_experts, op);
  FN_LAUNCH_REQUIRE(p.gate_up.rows == 2 * p.down.cols && p.gate_up.cols == p.down.rows, op);
  FN_LAUNCH_REQUIRE(p.gate_up.cols >= 16 && p.gate_up.cols % 16 == 0, op);
  FN_LAUNCH_REQUIRE(p.down.cols >= 16 && p.down.cols % 16 == 0, op);
  FN_LAUNCH_REQUIRE(p.gate_up.cols <= INT32_MAX && p.gate_up.rows <= INT32_MAX, op);
  FN_LAUNCH_REQUIRE(p.tokens * p.top_k <= INT32_MAX / 2, op);
  FN_LAUNCH_REQUIRE(p.chunk_tokens >= 0, op);
}

using detail::aligned;

void run_per_row(const MoePrefillParams& p, cudaStream_t stream) {
  uint16_t* h = static_cast<uint16_t*>(p.workspace);  // [tokens, top_k, I]
  const int64_t inter = p.down.cols;
  MoeGateUpParams gu;
  gu.experts = p.gate_up;
  gu.expert_ids = p.ids;
  gu.top_k = p.top_k;
  gu.x = p.x;
  gu.h = h;
  gu.tokens = p.tokens;
  gu.bulk = p.gate_up_bulk;
  launch_moe_gate_up_nvfp4(gu, stream);
  if (p.h_out != nullptr)
    FN_CUDA_CHECK(cudaMemcpyAsync(p.h_out, h, static_cast<size_t>(p.tokens * p.top_k * inter) * 2,
                                  cudaMemcpyDeviceToDevice, stream));
  MoeDownParams dn;
  dn.experts = p.down;
  dn.expert_ids = p.ids;
  dn.routing_weights = p.weights;
  dn.top_k = p.top_k;
  dn.h = h;
  dn.y = p.y;
  dn.tokens = p.tokens;
  dn.fixed_shape = p.down_fixed;
  launch_moe_down_nvfp4(dn, stream);
}

unsigned grid_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// ---- fused W4A16 path ------------------------------------------------------------------------
//
// Pairs of one chunk of tokens are bucketed by expert (ascending pair inside an expert) into
// sorted rows. An expert's rows form one row tile when they fit the tile's row capacity (kBm:
// 256 where the device gives a CTA 199 KB of shared memory, else 64), else ceil(rows / kBm)
// tiles of equal size (a multiple of 16 rows, the last one shorter): at M = 8192, top_k 10 and
// uniform routing (~160 rows per expert) every expert is one tile, so each weight tile is decoded
// once for all of its rows. One CTA computes a row tile x kGBn = 128 weight rows (gate+up: 64
// gate rows and the same 64 up rows) as a grouped GEMM on mma.sync m16n8k16 BF16 (FP32
// accumulation):
//   - a kStages-deep cp.async pipeline brings per k step of 64 the tile's activation rows
//     (gate+up: x rows gathered by token; down: h rows) and the raw NVFP4 codes of the 128
//     weight rows into shared memory; the E4M3 block scales come through registers two steps
//     ahead (rows of K / 16 bytes need not be 4-byte aligned);
//   - while the warps multiply step kt (ldmatrix from 144-byte rows: the 8 row addresses of every
//     8x8 matrix fall in 8 distinct 16-byte bank groups), each thread decodes its 32 codes of step
//     kt + 1 into the other of two BF16 weight buffers: E2M1 * 2^-126 times E4M3 * 2^100, one
//     exact BF16 product per weight (nvfp4_mma, the bulk-copy decode kernel's arithmetic); the
//     2^26 and the global scale are applied in the epilogue, so every product the tensor cores
//     see is exact and only the FP32 summation order differs from decode;
//   - one __syncthreads per k step; 8 warps as 2 (row fragments of 16, interleaved so both halves
//     get the same count) x 4 (32 weight rows); the tile's rows are rounded up to 32 and the main
//     loop is instantiated per count of 16-row fragments, so no MMA runs on a fragment wholly past
//     the tile's rows;
//   - epilogue from the registers: gate+up h = bf16(silu(g * 2^26 * gs_gate) * (u * 2^26 *
//     gs_up)) into h[sorted row] (each warp holds 16 gate and the same 16 up outputs); down
//     yd[pair, :] = sum * 2^26 (FP32).
//   reduce  y[t, d] = sum over slots j in order of fmaf(weights[t, j] * gs_down[e], yd, acc)
// The grid is one CTA per (row tile, feature tile), feature tiles of a row tile adjacent (they
// share the tile's activation rows in L2), row tiles in decreasing size (the long ones first).
// Deterministic: every output element is written by one thread, the k loop runs in order.

constexpr int kGBn = 128;                    // weight rows (output features) per CTA tile
constexpr int kGBk = 64;                     // k per pipeline stage
constexpr int kGLd = kGBk + 8;               // BF16 row stride of the staged tiles (144 bytes)
constexpr int kGThreads = 256;               // 8 warps: 2 (row fragments) x 4 (32 features)
constexpr int kGRawBytes = kGBn * kGBk / 2;  // NVFP4 codes of one stage (4 KB)
constexpr int kGDecBytes = kGBn * kGLd * 2;  // one decoded BF16 weight stage (18 KB)

// Shared memory of a variant: kStages x (activation rows + raw codes), two decoded weight
// buffers, then the tile's activation row offsets (int64) and pairs (int32).
template <int kBm, int kStages>
struct GemmShape {
  static_assert(kBm % 32 == 0 && kBm <= 256 && kStages >= 2, "moe prefill tile shape");
  static constexpr int kABytes = kBm * kGLd * 2;
  static constexpr size_t kRawOff = size_t(kStages) * kABytes;
  static constexpr size_t kDecOff = kRawOff + size_t(kStages) * kGRawBytes;
  static constexpr size_t kTabOff = kDecOff + 2 * size_t(kGDecBytes);
  static constexpr size_t kSmem = kTabOff + size_t(kBm) * 12;
};
// 203,776 bytes (H100/H200: 227 KB per CTA) and 64,256 bytes (every sm_75+ device).
constexpr int kBigTileRows = 256, kSmallTileRows = 64;
using BigTile = GemmShape<kBigTileRows, 4>;
using SmallTile = GemmShape<kSmallTileRows, 2>;

struct FusedArgs {
  const uint16_t* a = nullptr;  // gate_up: x [tokens, K]; down: h [sorted rows, K]
  const uint8_t* packed = nullptr;
  const uint8_t* scales = nullptr;
  const float* gscale = nullptr;
  int64_t wrows = 0;                  // weight rows per expert
  int64_t K = 0;                      // input length (multiple of 16)
  int64_t feats = 0;                  // gate_up: I; down: hidden
  int ftiles = 0;                     // feature tiles per row tile
  const int32_t* row_pair = nullptr;  // chunk-local pair of each sorted row
  const int32_t* tiles = nullptr;     // [tiles, 3]: expert, first sorted row, rows
  int top_k = 0;
  uint16_t* h = nullptr;      // [sorted rows, I] BF16
  uint16_t* h_out = nullptr;  // optional [chunk pairs, I]
  float* yd = nullptr;        // [chunk pairs, hidden] FP32
};

// ---- cp.async with zero fill, ldmatrix (sm_80+; below, plain copies that land at once) -------

// 16 bytes global -> shared, or 16 zero bytes when !full (src must still be a valid address).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool full) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = full ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(n)
               : "memory");
#else
  *static_cast<uint4*>(smem) = full ? *static_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}

// 8 bytes global -> shared (both 8-byte aligned), or 8 zero bytes when !full.
__device__ __forceinline__ void cp_async8_zfill(void* smem, const void* gmem, bool full) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = full ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(s), "l"(gmem), "r"(n)
               : "memory");
#else
  *static_cast<uint2*>(smem) = full ? *static_cast<const uint2*>(gmem) : make_uint2(0, 0);
#endif
}

using dev::cp_async_commit;

// Four 8x8 BF16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i,
// whose row l / 4, elements 2 (l % 4), +1 land in register i of lane l (PTX ISA, ldmatrix).
__device__ __forceinline__ void ldmatrix_x4(const uint16_t* p, uint32_t& r0, uint32_t& r1,
                                            uint32_t& r2, uint32_t& r3) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}

// One word of 8 codes (decode layout) times its block scale (e4m3_bf16x2_scaled) as 8 BF16 in
// element order: code * scale * 2^-26, exact. decode_layout_pair gives the pairs (q, q + 4).
__device__ __forceinline__ uint4 decode_word_bf16(uint32_t d, uint32_t sp) {
  const uint32_t p0 = nvfp4_mma::bf16x2_mul(nvfp4::decode_layout_pair(d, 0), sp);
  const uint32_t p1 = nvfp4_mma::bf16x2_mul(nvfp4::decode_layout_pair(d, 1), sp);
  const uint32_t p2 = nvfp4_mma::bf16x2_mul(nvfp4::decode_layout_pair(d, 2), sp);
  const uint32_t p3 = nvfp4_mma::bf16x2_mul(nvfp4::decode_layout_pair(d, 3), sp);
  return make_uint4(__byte_perm(p0, p1, 0x5410), __byte_perm(p2, p3, 0x5410),
                    __byte_perm(p0, p1, 0x7632), __byte_perm(p2, p3, 0x7632));
}

// The main loop and epilogue of one tile whose rows fill kNm fragments of 16 per warp row half
// (rows <= 32 kNm). Every thread of the CTA calls it with the same kNm.
template <bool kGateUp, int kBm, int kStages, int kNm>
__device__ __forceinline__ void fused_tile(const FusedArgs& args, unsigned char* smem, int64_t e,
                                           int row0, int nrows, int ftile) {
  using Shape = GemmShape<kBm, kStages>;
  uint16_t* s_a = reinterpret_cast<uint16_t*>(smem);  // [kStages][kBm][kGLd]
  unsigned char* s_raw = smem + Shape::kRawOff;       // [kStages][kGBn][32 bytes]
  uint16_t* s_dec = reinterpret_cast<uint16_t*>(smem + Shape::kDecOff);  // [2][kGBn][kGLd]
  const int64_t* s_aoff = reinterpret_cast<const int64_t*>(smem + Shape::kTabOff);
  const int32_t* s_pair = reinterpret_cast<const int32_t*>(s_aoff + kBm);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;
  const int64_t K = args.K, feats = args.feats;
  const int nk = static_cast<int>((K + kGBk - 1) / kGBk);

  // This thread's weight row (B row bn) and half stage (codes 32 bh .. 32 bh + 31 of a step).
  // gate+up: B rows 32 w .. 32 w + 31 (warp column w) are 16 gate rows then the same 16 up rows
  // (fragments j = 0, 1 gate, 2, 3 up), so each warp's epilogue holds g and u of its outputs.
  const int bn = tid >> 1, bh = tid & 1;
  int64_t f;
  bool ok;
  if (kGateUp) {
    const int w = bn >> 5, j = (bn >> 3) & 3;
    const int64_t c = static_cast<int64_t>(ftile) * (kGBn / 2) + w * 16 + (j & 1) * 8 + (bn & 7);
    ok = c < feats;
    f = (j >= 2 ? feats : 0) + c;
  } else {
    f = static_cast<int64_t>(ftile) * kGBn + bn;
    ok = f < feats;
  }
  const int64_t wrow = e * args.wrows + f;
  const uint8_t* bpk = ok ? args.packed + wrow * (K / 2) : nullptr;
  const uint8_t* bsc = ok ? args.scales + wrow * (K / 16) : nullptr;
  const int64_t nblk = K / 16;

  // Stage kt's activation rows and raw codes into slot kt % kStages (k past K zero-filled).
  auto load_stage = [&](int kt) {
    const int slot = kt % kStages;
    const int64_t k0 = static_cast<int64_t>(kt) * kGBk;
    uint16_t* a = s_a + slot * kBm * kGLd;
    for (int u = tid; u < nrows * 8; u += kGThreads) {
      const int r = u >> 3, c = u & 7;
      const int64_t kc = k0 + c * 8;
      const bool in = kc < K;
      cp_async16_zfill(a + r * kGLd + c * 8, in ? args.a + s_aoff[r] + kc : args.a, in);
    }
    unsigned char* raw = s_raw + slot * kGRawBytes + tid * 16;
    const int64_t kb = k0 + bh * 32;
    if (K % 32 == 0) {  // every real shape: one 16-byte copy (rows of K / 2 bytes, 16-aligned)
      const bool in = bpk != nullptr && kb < K;
      cp_async16_zfill(raw, in ? bpk + kb / 2 : args.packed, in);
    } else {  // rows only 8-byte aligned: two 8-byte copies of 16 codes
      const bool in0 = bpk != nullptr && kb < K, in1 = bpk != nullptr && kb + 16 < K;
      cp_async8_zfill(raw, in0 ? bpk + kb / 2 : args.packed, in0);
      cp_async8_zfill(raw + 8, in1 ? bpk + kb / 2 + 8 : args.packed, in1);
    }
  };
  // The two block-scale bytes of this thread's codes of step kt (0 past K or for a missing row).
  auto load_scales = [&](int kt) -> uint32_t {
    if (bsc == nullptr || kt >= nk) return 0u;
    const int64_t b0 = (static_cast<int64_t>(kt) * kGBk + bh * 32) / 16;
    uint32_t s = 0;
    if (b0 < nblk) s = __ldg(bsc + b0);
    if (b0 + 1 < nblk) s |= static_cast<uint32_t>(__ldg(bsc + b0 + 1)) << 8;
    return s;
  };
  uint16_t* dec_mine = s_dec + bn * kGLd + bh * 32;  // + buffer * kGBn * kGLd + 8 * word

  float acc[kNm][4][4];
#pragma unroll
  for (int mi = 0; mi < kNm; ++mi) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][j][q] = 0.0f;
    }
  }

  // Prologue: stages 0 .. kStages - 2 in flight, step 0 decoded.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s);
    cp_async_commit();
  }
  {
    const uint32_t sc = load_scales(0);
    dev::cp_async_wait_group<kStages - 2>();
    const uint4 raw = *reinterpret_cast<const uint4*>(s_raw + tid * 16);
    const uint32_t sp0 = nvfp4_mma::e4m3_bf16x2_scaled(sc & 0xffu);
    const uint32_t sp1 = nvfp4_mma::e4m3_bf16x2_scaled((sc >> 8) & 0xffu);
#pragma unroll
    for (int wi = 0; wi < 4; ++wi)
      *reinterpret_cast<uint4*>(dec_mine + 8 * wi) =
          decode_word_bf16(nvfp4_mma::word_of(raw, wi), wi < 2 ? sp0 : sp1);
  }
  uint32_t sc1 = load_scales(1), sc2 = load_scales(2);  // steps kt + 1 and kt + 2
  __syncthreads();

  for (int kt = 0; kt < nk; ++kt) {
    // Slot (kt - 1) % kStages was last read by step kt - 1 (behind the barrier below).
    if (kt + kStages - 1 < nk) load_stage(kt + kStages - 1);
    cp_async_commit();
    dev::cp_async_wait_group<kStages - 2>();  // step kt + 1's copies of this thread have landed
    const bool next = kt + 1 < nk;
    uint4 raw = make_uint4(0, 0, 0, 0);
    uint32_t sp0 = 0, sp1 = 0;
    if (next) {
      raw = *reinterpret_cast<const uint4*>(s_raw + ((kt + 1) % kStages) * kGRawBytes + tid * 16);
      sp0 = nvfp4_mma::e4m3_bf16x2_scaled(sc1 & 0xffu);
      sp1 = nvfp4_mma::e4m3_bf16x2_scaled((sc1 >> 8) & 0xffu);
    }
    const uint16_t* a = s_a + (kt % kStages) * kBm * kGLd;
    const uint16_t* b = s_dec + (kt & 1) * kGBn * kGLd;
    uint16_t* dnext = dec_mine + ((kt + 1) & 1) * kGBn * kGLd;
#pragma unroll
    for (int kk = 0; kk < kGBk / 16; ++kk) {
      // B fragments of the warp's 4 n-tiles of 8: matrices (n 0-7, k 0-7), (n 0-7, k 8-15),
      // (n 8-15, k 0-7), (n 8-15, k 8-15) of each pair of n-tiles -> b0, b1 of n-tile 2 jp and
      // of n-tile 2 jp + 1 (lane (g, t) gets B[k = 2t, 2t + 1][n = g]).
      uint32_t bf[4][2];
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        const int n = wn * 32 + jp * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int k = kk * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(b + n * kGLd + k, bf[2 * jp][0], bf[2 * jp][1], bf[2 * jp + 1][0],
                    bf[2 * jp + 1][1]);
      }
#pragma unroll
      for (int mi = 0; mi < kNm; ++mi) {
        // A fragment rows 16 (wm + 2 mi) ..: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7),
        // (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0 .. a3 of m16n8k16.
        const int m = (wm + 2 * mi) * 16 + (lane & 15);
        const int k = kk * 16 + (lane >> 4) * 8;
        uint32_t a0, a1, a2, a3;
        ldmatrix_x4(a + m * kGLd + k, a0, a1, a2, a3);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          nvfp4_mma::mma_bf16(acc[mi][j], a0, a1, a2, a3, bf[j][0], bf[j][1]);
      }
      // A quarter of step kt + 1's decode between the MMAs (word kk: block kk / 2).
      if (next)
        *reinterpret_cast<uint4*>(dnext + 8 * kk) =
            decode_word_bf16(nvfp4_mma::word_of(raw, kk), kk < 2 ? sp0 : sp1);
    }
    sc1 = sc2;
    sc2 = load_scales(kt + 3);
    __syncthreads();  // step kt + 1's activations and decoded weights visible; slots reusable
  }
  dev::cp_async_wait_group<0>();

  // Epilogue: lane (g, t) holds D[g][2t, 2t + 1] (q = 0, 1) and D[g + 8][2t, 2t + 1] (q = 2, 3)
  // of every fragment.
  const int g = lane >> 2, t = lane & 3;
  if (kGateUp) {
    const float gsg = __ldg(args.gscale + 2 * e), gsu = __ldg(args.gscale + 2 * e + 1);
#pragma unroll
    for (int mi = 0; mi < kNm; ++mi)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = (wm + 2 * mi) * 16 + g + 8 * hr;
        if (r >= nrows) continue;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int64_t c = static_cast<int64_t>(ftile) * (kGBn / 2) + wn * 16 + j * 8 + 2 * t;
          if (c >= feats) continue;  // feats % 16 == 0: c, c + 1 wholly in or out
          uint32_t hv[2];
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            // As moe_gate_up_nvfp4_kernel: global scale, silu, one rounding.
            const float gv = acc[mi][j][2 * hr + q] * nvfp4_mma::kMmaUnscale * gsg;
            const float uv = acc[mi][j + 2][2 * hr + q] * nvfp4_mma::kMmaUnscale * gsu;
            hv[q] = dev::float_to_bf16_bits(dev::silu(gv) * uv);
          }
          const uint32_t packed = hv[0] | (hv[1] << 16);
          *reinterpret_cast<uint32_t*>(args.h + static_cast<int64_t>(row0 + r) * feats + c) =
              packed;
          if (args.h_out != nullptr)
            *reinterpret_cast<uint32_t*>(args.h_out + static_cast<int64_t>(s_pair[r]) * feats + c) =
                packed;
        }
      }
  } else {
#pragma unroll
    for (int mi = 0; mi < kNm; ++mi)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = (wm + 2 * mi) * 16 + g + 8 * hr;
        if (r >= nrows) continue;
        float* dst = args.yd + static_cast<int64_t>(s_pair[r]) * feats;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t d = static_cast<int64_t>(ftile) * kGBn + wn * 32 + j * 8 + 2 * t;
          if (d >= feats) continue;  // hidden % 16 == 0
          *reinterpret_cast<float2*>(dst + d) =
              make_float2(acc[mi][j][2 * hr] * nvfp4_mma::kMmaUnscale,
                          acc[mi][j][2 * hr + 1] * nvfp4_mma::kMmaUnscale);
        }
      }
  }
}

// Picks the instance of fused_tile for the tile's fragment count nm (1 .. kNm).
template <bool kGateUp, int kBm, int kStages, int kNm>
__device__ __forceinline__ void fused_tile_dispatch(int nm, const FusedArgs& args,
                                                    unsigned char* smem, int64_t e, int row0,
                                                    int nrows, int ftile) {
  if (nm == kNm) {
    fused_tile<kGateUp, kBm, kStages, kNm>(args, smem, e, row0, nrows, ftile);
  } else if constexpr (kNm > 1) {
    fused_tile_dispatch<kGateUp, kBm, kStages, kNm - 1>(nm, args, smem, e, row0, nrows, ftile);
  }
}

template <bool kGateUp, int kBm, int kStages>
__global__ void __launch_bounds__(kGThreads, 1) fused_gemm_kernel(const FusedArgs args) {
  using Shape = GemmShape<kBm, kStages>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int ftile = static_cast<int>(blockIdx.x % static_cast<unsigned>(args.ftiles));
  const int64_t tile = blockIdx.x / static_cast<unsigned>(args.ftiles);
  const int32_t* tp = args.tiles + 3 * tile;
  const int64_t e = tp[0];
  const int row0 = tp[1], nrows = tp[2];  // 1 <= nrows <= kBm
  int64_t* s_aoff = reinterpret_cast<int64_t*>(smem_raw + Shape::kTabOff);
  int32_t* s_pair = reinterpret_cast<int32_t*>(s_aoff + kBm);
  for (int r = threadIdx.x; r < nrows; r += kGThreads) {
    const int32_t pair = args.row_pair[row0 + r];
    s_pair[r] = pair;
    s_aoff[r] = kGateUp ? static_cast<int64_t>(pair / args.top_k) * args.K
                        : static_cast<int64_t>(row0 + r) * args.K;
  }
  __syncthreads();
  // Fragments of 16 rows per warp row half: rows rounded up to 32 (CTA-uniform).
  const int nm = (nrows + 31) / 32;
  // Below sm_80 no device has the 256-row instance's shared memory (the host picks 64 rows
  // there), so only the 64-row instance is compiled (the MMA emulation is large).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  constexpr bool kCompiled = kBm <= kSmallTileRows;
#else
  constexpr bool kCompiled = true;
#endif
  if constexpr (kCompiled) {
    fused_tile_dispatch<kGateUp, kBm, kStages, kBm / 32>(nm, args, smem_raw, e, row0, nrows, ftile);
  } else {
    __trap();
  }
}

// y[t, d] = sum over slots j (in order) with a valid id of fmaf(weights * gs_down[e], yd, acc).
__global__ void __launch_bounds__(kThreads)
    fused_reduce_kernel(const float* yd, int64_t hidden, const int32_t* ids, const float* weights,
                        const float* gs_down, int num_experts, int top_k, int64_t tokens,
                        float* y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= tokens * hidden) return;
  const int64_t t = i / hidden, d = i - t * hidden;
  float acc = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const int64_t q = t * top_k + j;
    const int32_t e = __ldg(ids + q);
    if (e < 0 || e >= num_experts) continue;
    const float f = __ldg(weights + q) * __ldg(gs_down + e);
    acc = fmaf(f, yd[q * hidden + d], acc);
  }
  y[i] = acc;
}

int64_t fused_chunk(const MoePrefillParams& p) {
  const int64_t c = p.chunk_tokens > 0 ? p.chunk_tokens : kMoePrefillChunkTokens;
  return std::max<int64_t>(1, std::min<int64_t>(c, p.tokens));
}

// Workspace of the fused path: tables (all chunks), h and yd of one chunk.
struct FusedLayout {
  size_t meta, h, yd, total;
  int64_t meta_ints;
};

FusedLayout fused_layout(const MoePrefillParams& p) {
  const int64_t chunk = fused_chunk(p);
  const int64_t chunks = (p.tokens + chunk - 1) / chunk;
  const int64_t pairs = p.tokens * p.top_k, chunk_pairs = chunk * p.top_k;
  const int64_t hidden = p.gate_up.cols, inter = p.down.cols;
  FusedLayout l{};
  // Sorted rows' pairs (<= pairs) and tiles (an expert of n rows: ceil(n / capacity) <= n /
  // kSmallTileRows + 1, so <= pairs / kSmallTileRows + min(E, chunk pairs) per chunk).
  l.meta_ints = pairs +
                3 * (pairs / kSmallTileRows +
                     chunks * (std::min<int64_t>(p.gate_up.num_experts, chunk_pairs) + 1)) +
                64;
  l.meta = 0;
  l.h = align_up(static_cast<size_t>(l.meta_ints) * 4);
  l.yd = l.h + align_up(static_cast<size_t>(chunk_pairs) * inter * 2);
  l.total = l.yd + align_up(static_cast<size_t>(chunk_pairs) * hidden * 4);
  return l;
}

void run_fused(const MoePrefillParams& p, cudaStream_t stream) {
  const FusedLayout lay = fused_layout(p);
  char* ws = static_cast<char*>(p.workspace);
  const int64_t hidden = p.gate_up.cols, inter = p.down.cols, k = p.top_k;
  const int E = p.gate_up.num_experts;
  const int64_t chunk = fused_chunk(p);
  const int64_t pairs = p.tokens * k;

  std::vector<int32_t> ids(static_cast<size_t>(pairs));
  FN_CUDA_CHECK(cudaMemcpyAsync(ids.data(), p.ids, ids.size() * 4, cudaMemcpyDeviceToHost, stream));
  FN_CUDA_CHECK(cudaStreamSynchronize(stream));

  struct ChunkPlan {
    int64_t t0, tokens;
    size_t row_pair, tiles;  // offsets in ints
    int64_t num_tiles;
  };
  std::vector<ChunkPlan> plans;
  std::vector<int32_t> meta;
  meta.reserve(static_cast<size_t>(lay.meta_ints));
  std::vector<int32_t> count(static_cast<size_t>(E) + 1);
  struct TileRec {
    int32_t expert, row0, rows;
  };
  std::vector<TileRec> tiles;
  // The row capacity: the 256-row instance where the device gives a CTA its shared memory and
  // the device code was compiled for sm_80+ (below, only the 64-row instance has a body: a
  // compute_75 PTX build run on a newer device must not take the other).
  int dev = 0, smem_optin = 0;
  FN_CUDA_CHECK(cudaGetDevice(&dev));
  FN_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes big_attr{};
  FN_CUDA_CHECK(cudaFuncGetAttributes(&big_attr, fused_gemm_kernel<true, kBigTileRows, 4>));
  const bool big = static_cast<size_t>(smem_optin) >= BigTile::kSmem &&
                   (big_attr.ptxVersion == 0 || big_attr.ptxVersion >= 80);
  FN_CHECK(big || static_cast<size_t>(smem_optin) >= SmallTile::kSmem,
           "moe prefill: the fused path needs {} bytes of shared memory per block, the device "
           "gives {}",
           SmallTile::kSmem, smem_optin);
  const int32_t cap = big ? kBigTileRows : kSmallTileRows;
  for (int64_t t0 = 0; t0 < p.tokens; t0 += chunk) {
    ChunkPlan cp{};
    cp.t0 = t0;
    cp.tokens = std::min(chunk, p.tokens - t0);
    const int32_t* cid = ids.data() + t0 * k;
    const int32_t cpairs = static_cast<int32_t>(cp.tokens * k);
    std::fill(count.begin(), count.end(), 0);
    for (int32_t q = 0; q < cpairs; ++q)
      if (cid[q] >= 0 && cid[q] < E) ++count[static_cast<size_t>(cid[q]) + 1];
    for (int e = 0; e < E; ++e) count[e + 1] += count[e];
    cp.row_pair = meta.size();
    meta.resize(meta.size() + static_cast<size_t>(count[E]));
    {
      std::vector<int32_t> fill(count.begin(), count.end() - 1);
      for (int32_t q = 0; q < cpairs; ++q)
        if (cid[q] >= 0 && cid[q] < E) meta[cp.row_pair + static_cast<size_t>(fill[cid[q]]++)] = q;
    }
    cp.tiles = meta.size();
    // An expert's n rows: one tile up to the capacity, else ceil(n / capacity) tiles of
    // round_up(ceil(n / tiles), 16) rows (the last shorter); tiles in decreasing size.
    tiles.clear();
    for (int e = 0; e < E; ++e) {
      const int32_t n = count[e + 1] - count[e];
      if (n == 0) continue;
      const int32_t nt = (n + cap - 1) / cap;
      const int32_t per = std::min<int32_t>(cap, ((n + nt - 1) / nt + 15) / 16 * 16);
      for (int32_t r = 0; r < n; r += per)
        tiles.push_back({e, count[e] + r, std::min<int32_t>(per, n - r)});
    }
    std::stable_sort(tiles.begin(), tiles.end(),
                     [](const TileRec& x, const TileRec& y) { return x.rows > y.rows; });
    for (const TileRec& t : tiles) {
      meta.push_back(t.expert);
      meta.push_back(t.row0);
      meta.push_back(t.rows);
    }
    cp.num_tiles = static_cast<int64_t>(tiles.size());
    plans.push_back(cp);
  }
  FN_CHECK(static_cast<int64_t>(meta.size()) <= lay.meta_ints,
           "moe prefill: routing tables exceed the planned workspace");
  int32_t* meta_d = reinterpret_cast<int32_t*>(ws + lay.meta);
  if (!meta.empty())
    FN_CUDA_CHECK(
        cudaMemcpyAsync(meta_d, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, stream));
  if (p.h_out != nullptr)
    FN_CUDA_CHECK(cudaMemsetAsync(p.h_out, 0, static_cast<size_t>(pairs) * inter * 2, stream));
  uint16_t* h = reinterpret_cast<uint16_t*>(ws + lay.h);
  float* yd = reinterpret_cast<float*>(ws + lay.yd);
  using KernelFn = void (*)(FusedArgs);
  const KernelFn gate_up_kernel =
      big ? fused_gemm_kernel<true, kBigTileRows, 4> : fused_gemm_kernel<true, kSmallTileRows, 2>;
  const KernelFn down_kernel =
      big ? fused_gemm_kernel<false, kBigTileRows, 4> : fused_gemm_kernel<false, kSmallTileRows, 2>;
  const size_t smem = big ? BigTile::kSmem : SmallTile::kSmem;
  FN_CUDA_CHECK(cudaFuncSetAttribute(gate_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
  FN_CUDA_CHECK(cudaFuncSetAttribute(down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
  for (const ChunkPlan& cp : plans) {
    if (cp.num_tiles > 0) {
      FusedArgs a;
      a.a = p.x + cp.t0 * hidden;  // row_pair holds chunk-local pairs: token = pair / top_k
      a.packed = p.gate_up.packed;
      a.scales = p.gate_up.scales;
      a.gscale = p.gate_up.global_scale;
      a.wrows = p.gate_up.rows;
      a.K = hidden;
      a.feats = inter;
      a.ftiles = static_cast<int>((inter + kGBn / 2 - 1) / (kGBn / 2));
      a.row_pair = meta_d + cp.row_pair;
      a.tiles = meta_d + cp.tiles;
      a.top_k = p.top_k;
      a.h = h;
      a.h_out = p.h_out != nullptr ? p.h_out + cp.t0 * k * inter : nullptr;
      const int64_t blocks_gu = cp.num_tiles * a.ftiles;
      FN_CHECK(blocks_gu <= INT32_MAX, "moe prefill: too many tiles");
      gate_up_kernel<<<static_cast<unsigned>(blocks_gu), kGThreads, smem, stream>>>(a);
      FN_CUDA_LAUNCH_CHECK("fused_gemm_kernel<gate_up>");
      FusedArgs d;
      d.a = h;
      d.packed = p.down.packed;
      d.scales = p.down.scales;
      d.gscale = p.down.global_scale;
      d.wrows = p.down.rows;
      d.K = inter;
      d.feats = hidden;
      d.ftiles = static_cast<int>((hidden + kGBn - 1) / kGBn);
      d.row_pair = a.row_pair;
      d.tiles = a.tiles;
      d.top_k = p.top_k;
      d.yd = yd;
      const int64_t blocks_dn = cp.num_tiles * d.ftiles;
      FN_CHECK(blocks_dn <= INT32_MAX, "moe prefill: too many tiles");
      down_kernel<<<static_cast<unsigned>(blocks_dn), kGThreads, smem, stream>>>(d);
      FN_CUDA_LAUNCH_CHECK("fused_gemm_kernel<down>");
    }
    fused_reduce_kernel<<<grid_for(cp.tokens * hidden), kThreads, 0, stream>>>(
        yd, hidden, p.ids + cp.t0 * k, p.weights + cp.t0 * k, p.down.global_scale, E, p.top_k,
        cp.tokens, p.y + cp.t0 * hidden);
    FN_CUDA_LAUNCH_CHECK("fused_reduce_kernel");
  }
}

}  // namespace

size_t moe_prefill_workspace_bytes(const MoePrefillParams& p) {
  check_shapes(p, "moe_prefill_workspace_bytes");
  if (use_per_row(p))
    return align_up(static_cast<size_t>(std::max<int64_t>(p.tokens, 1) * p.top_k) * p.down.cols *
                    2);
  return fused_layout(p).total;
}

void launch_moe_prefill(const MoePrefillParams& p, cudaStream_t stream) {
  constexpr const char* kOp = "launch_moe_prefill";
  check_shapes(p, kOp);
  if (p.tokens == 0) return;
  FN_LAUNCH_REQUIRE(p.ids != nullptr && p.weights != nullptr && p.x != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.y != nullptr && p.workspace != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.gate_up.packed != nullptr && p.gate_up.scales != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.down.packed != nullptr && p.down.scales != nullptr, kOp);
  FN_LAUNCH_REQUIRE(p.gate_up.global_scale != nullptr && p.down.global_scale != nullptr, kOp);
  FN_LAUNCH_REQUIRE(aligned(p.x, 16) && aligned(p.workspace, kAlign), kOp);
  FN_LAUNCH_REQUIRE(aligned(p.gate_up.packed, 16) && aligned(p.down.packed, 16), kOp);
  if (use_per_row(p))
    run_per_row(p, stream);
  else
    run_fused(p, stream);
}

}  // namespace fn

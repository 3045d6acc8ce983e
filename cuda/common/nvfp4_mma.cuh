// Device helpers shared by the NVFP4 expert kernels (cuda/kernels/moe_nvfp4.cu: the FP32 decode
// kernels; cuda/kernels/moe_nvfp4_bulk.cu: the bulk-copy gate+up; cuda/kernels/moe_grouped.cu: the
// grouped routed experts; cuda/kernels/moe_prefill.cu: the prefill's dequantisation): the
// decode-layout word as FP32 values, the E4M3 block scale as a BF16 pair, the BF16x2 multiply and
// the m16n8k16 BF16 MMA (with exact emulations below sm_80), the 32-code MMA step of the
// bulk-copy kernels, the activation permutation of the MMA columns and the word picker. Included
// by .cu files only.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_util.cuh"
#include "cuda/common/nvfp4_bits.h"

namespace fn::nvfp4_mma {

/// 2^26 = 2^126 / 2^100: puts back the powers of two of e2m1_bf16_pair (code * 2^-126) times
/// e4m3_bf16x2_scaled (scale * 2^100) once per output.
inline constexpr float kMmaUnscale = 67108864.0f;

/// The 8 codes of a word in the decode layout (Nvfp4Experts::packed) as FP32 values code * 2^-126,
/// in element order: nvfp4::decode_layout_pair's BF16 halves widened by a shift (low half: code q)
/// or a mask (high half: code q + 4). Exact (e = 0 codes land on FP32 subnormals).
__device__ __forceinline__ void decode_layout_f32(uint32_t d, float (&f)[8]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t p = nvfp4::decode_layout_pair(d, q);
    f[q] = __uint_as_float(p << 16);
    f[q + 4] = __uint_as_float(p & 0xffff0000u);
  }
}

/// FP16 bit pattern (low 16 bits) -> float.
__device__ __forceinline__ float half_bits_to_float(uint32_t bits16) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
}

/// Word wi (0..3) of a 16-byte vector.
__device__ __forceinline__ uint32_t word_of(const uint4& w, int wi) {
  return wi == 0 ? w.x : wi == 1 ? w.y : wi == 2 ? w.z : w.w;
}

// E4M3 scale byte -> its value * 2^100 as a BF16 pair (exact: 4 significant bits, 2^91 .. 2^109);
// NaN codes -> BF16 NaN.
__device__ __forceinline__ uint32_t e4m3_bf16x2_scaled(uint32_t s) {
  if (nvfp4::e4m3_is_nan(s)) return 0x7fc07fc0u;
  const float v = half_bits_to_float(nvfp4::e4m3_fp16_bits(s)) * __int_as_float((127 + 108) << 23);
  const uint32_t b = __float_as_uint(v) >> 16;
  return b | (b << 16);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// a * b per BF16 half, round to nearest (exact here), subnormal inputs honoured.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// d += A (16x16 BF16, row) * B (16x8 BF16, col), FP32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#else
// Below sm_80 (no BF16 arithmetic, no BF16 mma.sync): the same operations in FP32/FP64.
// The BF16 bits of x rounded to nearest even once: to FP32 rounding to odd (truncate, then set the
// last bit when inexact), then to BF16 to nearest even (FP32 keeps >= 2 extra bits at every
// exponent, so the two steps round as one).
__device__ __forceinline__ uint32_t double_to_bf16_bits(double x) {
  const float f = __double2float_rz(x);
  const uint32_t u = __float_as_uint(f) | (static_cast<double>(f) != x ? 1u : 0u);
  return dev::float_to_bf16_bits(__uint_as_float(u));
}

// a * b per BF16 half: the FP64 product of two BF16 values is exact, then one rounding to nearest
// (as fma.rn.bf16x2 with a -0 addend).
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  const double lo = static_cast<double>(dev::bf16_lo(a)) * static_cast<double>(dev::bf16_lo(b));
  const double hi = static_cast<double>(dev::bf16_hi(a)) * static_cast<double>(dev::bf16_hi(b));
  return double_to_bf16_bits(lo) | (double_to_bf16_bits(hi) << 16);
}

// d += A (16x16 BF16, row) * B (16x8 BF16, col) with the m16n8k16 fragment layout of mma.sync
// (lane (g, t) = (lane / 4, lane % 4): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2/a3 the same
// at k + 8; b0 = B[2t, 2t+1][g], b1 the same at k + 8; d = D[g][2t, 2t+1], D[g+8][2t, 2t+1]),
// emulated by warp shuffles and an FP32 FMA chain over k ascending (the products are exact, the
// sum rounds per step instead of once per MMA). All 32 lanes of the warp must call it.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // k 0..7 (a0, a1, b0), then k 8..15 (a2, a3, b1)
    const uint32_t ar0 = half == 0 ? a0 : a2, ar1 = half == 0 ? a1 : a3;
    const uint32_t bc = half == 0 ? b0 : b1;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // k = 8 half + 2q, 2q + 1: held by the lanes with t == q
      const uint32_t x0 = __shfl_sync(0xffffffffu, ar0, 4 * g + q);           // A[g][k, k+1]
      const uint32_t x1 = __shfl_sync(0xffffffffu, ar1, 4 * g + q);           // A[g+8][k, k+1]
      const uint32_t y0 = __shfl_sync(0xffffffffu, bc, 4 * (2 * t) + q);      // B[k, k+1][2t]
      const uint32_t y1 = __shfl_sync(0xffffffffu, bc, 4 * (2 * t + 1) + q);  // B[k, k+1][2t+1]
      d[0] = fmaf(dev::bf16_lo(x0), dev::bf16_lo(y0), d[0]);
      d[0] = fmaf(dev::bf16_hi(x0), dev::bf16_hi(y0), d[0]);
      d[1] = fmaf(dev::bf16_lo(x0), dev::bf16_lo(y1), d[1]);
      d[1] = fmaf(dev::bf16_hi(x0), dev::bf16_hi(y1), d[1]);
      d[2] = fmaf(dev::bf16_lo(x1), dev::bf16_lo(y0), d[2]);
      d[2] = fmaf(dev::bf16_hi(x1), dev::bf16_hi(y0), d[2]);
      d[3] = fmaf(dev::bf16_lo(x1), dev::bf16_lo(y1), d[3]);
      d[3] = fmaf(dev::bf16_hi(x1), dev::bf16_hi(y1), d[3]);
    }
  }
}
#endif

/// d += one unit (32 codes) of the A rows g (codes wa, scale bytes sa: the unit's two block
/// scales, low byte first) and g + 8 (wb, sb) times the activation words x (permute_word order)
/// with the m16n8k16 fragments of lane (g, t): per 8-code word two MMAs, codes (q, q + 4) of both
/// rows as BF16x2 (nvfp4::decode_layout_pair: code * 2^-126) times their block scale (lut[256]:
/// e4m3_bf16x2_scaled, E4M3 * 2^100 as BF16x2), q = 0, 1 then 2, 3: every product is the exact
/// code * scale * x * 2^-26 (kMmaUnscale puts the 2^26 back). The bulk-copy kernels' inner step
/// (cuda/kernels/moe_nvfp4_bulk.cu, cuda/kernels/moe_grouped.cu). All 32 lanes must call it.
__device__ __forceinline__ void mma_unit(const uint4& wa, uint32_t sa, const uint4& wb, uint32_t sb,
                                         const uint4 (&x)[4], const uint32_t* lut, float (&d)[4]) {
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    const uint32_t fa = lut[(sa >> (8 * (wi / 2))) & 0xffu];
    const uint32_t fb = lut[(sb >> (8 * (wi / 2))) & 0xffu];
    const uint32_t ca = word_of(wa, wi), cb = word_of(wb, wi);
    mma_bf16(d, bf16x2_mul(nvfp4::decode_layout_pair(ca, 0), fa),
             bf16x2_mul(nvfp4::decode_layout_pair(cb, 0), fb),
             bf16x2_mul(nvfp4::decode_layout_pair(ca, 1), fa),
             bf16x2_mul(nvfp4::decode_layout_pair(cb, 1), fb), x[wi].x, x[wi].y);
    mma_bf16(d, bf16x2_mul(nvfp4::decode_layout_pair(ca, 2), fa),
             bf16x2_mul(nvfp4::decode_layout_pair(cb, 2), fb),
             bf16x2_mul(nvfp4::decode_layout_pair(ca, 3), fa),
             bf16x2_mul(nvfp4::decode_layout_pair(cb, 3), fb), x[wi].z, x[wi].w);
  }
}

/// The gate+up epilogue of the tensor-core kernels for selected expert j (id e, in range when
/// ok), row i: g = sum_g * 2^26 * gs[2e], u = sum_u * 2^26 * gs[2e + 1] (both 0 when !ok), then
/// h[j, i] = BF16(silu(g) * u) and, when gate_up_out is set, its [j, 2I] FP32 g and u.
__device__ __forceinline__ void store_gate_up(float sum_g, float sum_u, int e, bool ok,
                                              const float* global_scale, int j, int i, int inter,
                                              uint16_t* h, float* gate_up_out) {
  float gv = 0.0f, uv = 0.0f;
  if (ok) {
    gv = sum_g * kMmaUnscale * __ldg(global_scale + 2 * e);
    uv = sum_u * kMmaUnscale * __ldg(global_scale + 2 * e + 1);
  }
  const float hv = ok ? dev::silu(gv) * uv : 0.0f;
  h[static_cast<int64_t>(j) * inter + i] = dev::float_to_bf16_bits(hv);
  if (gate_up_out != nullptr) {
    gate_up_out[static_cast<int64_t>(j) * 2 * inter + i] = gv;
    gate_up_out[static_cast<int64_t>(j) * 2 * inter + inter + i] = uv;
  }
}

/// Eight BF16 activations x0..x7 (x0 in the low half of .x) as the pairs (x0, x4) (x1, x5)
/// (x2, x6) (x3, x7): the column order of e2m1_bf16_pair(word, q), q = 0..3.
__device__ __forceinline__ uint4 permute_word(const uint4& q) {
  return make_uint4(__byte_perm(q.x, q.z, 0x5410), __byte_perm(q.x, q.z, 0x7632),
                    __byte_perm(q.y, q.w, 0x5410), __byte_perm(q.y, q.w, 0x7632));
}

}  // namespace fn::nvfp4_mma

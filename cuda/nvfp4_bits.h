// Bit-level NVFP4 decoding used by the expert kernels (cuda/moe_nvfp4.cu) and checked
// exhaustively on the host (tests/test_cuda_nvfp4_bits.cpp, label cpu): E2M1 codes and E4M3
// block-scale bytes mapped to FP16 bit patterns whose values are the codes' values times fixed
// powers of two (MODEL.md §B.4). Plain constexpr C++ (no CUDA syntax); device code calls these
// through nvcc's --expt-relaxed-constexpr. Every mapping is exact.
#pragma once

#include <cstdint>

namespace fn::nvfp4 {

/// FP16 value of e2m1_fp16_pair(...) halves = E2M1 value * 2^-14 (exact for all 16 codes).
inline constexpr float kE2m1Fp16Scale = 1.0f / 16384.0f;
/// FP16 value of e4m3_fp16_bits(...) = E4M3 value * 2^-8 (exact for every non-NaN code).
inline constexpr float kE4m3Fp16Scale = 1.0f / 256.0f;

/// The two E2M1 codes of one packed byte (element 2j in the low nibble, 2j+1 in the high one) as
/// two FP16 bit patterns: low 16 bits = element 2j, high 16 bits = element 2j+1. Code s|e1 e0|m
/// becomes s<<15 | (e1 e0 m)<<9: e = 0 lands on the FP16 subnormal m * 2^-15 = (0.5 m) * 2^-14,
/// e > 0 on 2^(e-15) (1 + m/2) = 2^(e-1) (1 + m/2) * 2^-14.
constexpr uint32_t e2m1_fp16_pair(uint32_t byte) {
  const uint32_t pair = (byte & 0x0fu) | ((byte & 0xf0u) << 12);
  return ((pair & 0x00070007u) << 9) | ((pair & 0x00080008u) << 12);
}

/// FP32 value of the halves of e2m1_bf16_pair(...) widened to FP32 (bits << 16) = E2M1 value *
/// 2^-126 (exact for all 16 codes; e = 0 codes land on FP32 subnormals).
inline constexpr float kE2m1Bf16Scale = 1.1754943508222875e-38f;  // 2^-126

/// Codes q and q + 4 (q < 4) of a packed 32-bit word (code i in nibble i: byte j holds elements
/// 2j low and 2j+1 high) as two BF16 bit patterns: low 16 bits = code q, high 16 bits = code
/// q + 4. Code s|e1 e0|m becomes s<<15 | (e1 e0 m)<<6: e = 0 lands on the BF16 subnormal
/// m * 2^-127 = (0.5 m) * 2^-126, e > 0 on 2^(e-127) (1 + m/2) = 2^(e-1) (1 + m/2) * 2^-126.
/// Widening to FP32 is a shift (low) or a mask (high): no conversion instruction.
constexpr uint32_t e2m1_bf16_pair(uint32_t word, int q) {
  const uint32_t t = word >> (4 * q);
  return ((t & 0x00070007u) << 6) | ((t & 0x00080008u) << 12);
}

/// True for the two E4M3 NaN codes (0x7F, 0xFF), which e4m3_fp16_bits does not map to NaN.
constexpr bool e4m3_is_nan(uint32_t code) {
  return (code & 0x7fu) == 0x7fu;
}

/// An E4M3 byte s|eeee|mmm as the FP16 pattern s<<15 | (eeee mmm)<<7, whose value is the E4M3
/// value * 2^-8 (subnormals m/8 * 2^-6 land on FP16 subnormals). Not for NaN codes.
constexpr uint32_t e4m3_fp16_bits(uint32_t code) {
  return ((code & 0x7fu) << 7) | ((code & 0x80u) << 8);
}

}  // namespace fn::nvfp4

// Bit-level NVFP4 decoding used by the expert kernels (cuda/moe_nvfp4*.cu) and checked
// exhaustively on the host (tests/test_cuda_nvfp4_bits.cpp, label cpu): E2M1 codes and E4M3
// block-scale bytes mapped to FP16 bit patterns whose values are the codes' values times fixed
// powers of two (docs/model.md §B.4). Plain constexpr C++ (no CUDA syntax); device code calls these
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

/// ---- The decode layout of the GPU's expert codes --------------------------------------------
///
/// e2m1_bf16_pair above costs four instructions per pair on the checkpoint's layout (two shifts,
/// a mask, a mask-or): a code's sign and magnitude bits must move by different distances. The
/// CUDA model therefore permutes the bits of every 32-bit word of expert codes once, at load time
/// (to_decode_layout), so that pair q comes out of one rotation and one mask: bits
/// 0x81C081C0 are exactly the BF16 sign (15, 31), exponent low bits (7-8, 23-24) and mantissa top
/// bit (6, 22) that e2m1_bf16_pair fills. Four translates of that pattern cannot tile a word
/// (checked by search), so pair 3 takes two rotations; the cheapest assignment (rotations by 0,
/// 4, 10 and 6 + 14 bits) costs 9 instructions per word instead of 16. decode_layout_pair gives
/// the same bits as e2m1_bf16_pair on the original word, so every kernel's results are unchanged.
/// The permutation stays inside each 32-bit word (8 codes), so rows of any cols % 8 == 0 keep
/// their bytes, and 16-byte unit loads see the same codes as before.
inline constexpr uint32_t kBf16PairMask = 0x81C081C0u;

/// x rotated left by k bits (0 <= k < 32): bit i moves to bit (i + k) % 32.
constexpr uint32_t rotl32(uint32_t x, int k) {
  return k == 0 ? x : (x << k) | (x >> (32 - k));
}

/// e2m1_bf16_pair(w, q) of the word w whose decode-layout form is d = to_decode_layout(w).
constexpr uint32_t decode_layout_pair(uint32_t d, int q) {
  switch (q) {
    case 0:
      return d & kBf16PairMask;
    case 1:
      return rotl32(d, 4) & kBf16PairMask;
    case 2:
      return rotl32(d, 10) & kBf16PairMask;
    default:  // the mantissa bits by 6, the exponent and sign bits by 14
      return (rotl32(d, 6) & 0x00400040u) | (rotl32(d, 14) & 0x81808180u);
  }
}

/// A word of codes in the checkpoint's layout (code i in nibble i) -> its decode layout: pair
/// q's bits (e2m1_bf16_pair) rotated back by the rotation decode_layout_pair applies. A bit
/// permutation (the placed groups are disjoint; tests/test_cuda_nvfp4_bits.cpp checks every bit).
constexpr uint32_t to_decode_layout(uint32_t w) {
  const uint32_t p3 = e2m1_bf16_pair(w, 3);
  return e2m1_bf16_pair(w, 0) | rotl32(e2m1_bf16_pair(w, 1), 28) |
         rotl32(e2m1_bf16_pair(w, 2), 22) | rotl32(p3 & 0x00400040u, 26) |
         rotl32(p3 & 0x81808180u, 18);
}

/// The inverse of to_decode_layout: pair q's sign and magnitude bits back to nibbles q, q + 4.
/// No kernel needs it (they decode the layout directly); the tests check the permutation with it.
constexpr uint32_t from_decode_layout(uint32_t d) {
  uint32_t w = 0;
  for (int q = 0; q < 4; ++q) {
    const uint32_t p = decode_layout_pair(d, q);
    w |= ((p >> 6) & 0x00070007u) << (4 * q);   // magnitudes: bits 6-8, 22-24
    w |= ((p >> 12) & 0x00080008u) << (4 * q);  // signs: bits 15, 31
  }
  return w;
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

// Host test (label cpu, no GPU) of the bit-level NVFP4 decoding the expert kernels use
// (cuda/common/nvfp4_bits.h): every E2M1 code and every E4M3 byte against the core codecs
// (core/codecs.h, table-driven), through the core FP16 decoder.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "core/codecs.h"
#include "cuda/common/nvfp4_bits.h"

TEST_CASE("nvfp4 bits: both nibbles of every byte decode to the E2M1 value times 2^-14") {
  for (uint32_t b = 0; b < 256; ++b) {
    const uint32_t pair = fn::nvfp4::e2m1_fp16_pair(b);
    const float lo = fn::fp16_to_float(static_cast<uint16_t>(pair & 0xffffu));
    const float hi = fn::fp16_to_float(static_cast<uint16_t>(pair >> 16));
    const float want_lo = fn::e2m1_to_float(static_cast<uint8_t>(b & 0xfu));
    const float want_hi = fn::e2m1_to_float(static_cast<uint8_t>(b >> 4));
    CHECK_MESSAGE(lo == want_lo * fn::nvfp4::kE2m1Fp16Scale, "byte ", b);
    CHECK_MESSAGE(hi == want_hi * fn::nvfp4::kE2m1Fp16Scale, "byte ", b);
    CHECK(std::signbit(lo) == std::signbit(want_lo));  // code 8 is -0
    CHECK(std::signbit(hi) == std::signbit(want_hi));
  }
  // Hand-checked: 0x71 holds 0.5 (low) and 6.0 (high); 0xF9 holds -0.5 and -6.
  CHECK(fn::nvfp4::e2m1_fp16_pair(0x71) == ((0x0e00u << 16) | 0x0200u));
  CHECK(fn::nvfp4::e2m1_fp16_pair(0xf9) == ((0x8e00u << 16) | 0x8200u));
}

TEST_CASE("nvfp4 bits: every code in every nibble of a word decodes to its value times 2^-126") {
  // Codes q and q + 4 of the word from e2m1_bf16_pair(word, q), widened to FP32 by a shift
  // (low half) or a mask (high half), as the expert kernels do; the other six nibbles hold
  // varying fillers (they must not leak into the pair).
  constexpr uint32_t kFillers[] = {0x00000000u, 0xffffffffu, 0x9e3779b9u, 0x5a5a5a5au};
  int checked = 0;
  for (int q = 0; q < 4; ++q) {
    for (uint32_t a = 0; a < 16; ++a) {
      for (uint32_t b = 0; b < 16; ++b) {
        for (const uint32_t filler : kFillers) {
          const uint32_t mask = (0xfu << (4 * q)) | (0xfu << (4 * (q + 4)));
          const uint32_t word = (filler & ~mask) | (a << (4 * q)) | (b << (4 * (q + 4)));
          const uint32_t pair = fn::nvfp4::e2m1_bf16_pair(word, q);
          float lo = 0, hi = 0;
          const uint32_t lo_bits = pair << 16, hi_bits = pair & 0xffff0000u;
          std::memcpy(&lo, &lo_bits, 4);
          std::memcpy(&hi, &hi_bits, 4);
          const float want_lo = fn::e2m1_to_float(static_cast<uint8_t>(a));
          const float want_hi = fn::e2m1_to_float(static_cast<uint8_t>(b));
          CHECK_MESSAGE(double(lo) == std::ldexp(double(want_lo), -126), "q ", q, " code ", a);
          CHECK_MESSAGE(double(hi) == std::ldexp(double(want_hi), -126), "q ", q, " code ", b);
          CHECK(std::signbit(lo) == std::signbit(want_lo));
          CHECK(std::signbit(hi) == std::signbit(want_hi));
          ++checked;
        }
      }
    }
  }
  CHECK(checked == 4 * 16 * 16 * 4);
  CHECK(double(fn::nvfp4::kE2m1Bf16Scale) == std::ldexp(1.0, -126));
  // Hand-checked: word 0x70000001 holds 0.5 in nibble 0 and 6.0 in nibble 7 (pair q = 3 high
  // half, pair q = 0 low half): BF16 0x0040 (2^-127) and 0x01C0 (1.5 * 2^-124 = 6 * 2^-126).
  CHECK((fn::nvfp4::e2m1_bf16_pair(0x70000001u, 0) & 0xffffu) == 0x0040u);
  CHECK((fn::nvfp4::e2m1_bf16_pair(0x70000001u, 3) >> 16) == 0x01c0u);
}

TEST_CASE("nvfp4 bits: every E4M3 scale byte decodes to its value times 2^-8, NaN codes flagged") {
  int nan_codes = 0;
  for (uint32_t c = 0; c < 256; ++c) {
    const float want = fn::e4m3_to_float(static_cast<uint8_t>(c));
    if (fn::nvfp4::e4m3_is_nan(c)) {
      ++nan_codes;
      CHECK(std::isnan(want));
      continue;
    }
    const float got = fn::fp16_to_float(static_cast<uint16_t>(fn::nvfp4::e4m3_fp16_bits(c)));
    CHECK_MESSAGE(got == want * fn::nvfp4::kE4m3Fp16Scale, "code ", c);
    CHECK(std::signbit(got) == std::signbit(want));
  }
  CHECK(nan_codes == 2);  // 0x7F and 0xFF only
  // Hand-checked: 0x38 is 1.0 -> FP16 2^-8 (0x1C00); 0x01 is 2^-9 -> FP16 2^-17 (0x0080).
  CHECK(fn::nvfp4::e4m3_fp16_bits(0x38) == 0x1c00u);
  CHECK(fn::nvfp4::e4m3_fp16_bits(0x01) == 0x0080u);
}

TEST_CASE("nvfp4 bits: the decode layout is a bit permutation whose pairs equal e2m1_bf16_pair") {
  using fn::nvfp4::decode_layout_pair;
  using fn::nvfp4::e2m1_bf16_pair;
  using fn::nvfp4::from_decode_layout;
  using fn::nvfp4::to_decode_layout;
  // Every bit lands on exactly one bit and comes back: a permutation of the 32 bits (all three
  // maps are made of rotations, masks and ORs of disjoint groups, so single bits decide it).
  uint32_t seen = 0;
  for (int b = 0; b < 32; ++b) {
    const uint32_t d = to_decode_layout(uint32_t{1} << b);
    CHECK_MESSAGE((d != 0 && (d & (d - 1)) == 0), "bit ", b, " -> ", d);
    CHECK_MESSAGE((seen & d) == 0, "bit ", b, " collides");
    seen |= d;
    CHECK(from_decode_layout(d) == uint32_t{1} << b);
  }
  CHECK(seen == 0xffffffffu);
  // Every code in every nibble, with varying fillers, and random words: the same pairs as the
  // checkpoint's layout gives through e2m1_bf16_pair (checked against the codecs above).
  std::mt19937 rng(7);
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t w = i < 256 ? uint32_t(i) * 0x11111111u ^ uint32_t(i >> 4) : uint32_t(rng());
    const uint32_t d = to_decode_layout(w);
    CHECK(from_decode_layout(d) == w);
    for (int q = 0; q < 4; ++q) {
      if (decode_layout_pair(d, q) != e2m1_bf16_pair(w, q)) {
        FAIL_CHECK("word ", w, " pair ", q);
      }
      ++checked;
    }
  }
  CHECK(checked == 800000);
  // Hand-checked: code 1 (+0.5) in nibble 0 is its mantissa bit; pair 0 takes its bits
  // unrotated, so it is stored at BF16 bit 6, and pair 0 reads BF16 0x0040 = 0.5 * 2^-126.
  CHECK(to_decode_layout(0x00000001u) == 0x00000040u);
  CHECK(decode_layout_pair(0x00000040u, 0) == 0x00000040u);
  // Code 7 (+6.0) in nibble 7 (pair 3 high half): mantissa -> stored bit 16 (22 - 6), exponent
  // bits -> 23 - 14 = 9 and 24 - 14 = 10; pair 3 gives BF16 0x01C0 in the high half.
  CHECK(to_decode_layout(0x70000000u) == 0x00010600u);
  CHECK(decode_layout_pair(0x00010600u, 3) == 0x01c00000u);
}

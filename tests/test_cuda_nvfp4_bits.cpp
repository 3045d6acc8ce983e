// Host test (label cpu, no GPU) of the bit-level NVFP4 decoding the expert kernels use
// (cuda/nvfp4_bits.h): every E2M1 code and every E4M3 byte against the core codecs (core/codecs.h,
// table-driven), through the core FP16 decoder.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>

#include "core/codecs.h"
#include "cuda/nvfp4_bits.h"

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

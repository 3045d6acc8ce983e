// Codec tests: every code of E2M1 / E4M3 / E5M2 against values computed here from the bit layout
// with std::ldexp (not through the tables under test), BF16/FP16 against the bit layout and the
// compiler's _Float16 conversion, rounding ties, and NVFP4 rows (docs/model.md §B.4) by hand.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/codecs.h"
#include "core/error.h"

namespace {

// Reference decoders from the bit layouts (sign | exponent | mantissa), independent of
// core/codecs.cpp: value = (implicit + m / 2^mbits) * 2^(e - bias), subnormal at e = 0.
double ref_minifloat(uint32_t code, int ebits, int mbits, int bias) {
  const bool neg = (code >> (ebits + mbits)) & 1u;
  const int e = static_cast<int>((code >> mbits) & ((1u << ebits) - 1u));
  const int m = static_cast<int>(code & ((1u << mbits) - 1u));
  const double v = e == 0 ? std::ldexp(static_cast<double>(m), 1 - bias - mbits)
                          : std::ldexp(static_cast<double>((1 << mbits) + m), e - bias - mbits);
  return neg ? -v : v;
}

bool same_value(float got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  return static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
}

}  // namespace

TEST_CASE("codecs: all 16 E2M1 codes decode to the docs/model.md B.4 magnitudes") {
  const float table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (uint32_t c = 0; c < 16; ++c) {
    INFO("code " << c);
    CHECK(same_value(fn::e2m1_to_float(static_cast<uint8_t>(c)), table[c]));
    // E2M1 as a minifloat: 2 exponent bits, bias 1, 1 mantissa bit.
    CHECK(same_value(fn::e2m1_to_float(static_cast<uint8_t>(c)), ref_minifloat(c, 2, 1, 1)));
    // Only the low nibble is read.
    CHECK(same_value(fn::e2m1_to_float(static_cast<uint8_t>(c | 0xA0)), table[c]));
  }
  CHECK(std::signbit(fn::e2m1_to_float(8)));
}

TEST_CASE("codecs: all 256 E4M3 codes decode per float8_e4m3fn, with NaN, subnormals and -0") {
  for (uint32_t c = 0; c < 256; ++c) {
    INFO("code " << c);
    const double want =
        (c & 0x7F) == 0x7F ? std::numeric_limits<double>::quiet_NaN() : ref_minifloat(c, 4, 3, 7);
    CHECK(same_value(fn::e4m3_to_float(static_cast<uint8_t>(c)), want));
  }
  CHECK(fn::e4m3_to_float(0x7E) == 448.0f);
  CHECK(fn::e4m3_to_float(0xFE) == -448.0f);
  CHECK(fn::e4m3_to_float(0x38) == 1.0f);
  CHECK(fn::e4m3_to_float(0x01) == 0x1p-9f);  // smallest subnormal
  CHECK(fn::e4m3_to_float(0x07) == 7 * 0x1p-9f);
  CHECK(fn::e4m3_to_float(0x08) == 0x1p-6f);  // smallest normal
  CHECK(std::isnan(fn::e4m3_to_float(0x7F)));
  CHECK(std::isnan(fn::e4m3_to_float(0xFF)));
  CHECK(fn::e4m3_to_float(0x78) == 256.0f);  // exponent 15 is finite in e4m3fn
  CHECK(std::signbit(fn::e4m3_to_float(0x80)));
  CHECK(fn::e4m3_to_float(0x80) == 0.0f);
}

TEST_CASE("codecs: all 256 E5M2 codes decode IEEE-like with inf and NaN") {
  for (uint32_t c = 0; c < 256; ++c) {
    INFO("code " << c);
    double want;
    if (((c >> 2) & 0x1F) == 31) {
      want = (c & 3) == 0 ? ((c & 0x80) ? -INFINITY : INFINITY)
                          : std::numeric_limits<double>::quiet_NaN();
    } else {
      want = ref_minifloat(c, 5, 2, 15);
    }
    CHECK(same_value(fn::e5m2_to_float(static_cast<uint8_t>(c)), want));
  }
  CHECK(fn::e5m2_to_float(0x7B) == 57344.0f);
  CHECK(fn::e5m2_to_float(0x7C) == INFINITY);
  CHECK(fn::e5m2_to_float(0xFC) == -INFINITY);
  CHECK(std::isnan(fn::e5m2_to_float(0x7D)));
  CHECK(fn::e5m2_to_float(0x3C) == 1.0f);
  CHECK(fn::e5m2_to_float(0x01) == 0x1p-16f);
}

TEST_CASE("codecs: BF16 decodes every code by the bit layout and round-trips every non-NaN code") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fn::bf16_to_float(static_cast<uint16_t>(h));
    const uint32_t e = (h >> 7) & 0xFF;
    double want;
    if (e == 255) {
      want = (h & 0x7F) ? std::numeric_limits<double>::quiet_NaN()
                        : ((h & 0x8000) ? -INFINITY : INFINITY);
    } else {
      want = ref_minifloat(h, 8, 7, 127);
    }
    if (!same_value(f, want)) FAIL("bf16 code " << h);
    if (!std::isnan(f) && fn::float_to_bf16(f) != h) FAIL("bf16 round trip " << h);
  }
}

TEST_CASE("codecs: float to BF16 rounds to nearest even and keeps NaN") {
  CHECK(fn::float_to_bf16(1.0f) == 0x3F80);
  CHECK(fn::float_to_bf16(1.0f + 0x1p-8f) == 0x3F80);             // tie -> even (down)
  CHECK(fn::float_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3F82);         // tie -> even (up)
  CHECK(fn::float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3F81);  // above the tie
  CHECK(fn::float_to_bf16(-(1.0f + 0x1p-8f + 0x1p-20f)) == 0xBF81);
  CHECK(fn::float_to_bf16(-0.0f) == 0x8000);
  CHECK(fn::float_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // rounds to inf
  CHECK(fn::float_to_bf16(INFINITY) == 0x7F80);
  CHECK(fn::float_to_bf16(-INFINITY) == 0xFF80);
  // A NaN whose payload lives only in the dropped bits must stay NaN, not become inf.
  const uint16_t nan = fn::float_to_bf16(std::bit_cast<float>(0x7F800001u));
  CHECK(std::isnan(fn::bf16_to_float(nan)));
  CHECK(std::isnan(fn::bf16_to_float(fn::float_to_bf16(-std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::signbit(fn::bf16_to_float(fn::float_to_bf16(std::bit_cast<float>(0xFFC00000u)))));
  // Subnormal float: bits 0x00010000 is exactly bf16 0x0001; 0x00008000 is a tie -> 0.
  CHECK(fn::float_to_bf16(std::bit_cast<float>(0x00010000u)) == 0x0001);
  CHECK(fn::float_to_bf16(std::bit_cast<float>(0x00008000u)) == 0x0000);
  CHECK(fn::float_to_bf16(std::bit_cast<float>(0x00018000u)) == 0x0002);
}

TEST_CASE("codecs: FP16 decodes every code by the bit layout and round-trips every non-NaN code") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fn::fp16_to_float(static_cast<uint16_t>(h));
    const uint32_t e = (h >> 10) & 0x1F;
    double want;
    if (e == 31) {
      want = (h & 0x3FF) ? std::numeric_limits<double>::quiet_NaN()
                         : ((h & 0x8000) ? -INFINITY : INFINITY);
    } else {
      want = ref_minifloat(h, 5, 10, 15);
    }
    if (!same_value(f, want)) FAIL("fp16 code " << h);
    if (!std::isnan(f) && fn::float_to_fp16(f) != h) FAIL("fp16 round trip " << h);
    if (std::isnan(f) && !std::isnan(fn::fp16_to_float(fn::float_to_fp16(f)))) {
      FAIL("fp16 NaN lost " << h);
    }
  }
}

TEST_CASE("codecs: float to FP16 rounds to nearest even, including subnormals and overflow") {
  CHECK(fn::float_to_fp16(1.0f) == 0x3C00);
  CHECK(fn::float_to_fp16(1.0f + 0x1p-11f) == 0x3C00);      // tie -> even (down)
  CHECK(fn::float_to_fp16(1.0f + 3 * 0x1p-11f) == 0x3C02);  // tie -> even (up)
  CHECK(fn::float_to_fp16(65504.0f) == 0x7BFF);
  CHECK(fn::float_to_fp16(65519.0f) == 0x7BFF);
  CHECK(fn::float_to_fp16(65520.0f) == 0x7C00);  // tie between 65504 and 2^16 -> inf
  CHECK(fn::float_to_fp16(-1e6f) == 0xFC00);
  CHECK(fn::float_to_fp16(0x1p-14f) == 0x0400);      // smallest normal
  CHECK(fn::float_to_fp16(0x1p-24f) == 0x0001);      // smallest subnormal
  CHECK(fn::float_to_fp16(0x1p-25f) == 0x0000);      // tie -> even (0)
  CHECK(fn::float_to_fp16(3 * 0x1p-25f) == 0x0002);  // tie -> even (2)
  CHECK(fn::float_to_fp16(0x1p-25f * 1.0001f) == 0x0001);
  CHECK(fn::float_to_fp16(-0.0f) == 0x8000);
  CHECK(fn::float_to_fp16(1e-10f) == 0x0000);

  // Against the compiler's own IEEE conversion on random floats spanning every binade of FP16.
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-30, 17);
  for (int i = 0; i < 200000; ++i) {
    float x = std::ldexp(mant(rng), expo(rng));
    if (i & 1) x = -x;
    const _Float16 h = static_cast<_Float16>(x);
    const uint16_t want = std::bit_cast<uint16_t>(h);
    if (fn::float_to_fp16(x) != want) FAIL("fp16 of " << x);
  }
}

TEST_CASE("codecs: float to E4M3 round-trips every code, rounds ties to even and saturates") {
  for (uint32_t c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    const float v = fn::e4m3_to_float(static_cast<uint8_t>(c));
    CHECK(fn::float_to_e4m3(v) == c);
  }
  // Midpoints between consecutive positive codes go to the even code; just off them, to the
  // nearer one. Reference values from the bit layout, not from the tables.
  for (uint32_t c = 0; c < 0x7E; ++c) {
    const double lo = ref_minifloat(c, 4, 3, 7), hi = ref_minifloat(c + 1, 4, 3, 7);
    const float mid = static_cast<float>((lo + hi) / 2);  // exact in float
    INFO("between codes " << c << " and " << c + 1);
    CHECK(fn::float_to_e4m3(mid) == ((c & 1) ? c + 1 : c));
    CHECK(fn::float_to_e4m3(std::nextafter(mid, INFINITY)) == c + 1);
    CHECK(fn::float_to_e4m3(std::nextafter(mid, 0.0f)) == c);
    CHECK(fn::float_to_e4m3(-mid) == (0x80u | ((c & 1) ? c + 1 : c)));
  }
  CHECK(fn::float_to_e4m3(464.0f) == 0x7E);  // past 448: saturate, never NaN
  CHECK(fn::float_to_e4m3(1e9f) == 0x7E);
  CHECK(fn::float_to_e4m3(INFINITY) == 0x7E);
  CHECK(fn::float_to_e4m3(-INFINITY) == 0xFE);
  CHECK(fn::float_to_e4m3(-500.0f) == 0xFE);
  CHECK(fn::float_to_e4m3(NAN) == 0x7F);
  CHECK(fn::float_to_e4m3(0x1p-10f) == 0x00);  // half the smallest subnormal: tie -> 0
  CHECK(fn::float_to_e4m3(0x1p-10f * 1.01f) == 0x01);
  CHECK(fn::float_to_e4m3(1e-30f) == 0x00);
  CHECK(fn::float_to_e4m3(-1e-30f) == 0x80);
}

TEST_CASE("codecs: float to E2M1 rounds to nearest with ties to the even code and saturates") {
  for (uint32_t c = 0; c < 16; ++c) CHECK(fn::float_to_e2m1(fn::e2m1_to_float(c)) == c);
  const struct {
    float x;
    uint8_t code;
  } cases[] = {
      {0.25f, 0},   {0.2501f, 1},   {0.75f, 2},   {0.7499f, 1}, {1.25f, 2},    {1.2501f, 3},
      {1.75f, 4},   {1.7499f, 3},   {2.5f, 4},    {2.5001f, 5}, {3.5f, 6},     {3.4999f, 5},
      {5.0f, 6},    {5.0001f, 7},   {6.5f, 7},    {1e9f, 7},    {INFINITY, 7}, {-0.75f, 0xA},
      {-5.0f, 0xE}, {-100.0f, 0xF}, {-0.1f, 0x8}, {0.1f, 0},
  };
  for (const auto& c : cases) {
    INFO("x = " << c.x);
    CHECK(fn::float_to_e2m1(c.x) == c.code);
  }
}

TEST_CASE("codecs: a packed NVFP4 row dequantizes low nibble first with block and global scale") {
  // Two blocks of 16. Block 0: scale code 0x38 = 1.0; block 1: 0x40 = 2.0; global scale 0.5.
  const uint8_t packed[16] = {0x71, 0x9A, 0x00, 0x08, 0x23, 0x45, 0x67, 0xFF,
                              0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE};
  const uint8_t scales[2] = {0x38, 0x40};
  // By hand: byte 0x71 -> element 0 = code 1 (0.5), element 1 = code 7 (6); times 1.0 * 0.5.
  const float want[32] = {0.25f, 3.0f, -0.5f, -0.25f, 0.0f, 0.0f, -0.0f, 0.0f, 0.75f, 0.5f, 1.5f,
                          1.0f, 3.0f, 2.0f, -3.0f, -3.0f,
                          // block 1: codes 0..15 in order, times 2.0 * 0.5 = 1.0
                          0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f,
                          -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  float out[32];
  fn::dequant_nvfp4_row(packed, scales, 0.5f, 32, out);
  for (int i = 0; i < 32; ++i) {
    INFO("element " << i);
    CHECK(out[i] == want[i]);
    CHECK(std::signbit(out[i]) == std::signbit(want[i]));
  }
  // A subnormal block scale (code 0x03 = 3 * 2^-9) and a non-power-of-two global scale.
  const uint8_t sub_scale[1] = {0x03};
  float out16[16];
  fn::dequant_nvfp4_row(packed, sub_scale, 0.1f, 16, out16);
  CHECK(out16[1] == 6.0f * (3 * 0x1p-9f) * 0.1f);
  CHECK(out16[0] == 0.5f * (3 * 0x1p-9f) * 0.1f);
  CHECK_THROWS_AS(fn::dequant_nvfp4_row(packed, scales, 1.0f, 24, out), fn::Error);
}

TEST_CASE("codecs: NVFP4 quantize then dequantize stays within one block step") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const int64_t k = 2560;
  std::vector<float> w(k);
  for (auto& x : w) x = normal(rng);
  w[100] = 0.3f;  // an outlier sets amax
  float amax = 0.0f;
  for (float x : w) amax = std::fmax(amax, std::fabs(x));
  const float gs = fn::nvfp4_global_scale(amax);
  CHECK(gs == amax / 2688.0f);
  std::vector<uint8_t> packed(k / 2), scales(k / 16);
  fn::quantize_nvfp4_row(w.data(), k, gs, packed.data(), scales.data());
  std::vector<float> back(k);
  fn::dequant_nvfp4_row(packed.data(), scales.data(), gs, k, back.data());
  CHECK(scales[100 / 16] == 0x7E);  // the block holding amax uses the E4M3 maximum
  double sq_err = 0, sq = 0;
  for (int64_t i = 0; i < k; ++i) {
    const float step = fn::e4m3_to_float(scales[i / 16]) * gs;
    INFO("element " << i << " w " << w[i] << " back " << back[i]);
    if (!(std::fabs(w[i] - back[i]) <= step)) FAIL("error above one block step");
    // The block scale is the E4M3 rounding of amax_block / 6 / gs: at most 1/16 relative.
    float bmax = 0;
    for (int j = 0; j < 16; ++j) bmax = std::fmax(bmax, std::fabs(w[i / 16 * 16 + j]));
    const float ideal = bmax / 6.0f / gs;
    if (ideal >= 0x1p-6f &&
        !(std::fabs(fn::e4m3_to_float(scales[i / 16]) - ideal) <= ideal / 16.0f * 1.0001f)) {
      FAIL("block scale off");
    }
    sq_err += double(w[i] - back[i]) * (w[i] - back[i]);
    sq += double(w[i]) * w[i];
  }
  // NVFP4 on Gaussian data: relative RMS error about 0.1 (4-bit codes).
  CHECK(std::sqrt(sq_err / sq) < 0.15);
}

TEST_CASE("codecs: NVFP4 quantization is exact for representable values and zero blocks") {
  // Block 0 holds exact E2M1 multiples of a power-of-two step; block 1 is all zeros.
  const uint8_t codes[16] = {7, 0xF, 1, 2, 3, 4, 5, 6, 8, 9, 0xA, 0xB, 0xC, 0xD, 0xE, 0};
  std::vector<float> w(32, 0.0f);
  const float gs = 0x1p-9f;
  // w = code value * 2 * gs: amax = 12 * gs -> block scale 12 gs / 6 / gs = 2.0 exactly (code
  // 0x40), step = 2 * gs, and w / step is the code value itself.
  for (int i = 0; i < 16; ++i) w[i] = fn::e2m1_to_float(codes[i]) * 2.0f * gs;
  std::vector<uint8_t> packed(16), scales(2);
  fn::quantize_nvfp4_row(w.data(), 32, gs, packed.data(), scales.data());
  CHECK(scales[0] == 0x40);
  CHECK(scales[1] == 0x00);
  for (int j = 0; j < 8; ++j) {
    CHECK((packed[j] & 0xF) == codes[2 * j]);
    CHECK((packed[j] >> 4) == codes[2 * j + 1]);
    CHECK(packed[8 + j] == 0);
  }
  std::vector<float> back(32);
  fn::dequant_nvfp4_row(packed.data(), scales.data(), gs, 32, back.data());
  for (int i = 0; i < 32; ++i) CHECK(back[i] == w[i]);
  // A zero global scale (all-zero tensor) gives zero codes and scales.
  fn::quantize_nvfp4_row(w.data(), 32, 0.0f, packed.data(), scales.data());
  for (uint8_t b : packed) CHECK(b == 0);
  for (uint8_t s : scales) CHECK(s == 0);
}

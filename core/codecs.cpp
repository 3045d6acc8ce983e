#include "core/codecs.h"

#include <array>
#include <bit>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace fn {
namespace {

// 2^e for |e| <= 126 by repeated exact multiplication (constexpr; std::ldexp is not in C++20).
constexpr float pow2(int e) {
  float r = 1.0f;
  for (; e > 0; --e) r *= 2.0f;
  for (; e < 0; ++e) r *= 0.5f;
  return r;
}

constexpr std::array<float, 16> kE2M1 = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// float8_e4m3fn: s eeee mmm, bias 7; e = 0 subnormal; 0x7F / 0xFF NaN; no inf.
constexpr std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 0xF;
    const int m = c & 0x7;
    float v;
    if ((c & 0x7F) == 0x7F) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (e == 0) {
      v = static_cast<float>(m) / 8.0f * pow2(-6);
    } else {
      v = (1.0f + static_cast<float>(m) / 8.0f) * pow2(e - 7);
    }
    t[c] = (c & 0x80) ? -v : v;
  }
  return t;
}

// float8_e5m2: s eeeee mm, bias 15; e = 0 subnormal; e = 31 inf (m = 0) or NaN.
constexpr std::array<float, 256> make_e5m2_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 2) & 0x1F;
    const int m = c & 0x3;
    float v;
    if (e == 31) {
      v = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    } else if (e == 0) {
      v = static_cast<float>(m) / 4.0f * pow2(-14);
    } else {
      v = (1.0f + static_cast<float>(m) / 4.0f) * pow2(e - 15);
    }
    t[c] = (c & 0x80) ? -v : v;
  }
  return t;
}

constexpr std::array<float, 256> kE4M3 = make_e4m3_table();
constexpr std::array<float, 256> kE5M2 = make_e5m2_table();

constexpr int kNvfp4Block = 16;

}  // namespace

float e2m1_to_float(uint8_t code) noexcept {
  return kE2M1[code & 0xF];
}
float e4m3_to_float(uint8_t code) noexcept {
  return kE4M3[code];
}
float e5m2_to_float(uint8_t code) noexcept {
  return kE5M2[code];
}

float bf16_to_float(uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

uint16_t float_to_bf16(float value) noexcept {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    // NaN: keep sign and top payload bits, force the quiet bit so truncation cannot make it inf.
    return static_cast<uint16_t>((x >> 16) | 0x0040u);
  }
  const uint32_t rounding = 0x7FFFu + ((x >> 16) & 1u);  // RNE on the 16 dropped bits
  return static_cast<uint16_t>((x + rounding) >> 16);
}

float fp16_to_float(uint16_t bits) noexcept {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t e = (bits >> 10) & 0x1Fu;
  const uint32_t m = bits & 0x3FFu;
  if (e == 0) {
    const float v = static_cast<float>(m) * pow2(-24);  // exact: m < 2^10
    return sign ? -v : v;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7F800000u | (m << 13));
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t float_to_fp16(float value) noexcept {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
  // 65520 = 65504 + half an ulp; at or above it RNE gives inf (the tie goes to the even inf).
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (ax < 0x38800000u) {
    // Below 2^-14: subnormal half. Adding 0.5f puts the value's 2^-24 units in the low mantissa
    // bits of a float in [0.5, 1), and the FPU's own RNE does the rounding.
    const float a = std::bit_cast<float>(ax) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(a) - 0x3F000000u));
  }
  const uint32_t mant_odd = (ax >> 13) & 1u;
  ax += 0xC8000FFFu + mant_odd;  // rebias exponent 127 -> 15 (-112 << 23) and round to even
  return static_cast<uint16_t>(sign | (ax >> 13));
}

uint8_t float_to_e4m3(float value) noexcept {
  if (std::isnan(value)) return 0x7F;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float a = std::fabs(value);
  if (a >= 448.0f) return sign | 0x7E;
  // Codes 0x00..0x7E are monotonic in magnitude: find the last code whose value is <= a.
  int lo = 0, hi = 0x7E;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (kE4M3[mid] <= a) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (lo == 0x7E) return sign | 0x7E;
  // Midpoint and distances are exact in double (both neighbours have <= 4 significant bits).
  const double below = kE4M3[lo], above = kE4M3[lo + 1];
  const double d_lo = static_cast<double>(a) - below, d_hi = above - static_cast<double>(a);
  int code = lo;
  if (d_hi < d_lo || (d_hi == d_lo && (lo & 1))) code = lo + 1;
  return static_cast<uint8_t>(sign | code);
}

uint8_t float_to_e2m1(float value) noexcept {
  if (std::isnan(value)) return 0;
  const uint8_t sign = std::signbit(value) ? 0x8 : 0x0;
  const float a = std::fabs(value);
  // Midpoints between consecutive magnitudes; at a tie the even code wins (<= vs <).
  uint8_t m;
  if (a <= 0.25f) {
    m = 0;
  } else if (a < 0.75f) {
    m = 1;
  } else if (a <= 1.25f) {
    m = 2;
  } else if (a < 1.75f) {
    m = 3;
  } else if (a <= 2.5f) {
    m = 4;
  } else if (a < 3.5f) {
    m = 5;
  } else if (a <= 5.0f) {
    m = 6;
  } else {
    m = 7;
  }
  return static_cast<uint8_t>(sign | m);
}

float nvfp4_global_scale(float amax) noexcept {
  return amax / (6.0f * 448.0f);
}

void dequant_nvfp4_row(const uint8_t* packed, const uint8_t* block_scales, float global_scale,
                       int64_t k, float* out) {
  FN_CHECK(k > 0 && k % kNvfp4Block == 0, "NVFP4 row length {} is not a positive multiple of 16",
           k);
  for (int64_t b = 0; b < k / kNvfp4Block; ++b) {
    const float scale = kE4M3[block_scales[b]] * global_scale;
    const uint8_t* p = packed + b * (kNvfp4Block / 2);
    float* o = out + b * kNvfp4Block;
    for (int j = 0; j < kNvfp4Block / 2; ++j) {
      o[2 * j] = kE2M1[p[j] & 0xF] * scale;
      o[2 * j + 1] = kE2M1[p[j] >> 4] * scale;
    }
  }
}

void quantize_nvfp4_row(const float* w, int64_t k, float global_scale, uint8_t* packed,
                        uint8_t* block_scales) {
  FN_CHECK(k > 0 && k % kNvfp4Block == 0, "NVFP4 row length {} is not a positive multiple of 16",
           k);
  for (int64_t b = 0; b < k / kNvfp4Block; ++b) {
    const float* x = w + b * kNvfp4Block;
    float amax = 0.0f;
    for (int i = 0; i < kNvfp4Block; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const uint8_t sc = global_scale > 0.0f ? float_to_e4m3(amax / 6.0f / global_scale) : 0;
    block_scales[b] = sc;
    const float step = kE4M3[sc] * global_scale;
    uint8_t* p = packed + b * (kNvfp4Block / 2);
    if (!(step > 0.0f) || !std::isfinite(step)) {
      for (int j = 0; j < kNvfp4Block / 2; ++j) p[j] = 0;
      continue;
    }
    // Divide (not multiply by 1/step): exactly representable values must round-trip exactly.
    for (int j = 0; j < kNvfp4Block / 2; ++j) {
      const uint8_t lo = float_to_e2m1(x[2 * j] / step);
      const uint8_t hi = float_to_e2m1(x[2 * j + 1] / step);
      p[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

}  // namespace fn

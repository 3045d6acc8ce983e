// Exact scalar codecs for the checkpoint element types (E2M1, FP8 E4M3/E5M2, BF16, FP16) and the
// NVFP4 row (de)quantizer of docs/model.md §B.4. Called by the CPU backend (dequantization), the
// checkpoint writer `fngen synth` (quantization) and tests. Decoders are table lookups or exact
// bit manipulation (no rounding); encoders round to nearest, ties to even, as documented per call.
#pragma once

#include <cstdint>

namespace fn {

/// E2M1 (FP4) code -> float. Only the low 4 bits are read: bit 3 is the sign, bits 0-2 index the
/// magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; code 8 is -0 (docs/model.md §B.4).
float e2m1_to_float(uint8_t code) noexcept;
/// float8_e4m3fn -> float: bias 7, no infinities, 0x7F/0xFF are NaN, exponent 0 is subnormal
/// (m/8 * 2^-6), max finite ±448 (docs/model.md §B.4, §B.5).
float e4m3_to_float(uint8_t code) noexcept;
/// float8_e5m2 -> float: IEEE-like, bias 15, exponent 31 is inf (mantissa 0) or NaN.
float e5m2_to_float(uint8_t code) noexcept;
/// bfloat16 bits -> float (exact: the bits shifted into the high half).
float bf16_to_float(uint16_t bits) noexcept;
/// float -> bfloat16 bits, round to nearest even; NaN stays NaN (quiet, sign kept); overflow
/// rounds to ±inf as IEEE does.
uint16_t float_to_bf16(float value) noexcept;
/// IEEE binary16 bits -> float (exact, subnormals and inf/NaN included).
float fp16_to_float(uint16_t bits) noexcept;
/// float -> IEEE binary16 bits, round to nearest even; |x| >= 65520 -> ±inf; NaN stays NaN.
uint16_t float_to_fp16(float value) noexcept;

/// float -> float8_e4m3fn code, round to nearest, ties to even code; saturates: |x| > 448 and
/// ±inf give ±448 (0x7E/0xFE); NaN gives 0x7F (used by `fngen synth` for block scales).
uint8_t float_to_e4m3(float value) noexcept;
/// float -> E2M1 code (low 4 bits), round to nearest, ties to the even code (0.25 -> 0,
/// 0.75 -> 1.0, 2.5 -> 2, 5 -> 4); |x| > 6 saturates to ±6; NaN gives +0; negative values that
/// round to zero give -0 (code 8).
uint8_t float_to_e2m1(float value) noexcept;

/// NVFP4 global scale (`weight_scale_2`, a multiplier) for a tensor whose largest magnitude is
/// `amax`: amax / (6 * 448), so the largest block scale lands on the E4M3 maximum (docs/model.md
/// §B.4).
float nvfp4_global_scale(float amax) noexcept;

/// Dequantizes one NVFP4 row of k elements (docs/model.md §B.4):
/// out[i] = e2m1(code i) * e4m3(block_scales[i / 16]) * global_scale, where byte j of `packed`
/// holds element 2j in its low nibble and 2j+1 in its high nibble.
/// packed: [k/2] U8, block_scales: [k/16] F8_E4M3, out: [k] F32. k must be a positive multiple
/// of 16 (fn::Error(Internal) otherwise).
void dequant_nvfp4_row(const uint8_t* packed, const uint8_t* block_scales, float global_scale,
                       int64_t k, float* out);

/// Quantizes one row of k floats to NVFP4 (inverse of dequant_nvfp4_row): per 16-element block,
/// block scale = e4m3(amax_block / 6 / global_scale) (RNE, saturating), codes =
/// e2m1(w / (decoded block scale * global_scale)). A block whose decoded scale is 0 (or a
/// global_scale of 0) gets all-zero codes. packed: [k/2], block_scales: [k/16]; k a positive
/// multiple of 16 (fn::Error(Internal) otherwise). When the block scale lands in E4M3's normal
/// range and below 448, the error per element is at most one decoded block step
/// s = e4m3(scale) * global_scale (E2M1 half-gap <= 1 step, saturation <= 0.4 step).
void quantize_nvfp4_row(const float* w, int64_t k, float global_scale, uint8_t* packed,
                        uint8_t* block_scales);

}  // namespace fn

// Value checks of scale tensors and unquantised weights (see weight_checks.h).
#include "core/weight_checks.h"

#include <cmath>
#include <cstring>

#include "core/codecs.h"
#include "core/error.h"

namespace fn {

namespace {

// Element i of `bytes` as a float (F32, BF16, F16, F8_E4M3).
float element(DType dtype, std::span<const std::byte> bytes, std::size_t i) {
  switch (dtype) {
    case DType::F32: {
      float f;
      std::memcpy(&f, bytes.data() + 4 * i, 4);
      return f;
    }
    case DType::BF16:
    case DType::F16: {
      uint16_t b;
      std::memcpy(&b, bytes.data() + 2 * i, 2);
      return dtype == DType::BF16 ? bf16_to_float(b) : fp16_to_float(b);
    }
    case DType::F8_E4M3:
      return e4m3_to_float(std::to_integer<uint8_t>(bytes[i]));
    default:
      return 0.0f;
  }
}

bool is_float(DType dtype) {
  return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16 ||
         dtype == DType::F8_E4M3;
}

// "tensor 'x': <what>, e.g. element i = v (k of n)" for the elements failing `bad`, or "".
template <class Bad>
std::string first_bad(std::string_view tensor, DType dtype, std::span<const std::byte> bytes,
                      std::string_view what, Bad bad) {
  const std::size_t n = bytes.size() / dtype_size(dtype);
  std::size_t count = 0, first = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (bad(i)) {
      if (count++ == 0) first = i;
    }
  }
  if (count == 0) return {};
  const float v = element(dtype, bytes, first);
  const std::string shown =
      dtype == DType::F8_E4M3
          ? fmt::format("{} (code 0x{:02X})", v, std::to_integer<uint8_t>(bytes[first]))
          : fmt::format("{}", v);
  return fmt::format("tensor '{}': {}, e.g. element {} = {} ({} of {})", tensor, what, first, shown,
                     count, n);
}

}  // namespace

bool is_scale_role(TensorRole role) noexcept {
  return role == TensorRole::ExpertBlockScale || role == TensorRole::ExpertGlobalScale ||
         role == TensorRole::PleNgramScale;
}

std::string scale_problem(TensorRole role, std::string_view tensor, DType dtype,
                          std::span<const std::byte> bytes) {
  if (!is_scale_role(role) || !is_float(dtype)) return {};
  switch (role) {
    case TensorRole::ExpertBlockScale:
      // E4M3 (FN): bit 7 is the sign; 0x7F and 0xFF are NaN.
      return first_bad(tensor, dtype, bytes,
                       "an NVFP4 block scale is negative or NaN (E4M3 sign bit set or code 0x7F)",
                       [&](std::size_t i) {
                         const auto c = std::to_integer<uint8_t>(bytes[i]);
                         return dtype != DType::F8_E4M3 ? !(element(dtype, bytes, i) >= 0.0f)
                                                        : (c & 0x80u) != 0 || c == 0x7Fu;
                       });
    case TensorRole::ExpertGlobalScale:
      return first_bad(tensor, dtype, bytes,
                       "the NVFP4 global scale (weight_scale_2) is negative or not finite",
                       [&](std::size_t i) {
                         const float v = element(dtype, bytes, i);
                         return !std::isfinite(v) || v < 0.0f || std::signbit(v);
                       });
    default:  // PleNgramScale
      return first_bad(tensor, dtype, bytes,
                       "the FP8 n-gram table's weight_scale is not a finite number > 0",
                       [&](std::size_t i) {
                         const float v = element(dtype, bytes, i);
                         return !std::isfinite(v) || !(v > 0.0f);
                       });
  }
}

void require_possible_scales(TensorRole role, std::string_view tensor, DType dtype,
                             std::span<const std::byte> bytes, std::string_view where) {
  const std::string problem = scale_problem(role, tensor, dtype, bytes);
  FN_REQUIRE(problem.empty(), Format, "{}: {}", where, problem);
}

bool zero_global_scale_of_nonzero_tensor(float global_scale,
                                         std::span<const std::byte> block_scales) noexcept {
  if (global_scale != 0.0f) return false;
  for (const std::byte b : block_scales)
    if (std::to_integer<uint8_t>(b) != 0) return true;
  return false;
}

std::string nonfinite_problem(std::string_view tensor, DType dtype,
                              std::span<const std::byte> bytes, uint64_t first_element) {
  if (!is_float(dtype)) return {};
  const std::size_t n = bytes.size() / dtype_size(dtype);
  for (std::size_t i = 0; i < n; ++i) {
    const float v = element(dtype, bytes, i);
    if (!std::isfinite(v))
      return fmt::format("tensor '{}': non-finite value {} at element {}", tensor, v,
                         first_element + i);
  }
  return {};
}

}  // namespace fn

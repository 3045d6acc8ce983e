// Unit tests of core/weight_checks.h: the scale checks every load and `fngen inspect` share, and
// the non-finite check of unquantised weights, against hand-made bytes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/weight_checks.h"

using fn::DType;
using fn::TensorRole;

namespace {

std::vector<std::byte> bytes_of(std::initializer_list<uint8_t> codes) {
  std::vector<std::byte> out;
  for (uint8_t c : codes) out.push_back(std::byte{c});
  return out;
}

std::vector<std::byte> f32(float v) {
  std::vector<std::byte> out(4);
  std::memcpy(out.data(), &v, 4);
  return out;
}

std::vector<std::byte> bf16(std::initializer_list<uint16_t> bits) {
  std::vector<std::byte> out;
  for (uint16_t b : bits) {
    out.push_back(std::byte{static_cast<uint8_t>(b & 0xFF)});
    out.push_back(std::byte{static_cast<uint8_t>(b >> 8)});
  }
  return out;
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("weight checks: E4M3 block scales with the sign bit set or the NaN code are refused") {
  const auto problem = [](std::initializer_list<uint8_t> codes) {
    return fn::scale_problem(TensorRole::ExpertBlockScale, "w.weight_scale", DType::F8_E4M3,
                             bytes_of(codes));
  };
  CHECK(problem({0x00, 0x38, 0x7E, 0x01}).empty());           // 0, 1.0, 448, the smallest subnormal
  const std::string neg = problem({0x38, 0x38, 0xB8, 0x80});  // -1.0 and -0
  CHECK(has(neg, "tensor 'w.weight_scale': an NVFP4 block scale is negative or NaN"));
  CHECK(has(neg, "e.g. element 2 = -1 (code 0xB8) (2 of 4)"));
  CHECK(has(problem({0x7F}), "element 0 = nan (code 0x7F) (1 of 1)"));
  CHECK(has(problem({0x38, 0xFF}), "element 1 = -nan (code 0xFF) (1 of 2)"));
}

TEST_CASE("weight checks: the NVFP4 global scale must be finite and >= 0; 0 only warns") {
  const auto problem = [](float v) {
    return fn::scale_problem(TensorRole::ExpertGlobalScale, "w.weight_scale_2", DType::F32, f32(v));
  };
  CHECK(problem(0.0123f).empty());
  CHECK(problem(0.0f).empty());
  CHECK(has(problem(-0.5f),
            "tensor 'w.weight_scale_2': the NVFP4 global scale (weight_scale_2) "
            "is negative or not finite, e.g. element 0 = -0.5 (1 of 1)"));
  CHECK(!problem(-0.0f).empty());
  CHECK(!problem(std::numeric_limits<float>::quiet_NaN()).empty());
  CHECK(!problem(std::numeric_limits<float>::infinity()).empty());
  // A zero global scale over block scales that are not all zero: the tensor is erased.
  CHECK(fn::zero_global_scale_of_nonzero_tensor(0.0f, bytes_of({0x00, 0x00, 0x38})));
  CHECK_FALSE(fn::zero_global_scale_of_nonzero_tensor(0.0f, bytes_of({0x00, 0x00})));
  CHECK_FALSE(fn::zero_global_scale_of_nonzero_tensor(0.5f, bytes_of({0x38})));
}

TEST_CASE("weight checks: the PLE n-gram weight_scale must be finite and > 0") {
  const auto problem = [](uint16_t bits) {
    return fn::scale_problem(TensorRole::PleNgramScale, "ple.weight_scale", DType::BF16,
                             bf16({bits}));
  };
  CHECK(problem(0x3C00).empty());  // 2^-7
  CHECK(has(problem(0x0000),
            "tensor 'ple.weight_scale': the FP8 n-gram table's weight_scale is "
            "not a finite number > 0, e.g. element 0 = 0 (1 of 1)"));
  CHECK(has(problem(0xBF80), "element 0 = -1"));
  CHECK(has(problem(0x7FC0), "element 0 = nan"));
  CHECK(has(problem(0x7F80), "element 0 = inf"));
}

TEST_CASE("weight checks: roles that are not scales pass; require_possible_scales throws Format") {
  CHECK(
      fn::scale_problem(TensorRole::LmHead, "lm_head.weight", DType::BF16, bf16({0xBF80})).empty());
  CHECK_FALSE(fn::is_scale_role(TensorRole::ExpertInputScale));
  try {
    fn::require_possible_scales(TensorRole::ExpertGlobalScale, "x.weight_scale_2", DType::F32,
                                f32(-2.0f), "/ckpt");
    FAIL("no throw");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
    CHECK(has(e.what(), "/ckpt: tensor 'x.weight_scale_2': the NVFP4 global scale"));
  }
}

TEST_CASE("weight checks: the first non-finite value of a float tensor is named with its index") {
  CHECK(fn::nonfinite_problem("t", DType::BF16, bf16({0x3F80, 0xBF80, 0x0000})).empty());
  CHECK(fn::nonfinite_problem("t", DType::BF16, bf16({0x3F80, 0x7F80, 0x7FC0}), 100) ==
        "tensor 't': non-finite value inf at element 101");
  CHECK(fn::nonfinite_problem("t", DType::F32, f32(std::nanf(""))) ==
        "tensor 't': non-finite value nan at element 0");
  CHECK(fn::nonfinite_problem("t", DType::F8_E4M3, bytes_of({0x38, 0xFF})) ==
        "tensor 't': non-finite value -nan at element 1");
  CHECK(fn::nonfinite_problem("t", DType::U8, bytes_of({0xFF})).empty());  // not a float
}

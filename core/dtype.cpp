#include "core/dtype.h"

#include <array>
#include <utility>

namespace fn {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::size_t size;
};

constexpr std::array<DTypeInfo, 15> kDTypes{{
    {DType::Bool, "BOOL", 1},
    {DType::U8, "U8", 1},
    {DType::I8, "I8", 1},
    {DType::U16, "U16", 2},
    {DType::I16, "I16", 2},
    {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},
    {DType::U32, "U32", 4},
    {DType::I32, "I32", 4},
    {DType::F32, "F32", 4},
    {DType::U64, "U64", 8},
    {DType::I64, "I64", 8},
    {DType::F64, "F64", 8},
    {DType::F8_E4M3, "F8_E4M3", 1},
    {DType::F8_E5M2, "F8_E5M2", 1},
}};

}  // namespace

std::size_t dtype_size(DType dtype) noexcept {
  return kDTypes[static_cast<std::size_t>(dtype)].size;
}

std::string_view dtype_name(DType dtype) noexcept {
  return kDTypes[static_cast<std::size_t>(dtype)].name;
}

std::optional<DType> parse_dtype(std::string_view name) noexcept {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

}  // namespace fn

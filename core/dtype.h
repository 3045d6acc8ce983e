// Tensor element types as safetensors names them, with their sizes. Used by the safetensors
// reader/writer, the expected-tensor table (model_tensors.h) and the shard plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace fn {

/// safetensors dtypes fngen knows. Sub-byte types do not exist in safetensors: NVFP4 weights are
/// stored as U8 (two E2M1 codes per byte, low nibble first; docs/model.md §B.4).
enum class DType : uint8_t {
  Bool,
  U8,
  I8,
  U16,
  I16,
  F16,
  BF16,
  U32,
  I32,
  F32,
  U64,
  I64,
  F64,
  F8_E4M3,
  F8_E5M2,
};

/// Bytes per element (1 for U8/I8/Bool/F8_*).
std::size_t dtype_size(DType dtype) noexcept;
/// The safetensors spelling: "BF16", "F8_E4M3", "U8", ...
std::string_view dtype_name(DType dtype) noexcept;
/// Parses the safetensors spelling (exact, case-sensitive); nullopt for anything else.
std::optional<DType> parse_dtype(std::string_view name) noexcept;

}  // namespace fn

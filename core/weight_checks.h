// The value checks of a checkpoint's tensors that dtype and shape cannot catch: quantisation
// scales that no exporter writes (a negative NVFP4 global scale, an E4M3 block scale with its sign
// bit set or a NaN code, a PLE n-gram weight_scale that is not positive) and non-finite values in
// unquantised weights. One function per check, called by every backend's load
// (RankSliceReader::read/read_into, core/rank_slices.h) and by `fngen inspect`'s validation
// (core/inspect.cpp), so that what a load refuses inspect reports, in the same words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "core/dtype.h"
#include "core/model_tensors.h"

namespace fn {

/// True for the roles whose values scale others: ExpertBlockScale (F8_E4M3 [rows, K/16]),
/// ExpertGlobalScale (weight_scale_2, F32 []) and PleNgramScale (BF16 [1]).
bool is_scale_role(TensorRole role) noexcept;

/// The problem with the values of a scale tensor `tensor` of `role` (is_scale_role), or "" when
/// they are possible. `bytes` holds the tensor (or one rank's slice of it) in `dtype`. NVFP4
/// (docs/model.md §B.3): a block scale is an E4M3 code of amax/6/global, never negative (sign bit
/// set, -0 included) nor NaN (0x7F, 0xFF); the global scale weight_scale_2 is a finite number >= 0.
/// The FP8 n-gram table's weight_scale is finite and > 0 (a 0 erases the table, a negative one
/// flips it). Message: "tensor '<tensor>': <what>, e.g. element <i> = <value> (<count> of <n>)".
/// Roles that are not scales give "". Never throws.
std::string scale_problem(TensorRole role, std::string_view tensor, DType dtype,
                          std::span<const std::byte> bytes);

/// Throws fn::Error(Format) "<where>: <scale_problem>" unless scale_problem gives "".
void require_possible_scales(TensorRole role, std::string_view tensor, DType dtype,
                             std::span<const std::byte> bytes, std::string_view where);

/// True when an NVFP4 tensor whose global scale is `global_scale` dequantizes to all zeros
/// although its E4M3 `block_scales` are not all zero: a global scale of 0 for a non-zero tensor,
/// which is legal but almost surely an export bug (the caller warns).
bool zero_global_scale_of_nonzero_tensor(float global_scale,
                                         std::span<const std::byte> block_scales) noexcept;

/// The first non-finite value of an unquantised float tensor (F32, BF16, F16 or F8_E4M3 bytes)
/// in `bytes`, as "tensor '<tensor>': non-finite value <v> at element <i>", or "" when every
/// value is finite (other dtypes: ""). `first_element` is the index of bytes[0] in the tensor.
/// Never throws.
std::string nonfinite_problem(std::string_view tensor, DType dtype,
                              std::span<const std::byte> bytes, uint64_t first_element = 0);

}  // namespace fn

// Read-only access to one .safetensors file: the header is parsed and validated in full at open()
// (every rule of the safetensors spec: dtypes, shapes, offsets contiguous and covering the data
// section), then tensors are read as views into a private read-only mapping or copied by byte
// range with pread (slices touch only their own pages). Used by Checkpoint (core/checkpoint.h),
// `fngen inspect` and the backends' loaders. Every malformed input throws fn::Error(Format).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace fn {

/// One tensor entry of a safetensors header. begin/end are byte offsets within the data section
/// (the bytes after the 8-byte length and the JSON header); end - begin == nbytes().
struct TensorInfo {
  std::string name;
  DType dtype = DType::U8;
  std::vector<int64_t> shape;  ///< [] for a scalar (numel 1)
  uint64_t begin = 0;
  uint64_t end = 0;
  /// Product of shape (1 for a scalar); validated at open() to fit in int64.
  int64_t numel() const;
  /// numel() * dtype_size(dtype).
  uint64_t nbytes() const;
};

/// A validated, memory-mapped safetensors file. Move-only; the mapping and file descriptor live
/// as long as the object. The const read functions may be called from several threads at once
/// (pread has no shared file position).
class SafetensorsFile {
 public:
  /// Opens, maps (PROT_READ, MAP_PRIVATE) and validates `path`. Throws fn::Error(Io) if the file
  /// cannot be opened or mapped, fn::Error(Format) naming the file (and tensor) for: a file
  /// shorter than 8 bytes; a header length past the end of the file or over 100 MB; a header that
  /// is not a JSON object or has a duplicate key; `__metadata__` not an object of strings; an
  /// entry that is not an object with a known `dtype`, a `shape` of non-negative integers whose
  /// element count fits int64, and `data_offsets` [begin, end] of non-negative integers with
  /// begin <= end <= data size and end - begin == numel * dtype size; offsets that overlap,
  /// leave a gap, or do not cover the data section exactly.
  static SafetensorsFile open(const std::filesystem::path& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  /// Tensors in ascending data offset order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// The tensor of that name, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  const std::filesystem::path& path() const { return path_; }
  /// `__metadata__` (empty if absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Bytes in the data section (the file size minus 8 minus the header length).
  uint64_t data_size() const { return data_size_; }

  /// The tensor's bytes as a view into the mapping (no copy; pages are read on first touch).
  /// `t` must come from this file (fn::Error(Usage) otherwise).
  std::span<const std::byte> bytes(const TensorInfo& t) const;
  /// Copies rows [row_begin, row_begin + row_count) of the first dimension (the whole scalar for
  /// a 0-d tensor with row 0 of 1) into dst (row_count * row bytes). A 1-D tensor's rows are its
  /// elements. Throws fn::Error(Usage) naming the tensor for out-of-range rows.
  void read_rows(const TensorInfo& t, int64_t row_begin, int64_t row_count, void* dst) const;
  /// Copies the block rows [row_begin, +row_count) x columns [col_begin, +col_count) of a 2-D
  /// tensor into dst, densely ([row_count, col_count]). Columns count stored elements (for an
  /// NVFP4 U8 weight one column is one packed byte = two E2M1 codes). A block of a quarter of
  /// each row or more (a tensor-parallel column shard) is read in spans of up to 8 MiB of whole
  /// rows, a narrower one with one pread per row.
  /// Throws fn::Error(Usage) naming the tensor if it is not 2-D or the block is out of range.
  void read_block(const TensorInfo& t, int64_t row_begin, int64_t row_count, int64_t col_begin,
                  int64_t col_count, void* dst) const;
  /// Copies slice i of the first dimension (one expert of a fused [E, ...] tensor) into dst
  /// (nbytes / shape[0] bytes). Same as read_rows(t, i, 1, dst).
  void read_index0(const TensorInfo& t, int64_t i, void* dst) const;
  /// Copies the whole tensor into dst (nbytes bytes).
  void read_all(const TensorInfo& t, void* dst) const;

 private:
  SafetensorsFile() = default;
  void check_owned(const TensorInfo& t) const;
  void pread_exact(uint64_t data_offset, uint64_t n, void* dst, const TensorInfo& t) const;

  std::filesystem::path path_;
  int fd_ = -1;
  const std::byte* map_ = nullptr;
  uint64_t file_size_ = 0;
  uint64_t data_start_ = 0;  ///< 8 + header length
  uint64_t data_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace fn

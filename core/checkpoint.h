// A model directory's safetensors tensors behind one name lookup: `model.safetensors.index.json`
// (sharded), else `model.safetensors`, else every `*.safetensors` in the directory. Opening
// validates every file (SafetensorsFile::open) and the index against the files: each name lives in
// exactly one file and the index agrees. Used by config validation, the shard plan, `fngen
// inspect` and the backends' loaders; reads copy only the requested byte ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/safetensors.h"

namespace fn {

/// The tensors of one checkpoint directory (docs/model.md §B.1: always resolved through the index).
class Checkpoint {
 public:
  /// Opens `dir`. Throws fn::Error(Io) if dir is not a directory, a file cannot be opened, the
  /// index names a missing file (naming the index and the file), or no safetensors file exists;
  /// fn::Error(Format) for an index that is not JSON or has wrong types (`weight_map` an object
  /// of name -> file-name strings, `metadata` an object if present), a file name with a '/' or NUL,
  /// a tensor of the index absent from its file, a file tensor missing from the index, the same
  /// tensor in two files (naming both), and every error of SafetensorsFile::open.
  static Checkpoint open(const std::filesystem::path& dir);

  Checkpoint(Checkpoint&&) noexcept = default;
  Checkpoint& operator=(Checkpoint&&) noexcept = default;
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  /// The tensor of that name, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  /// The file holding `name`; throws fn::Error(Format) naming the tensor if it is absent.
  const SafetensorsFile& file_of(std::string_view name) const;
  /// The tensor of that name; throws fn::Error(Format) naming the tensor if it is absent.
  const TensorInfo& info(std::string_view name) const;
  /// Every tensor name, sorted.
  std::vector<std::string> tensor_names() const;
  /// Sum of nbytes() over all tensors.
  uint64_t total_bytes() const { return total_bytes_; }
  /// Number of safetensors files opened.
  std::size_t file_count() const { return files_.size(); }
  /// The opened files (index order of first reference, or sorted file names).
  const std::vector<SafetensorsFile>& files() const { return files_; }
  /// The directory given to open().
  const std::filesystem::path& dir() const { return dir_; }
  /// The index's `metadata` object as JSON text ("{}" without an index or metadata).
  const std::string& index_metadata_json() const { return index_metadata_json_; }

  /// SafetensorsFile::read_rows of the named tensor (fn::Error(Format) if absent).
  void read_rows(std::string_view name, int64_t row_begin, int64_t row_count, void* dst) const;
  /// SafetensorsFile::read_block of the named 2-D tensor.
  void read_block(std::string_view name, int64_t row_begin, int64_t row_count, int64_t col_begin,
                  int64_t col_count, void* dst) const;
  /// SafetensorsFile::read_index0: slice i of the first dimension.
  void read_index0(std::string_view name, int64_t i, void* dst) const;
  /// The whole tensor (nbytes bytes) into dst.
  void read_all(std::string_view name, void* dst) const;

 private:
  Checkpoint() = default;
  struct Location {
    std::size_t file;
    const TensorInfo* info;  // points into files_[file].tensors(), stable across moves
  };
  const Location& locate(std::string_view name) const;

  std::filesystem::path dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, Location, std::less<>> tensors_;
  uint64_t total_bytes_ = 0;
  std::string index_metadata_json_ = "{}";
};

}  // namespace fn

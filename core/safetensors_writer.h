// Streaming writer of one .safetensors file, for `fngen synth` and test fixtures. Tensors are
// declared first (name, dtype, shape, fill callback), then write() emits the header and calls each
// fill in insertion order with a buffer of exactly that tensor's bytes, so at most one tensor
// (plus an 8 MB staging buffer) is in memory. Output goes to a staging file of its own beside PATH
// (create_staging_file, core/paths.h) renamed to PATH only after everything was written: on any
// error no partial file remains, and two writers of one PATH never share a staging file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace fn {

/// Collects tensor declarations and writes them as one safetensors file.
class SafetensorsWriter {
 public:
  /// Fills the tensor's bytes (little-endian, row-major); the span has exactly nbytes bytes and
  /// must be written in full (its prior contents are unspecified). An empty Fill writes zeros.
  using Fill = std::function<void(std::span<std::byte>)>;

  /// Declares a tensor. Throws fn::Error(Usage) for an empty or duplicate name, the name
  /// "__metadata__", a negative dimension, or a byte size that overflows.
  void add(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill);
  /// Sets one `__metadata__` string entry (e.g. "format" -> "pt").
  void set_metadata(std::string key, std::string value);
  /// Writes the file: 8-byte little-endian header length, the JSON header padded with spaces to a
  /// multiple of 8, then the tensors contiguously in insertion order. Returns the bytes written
  /// (the file size). Throws fn::Error(Io) naming the path on any write/rename failure; an
  /// exception from a fill callback propagates. Either way the staging file is removed.
  uint64_t write(const std::filesystem::path& path);
  /// Number of tensors declared so far.
  std::size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    uint64_t nbytes;
    Fill fill;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::size_t> names_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace fn

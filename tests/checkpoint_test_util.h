// Helpers for the safetensors/checkpoint tests: a self-deleting temp directory, raw file writes
// (for hand-crafted malformed files) and an error matcher that checks the kind and that the
// message names the file/tensor at fault.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"

namespace fn::testing {

/// A fresh directory, removed with its contents on destruction.
class TempDir {
 public:
  /// Under `base`, or the system temp dir when base is empty.
  explicit TempDir(const std::filesystem::path& base = {}) {
    static std::atomic<int> counter{0};
    path_ = (base.empty() ? std::filesystem::temp_directory_path() : base) /
            ("fn_ckpt_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

/// /dev/shm when it is a writable directory (RAM-backed: tests that rewrite files thousands of
/// times run 20x faster there than on a disk-backed /tmp), else empty (the system temp dir).
inline std::filesystem::path fast_temp_base() {
  std::error_code ec;
  if (std::filesystem::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0) {
    return "/dev/shm";
  }
  return {};
}

inline void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

/// An 8-byte little-endian length followed by `header` and `data` (no padding).
inline std::string raw_safetensors(const std::string& header, const std::string& data,
                                   uint64_t header_len_override = UINT64_MAX) {
  const uint64_t n = header_len_override == UINT64_MAX ? header.size() : header_len_override;
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

/// Runs f, requires an fn::Error of `kind` whose message contains every string of `parts`.
template <class F>
void check_error(F&& f, fn::ErrorKind kind, const std::vector<std::string>& parts) {
  try {
    f();
    FAIL("no fn::Error thrown");
  } catch (const fn::Error& e) {
    const std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(fn::error_kind_name(e.kind()) == std::string(fn::error_kind_name(kind)));
    for (const std::string& p : parts) {
      INFO("expected in message: " << p);
      CHECK(msg.find(p) != std::string::npos);
    }
  }
}

}  // namespace fn::testing

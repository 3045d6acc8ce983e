#include "core/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/ranges.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/paths.h"

namespace fn {
namespace {

constexpr std::size_t kStagingBytes = 8u << 20;  // batch small tensors into 8 MB writes

// Owns the staging file (create_staging_file) until commit(): closes and unlinks it on
// destruction otherwise.
class TmpFile {
 public:
  explicit TmpFile(const std::filesystem::path& final_path) {
    StagingFile s = create_staging_file(final_path);
    fd_ = s.fd;
    path_ = std::move(s.path);
  }
  TmpFile(const TmpFile&) = delete;
  TmpFile& operator=(const TmpFile&) = delete;
  ~TmpFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) {
      std::error_code ec;
      std::filesystem::remove(path_, ec);
    }
  }
  void write_all(const std::byte* p, std::size_t n) {
    while (n > 0) {
      const ssize_t got = ::write(fd_, p, std::min<std::size_t>(n, 1u << 30));
      if (got < 0 && errno == EINTR) continue;
      FN_REQUIRE(got > 0, Io, "write to '{}' failed: {}", path_.string(),
                 got < 0 ? std::strerror(errno) : "no progress");
      p += got;
      n -= static_cast<std::size_t>(got);
    }
  }
  void commit(const std::filesystem::path& final_path) {
    const int rc = ::close(fd_);
    fd_ = -1;
    FN_REQUIRE(rc == 0, Io, "closing '{}' failed: {}", path_.string(), std::strerror(errno));
    std::error_code ec;
    std::filesystem::rename(path_, final_path, ec);
    FN_REQUIRE(!ec, Io, "renaming '{}' to '{}' failed: {}", path_.string(), final_path.string(),
               ec.message());
    committed_ = true;
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill) {
  FN_REQUIRE(!name.empty(), Usage, "safetensors writer: empty tensor name");
  FN_REQUIRE(name != "__metadata__", Usage, "safetensors writer: '__metadata__' is reserved");
  FN_REQUIRE(!names_.count(name), Usage, "safetensors writer: tensor '{}' added twice", name);
  try {
    (void)nlohmann::json(name).dump();
  } catch (const nlohmann::json::exception&) {
    FN_THROW(Usage, "safetensors writer: tensor name '{}' is not valid UTF-8", name);
  }
  int64_t n = static_cast<int64_t>(dtype_size(dtype));
  for (int64_t d : shape) {
    FN_REQUIRE(d >= 0, Usage, "safetensors writer: tensor '{}' has negative dimension {}", name, d);
    FN_REQUIRE(!__builtin_mul_overflow(n, d, &n), Usage,
               "safetensors writer: tensor '{}' byte size overflows", name);
  }
  names_.emplace(name, entries_.size());
  entries_.push_back(
      Entry{std::move(name), dtype, std::move(shape), static_cast<uint64_t>(n), std::move(fill)});
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

uint64_t SafetensorsWriter::write(const std::filesystem::path& path) {
  // The header is assembled as text, entry by entry, in insertion order (nlohmann's
  // ordered_json would keep the order too, but finds keys by linear search: O(n^2)).
  std::string text = "{";
  if (!metadata_.empty()) text += "\"__metadata__\":" + nlohmann::json(metadata_).dump();
  uint64_t offset = 0;
  for (const Entry& e : entries_) {
    if (text.size() > 1) text += ',';
    text += nlohmann::json(e.name).dump();
    text += fmt::format(R"(:{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}})",
                        dtype_name(e.dtype), fmt::join(e.shape, ","), offset, offset + e.nbytes);
    offset += e.nbytes;
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');

  TmpFile out(path);
  std::vector<std::byte> staging;
  staging.reserve(kStagingBytes);
  const auto flush = [&] {
    out.write_all(staging.data(), staging.size());
    staging.clear();
  };
  std::byte len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::byte>((text.size() >> (8 * i)) & 0xFF);
  staging.insert(staging.end(), len, len + 8);
  const auto* hp = reinterpret_cast<const std::byte*>(text.data());
  if (text.size() + 8 > kStagingBytes) {
    flush();
    out.write_all(hp, text.size());
  } else {
    staging.insert(staging.end(), hp, hp + text.size());
  }

  std::vector<std::byte> big;
  for (Entry& e : entries_) {
    if (e.nbytes <= kStagingBytes) {
      if (staging.size() + e.nbytes > kStagingBytes) flush();
      const std::size_t at = staging.size();
      staging.resize(at + e.nbytes);
      if (e.fill) e.fill(std::span<std::byte>(staging.data() + at, e.nbytes));
    } else {
      flush();
      big.resize(e.nbytes);
      if (e.fill) {
        e.fill(std::span<std::byte>(big.data(), big.size()));
      } else {
        std::fill(big.begin(), big.end(), std::byte{0});
      }
      out.write_all(big.data(), big.size());
    }
  }
  flush();
  out.commit(path);
  return 8 + text.size() + offset;
}

}  // namespace fn

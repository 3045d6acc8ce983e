#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/ranges.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "core/error.h"

namespace fn {

namespace {

/// Largest span read_block reads in one pread when it coalesces the rows of a column shard.
constexpr uint64_t kCoalesceChunk = 8u << 20;

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;  // safetensors' own limit (100 MB)

// a * b, or false when it overflows int64 (a, b >= 0).
bool mul_fits(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out) && *out >= 0;
}

// SAX handler that records the first key repeated at the top level of a JSON object.
struct TopLevelKeys : nlohmann::json_sax<nlohmann::json> {
  int depth = 0;
  std::set<std::string, std::less<>> seen;
  std::string duplicate;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return ++depth, true; }
  bool end_object() override { return --depth, true; }
  bool start_array(std::size_t) override { return ++depth, true; }
  bool end_array() override { return --depth, true; }
  bool key(string_t& k) override {
    if (depth == 1 && !seen.insert(k).second && duplicate.empty()) duplicate = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }
};

std::string shape_str(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated at open() not to overflow
  return n;
}

uint64_t TensorInfo::nbytes() const {
  return static_cast<uint64_t>(numel()) * dtype_size(dtype);
}

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  SafetensorsFile f;
  f.path_ = path;
  const std::string file = path.string();
  // O_NONBLOCK: a FIFO returns from open() at once (and is refused below) instead of blocking.
  f.fd_ = ::open(file.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  FN_REQUIRE(f.fd_ >= 0, Io, "safetensors file '{}': cannot open: {}", file, std::strerror(errno));
  struct stat st {};
  FN_REQUIRE(::fstat(f.fd_, &st) == 0, Io, "safetensors file '{}': cannot stat: {}", file,
             std::strerror(errno));
  FN_REQUIRE(S_ISREG(st.st_mode), Io, "safetensors file '{}': not a regular file", file);
  f.file_size_ = static_cast<uint64_t>(st.st_size);
  FN_REQUIRE(f.file_size_ >= 8, Format,
             "safetensors file '{}': {} bytes is shorter than the 8-byte header length", file,
             f.file_size_);

  void* m = ::mmap(nullptr, f.file_size_, PROT_READ, MAP_PRIVATE, f.fd_, 0);
  FN_REQUIRE(m != MAP_FAILED, Io, "safetensors file '{}': mmap of {} bytes failed: {}", file,
             f.file_size_, std::strerror(errno));
  f.map_ = static_cast<const std::byte*>(m);
  // Loads read scattered slices: no read-ahead of pages nobody asked for, through the mapping
  // or through pread on the descriptor.
  ::madvise(m, f.file_size_, MADV_RANDOM);
  ::posix_fadvise(f.fd_, 0, 0, POSIX_FADV_RANDOM);

  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) {
    header_len |= static_cast<uint64_t>(std::to_integer<uint8_t>(f.map_[i])) << (8 * i);
  }
  FN_REQUIRE(header_len <= kMaxHeaderBytes, Format,
             "safetensors file '{}': header length {} is larger than the 100 MB limit", file,
             header_len);
  FN_REQUIRE(header_len <= f.file_size_ - 8, Format,
             "safetensors file '{}': header length {} runs past the end of the file ({} bytes)",
             file, header_len, f.file_size_);
  f.data_start_ = 8 + header_len;
  f.data_size_ = f.file_size_ - f.data_start_;

  // Parse. A DOM object keeps only the last of duplicate keys, so a SAX pre-pass finds them
  // (nlohmann's parser_callback_t would do it too, but costs O(n^2) in the number of keys).
  const char* text = reinterpret_cast<const char*>(f.map_ + 8);
  nlohmann::json header;
  std::string duplicate;
  try {
    header = nlohmann::json::parse(text, text + header_len);
    if (header.is_object()) {
      TopLevelKeys keys;
      nlohmann::json::sax_parse(text, text + header_len, &keys);
      duplicate = keys.duplicate;
    }
  } catch (const nlohmann::json::exception& e) {
    FN_THROW(Format, "safetensors file '{}': header is not valid JSON: {}", file, e.what());
  }
  FN_REQUIRE(header.is_object(), Format,
             "safetensors file '{}': header is a JSON {}, not an object", file, header.type_name());
  FN_REQUIRE(duplicate.empty(), Format, "safetensors file '{}': header names '{}' twice", file,
             duplicate);

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      FN_REQUIRE(entry.is_object(), Format,
                 "safetensors file '{}': __metadata__ is a JSON {}, not an object", file,
                 entry.type_name());
      for (const auto& [key, value] : entry.items()) {
        FN_REQUIRE(value.is_string(), Format,
                   "safetensors file '{}': __metadata__ field '{}' is a JSON {}, not a string",
                   file, key, value.type_name());
        f.metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    FN_REQUIRE(entry.is_object(), Format,
               "safetensors file '{}': tensor '{}': entry is a JSON {}, not an object", file, name,
               entry.type_name());
    TensorInfo t;
    t.name = name;

    const auto dt = entry.find("dtype");
    FN_REQUIRE(dt != entry.end(), Format, "safetensors file '{}': tensor '{}': no dtype", file,
               name);
    FN_REQUIRE(dt->is_string(), Format,
               "safetensors file '{}': tensor '{}': dtype is a JSON {}, not a string", file, name,
               dt->type_name());
    const auto parsed_dtype = parse_dtype(dt->get_ref<const std::string&>());
    FN_REQUIRE(parsed_dtype.has_value(), Format,
               "safetensors file '{}': tensor '{}': unknown dtype '{}'", file, name,
               dt->get_ref<const std::string&>());
    t.dtype = *parsed_dtype;

    const auto sh = entry.find("shape");
    FN_REQUIRE(sh != entry.end(), Format, "safetensors file '{}': tensor '{}': no shape", file,
               name);
    FN_REQUIRE(sh->is_array(), Format,
               "safetensors file '{}': tensor '{}': shape is a JSON {}, not an array", file, name,
               sh->type_name());
    int64_t numel = 1;
    for (const auto& d : *sh) {
      FN_REQUIRE(d.is_number_integer(), Format,
                 "safetensors file '{}': tensor '{}': shape entry {} is not an integer", file, name,
                 d.dump());
      FN_REQUIRE(d.is_number_unsigned(), Format,
                 "safetensors file '{}': tensor '{}': shape entry {} is negative", file, name,
                 d.dump());
      const uint64_t u = d.get<uint64_t>();
      FN_REQUIRE(u <= static_cast<uint64_t>(INT64_MAX), Format,
                 "safetensors file '{}': tensor '{}': shape entry {} is too large", file, name, u);
      t.shape.push_back(static_cast<int64_t>(u));
      FN_REQUIRE(mul_fits(numel, t.shape.back(), &numel), Format,
                 "safetensors file '{}': tensor '{}': element count of shape {} overflows", file,
                 name, sh->dump());
    }
    int64_t nbytes = 0;
    FN_REQUIRE(mul_fits(numel, static_cast<int64_t>(dtype_size(t.dtype)), &nbytes), Format,
               "safetensors file '{}': tensor '{}': byte size of shape {} overflows", file, name,
               sh->dump());

    const auto off = entry.find("data_offsets");
    FN_REQUIRE(off != entry.end(), Format, "safetensors file '{}': tensor '{}': no data_offsets",
               file, name);
    FN_REQUIRE(off->is_array() && off->size() == 2, Format,
               "safetensors file '{}': tensor '{}': data_offsets {} is not a pair [begin, end]",
               file, name, off->dump());
    for (const auto& o : *off) {
      FN_REQUIRE(o.is_number_integer(), Format,
                 "safetensors file '{}': tensor '{}': data_offsets entry {} is not an integer",
                 file, name, o.dump());
      FN_REQUIRE(o.is_number_unsigned(), Format,
                 "safetensors file '{}': tensor '{}': data_offsets entry {} is negative", file,
                 name, o.dump());
    }
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    FN_REQUIRE(t.begin <= t.end, Format,
               "safetensors file '{}': tensor '{}': data_offsets [{}, {}] are out of order", file,
               name, t.begin, t.end);
    FN_REQUIRE(t.end <= f.data_size_, Format,
               "safetensors file '{}': tensor '{}': data_offsets end {} is past the end of the "
               "data section ({} bytes)",
               file, name, t.end, f.data_size_);
    FN_REQUIRE(t.end - t.begin == static_cast<uint64_t>(nbytes), Format,
               "safetensors file '{}': tensor '{}': data_offsets cover {} bytes but {} {} needs "
               "{}",
               file, name, t.end - t.begin, dtype_name(t.dtype), shape_str(t.shape), nbytes);
    f.tensors_.push_back(std::move(t));
  }

  // The spec: sorted by offset, the tensors tile the data section with no gap and no overlap.
  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t cursor = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : f.tensors_) {
    FN_REQUIRE(t.begin >= cursor, Format,
               "safetensors file '{}': tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes "
               "[{}, {}))",
               file, t.name, t.begin, t.end, prev ? prev->name : "", prev ? prev->begin : 0,
               cursor);
    FN_REQUIRE(t.begin == cursor, Format,
               "safetensors file '{}': tensor '{}' starts at byte {} leaving a gap after byte {}",
               file, t.name, t.begin, cursor);
    cursor = t.end;
    prev = &t;
  }
  FN_REQUIRE(cursor == f.data_size_, Format,
             "safetensors file '{}': tensors cover {} bytes but the data section has {} (trailing "
             "bytes)",
             file, cursor, f.data_size_);
  for (std::size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept {
  *this = std::move(other);
}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this == &other) return *this;
  if (map_) ::munmap(const_cast<std::byte*>(map_), file_size_);
  if (fd_ >= 0) ::close(fd_);
  path_ = std::move(other.path_);
  fd_ = std::exchange(other.fd_, -1);
  map_ = std::exchange(other.map_, nullptr);
  file_size_ = std::exchange(other.file_size_, 0);
  data_start_ = std::exchange(other.data_start_, 0);
  data_size_ = std::exchange(other.data_size_, 0);
  tensors_ = std::move(other.tensors_);
  index_ = std::move(other.index_);
  metadata_ = std::move(other.metadata_);
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(const_cast<std::byte*>(map_), file_size_);
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::check_owned(const TensorInfo& t) const {
  const auto it = index_.find(t.name);
  FN_REQUIRE(it != index_.end() && &tensors_[it->second] == &t, Usage,
             "tensor '{}' does not belong to safetensors file '{}'", t.name, path_.string());
}

void SafetensorsFile::pread_exact(uint64_t data_offset, uint64_t n, void* dst,
                                  const TensorInfo& t) const {
  auto* out = static_cast<char*>(dst);
  uint64_t pos = data_start_ + data_offset;
  while (n > 0) {
    const ssize_t got =
        ::pread(fd_, out, std::min<uint64_t>(n, 1ull << 30), static_cast<off_t>(pos));
    if (got < 0 && errno == EINTR) continue;
    FN_REQUIRE(got > 0, Io, "safetensors file '{}': tensor '{}': read of {} bytes at {} failed: {}",
               path_.string(), t.name, n, pos, got < 0 ? std::strerror(errno) : "end of file");
    out += got;
    pos += static_cast<uint64_t>(got);
    n -= static_cast<uint64_t>(got);
  }
}

std::span<const std::byte> SafetensorsFile::bytes(const TensorInfo& t) const {
  check_owned(t);
  return {map_ + data_start_ + t.begin, static_cast<std::size_t>(t.end - t.begin)};
}

void SafetensorsFile::read_rows(const TensorInfo& t, int64_t row_begin, int64_t row_count,
                                void* dst) const {
  check_owned(t);
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  FN_REQUIRE(row_begin >= 0 && row_count >= 0 && row_begin <= rows && row_count <= rows - row_begin,
             Usage, "tensor '{}' in '{}': rows [{}, +{}) outside its {} rows (shape {})", t.name,
             path_.string(), row_begin, row_count, rows, shape_str(t.shape));
  if (row_count == 0) return;
  const uint64_t row_bytes = t.nbytes() / static_cast<uint64_t>(rows);
  pread_exact(t.begin + static_cast<uint64_t>(row_begin) * row_bytes,
              static_cast<uint64_t>(row_count) * row_bytes, dst, t);
}

void SafetensorsFile::read_block(const TensorInfo& t, int64_t row_begin, int64_t row_count,
                                 int64_t col_begin, int64_t col_count, void* dst) const {
  check_owned(t);
  FN_REQUIRE(t.shape.size() == 2, Usage,
             "tensor '{}' in '{}': a column block needs a 2-D tensor, shape is {}", t.name,
             path_.string(), shape_str(t.shape));
  const int64_t rows = t.shape[0], cols = t.shape[1];
  FN_REQUIRE(
      row_begin >= 0 && row_count >= 0 && row_begin <= rows && row_count <= rows - row_begin &&
          col_begin >= 0 && col_count >= 0 && col_begin <= cols && col_count <= cols - col_begin,
      Usage, "tensor '{}' in '{}': block rows [{}, +{}) x cols [{}, +{}) outside shape {}", t.name,
      path_.string(), row_begin, row_count, col_begin, col_count, shape_str(t.shape));
  if (row_count == 0 || col_count == 0) return;
  const uint64_t es = dtype_size(t.dtype);
  const uint64_t row_bytes = static_cast<uint64_t>(cols) * es;
  const uint64_t block_row_bytes = static_cast<uint64_t>(col_count) * es;
  if (col_begin == 0 && col_count == cols) {
    read_rows(t, row_begin, row_count, dst);
    return;
  }
  auto* out = static_cast<char*>(dst);
  const uint64_t col_offset = static_cast<uint64_t>(col_begin) * es;
  if (block_row_bytes * 4 < row_bytes || block_row_bytes >= kCoalesceChunk) {
    // A narrow block of wide rows, or rows big enough on their own: one pread per row.
    for (int64_t r = 0; r < row_count; ++r) {
      pread_exact(t.begin + static_cast<uint64_t>(row_begin + r) * row_bytes + col_offset,
                  block_row_bytes, out + static_cast<uint64_t>(r) * block_row_bytes, t);
    }
    return;
  }
  // A tensor-parallel column shard (a quarter of each row or more): read the span covering a
  // group of rows in one pread and copy the block out of it, instead of one small pread per row
  // (an expert's down_proj at TP=2 has 2,560 rows of 160 bytes).
  thread_local std::vector<char> span;
  const int64_t group = std::max<int64_t>(1, static_cast<int64_t>(kCoalesceChunk / row_bytes));
  for (int64_t r0 = 0; r0 < row_count; r0 += group) {
    const int64_t n = std::min(group, row_count - r0);
    const uint64_t bytes = static_cast<uint64_t>(n - 1) * row_bytes + block_row_bytes;
    span.resize(bytes);
    pread_exact(t.begin + static_cast<uint64_t>(row_begin + r0) * row_bytes + col_offset, bytes,
                span.data(), t);
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(out + static_cast<uint64_t>(r0 + r) * block_row_bytes,
                  span.data() + static_cast<uint64_t>(r) * row_bytes, block_row_bytes);
    }
  }
}

void SafetensorsFile::read_index0(const TensorInfo& t, int64_t i, void* dst) const {
  check_owned(t);
  FN_REQUIRE(!t.shape.empty(), Usage, "tensor '{}' in '{}': a scalar has no first dimension",
             t.name, path_.string());
  read_rows(t, i, 1, dst);
}

void SafetensorsFile::read_all(const TensorInfo& t, void* dst) const {
  check_owned(t);
  if (t.end > t.begin) pread_exact(t.begin, t.end - t.begin, dst, t);
}

}  // namespace fn

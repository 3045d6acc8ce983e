// Filesystem path helpers (core/paths.h).
#include "core/paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <system_error>

#include "core/error.h"

namespace fn {

namespace fs = std::filesystem;

namespace {

// Symlinks followed from `p` (already absolute) before resolve_output_path gives up: a loop.
constexpr int kMaxLinkHops = 40;

}  // namespace

fs::path resolve_output_path(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  if (ec) return fs::path(path).lexically_normal();
  for (int hop = 0; hop < kMaxLinkHops; ++hop) {
    if (p.filename().empty() || p.filename() == "." || p.filename() == "..") {
      const fs::path c = fs::weakly_canonical(p, ec);
      return ec ? p.lexically_normal() : c;
    }
    // The directory part: symlinks and ".." resolved where it exists.
    const fs::path parent = fs::weakly_canonical(p.parent_path(), ec);
    if (ec) return p.lexically_normal();
    p = parent / p.filename();
    // The last part: a symlink, even a dangling one (fopen "wb" creates its target).
    if (!fs::is_symlink(fs::symlink_status(p, ec))) break;
    const fs::path target = fs::read_symlink(p, ec);
    if (ec) break;
    p = target.is_absolute() ? target : parent / target;
  }
  return p.lexically_normal();
}

namespace {

// "is not a regular file (a directory)" and so on, for the message of read_regular_file.
const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a plain file";
}

}  // namespace

std::string read_regular_file(const fs::path& path, uint64_t max_bytes, std::string_view what) {
  const std::string name = what.empty() ? path.string() : fmt::format("{} {}", what, path.string());
  struct stat st {};
  FN_REQUIRE(::stat(path.c_str(), &st) == 0, Io, "{}: cannot open file ({})", name,
             std::strerror(errno));
  FN_REQUIRE(S_ISREG(st.st_mode), Io, "{}: is not a regular file ({})", name,
             file_kind(st.st_mode));
  // O_NONBLOCK: a FIFO put there after the stat returns from open() at once instead of waiting
  // for a writer; the fstat below then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  FN_REQUIRE(fd >= 0, Io, "{}: cannot open file ({})", name, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  FN_REQUIRE(::fstat(fd, &st) == 0, Io, "{}: cannot stat ({})", name, std::strerror(errno));
  FN_REQUIRE(S_ISREG(st.st_mode), Io, "{}: is not a regular file ({})", name,
             file_kind(st.st_mode));
  const auto too_large = [&](uint64_t bytes) {
    FN_THROW(Io, "{}: {} bytes, more than the {} such a file may have: not the right file", name,
             bytes,
             max_bytes >= (uint64_t{1} << 20) ? fmt::format("{} MiB", max_bytes >> 20)
                                              : fmt::format("{} bytes", max_bytes));
  };
  if (static_cast<uint64_t>(st.st_size) > max_bytes) too_large(static_cast<uint64_t>(st.st_size));
  std::string out(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  for (;;) {
    if (got == out.size()) {
      // The file may have grown since the fstat: read on, up to one byte past the cap.
      if (got > max_bytes) too_large(got);
      out.resize(std::min<uint64_t>(max_bytes + 1, got + (uint64_t{1} << 20)));
    }
    const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    FN_REQUIRE(n >= 0, Io, "{}: read failed ({})", name, std::strerror(errno));
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got > max_bytes) too_large(got);
  out.resize(got);
  return out;
}

namespace {

// "<final_path>.partial.<pid>.<16 hex digits>", a name no other writer draws.
fs::path staging_name(const fs::path& final_path) {
  thread_local std::mt19937_64 rng{std::random_device{}() ^
                                   (static_cast<uint64_t>(::getpid()) << 32)};
  fs::path p = final_path;
  p += fmt::format("{}.{}.{:016x}", kStagingSuffix, ::getpid(), rng());
  return p;
}

}  // namespace

fs::path create_staging_directory(const fs::path& final_path) {
  for (int attempt = 0;; ++attempt) {
    fs::path p = staging_name(final_path);
    if (::mkdir(p.c_str(), 0777) == 0) return p;
    const int err = errno;
    FN_REQUIRE(err == EEXIST && attempt < 8, Io, "cannot create the staging directory {} ({})",
               p.string(), std::strerror(err));
  }
}

StagingFile create_staging_file(const fs::path& final_path) {
  StagingFile s;
  for (int attempt = 0;; ++attempt) {
    s.path = staging_name(final_path);
    s.fd = ::open(s.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (s.fd >= 0) return s;
    const int err = errno;
    // A name that exists already (64 random bits: practically never) is drawn again.
    FN_REQUIRE(err == EEXIST && attempt < 8, Io, "cannot create the staging file {} ({})",
               s.path.string(), std::strerror(err));
  }
}

}  // namespace fn

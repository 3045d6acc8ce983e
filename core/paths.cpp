// Filesystem path helpers (core/paths.h).
#include "core/paths.h"

#include <system_error>

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

}  // namespace fn

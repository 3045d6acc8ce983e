// Filesystem path helpers shared by the apps and the core writers.
#pragma once

#include <filesystem>
#include <string>

namespace fn {

/// Where writing the output file `path` would land: absolute, normalised, every symlink followed,
/// also a dangling one (opening it for writing creates its target) and one in a directory part.
/// A link chain longer than 40 (a loop) is left where it stops, so a result that is still a
/// symlink means a loop. Never throws (a path it cannot resolve comes back normalised).
std::filesystem::path resolve_output_path(const std::string& path);

}  // namespace fn

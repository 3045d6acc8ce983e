// Filesystem helpers shared by the apps, the loaders and the core writers: where an output path
// lands, the one guarded read of an input file (never a device, FIFO or directory, never more
// than a cap) and the one staging-file creation of every writer that renames its file into place.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace fn {

/// Where writing the output file `path` would land: absolute, normalised, every symlink followed,
/// also a dangling one (opening it for writing creates its target) and one in a directory part.
/// A link chain longer than 40 (a loop) is left where it stops, so a result that is still a
/// symlink means a loop. Never throws (a path it cannot resolve comes back normalised).
std::filesystem::path resolve_output_path(const std::string& path);

/// Largest JSON file of a checkpoint read_regular_file accepts (config.json,
/// generation_config.json, model.safetensors.index.json, hf_quant_config.json): the real ones are
/// a few MiB at most.
inline constexpr uint64_t kMaxCheckpointJsonBytes = uint64_t{64} << 20;

/// Largest tokenizer file read (real ones: 11 MB for Qwen3's tokenizer.json, 4 MB for a
/// SentencePiece model).
inline constexpr uint64_t kMaxTokenizerFileBytes = uint64_t{1} << 30;

/// The whole content of the regular file `path`, read through one guarded open: `path` (symlinks
/// followed) must be a regular file before the open, the open is O_NONBLOCK (a FIFO swapped in
/// meanwhile cannot block it) and the descriptor is checked again with fstat; a file larger than
/// `max_bytes` is refused before anything is read, and the read stops at `max_bytes` + 1 bytes
/// should the file grow. `what` names the kind of file before the path in messages ("tokenizer
/// file"; empty: the path alone). Throws fn::Error(Io) "[<what> ]<path>: ..." when it does not
/// exist or cannot be opened or read, when it is a directory, a device, a FIFO or a socket ("is not
/// a regular file") and when it is larger than max_bytes.
std::string read_regular_file(const std::filesystem::path& path, uint64_t max_bytes,
                              std::string_view what);

/// A staging file created for a writer that renames its result onto `final_path`.
struct StagingFile {
  int fd = -1;                 ///< open for writing (O_WRONLY | O_CLOEXEC); the caller closes it
  std::filesystem::path path;  ///< "<final_path>.partial.<pid>.<16 hex digits>"
};

/// The staging suffix every staged writer uses before its unique part (".partial").
inline constexpr const char* kStagingSuffix = ".partial";

/// Creates a new, empty staging file beside `final_path` (same directory, so that the rename
/// stays on one file system): "<final_path>.partial.<pid>.<random 64-bit hex>", opened with
/// O_CREAT | O_EXCL (never an existing file or a symlink), mode 0666 before the umask. Two
/// writers of the same final path, in one process or several, never share a staging file, so
/// the one whose rename lands last is the one whose data the file holds. Returns the descriptor
/// and the name; throws fn::Error(Io) "cannot create the staging file <name> (<reason>)" when the
/// directory refuses it (after retrying a name that happens to exist).
StagingFile create_staging_file(const std::filesystem::path& final_path);

/// create_staging_file for a writer that fills a directory and renames it onto `final_path`
/// (`fngen synth`): a new, empty directory "<final_path>.partial.<pid>.<random 64-bit hex>" made
/// with mkdir (never an existing one), mode 0777 before the umask. Returns its path; throws
/// fn::Error(Io) "cannot create the staging directory <name> (<reason>)".
std::filesystem::path create_staging_directory(const std::filesystem::path& final_path);

}  // namespace fn

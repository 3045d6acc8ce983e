// fn::Error, the one exception type of fngen, and the FN_CHECK family that raises it.
// Host code throws; main() catches once, logs with the rank prefix and maps the kind to
// the process exit code (docs/design.md "Decisions", errors). No CUDA or MPI here: FN_CUDA_CHECK,
// FN_NCCL_CHECK and FN_MPI_CHECK live in comm/.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace fn {

/// What went wrong, which decides the exit code (exit_code()).
enum class ErrorKind {
  Usage,     ///< bad command line or flag combination (exit 2)
  Io,        ///< a file could not be opened, read or written (exit 3)
  Format,    ///< an input file is malformed or disagrees with the config (exit 3)
  Cuda,      ///< a CUDA runtime call or kernel launch failed (exit 4)
  Nccl,      ///< an NCCL call failed (exit 5)
  Mpi,       ///< an MPI call failed or a peer rank is gone (exit 5)
  Internal,  ///< a broken invariant inside fngen (exit 1)
};

/// The exception every fngen failure travels as. what() is the full message, already naming
/// the file, tensor, rank or flag at fault (a NUL byte in it is written as \x00, so what() is
/// never cut short); where() is the source location that raised it.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message, const char* file = "", int line = 0);
  ErrorKind kind() const noexcept { return kind_; }
  /// "core/safetensors.cpp:88" or "" when unknown.
  const std::string& where() const noexcept { return where_; }
  void set_where(std::string where) { where_ = std::move(where); }
  /// True when every rank of the job raised this same error (agree_on_error() in
  /// core/collectives.h): main() prints it once, on rank 0, and every rank leaves MPI normally
  /// with the kind's exit code (no MPI_Abort).
  bool on_every_rank() const noexcept { return on_every_rank_; }
  void set_on_every_rank() noexcept { on_every_rank_ = true; }

 private:
  ErrorKind kind_;
  std::string where_;
  bool on_every_rank_ = false;
};

/// Process exit code for an error kind: 0 ok, 1 other, 2 usage, 3 input/format, 4 CUDA,
/// 5 communication (docs/cli.md "Errors, exit codes and logs").
int exit_code(ErrorKind kind) noexcept;

/// "usage", "io", "format", "cuda", "nccl", "mpi", "internal".
const char* error_kind_name(ErrorKind kind) noexcept;

namespace detail {
[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line, std::string message);
}  // namespace detail

}  // namespace fn

/// Throws fn::Error of the given kind (an ErrorKind enumerator name) with a fmt message.
#define FN_THROW(kind, ...) \
  ::fn::detail::throw_error(::fn::ErrorKind::kind, __FILE__, __LINE__, ::fmt::format(__VA_ARGS__))

/// Checks an internal invariant: throws fn::Error(Internal) naming the condition.
#define FN_CHECK(cond, ...)                                                           \
  do {                                                                                \
    if (!(cond)) [[unlikely]]                                                         \
      ::fn::detail::throw_error(::fn::ErrorKind::Internal, __FILE__, __LINE__,        \
                                ::fmt::format(__VA_ARGS__) + " [failed: " #cond "]"); \
  } while (0)

/// Checks a property of user input: throws fn::Error of `kind` (Usage, Io, Format, ...)
/// with the message alone (the message names the file/tensor/field/flag at fault).
#define FN_REQUIRE(cond, kind, ...)                                        \
  do {                                                                     \
    if (!(cond)) [[unlikely]]                                              \
      ::fn::detail::throw_error(::fn::ErrorKind::kind, __FILE__, __LINE__, \
                                ::fmt::format(__VA_ARGS__));               \
  } while (0)

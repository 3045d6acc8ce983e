#include "core/error.h"

namespace fn {

Error::Error(ErrorKind kind, std::string message, const char* file, int line)
    : std::runtime_error(std::move(message)), kind_(kind) {
  if (file != nullptr && file[0] != '\0') where_ = fmt::format("{}:{}", file, line);
}

int exit_code(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::Usage:
      return 2;
    case ErrorKind::Io:
      return 3;
    case ErrorKind::Format:
      return 3;
    case ErrorKind::Cuda:
      return 4;
    case ErrorKind::Nccl:
      return 5;
    case ErrorKind::Mpi:
      return 5;
    case ErrorKind::Internal:
      return 1;
  }
  return 1;
}

const char* error_kind_name(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::Usage:
      return "usage";
    case ErrorKind::Io:
      return "io";
    case ErrorKind::Format:
      return "format";
    case ErrorKind::Cuda:
      return "cuda";
    case ErrorKind::Nccl:
      return "nccl";
    case ErrorKind::Mpi:
      return "mpi";
    case ErrorKind::Internal:
      return "internal";
  }
  return "internal";
}

namespace detail {
void throw_error(ErrorKind kind, const char* file, int line, std::string message) {
  throw Error(kind, std::move(message), file, line);
}
}  // namespace detail

}  // namespace fn

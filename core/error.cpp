#include "core/error.h"

namespace fn {

namespace {

// what() is a C string: a NUL inside the message (a hostile file's text quoted in it) would end
// it there, so NUL bytes are written as \x00 (escape_for_log's spelling, core/log.h).
std::string without_nul(std::string message) {
  if (message.find('\0') == std::string::npos) return message;
  std::string out;
  out.reserve(message.size() + 8);
  for (const char c : message) {
    if (c == '\0')
      out += "\\x00";
    else
      out += c;
  }
  return out;
}

}  // namespace

Error::Error(ErrorKind kind, std::string message, const char* file, int line)
    : std::runtime_error(without_nul(std::move(message))), kind_(kind) {
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

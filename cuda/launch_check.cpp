#include "cuda/launch_check.h"

#include "core/error.h"

namespace fn::detail {

void throw_launch_precondition(const char* op, const char* cond, const char* file, int line) {
  throw_error(ErrorKind::Internal, file, line,
              fmt::format("{}: precondition failed: {} ({}:{})", op, cond, file, line));
}

}  // namespace fn::detail
